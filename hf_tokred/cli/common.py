"""What every ``hf-tokred`` command shares: the error policy, the reduction and model flags, loading a model.

Error policy: a user mistake raises :class:`UsageError` (the command prints one line naming the flag and exits
2); a model or file that cannot be found or read exits 1 with one line; ``-v`` shows tracebacks instead.
"""

from __future__ import annotations

import argparse
import functools

import tqdm
from transformers.utils import logging as hf_logging

from ..config import DEFAULT_MATCH_WINDOW, DEFAULT_METHOD, LONG_CONTEXT_METHOD, METHODS, METRICS, STRATEGIES, TokenReductionConfig
from ..models import check_model_spec, load_model
from ..settings import apply_token_reduction

__all__ = ["UsageError", "add_model_argument", "add_reduction_arguments", "load_for_command", "positive",
           "positive_int_text", "quiet_libraries", "reduction_from_args"]


class UsageError(Exception):
    """A user mistake the command reports with exit code 2."""


def add_reduction_arguments(parser: argparse.ArgumentParser, required: bool = False) -> None:
    """The flags that build a TokenReductionConfig, shared by every subcommand."""
    g = parser.add_argument_group("token reduction")
    g.add_argument("--method", choices=sorted(METHODS), default=None,
                   help=f"reduction method (default: {DEFAULT_METHOD} with --flops-reduction / --keep-ratio, "
                        f"{LONG_CONTEXT_METHOD} with --keep-tokens)")
    g.add_argument("--flops-reduction", type=float, default=None, help="target FLOPs reduction, e.g. 0.2")
    g.add_argument("--keep-ratio", type=float, default=None, help="per-anchor keep ratio (instead of a FLOPs target)")
    g.add_argument("--keep-tokens", type=int, default=None,
                   help="token budget: blocks after the last anchor process at most this many tokens per sequence "
                        "(instead of a ratio; shorter prompts are not reduced)")
    g.add_argument("--anchors", type=str, default=None, help="comma-separated anchor layers, e.g. 12,17,22")
    g.add_argument("--metric", choices=sorted(METRICS), default=None,
                   help="importance metric (default: the method's own; clip for the paper's methods)")
    g.add_argument("--q", type=float, default=0.5, help="pruned share in the hybrid strategy (default: 0.5)")
    g.add_argument("--hidden-strategy", choices=sorted(STRATEGIES), default=None, help="override (ablations)")
    g.add_argument("--residual-strategy", choices=sorted(STRATEGIES), default=None, help="override (ablations)")
    g.add_argument("--protect-recent", type=float, default=0.0,
                   help="share of each sequence's most recent tokens that are never removed (default: 0)")
    g.add_argument("--match-window", type=int, default=DEFAULT_MATCH_WINDOW,
                   help="similarity-matching methods: destinations searched per candidate, near it "
                        f"(0: exact global matching; default: {DEFAULT_MATCH_WINDOW})")


def reduction_from_args(args: argparse.Namespace):
    """A TokenReductionConfig from the shared flags, or ``None`` for the dense model."""
    if args.flops_reduction is None and args.keep_ratio is None and args.keep_tokens is None:
        if args.method is not None or args.anchors is not None:
            raise UsageError("--method/--anchors need --flops-reduction, --keep-ratio or --keep-tokens")
        return None
    anchors = None
    if args.anchors:
        try:
            anchors = [int(a) for a in args.anchors.split(",")]
        except ValueError:
            raise UsageError(f"--anchors must be comma-separated integers, got {args.anchors!r}") from None
    try:
        return TokenReductionConfig(
            method=args.method, flops_reduction=args.flops_reduction, keep_ratio=args.keep_ratio,
            anchors=anchors, metric=args.metric, q=args.q, hidden_strategy=args.hidden_strategy,
            residual_strategy=args.residual_strategy, protect_recent=args.protect_recent, keep_tokens=args.keep_tokens,
            match_window=args.match_window,
        )
    except (TypeError, ValueError) as err:
        raise UsageError(str(err)) from None


def add_model_argument(parser: argparse.ArgumentParser, default: str = "bundled:mamba") -> None:
    parser.add_argument("--model", default=default,
                        help="bundled:mamba | bundled:mamba2 | random:<family>-<size> (e.g. random:mamba-130m) | "
                             f"a local folder or Hub id (default: {default})")


def load_for_command(spec: str, cfg=None, **kwargs):
    """``(model, tokenizer)`` for ``--model`` with reduction settings applied; user mistakes become UsageError
    naming the flag (an unknown spec: --model; settings that do not fit the model: the reduction flags)."""
    try:
        check_model_spec(spec)
        model, tok = load_model(spec, **kwargs)
    except (ValueError, TypeError) as err:
        raise UsageError(f"--model {spec}: {err}") from None
    if cfg is not None:
        try:
            apply_token_reduction(model, cfg)
        except (TypeError, ValueError) as err:
            raise UsageError(f"--flops-reduction/--keep-ratio/--keep-tokens/--anchors for --model {spec}: {err}") from None
    return model, tok


def positive(flag: str, value: int | None, example: str) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{flag} must be a positive integer, got {value} (e.g. {flag} {example})")




def positive_int_text(flag: str, value, example: str) -> int | None:
    """A positive integer given as text (``None`` stays ``None``)."""
    if value is None:
        return None
    try:
        n = int(str(value).strip())
    except ValueError:
        n = 0
    if n < 1 or str(n) != str(value).strip():
        raise UsageError(f"{flag} must be a positive integer, got {value!r} (e.g. {flag} {example})")
    return n


def quiet_libraries() -> None:
    """Commands keep stderr for what they have to say: no weight-loading bars, no library info/warnings."""
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    init = tqdm.tqdm.__init__
    if not getattr(init, "_hf_tokred_quiet", False):  # lm-eval's and our own progress bars (even disable=False)

        @functools.wraps(init)
        def quiet(self, *args, **kwargs):
            init(self, *args, **{**kwargs, "disable": True})

        quiet._hf_tokred_quiet = True
        tqdm.tqdm.__init__ = quiet
