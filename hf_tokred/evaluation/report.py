"""Tables and plots from ``hf-tokred eval`` result files.

:func:`make_report` reads result JSONs (files or folders), writes a markdown table with one row per
model x method x FLOPs level (the paper-style columns) and a PNG plotting a metric (default: average
accuracy, or the held-out suffix perplexity when no accuracy was measured) against the measured FLOPs
reduction, one line per method, with each model's dense result as every method's 0 % point.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .results import ROW_COLUMNS, SCHEMA, format_row, paper_row

__all__ = ["X_AXES", "load_results", "make_report", "markdown_table", "plot_results", "report_rows"]

#: x-axis choices: key in the paper-style row
X_AXES = {"exact": "flops_exact", "proxy": "flops_proxy", "target": "flops_target"}
_LABELS = {k: h for k, h, _ in ROW_COLUMNS}
_KIND = {k: kind for k, _, kind in ROW_COLUMNS}


def _nan(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def load_results(inputs: Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """Result dicts from files and folders (folders: every ``*.json`` below them with the eval schema)."""
    results = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*.json") if "lm_eval_tasks" not in p.parts)
            explicit = False
        elif path.is_file():
            files, explicit = [path], True
        else:
            raise FileNotFoundError(f"no such result file or folder: {path}")
        for f in files:
            try:
                data = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError) as err:
                if explicit:
                    raise ValueError(f"{f} is not a readable JSON result file: {err}") from None
                continue
            if not isinstance(data, dict) or data.get("schema") != SCHEMA:
                if explicit:
                    raise ValueError(f"{f} is not an hf-tokred eval result (schema {SCHEMA!r})")
                continue
            data["_path"] = str(f)
            results.append(data)
    return results


def _level(result: dict) -> float:
    v = result.get("flops_target")
    return 0.0 if _nan(v) else round(float(v), 6)


def report_rows(results: Sequence[dict]) -> list[dict[str, Any]]:
    """Paper-style rows, one per model x method x FLOPs level (the newest result wins), sorted."""
    best: dict[tuple, dict] = {}
    for r in results:
        key = (r.get("model"), r.get("method"), _level(r))
        if key in best:
            print(f"hf-tokred report: {key} appears twice; keeping the newer of {best[key].get('_path')} and "
                  f"{r.get('_path')}", file=sys.stderr)
            if str(r.get("created", "")) < str(best[key].get("created", "")):
                continue
        best[key] = r
    keys = sorted(best, key=lambda k: (str(k[0]), k[1] != "dense", str(k[1]), k[2]))
    rows = []
    for k in keys:
        row = paper_row(best[k])
        row["_missing"] = [t for t, e in best[k].get("tasks", {}).items() if e.get("status") != "ok"]
        rows.append(row)
    return rows


def markdown_table(results: Sequence[dict]) -> str:
    """The markdown table (paper columns always; held-out columns only where some row has a value)."""
    return format_row(report_rows(results))


def _default_y(rows: Sequence[dict]) -> str:
    for key in ("avg_acc", "heldout_suffix_ppl", "heldout_ppl", "lambada_ppl"):
        if any(not _nan(r.get(key)) for r in rows):
            return key
    return "avg_acc"


def plot_results(results: Sequence[dict], path: str | os.PathLike, y: str | None = None, x: str = "exact") -> Path:
    """PNG of ``y`` (a row key, e.g. ``avg_acc``, ``heldout_suffix_ppl``) against the FLOPs reduction.

    One panel per model, one line per method; a model's dense result is every method's 0 % point.
    Perplexities spanning more than 5x use a log scale.  Rendered with matplotlib's Agg canvas (no display needed).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if x not in X_AXES:
        raise ValueError(f"x must be one of {', '.join(X_AXES)}, got {x!r}")
    rows = report_rows(results)
    y = y or _default_y(rows)
    if rows and y not in rows[0]:
        raise ValueError(f"unknown metric {y!r}; choose one of {', '.join(k for k in rows[0] if not k.startswith('_'))}")
    xkey = X_AXES[x]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig = Figure(figsize=(5.5 * max(1, len(models)), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, max(1, len(models)), squeeze=False)[0]
    pct_y = _KIND.get(y) == "pct"
    for ax, model in zip(axes, models or [""]):
        mine = [r for r in rows if r["model"] == model]
        dense = next((r for r in mine if r["method"] == "dense"), None)
        methods = list(dict.fromkeys(r["method"] for r in mine if r["method"] != "dense"))
        for method in methods:
            pts = [(0.0, dense[y])] if dense is not None and not _nan(dense[y]) else []
            pts += [(r[xkey], r[y]) for r in mine if r["method"] == method and not _nan(r[y]) and not _nan(r[xkey])]
            pts.sort()
            if pts:
                ax.plot([100 * p[0] for p in pts], [100 * p[1] if pct_y else p[1] for p in pts], marker="o", label=method)
        if not methods and dense is not None and not _nan(dense[y]):
            ax.plot([0.0], [100 * dense[y] if pct_y else dense[y]], marker="o", label="dense")
        values = [v for line in ax.get_lines() for v in line.get_ydata()]
        if _KIND.get(y) == "ppl" and values and min(values) > 0 and max(values) / min(values) > 5:
            ax.set_yscale("log")  # perplexities explode under heavy reduction
        ax.set_title(str(model))
        ax.set_xlabel(f"{_LABELS.get(xkey, xkey)} (%)")
        ax.set_ylabel(_LABELS.get(y, y) + (" (%)" if pct_y else ""))
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _output_paths(output: str | os.PathLike) -> tuple[Path, Path]:
    out = Path(output)
    if out.suffix.lower() in (".md", ".png"):
        return out.with_suffix(".md"), out.with_suffix(".png")
    return out / "report.md", out / "report.png"


def make_report(inputs: Iterable[str | os.PathLike], output: str | os.PathLike = "report", y: str | None = None,
                x: str = "exact") -> tuple[Path, Path]:
    """Write the markdown table and the plot; returns ``(markdown_path, png_path)``.

    ``output``: a folder (gets ``report.md`` + ``report.png``) or a ``.md``/``.png`` path (both files share
    its stem).
    """
    results = load_results(inputs)
    if not results:
        raise ValueError("no hf-tokred eval result files found in the given inputs")
    md_path, png_path = _output_paths(output)
    rows = report_rows(results)
    y = y or _default_y(rows)
    plot_results(results, png_path, y=y, x=x)
    notes = [
        ("Accuracies in %: acc for LAMBADA, PIQA, Arc-E, WinoGrande; acc_norm for HellaSwag, Arc-C. "
         "Avg = mean of the accuracies present (\"Avg over\" = how many)."),
        ("FLOPs red. (exact) = 1 - analytic FLOPs (hf_tokred.flops) of the forwards that ran / dense; "
         "(proxy) = the paper's 1 - mean fraction of tokens per layer; both measured on the evaluated sequences, "
         "with the scored positions protected."),
        "Held-out columns: BoolQ passages whose sha1 starts with c-f (never trained on); KL in nats.",
    ]
    for r in rows:
        if r["_missing"]:
            notes.append(f"{r['model']} / {r['method']}: missing {', '.join(r['_missing'])} (not available; "
                         "shown as '-', nothing substituted).")
    text = ["# hf-tokred evaluation report", "", markdown_table(results), "",
            *[f"* {n}" for n in notes], "", f"![{_LABELS.get(y, y)} vs FLOPs reduction]({png_path.name})", ""]
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text("\n".join(text))
    return md_path, png_path
