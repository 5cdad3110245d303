"""Triton kernel behind ``hf_tokred::selective_scan_varlen`` (imported lazily, on first use).

Grid ``(S, cdiv(D, BLOCK_D))``: one program per packed sequence and block of ``BLOCK_D`` channels.
The program holds the state ``h [BLOCK_D, BLOCK_N]`` (all ``N`` state indices) in fp32 registers,
starting from the sequence's initial state (or zeros), and walks the sequence's tokens
``cu_seqlens[s] <= t < cu_seqlens[s + 1]`` one by one::

    dt = softplus(dt_t + bias)      h = exp(dt * A) * h + (dt * u_t) B_t      y_t = h . C_t (+ D u_t) (* silu(z_t))

Token-major layout (``u, dt, z, y: [T, D]``, ``B, C: [T, N]``) makes every per-step load of a channel
block one contiguous row segment.  Sequences of different lengths need no padding: short sequences'
programs simply finish early.  The final state goes to ``[S, D, N]`` fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .dispatch import LAUNCH_SPACE, kernel_dtype

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _softplus(x):
    # log1p(exp(x)) with Kahan's log1p trick (no libdevice needed), identity above 20 as torch does
    e = tl.exp(tl.minimum(x, 20.0))
    p = 1.0 + e
    lp = tl.where(p == 1.0, e, tl.log(p) * (e / (p - 1.0)))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _selective_scan_varlen_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, h0_ptr, cu_ptr, y_ptr, hT_ptr,
    DIM, NS,
    s_ut, s_ud, s_dtt, s_dtd, s_Ad, s_An, s_Bt, s_Bn, s_Ct, s_Cn, s_zt, s_zd, s_yt, s_yd,
    s_h0s, s_h0d, s_h0n,
    HAS_Z: tl.constexpr, SOFTPLUS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    start = tl.load(cu_ptr + s).to(tl.int64)
    end = tl.load(cu_ptr + s + 1).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    dmask = offs_d < DIM
    nmask = offs_n < NS
    m2 = dmask[:, None] & nmask[None, :]

    # the launcher passes zeros for a missing D, dt_bias or initial state (exact, and fewer specialisations)
    A = tl.load(A_ptr + offs_d[:, None] * s_Ad + offs_n[None, :] * s_An, mask=m2, other=0.0)
    h = tl.load(h0_ptr + s * s_h0s + offs_d[:, None] * s_h0d + offs_n[None, :] * s_h0n, mask=m2, other=0.0)
    bias = tl.load(bias_ptr + offs_d, mask=dmask, other=0.0)
    Dv = tl.load(D_ptr + offs_d, mask=dmask, other=0.0)

    for t in range(start, end):
        u = tl.load(u_ptr + t * s_ut + offs_d * s_ud, mask=dmask, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * s_dtt + offs_d * s_dtd, mask=dmask, other=0.0).to(tl.float32) + bias
        if SOFTPLUS:
            dt = _softplus(dt)
        Bt = tl.load(B_ptr + t * s_Bt + offs_n * s_Bn, mask=nmask, other=0.0).to(tl.float32)
        Ct = tl.load(C_ptr + t * s_Ct + offs_n * s_Cn, mask=nmask, other=0.0).to(tl.float32)
        h = tl.exp(dt[:, None] * A) * h + (dt * u)[:, None] * Bt[None, :]
        # tl.reduce with a local combine, not tl.sum: tl.sum is a @jit function of triton.language that is
        # not interpretable when triton was imported before TRITON_INTERPRET was set
        y = tl.reduce(h * Ct[None, :], 1, _add) + Dv * u
        if HAS_Z:
            z = tl.load(z_ptr + t * s_zt + offs_d * s_zd, mask=dmask, other=0.0).to(tl.float32)
            y = y * (z / (1.0 + tl.exp(-z)))
        tl.store(y_ptr + t * s_yt + offs_d * s_yd, y.to(y_ptr.dtype.element_ty), mask=dmask)

    tl.store(hT_ptr + s * DIM * NS + offs_d[:, None] * NS + offs_n[None, :], h, mask=m2)


_SPACE = LAUNCH_SPACE["selective_scan_varlen"]


def _blocks(D: int, N: int) -> tuple[int, int, int]:
    """``(BLOCK_D, BLOCK_N, num_warps)``: on a GPU from :data:`~.dispatch.LAUNCH_SPACE` (the first ``BLOCK_N``
    that holds all ``N`` state indices), in the interpreter the narrowest blocks (for speed)."""
    if _INTERPRET:
        return min(triton.next_power_of_2(D), 64), triton.next_power_of_2(N), 1
    for block_n, block_d, warps in _SPACE["block"]:
        if block_n >= N:
            return block_d, block_n, warps
    raise ValueError(f"hf_tokred: the Triton selective scan holds at most {_SPACE['block'][-1][0]} state indices "
                     f"per channel (got state size {N}); run it on the torch backend "
                     "(hf_tokred.ops.force_backend('torch'))")


def selective_scan_varlen(u, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, dt_softplus):
    T, DIM = u.shape
    NS = A.shape[1]
    S = cu_seqlens.shape[0] - 1
    out_dtype = u.dtype
    if S == 0 or DIM == 0:
        return torch.empty(T, DIM, dtype=out_dtype, device=u.device), u.new_empty(S, DIM, NS, dtype=torch.float32)
    acts = [x for x in (u, dt, B, C, z) if x is not None]
    if any(x.dtype != u.dtype for x in acts) or u.dtype not in _SPACE["dtype"]:  # exact casts (kernel_dtype)
        dtype = kernel_dtype(*(x.dtype for x in acts))
        u, dt, B, C = (x.to(dtype) for x in (u, dt, B, C))
        z = None if z is None else z.to(dtype)
    y = torch.empty(T, DIM, dtype=u.dtype, device=u.device)
    hT = torch.empty(S, DIM, NS, dtype=torch.float32, device=u.device)
    if NS == 0:
        hT.zero_()
    f32 = lambda x: None if x is None else x.to(torch.float32)  # noqa: E731
    A, D, dt_bias = f32(A), f32(D), f32(dt_bias)
    zeros = u.new_zeros(DIM, dtype=torch.float32)
    h0 = f32(initial_state) if initial_state is not None else u.new_zeros(S, DIM, NS, dtype=torch.float32)
    cu = cu_seqlens.to(torch.int64).contiguous()
    zz = z if z is not None else u  # dummy, never read
    block_d, block_n, warps = _blocks(DIM, max(NS, 1))
    grid = (S, triton.cdiv(DIM, block_d))
    _selective_scan_varlen_kernel[grid](
        u, dt, A, B, C,
        D if D is not None else zeros, zz, dt_bias if dt_bias is not None else zeros, h0, cu, y, hT,
        DIM, NS,
        u.stride(0), u.stride(1), dt.stride(0), dt.stride(1), A.stride(0), A.stride(1),
        B.stride(0), B.stride(1), C.stride(0), C.stride(1), zz.stride(0), zz.stride(1), y.stride(0), y.stride(1),
        h0.stride(0), h0.stride(1), h0.stride(2),
        HAS_Z=z is not None, SOFTPLUS=bool(dt_softplus), BLOCK_D=block_d, BLOCK_N=block_n,
        num_warps=warps,
    )
    return y.to(out_dtype), hT
