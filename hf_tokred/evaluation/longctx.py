"""Long-context evaluation, offline, for any model: recall by prompt length and depth, per method, with intervals.

Tasks:

* ``mqar`` -- multi-query associative recall (:mod:`.mqar`) stretched to each length with more filler, the key-value
  block after ``depth`` of the filler; the queries are the question (never reduced).  Needs a recall model
  (``config.mqar``, e.g. ``bundled:recall-mamba2``).  Per row: the share of queries answered.
* ``passkey`` -- a needle in a haystack (:mod:`.passkey`), the question and answer kept as the question.  Needs a
  text tokenizer.  Per row: 1 when greedy decoding would write the key.
* ``position_ppl`` -- perplexity at a position (the PG-19 experiment of DeciMamba / LongMamba, on held-out text):
  each row is ``length`` consecutive tokens of the held-out passages run together, and its last
  :data:`PPL_SUFFIX` tokens are scored (kept as the question, so every method is scored at the same positions,
  each given the whole document before it).  Needs a text tokenizer and the held-out texts.  Per row: the mean
  NLL of the scored tokens; a cell is the perplexity ``exp`` of the mean over rows (interval likewise).  Depth
  has no meaning here: one cell per length.

Every method sees exactly the same rows (same seed), dense included; each cell is the mean over rows with a 95 %
percentile bootstrap interval over rows, and the FLOPs the method saved on those rows (from the plans that ran; the
LM head counted at the positions whose logits were computed, the same for every method).
:func:`grid` returns records; :func:`format_table`, :func:`plot` and :func:`save` present them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..settings import apply_token_reduction
from .meter import FlopsMeter
from .mqar import make_batch
from .passkey import PasskeySettings, make_passkey_batch, passkey_hits
from .quality import bootstrap_ci

__all__ = ["EVAL_SEED", "LONG_TASKS", "PPL_SUFFIX", "document_rows", "format_table", "grid", "pct", "plot", "save"]

EVAL_SEED = 1_000_000
LONG_TASKS = ("mqar", "passkey", "position_ppl")
#: tasks scored by accuracy (the rest: perplexity)
RECALL_TASKS = ("mqar", "passkey")
ALL_DEPTHS = "all"
#: ``position_ppl`` scores the last this many tokens of each row
PPL_SUFFIX = 32


def _mqar_rows(model, settings, length: int, depth: float, n: int, seed: int):
    """``(input_ids, question_length, score)`` where ``score(logits, rows) -> [rows]`` per-row recall."""
    s = replace(settings, seq_len=length)
    b = make_batch(s, n, seed, depth=depth)
    question = torch.full((n,), 2 * s.num_queries)

    def score(logits, rows):  # logits of the last positions
        return (logits[:, b.query_positions - length + logits.shape[1]].argmax(-1) == b.answers[rows]).float().mean(1)
    return b.input_ids, question, score


def _passkey_rows(tokenizer, settings: PasskeySettings, texts, length: int, depth: float, n: int, seed: int):
    b = make_passkey_batch(tokenizer, replace(settings, seq_len=length), n, seed, depth=depth, texts=texts)

    def score(logits, rows):
        sub = replace(b, labels=b.labels[rows])
        return passkey_hits(logits, sub).float()
    return b.input_ids, b.question_length, score


def document_rows(stream: Sequence[int], length: int, n: int) -> torch.Tensor:
    """``[n, length]``: windows of a token stream, spread evenly over it (overlapping only when ``n * length``
    exceeds the stream)."""
    if len(stream) < length:
        raise ValueError(f"the held-out text has {len(stream)} tokens, fewer than --lengths {length}; use shorter "
                         f"lengths")
    stride = (len(stream) - length) // max(1, n - 1)
    return torch.tensor([list(stream[i * stride:i * stride + length]) for i in range(n)])


def _ppl_rows(stream: Sequence[int], length: int, n: int):
    ids = document_rows(stream, length, n)
    question = torch.full((n,), PPL_SUFFIX + 1)  # the scored tokens and the one whose logits predict the first

    def score(logits, rows):
        logp = F.log_softmax(logits[:, -PPL_SUFFIX - 1:-1].float(), -1)
        return -logp.gather(-1, ids[rows, -PPL_SUFFIX:, None])[..., 0].mean(1)
    return ids, question, score


def _logits_kept(question: torch.Tensor) -> int:
    """The last positions whose logits a task reads: its question and the token before it."""
    return int(question.max()) + 1


@torch.no_grad()
def _run(model, ids, question, score, batch_size: int, meter: FlopsMeter, group: str) -> list[float]:
    device = next(model.parameters()).device
    per_row, keep = [], _logits_kept(question)
    for i in range(0, len(ids), batch_size):
        rows = slice(i, i + batch_size)
        out = model(ids[rows].to(device), question_length=question[rows].to(device), use_cache=False,
                    logits_to_keep=keep)
        logits = out.logits.float().cpu()
        per_row += score(logits, rows).tolist()
        meter.add_forward(group, out, [ids.shape[1]] * logits.shape[0])
    return per_row


def _cell(task, method, length, depth, values, flops) -> dict[str, Any]:
    """Accuracy (recall tasks) or perplexity (``exp`` of the mean NLL, interval likewise) over the rows."""
    est, lo, hi = bootstrap_ci(values)
    metric = "accuracy" if task in RECALL_TASKS else "perplexity"
    if metric == "perplexity":
        est, lo, hi = math.exp(est), math.exp(lo), math.exp(hi)
    return {"task": task, "method": method, "length": length, "depth": depth, "metric": metric, "score": est,
            "ci": [lo, hi], "n": len(values), "flops_saved": flops}


def grid(model, tokenizer, tasks: Sequence[str], lengths: Sequence[int], depths: Sequence[float],
         methods: Mapping[str, Any], n: int = 64, seed: int = EVAL_SEED, batch_size: int = 8,
         mqar_settings=None, passkey: PasskeySettings = PasskeySettings(), texts: Sequence[str] | None = None,
         progress: Callable[[dict], None] | None = None) -> list[dict[str, Any]]:
    """One record per (task, method, length, depth), plus a pooled ``depth="all"`` record per (task, method,
    length) (``position_ppl``: the ``"all"`` record only).  ``methods`` maps a row name to a TokenReductionConfig
    (``None``: dense); each is applied in turn, so the model ends with the last one applied.  ``texts``: the
    natural haystack's passages (passkey) and the documents of ``position_ppl``."""
    records = []
    for task in tasks:
        stream = tokenizer("\n\n".join(texts))["input_ids"] if task == "position_ppl" else None
        for length in lengths:
            if task == "position_ppl":
                batches = {ALL_DEPTHS: _ppl_rows(stream, length, n)}
            elif task == "mqar":
                batches = {d: _mqar_rows(model, mqar_settings, length, d, n, seed) for d in depths}
            else:
                batches = {d: _passkey_rows(tokenizer, passkey, texts, length, d, n, seed) for d in depths}
            for name, cfg in methods.items():
                apply_token_reduction(model, cfg)
                # the LM head runs on the question's positions only, dense and reduced alike
                keep = max(_logits_kept(question) for _, question, _ in batches.values())
                meter, pooled = FlopsMeter(model.config, lm_head_positions=keep), []
                for depth, (ids, question, score) in batches.items():
                    values = _run(model, ids, question, score, batch_size, meter, str(depth))
                    pooled += values
                    rec = _cell(task, name, length, depth, values, meter.summary([str(depth)])["exact"])
                    if depth != ALL_DEPTHS:
                        records.append(rec)
                    if progress is not None:
                        progress(rec)
                records.append(_cell(task, name, length, ALL_DEPTHS, pooled, meter.summary()["exact"]))
    return records


