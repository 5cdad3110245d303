"""Evaluation of token-reduced Mamba / Mamba-2 models: offline data, an lm-eval harness, reports.

* :mod:`.data` -- fetch the offline validation splits (``hf-tokred data``), the held-out BoolQ split rule;
* :mod:`.harness` -- :func:`evaluate_model` runs lm-eval 0.4.13 with position-correct scoring
  (``hf-tokred eval``);
* :mod:`.report` -- markdown table + plot from result files (``hf-tokred report``);
* :mod:`.cli` -- the three subcommands (``add_parser``).

lm-eval and matplotlib are optional dependencies (``pip install 'hf-tokred[eval]'``); they are imported
only when an evaluation or a plot runs.  Names below are imported lazily.
"""

import importlib

_EXPORTS = {
    "DataFetchError": "data",
    "DataMissingError": "data",
    "fetch_data": "data",
    "find_data": "data",
    "heldout_passages": "data",
    "is_heldout": "data",
    "DEFAULT_TASKS": "harness",
    "UncomputedPositionError": "harness",
    "evaluate_model": "harness",
    "format_row": "harness",
    "heldout_fidelity": "harness",
    "lm_class": "harness",
    "paper_row": "harness",
    "save_results": "harness",
    "load_results": "report",
    "make_report": "report",
    "markdown_table": "report",
    "plot_results": "report",
}

__all__ = [  # noqa: RUF022 (grouped by module, like _EXPORTS)
    "DataFetchError",
    "DataMissingError",
    "fetch_data",
    "find_data",
    "heldout_passages",
    "is_heldout",
    "DEFAULT_TASKS",
    "UncomputedPositionError",
    "evaluate_model",
    "format_row",
    "heldout_fidelity",
    "lm_class",
    "paper_row",
    "save_results",
    "load_results",
    "make_report",
    "markdown_table",
    "plot_results",
]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
