"""The wrappers installed around transformers' ``forward`` and ``generate`` of the supported classes.

Each wrapper runs the stock code when the model has no token-reduction settings, and the reducing loop
(:mod:`hf_tokred.loop`) otherwise.  ``install()`` puts them in place and ``uninstall()`` removes them.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from .compat import with_legacy_cache_name
from .loop import check_shapes, generation_prompt, reduced_backbone
from .outputs import TokenReductionCausalLMOutput, TokenReductionModelOutput, computed_mask, scatter_to_positions
from .families import family_of
from .settings import active

__all__ = ["as_protected_mask", "backbone_forward", "generate", "lm_forward", "reduced_loss"]

_BACKBONE_KEYS = (
    "input_ids", "inputs_embeds", "cache", "use_cache", "output_hidden_states", "attention_mask", "protected_mask",
    "position_ids", "question_length",
)
#: what a reducing forward takes besides stock's arguments (a dense forward drops them: nothing is reduced there)
_REDUCTION_KEYS = ("protected_mask", "question_length")


def _bind(signature: inspect.Signature, self, args, kwargs) -> dict[str, Any]:
    bound = signature.bind(self, *args, **kwargs)
    bound.apply_defaults()
    params = dict(bound.arguments)
    params.pop("self")
    params = {**params, **params.pop("kwargs", {})}
    # the cache under either name (transformers renamed ``cache_params`` to ``cache`` in 5.24 and keeps the old name
    # as a deprecated alias); the reducing loop calls it ``cache``
    # (and hybrid models' ``past_key_values`` before 5.24)
    cache = params.pop("cache", None)
    aliases = [a for a in (params.pop("cache_params", None), params.pop("past_key_values", None)) if a is not None]
    params["cache"] = cache if cache is not None or not aliases else aliases[0]
    return params


def _length(p: dict) -> int:
    return (p["input_ids"] if p["input_ids"] is not None else p["inputs_embeds"]).shape[1]


def as_protected_mask(mask: Any, like: torch.Tensor) -> torch.Tensor | None:
    """``protected_mask`` as a tensor on ``like``'s device: a tensor, or a numpy array / nested list of bools or
    0/1 integers; anything else is a ``TypeError`` naming what is accepted."""
    if mask is None:
        return None
    if not torch.is_tensor(mask):
        given = type(mask).__name__
        try:
            mask = torch.as_tensor(mask)
        except (TypeError, ValueError, RuntimeError):
            mask = None
        if mask is None or mask.is_floating_point() or mask.is_complex() or (
                mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all())):
            raise TypeError("protected_mask must be a bool tensor (or a numpy array / nested list of bools or 0/1) "
                            f"of shape (batch, sequence), got {given}"
                            f"{'' if mask is None else f' of {mask.dtype} values'}")
    return mask.to(like.device)


def _with_protected_mask(p: dict) -> dict:
    prompt = p["input_ids"] if p["input_ids"] is not None else p["inputs_embeds"]
    return {**p, "protected_mask": as_protected_mask(p.get("protected_mask"), prompt)}


def backbone_forward(original):
    """``MambaModel.forward`` / ``Mamba2Model.forward``: hidden states aligned with the input positions."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        settings = active(self)
        if settings is None:
            for key in _REDUCTION_KEYS:  # nothing is reduced, so every position survives as it is
                kwargs.pop(key, None)
            return original(self, *args, **kwargs)
        p = _with_protected_mask(_bind(signature, self, args, kwargs))
        return_dict = p.pop("return_dict", None)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        r = reduced_backbone(self, *settings, **p)
        N = _length(p)
        out = TokenReductionModelOutput(
            last_hidden_state=scatter_to_positions(r.hidden, r.positions, N), cache=r.cache,
            hidden_states=r.all_hidden, computed_mask=computed_mask(r.positions, N), kept_positions=r.positions,
            plans=r.plans,
        )
        if not return_dict:
            return tuple(v for v in (out.last_hidden_state, out.cache, out.hidden_states) if v is not None)
        return with_legacy_cache_name(out, family_of(self).hybrid)

    forward._hf_tokred_original = original
    return forward


def reduced_loss(model, logits, labels, positions, loss_kwargs) -> torch.Tensor:
    """Next-token loss of a reduced forward: the mean over the labelled positions that were computed.

    ``num_items_in_batch`` (what ``Trainer`` passes: the labelled positions of the whole accumulated batch) is
    made consistent with that meaning: this batch's mean is weighted by its share of the labelled positions, so
    the sum over accumulation steps is the labelled-weighted mean of the per-batch means, and a single batch
    reports exactly the mean over its computed labelled positions (never shrunk by the kept fraction).
    """
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100).to(positions.device)
    shift_labels = shifted.gather(1, positions.clamp_min(0)).masked_fill(positions < 0, -100)
    loss_kwargs = dict(loss_kwargs)
    total = loss_kwargs.pop("num_items_in_batch", None)
    loss = model.loss_function(
        logits=logits, labels=None, shift_labels=shift_labels, vocab_size=model.config.vocab_size, **loss_kwargs
    )
    if total is not None:
        share = (shifted != -100).sum().to(loss.device, loss.dtype)
        loss = loss * share / (total.to(loss.device, loss.dtype) if torch.is_tensor(total) else float(total))
    return loss