def pct(rec: Mapping[str, Any]) -> str:
    """A cell: ``est [low, high]`` (recall in %, perplexity as it is)."""
    lo, hi = rec["ci"]
    if rec["metric"] == "perplexity":
        return f"{rec['score']:.2f} [{lo:.2f}, {hi:.2f}]"
    return f"{100 * rec['score']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def _depth(depth) -> str:
    return depth if isinstance(depth, str) else f"{depth:g}"


def format_table(records: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table: one row per (task, method, depth), one column per length (recall in %, or perplexity),
    then a FLOPs-saved row per (task, method)."""
    lengths = sorted({r["length"] for r in records})
    head = "| task | method | depth | " + " | ".join(f"{n:,} tokens" for n in lengths) + " |"
    lines = [head, "|" + "---|" * (3 + len(lengths))]
    keys = list(dict.fromkeys((r["task"], r["method"]) for r in records))
    for task, method in keys:
        mine = [r for r in records if (r["task"], r["method"]) == (task, method)]
        depths = list(dict.fromkeys(r["depth"] for r in mine))
        for depth in depths:
            cells = {r["length"]: pct(r) for r in mine if r["depth"] == depth}
            lines.append(f"| {task} | {method} | {_depth(depth)} | " + " | ".join(cells.get(n, "") for n in lengths) + " |")
        saved = {r["length"]: f"{100 * r['flops_saved']:.1f} %" for r in mine if r["depth"] == ALL_DEPTHS}
        lines.append(f"| {task} | {method} | FLOPs saved | " + " | ".join(saved.get(n, "") for n in lengths) + " |")
    return "\n".join(lines)


def plot(records: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Accuracy (pooled over depths) or perplexity, with its interval, against prompt length: one line per method,
    one panel per task."""
    from matplotlib.figure import Figure  # optional dependency (the eval extra), as in .report

    pooled = [r for r in records if r["depth"] == ALL_DEPTHS]
    tasks = list(dict.fromkeys(r["task"] for r in pooled))
    fig = Figure(figsize=(5 * len(tasks), 3.6))
    axes = fig.subplots(1, len(tasks), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for method in dict.fromkeys(r["method"] for r in pooled if r["task"] == task):
            rs = sorted((r for r in pooled if (r["task"], r["method"]) == (task, method)), key=lambda r: r["length"])
            unit = 100 if rs[0]["metric"] == "accuracy" else 1
            x = [r["length"] for r in rs]
            y = [unit * r["score"] for r in rs]
            err = [[unit * (r["score"] - r["ci"][0]) for r in rs], [unit * (r["ci"][1] - r["score"]) for r in rs]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens)")
        if task in RECALL_TASKS:
            ax.set_ylabel(f"{task} accuracy (%), all depths")
            ax.set_ylim(0, 102)
        else:
            ax.set_ylabel(f"perplexity of the last {PPL_SUFFIX} tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path


def save(records: Sequence[Mapping[str, Any]], folder: str | Path, meta: Mapping[str, Any]) -> dict[str, Path]:
    """``longctx.json`` (settings + records), ``longctx.md`` (the table) and ``longctx.png`` (the plot, when
    matplotlib is installed) in ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = {"json": folder / "longctx.json", "table": folder / "longctx.md", "plot": folder / "longctx.png"}
    files["json"].write_text(json.dumps({"meta": dict(meta), "records": list(records)}, indent=1) + "\n")
    files["table"].write_text(format_table(records) + "\n")
    try:
        plot(records, files["plot"], title=str(meta.get("model", "")))
    except ImportError:  # matplotlib (the eval extra) is optional: the caller says the plot is missing
        del files["plot"]
    return files
