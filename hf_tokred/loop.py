"""The reducing layer loop, shared by every family: blocks run one by one, anchors shrink the sequence between them.

At an anchor the block is split into its two branches (``residual`` and ``h = mixer(norm(x))``); a plan is made
once from ``h`` and applied to both before they are added (Falcon-H1: ``h`` also holds the attention that runs beside
the mixer on the same normalised input; the plan is made from the SSM mixer's part).  The attention mask, the
protected positions and the map to input positions shrink with the sequence.  Inside ``generate()`` only the prompt is reduced: a no-cache
step re-runs prompt + generated tokens, and the generated tokens are kept as they are, so ``use_cache`` changes
speed only.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from .compat import cache_kwargs, layer_cache_kwargs, merged_use_cache, recurrent_mask
from .config import ResolvedSchedule, TokenReductionConfig
from .families import family_of
from .hybrid_layers import ATTENTION_KINDS
from .hybrid import AttentionLayers, check_attention_implementation, default_positions, note_seen
from .ops import fused_apply_plan
from .outputs import ReductionRecord, current_recorder
from .reduce import Plan, apply_plan_pair, extend_plan, make_plan, merge_weights
from .tokens import Tokens, start_tokens, warn_over_budget

__all__ = ["Reduced", "check_shapes", "generation_prompt", "reduced_backbone"]


@dataclass(frozen=True)
class _Prompt:
    """Set while ``generate()`` runs on a reducing model: the prompt's length and the caller's protected mask."""

    length: int
    protected_mask: torch.Tensor | None
    question_length: Any = None


_GENERATION: contextvars.ContextVar = contextvars.ContextVar("hf_tokred_generation", default=None)


@contextlib.contextmanager
def generation_prompt(length: int, protected_mask: torch.Tensor | None, question_length=None):
    """Within the block, reducing forwards reduce only the first ``length`` positions (the prompt), whose last
    ``question_length`` real tokens (the question) are kept exactly as they are."""
    token = _GENERATION.set(_Prompt(length, protected_mask, question_length))
    try:
        yield
    finally:
        _GENERATION.reset(token)


@dataclass
class Reduced:
    hidden: torch.Tensor  # [B, M, D] after norm_f
    positions: torch.Tensor  # [B, M] input position of each column, -1 for padding
    cache: Any
    all_hidden: tuple | None
    plans: tuple


def check_shapes(B: int, N: int, labels, attention_mask) -> None:
    """Labels and attention mask must match the input's ``(batch, length)``: checked before any work is done."""
    if labels is not None and tuple(labels.shape) != (B, N):
        raise ValueError(f"labels must have the shape of input_ids {(B, N)} (batch, sequence); got "
                         f"{tuple(labels.shape)}. Pass one label per input position (-100 where nothing is scored).")
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[0] != B
                                       or attention_mask.shape[1] < N):
        raise ValueError(f"attention_mask must have shape (batch, length) = {(B, N)} for input of that shape; got "
                         f"{tuple(attention_mask.shape)}")


def _mamba_use_cache(backbone, use_cache: bool | None) -> bool:
    """``use_cache`` as transformers' Mamba / Mamba-2 / Falcon Mamba backbones resolve it: the config's value in eval
    mode, off while training unless passed, off under gradient checkpointing while training."""
    if use_cache is None:
        use_cache = backbone.config.use_cache and not backbone.training
    return bool(use_cache) and not (backbone.gradient_checkpointing and backbone.training)


def _is_fresh(cache, first_ssm: int | None = None) -> bool:
    """Whether ``cache`` holds nothing yet.  Hybrids ask their first SSM layer (transformers 5.22's cache counts a
    Nemotron-H feed-forward layer as a stateful layer that never gets a state)."""
    if cache is None:
        return True
    try:
        return not cache.has_previous_state(first_ssm)
    except ValueError:  # a cache without linear-attention layers holds no state yet
        return True


