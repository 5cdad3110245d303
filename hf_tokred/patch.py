"""Attaching token reduction to transformers' own Mamba / Mamba-2 classes.

``import hf_tokred`` installs three small hooks (idempotent):

* ``PreTrainedModel.from_pretrained`` and the ``AutoModel*`` loaders accept ``token_reduction=`` and
  validate a ``token_reduction`` block found in ``config.json``;
* ``MambaModel.forward`` / ``Mamba2Model.forward`` run the shared reducing layer loop when
  ``config.token_reduction`` is set, and the stock code otherwise;
* ``MambaForCausalLM.forward`` / ``Mamba2ForCausalLM.forward`` map logits back to input positions.

The settings live in ``model.config.token_reduction`` as a plain dict, so ``save_pretrained`` and
``push_to_hub`` carry them, and stock transformers (without the plugin) loads such a folder as a normal model.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version
from transformers import (
    Mamba2ForCausalLM,
    Mamba2Model,
    MambaForCausalLM,
    MambaModel,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_recurrent_attention_mask
from transformers.models.auto.auto_factory import _BaseAutoModelClass
from transformers.utils import ModelOutput

from .config import ResolvedSchedule, TokenReductionConfig
from .reduce import Plan, apply_plan_pair, extend_plan, make_plan, reduce_along

__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "ReductionRecord",
    "TokenReductionCausalLMOutput",
    "TokenReductionModelOutput",
    "apply_token_reduction",
    "check_transformers_version",
    "get_token_reduction",
    "install",
    "record_reduction",
]

SUPPORTED_TRANSFORMERS = (Version("5.24.0"), Version("5.25.0"))  # [low, high)


class UnsupportedTransformersVersion(ImportError, ValueError):
    """The installed transformers is outside the line whose Mamba internals hf_tokred patches."""


def check_transformers_version(version: str) -> None:
    lo, hi = SUPPORTED_TRANSFORMERS
    if not lo <= Version(version) < hi:
        raise UnsupportedTransformersVersion(
            f"hf_tokred supports transformers>={lo},<{hi} (its Mamba cache/mixer API changes between lines); "
            f"found transformers=={version}. Install a supported version: pip install 'transformers>={lo},<{hi}'"
        )


# ----------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    """The one place Mamba and Mamba-2 differ for this plugin."""

    name: str
    lm_class: type
    backbone_class: type
    mixer_takes_kwargs: bool  # Mamba2Block forwards **kwargs to its mixer, MambaBlock does not


FAMILIES = {
    "mamba": Family("mamba", MambaForCausalLM, MambaModel, False),
    "mamba2": Family("mamba2", Mamba2ForCausalLM, Mamba2Model, True),
}


def _family(model_or_config: Any) -> Family:
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        what = type(model_or_config).__name__
        raise ValueError(
            f"token_reduction supports Mamba and Mamba-2 models (MambaForCausalLM, Mamba2ForCausalLM, MambaModel, "
            f"Mamba2Model); got {what} with model_type={model_type!r}"
        )
    return FAMILIES[model_type]


# ----------------------------------------------------------------------------- settings


def apply_token_reduction(model: PreTrainedModel, token_reduction: TokenReductionConfig | dict | None):
    """Turn token reduction on (validated against the model's depth), or off with ``None``. Returns ``model``."""
    config = model.config
    if token_reduction is None:
        config.__dict__.pop("token_reduction", None)
        return model
    _family(model)
    cfg = TokenReductionConfig.coerce(token_reduction)
    cfg.resolve(config.num_hidden_layers)  # raises if the schedule does not fit this model
    config.token_reduction = cfg.to_dict()
    return model


def _settings_property() -> property:
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


def get_token_reduction(model_or_config: Any) -> TokenReductionConfig | None:
    config = getattr(model_or_config, "config", model_or_config)
    settings = getattr(config, "token_reduction", None)
    return None if settings is None else TokenReductionConfig.coerce(settings)


@functools.lru_cache(maxsize=64)
def _schedule(settings_json: str, num_hidden_layers: int) -> tuple[TokenReductionConfig, ResolvedSchedule]:
    cfg = TokenReductionConfig.from_dict(json.loads(settings_json))
    return cfg, cfg.resolve(num_hidden_layers)


def _active(config) -> tuple[TokenReductionConfig, ResolvedSchedule] | None:
    settings = getattr(config, "token_reduction", None)
    if settings is None:
        return None
    if isinstance(settings, TokenReductionConfig):
        settings = settings.to_dict()
    try:  # validated on first use too: settings may predate `import hf_tokred` or be set by hand
        return _schedule(json.dumps(settings, sort_keys=True), config.num_hidden_layers)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"model.config.token_reduction is invalid for this {config.num_hidden_layers}-layer model: "
            f"{str(err).rstrip('.')}. Set valid settings with hf_tokred.apply_token_reduction(model, settings), "
            "or turn reduction off with hf_tokred.apply_token_reduction(model, None)"
        ) from None


