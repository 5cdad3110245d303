"""The transformers releases hf_tokred supports, and the small adapters their differences need.

Policy for a new transformers release: run the test suite against it; where its Mamba internals moved (the
cache argument of the blocks and mixers, the recurrent attention-mask helper, the hub-kernel wrappers of the
scan functions), add the difference here -- one function per difference, chosen by version -- and widen
``SUPPORTED_TRANSFORMERS`` (and pyproject's range, and the oldest/newest pair ``.ci/run`` tests) only when the
whole suite passes on it.
"""

from __future__ import annotations

import transformers
from packaging.version import Version
from transformers.masking_utils import create_recurrent_attention_mask

__all__ = ["SUPPORTED_TRANSFORMERS", "UnsupportedTransformersVersion", "check_transformers_version",
           "recurrent_mask"]

SUPPORTED_TRANSFORMERS = (Version("5.24.0"), Version("5.25.0"))  # [low, high)


class UnsupportedTransformersVersion(ImportError, ValueError):
    """The installed transformers is outside the releases whose Mamba internals hf_tokred patches."""


def check_transformers_version(version: str = transformers.__version__) -> None:
    lo, hi = SUPPORTED_TRANSFORMERS
    if not lo <= Version(version) < hi:
        raise UnsupportedTransformersVersion(
            f"hf_tokred supports transformers>={lo},<{hi} (its Mamba cache/mixer API changes between releases); "
            f"found transformers=={version}. Install a supported version: pip install 'transformers>={lo},<{hi}'"
        )


def recurrent_mask(config, inputs_embeds, attention_mask, cache):
    """The attention mask the Mamba blocks take (``None`` when nothing is padded)."""
    return create_recurrent_attention_mask(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                           cache=cache)
