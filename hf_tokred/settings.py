"""Token-reduction settings on a model: turning them on and off, reading them, and the resolved schedule.

The settings live in ``model.config.token_reduction`` as a JSON-safe dict (so ``save_pretrained`` and
``push_to_hub`` carry them).  The schedule they resolve to is computed once and kept on the module that runs
(re-resolved only when the settings change), not re-parsed on every forward.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from typing import Any

from .config import ResolvedSchedule, TokenReductionConfig
from .families import family_of
from .flops import layer_costs

__all__ = ["UNSET", "active", "apply_token_reduction", "get_token_reduction", "handing_settings", "pending_settings",
           "resolve_schedule", "settings_property"]

#: "not given": keep whatever the checkpoint's config.json says (``token_reduction=None`` turns reduction off).
UNSET: Any = type("Unset", (), {"__repr__": lambda self: "UNSET"})()

_PENDING: contextvars.ContextVar = contextvars.ContextVar("hf_tokred_pending", default=UNSET)


@contextlib.contextmanager
def handing_settings(token_reduction: Any):
    """Hand ``token_reduction`` to the ``from_pretrained`` of whichever class an Auto class picks (the Auto
    classes build the concrete model themselves, so the setting travels in this context)."""
    token = _PENDING.set(token_reduction)
    try:
        yield
    finally:
        _PENDING.reset(token)


def pending_settings() -> Any:
    """The settings handed down by :func:`handing_settings`, or :data:`UNSET`."""
    return _PENDING.get()


def resolve_schedule(cfg: TokenReductionConfig, config: Any) -> ResolvedSchedule:
    """``cfg.resolve`` for the model of ``config``: a hybrid's anchors must sit on its SSM layers, and a FLOPs target
    weighs its layers by their FLOPs (attention's quadratic term, feed-forward and MoE layers)."""
    family = family_of(config)
    if not family.hybrid:
        return cfg.resolve(config.num_hidden_layers)
    return cfg.resolve(config.num_hidden_layers, family.anchor_layers(config), layer_costs(config))


def apply_token_reduction(model, token_reduction: TokenReductionConfig | dict | None):
    """Turn token reduction on (validated against the model's depth), or off with ``None``. Returns ``model``."""
    config = model.config
    if token_reduction is None:
        config.__dict__.pop("token_reduction", None)
        return model
    family_of(model)
    cfg = TokenReductionConfig.coerce(token_reduction)
    resolve_schedule(cfg, config)  # raises if the schedule does not fit this model
    config.__dict__["token_reduction"] = cfg.to_dict()
    return model


def get_token_reduction(model_or_config: Any) -> TokenReductionConfig | None:
    config = getattr(model_or_config, "config", model_or_config)
    settings = getattr(config, "token_reduction", None)
    return None if settings is None else TokenReductionConfig.coerce(settings)


def active(module) -> tuple[TokenReductionConfig, ResolvedSchedule] | None:
    """The settings and resolved schedule ``module`` runs with, or ``None`` (no reduction).

    Validated on first use (settings may predate ``import hf_tokred`` or be set by hand) and kept on the module
    until ``config.token_reduction`` changes.
    """
    config = module.config
    settings = config.__dict__.get("token_reduction")
    if settings is None:
        return None
    cached = module.__dict__.get("_hf_tokred_active")
    if cached is not None and cached[0] == settings:
        return cached[1]
    try:
        cfg = TokenReductionConfig.coerce(settings)
        resolved = (cfg, resolve_schedule(cfg, config))
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"model.config.token_reduction is invalid for this {config.num_hidden_layers}-layer model: "
            f"{str(err).rstrip('.')}. Set valid settings with hf_tokred.apply_token_reduction(model, settings), "
            "or turn reduction off with hf_tokred.apply_token_reduction(model, None)"
        ) from None
    module.__dict__["_hf_tokred_active"] = (copy.deepcopy(settings), resolved)
    return resolved


def settings_property() -> property:
    """``config.token_reduction`` on the supported config classes: assigning a ``TokenReductionConfig`` stores its
    JSON-safe dict (so ``save_pretrained`` / ``to_json_string`` keep working), ``None`` or ``del`` turns it off.
    Settings are validated where they are applied (``apply_token_reduction``, loading, and the first forward)."""

    def get(config):
        return config.__dict__.get("token_reduction")

    def set_(config, value):
        if value is None:
            config.__dict__.pop("token_reduction", None)
        else:
            config.__dict__["token_reduction"] = value.to_dict() if isinstance(value, TokenReductionConfig) else value

    def delete(config):
        config.__dict__.pop("token_reduction", None)

    return property(get, set_, delete, doc="token-reduction settings (a JSON-safe dict), or None")