# ----------------------------------------------------------------------------- outputs


@dataclass
class TokenReductionModelOutput(ModelOutput):
    """Backbone output of a reducing model.

    ``last_hidden_state`` is aligned with the input positions; positions that were removed hold NaN.
    ``computed_mask [B, N]`` tells which input positions were computed; ``kept_positions [B, M]`` lists
    them per row (-1 = padding); ``plans`` holds ``(anchor_layer, Plan)`` per anchor that reduced.
    ``hidden_states`` (if requested) are per block, in each block's own reduced layout.
    """

    last_hidden_state: torch.Tensor | None = None
    cache: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    computed_mask: torch.Tensor | None = None
    kept_positions: torch.Tensor | None = None
    plans: tuple[tuple[int, Plan], ...] | None = None


@dataclass
class TokenReductionCausalLMOutput(ModelOutput):
    """Causal-LM output of a reducing model: ``logits`` aligned with the input positions (NaN where a
    position was not computed), loss over the computed positions, plus the fields of the backbone output.

    With ``model(..., compact_logits=True)`` the logits are only those computed: ``[B, M, V]`` with column
    ``j`` at input position ``kept_positions[:, j]`` (-1: padding column), or the last ``cols`` columns of
    that when ``logits_to_keep`` limits them.  This saves the ``[B, N, V]`` NaN-filled tensor, which for a
    full-logits forward (scoring, perplexity) is most of the memory reduction can save."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    computed_mask: torch.Tensor | None = None
    kept_positions: torch.Tensor | None = None
    plans: tuple[tuple[int, Plan], ...] | None = None


# ----------------------------------------------------------------------------- the shared layer loop


@dataclass(frozen=True)
class _Prompt:
    """Set while ``generate()`` runs on a reducing model: the prompt's length and the caller's protected mask."""

    length: int
    protected_mask: torch.Tensor | None


_GENERATION: contextvars.ContextVar = contextvars.ContextVar("hf_tokred_generation", default=None)


@dataclass(frozen=True)
class ReductionRecord:
    """What one reducing forward did: ``layer_lengths[b][i]`` real tokens of row ``b`` processed by block ``i``
    (for one row: ``layer_lengths[0]``), ``input_lengths[b]`` real input tokens, the anchors that reduced, and
    ``kept_positions[b]``: the input positions of row ``b`` that reached the last block."""

    input_lengths: list[int]
    layer_lengths: list[list[int]]
    anchors: list[int]
    kept_positions: list[list[int]]


_RECORDS: contextvars.ContextVar = contextvars.ContextVar("hf_tokred_records", default=None)


@contextlib.contextmanager
def record_reduction():
    """Collect a :class:`ReductionRecord` for every reducing forward run inside the block (prefills; decode steps
    are not reduced and not recorded)::

        with hf_tokred.record_reduction() as records:
            model.generate(**inputs)
        print(records[0].layer_lengths[0])   # tokens each block computed for the prompt
    """
    records: list[ReductionRecord] = []
    token = _RECORDS.set(records)
    try:
        yield records
    finally:
        _RECORDS.reset(token)


def _protected_for(mask: torch.Tensor, B: int, prefix: int, N: int) -> torch.Tensor:
    """A caller's ``protected_mask [b, prefix]`` as ``[B, N]`` bool: rows repeated when generate expanded the batch
    (beams, ``num_return_sequences``), columns after the prompt False."""
    if mask.dim() != 2 or mask.shape[1] != prefix or B % max(mask.shape[0], 1):
        raise ValueError(f"protected_mask must have shape (batch, sequence) = {(B, prefix)}, got {tuple(mask.shape)}")
    mask = mask.to(torch.bool).repeat_interleave(B // mask.shape[0], dim=0)
    return F.pad(mask, (0, N - prefix), value=False)


@dataclass
class _Reduced:
    hidden: torch.Tensor  # [B, M, D] after norm_f
    positions: torch.Tensor  # [B, M] input position of each column, -1 for padding
    cache: Any
    all_hidden: tuple | None
    plans: tuple


def _is_fresh(cache) -> bool:
    if cache is None:
        return True
    try:
        return not cache.has_previous_state()
    except ValueError:  # a cache without linear-attention layers holds no state yet
        return True


def _anchor_block(block, hidden, cache, layer_mask, real, protected, cfg, keep_ratio, mixer_kwargs, prefix):
    """One anchor block, split into its two branches so each can be reduced before they are added.

    Only the first ``prefix`` columns (the prompt, when a no-cache ``generate`` re-runs prompt + generated tokens)
    are planned over; the columns after them are kept as they are, exactly as with a cache.
    """
    residual = hidden
    h = block.norm(hidden.to(dtype=block.norm.weight.dtype))
    if block.residual_in_fp32:
        residual = residual.to(torch.float32)
    h = block.mixer(h, cache=cache, attention_mask=layer_mask, **mixer_kwargs)
    with torch.no_grad():
        spec = cfg.spec
        plan = make_plan(h[:, :prefix].detach(), real[:, :prefix], protected[:, :prefix], keep_ratio, spec.selection,
                         cfg.metric, spec.pairs)
        if plan is not None and prefix < h.shape[1]:
            plan = extend_plan(plan, prefix, h.shape[1])
    if plan is None:
        return residual + h, None
    return _apply_both(residual, h, plan, cfg), plan


def _apply_both(residual, h, plan: Plan, cfg: TokenReductionConfig) -> torch.Tensor:
    """Reduce both branches with one plan and add them: one fused Triton kernel on CUDA, torch elsewhere."""
    if h.device.type == "cuda":
        from .kernels import fused_apply_plan

        return fused_apply_plan(residual, h, plan, cfg.residual, cfg.hidden, cfg.q)[0]
    return apply_plan_pair(residual, h, plan, cfg.residual, cfg.hidden, cfg.q)


def _reduced_backbone(
    backbone,
    cfg: TokenReductionConfig,
    schedule: ResolvedSchedule,
    input_ids=None,
    inputs_embeds=None,
    cache=None,
    use_cache=None,
    output_hidden_states=None,
    attention_mask=None,
    protected_mask=None,
    **kwargs,
) -> _Reduced:
    config = backbone.config
    family = _family(config)
    output_hidden_states = output_hidden_states if output_hidden_states is not None else config.output_hidden_states
    use_cache = use_cache if use_cache is not None else (config.use_cache if not backbone.training else False)
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds = backbone.embeddings(input_ids)
    if backbone.gradient_checkpointing and backbone.training and use_cache:
        use_cache = False
    if use_cache and cache is None:
        cache = DynamicCache(config=config)

    B, N = inputs_embeds.shape[:2]
    device = inputs_embeds.device
    _check_shapes(B, N, None, attention_mask)
    layer_mask = create_recurrent_attention_mask(
        config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache
    )
    reducing = N > 1 and _is_fresh(cache)
    prompt = _GENERATION.get()
    # inside generate(): only the prompt is reduced (a no-cache step re-runs prompt + generated tokens)
    prefix = N if prompt is None else min(prompt.length, N)
    if reducing:
        if attention_mask is not None and attention_mask.shape[1] != N:
            raise ValueError(f"attention_mask must have shape (batch, length) = {(B, N)} for a forward without a "
                             f"cache; got {tuple(attention_mask.shape)}")
        real = (
            torch.ones(B, N, dtype=torch.bool, device=device)
            if attention_mask is None
            else attention_mask.to(device=device, dtype=torch.bool)
        )
        ar = torch.arange(N, device=device)
        # The last real token of every row (of the prompt) always survives (next-token logits and the decode
        # cache need it).
        last = torch.where(real & (ar < prefix), ar, -1).max(1).values
        protected = real & (ar[None, :] == last[:, None])
        for extra in (protected_mask, None if prompt is None else prompt.protected_mask):
            if extra is not None:
                protected |= _protected_for(extra, B, prefix, N).to(device) & real
    positions = torch.arange(N, device=device).expand(B, N)
    mixer_kwargs = kwargs if family.mixer_takes_kwargs else {}
    anchors = set(schedule.anchors) if reducing and prefix > 1 else set()

    hidden = inputs_embeds
    all_hidden = () if output_hidden_states else None
    plans = []
    records = _RECORDS.get() if reducing else None
    lengths = [] if records is not None else None
    for i, block in enumerate(backbone.layers):
        if lengths is not None:
            lengths.append(real.sum(1))
        if i in anchors:
            hidden, plan = _anchor_block(
                block, hidden, cache, layer_mask, real, protected, cfg, schedule.keep_ratio, mixer_kwargs, prefix
            )
            if plan is not None:
                plans.append((i, plan))
                prefix = plan.keep.shape[1] - (real.shape[1] - prefix)  # the suffix columns are all kept
                real = reduce_along(real, plan, False)
                protected = reduce_along(protected, plan, False)
                positions = reduce_along(positions, plan, -1)
                layer_mask = None if bool(real.all()) else real.to(torch.long)
        else:
            hidden = block(hidden, cache=cache, attention_mask=layer_mask, **kwargs)
        if output_hidden_states:
            all_hidden += (hidden,)
    hidden = backbone.norm_f(hidden)
    if output_hidden_states:
        all_hidden += (hidden,)
    if records is not None:
        records.append(ReductionRecord(lengths[0].tolist(), torch.stack(lengths, 1).tolist(), [a for a, _ in plans],
                                       [p[r].tolist() for p, r in zip(positions, real)]))
    return _Reduced(hidden, positions, cache if use_cache else None, all_hidden, tuple(plans))


def _scatter_to_positions(values: torch.Tensor, positions: torch.Tensor, length: int, offset: int = 0) -> torch.Tensor:
    """Place ``values [B, M, ...]`` at ``positions - offset`` of a NaN-filled ``[B, length, ...]`` tensor."""
    B = values.shape[0]
    out = values.new_full((B, length, *values.shape[2:]), float("nan"))
    ok = (positions >= offset) & (positions < offset + length)
    rows = torch.arange(B, device=values.device)[:, None].expand_as(positions)
    out[rows[ok], positions[ok] - offset] = values[ok]
    return out


def _computed_mask(positions: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, length]`` bool: which input positions appear in ``positions`` (-1 = padding, ignored)."""
    mask = torch.zeros(positions.shape[0], length, dtype=torch.bool, device=positions.device)
    ok = positions >= 0
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)
    mask[rows[ok], positions[ok]] = True
    return mask


