"""Evaluation results: the result-file schema, the paper-style row, and reading / writing result files.

Dependency-free (no torch, no lm-eval), so tables, reports and model cards can be made from result files on any
machine.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import TokenReductionConfig, setting_text

__all__ = ["OPTIONAL_COLUMNS", "PAPER_ACC", "ROW_COLUMNS", "SCHEMA", "format_row", "load_eval_results",
           "method_label", "paper_row", "result_stem", "save_results"]

SCHEMA = "hf_tokred.eval/1"
SCHEMA_PREFIX = "hf_tokred.eval/"


#: (key, header, kind) of the paper-style row; kind: text | pct | ppl | num | int
ROW_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("model", "Model", "text"),
    ("method", "Method", "text"),
    ("flops_target", "FLOPs target", "pct"),
    ("flops_exact", "FLOPs red. (exact)", "pct"),
    ("flops_proxy", "FLOPs red. (proxy)", "pct"),
    ("lambada_ppl", "LAMBADA PPL", "ppl"),
    ("lambada_acc", "LAMBADA", "pct"),
    ("hellaswag_acc_norm", "HellaSwag", "pct"),
    ("piqa_acc", "PIQA", "pct"),
    ("arc_easy_acc", "Arc-E", "pct"),
    ("arc_challenge_acc_norm", "Arc-C", "pct"),
    ("winogrande_acc", "WinoGrande", "pct"),
    ("avg_acc", "Avg", "pct"),
    ("avg_tasks", "Avg over", "int"),
    ("heldout_suffix_ppl", "Held-out suffix PPL", "ppl"),
    ("heldout_ppl", "Held-out PPL", "ppl"),
    ("heldout_top1_agreement", "Held-out top-1 agr.", "pct"),
    ("heldout_kl", "Held-out KL", "num"),
    ("mqar_acc", "MQAR recall", "pct"),
)

#: accuracy columns of the paper: task -> (lm-eval metric, row key)
PAPER_ACC = {
    "lambada_openai": ("acc", "lambada_acc"),
    "hellaswag": ("acc_norm", "hellaswag_acc_norm"),
    "piqa": ("acc", "piqa_acc"),
    "arc_easy": ("acc", "arc_easy_acc"),
    "arc_challenge": ("acc_norm", "arc_challenge_acc_norm"),
    "winogrande": ("acc", "winogrande_acc"),
}


def method_label(cfg: TokenReductionConfig | dict | None) -> str:
    """``dense``, the method name, or the method with its non-default settings, e.g. ``utrc[metric=l1]``."""
    if cfg is None:
        return "dense"
    cfg = TokenReductionConfig.coerce(cfg)
    short = {"keep_ratio": "keep", "hidden_strategy": "hidden", "residual_strategy": "residual"}
    extra = [f"{short.get(k, k)}={setting_text(v, '-')}" for k, v in cfg.non_default_settings().items()]
    return cfg.method + (f"[{','.join(extra)}]" if extra else "")


def _metric(result: dict, task: str, metric: str) -> float:
    t = result.get("tasks", {}).get(task)
    if not t or t.get("status") != "ok":
        return float("nan")
    v = t.get("metrics", {}).get(metric)
    return float(v) if isinstance(v, (int, float)) else float("nan")


def paper_row(result: dict) -> dict[str, Any]:
    """The paper-style row of one result (accuracies as fractions; NaN where a task was not run / missing)."""
    row: dict[str, Any] = {
        "model": result.get("model"),
        "method": result.get("method"),
        "flops_target": result.get("flops_target"),
        "flops_exact": result.get("flops", {}).get("exact", float("nan")),
        "flops_proxy": result.get("flops", {}).get("proxy", float("nan")),
        "lambada_ppl": _metric(result, "lambada_openai", "perplexity"),
    }
    accs = []
    for task, (metric, key) in PAPER_ACC.items():
        row[key] = _metric(result, task, metric)
        if not math.isnan(row[key]):
            accs.append(row[key])
    row["avg_acc"] = sum(accs) / len(accs) if accs else float("nan")
    row["avg_tasks"] = len(accs)
    row["heldout_suffix_ppl"] = _metric(result, "boolq_heldout_suffix", "token_perplexity")
    row["heldout_ppl"] = _metric(result, "boolq_heldout_ppl", "token_perplexity")
    fid = result.get("fidelity") or {}
    row["heldout_top1_agreement"] = fid.get("top1_agreement", float("nan"))
    row["heldout_kl"] = fid.get("kl_mean", float("nan"))
    row["mqar_acc"] = _metric(result, "mqar", "acc")
    return row


def _fmt(value, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}"
    if kind == "ppl":
        return f"{value:.2f}"
    if kind == "num":
        return f"{value:.4f}"
    if kind == "int":
        return str(int(value))
    return str(value)


#: columns shown only when some row has a value (the paper's columns are always shown)
OPTIONAL_COLUMNS = ("heldout_suffix_ppl", "heldout_ppl", "heldout_top1_agreement", "heldout_kl", "mqar_acc")


def _empty(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def format_row(rows: dict | Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """A markdown table (header + one line per row); percentages for accuracies and FLOPs.

    ``columns`` (keys of :data:`ROW_COLUMNS`) defaults to the paper's columns plus the optional columns that
    have a value in some row.
    """
    rows = [rows] if isinstance(rows, dict) else list(rows)
    if columns is None:
        columns = [k for k, _, _ in ROW_COLUMNS
                   if k not in OPTIONAL_COLUMNS or any(not _empty(r.get(k)) for r in rows)]
    cols = [c for c in ROW_COLUMNS if c[0] in columns]
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(k), kind) for k, _, kind in cols) + " |")
    return "\n".join(lines)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=_-]+", "-", str(text)).strip("-") or "x"


def result_stem(result: dict) -> str:
    target = result.get("flops_target") or 0.0
    return _slug(f"eval_{result['model']}_{result['method']}_flops{100 * target:.4g}")


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def save_results(result: dict, output: str | os.PathLike) -> dict[str, Path]:
    """Write ``<output>/<stem>.json`` (everything; NaN as null) and ``<stem>.csv`` (the paper-style row)."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem(result)
    paths = {"json": out / f"{stem}.json", "csv": out / f"{stem}.csv"}
    result = {**result, "files": {k: str(v) for k, v in paths.items()}}
    paths["json"].write_text(json.dumps(_json_safe(result), indent=1, sort_keys=False) + "\n")
    row = paper_row(result)
    with paths["csv"].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([k for k, _, _ in ROW_COLUMNS])
        w.writerow(["" if (isinstance(row[k], float) and math.isnan(row[k])) or row[k] is None else row[k]
                    for k, _, _ in ROW_COLUMNS])
    return paths


def load_eval_results(eval_results: Any) -> dict[str, Any]:
    """A result dict written by ``hf-tokred eval`` (path or dict), checked to be one."""
    if isinstance(eval_results, (str, os.PathLike)):
        path = Path(eval_results)
        if not path.is_file():
            raise FileNotFoundError(f"eval results file {str(path)!r} does not exist")
        try:
            eval_results = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{str(path)!r} is not JSON: {err}") from None
    if not isinstance(eval_results, dict) or not str(eval_results.get("schema", "")).startswith(SCHEMA_PREFIX) \
            or not isinstance(eval_results.get("row"), dict):
        raise ValueError("eval results must be a result JSON written by `hf-tokred eval` (schema "
                         f"{SCHEMA_PREFIX}1, with a 'row' dict)")
    return eval_results
