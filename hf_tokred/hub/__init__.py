"""Publishing token-reduced variants on the Hugging Face Hub (``hf-tokred push``).

* :mod:`.publish` -- :func:`save_variant`, :func:`push_variant`, :func:`upload_variant`;
* :mod:`.card` -- the model card; :mod:`.base` -- resolving the base model and its licence.

The settings-only variant loader itself is integration code: :mod:`hf_tokred.variant`.
"""

from ..variant import VARIANT_FILE, VARIANT_MODEL_TYPE, TokenReductionVariant, TokenReductionVariantConfig
from .base import is_hub_id
from .card import DEFAULT_FLOPS_LENGTH, analytic_flops, make_model_card
from .publish import push_variant, save_variant, upload_variant, variant_stub

__all__ = ["DEFAULT_FLOPS_LENGTH", "VARIANT_FILE", "VARIANT_MODEL_TYPE", "TokenReductionVariant",
           "TokenReductionVariantConfig", "analytic_flops", "is_hub_id", "make_model_card", "push_variant",
           "save_variant", "upload_variant", "variant_stub"]
