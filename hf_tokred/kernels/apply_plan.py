"""Apply one :class:`~hf_tokred.reduce.Plan` to both branches at once: ``apply(residual) + apply(hidden)``.

:func:`fused_apply_plan` computes, in one pass over the data,
``reduce.apply_plan(residual, plan, residual_strategy, q) + reduce.apply_plan(hidden, plan, hidden_strategy, q)``
(gather the kept tokens, fold each source into its destination with its weight, divide by
``1 + sum of weights``, zero the left padding) and, optionally, ``reduce.reduce_along`` for the carried
per-token tensors (mask, positions, protection) in the same launch.

Semantics and precision
    Everything is accumulated in fp32 and rounded once, to ``torch.promote_types(residual.dtype,
    hidden.dtype)`` (what ``residual + hidden`` gives; fp32 whenever the residual is fp32).  For fp32
    inputs this equals the unfused reference (same summation order).  For bf16/fp16 it equals the
    reference computed in fp32 and then cast, within one ulp; the unfused low-precision path rounds each
    branch to its own dtype before the addition, so it can differ from both by those roundings.

Weights (built in torch by ``reduce._merge_weights``, so the rules are exactly the reference's)
    ``prune`` -> no weights (``None``); ``merge`` -> 1 per valid source; ``hybrid`` -> 0/1 per source
    (``[B, R, 1]``); ``hybrid_channel`` -> 0/1 per source and channel (``[B, R, D]``, which needs the
    gathered source values for its per-channel ranking).

The work is the custom op ``torch.ops.hf_tokred.apply_plan_fused`` (plan-level tensors in, output
and compacted carried tensors out).  It picks Triton or torch per call (:mod:`.dispatch`), has a
fake (meta) implementation for ``torch.compile``, a torch backward (the op is linear in both inputs;
the 0/1 weights carry no gradient, as in the reference), and a FLOPs formula for ``FlopCounterMode``.
The Triton kernel and its CSR index layout are described in ``_apply_plan_triton.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..reduce import Plan, _merge_weights, _take
from .dispatch import choose_backend, load_triton_module

__all__ = ["apply_plan_fused_reference", "fused_apply_plan"]

_OP = "apply_plan_fused"


def _branch_torch(x: Tensor, keep: Tensor, src: Tensor, dst_slot: Tensor, w: Tensor | None) -> Tensor:
    """One branch in fp32: gather kept rows, fold weighted sources into their slots, normalise."""
    out = _take(x, keep).float()
    if w is None or src.shape[1] == 0:
        return out
    slot = dst_slot[..., None]
    out.scatter_add_(1, slot.expand(-1, -1, x.shape[-1]), _take(x, src).float() * w)
    den = torch.ones(*keep.shape, w.shape[-1], device=x.device)
    den.scatter_add_(1, slot.expand(-1, -1, w.shape[-1]), w)
    return out / den


def _fused_torch(residual, hidden, keep, keep_mask, src, dst_slot, w_res, w_hid, aux, aux_fill, out_dtype):
    out = _branch_torch(residual, keep, src, dst_slot, w_res) + _branch_torch(hidden, keep, src, dst_slot, w_hid)
    out = out.masked_fill(~keep_mask.bool()[..., None], 0).to(out_dtype)
    B, M = keep.shape
    if aux is None:
        aux_out = torch.empty(0, B, M, dtype=torch.int64, device=residual.device)
    else:
        fill = torch.tensor(list(aux_fill), dtype=torch.int64, device=residual.device)[:, None, None]
        g = aux.to(torch.int64).gather(2, keep[None].expand(aux.shape[0], -1, -1))
        aux_out = torch.where(keep_mask.bool()[None], g, fill)
    return out.contiguous(), aux_out.contiguous()


def _check(residual, hidden, keep, keep_mask, src, dst_slot, w_res, w_hid, aux, aux_fill) -> None:
    if residual.dim() != 3 or hidden.shape != residual.shape:
        raise ValueError(
            f"residual and hidden must both be [B, N, D]; got {tuple(residual.shape)}, {tuple(hidden.shape)}"
        )
    B, N, D = residual.shape
    if keep.dim() != 2 or keep.shape[0] != B or keep_mask.shape != keep.shape:
        raise ValueError(f"keep/keep_mask must be [B, M] with B={B}; got {tuple(keep.shape)}, {tuple(keep_mask.shape)}")
    if src.dim() != 2 or src.shape[0] != B or dst_slot.shape != src.shape:
        raise ValueError(f"src/dst_slot must be [B, R] with B={B}; got {tuple(src.shape)}, {tuple(dst_slot.shape)}")
    for name, w in (("w_res", w_res), ("w_hid", w_hid)):
        if w is not None and (w.dim() != 3 or w.shape[:2] != src.shape or w.shape[2] not in (1, D)):
            raise ValueError(f"{name} must be [B, R, 1] or [B, R, D]; got {tuple(w.shape)}")
    if aux is not None and (aux.dim() != 3 or aux.shape[1:] != (B, N) or len(aux_fill) != aux.shape[0]):
        raise ValueError(f"aux must be [K, B, N] with K fills; got {tuple(aux.shape)} and {len(aux_fill)} fills")


@torch.library.custom_op("hf_tokred::apply_plan_fused", mutates_args=())
def _apply_plan_fused_op(
    residual: Tensor,
    hidden: Tensor,
    keep: Tensor,
    keep_mask: Tensor,
    src: Tensor,
    dst_slot: Tensor,
    w_res: Tensor | None,
    w_hid: Tensor | None,
    aux: Tensor | None,
    aux_fill: list[int],
) -> tuple[Tensor, Tensor]:
    """``(apply(residual) + apply(hidden) [B, M, D], compacted aux [K, B, M] int64)``."""
    _check(residual, hidden, keep, keep_mask, src, dst_slot, w_res, w_hid, aux, aux_fill)
    out_dtype = torch.promote_types(residual.dtype, hidden.dtype)
    args = (residual, hidden, keep, keep_mask, src, dst_slot, w_res, w_hid, aux, aux_fill, out_dtype)
    if choose_backend(_OP, residual.device) == "triton":
        return load_triton_module("_apply_plan_triton").apply_plan_fused(*args)
    return _fused_torch(*args)


@_apply_plan_fused_op.register_fake
def _(residual, hidden, keep, keep_mask, src, dst_slot, w_res, w_hid, aux, aux_fill):
    B, M = keep.shape
    out = residual.new_empty(B, M, residual.shape[-1], dtype=torch.promote_types(residual.dtype, hidden.dtype))
    k = 0 if aux is None else aux.shape[0]
    return out, keep.new_empty(k, B, M, dtype=torch.int64)


def _setup_context(ctx, inputs, output) -> None:
    residual, hidden, keep, keep_mask, src, dst_slot, w_res, w_hid, _aux, _fill = inputs
    ctx.save_for_backward(keep, keep_mask, src, dst_slot, w_res, w_hid)
    ctx.meta = (residual.shape, residual.dtype, hidden.dtype)


def _branch_grad(g: Tensor, keep, src, dst_slot, w: Tensor | None, N: int, dtype) -> Tensor:
    B, M, D = g.shape
    grad = torch.zeros(B, N, D, dtype=torch.float32, device=g.device)
    if w is not None and src.shape[1]:
        slot = dst_slot[..., None]
        den = torch.ones(B, M, w.shape[-1], device=g.device).scatter_add_(1, slot.expand(-1, -1, w.shape[-1]), w)
        g = g / den
        grad.scatter_add_(1, src[..., None].expand(-1, -1, D), _take(g, dst_slot) * w)
    grad.scatter_add_(1, keep[..., None].expand(-1, -1, D), g)
    return grad.to(dtype)


def _backward(ctx, grad_out, _grad_aux):
    keep, keep_mask, src, dst_slot, w_res, w_hid = ctx.saved_tensors
    (B, N, D), res_dtype, hid_dtype = ctx.meta
    g = grad_out.float().masked_fill(~keep_mask.bool()[..., None], 0)
    g_res = _branch_grad(g, keep, src, dst_slot, w_res, N, res_dtype) if ctx.needs_input_grad[0] else None
    g_hid = _branch_grad(g, keep, src, dst_slot, w_hid, N, hid_dtype) if ctx.needs_input_grad[1] else None
    return g_res, g_hid, None, None, None, None, None, None, None, None


_apply_plan_fused_op.register_autograd(_backward, setup_context=_setup_context)


def _flops(residual, hidden, keep, keep_mask, src, dst_slot, w_res, w_hid, aux, aux_fill, out_shape=None, **kw) -> int:
    """Multiply-adds of the weighted sums (counted as 2 FLOPs, over all R sources), the divisions and the
    branch sum; gathers and copies are free, as in FlopCounterMode's other formulas."""
    B, _, D = residual
    M = keep[1]
    R = src[1]
    flops = B * M * D  # residual + hidden
    for w in (w_res, w_hid):
        if w is not None:
            flops += 2 * B * R * D + B * M * D  # w * x + acc, then acc / den
    return flops


