"""One plan applied to both branches of an anchor block in one kernel: ``apply(residual) + apply(hidden)``.

:func:`fused_apply_plan` takes the plan as tensors (kept token indices and their mask, removed sources and the
output slot each merges into) and the merge weights of each branch (built by the caller with
:func:`hf_tokred.reduce.merge_weights`; ``None`` prunes that branch's sources).  Per output row: gather the
kept token of both branches, fold each source in with its weight, divide by ``1 + sum of weights``, add the
branches, zero the left padding.  It computes what :func:`hf_tokred.reduce.apply_plan_pair` computes (the tests
compare the two); this module never imports :mod:`hf_tokred.reduce`.

Semantics and precision
    Everything is accumulated in fp32 and rounded once, to ``torch.promote_types(residual.dtype,
    hidden.dtype)`` (what ``residual + hidden`` gives; fp32 whenever the residual is fp32).  For fp32 inputs
    this equals the unfused torch path.  For bf16/fp16 it equals that path computed in fp32 and then cast,
    within one ulp; the unfused low-precision path rounds each branch to its own dtype before the addition.

The work is the custom op ``torch.ops.hf_tokred.apply_plan_fused``: the Triton kernel on CUDA (and on CPU under
``TRITON_INTERPRET=1``, how the tests run it), a torch implementation on CPU otherwise (see :mod:`.dispatch`),
a fake (meta) implementation for ``torch.compile``, a torch backward (the op is linear in both inputs; the 0/1
weights carry no gradient), and a FLOPs formula for ``FlopCounterMode``.  The Triton kernel and its CSR index
layout are described in ``_apply_plan_triton.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .dispatch import choose_backend, load_triton_module

__all__ = ["fused_apply_plan"]

_OP = "apply_plan_fused"


def _rows(x: Tensor, idx: Tensor) -> Tensor:
    """``x [B, N, D]`` gathered along dim 1 with ``idx [B, K]``."""
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


def _branch_torch(x: Tensor, keep: Tensor, src: Tensor, dst_slot: Tensor, w: Tensor | None) -> Tensor:
    """One branch in fp32: gather kept rows, fold weighted sources into their slots, normalise."""
    out = _rows(x, keep).float()
    if w is None or src.shape[1] == 0:
        return out
    slot = dst_slot[..., None]
    out.scatter_add_(1, slot.expand(-1, -1, x.shape[-1]), _rows(x, src).float() * w)
    den = torch.ones(*keep.shape, w.shape[-1], device=x.device)
    den.scatter_add_(1, slot.expand(-1, -1, w.shape[-1]), w)
    return out / den


def _check(residual, hidden, keep, keep_mask, src, dst_slot, w_res, w_hid) -> None:
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
) -> Tensor:
    """``apply(residual) + apply(hidden)``, ``[B, M, D]``."""
    _check(residual, hidden, keep, keep_mask, src, dst_slot, w_res, w_hid)
    out_dtype = torch.promote_types(residual.dtype, hidden.dtype)
    if choose_backend(_OP, residual.device) == "triton":
        return load_triton_module("_apply_plan_triton").apply_plan_fused(
            residual, hidden, keep, keep_mask, src, dst_slot, w_res, w_hid, out_dtype)
    out = _branch_torch(residual, keep, src, dst_slot, w_res) + _branch_torch(hidden, keep, src, dst_slot, w_hid)
    return out.masked_fill(~keep_mask.bool()[..., None], 0).to(out_dtype).contiguous()


@_apply_plan_fused_op.register_fake
def _(residual, hidden, keep, keep_mask, src, dst_slot, w_res, w_hid):
    B, M = keep.shape
    return residual.new_empty(B, M, residual.shape[-1], dtype=torch.promote_types(residual.dtype, hidden.dtype))


def _setup_context(ctx, inputs, output) -> None:
    residual, hidden, keep, keep_mask, src, dst_slot, w_res, w_hid = inputs
    ctx.save_for_backward(keep, keep_mask, src, dst_slot, w_res, w_hid)
    ctx.meta = (residual.shape, residual.dtype, hidden.dtype)


def _branch_grad(g: Tensor, keep, src, dst_slot, w: Tensor | None, N: int, dtype) -> Tensor:
    B, M, D = g.shape
    grad = torch.zeros(B, N, D, dtype=torch.float32, device=g.device)
    if w is not None and src.shape[1]:
        slot = dst_slot[..., None]
        den = torch.ones(B, M, w.shape[-1], device=g.device).scatter_add_(1, slot.expand(-1, -1, w.shape[-1]), w)
        g = g / den
        grad.scatter_add_(1, src[..., None].expand(-1, -1, D), _rows(g, dst_slot) * w)
    grad.scatter_add_(1, keep[..., None].expand(-1, -1, D), g)
    return grad.to(dtype)


def _backward(ctx, grad_out):
    keep, keep_mask, src, dst_slot, w_res, w_hid = ctx.saved_tensors
    (B, N, D), res_dtype, hid_dtype = ctx.meta
    g = grad_out.float().masked_fill(~keep_mask.bool()[..., None], 0)
    g_res = _branch_grad(g, keep, src, dst_slot, w_res, N, res_dtype) if ctx.needs_input_grad[0] else None
    g_hid = _branch_grad(g, keep, src, dst_slot, w_hid, N, hid_dtype) if ctx.needs_input_grad[1] else None
    return g_res, g_hid, None, None, None, None, None, None


_apply_plan_fused_op.register_autograd(_backward, setup_context=_setup_context)


def _flops(residual, hidden, keep, keep_mask, src, dst_slot, w_res, w_hid, out_shape=None, **kw) -> int:
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


register_flop_formula(torch.ops.hf_tokred.apply_plan_fused)(_flops)


def fused_apply_plan(residual: Tensor, hidden: Tensor, keep: Tensor, keep_mask: Tensor, src: Tensor,
                     dst_slot: Tensor, w_res: Tensor | None, w_hid: Tensor | None) -> Tensor:
    """``apply(residual) + apply(hidden)`` in one kernel.

    Args:
        residual, hidden: the two branches, ``[B, N, D]`` (any dtypes; the output has their promoted dtype).
        keep, keep_mask: kept token indices ``[B, M]`` (right-aligned; ``keep_mask`` False at left padding).
        src, dst_slot: removed tokens ``[B, R]`` and the output slot (column of ``keep``) each merges into.
        w_res, w_hid: merge weights ``[B, R, 1]`` or ``[B, R, D]`` (0 = pruned), or ``None`` to prune all.
    """
    detach = (lambda w: None if w is None else w.detach())  # noqa: E731 - weights are 0/1 selections
    return torch.ops.hf_tokred.apply_plan_fused(residual, hidden, keep, keep_mask, src, dst_slot, detach(w_res),
                                                detach(w_hid))