# ----------------------------------------------------------------------------- patched forwards


def _bind(signature: inspect.Signature, self, args, kwargs) -> dict[str, Any]:
    bound = signature.bind(self, *args, **kwargs)
    bound.apply_defaults()
    params = dict(bound.arguments)
    params.pop("self")
    extra = params.pop("kwargs", {})
    if "cache_params" in extra:  # deprecated alias transformers still accepts
        params["cache"] = extra.pop("cache_params")
    return {**params, **extra}


def _patch_backbone_forward(cls) -> None:
    original = cls.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        active = _active(self.config)
        if active is None:
            kwargs.pop("protected_mask", None)  # nothing is reduced, so every position survives
            return original(self, *args, **kwargs)
        p = _bind(signature, self, args, kwargs)
        return_dict = p.pop("return_dict")
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        r = _reduced_backbone(self, *active, **p)
        N = (p["input_ids"] if p["input_ids"] is not None else p["inputs_embeds"]).shape[1]
        out = TokenReductionModelOutput(
            last_hidden_state=_scatter_to_positions(r.hidden, r.positions, N),
            cache=r.cache,
            hidden_states=r.all_hidden,
            computed_mask=_computed_mask(r.positions, N),
            kept_positions=r.positions,
            plans=r.plans,
        )
        if not return_dict:
            return tuple(v for v in (out.last_hidden_state, out.cache, out.hidden_states) if v is not None)
        return out

    forward._hf_tokred_original = original
    cls.forward = forward


