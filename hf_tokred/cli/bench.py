"""``hf-tokred bench``: dense vs reduced prefill and decode speed (and peak memory), side by side in one run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..bench import format_table, run_bench
from ..models import check_model_spec
from ..config import DEFAULT_METHOD, LONG_CONTEXT_METHOD, METHODS, TokenReductionConfig
from .common import UsageError, add_model_argument

__all__ = ["add_parser"]


def _cmd(args: argparse.Namespace) -> int:
    if args.flops is None:  # the default levels, unless only token budgets were asked for
        args.flops = "" if args.keep_tokens else "0.1,0.2,0.3"
    try:
        flops = tuple(float(f) for f in args.flops.split(",")) if args.flops else ()
    except ValueError:
        raise UsageError(f"--flops must be comma-separated numbers like 0.1,0.2,0.3, got {args.flops!r}") from None
    if any(not 0 < f < 1 for f in flops):
        raise UsageError(f"--flops values must be in (0, 1), got {args.flops}")
    try:
        budgets = tuple(int(k) for k in args.keep_tokens.split(",")) if args.keep_tokens else ()
    except ValueError:
        budgets = (0,)
    if any(k < 1 for k in budgets):
        raise UsageError(f"--keep-tokens must be comma-separated positive integers like 1024,2048, got "
                         f"{args.keep_tokens!r}")
    try:
        TokenReductionConfig(method=args.method, keep_ratio=1.0,
                             **({} if args.match_window is None else {"match_window": args.match_window}))
    except (TypeError, ValueError) as err:
        raise UsageError(f"--method/--match-window: {err}") from None
    if args.repeats < 1 or args.batch < 1 or args.length < 2:
        raise UsageError("--repeats and --batch must be >= 1 and --length >= 2")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but torch sees no CUDA device")
    try:
        check_model_spec(args.model)
    except ValueError as err:
        raise UsageError(f"--model {args.model}: {err}") from None
    result = run_bench(args.model, args.batch, args.length, flops, args.method, args.repeats, args.warmup,
                       args.decode_tokens, args.threads, args.compare_stock, args.memory, args.device, args.dtype,
                       memory_logits=args.memory_logits, keep_tokens=budgets, match_window=args.match_window)
    print(format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench", help="measure prefill/decode speed, reduction overhead and peak memory, dense vs reduced",
        description="Side-by-side speed and memory benchmark. Random-weight models of the real sizes are fine: "
                    "speed does not depend on the weights. Example: hf-tokred bench --model random:mamba-130m "
                    "--length 2048 --flops 0.1,0.2,0.3 --compare-stock --json runs/bench.json",
    )
    add_model_argument(p, default="random:mamba-130m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--length", type=int, default=2048, help="prompt length (tokens)")
    p.add_argument("--flops", default=None,
                   help="FLOPs-reduction levels to compare with dense (default: 0.1,0.2,0.3 unless --keep-tokens)")
    p.add_argument("--keep-tokens", default="", help="token budgets to compare with dense, e.g. 1024,2048 (see "
                   "TokenReductionConfig.keep_tokens)")
    p.add_argument("--method", choices=sorted(METHODS), default=None,
                   help=f"default: {DEFAULT_METHOD} for --flops levels, {LONG_CONTEXT_METHOD} for --keep-tokens")
    p.add_argument("--match-window", type=int, default=None,
                   help="similarity-matching methods: destinations searched per candidate (0: exact global)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per setting (interleaved)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up rounds")
    p.add_argument("--decode-tokens", type=int, default=16, help="decode steps timed after each prefill")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--compare-stock", action="store_true",
                   help="also time stock transformers' own code paths (dense) in the same run")
    p.add_argument("--memory", action="store_true",
                   help="peak memory per setting (CPU, Linux: peak RSS of one prefill above the RSS before it, "
                        "in a fresh process)")
    p.add_argument("--memory-logits", choices=["last", "all"], default="last",
                   help="with --memory: 'last' = next-token logits only (generation prefill, default); 'all' = "
                        "logits at every computed position (scoring), compact_logits=True for reduced models")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--json", default=None, help="write the full result here")
    p.set_defaults(func=_cmd)