def _apply_both(residual, h, plan: Plan, cfg: TokenReductionConfig, timer) -> torch.Tensor:
    """Reduce both branches with one plan and add them: one fused Triton kernel on CUDA (it adds as it gathers),
    torch elsewhere, on ``residual + h`` (the block's own output, computed as the dense block computes it: not
    timed as the reduction's cost)."""
    if h.device.type == "cuda":
        with timer("apply"):
            take = lambda x: x.gather(1, plan.src[..., None].expand(-1, -1, x.shape[-1]))  # noqa: E731
            w_res, w_hid = (merge_weights(plan, st, cfg.q, take(x) if st == "hybrid_channel" else None)
                            for x, st in ((residual, cfg.residual), (h, cfg.hidden)))
            return fused_apply_plan(residual, h, plan.keep, plan.keep_mask, plan.src, plan.dst_slot, w_res, w_hid)
    total = residual + h
    with timer("apply"):
        return apply_plan_pair(residual, h, plan, cfg.residual, cfg.hidden, cfg.q, total)


class _Captured:
    def __init__(self, mixer, family) -> None:
        self.mixer, self.family, self.value = mixer, family, None

    def __call__(self, module, inputs, output) -> None:
        with torch.no_grad():
            self.value = self.family.delta(self.mixer, inputs, output)

    def get(self) -> torch.Tensor:
        if self.value is None:
            raise RuntimeError("the 'delta' importance metric could not read the anchor mixer's step sizes (its "
                               f"{self.family.delta_source} was not called: a fused training kernel?); run the model "
                               "in eval mode, or use another metric")
        return self.value


@contextlib.contextmanager
def _step_sizes(mixer, family, wanted: bool):
    """While the mixer runs, capture the step sizes of its SSM (``[B, L]``; the families table says where)."""
    if not wanted:
        yield None
        return
    captured = _Captured(mixer, family)
    handle = getattr(mixer, family.delta_source).register_forward_hook(captured)
    try:
        yield captured
    finally:
        handle.remove()


def _plan_at(block, family, hidden, cache, layer_mask, tokens: Tokens, cfg, removal, mixer_kwargs, timer,
             mixer_timed: str | None = None, branch=None):
    """An anchor block's two branches (``residual``, ``h = mixer(norm(x))``) and the plan made from ``h``.

    Only the first ``prefix`` columns (the prompt, when a no-cache ``generate`` re-runs prompt + generated tokens)
    are planned over; the columns after them are kept as they are, exactly as with a cache.  ``mixer_timed``: the
    record field the mixer's time goes to (the scoring pass of a method that re-runs its anchor).  ``branch``: what a
    layer with attention beside its mixer (Falcon-H1) adds to ``h`` from the same normalised input; the plan is
    made from the SSM mixer's output alone (``family.plan_from_sum``: from the sum of both branches).
    """
    norm, mixer = getattr(block, family.norm_attr), getattr(block, family.mixer_attr)
    residual = hidden
    normed = norm(hidden.to(dtype=norm.weight.dtype))
    if getattr(block, "residual_in_fp32", False):
        residual = residual.to(torch.float32)
    metric = cfg.importance_metric
    timed = timer(mixer_timed) if mixer_timed else contextlib.nullcontext()
    with timed, _step_sizes(mixer, family, metric == "delta") as delta:
        h = mixer(normed, **cache_kwargs(cache), attention_mask=layer_mask, **mixer_kwargs)
    if family.residual_multiplier:
        h = h * getattr(block, family.residual_multiplier)
    both = h if branch is None else h + branch(normed)
    source = both if family.plan_from_sum else h
    prefix = tokens.prefix
    with torch.no_grad(), timer("plan"):
        spec = cfg.spec
        scores = None if delta is None else delta.get()[:, :prefix]
        frozen = None if tokens.frozen is None else tokens.frozen[:, :prefix]
        plan = make_plan(source[:, :prefix].detach(), tokens.real[:, :prefix], tokens.protected[:, :prefix], None,
                         spec.selection, metric, spec.pairs, scores, spec.protected_receive, removal, frozen,
                         cfg.match_window)
        if plan is not None:  # the columns after the prompt are kept (none without them: the same plan)
            plan = extend_plan(plan, prefix, h.shape[1])
    return residual, both, plan


