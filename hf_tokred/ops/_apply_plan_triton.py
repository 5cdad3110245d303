"""Triton kernel behind ``hf_tokred::apply_plan_fused`` (imported lazily, on first use).

Index layout (built in torch by :func:`build_csr`, no host synchronisation):

* every source ``(b, r)`` with a nonzero weight in either branch gets the key ``b * M + dst_slot[b, r]``;
  inactive sources (invalid, or pruned in both branches) get the sentinel key ``B * M``;
* a stable ``argsort`` of the keys gives ``order`` (sources of one kept slot are contiguous and keep
  their ``r`` order, i.e. the same summation order as the reference ``scatter_add_``);
* ``row_ptr [B*M + 1]`` is the exclusive cumulative count per key (CSR row pointers), ``nz_tok[j]`` the
  source's token index in its row and ``nz_r[j] = b * R + r`` its index in the weight tensors.

Kernel grid ``(B * M, cdiv(D, BLOCK_D))``: one program per output row (kept slot) and channel block.
It loads the kept token of both branches, walks its CSR segment accumulating ``w * x_src`` and ``w``
per branch in fp32, divides by ``1 + sum w``, adds the branches, zeroes padding slots and stores in the
output dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .dispatch import LAUNCH_SPACE, kernel_dtype

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# weight modes per branch (constexpr)
PRUNE, TOKEN, CHANNEL = 0, 1, 2


@triton.jit
def _apply_plan_fused_kernel(
    res_ptr, hid_ptr, out_ptr,
    keep_ptr, kmask_ptr,
    row_ptr, nz_tok_ptr, nz_r_ptr,
    wr_ptr, wh_ptr,
    M, D,
    s_rb, s_rn, s_rd,
    s_hb, s_hn, s_hd,
    s_wr, s_wh,
    RES_MODE: tl.constexpr, HID_MODE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # b * M + m
    pid_d = tl.program_id(1)
    b = pid // M
    tok = tl.load(keep_ptr + pid)
    valid = tl.load(kmask_ptr + pid) != 0
    offs = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs < D

    acc_r = tl.load(res_ptr + b * s_rb + tok * s_rn + offs * s_rd, mask=dmask, other=0.0).to(tl.float32)
    acc_h = tl.load(hid_ptr + b * s_hb + tok * s_hn + offs * s_hd, mask=dmask, other=0.0).to(tl.float32)
    den_r = tl.full([BLOCK_D], 1.0, tl.float32)
    den_h = tl.full([BLOCK_D], 1.0, tl.float32)

    if RES_MODE + HID_MODE > 0:
        start = tl.load(row_ptr + pid)
        end = tl.load(row_ptr + pid + 1)
        for j in range(start, end):
            s = tl.load(nz_tok_ptr + j)
            q = tl.load(nz_r_ptr + j)
            if RES_MODE == 1:
                w = tl.load(wr_ptr + q)
                x = tl.load(res_ptr + b * s_rb + s * s_rn + offs * s_rd, mask=dmask, other=0.0).to(tl.float32)
                acc_r += w * x
                den_r += w
            if RES_MODE == 2:
                w = tl.load(wr_ptr + q * s_wr + offs, mask=dmask, other=0.0)
                x = tl.load(res_ptr + b * s_rb + s * s_rn + offs * s_rd, mask=dmask, other=0.0).to(tl.float32)
                acc_r += w * x
                den_r += w
            if HID_MODE == 1:
                w = tl.load(wh_ptr + q)
                x = tl.load(hid_ptr + b * s_hb + s * s_hn + offs * s_hd, mask=dmask, other=0.0).to(tl.float32)
                acc_h += w * x
                den_h += w
            if HID_MODE == 2:
                w = tl.load(wh_ptr + q * s_wh + offs, mask=dmask, other=0.0)
                x = tl.load(hid_ptr + b * s_hb + s * s_hn + offs * s_hd, mask=dmask, other=0.0).to(tl.float32)
                acc_h += w * x
                den_h += w
    if RES_MODE > 0:
        acc_r = acc_r / den_r
    if HID_MODE > 0:
        acc_h = acc_h / den_h
    out = tl.where(valid, acc_r + acc_h, 0.0)
    tl.store(out_ptr + pid * D + offs, out.to(out_ptr.dtype.element_ty), mask=dmask)


def build_csr(src, dst_slot, w_res, w_hid, M):
    """CSR of active sources per kept slot (see the module docstring): ``row_ptr, nz_tok, nz_r``."""
    B, R = src.shape
    device = src.device
    active = torch.zeros(B, R, dtype=torch.bool, device=device)
    for w in (w_res, w_hid):
        if w is not None:
            active |= (w != 0).any(-1)
    rows = torch.arange(B, device=device)[:, None]
    key = torch.where(active, rows * M + dst_slot, B * M).flatten()
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(B * M + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    row_ptr = torch.zeros(B * M + 1, dtype=torch.int64, device=device)
    row_ptr[1:] = counts[: B * M].cumsum(0)
    nz_tok = src.flatten()[order]
    return row_ptr, nz_tok, order


_SPACE = LAUNCH_SPACE["apply_plan_fused"]


def _block(D: int) -> tuple[int, int]:
    """``(BLOCK_D, num_warps)``: on a GPU from :data:`~.dispatch.LAUNCH_SPACE`, the first block as wide as ``D``
    (else the widest); in the interpreter the narrowest power of two that holds ``D`` (at most 256), for speed."""
    if _INTERPRET:
        return min(triton.next_power_of_2(D), 256), 1
    return next((b for b in _SPACE["block"] if b[0] >= D), _SPACE["block"][-1])


def _weights(w, B, R, D, dummy):
    """``(mode, pointer, row stride)`` of one branch's merge weights (fp32; ``dummy`` is never read when pruning)."""
    if w is None:
        return PRUNE, dummy, 0
    if w.shape[-1] == 1:
        return TOKEN, w.reshape(B * R).to(torch.float32).contiguous(), 1
    wc = w.reshape(B * R, D).to(torch.float32).contiguous()
    return CHANNEL, wc, wc.stride(0)


