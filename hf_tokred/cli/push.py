"""``hf-tokred push``: publish a token-reduced variant (settings-only or full copy) with a model card."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from ..evaluation.results import load_eval_results
from ..hub.base import is_hub_id, special_spec
from ..hub.card import DEFAULT_FLOPS_LENGTH
from ..hub.publish import load_full, save_variant, summary, upload_variant
from .common import UsageError, add_model_argument, add_reduction_arguments, reduction_from_args

__all__ = ["add_parser"]


def _check_repo(repo: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", repo or "") or ".." in repo or "--" in repo \
            or repo.endswith((".", "-")) or len(repo.split("/")[1]) > 96:
        raise UsageError(f"--repo must be a Hub repo id 'owner/name' (letters, digits, '-', '_', '.'), got {repo!r} "
                         "(e.g. --repo your-name/mamba-130m-utrc-20)")


def _push(args: argparse.Namespace) -> int:
    if args.output is None and not args.repo:
        raise UsageError("--repo is required to upload (e.g. --repo your-name/mamba-130m-utrc-20); or pass "
                         "--output DIR "
                         "to only write the folder")
    if args.repo:
        _check_repo(args.repo)
    if args.flops_length < 1:
        raise UsageError(f"--flops-length must be a positive integer, got {args.flops_length}")
    cfg = reduction_from_args(args)
    if cfg is None and not args.full_copy:
        raise UsageError("a settings-only variant needs reduction settings: pass --flops-reduction (e.g. 0.2) or "
                         "--keep-ratio (and optionally --method, --anchors)")
    special = special_spec(args.model)
    if not args.full_copy:
        if special == "random":
            raise UsageError(f"--model {args.model} has random weights that exist nowhere else; a settings-only "
                             "variant "
                             "cannot point at them: pass --full-copy")
        if args.output is None and not is_hub_id(args.model):
            raise UsageError(f"--model {args.model} is not a Hub id, so a settings-only variant on the Hub could not "
                             "load it elsewhere: pass a Hub id (e.g. --model state-spaces/mamba-130m-hf), --full-copy, "
                             "or --output DIR to write a local variant")
    result = None
    if args.eval_results is not None:
        try:
            result = load_eval_results(args.eval_results)
        except (FileNotFoundError, ValueError) as err:
            raise UsageError(f"--eval-results: {err}") from None

    model = args.model
    tokenizer = None
    if args.full_copy:
        try:
            model, tokenizer = load_full(args.model, args.base_revision)
        except (ValueError, OSError) as err:
            raise UsageError(f"--model {args.model}: {err}") from None
        if cfg is None and getattr(model.config, "token_reduction", None) is None:
            raise UsageError(f"--model {args.model} has no token_reduction settings of its own: pass --flops-reduction "
                             "(e.g. 0.2) or --keep-ratio")
    with tempfile.TemporaryDirectory(prefix="hf_tokred_variant_") as tmp:
        target = Path(args.output) if args.output is not None else Path(tmp) / args.repo.split("/")[-1]
        try:
            out = save_variant(model, cfg, target, tokenizer=tokenizer, full_copy=args.full_copy, eval_results=result,
                               base_revision=args.base_revision, repo_id=args.repo or None,
                               flops_length=args.flops_length, base_name=args.model)
        except (ValueError, TypeError) as err:
            text = str(err)
            if "eval results" in text:
                flag = "--eval-results"
            elif "base model" in text or "model_type" in text:
                flag = "--model"
            else:
                flag = "--flops-reduction/--keep-ratio/--anchors"
            raise UsageError(f"{flag}: {text}") from None
        except OSError as err:
            raise UsageError(f"--model {args.model}: {err}") from None
        info_summary = summary(out)
        base = info_summary.get("base_model")
        if info_summary["kind"] == "settings-only" and base and os.path.isabs(base):
            info_summary["note"] = (f"base_model is the local folder {base}: the variant loads on this machine only; "
                                    "to publish one, pass the base's Hub id (--model owner/name) or --full-copy")
        if args.output is not None:
            print(json.dumps({"output": str(out), "uploaded": False, **info_summary}, indent=None if args.json else 2))
            return 0
        try:
            info = upload_variant(out, args.repo, private=args.private)
        except Exception as err:  # noqa: BLE001 -- network, authentication, permissions: not a usage error
            print(f"hf-tokred push: error: uploading to {args.repo} failed ({type(err).__name__}: {err}). Log in with "
                  "`hf auth login` (or set HF_TOKEN), or pass --output DIR to write the folder and upload it later.",
                  file=sys.stderr)
            return 1
    url = getattr(info, "commit_url", None) or f"https://huggingface.co/{args.repo}"
    print(json.dumps({"repo": args.repo, "uploaded": True, "url": str(url), **info_summary},
                     indent=None if args.json else 2))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "push", help="publish a token-reduced variant (settings-only or full copy) with a model card",
        description="Publish a token-reduced variant of a Mamba / Mamba-2 model on the Hugging Face Hub. By default a "
                    "settings-only variant (config + tokenizer + card, no weights; it loads the base model's weights "
                    "and needs `import hf_tokred`); with --full-copy the reduced model's weights are saved too (stock "
                    "transformers loads it as the dense model). The card states the method, settings, the analytic "
                    "FLOPs reduction, how to load it, the base model's licence, and an evaluation table only when "
                    "--eval-results is given.",
        epilog="Example: hf-tokred push --model state-spaces/mamba-130m-hf --flops-reduction 0.2 "
               "--repo your-name/mamba-130m-utrc-20 --eval-results eval_results/eval_...json",
    )
    add_model_argument(p)
    p.add_argument("--repo", default=None, help="Hub repo id owner/name to create and upload to")
    p.add_argument("--output", default=None, metavar="DIR",
                   help="only write the variant folder to DIR (nothing is uploaded)")
    p.add_argument("--full-copy", action="store_true", help="save the weights too (a standalone reduced checkpoint)")
    p.add_argument("--private", action="store_true", help="create the repo as private")
    p.add_argument("--eval-results", default=None, metavar="JSON",
                   help="result JSON written by `hf-tokred eval` for these exact settings: adds its table to the card")
    p.add_argument("--base-revision", default=None, metavar="REV",
                   help="revision (branch, tag, commit) of the base model to pin")
    p.add_argument("--flops-length", type=int, default=DEFAULT_FLOPS_LENGTH, metavar="N",
                   help=f"sequence length of the card's analytic FLOPs figure (default: {DEFAULT_FLOPS_LENGTH})")
    p.add_argument("--json", action="store_true", help="one-line JSON summary")
    add_reduction_arguments(p)
    p.set_defaults(func=_push)
