"""Settings-only variants: a ``config.json`` that names a base model and token-reduction settings, no weights.

``config.json`` has ``"model_type": "hf_tokred_variant"``, ``base_model`` (Hub id or path of the base, or
``bundled:NAME`` for a model shipped with hf_tokred, found in the installation that loads it), optional
``base_revision`` and the ``token_reduction`` dict.  Registered with ``AutoConfig`` / ``AutoModelForCausalLM`` by
``install()``, :class:`TokenReductionVariant` loads the *base* model with the saved settings applied and returns
it (a stock ``MambaForCausalLM`` / ``Mamba2ForCausalLM``).  Writing and publishing variants: :mod:`hf_tokred.hub`.
"""

from __future__ import annotations

from transformers import AutoModelForCausalLM, PreTrainedConfig

from .bundled_models import bundled_name, bundled_path
from .config import TokenReductionConfig
from .settings import UNSET, pending_settings

__all__ = ["AUTO_MAP", "VARIANT_FILE", "VARIANT_MODEL_TYPE", "TokenReductionVariant", "TokenReductionVariantConfig"]

VARIANT_MODEL_TYPE = "hf_tokred_variant"
VARIANT_MODULE = "hf_tokred_variant"
VARIANT_FILE = f"{VARIANT_MODULE}.py"
AUTO_MAP = {
    "AutoConfig": f"{VARIANT_MODULE}.TokenReductionVariantConfig",
    "AutoModelForCausalLM": f"{VARIANT_MODULE}.TokenReductionVariant",
}
# hub kwargs that concern the variant repository itself, never the base model
_VARIANT_ONLY_KWARGS = ("revision", "subfolder", "code_revision", "_from_auto", "adapter_kwargs", "trust_remote_code")


class TokenReductionVariantConfig(PreTrainedConfig):
    """``config.json`` of a settings-only variant: which base model to load, and the token-reduction settings."""

    model_type = VARIANT_MODEL_TYPE

    base_model: str | None = None
    base_revision: str | None = None
    token_reduction: dict | None = None

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """No-op: the variant's ``auto_map`` is written explicitly, never by copying this module."""


class TokenReductionVariant:
    """Loader registered for :class:`TokenReductionVariantConfig` with ``AutoModelForCausalLM``.

    Not a model: :meth:`from_pretrained` loads the *base* model named in the variant's config with the variant's
    settings applied and returns that model (a stock ``MambaForCausalLM`` / ``Mamba2ForCausalLM``).
    """

    config_class = TokenReductionVariantConfig

    def __init__(self, *args, **kwargs):
        raise TypeError("TokenReductionVariant is a loader, not a model: use TokenReductionVariant.from_pretrained "
                        "(or AutoModelForCausalLM.from_pretrained) on a settings-only variant")

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM"):
        """No-op (see :meth:`TokenReductionVariantConfig.register_for_auto_class`)."""

    @classmethod
    def _from_config(cls, config, **kwargs):
        raise TypeError(
            f"a settings-only hf_tokred variant has no architecture of its own; load it with from_pretrained, or "
            f"build the base model ({getattr(config, 'base_model', None)!r}) from its own config"
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        token_reduction = kwargs.pop("token_reduction", UNSET)
        if token_reduction is UNSET:  # AutoModel*.from_pretrained(..., token_reduction=...) hands it over here
            token_reduction = pending_settings()
        if not isinstance(config, TokenReductionVariantConfig):
            hub = {k: kwargs[k] for k in ("cache_dir", "force_download", "local_files_only", "proxies", "revision",
                                          "subfolder", "token") if k in kwargs}
            config = TokenReductionVariantConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        source = str(pretrained_model_name_or_path)
        base = config.base_model
        if not base:
            raise ValueError(f"{source!r} is not a settings-only hf_tokred variant: its config.json has no base_model")
        if str(base) == source:
            raise ValueError(f"the hf_tokred variant {source!r} names itself as its base_model")
        if token_reduction is UNSET:
            token_reduction = config.token_reduction
            if token_reduction is None:
                raise ValueError(f"the hf_tokred variant {source!r} has no token_reduction block in its config.json")
            try:
                TokenReductionConfig.coerce(token_reduction)
            except (TypeError, ValueError) as err:
                raise ValueError(
                    f"the token_reduction block in the config of {source!r} is invalid: {str(err).rstrip('.')}. Fix "
                    "that block in "
                    "config.json, or pass token_reduction=... (or None) to from_pretrained."
                ) from err
        for key in _VARIANT_ONLY_KWARGS:
            kwargs.pop(key, None)
        if config.base_revision:
            kwargs["revision"] = config.base_revision
        if bundled_name(base):
            base = bundled_path(bundled_name(base))
        return AutoModelForCausalLM.from_pretrained(base, *model_args, token_reduction=token_reduction, **kwargs)