def apply_plan_fused(residual, hidden, keep, keep_mask, src, dst_slot, w_res, w_hid, out_dtype):
    B, N, D = residual.shape
    M = keep.shape[1]
    R = src.shape[1]
    if (residual.dtype, hidden.dtype) not in _SPACE["dtypes"]:  # e.g. fp64, or fp16 beside bf16: exact casts
        dtype = kernel_dtype(residual.dtype, hidden.dtype)
        residual, hidden = residual.to(dtype), hidden.to(dtype)
    out = torch.empty(B, M, D, dtype=torch.promote_types(residual.dtype, hidden.dtype), device=residual.device)
    if B * M == 0:
        return out.to(out_dtype)
    if R == 0:
        w_res = w_hid = None
    keep_c = keep.to(torch.int64).contiguous()
    src = src.to(torch.int64)
    (mode_r, ptr_r, s_wr), (mode_h, ptr_h, s_wh) = (_weights(w, B, R, D, keep_c) for w in (w_res, w_hid))
    if mode_r or mode_h:
        row_ptr, nz_tok, nz_r = build_csr(src, dst_slot, w_res, w_hid, M)
    else:
        row_ptr = nz_tok = nz_r = keep_c  # dummies, never read
    kmask = keep_mask.to(torch.int8).contiguous()
    BLOCK_D, warps = _block(D)
    grid = (B * M, triton.cdiv(D, BLOCK_D))
    _apply_plan_fused_kernel[grid](
        residual, hidden, out,
        keep_c, kmask,
        row_ptr, nz_tok, nz_r,
        ptr_r, ptr_h,
        M, D,
        residual.stride(0), residual.stride(1), residual.stride(2),
        hidden.stride(0), hidden.stride(1), hidden.stride(2),
        s_wr, s_wh,
        RES_MODE=mode_r, HID_MODE=mode_h, BLOCK_D=BLOCK_D,
        num_warps=warps,
    )
    return out.to(out_dtype)
