"""``hf-tokred schedule``: anchors, keep ratio and FLOPs of a reduction setting, without running the model."""

from __future__ import annotations

import argparse
import json

from ..config import TokenReductionConfig
from ..families import family_of
from ..flops import flops_reduction, measured_proxy_reduction
from ..settings import get_token_reduction, resolve_schedule
from .common import UsageError, add_model_argument, add_reduction_arguments, cli_wording, load_for_command, \
    positive, reduction_from_args

__all__ = ["add_parser"]


def _schedule(args: argparse.Namespace) -> int:
    positive("--layers", args.layers, "24")
    positive("--length", args.length, "2048")
    cfg = reduction_from_args(args)
    config = load_for_command(args.model, cfg)[0].config if args.layers is None else None
    if cfg is None:  # the settings saved with the model, else none (the dense schedule)
        cfg = (get_token_reduction(config) if config is not None else None) or TokenReductionConfig(flops_reduction=0.0)
    layers = args.layers or config.num_hidden_layers
    family = None if config is None else family_of(config)
    try:
        s = cfg.resolve(layers) if config is None else resolve_schedule(cfg, config)
    except ValueError as err:
        raise UsageError(cli_wording(str(err))) from None
    row = {"num_hidden_layers": layers, "anchors": list(s.anchors)}
    if s.keep_tokens is None:
        row.update(keep_ratio=round(s.keep_ratio, 6), flops_reduction_proxy=round(s.flops_reduction, 6))
    else:  # a budget: what it saves depends on the prompt's length (the limit: nothing after the first anchor)
        row.update(keep_tokens=s.keep_tokens, method=cfg.method, flops_reduction_proxy_limit=round(s.flops_reduction, 6))
        if config is None:
            row.update(length=args.length, layer_lengths=s.layer_lengths(args.length))
    if family is not None and family.hybrid:
        # the solver weighs a hybrid's layers by their FLOPs (not the paper's every-layer-alike proxy)
        proxy = "flops_reduction_proxy" if s.keep_tokens is None else "flops_reduction_proxy_limit"
        row[proxy.replace("proxy", "layer_weighted")] = row.pop(proxy)
        row["layer_types"] = list(family.kinds(config))
        row["anchor_types"] = [row["layer_types"][a] for a in s.anchors]
    if config is not None:
        lengths = s.layer_lengths(args.length)  # the lengths each block sees for one sequence
        row["length"] = args.length
        row["layer_lengths"] = lengths
        row["flops_reduction_proxy_at_length"] = round(measured_proxy_reduction(lengths, args.length), 6)
        # generation (prefill) computes next-token logits at one position; scoring computes them at every position
        row["flops_reduction_exact_prefill"] = round(
            flops_reduction(config, lengths, args.length, lm_head_positions=1, dense_lm_head_positions=1), 6)
        row["flops_reduction_exact_scoring"] = round(flops_reduction(config, lengths, args.length), 6)
        row["note"] = ("exact_prefill: LM head at the last position (generate); exact_scoring: LM head at every "
                       "computed position (perplexity, lm-eval)")
    print(json.dumps(row, indent=None if args.json else 2))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("schedule", help="print anchors, keep ratio and FLOPs for a model and target",
                       description="Resolve a reduction setting for a model depth without running the model.")
    add_model_argument(p)
    p.add_argument("--layers", type=int, default=None, help="depth to plan for instead of loading --model")
    p.add_argument("--length", type=int, default=2048, help="sequence length for the exact FLOPs figures")
    p.add_argument("--json", action="store_true", help="one-line JSON")
    add_reduction_arguments(p)
    p.set_defaults(func=_schedule)
