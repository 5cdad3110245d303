#!/usr/bin/env python
"""The quality table: every method at 10 / 20 / 30 % FLOPs on the bundled models, with 95 % bootstrap intervals.

Language models (``bundled:mamba``, ``bundled:mamba2``): held-out BoolQ passages (never trained on), the last 32
tokens of each protected and scored; suffix perplexity, top-1 agreement and KL(dense || reduced) at exactly those
positions.  Recall models (``bundled:recall-mamba``, ``bundled:recall-mamba2``): MQAR accuracy at the (protected)
query positions, with anchors at blocks 0-3 (see RECALL_ANCHORS).  Every row also has the exact FLOPs reduction
measured on the sequences evaluated (analytic, per row, LM head on every computed position) and the paper's proxy.

    python examples/quality_table.py --out results/quality                  # everything (resumable)
    python examples/quality_table.py --out runs/q --passages 20 --sequences 64 --levels 0.2   # quick look
    python examples/quality_table.py --report results/quality               # table + plot from the JSON files

One JSON file per (model, method, level) in ``--out``; existing files are kept (delete one to redo it).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

import hf_tokred
from hf_tokred import TokenReductionConfig
from hf_tokred.evaluation import data
from hf_tokred.models import BUNDLED
from hf_tokred.evaluation.meter import FlopsMeter
from hf_tokred.evaluation.quality import context_benefit, fidelity, mqar_accuracy, passage_ids, suffix_scores
from hf_tokred.evaluation.runner import mqar_settings

#: name -> settings (besides the FLOPs level); the paper's method, the authors' code, the baselines, ours
METHODS = {
    "utrc": {"method": "utrc"},
    "utrc_reference": {"method": "utrc_reference"},
    "evit": {"method": "evit"},
    "tome": {"method": "tome"},
    "prune_only": {"method": "prune_only"},
    "merge_only": {"method": "merge_only"},
    "evit_delta": {"method": "evit", "metric": "delta"},
    "evit_recent": {"method": "evit", "protect_recent": 0.25},
    "evit_delta_recent": {"method": "evit", "metric": "delta", "protect_recent": 0.25},
    "utrc_delta": {"method": "utrc", "metric": "delta"},
    "utrc_frozen": {"method": "utrc_frozen"},
    "front_prune": {"method": "front_prune"},
}
#: the recall models run 8 blocks; the paper's rule anchors them at blocks 2-5, after the models have already moved
#: the key-value information to later positions (every method then keeps recall), so they reduce from block 0
RECALL_ANCHORS = [0, 1, 2, 3]
LM_MODELS = ("mamba", "mamba2")
RECALL_MODELS = ("recall-mamba", "recall-mamba2")


def _measured(model, run):
    """Run ``run()`` recording what reduction did; returns (its result, a FlopsMeter of the forwards)."""
    meter = FlopsMeter(model.config)
    with hf_tokred.record_reduction() as records:
        out = run()
    for r in records:
        meter.add("all", r.layer_lengths, r.input_lengths)
    return out, meter


def _flops_fields(meter: FlopsMeter, reducing: bool) -> dict:
    if not reducing:
        return {"flops_exact": 0.0, "flops_proxy": 0.0}
    s = meter.summary()
    return {"flops_exact": s["exact"], "flops_proxy": s["proxy"]}


def lm_rows(name: str, args, done) -> None:
    model, tok = hf_tokred.load_model(f"bundled:{name}", token_reduction=None)
    seqs = passage_ids(tok, data.heldout_passages(), 96)[: args.passages]
    if not done.context_path(name).is_file():  # does the model use its context? (issue 12: >= 15 % wanted)
        benefit = context_benefit(model, seqs, suffix=32, batch_size=args.batch)
        done.context_path(name).write_text(json.dumps({"model": f"bundled:{name}", "passages": len(seqs),
                                                       **benefit}, indent=1) + "\n")
        print(f"context benefit of bundled:{name}: {json.dumps(benefit)}", flush=True)
    dense = suffix_scores(model, seqs, suffix=32, batch_size=args.batch)
    ppl = math.exp(sum(dense.nll) / sum(dense.tokens))
    done(name, "dense", 0.0, {"suffix_ppl": [ppl, ppl, ppl], "top1_agreement": [1.0, 1.0, 1.0], "kl": [0, 0, 0],
                              "passages": len(seqs), "flops_exact": 0.0, "flops_proxy": 0.0})
    for method, settings in METHODS.items():
        for level in args.levels:
            if done.exists(name, method, level):
                continue
            hf_tokred.apply_token_reduction(model, TokenReductionConfig(flops_reduction=level, **settings))
            scores, meter = _measured(model, lambda: suffix_scores(model, seqs, suffix=32, batch_size=args.batch))
            row = fidelity(dense, scores)
            done(name, method, level, {**{k: list(v) if isinstance(v, tuple) else v for k, v in row.items()},
                                       **_flops_fields(meter, True)})
    hf_tokred.apply_token_reduction(model, None)


def recall_rows(name: str, args, done) -> None:
    model, _ = hf_tokred.load_model(f"bundled:{name}", token_reduction=None)
    settings = mqar_settings(model)
    dense = mqar_accuracy(model, settings, n=args.sequences)
    done(name, "dense", 0.0, {"mqar_acc": list(dense["accuracy"]), "sequences": dense["sequences"],
                              "flops_exact": 0.0, "flops_proxy": 0.0})
    for method, extra in METHODS.items():
        for level in args.levels:
            if done.exists(name, method, level):
                continue
            hf_tokred.apply_token_reduction(model, TokenReductionConfig(flops_reduction=level, anchors=RECALL_ANCHORS,
                                                                        **extra))
            result, meter = _measured(model, lambda: mqar_accuracy(model, settings, n=args.sequences))
            done(name, method, level, {"mqar_acc": list(result["accuracy"]), "sequences": result["sequences"],
                                       "anchors": RECALL_ANCHORS,
                                       "mqar_vs_dense": result["accuracy"][0] / max(dense["accuracy"][0], 1e-9),
                                       **_flops_fields(meter, True)})
    hf_tokred.apply_token_reduction(model, None)


class Store:
    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)

    def path(self, model, method, level) -> Path:
        return self.out / f"{model}__{method}__{level:g}.json"

    def context_path(self, model) -> Path:
        return self.out / f"{model}__context.txt"

    def exists(self, model, method, level) -> bool:
        return self.path(model, method, level).is_file()

    def __call__(self, model, method, level, row) -> None:
        row = {"model": f"bundled:{model}", "method": method, "flops_target": level,
               "settings": METHODS.get(method), **row, "created": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.path(model, method, level).write_text(json.dumps(row, indent=1) + "\n")
        print(json.dumps({k: row[k] for k in row if k not in ("settings", "created")}), flush=True)


def _cell(v, pct=True) -> str:
    if v is None:
        return "-"
    est, lo, hi = v
    return f"{100 * est:.1f} ({100 * lo:.1f}–{100 * hi:.1f})" if pct else f"{est:.1f} ({lo:.1f}–{hi:.1f})"


def summary(folder: Path, levels=(0.2, 0.3)) -> str:
    """One line per method: the headline measure of each model at each level (top-1 agreement with dense for the
    language models, MQAR accuracy relative to dense for the recall models), estimate and 95 % interval."""
    rows = {(r["model"], r["method"], r["flops_target"]): r for r in
            (json.loads(p.read_text()) for p in sorted(folder.glob("*.json")))}
    models = [m for m in (*LM_MODELS, *RECALL_MODELS) if (f"bundled:{m}", "dense", 0.0) in rows]
    head = [f"{m} {100 * lv:.0f} %" for m in models for lv in levels]
    lines = ["| method | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for method in METHODS:
        cells = []
        for m in models:
            dense = rows[(f"bundled:{m}", "dense", 0.0)]
            for lv in levels:
                r = rows.get((f"bundled:{m}", method, lv))
                if r is None:
                    cells.append("-")
                elif "top1_agreement" in r:
                    cells.append(_cell(r["top1_agreement"]))
                else:  # relative to the dense model's accuracy
                    cells.append(_cell([v / dense["mqar_acc"][0] for v in r["mqar_acc"]]))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(folder: Path) -> str:
    rows = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    lines = ["| model | method | FLOPs target | FLOPs exact / proxy | suffix top-1 agr. % | suffix KL | suffix PPL | "
             "MQAR acc. % |", "|---|---|---|---|---|---|---|---|"]
    order = {m: i for i, m in enumerate(["dense", *METHODS])}
    for r in sorted(rows, key=lambda r: (r["model"], r["flops_target"], order.get(r["method"], 99))):
        kl = r.get("kl")
        lines.append(
            f"| {r['model']} | {r['method']} | {100 * r['flops_target']:.0f} % | "
            f"{100 * r['flops_exact']:.1f} / {100 * r['flops_proxy']:.1f} | {_cell(r.get('top1_agreement'))} | "
            f"{'-' if kl is None else f'{kl[0]:.4f} ({kl[1]:.4f}–{kl[2]:.4f})'} | "
            f"{_cell(r.get('suffix_ppl'), pct=False)} | {_cell(r.get('mqar_acc'))} |")
    lines += ["", "Context benefit (suffix perplexity of the last 32 tokens with 8 / 32 / 128 / all tokens of context; "
              "benefit = 1 - ppl(all) / ppl(32)):", "",
              "| model | passages | ctx 8 | ctx 32 | ctx 128 | all | benefit |", "|---|---|---|---|---|---|---|"]
    for p in sorted(folder.glob("*__context.txt")):
        c = json.loads(p.read_text())
        lines.append(f"| {c['model']} | {c['passages']} | " + " | ".join(_cell(c[k], pct=False) for k in
                                                                          ("8", "32", "128", "all"))
                     + f" | {100 * c['benefit_all_vs_32']:.1f} % |")
    return "\n".join(lines)


def plot(folder: Path, dest: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    have = {r["model"] for r in rows}
    panels = [(key, m, title) for key, models, title in
              [("top1_agreement", LM_MODELS, "suffix top-1 agreement with dense"),
               ("mqar_acc", RECALL_MODELS, "MQAR recall accuracy")] for m in models if f"bundled:{m}" in have]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4.2), squeeze=False)
    for ax, (key, name, title) in zip(axes[0], panels):
        for method in ["utrc", "utrc_reference", "evit", "evit_recent", "tome", "utrc_frozen", "front_prune"]:
            pts = sorted((r["flops_exact"], r[key]) for r in rows if r["model"] == f"bundled:{name}"
                         and r["method"] in (method, "dense") and r.get(key))
            if pts:
                ax.errorbar([100 * x for x, _ in pts], [100 * v[0] for _, v in pts],
                            yerr=[[100 * (v[0] - v[1]) for _, v in pts], [100 * (v[2] - v[0]) for _, v in pts]],
                            marker="o", capsize=3, label=method)
        ax.set_title(f"bundled:{name}")
        ax.set_xlabel("FLOPs reduction measured (%)")
        ax.set_ylabel(f"{title} (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/quality")
    ap.add_argument("--models", default=",".join(m for m in LM_MODELS + RECALL_MODELS if m in BUNDLED))
    ap.add_argument("--levels", default="0.1,0.2,0.3")
    ap.add_argument("--passages", type=int, default=200, help="held-out passages (language models)")
    ap.add_argument("--sequences", type=int, default=512, help="MQAR sequences (recall models)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--report", default=None, metavar="DIR", help="only write DIR/report.md + report.png")
    args = ap.parse_args(argv)
    if args.report:
        folder = Path(args.report)
        (folder / "report.md").write_text("Summary (language models: suffix top-1 agreement with dense, %; recall "
                                          "models: MQAR accuracy as % of dense):\n\n" + summary(folder)
                                          + "\n\nEvery row:\n\n" + report(folder) + "\n")
        plot(folder, folder / "report.png")
        print((folder / "report.md").read_text())
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    args.levels = [float(x) for x in args.levels.split(",")]
    store = Store(Path(args.out))
    for name in args.models.split(","):
        (recall_rows if name.startswith("recall") else lm_rows)(name, args, store)


if __name__ == "__main__":
    main()
