"""``from_pretrained(..., token_reduction=...)``: the wrappers ``install()`` puts around transformers' loaders.

* ``PreTrainedModel.from_pretrained`` takes ``token_reduction=`` (a config, a dict, or ``None`` for the dense
  model), validates a ``token_reduction`` block found in ``config.json``, and loads a settings-only variant
  through its base model when a concrete class is asked for it;
* every ``AutoModel*.from_pretrained`` hands ``token_reduction=`` to the class it picks
  (:func:`hf_tokred.settings.handing_settings`);
* ``AutoConfig.from_pretrained(..., token_reduction=)`` stores validated settings on a supported config and
  refuses any other config (instead of silently dropping the argument);
* all of them load original mamba_ssm checkpoints (``config.json`` with ``d_model`` / ``n_layer`` / ``ssm_cfg``,
  weights under ``backbone.embedding...``), converting config and weights on load
  (:mod:`hf_tokred.mamba_ssm_loading`), with or without ``token_reduction=``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from transformers import PreTrainedConfig, PreTrainedModel

from .config import TokenReductionConfig
from .families import FAMILIES, family_names, supported_text
from .mamba_ssm_loading import load_original, original_config, original_transformers_config
from .settings import UNSET, apply_token_reduction, handing_settings, pending_settings, resolve_schedule
from .variant import VARIANT_MODEL_TYPE, TokenReductionVariant

__all__ = ["auto_config_from_pretrained", "auto_model_from_pretrained", "model_from_pretrained"]


def _finish_loading(model, token_reduction, source) -> Any:
    if token_reduction is UNSET:
        settings = getattr(getattr(model, "config", None), "token_reduction", None)
        if settings is None:
            return model
        try:
            return apply_token_reduction(model, settings)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"the token_reduction block in the config of {source!r} is invalid: {str(err).rstrip('.')}. Fix that "
                "block in config.json, or load with token_reduction=None to ignore it."
            ) from err
    return apply_token_reduction(model, token_reduction)


def _is_settings_only_variant(source, kwargs) -> bool:
    """Whether ``source`` is a settings-only hf_tokred variant (a config.json with no weights of its own)."""
    if not isinstance(source, (str, os.PathLike)) or "config" in kwargs:
        return False
    hub = {k: kwargs[k] for k in ("cache_dir", "local_files_only", "revision", "subfolder", "token") if k in kwargs}
    try:
        config, _ = PreTrainedConfig.get_config_dict(source, **hub)
    except (OSError, ValueError):
        return False
    return config.get("model_type") == VARIANT_MODEL_TYPE


def _load_variant_as(cls, source, token_reduction, args, kwargs):
    """``Mamba*ForCausalLM.from_pretrained(<settings-only variant>)``: load its base model through the variant
    loader, and check that the base model is of the class asked for."""
    if token_reduction is not UNSET:
        kwargs = {**kwargs, "token_reduction": token_reduction}
    model = TokenReductionVariant.from_pretrained(source, *args, **kwargs)
    loaded = model[0] if isinstance(model, tuple) else model
    if not isinstance(loaded, cls):
        raise ValueError(f"{str(source)!r} is a settings-only hf_tokred variant whose base model is a "
                         f"{type(loaded).__name__}, not a {cls.__name__}; load it with "
                         "AutoModelForCausalLM.from_pretrained")
    return model


def model_from_pretrained(original):
    """Wrapper of ``PreTrainedModel.from_pretrained`` (the function under the classmethod)."""

    @functools.wraps(original)
    def from_pretrained(cls, pretrained_model_name_or_path, *args, token_reduction=UNSET, **kwargs):
        if token_reduction is UNSET:
            token_reduction = pending_settings()
        if token_reduction is not UNSET and token_reduction is not None:
            TokenReductionConfig.coerce(token_reduction)  # fail on bad settings before loading weights
            model_type = getattr(getattr(cls, "config_class", None), "model_type", None)
            if model_type not in FAMILIES:
                raise ValueError(
                    f"token_reduction supports {supported_text()}; {cls.__name__} (model_type={model_type!r}) cannot "
                    f"reduce tokens. Drop token_reduction= or load a {family_names()} checkpoint."
                )
        raw = original_config(pretrained_model_name_or_path, kwargs)
        with handing_settings(UNSET):
            try:
                model = (original(cls, pretrained_model_name_or_path, *args, **kwargs) if raw is None else
                         load_original(original, cls, pretrained_model_name_or_path, raw, args, kwargs))
            except OSError:
                if raw is not None or not _is_settings_only_variant(pretrained_model_name_or_path, kwargs):
                    raise
                return _load_variant_as(cls, pretrained_model_name_or_path, token_reduction, args, kwargs)
        if not isinstance(model, PreTrainedModel):  # e.g. output_loading_info=True returns a tuple
            return (_finish_loading(model[0], token_reduction, pretrained_model_name_or_path), *model[1:])
        return _finish_loading(model, token_reduction, pretrained_model_name_or_path)

    from_pretrained._hf_tokred_original = original
    return from_pretrained


def auto_model_from_pretrained(original):
    """Wrapper of an Auto class's own ``from_pretrained`` (each Auto class carries its own copy)."""

    @functools.wraps(original)
    def from_pretrained(cls, *args, token_reduction=UNSET, **kwargs):
        if token_reduction is UNSET:
            return original(cls, *args, **kwargs)
        with handing_settings(token_reduction):  # handed to the concrete class's from_pretrained
            return original(cls, *args, **kwargs)

    from_pretrained._hf_tokred_original = original
    return from_pretrained


def auto_config_from_pretrained(original):
    """Wrapper of ``AutoConfig.from_pretrained``."""

    @functools.wraps(original)
    def from_pretrained(cls, pretrained_model_name_or_path, *args, token_reduction=UNSET, **kwargs):
        raw = original_config(pretrained_model_name_or_path, kwargs)
        loaded = (original(cls, pretrained_model_name_or_path, *args, **kwargs) if raw is None else
                  original_transformers_config(raw, pretrained_model_name_or_path, **kwargs))
        if token_reduction is UNSET:
            return loaded
        config = loaded[0] if isinstance(loaded, tuple) else loaded
        if getattr(config, "model_type", None) not in FAMILIES:
            raise ValueError(
                f"token_reduction applies to {family_names()} configs; this config has "
                f"model_type={getattr(config, 'model_type', None)!r}. Drop token_reduction= for this model."
            )
        if token_reduction is not None:
            token_reduction = TokenReductionConfig.coerce(token_reduction)
            resolve_schedule(token_reduction, config)  # raises if the schedule does not fit this model
        config.__dict__.pop("token_reduction", None)
        if token_reduction is not None:
            config.__dict__["token_reduction"] = token_reduction.to_dict()
        return loaded

    from_pretrained._hf_tokred_original = original
    return from_pretrained