def _anchor_block(block, family, hidden, cache, layer_mask, tokens, cfg, removal, mixer_kwargs, timer, branch=None):
    """One anchor block, split into its two branches so each can be reduced before they are added; a hybrid
    layer's feed-forward half then runs on the reduced sequence (it is per token)."""
    residual, h, plan = _plan_at(block, family, hidden, cache, layer_mask, tokens, cfg, removal, mixer_kwargs, timer,
                                 branch=branch)
    out = residual + h if plan is None else _apply_both(residual, h, plan, cfg, timer)
    return (out if family.feed_forward is None else family.feed_forward(block, out)), plan


def _prefilter(block, family, hidden, layer_mask, tokens, cfg, removal, mixer_kwargs, timer):
    """A method that re-runs its anchor (``MethodSpec.rerun``): a first pass of the anchor's mixer, which writes
    no cache, scores the tokens; the plan prunes the anchor's *input*, so the anchor block itself and every block
    after it run on the kept tokens only (the caller runs it)."""
    if not any(removal(n) for n in tokens.prompt_lengths()):
        return hidden, None  # every row within the budget: no scoring pass, the block runs as dense
    _, _, plan = _plan_at(block, family, hidden, None, layer_mask, tokens, cfg, removal, mixer_kwargs, timer, "score")
    if plan is None:
        return hidden, None
    with timer("apply"):
        hidden = apply_plan_pair(hidden, None, plan, "prune")
    return hidden, replace(plan, rerun=True)


def _output(out):
    """A block's hidden states (hybrid decoder layers may return ``(hidden, attention weights)``)."""
    return out[0] if isinstance(out, tuple) else out


def _embed(backbone, family, input_ids, inputs_embeds):
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    looked_up = inputs_embeds is None
    if looked_up:
        inputs_embeds = getattr(backbone, family.embeddings_attr)(input_ids)
    if family.embedding_multiplier and (looked_up or not family.multiplier_on_lookup_only):
        inputs_embeds = inputs_embeds * getattr(backbone.config, family.embedding_multiplier)
    return inputs_embeds


def _attention_layers(backbone, family, cache, position_ids, use_cache, fresh, inputs_embeds):
    """A hybrid's attention layers inside the loop, at the original positions (``None`` for a pure SSM)."""
    if not family.hybrid:
        return None
    check_attention_implementation(backbone.config)
    (B, N), device = inputs_embeds.shape[:2], inputs_embeds.device
    original = (default_positions(cache, B, N, fresh, device) if position_ids is None
                else position_ids.to(device).expand(B, N))
    embeddings = inputs_embeds.clone() if family.shared_attention_reads_embeddings else None
    return AttentionLayers(backbone, family, cache, original, use_cache, fresh, embeddings)


def _anchor(i, block, family, hidden, t: Tokens, cfg, schedule, anchor_index, attention, cache, **kw):
    """Block ``i`` as an anchor: the plan, and the hidden states after it (the block's output, or for a method that
    re-runs its anchor, the block's kept input); the columns' state and the attention layers follow the plan."""
    removal = functools.partial(schedule.removal, anchor_index=anchor_index)
    if cfg.spec.rerun:
        hidden, plan = _prefilter(block, family, hidden, tokens=t, cfg=cfg, removal=removal, **kw)
    else:
        branch = None
        if family.parallel_branch is not None:  # attention beside the mixer, on the unreduced columns
            attend = functools.partial(attention.attend, layer=i, real=t.real)
            branch = functools.partial(family.parallel_branch, block, attend=attend)
        hidden, plan = _anchor_block(block, family, hidden, cache, tokens=t, cfg=cfg, removal=removal,
                                     branch=branch, **kw)
    if plan is not None:
        t.shrink(plan)
        if attention is not None:
            attention.shrink(plan, "prune" if plan.rerun else cfg.residual, cfg.q)
    return hidden, plan


def _layer(block, i, kind, hidden, attention, t: Tokens, layer_mask, block_cache, kwargs):
    """A block that is not an anchor (or the re-run of one) on the current columns."""
    if kind in ATTENTION_KINDS:
        return attention(block, i, hidden, t.real, layer_mask)
    mask = layer_mask if kind == "ssm" else None
    return _output(block(hidden, **block_cache, attention_mask=mask, **kwargs))