def _reduced_loss(model, logits, labels, positions, loss_kwargs) -> torch.Tensor:
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


def _check_shapes(B: int, N: int, labels, attention_mask) -> None:
    """Labels and attention mask must match the input's ``(batch, length)``: checked before any work is done."""
    if labels is not None and tuple(labels.shape) != (B, N):
        raise ValueError(f"labels must have the shape of input_ids {(B, N)} (batch, sequence); got "
                         f"{tuple(labels.shape)}. Pass one label per input position (-100 where nothing is scored).")
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[0] != B
                                       or attention_mask.shape[1] < N):
        raise ValueError(f"attention_mask must have shape (batch, length) = {(B, N)} for input of that shape; got "
                         f"{tuple(attention_mask.shape)}")


_BACKBONE_KEYS = (
    "input_ids", "inputs_embeds", "cache", "use_cache", "output_hidden_states", "attention_mask", "protected_mask"
)


def _patch_lm_forward(cls) -> None:
    original = cls.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        active = _active(self.config)
        compact = kwargs.pop("compact_logits", False)
        if active is None:
            kwargs.pop("protected_mask", None)  # every position is computed: compact and aligned logits agree
            return original(self, *args, **kwargs)
        p = _bind(signature, self, args, kwargs)
        labels, logits_to_keep = p.pop("labels"), p.pop("logits_to_keep")
        if compact and not isinstance(logits_to_keep, int):
            raise ValueError("compact_logits=True takes an int logits_to_keep (0 = every computed position); "
                             "select positions from the compact logits with kept_positions instead")
        return_dict = p.pop("return_dict")
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if labels is not None:
            x = p["input_ids"] if p["input_ids"] is not None else p["inputs_embeds"]
            _check_shapes(*x.shape[:2], labels, None)
        loss_kwargs = {k: v for k, v in p.items() if k not in _BACKBONE_KEYS}
        r = _reduced_backbone(self.backbone, *active, **{k: p.get(k) for k in _BACKBONE_KEYS})
        N = (p["input_ids"] if p["input_ids"] is not None else p["inputs_embeds"]).shape[1]
        M = r.hidden.shape[1]
        head = lambda h: self.lm_head(h.to(self.lm_head.weight.dtype)).float()  # noqa: E731
        every = head(r.hidden) if labels is not None or not isinstance(logits_to_keep, int) else None

        if isinstance(logits_to_keep, int):
            # the same positions as transformers' slice(-logits_to_keep, None): [start, N)
            start = max(N - logits_to_keep, 0) if logits_to_keep > 0 else min(-logits_to_keep, N)
            cols = min(N - start, M)  # kept positions >= start are the last columns
            part = every[:, M - cols :] if every is not None else head(r.hidden[:, M - cols :])
            # compact: only what was computed ([B, cols, V], column j at input position kept_positions[:, M-cols+j]),
            # so a full-logits forward allocates the reduced length, not a NaN-filled [B, N, V]
            logits = part if compact else _scatter_to_positions(part, r.positions[:, M - cols :], N - start,
                                                                 offset=start)
        else:
            logits = _scatter_to_positions(every, r.positions, N)[:, logits_to_keep]

        loss = None
        if labels is not None:
            loss = _reduced_loss(self, every, labels, r.positions, loss_kwargs)
        if not return_dict:
            out = tuple(v for v in (logits, r.cache, r.all_hidden) if v is not None)
            return ((loss,) + out) if loss is not None else out
        return TokenReductionCausalLMOutput(
            loss=loss,
            logits=logits,
            cache=r.cache,
            hidden_states=r.all_hidden,
            computed_mask=_computed_mask(r.positions, N),
            kept_positions=r.positions,
            plans=r.plans,
        )

    forward._hf_tokred_original = original
    cls.forward = forward


