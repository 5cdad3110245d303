"""The ``hf-tokred`` command.

Each subcommand lives beside the code it drives and registers itself through ``add_parser(subparsers)``.
Exit codes: 0 success, 2 bad usage or invalid settings (the message says which flag), 1 anything else
(e.g. a model or data file that cannot be found; one line on stderr says what).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

__all__ = ["main", "add_reduction_arguments", "reduction_from_args"]

# modules whose add_parser(subparsers) registers subcommands
SUBCOMMAND_MODULES = ("hf_tokred.cli", "hf_tokred.bench", "hf_tokred.evaluation.cli", "hf_tokred.hub")


class UsageError(Exception):
    """A user mistake the command reports with exit code 2."""


def add_reduction_arguments(parser: argparse.ArgumentParser, required: bool = False) -> None:
    """The flags that build a TokenReductionConfig, shared by every subcommand."""
    from .config import METHODS, METRICS, STRATEGIES

    g = parser.add_argument_group("token reduction")
    g.add_argument("--method", choices=sorted(METHODS), default=None,
                   help="reduction method (default: utrc when --flops-reduction or --keep-ratio is given)")
    g.add_argument("--flops-reduction", type=float, default=None, help="target FLOPs reduction, e.g. 0.2")
    g.add_argument("--keep-ratio", type=float, default=None, help="per-anchor keep ratio (instead of a FLOPs target)")
    g.add_argument("--anchors", type=str, default=None, help="comma-separated anchor layers, e.g. 12,17,22")
    g.add_argument("--metric", choices=sorted(METRICS), default="clip", help="importance metric (default: clip)")
    g.add_argument("--q", type=float, default=0.5, help="pruned share in the hybrid strategy (default: 0.5)")
    g.add_argument("--hidden-strategy", choices=sorted(STRATEGIES), default=None, help="override (ablations)")
    g.add_argument("--residual-strategy", choices=sorted(STRATEGIES), default=None, help="override (ablations)")


def reduction_from_args(args: argparse.Namespace):
    """A TokenReductionConfig from the shared flags, or ``None`` for the dense model."""
    from .config import TokenReductionConfig

    if args.flops_reduction is None and args.keep_ratio is None:
        if args.method is not None or args.anchors is not None:
            raise UsageError("--method/--anchors need --flops-reduction or --keep-ratio")
        return None
    anchors = None
    if args.anchors:
        try:
            anchors = [int(a) for a in args.anchors.split(",")]
        except ValueError:
            raise UsageError(f"--anchors must be comma-separated integers, got {args.anchors!r}") from None
    try:
        return TokenReductionConfig(
            method=args.method or "utrc", flops_reduction=args.flops_reduction, keep_ratio=args.keep_ratio,
            anchors=anchors, metric=args.metric, q=args.q, hidden_strategy=args.hidden_strategy,
            residual_strategy=args.residual_strategy,
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
    from .models import check_model_spec, load_model
    from .patch import apply_token_reduction

    try:
        check_model_spec(spec)
        model, tok = load_model(spec, **kwargs)
    except (ValueError, TypeError) as err:
        raise UsageError(f"--model {spec}: {err}") from None
    if cfg is not None:
        try:
            apply_token_reduction(model, cfg)
        except (TypeError, ValueError) as err:
            raise UsageError(f"--flops-reduction/--keep-ratio/--anchors for --model {spec}: {err}") from None
    return model, tok


def positive(flag: str, value: int | None, example: str) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{flag} must be a positive integer, got {value} (e.g. {flag} {example})")


# ----------------------------------------------------------------------------- generate / schedule

#: The prompt of the main job when none is given: long enough for every anchor of the bundled models to reduce.
DEMO_PROMPT = (
    "The history of the city begins with a small settlement on the river, where farmers and traders built their "
    "houses near the old bridge. In the following centuries the town grew into an important market, and its "
    "harbour connected the region with the rest of the country. During the nineteenth century the railway "
    "arrived, new factories were built, and the population increased rapidly. Today the city is known for its "
    "university, its museums and its parks, and many visitors come every year to see the old town and the "
    "cathedral. The history of the"
)


def reduction_summary(model, record, prompt_tokens: int) -> dict:
    """What reduction did to one prompt's prefill: tokens per anchor and the analytic prefill FLOPs saved."""
    from .flops import flops_reduction

    lengths = record.layer_lengths[0] if record is not None else [prompt_tokens] * model.config.num_hidden_layers
    after = {a: lengths[a + 1] for a in (record.anchors if record is not None else [])
             if a + 1 < len(lengths)}
    return {
        "prompt_tokens": prompt_tokens,
        "layer_lengths": lengths,
        "kept_after_anchor": after,
        "tokens_removed": prompt_tokens - lengths[-1],
        # generation computes the logits of the last position only
        "prefill_flops_reduction": flops_reduction(model.config, lengths, prompt_tokens, lm_head_positions=1,
                                                   dense_lm_head_positions=1),
    }


def _format_summary(summary: dict, cfg) -> str:
    n, after = summary["prompt_tokens"], summary["kept_after_anchor"]
    if cfg is None:
        return f"[dense model: no token reduction; {n} prompt tokens computed by every layer]"
    if not after:
        return (f"[token reduction {cfg.method}: the {n}-token prompt is too short for any anchor to remove a token "
                "(each anchor removes n - ceil(n * keep_ratio)); try a longer prompt]")
    steps = ", ".join(f"layer {a}: {m}" for a, m in after.items())
    last = summary["layer_lengths"][-1]
    return (f"[token reduction {cfg.method}: kept {last}/{n} prompt tokens ({steps}); "
            f"prefill FLOPs {-100 * summary['prefill_flops_reduction']:+.1f} % (analytic, next-token logits only); "
            "decoding is not reduced]")