def reduced_backbone(backbone, cfg: TokenReductionConfig, schedule: ResolvedSchedule, input_ids=None,
                     inputs_embeds=None, cache=None, use_cache=None, output_hidden_states=None, attention_mask=None,
                     protected_mask=None, position_ids=None, question_length=None, **kwargs) -> Reduced:
    """The backbone's forward with reduction after the schedule's anchors (the stock loop otherwise).

    ``question_length``: the last tokens of each row's prompt are a question, kept exactly as they are.
    Hybrids: attention layers get the reduced sequence with the original positions (:mod:`hf_tokred.hybrid`),
    feed-forward / MoE layers run per token, and ``kwargs`` are not passed on."""
    config = backbone.config
    family = family_of(config)
    output_hidden_states = output_hidden_states if output_hidden_states is not None else config.output_hidden_states
    use_cache = (merged_use_cache if family.merged_use_cache else _mamba_use_cache)(backbone, use_cache=use_cache)
    inputs_embeds = _embed(backbone, family, input_ids, inputs_embeds)
    if use_cache and cache is None:
        cache = DynamicCache(config=config)

    B, N = inputs_embeds.shape[:2]
    device = inputs_embeds.device
    check_shapes(B, N, None, attention_mask)
    layer_mask = recurrent_mask(config, inputs_embeds, attention_mask, cache)
    kinds = family.kinds(config)
    fresh = _is_fresh(cache, family.anchor_layers(config)[0] if family.hybrid else None)
    reducing = N > 1 and fresh
    prompt = _GENERATION.get() or _Prompt(N, None)
    if reducing and attention_mask is not None and attention_mask.shape[1] != N:
        raise ValueError(f"attention_mask must have shape (batch, length) = {(B, N)} for a forward without a "
                         f"cache; got {tuple(attention_mask.shape)}")
    t = start_tokens(B, N, device, attention_mask, prompt, reducing, cfg, schedule, protected_mask, question_length)
    attention = _attention_layers(backbone, family, cache, position_ids, use_cache, fresh, inputs_embeds)
    if attention is not None:
        kwargs = {}
    block_cache = layer_cache_kwargs(cache) if family.hybrid else cache_kwargs(cache)
    mixer_kwargs = kwargs if family.mixer_takes_kwargs else {}
    anchors = {a: j for j, a in enumerate(schedule.anchors)} if reducing and t.prefix > 1 else {}
    recorder = current_recorder() if reducing else None
    record = ReductionRecord() if recorder is not None else None
    timer = (lambda what: recorder.timed(record, what, device)) if recorder else (lambda what: contextlib.nullcontext())

    hidden = inputs_embeds
    all_hidden = () if output_hidden_states else None
    plans, lengths = [], []
    for i, (block, kind) in enumerate(zip(backbone.layers, kinds)):
        if record is not None:
            lengths.append(t.real.sum(1))
        plan = None
        if i in anchors:
            hidden, plan = _anchor(i, block, family, hidden, t, cfg, schedule, anchors[i], attention, cache,
                                   layer_mask=layer_mask, mixer_kwargs=mixer_kwargs, timer=timer)
            if plan is not None:
                plans.append((i, plan))
                layer_mask = None if bool(t.real.all()) else t.real.to(torch.long)
                if record is not None and plan.rerun:  # the anchor runs again, on the kept tokens
                    lengths[-1] = lengths[-1] + t.real.sum(1)
        if i not in anchors or cfg.spec.rerun:  # else the anchor block ran, split into its branches
            hidden = _layer(block, i, kind, hidden, attention, t, layer_mask, block_cache, kwargs)
        if output_hidden_states:
            all_hidden += (hidden,)
    hidden = getattr(backbone, family.final_norm_attr)(hidden)
    if output_hidden_states:
        all_hidden += (hidden,)
    if family.hybrid:  # a cache passed with use_cache=False is still written by the layers, as in stock
        note_seen(cache, N, fresh)
    if plans:
        warn_over_budget(schedule, t)
    if record is not None:
        record.input_lengths = lengths[0].tolist()
        record.layer_lengths = torch.stack(lengths, 1).tolist()
        record.anchors = [a for a, _ in plans]
        record.kept_positions = [p[r].tolist() for p, r in zip(t.positions, t.real)]
        recorder.records.append(record)
    return Reduced(hidden, t.positions, cache if use_cache else None, all_hidden, tuple(plans))