def _logits(head, r, every, N: int, logits_to_keep, compact: bool) -> torch.Tensor:
    """The logits a caller asked for: aligned with the input positions (NaN where not computed), or compact."""
    M = r.hidden.shape[1]
    if not isinstance(logits_to_keep, int):
        return scatter_to_positions(every, r.positions, N)[:, logits_to_keep]
    # the same positions as transformers' slice(-logits_to_keep, None): [start, N)
    start = max(N - logits_to_keep, 0) if logits_to_keep > 0 else min(-logits_to_keep, N)
    cols = min(N - start, M)  # kept positions >= start are the last columns
    part = every[:, M - cols :] if every is not None else head(r.hidden[:, M - cols :])
    # compact: only what was computed ([B, cols, V], column j at input position kept_positions[:, M-cols+j]),
    # so a full-logits forward allocates the reduced length, not a NaN-filled [B, N, V]
    return part if compact else scatter_to_positions(part, r.positions[:, M - cols :], N - start, offset=start)


def _check_loss_terms(model, p: dict, labels, family) -> None:
    """Loss terms a reducing forward does not compute are refused rather than silently left out."""
    if p.get("output_router_logits") or getattr(model.config, "output_router_logits", False):
        raise ValueError(f"output_router_logits (the MoE load-balancing loss) is not supported with token reduction "
                         f"on {family.name}; pass output_router_logits=False, or turn reduction off")
    if labels is not None and getattr(model.config, "z_loss_coefficient", 0):
        raise ValueError(f"the z-loss (config.z_loss_coefficient={model.config.z_loss_coefficient}) is not supported "
                         "with token reduction; set config.z_loss_coefficient = 0, or turn reduction off")


def lm_forward(original):
    """``MambaForCausalLM.forward`` / ``Mamba2ForCausalLM.forward``: logits mapped back to the input positions."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        settings = active(self)
        compact = kwargs.pop("compact_logits", False)
        if settings is None:  # every position is computed as it is: compact and aligned logits agree
            for key in _REDUCTION_KEYS:
                kwargs.pop(key, None)
            return original(self, *args, **kwargs)
        p = _with_protected_mask(_bind(signature, self, args, kwargs))
        labels, logits_to_keep = p.pop("labels"), p.pop("logits_to_keep")
        if compact and not isinstance(logits_to_keep, int):
            raise ValueError("compact_logits=True takes an int logits_to_keep (0 = every computed position); "
                             "select positions from the compact logits with kept_positions instead")
        return_dict = p.pop("return_dict", None)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        family = family_of(self)
        _check_loss_terms(self, p, labels, family)
        N = _length(p)
        if labels is not None:
            check_shapes((p["input_ids"] if p["input_ids"] is not None else p["inputs_embeds"]).shape[0], N, labels,
                         None)
        loss_kwargs = {k: v for k, v in p.items() if k not in _BACKBONE_KEYS}
        backbone = getattr(self, family.backbone_attr)
        r = reduced_backbone(backbone, *settings, **{k: p.get(k) for k in _BACKBONE_KEYS})
        divisor = getattr(self.config, family.logits_divisor) if family.logits_divisor else 1.0
        times = getattr(self.config, family.logits_multiplier) if family.logits_multiplier else 1.0
        head = lambda h: (self.lm_head(h.to(self.lm_head.weight.dtype)) * times).float() / divisor  # noqa: E731
        every = head(r.hidden) if labels is not None or not isinstance(logits_to_keep, int) else None
        logits = _logits(head, r, every, N, logits_to_keep, compact)
        loss = reduced_loss(self, every, labels, r.positions, loss_kwargs) if labels is not None else None
        if not return_dict:
            out = tuple(v for v in (logits, r.cache, r.all_hidden) if v is not None)
            return ((loss,) + out) if loss is not None else out
        return with_legacy_cache_name(TokenReductionCausalLMOutput(
            loss=loss, logits=logits, cache=r.cache, hidden_states=r.all_hidden,
            computed_mask=computed_mask(r.positions, N), kept_positions=r.positions, plans=r.plans), family.hybrid)

    forward._hf_tokred_original = original
    return forward


def generate(original):
    """``generate()`` on a reducing model reduces the prompt only, with or without a cache (a no-cache step
    re-runs prompt + generated tokens; the generated tokens are kept as they are), and takes
    ``protected_mask [batch, prompt length]`` for the prompt and ``question_length`` (the prompt's last tokens are a
    question, kept exactly as written)."""

    @functools.wraps(original)
    def wrapper(self, inputs=None, *args, protected_mask=None, question_length=None, **kwargs):
        if active(self) is None:  # nothing is reduced: every position survives anyway
            return original(self, inputs, *args, **kwargs)
        prompt = next((x for x in (inputs, kwargs.get("input_ids"), kwargs.get("inputs_embeds")) if x is not None), None)
        if prompt is None:
            return original(self, inputs, *args, **kwargs)
        if protected_mask is not None:
            protected_mask = as_protected_mask(protected_mask, prompt)
            if tuple(protected_mask.shape) != tuple(prompt.shape[:2]):
                raise ValueError(f"protected_mask must have the prompt's shape {tuple(prompt.shape[:2])} "
                                 f"(batch, prompt length), got {tuple(protected_mask.shape)}")
        with generation_prompt(prompt.shape[1], protected_mask, question_length):
            return original(self, inputs, *args, **kwargs)

    wrapper._hf_tokred_original = original
    return wrapper