def _generate(args: argparse.Namespace) -> int:
    import torch

    from .patch import record_reduction

    prompt = DEMO_PROMPT if args.prompt is None else args.prompt
    if not prompt.strip():
        raise UsageError("the prompt is empty: give some text to continue (or omit it for the built-in demo prompt)")
    positive("--max-new-tokens", args.max_new_tokens, "40")
    cfg = reduction_from_args(args)
    model, tok = load_for_command(args.model, cfg)
    torch.manual_seed(args.seed)
    enc = tok(prompt, return_tensors="pt")
    if enc["input_ids"].shape[1] == 0:
        raise UsageError("the prompt encodes to no tokens: give some text to continue")
    with record_reduction() as records:
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                             pad_token_id=tok.pad_token_id, return_dict_in_generate=True)
    text = tok.decode(out.sequences[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    summary = reduction_summary(model, records[0] if records else None, enc["input_ids"].shape[1])
    if args.json:
        print(json.dumps({"model": args.model, "prompt": prompt, "completion": text,
                          "token_reduction": None if cfg is None else cfg.to_dict(), "reduction": summary}))
    else:
        print(prompt + text)
        print(_format_summary(summary, cfg))
    return 0


def _schedule(args: argparse.Namespace) -> int:
    from .config import TokenReductionConfig
    from .flops import flops_reduction, proxy_flops_reduction
    from .hub import layer_lengths

    positive("--layers", args.layers, "24")
    positive("--length", args.length, "2048")
    cfg = reduction_from_args(args) or TokenReductionConfig(flops_reduction=0.0)
    config = load_for_command(args.model)[0].config if args.layers is None else None
    layers = args.layers or config.num_hidden_layers
    try:
        s = cfg.resolve(layers)
    except ValueError as err:
        raise UsageError(str(err)) from None
    row = {"num_hidden_layers": layers, "anchors": list(s.anchors), "keep_ratio": round(s.keep_ratio, 6),
           "flops_reduction_proxy": round(s.flops_reduction, 6)}
    if config is not None:
        lengths = layer_lengths(cfg, layers, args.length)  # the lengths each block sees for one sequence
        row["length"] = args.length
        row["layer_lengths"] = lengths
        row["flops_reduction_proxy_at_length"] = round(proxy_flops_reduction(lengths, args.length), 6)
        # generation (prefill) computes next-token logits at one position; scoring computes them at every position
        row["flops_reduction_exact_prefill"] = round(
            flops_reduction(config, lengths, args.length, lm_head_positions=1, dense_lm_head_positions=1), 6)
        row["flops_reduction_exact_scoring"] = round(flops_reduction(config, lengths, args.length), 6)
        row["note"] = ("exact_prefill: LM head at the last position (generate); exact_scoring: LM head at every "
                       "computed position (perplexity, lm-eval)")
    print(json.dumps(row, indent=None if args.json else 2))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with a (reduced) model",
                       description="Generate a continuation; the prompt's prefill is token-reduced, decoding is not.")
    p.add_argument("prompt", nargs="?", default=None,
                   help="text to continue (default: a built-in paragraph long enough to show the reduction)")
    add_model_argument(p)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_reduction_arguments(p)
    p.set_defaults(func=_generate)

    p = sub.add_parser("schedule", help="print anchors, keep ratio and FLOPs for a model and target",
                       description="Resolve a reduction setting for a model depth without running the model.")
    add_model_argument(p)
    p.add_argument("--layers", type=int, default=None, help="depth to plan for instead of loading --model")
    p.add_argument("--length", type=int, default=2048, help="sequence length for the exact FLOPs figures")
    p.add_argument("--json", action="store_true", help="one-line JSON")
    add_reduction_arguments(p)
    p.set_defaults(func=_schedule)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-tokred",
        description="Token reduction for Hugging Face Mamba / Mamba-2 models (UTRC and baselines).",
        epilog="Example: hf-tokred generate --model bundled:mamba --flops-reduction 0.2",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show library logs, progress bars and full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def quiet_libraries() -> None:
    """Commands keep stderr for what they have to say: no weight-loading bars, no library info/warnings."""
    import functools

    import tqdm
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    init = tqdm.tqdm.__init__
    if not getattr(init, "_hf_tokred_quiet", False):  # lm-eval's and our own progress bars (even disable=False)

        @functools.wraps(init)
        def quiet(self, *args, **kwargs):
            init(self, *args, **{**kwargs, "disable": True})

        quiet._hf_tokred_quiet = True
        tqdm.tqdm.__init__ = quiet


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.verbose:
        quiet_libraries()
    try:
        return args.func(args)
    except UsageError as err:
        print(f"hf-tokred {args.command}: error: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, OSError) as err:  # a model or data file that cannot be found or read
        if args.verbose:
            raise
        print(f"hf-tokred {args.command}: error: {err}", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as err:  # invalid input found deeper down (settings, shapes, lengths)
        if args.verbose:
            raise
        print(f"hf-tokred {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # python -m hf_tokred.cli: run the package's module, not this __main__ copy
    from hf_tokred.cli import main as _main

    sys.exit(_main())
