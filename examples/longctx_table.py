#!/usr/bin/env python
"""The long-context table of docs/long-prompts.md: every bundled recall and passkey model at 1x, 8x and 16x the
length it was trained on, the key-value block / needle at depths 0, 0.5 and 1, the dense model beside each method
at a token budget equal to the training length, on two seeds of rows (the evaluation seed 1,000,000 and 7; no
test uses either).  Passkey models are run on both haystacks.

Each run is what ``hf-tokred eval --tasks mqar|passkey --lengths ... --depths ... --methods ...`` writes (one folder
per model, haystack and seed: longctx.json / .md / .png), and ``summary.md`` checks the target: each method's
accuracy (pooled over depths) as a share of the dense model's at the training length, at 8x and 16x, and the
prefill FLOPs it saved at 16x.

    python examples/longctx_table.py --out results/longctx            # about an hour on 2 CPU cores
    python examples/longctx_table.py --out runs/lc --models recall-mamba2-anydepth --rows 16 --seeds 7
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hf_tokred import TokenReductionConfig
from hf_tokred.bundled_models import BUNDLED
from hf_tokred.evaluation import data
from hf_tokred.evaluation.longctx import ALL_DEPTHS, EVAL_SEED, grid, save
from hf_tokred.evaluation.passkey import PasskeySettings
from hf_tokred.evaluation.runner import mqar_settings
from hf_tokred.models import load_model

METHODS = ("prefilter", "front_prune")
SEEDS = (EVAL_SEED, 7)
#: the target: a share of in-distribution dense accuracy at 8x and at 16x, and the FLOPs saved at 16x
TARGET = {8: 0.95, 16: 0.90, "flops": 0.80}


def runs(name: str) -> list[tuple[str, str, int]]:
    """``(task, haystack, training length)`` of a bundled long-context model."""
    model, _ = load_model(f"bundled:{name}")
    if name.startswith("recall-"):
        return [("mqar", "noise", mqar_settings(model).seq_len)]
    length = model.config.passkey["seq_len"]
    return [("passkey", "noise", length), ("passkey", "natural", length)]


def summary_rows(records, model: str, haystack: str, seed: int, train_len: int) -> list[str]:
    pooled = {(r["method"], r["length"]): r for r in records if r["depth"] == ALL_DEPTHS}
    base = pooled[("dense", train_len)]["score"]
    lines = []
    for method in dict.fromkeys(m for m, _ in pooled):
        cells = []
        for x in (8, 16):
            rec = pooled[(method, x * train_len)]
            share = rec["score"] / base
            ok = "" if method == "dense" else (" ✓" if share >= TARGET[x] else " ✗")
            cells.append(f"{100 * rec['score']:.1f} [{100 * rec['ci'][0]:.1f}, {100 * rec['ci'][1]:.1f}] = "
                         f"{100 * share:.1f} %{ok}")
        saved = pooled[(method, 16 * train_len)]["flops_saved"]
        mark = "" if method == "dense" else (" ✓" if saved >= TARGET["flops"] else " ✗")
        lines.append(f"| {model} | {records[0]['task']} ({haystack}) | {seed} | {method} | {100 * base:.1f} | "
                     + " | ".join(cells) + f" | {100 * saved:.1f} %{mark} |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/longctx")
    ap.add_argument("--models", default=",".join(m for m in BUNDLED if m.startswith(("recall-", "passkey-"))))
    ap.add_argument("--rows", type=int, default=128, help="rows per cell (passkey: half as many)")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    lines = ["| model | task | seed | method | dense at 1x (%) | 8x: % [95 % CI] = share of dense at 1x | 16x: likewise "
             "| FLOPs saved at 16x |", "|---|---|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        for task, haystack, train_len in runs(name):
            model, tok = load_model(f"bundled:{name}", dtype=torch.float32)
            methods = {"dense": None} | {m: TokenReductionConfig(method=m, keep_tokens=train_len) for m in METHODS}
            lengths = [train_len, 8 * train_len, 16 * train_len]
            texts = data.heldout_passages() if haystack == "natural" else None
            rows = args.rows if task == "mqar" else args.rows // 2
            for seed in map(int, args.seeds.split(",")):
                records = grid(model, tok, [task], lengths, [0.0, 0.5, 1.0], methods, n=rows, seed=seed,
                               mqar_settings=mqar_settings(model) if task == "mqar" else None,
                               passkey=PasskeySettings(haystack=haystack), texts=texts)
                folder = out / f"{name}-{haystack}-seed{seed}" if task == "passkey" else out / f"{name}-seed{seed}"
                save(records, folder, {"model": f"bundled:{name}", "tasks": [task], "lengths": lengths,
                                       "depths": [0.0, 0.5, 1.0], "rows_per_cell": rows, "seed": seed,
                                       "haystack": haystack, "keep_tokens": train_len, "torch": torch.__version__,
                                       "methods": {k: v and v.to_dict() for k, v in methods.items()}})
                lines += summary_rows(records, name, haystack, seed, train_len)
                print(lines[-1], flush=True)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
