"""The transformers releases hf_tokred supports, and the small adapters their differences need.

Supported: ``SUPPORTED_TRANSFORMERS`` (``[low, high)``); ``import hf_tokred`` refuses any other release with
:class:`UnsupportedTransformersVersion`, naming the range and the pip command that installs it.  Every release in
the range ran the whole test suite; ``.ci/run`` runs it on the oldest and the newest.

What differs inside the range, one adapter per difference (each chosen by the installed version, each a few lines;
the rest of the package calls the adapter, never ``transformers.__version__``):

* 5.24 renamed the Mamba forwards' cache argument and output field ``cache_params`` -> ``cache`` (the old name is a
  deprecated alias there): :data:`CACHE_ARG`, :func:`cache_kwargs`, :func:`cache_of`, :func:`with_legacy_cache_name`;
* 5.24 renamed the hybrid models' decoder-layer cache argument ``past_key_values`` -> ``cache``:
  :func:`layer_cache_kwargs` (and :func:`with_legacy_cache_name` names their outputs' cache ``past_key_values``);
* 5.24 renamed the recurrent mask helper's cache parameter ``past_key_values`` -> ``cache``:
  :func:`recurrent_mask` passes it by position;
* 5.23 made Mamba-2's gated RMSNorm normalise each of the ``n_groups`` groups of channels on its own (as mamba_ssm
  does); 5.22 normalises over all channels, so a Mamba-2 checkpoint with ``n_groups > 1`` computes something else
  there: :func:`mamba2_norm_is_grouped` (the original-checkpoint loader refuses such checkpoints on 5.22).

Policy for a new transformers release: install it in a fresh virtual environment and run the whole suite against
it.  Where its Mamba internals moved (the cache argument of the blocks and mixers, the recurrent attention-mask
helper, the hub-kernel wrappers of the scan functions the families table names, the output fields generate reads),
add the difference here -- one function per difference, chosen by version, with its own test in
``tests/test_versions.py`` -- and widen ``SUPPORTED_TRANSFORMERS`` (and pyproject's range, and the oldest/newest
pair ``.ci/run`` tests) only when the whole suite passes on it.  A release that changes the mixer ABI itself (the
pre-5.0 ``cache_position`` / ``MambaCache`` era) is not adapted: the range ends there.
"""

from __future__ import annotations

from typing import Any

import transformers
from packaging.version import Version
from transformers.masking_utils import create_recurrent_attention_mask
from transformers.utils.generic import merge_with_config_defaults

__all__ = ["CACHE_ARG", "SUPPORTED_TRANSFORMERS", "UnsupportedTransformersVersion", "cache_argument", "cache_kwargs",
           "cache_of", "check_transformers_version", "layer_cache_kwargs", "mamba2_norm_is_grouped", "merged_use_cache", "recurrent_mask",
           "with_legacy_cache_name"]

SUPPORTED_TRANSFORMERS = (Version("5.22.0"), Version("5.25.0"))  # [low, high)
INSTALLED = Version(transformers.__version__)


class UnsupportedTransformersVersion(ImportError, ValueError):
    """The installed transformers is outside the releases whose Mamba internals hf_tokred patches."""


def check_transformers_version(version: str = transformers.__version__) -> None:
    lo, hi = SUPPORTED_TRANSFORMERS
    if not lo <= Version(version) < hi:
        raise UnsupportedTransformersVersion(
            f"hf_tokred supports transformers>={lo},<{hi} (its Mamba cache/mixer API changes between releases); "
            f"found transformers=={version}. Install a supported version: pip install 'transformers>={lo},<{hi}'"
        )


# ----------------------------------------------------------------------------- the cache argument (5.24: cache)


def cache_argument(version: Version = INSTALLED) -> str:
    """The name transformers' Mamba forwards take the cache by (and their outputs carry it under)."""
    return "cache" if version >= Version("5.24.0") else "cache_params"


CACHE_ARG = cache_argument()


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``{CACHE_ARG: cache}``: the keyword a block / mixer / model of the installed release takes."""
    return {CACHE_ARG: cache}


def cache_of(output: Any, hybrid: bool = False) -> Any:
    """The cache of a model output of the installed release (stock or hf_tokred's; a hybrid's is
    ``past_key_values`` before 5.24)."""
    return getattr(output, "past_key_values" if hybrid and CACHE_ARG != "cache" else CACHE_ARG, None)


def with_legacy_cache_name(output: Any, hybrid: bool = False) -> Any:
    """hf_tokred's outputs carry the cache as ``cache``; on releases before 5.24, where ``generate()`` (and stock
    code) read it from ``cache_params`` (``past_key_values`` for hybrid SSM-attention models), the output also
    gets that key.  (5.24's ``ModelOutput`` maps the old names to ``cache`` itself.)"""
    if CACHE_ARG != "cache" and output.get("cache") is not None:
        output["past_key_values" if hybrid else "cache_params"] = output["cache"]
    return output


def layer_cache_kwargs(cache: Any) -> dict[str, Any]:
    """The cache keyword of a hybrid model's decoder layers: ``cache`` from 5.24, ``past_key_values`` before (their
    SSM mixers take :data:`CACHE_ARG`, as Mamba's do)."""
    return {"cache" if CACHE_ARG == "cache" else "past_key_values": cache}


# ----------------------------------------------------------------------------- the recurrent mask helper


def recurrent_mask(config, inputs_embeds, attention_mask, cache):
    """The attention mask the Mamba blocks take (``None`` when nothing is padded).  The helper's fourth parameter is
    ``past_key_values`` before 5.24 and ``cache`` from 5.24 on, so it is passed by position."""
    return create_recurrent_attention_mask(config, inputs_embeds, attention_mask, cache)


# ----------------------------------------------------------------------------- Mamba-2's gated norm (5.23: per group)


def mamba2_norm_is_grouped(version: Version = INSTALLED) -> bool:
    """Whether transformers' Mamba-2 gated RMSNorm normalises each group of ``intermediate_size // n_groups``
    channels on its own (5.23 on, as mamba_ssm's ``RMSNormGated(group_size=...)``), rather than all channels."""
    return version >= Version("5.23.0")


# ----------------------------------------------------------------------------- use_cache of the hybrid backbones

#: ``merged_use_cache(backbone, use_cache=...)``: ``use_cache`` as transformers' hybrid backbones resolve it (their
#: forward is wrapped in ``merge_with_config_defaults``: the config's value when None, False under gradient
#: checkpointing while training -- from 5.24 only while gradients are enabled), by the installed release's own rule
merged_use_cache = merge_with_config_defaults(lambda self, use_cache=None: use_cache)