def _register_flops() -> None:
    from torch.utils.flop_counter import register_flop_formula

    register_flop_formula(torch.ops.hf_tokred.apply_plan_fused)(_flops)


_register_flops()


_STRATEGIES = ("prune", "merge", "hybrid", "hybrid_channel")


def _weights(x: Tensor, plan: Plan, strategy: str, q: float) -> Tensor | None:
    if strategy not in _STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; allowed: {', '.join(_STRATEGIES)}")
    if plan.src.shape[1] == 0 or strategy == "prune":
        return None
    x_src = _take(x, plan.src) if strategy == "hybrid_channel" else None
    w = _merge_weights(plan, strategy, q, x_src)
    return None if w is None else w.detach()


def fused_apply_plan(
    residual: Tensor,
    hidden: Tensor,
    plan: Plan,
    residual_strategy: str = "merge",
    hidden_strategy: str = "hybrid",
    q: float = 0.5,
    carry: Sequence[Tensor] = (),
    fills: Sequence[int | bool] = (),
) -> tuple[Tensor, list[Tensor]]:
    """``apply_plan(residual, ...) + apply_plan(hidden, ...)`` in one kernel, plus ``reduce_along`` for ``carry``.

    Args:
        residual, hidden: the two branches, ``[B, N, D]`` (any dtypes; the output has their promoted dtype).
        plan: from :func:`hf_tokred.reduce.make_plan`.
        residual_strategy, hidden_strategy: ``prune`` | ``merge`` | ``hybrid`` | ``hybrid_channel``.
        q: prune share of the hybrid strategies.
        carry: per-token tensors ``[B, N]`` (bool or integer) to compact with the plan, e.g. the real-token
            mask and the position map; ``fills[i]`` is the value written at padding slots.

    Returns:
        ``(out [B, M, D], [reduce_along(t, plan, fill) for t, fill in zip(carry, fills)])``.
    """
    if len(carry) != len(fills):
        raise ValueError(f"carry has {len(carry)} tensors but fills has {len(fills)} values")
    for t in carry:
        if t.is_floating_point() or t.shape != residual.shape[:2]:
            raise ValueError(f"carried tensors must be bool/integer [B, N]; got {t.dtype} {tuple(t.shape)}")
    w_res = _weights(residual, plan, residual_strategy, q)
    w_hid = _weights(hidden, plan, hidden_strategy, q)
    aux = torch.stack([t.to(torch.int64) for t in carry]) if carry else None
    out, aux_out = torch.ops.hf_tokred.apply_plan_fused(
        residual, hidden, plan.keep, plan.keep_mask, plan.src, plan.dst_slot, w_res, w_hid, aux,
        [int(f) for f in fills],
    )
    return out, [a.to(t.dtype) for a, t in zip(aux_out, carry)]