def _patch_generate(cls) -> None:
    """``generate()`` on a reducing model reduces the prompt only, with or without a cache (a no-cache step
    re-runs prompt + generated tokens; the generated tokens are kept as they are), and takes
    ``protected_mask [batch, prompt length]`` for the prompt."""
    original = cls.generate

    @functools.wraps(original)
    def generate(self, inputs=None, *args, protected_mask=None, **kwargs):
        if _active(self.config) is None:  # nothing is reduced: every position survives anyway
            return original(self, inputs, *args, **kwargs)
        prompt = next((x for x in (inputs, kwargs.get("input_ids"), kwargs.get("inputs_embeds")) if x is not None), None)
        if prompt is None:
            return original(self, inputs, *args, **kwargs)
        length = prompt.shape[1]
        if protected_mask is not None:
            protected_mask = torch.as_tensor(protected_mask)
            if tuple(protected_mask.shape) != tuple(prompt.shape[:2]):
                raise ValueError(f"protected_mask must have the prompt's shape {tuple(prompt.shape[:2])} "
                                 f"(batch, prompt length), got {tuple(protected_mask.shape)}")
        token = _GENERATION.set(_Prompt(length, protected_mask))
        try:
            return original(self, inputs, *args, **kwargs)
        finally:
            _GENERATION.reset(token)

    generate._hf_tokred_original = original
    cls.generate = generate


