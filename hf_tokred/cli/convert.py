"""``hf-tokred convert SRC DEST``: an original mamba_ssm checkpoint as a standard transformers folder."""

from __future__ import annotations

import argparse
import json
import os

import torch

from ..convert import convert_checkpoint
from ..models import looks_like_a_folder
from .common import UsageError

__all__ = ["add_parser"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _convert(args: argparse.Namespace) -> int:
    if looks_like_a_folder(args.src) and not os.path.exists(args.src):
        raise UsageError(f"SRC: no such folder {args.src!r} (a local mamba_ssm checkpoint folder, or a Hub repo id "
                         "such as state-spaces/mamba2-130m)")
    hub = {"revision": args.revision} if args.revision else {}
    result = convert_checkpoint(args.src, args.dest, dtype=_DTYPES.get(args.dtype), data_dir=args.data_dir, **hub)
    if args.json:
        print(json.dumps({"dest": str(result.dest), "model_class": result.model_class,
                          "tokenizer": result.tokenizer, "note": result.note}))
    else:
        print(f"wrote {result.dest}: {result.model_class} (config.json, model.safetensors); {result.note}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "convert", help="convert an original mamba_ssm checkpoint into a transformers folder",
        description="Convert an original mamba_ssm checkpoint (state-spaces/mamba-*, state-spaces/mamba2-*: "
                    "config.json with d_model/n_layer/ssm_cfg, pytorch_model.bin or model.safetensors) into a "
                    "standard transformers folder (config.json, model.safetensors, and the GPT-NeoX tokenizer when "
                    "it can be found offline). With hf_tokred imported such checkpoints also load directly.",
        epilog="Example: hf-tokred convert state-spaces/mamba2-2.7b ./mamba2-2.7b-hf",
    )
    p.add_argument("src", help="a local folder or Hub repo id in mamba_ssm's format")
    p.add_argument("dest", help="a new (or empty) folder to write")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="dtype of the written weights (default: the checkpoint's own)")
    p.add_argument("--revision", default=None, help="Hub revision of SRC")
    p.add_argument("--data-dir", default=None,
                   help="where `hf-tokred data` put the offline files (default: $HF_TOKRED_DATA or ~/.cache/hf_tokred)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_convert)