def _documented_merge_count(r: int, q: float) -> int:
    """``floor(r * (1 - q))`` for the ``q`` the user meant: ``q`` is read as the simplest fraction within float
    rounding of it (``0.8`` -> 4/5, ``1/3`` -> 1/3), so ``r * (1 - q)`` is exact (``5 * (1 - 0.8)`` is 1, not
    0.9999999999999998)."""
    from fractions import Fraction

    return math.floor(r * (1 - Fraction(q).limit_denominator(10**6)))


def _documented_weights(x: Tensor, plan: Plan, strategy: str, q: float) -> Tensor | None:
    """0/1 merge weights ``[B, R, D]`` by the documented rule of each strategy, row by row in Python (independent
    of :func:`hf_tokred.reduce._merge_weights`, which the kernel uses):

    * ``prune``: none; ``merge``: every valid source;
    * ``hybrid``: of a row's ``r`` valid sources, the ``floor(r (1 - q))`` with the highest importance
      (``src_score``; ties: the earlier source) merge, the others are pruned;
    * ``hybrid_channel``: per channel, the ``floor(r (1 - q))`` sources with the largest value in that channel
      (ties: the earlier source) merge.
    """
    if strategy not in _STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; allowed: {', '.join(_STRATEGIES)}")
    if strategy == "prune":
        return None
    B, R = plan.src.shape
    D = x.shape[-1]
    w = torch.zeros(B, R, D)
    for b in range(B):
        valid = [i for i in range(R) if bool(plan.src_mask[b, i])]
        k = _documented_merge_count(len(valid), q)
        if strategy == "merge":
            w[b, valid] = 1.0
        elif strategy == "hybrid":
            score = plan.src_score[b].tolist()
            for i in sorted(valid, key=lambda i: (-score[i], i))[:k]:
                w[b, i] = 1.0
        else:
            values = x[b, plan.src[b]].detach().float().cpu()  # [R, D]
            for d in range(D):
                col = values[:, d].tolist()
                for i in sorted(valid, key=lambda i: (-col[i], i))[:k]:
                    w[b, i, d] = 1.0
    return w.to(x.device)


def _reference_branch(x: Tensor, plan: Plan, strategy: str, q: float) -> Tensor:
    """One branch: kept rows, each destination ``(x_dst + sum_i w_i x_src_i) / (1 + sum_i w_i)`` in fp32, padding
    zeroed, cast back to ``x.dtype``."""
    w = _documented_weights(x, plan, strategy, q)
    out = _take(x, plan.keep).float()
    if w is not None and plan.src.shape[1]:
        slot = plan.dst_slot[..., None].expand(-1, -1, x.shape[-1])
        out = out.scatter_add(1, slot, _take(x, plan.src).float() * w)
        den = torch.ones_like(out).scatter_add(1, slot, w)
        out = out / den
    return out.masked_fill(~plan.keep_mask[..., None], 0).to(x.dtype)


def apply_plan_fused_reference(
    residual: Tensor, hidden: Tensor, plan: Plan, residual_strategy: str = "merge", hidden_strategy: str = "hybrid",
    q: float = 0.5,
) -> Tensor:
    """The torch reference: each branch reduced on its own (merge weights from the documented rule, not from the
    helpers the kernel shares with :mod:`hf_tokred.reduce`) and rounded to its dtype, then summed."""
    return _reference_branch(residual, plan, residual_strategy, q) + _reference_branch(hidden, plan, hidden_strategy, q)