# ----------------------------------------------------------------------------- loading


_UNSET: Any = object()
_PENDING: contextvars.ContextVar = contextvars.ContextVar("hf_tokred_pending", default=_UNSET)


def _finish_loading(model, token_reduction, source) -> Any:
    if token_reduction is _UNSET:
        settings = getattr(getattr(model, "config", None), "token_reduction", None)
        if settings is None:
            return model
        try:
            return apply_token_reduction(model, settings)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"the token_reduction block in the config of {source!r} is invalid: {str(err).rstrip('.')}. Fix that block in "
                "config.json, or load with token_reduction=None to ignore it."
            ) from err
    return apply_token_reduction(model, token_reduction)


def _settings_only_variant(cls, source, kwargs) -> dict | None:
    """The config dict of ``source`` when it is a settings-only hf_tokred variant (no weights of its own)."""
    from .hub import VARIANT_MODEL_TYPE

    if not isinstance(source, (str, os.PathLike)) or "config" in kwargs:
        return None
    hub = {k: kwargs[k] for k in ("cache_dir", "local_files_only", "revision", "subfolder", "token") if k in kwargs}
    try:
        config, _ = PreTrainedConfig.get_config_dict(source, **hub)
    except (OSError, ValueError):
        return None
    return config if config.get("model_type") == VARIANT_MODEL_TYPE else None


def _load_variant_as(cls, source, token_reduction, args, kwargs):
    """``Mamba*ForCausalLM.from_pretrained(<settings-only variant>)``: load its base model through the variant
    loader, and check that the base model is of the class asked for."""
    from .hub import TokenReductionVariant

    if token_reduction is not _UNSET:
        kwargs = {**kwargs, "token_reduction": token_reduction}
    model = TokenReductionVariant.from_pretrained(source, *args, **kwargs)
    loaded = model[0] if isinstance(model, tuple) else model
    if not isinstance(loaded, cls):
        raise ValueError(f"{str(source)!r} is a settings-only hf_tokred variant whose base model is a "
                         f"{type(loaded).__name__}, not a {cls.__name__}; load it with "
                         "AutoModelForCausalLM.from_pretrained")
    return model


