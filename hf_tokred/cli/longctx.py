"""``hf-tokred eval --tasks mqar,passkey --lengths ...``: recall by prompt length and depth, dense beside each method."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from ..evaluation import data
from ..evaluation.longctx import EVAL_SEED, LONG_TASKS, format_table, grid, pct, save
from ..evaluation.passkey import HAYSTACKS, PasskeySettings
from ..evaluation.runner import mqar_settings
from ..settings import get_token_reduction
from .common import UsageError, load_for_command, positive_int_text, reduction_from_args

__all__ = ["LONG_TASKS", "is_long_run", "run_long"]


def is_long_run(args: argparse.Namespace, tasks: list[str]) -> bool:
    """``--lengths`` / ``--depths`` / ``--methods`` / ``--seed`` given, or a task only the long-context grid runs."""
    return any(getattr(args, f) is not None for f in ("lengths", "depths", "methods", "seed")) or \
        any(t in tasks for t in LONG_TASKS if t != "mqar")


def _numbers(flag: str, text: str, kind, example: str, low: float, high: float | None = None) -> list:
    try:
        values = [kind(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or any(v < low or (high is not None and v > high) for v in values):
        bounds = f"in [{low:g}, {high:g}]" if high is not None else f"at least {low:g}"
        raise UsageError(f"{flag} must be comma-separated numbers {bounds}, got {text!r} (e.g. {flag} {example})")
    return list(dict.fromkeys(values))


def _label(cfg) -> str:
    for field in ("keep_tokens", "flops_reduction", "keep_ratio"):
        value = getattr(cfg, field)
        if value is not None:
            return f"{cfg.method} {field}={value:g}"
    return cfg.method


def _methods(args: argparse.Namespace, model) -> dict:
    """``{"dense": None, label: config, ...}``: the reduction flags (or the model's saved settings), and with
    ``--methods`` the same level for each named method."""
    cfg = reduction_from_args(args)
    if cfg is None:
        cfg = get_token_reduction(model)
    out = {"dense": None}
    if args.methods is None:
        if cfg is not None:
            out[_label(cfg)] = cfg
        return out
    if cfg is None:
        raise UsageError("--methods needs a reduction level shared by the methods: add --keep-tokens, "
                         "--flops-reduction or --keep-ratio (e.g. --methods prefilter,front_prune --keep-tokens 128)")
    if args.method is not None:
        raise UsageError("give --method or --methods, not both (--methods runs each at the same level)")
    for name in dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()):
        try:
            one = dataclasses.replace(cfg, method=name)
        except (TypeError, ValueError) as err:
            raise UsageError(f"--methods {name}: {err}") from None
        out[_label(one)] = one
    return out


def _check_model(tasks, model, tokenizer) -> dict:
    settings = {}
    if "mqar" in tasks:
        try:
            settings["mqar"] = mqar_settings(model)
        except ValueError as err:
            raise UsageError(f"--tasks mqar: {err} (e.g. --model bundled:recall-mamba2)") from None
    for task in ("passkey", "position_ppl"):
        if task in tasks and (tokenizer is None or getattr(model.config, "mqar", None) is not None):
            raise UsageError(f"--tasks {task} needs a language model with a text tokenizer (e.g. --model "
                             "bundled:passkey-mamba2); a recall model's tokenizer has no words")
    return settings


def run_long(args: argparse.Namespace, tasks: list[str]) -> int:
    unknown = [t for t in tasks if t not in LONG_TASKS]
    if unknown:
        raise UsageError(f"--lengths/--depths/--methods run the long-context tasks {', '.join(LONG_TASKS)}; "
                         f"{', '.join(unknown)} {'is an lm-eval task' if len(unknown) == 1 else 'are lm-eval tasks'}: run "
                         f"{'it' if len(unknown) == 1 else 'them'} in a separate `hf-tokred eval` without those flags")
    lengths = _numbers("--lengths", args.lengths or "128,512,1024", int, "128,1024,2048", 16)
    depths = _numbers("--depths", args.depths or "0,0.5,1", float, "0,0.5,1", 0.0, 1.0)
    rows = positive_int_text("--limit", args.limit, "64") or 64
    batch_size = positive_int_text("--batch-size", args.batch_size, "8")
    if args.haystack not in HAYSTACKS:
        raise UsageError(f"--haystack must be one of {', '.join(HAYSTACKS)}, got {args.haystack!r}")
    texts = None
    if "position_ppl" in tasks or ("passkey" in tasks and args.haystack == "natural"):
        try:
            texts = data.heldout_passages(args.data_dir)
        except data.DataMissingError as err:
            raise UsageError(f"{err} (--tasks position_ppl and --haystack natural read the held-out passages)") \
                from None
    model, tokenizer = load_for_command(args.model, None)
    methods = _methods(args, model)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        model.to(device).eval()
    except (RuntimeError, AssertionError) as err:
        raise UsageError(f"--device {args.device}: {err}") from None
    settings = _check_model(tasks, model, tokenizer)
    passkey = PasskeySettings(haystack=args.haystack)
    seed = EVAL_SEED if args.seed is None else args.seed
    try:
        records = grid(model, tokenizer, tasks, lengths, depths, methods, n=rows, seed=seed,
                       batch_size=batch_size, mqar_settings=settings.get("mqar"), passkey=passkey, texts=texts,
                       progress=None if args.json else _progress)
    except ValueError as err:
        raise UsageError(f"{err}") from None
    meta = {"model": args.model, "tasks": tasks, "lengths": lengths, "depths": depths, "rows_per_cell": rows,
            "seed": seed, "haystack": args.haystack, "torch": torch.__version__,
            "methods": {k: (v.to_dict() if v is not None else None) for k, v in methods.items()}}
    files = save(records, args.output, meta)
    if args.json:
        print(json.dumps({"meta": meta, "records": records}))
    else:
        print(format_table(records))
        plot = files.get("plot", "no plot (matplotlib is missing: pip install 'hf-tokred[eval]')")
        print(f"saved: {files['json']}, {files['table']} and {plot}")
    return 0


def _progress(rec: dict) -> None:
    print(f"  {rec['task']} {rec['method']} length {rec['length']} depth {rec['depth']}: {pct(rec)}",
          file=sys.stderr, flush=True)
