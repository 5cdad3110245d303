#!/usr/bin/env python
"""How much a bounded matching window (``match_window``) changes the similarity methods' plans and quality,
against the exact global matching (``match_window=0``), at long prompts (dev tool; docs/long-prompts.md cites its output).

Held-out documents of the project's corpus, concatenated to ``--length`` tokens + a 32-token suffix; the suffix is
scored (protected, as in the quality table) so every variant is compared at the same positions.  Per window:
the share of the first anchor's removed tokens that exact matching removes too, the share of merges into the same
destination, and the fidelity to the dense model (top-1 agreement, KL) with 95 % bootstrap intervals.

    python dev/match_window.py --model bundled:mamba --method utrc --flops 0.3 --length 8192 --windows 0,256,1024
"""

from __future__ import annotations

import argparse
import json

import torch

import hf_tokred
from hf_tokred import TokenReductionConfig
from hf_tokred.evaluation import data
from hf_tokred.evaluation.quality import bootstrap_ci, fidelity, suffix_scores
from hf_tokred.models import load_bundled

SUFFIX = 32


def documents(tok, n: int, length: int) -> list[list[int]]:
    """``n`` token sequences of ``length + SUFFIX`` tokens, each a run of consecutive held-out passages."""
    ids = tok("\n\n".join(data.heldout_passages()))["input_ids"]
    size = length + SUFFIX
    if len(ids) < n * size:
        raise SystemExit(f"the held-out split has {len(ids)} tokens; fewer documents (--docs) or a shorter --length")
    return [ids[i * size:(i + 1) * size] for i in range(n)]


def first_plan(model, seq):
    ids = torch.tensor([seq])
    protected = torch.zeros_like(ids, dtype=torch.bool)
    protected[:, -1 - SUFFIX:-1] = True
    with torch.no_grad():
        out = model(ids, protected_mask=protected, use_cache=False)
    _, plan = out.plans[0]
    src = plan.src[0][plan.src_mask[0]].tolist()
    dst = plan.dst[0][plan.src_mask[0]].tolist()
    return dict(zip(src, dst))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bundled:mamba")
    ap.add_argument("--method", default="utrc")
    ap.add_argument("--flops", type=float, default=0.3)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--windows", default="0,256,512,1024")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    family = args.model.removeprefix("bundled:")
    model, tok = load_bundled(family)
    docs = documents(tok, args.docs, args.length)
    dense = suffix_scores(model, docs, SUFFIX, batch_size=1)
    exact_plans = None
    for w in [int(x) for x in args.windows.split(",")]:
        cfg = TokenReductionConfig(method=args.method, flops_reduction=args.flops, match_window=w)
        hf_tokred.apply_token_reduction(model, cfg)
        plans = [first_plan(model, d) for d in docs]
        exact_plans = plans if exact_plans is None else exact_plans
        same_removed = [len(p.keys() & e.keys()) / len(e) for p, e in zip(plans, exact_plans)]
        same_merge = [sum(p.get(s) == t for s, t in e.items()) / len(e) for p, e in zip(plans, exact_plans)]
        fid = fidelity(dense, suffix_scores(model, docs, SUFFIX, batch_size=1))
        hf_tokred.apply_token_reduction(model, None)
        print(json.dumps({"model": args.model, "method": args.method, "flops": args.flops, "length": args.length,
                          "docs": args.docs, "match_window": w,
                          "same_removed_as_exact": bootstrap_ci(same_removed),
                          "same_destination_as_exact": bootstrap_ci(same_merge),
                          "top1_agreement": fid["top1_agreement"], "kl": fid["kl"]}), flush=True)


if __name__ == "__main__":
    main()
