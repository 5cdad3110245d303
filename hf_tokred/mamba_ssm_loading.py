"""Loading original mamba_ssm checkpoints (a local folder or Hub repo) into transformers' own classes.

:mod:`hf_tokred.loading` calls these from its ``from_pretrained`` wrappers: when the source's ``config.json`` is
mamba_ssm's (:func:`hf_tokred.mamba_ssm_format.is_mamba_ssm_config`), the config is converted to a ``MambaConfig`` /
``Mamba2Config`` and the weights (``model.safetensors`` or ``pytorch_model.bin``, the latter read with
``torch.load(weights_only=True)``) are renamed and handed to transformers' ``from_pretrained`` as a state dict.
Every weight must land: a missing, unexpected or mis-shaped one is an :class:`UnsupportedCheckpoint` naming it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import transformers
from safetensors.torch import load_file
from transformers import PreTrainedConfig
from transformers.utils.hub import cached_file

from .compat import mamba2_norm_is_grouped
from .families import FAMILIES
from .mamba_ssm_format import (UnsupportedCheckpoint, is_mamba_ssm_config, transformers_config,
                               transformers_weight_name)

__all__ = ["WEIGHT_FILES", "load_original", "original_config", "original_state_dict", "original_transformers_config",
           "read_config"]

#: where the Hub / cache options of ``from_pretrained`` go (the rest are model or config options)
HUB_KEYS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")
#: the weight files looked for, in this order
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _hub(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in HUB_KEYS if kwargs.get(k) is not None}


def read_config(source: Any, kwargs: dict) -> dict | None:
    """The ``config.json`` of a folder or Hub repo as a dict; ``None`` when there is none or it cannot be read."""
    if not isinstance(source, (str, os.PathLike)) or os.path.isfile(source):
        return None
    try:
        path = cached_file(source, "config.json", _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **_hub(kwargs))
        if path is None:
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def original_config(source: Any, kwargs: dict) -> dict | None:
    """The ``config.json`` of ``source`` when it is an original mamba_ssm checkpoint, else ``None`` (including when
    it cannot be read: transformers then reports that in its own words)."""
    raw = read_config(source, kwargs)
    return raw if is_mamba_ssm_config(raw) else None


def original_transformers_config(raw: dict, source: Any, **kwargs) -> PreTrainedConfig:
    """The ``MambaConfig`` / ``Mamba2Config`` of a mamba_ssm ``config.json``; ``kwargs`` as
    ``PreTrainedConfig.from_dict`` takes them (overrides, ``return_unused_kwargs``)."""
    fields = transformers_config(raw, str(source))
    if fields["model_type"] == "mamba2" and fields["n_groups"] > 1 and not mamba2_norm_is_grouped():
        raise UnsupportedCheckpoint(
            f"{source}: ssm_cfg ngroups={fields['n_groups']} needs Mamba-2's gated RMSNorm per group of channels, "
            f"which transformers {transformers.__version__} does not do (it normalises all channels together); "
            "install transformers>=5.23 to load this checkpoint")
    config_class = getattr(transformers, FAMILIES[fields["model_type"]].config_class)
    kwargs = {k: v for k, v in kwargs.items() if k not in (*HUB_KEYS, "trust_remote_code", "code_revision")}
    return config_class.from_dict({**fields, "name_or_path": str(source)}, **kwargs)


def _read_weights(source: Any, kwargs: dict) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = cached_file(source, name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **_hub(kwargs))
        if path is None:
            continue
        if name.endswith(".safetensors"):
            return load_file(path)
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a file written without torch's zip format cannot be memory-mapped
            return torch.load(path, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{source} has an original mamba_ssm config.json but no weights: none of "
                            f"{', '.join(WEIGHT_FILES)} was found")


def original_state_dict(source: Any, config: PreTrainedConfig, kwargs: dict | None = None) -> dict[str, torch.Tensor]:
    """The weights of an original mamba_ssm checkpoint under transformers' names (the tied LM head dropped)."""
    state = {transformers_weight_name(k): v for k, v in _read_weights(source, kwargs or {}).items()}
    if config.tie_word_embeddings and "lm_head.weight" in state:
        head, embedding = state.pop("lm_head.weight"), state.get("backbone.embeddings.weight")
        if embedding is not None and not torch.equal(head, embedding):
            raise UnsupportedCheckpoint(f"{source}: tie_embeddings is true but lm_head.weight differs from "
                                        "backbone.embedding.weight; set tie_embeddings to false in config.json if the "
                                        "head is its own")
    return state


def _check_loaded(source: Any, model, info: dict) -> None:
    unexpected = {k for k in info["unexpected_keys"] if hasattr(model, "lm_head") or not k.startswith("lm_head.")}
    problems = [f"missing {sorted(info['missing_keys'])}" if info["missing_keys"] else "",
                f"unexpected {sorted(unexpected)}" if unexpected else "",
                "of another shape " + ", ".join(f"{k} {tuple(got)} (expected {tuple(want)})"
                                                for k, got, want in sorted(info["mismatched_keys"]))
                if info["mismatched_keys"] else ""]
    problems = [p for p in problems if p]
    if problems:
        raise UnsupportedCheckpoint(f"{source}: the original checkpoint's weights do not fit its converted config "
                                    f"(transformers names): {'; '.join(problems)}")


def load_original(from_pretrained, cls, source: Any, raw: dict, args: tuple, kwargs: dict):
    """``cls.from_pretrained(source, ...)`` for an original mamba_ssm checkpoint: transformers' own loading
    (``from_pretrained``, the unwrapped function) on the converted config and state dict."""
    kwargs = dict(kwargs)
    config = kwargs.pop("config", None)  # AutoModel / pipeline pass the config they loaded (converted by us)
    if not isinstance(config, PreTrainedConfig):
        config = original_transformers_config(raw, source)
    family = FAMILIES[config.model_type]
    if getattr(getattr(cls, "config_class", None), "model_type", None) != config.model_type:
        raise ValueError(f"{str(source)!r} is an original mamba_ssm {family.name} checkpoint; load it with "
                         f"{family.lm_class}.from_pretrained or AutoModelForCausalLM.from_pretrained, not "
                         f"{cls.__name__}")
    state_dict = original_state_dict(source, config, kwargs)
    wants_info = kwargs.pop("output_loading_info", False)
    rest = {k: v for k, v in kwargs.items() if k not in (*HUB_KEYS, "ignore_mismatched_sizes")}
    # mismatched shapes are reported back (and refused below, naming the weights), not raised anonymously
    model, info = from_pretrained(cls, None, *args, config=config, state_dict=state_dict, output_loading_info=True,
                                  ignore_mismatched_sizes=True, **rest)
    _check_loaded(source, model, info)
    return (model, info) if wants_info else model
