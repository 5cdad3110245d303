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


# ----------------------------------------------------------------------------- generate / schedule


def _generate(args: argparse.Namespace) -> int:
    import torch

    from .models import load_model

    cfg = reduction_from_args(args)
    torch.manual_seed(args.seed)
    model, tok = load_model(args.model, **({} if cfg is None else {"token_reduction": cfg}))
    enc = tok(args.prompt, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                         pad_token_id=tok.pad_token_id, return_dict_in_generate=True)
    text = tok.decode(out.sequences[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    if args.json:
        print(json.dumps({"model": args.model, "prompt": args.prompt, "completion": text,
                          "token_reduction": None if cfg is None else cfg.to_dict()}))
    else:
        print(args.prompt + text)
    return 0


def _schedule(args: argparse.Namespace) -> int:
    from .config import TokenReductionConfig
    from .flops import flops_reduction, proxy_flops_reduction
    from .models import load_model

    cfg = reduction_from_args(args) or TokenReductionConfig(flops_reduction=0.0)
    config = load_model(args.model)[0].config if args.layers is None else None
    layers = args.layers or config.num_hidden_layers
    try:
        s = cfg.resolve(layers)
    except ValueError as err:
        raise UsageError(str(err)) from None
    row = {"num_hidden_layers": layers, "anchors": list(s.anchors), "keep_ratio": round(s.keep_ratio, 6),
           "flops_reduction_proxy": round(s.flops_reduction, 6)}
    if config is not None:
        import torch

        from .reduce import num_to_remove

        lengths, n = [], args.length
        for layer in range(layers):  # the lengths each block sees for one sequence of --length tokens
            lengths.append(n)
            if layer in s.anchors:
                n -= int(num_to_remove(torch.tensor([n]), s.keep_ratio, cfg.spec.pairs))
        row["length"] = args.length
        row["layer_lengths"] = lengths
        row["flops_reduction_proxy_at_length"] = round(proxy_flops_reduction(lengths, args.length), 6)
        row["flops_reduction_exact_at_length"] = round(flops_reduction(config, lengths, args.length), 6)
    print(json.dumps(row, indent=None if args.json else 2))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with a (reduced) model",
                       description="Generate a continuation; the prompt's prefill is token-reduced, decoding is not.")
    p.add_argument("prompt", help="text to continue")
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
    p.add_argument("--length", type=int, default=2048, help="sequence length for the exact FLOPs figure")
    p.add_argument("--json", action="store_true", help="one-line JSON")
    add_reduction_arguments(p)
    p.set_defaults(func=_schedule)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-tokred",
        description="Token reduction for Hugging Face Mamba / Mamba-2 models (UTRC and baselines).",
        epilog="Example: hf-tokred generate 'The history of the' --model bundled:mamba --flops-reduction 0.2",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as err:
        print(f"hf-tokred {args.command}: error: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, OSError) as err:  # a model or data file that cannot be found or read
        print(f"hf-tokred {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # python -m hf_tokred.cli: run the package's module, not this __main__ copy
    from hf_tokred.cli import main as _main

    sys.exit(_main())
