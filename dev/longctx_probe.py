#!/usr/bin/env python
"""Quick probes of long-context selection variants (dev tool; docs/long-prompts.md cites its output).

The same grid as ``hf-tokred eval --tasks mqar|passkey --lengths ...`` (:func:`hf_tokred.evaluation.longctx.grid`:
every variant on the same rows, dense included, 95 % intervals), for variants that are not settings of the
package.  A variant is ``dense`` or ``METHOD:K[:key=value,...]`` (a token budget of ``K``; keys are
TokenReductionConfig fields, ``anchors`` as ``1+3``), where METHOD is one of hf_tokred's methods or a probe-only
one registered here, on the selector table, for this process only:

* ``pre_blocksB`` -- prefilter with blocks of ``B`` tokens (``prefilter`` itself uses 32);
* ``pre_lookaheadS`` -- prefilter keeping single tokens, each scoring the highest importance of itself and the
  ``S`` tokens after it (``prefilter`` before 0.4.0 used ``S = 3``);
* ``pre_tokens`` -- prefilter keeping the most important single tokens (EViT's rule before the anchor).

    python dev/longctx_probe.py --model bundled:passkey-mamba2 --task passkey --lengths 2048 --budget 256 \
        --variants "dense;prefilter;pre_lookahead3;pre_blocks32"
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from hf_tokred import TokenReductionConfig, config, select
from hf_tokred.config import MethodSpec
from hf_tokred.evaluation import data
from hf_tokred.evaluation.longctx import EVAL_SEED, grid
from hf_tokred.evaluation.passkey import PasskeySettings
from hf_tokred.evaluation.runner import mqar_settings
from hf_tokred.models import load_model

SIZES = (4, 8, 16, 32, 64)
SPANS = (0, 1, 3, 7, 15)


def _lookahead(h, s, protected, r, metric, receive=True, frozen=None, match_window=0, span=3):
    """Importance spread backwards over ``span`` tokens, then EViT's rule."""
    spread = s.clone()
    for k in range(1, min(span, s.shape[1] - 1) + 1):
        spread[:, :-k] = torch.maximum(spread[:, :-k], s[:, k:])
    return select._select_importance(h, spread, protected, r, metric, receive, frozen, match_window)


def register_variants() -> None:
    for size in SIZES:
        select._SELECTORS[f"blocks{size}"] = functools.partial(select._select_blocks, size=size)
        config.METHODS[f"pre_blocks{size}"] = MethodSpec(f"blocks{size}", "prune", "prune", False, "probe", rerun=True)
    for span in SPANS:
        select._SELECTORS[f"lookahead{span}"] = functools.partial(_lookahead, span=span)
        config.METHODS[f"pre_lookahead{span}"] = MethodSpec(f"lookahead{span}", "prune", "prune", False, "probe",
                                                            rerun=True)
    config.METHODS["pre_tokens"] = MethodSpec("importance", "prune", "prune", False, "probe", rerun=True)


def variant(text: str, budget: int) -> TokenReductionConfig | None:
    if text == "dense":
        return None
    method, *rest = text.split(":")
    k = int(rest[0]) if rest and rest[0] else budget
    kw = {}
    for item in (rest[1].split(",") if len(rest) > 1 else []):
        key, value = item.split("=")
        kw[key] = [int(a) for a in value.split("+")] if key == "anchors" else (
            float(value) if key in ("protect_recent", "q") else value)
    return TokenReductionConfig(method=method, keep_tokens=k, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bundled:recall-mamba2-anydepth")
    ap.add_argument("--task", default="mqar", choices=["mqar", "passkey"])
    ap.add_argument("--variants", default="dense;prefilter")
    ap.add_argument("--budget", type=int, default=128, help="K of the variants that name none")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--depths", default="0,0.5,1")
    ap.add_argument("--n", type=int, default=64, help="rows per cell")
    ap.add_argument("--seed", type=int, default=EVAL_SEED)
    ap.add_argument("--haystack", default="noise", choices=["noise", "natural"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    register_variants()
    model, tok = load_model(args.model, dtype=torch.float32)
    methods = {v: variant(v, args.budget) for v in args.variants.split(";")}
    texts = data.heldout_passages() if args.haystack == "natural" else None
    records = grid(model, tok, [args.task], [int(x) for x in args.lengths.split(",")],
                   [float(x) for x in args.depths.split(",")], methods, n=args.n, seed=args.seed,
                   mqar_settings=mqar_settings(model) if args.task == "mqar" else None,
                   passkey=PasskeySettings(haystack=args.haystack), texts=texts)
    for rec in records:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}), flush=True)


if __name__ == "__main__":
    main()