def _patch_model_from_pretrained() -> None:
    original = PreTrainedModel.from_pretrained.__func__

    @functools.wraps(original)
    def from_pretrained(cls, pretrained_model_name_or_path, *args, token_reduction=_UNSET, **kwargs):
        if token_reduction is _UNSET:
            token_reduction = _PENDING.get()
        if token_reduction is not _UNSET and token_reduction is not None:
            TokenReductionConfig.coerce(token_reduction)  # fail on bad settings before loading weights
            model_type = getattr(getattr(cls, "config_class", None), "model_type", None)
            if model_type not in FAMILIES:
                raise ValueError(
                    f"token_reduction supports MambaForCausalLM, Mamba2ForCausalLM, MambaModel and Mamba2Model; "
                    f"{cls.__name__} (model_type={model_type!r}) cannot reduce tokens. Drop token_reduction= or load a "
                    "Mamba / Mamba-2 checkpoint."
                )
        token = _PENDING.set(_UNSET)
        try:
            model = original(cls, pretrained_model_name_or_path, *args, **kwargs)
        except OSError:
            variant = _settings_only_variant(cls, pretrained_model_name_or_path, kwargs)
            if variant is None:
                raise
            return _load_variant_as(cls, pretrained_model_name_or_path, token_reduction, args, kwargs)
        finally:
            _PENDING.reset(token)
        if not isinstance(model, PreTrainedModel):  # e.g. output_loading_info=True returns a tuple
            return (_finish_loading(model[0], token_reduction, pretrained_model_name_or_path), *model[1:])
        return _finish_loading(model, token_reduction, pretrained_model_name_or_path)

    from_pretrained._hf_tokred_original = original
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def _patch_auto_from_pretrained(cls) -> None:
    """Auto classes each carry their own copy of ``from_pretrained``; wrap the one ``cls`` defines."""
    original = cls.__dict__["from_pretrained"].__func__

    @functools.wraps(original)
    def from_pretrained(cls, *args, token_reduction=_UNSET, **kwargs):
        if token_reduction is _UNSET:
            return original(cls, *args, **kwargs)
        token = _PENDING.set(token_reduction)  # handed to the concrete class's from_pretrained
        try:
            return original(cls, *args, **kwargs)
        finally:
            _PENDING.reset(token)

    from_pretrained._hf_tokred_original = original
    cls.from_pretrained = classmethod(from_pretrained)


def _patch_auto_config() -> None:
    """``AutoConfig.from_pretrained(..., token_reduction=)`` stores validated settings on a supported config and
    refuses any other config (instead of silently dropping the argument)."""
    from transformers import AutoConfig

    original = AutoConfig.__dict__["from_pretrained"].__func__

    @functools.wraps(original)
    def from_pretrained(cls, *args, token_reduction=_UNSET, **kwargs):
        loaded = original(cls, *args, **kwargs)
        if token_reduction is _UNSET:
            return loaded
        config = loaded[0] if isinstance(loaded, tuple) else loaded
        if getattr(config, "model_type", None) not in FAMILIES:
            raise ValueError(
                f"token_reduction applies to Mamba / Mamba-2 configs; this config has "
                f"model_type={getattr(config, 'model_type', None)!r}. Drop token_reduction= for this model."
            )
        if token_reduction is not None:
            token_reduction = TokenReductionConfig.coerce(token_reduction)
            token_reduction.resolve(config.num_hidden_layers)  # raises if the schedule does not fit this depth
        config.token_reduction = token_reduction
        return loaded

    from_pretrained._hf_tokred_original = original
    AutoConfig.from_pretrained = classmethod(from_pretrained)


def _auto_classes() -> list[type]:
    from transformers.models.auto import modeling_auto

    found = [_BaseAutoModelClass]
    for obj in vars(modeling_auto).values():
        if isinstance(obj, type) and issubclass(obj, _BaseAutoModelClass) and "from_pretrained" in obj.__dict__:
            found.append(obj)
    return found


_INSTALLED = False


def install() -> None:
    """Install the hooks (called by ``import hf_tokred``; safe to call again)."""
    global _INSTALLED
    if _INSTALLED:
        return
    check_transformers_version(transformers.__version__)
    from . import fastpath

    fastpath.install()
    for family in FAMILIES.values():
        family.lm_class.config_class.token_reduction = _settings_property()
        _patch_backbone_forward(family.backbone_class)
        _patch_lm_forward(family.lm_class)
        _patch_generate(family.lm_class)
    _patch_model_from_pretrained()
    _patch_auto_config()
    for auto_class in _auto_classes():
        _patch_auto_from_pretrained(auto_class)
    from . import hub

    hub.register()
    _INSTALLED = True
