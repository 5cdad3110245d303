"""Mamba-1 selective scan over variable-length packed sequences, with initial and final states.

Layout (chosen for the kernel: every per-step load is one contiguous row segment)
    Sequences are packed token-major, without padding:

    ==============  ==================  ==========================================
    ``u``, ``dt``   ``[T, D]``          ``T = cu_seqlens[-1]`` tokens of all sequences
    ``z``           ``[T, D]``          optional gate
    ``B``, ``C``    ``[T, N]``
    ``A``           ``[D, N]``
    ``D``, ``dt_bias``  ``[D]``         optional
    ``initial_state``   ``[S, D, N]``   optional, one per sequence (default zeros)
    ``cu_seqlens``  ``[S + 1]``         int32/int64, ``cu_seqlens[0] = 0``, non-decreasing
    ==============  ==================  ==========================================

    Sequence ``s`` is tokens ``cu_seqlens[s]:cu_seqlens[s + 1]`` (a length-0 sequence just returns its
    initial state).  :func:`pack_padded` / :func:`unpack_padded` convert from / to transformers' padded
    ``[B, D, L]`` layout with a ``[B, L]`` mask (left or right padding).

Semantics
    Per sequence, exactly transformers' ``mamba_selective_scan`` (``hidden_states=u[B, D, L]``, ...),
    extended with an initial state: ``dt <- softplus(dt + dt_bias)`` (each optional),
    ``h_t = exp(dt_t A) * h_{t-1} + dt_t B_t u_t``, ``y_t = C_t . h_t + D u_t``, ``y_t *= silu(z_t)``.
    Arithmetic is fp32 throughout (transformers keeps its state in the input dtype; in fp32 the two
    agree).  Returns ``y [T, D]`` in ``u.dtype`` and the final states ``[S, D, N]`` in fp32.

Implementations (:mod:`.dispatch` picks one per call)
    * Triton (CUDA, or CPU under ``TRITON_INTERPRET=1``): ``_selective_scan_triton.py``.
    * torch (CPU): the sequences are right-padded to ``[S, D, L_max]`` with ``dt = 0`` after the bias
      and softplus (decay 1, input 0: padding leaves the state unchanged) and run through the chunked
      :func:`hf_tokred.ops.scan.selective_scan` in one call.
    * :func:`selective_scan_varlen_ref`: the slow per-sequence, per-step loop used as the test oracle.

The custom op ``torch.ops.hf_tokred.selective_scan_varlen`` has a fake implementation and a FLOPs
formula (mamba_ssm's convention: ``9 T D N``, plus ``2 T D`` for the ``D`` skip and ``T D`` for the
gate).  It has no backward (inference kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .dispatch import choose_backend, load_triton_module
from .scan import selective_scan

__all__ = [
    "cu_seqlens_from_lengths",
    "pack_padded",
    "selective_scan_varlen",
    "selective_scan_varlen_ref",
    "unpack_padded",
]

_OP = "selective_scan_varlen"


def cu_seqlens_from_lengths(lengths: Tensor) -> Tensor:
    """``[0, l0, l0 + l1, ...]`` as int32 (the layout ``cu_seqlens`` expects)."""
    return F.pad(lengths.to(torch.int64).cumsum(0), (1, 0)).to(torch.int32)


def pack_padded(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Padded ``x [B, C, L]`` and real-token ``mask [B, L]`` -> ``(packed [T, C], cu_seqlens [B + 1])``."""
    mask = mask.bool()
    return x.transpose(1, 2)[mask], cu_seqlens_from_lengths(mask.sum(1))


def unpack_padded(packed: Tensor, mask: Tensor, fill: float = 0.0) -> Tensor:
    """Inverse of :func:`pack_padded`: ``packed [T, C]`` -> ``[B, C, L]`` with ``fill`` at padding."""
    mask = mask.bool()
    out = packed.new_full((*mask.shape, packed.shape[-1]), fill)
    out[mask] = packed
    return out.transpose(1, 2)


def _check(u, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens) -> None:
    if u.dim() != 2:
        raise ValueError(f"u must be packed [T, D]; got {tuple(u.shape)}")
    T, Dm = u.shape
    N = A.shape[-1]
    if dt.shape != u.shape or A.shape != (Dm, N):
        raise ValueError(f"bad shapes: u {tuple(u.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}")
    if B.shape != (T, N) or C.shape != (T, N):
        raise ValueError(f"B and C must be [T, N] = {(T, N)}; got {tuple(B.shape)}, {tuple(C.shape)}")
    if z is not None and z.shape != u.shape:
        raise ValueError(f"z must be [T, D] = {(T, Dm)}; got {tuple(z.shape)}")
    for name, v in (("D", D), ("dt_bias", dt_bias)):
        if v is not None and v.shape != (Dm,):
            raise ValueError(f"{name} must be [D] = {(Dm,)}; got {tuple(v.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point():
        raise ValueError(
            f"cu_seqlens must be an integer [S + 1] tensor; got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    S = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (S, Dm, N):
        raise ValueError(f"initial_state must be [S, D, N] = {(S, Dm, N)}; got {tuple(initial_state.shape)}")


def _prepared_dt(dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool) -> Tensor:
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    return F.softplus(dt) if dt_softplus else dt


def _scan_torch(u, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, dt_softplus):
    """CPU path: right-pad to ``[S, D, L_max]`` with ``dt = 0`` and run the chunked scan once."""

    T, Dm = u.shape
    N = A.shape[-1]
    S = cu_seqlens.numel() - 1
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    L = int(lengths.max()) if S else 0
    h0 = initial_state.float() if initial_state is not None else u.new_zeros(S, Dm, N, dtype=torch.float32)
    if L == 0:
        return torch.empty_like(u), h0.clone()
    t = torch.arange(L, device=u.device)
    valid = t[None, :] < lengths[:, None]  # [S, L]
    idx = torch.where(valid, cu[:-1, None] + t[None, :], 0)

    def pad(x: Tensor) -> Tensor:  # [T, C] -> [S, C, L], zeros at padding
        return x[idx].masked_fill(~valid[..., None], 0).transpose(1, 2)

    dt_p = pad(_prepared_dt(dt, dt_bias, dt_softplus))
    y, hT = selective_scan(
        pad(u.float()), dt_p, A.float(), pad(B.float()), pad(C.float()),
        D=None if D is None else D.float(), z=None if z is None else pad(z.float()),
        return_last_state=True, initial_state=h0,
    )
    y = y.transpose(1, 2)[valid].to(u.dtype)
    return y.contiguous(), hT.contiguous()


@torch.library.custom_op("hf_tokred::selective_scan_varlen", mutates_args=())
def _selective_scan_varlen_op(
    u: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor,
    dt_softplus: bool,
) -> tuple[Tensor, Tensor]:
    """``(y [T, D] in u.dtype, final_state [S, D, N] fp32)``; see the module docstring."""
    _check(u, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens)
    if choose_backend(_OP, u.device) == "triton":
        c = lambda x: None if x is None else x.contiguous()  # noqa: E731
        return load_triton_module("_selective_scan_triton").selective_scan_varlen(
            u, dt, A, B, C, c(D), z, c(dt_bias), initial_state, cu_seqlens, dt_softplus
        )
    return _scan_torch(u, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, dt_softplus)


@_selective_scan_varlen_op.register_fake
def _(u, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, dt_softplus):
    S = cu_seqlens.shape[0] - 1
    return torch.empty_like(u, memory_format=torch.contiguous_format), u.new_empty(
        S, u.shape[1], A.shape[-1], dtype=torch.float32
    )


def _flops(u, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, dt_softplus, out_shape=None, **kw) -> int:
    T, Dm = u
    N = A[-1]
    flops = 9 * T * Dm * N
    if D is not None:
        flops += 2 * T * Dm
    if z is not None:
        flops += T * Dm
    return flops


def _register_flops() -> None:
    from torch.utils.flop_counter import register_flop_formula

    register_flop_formula(torch.ops.hf_tokred.selective_scan_varlen)(_flops)


_register_flops()


def selective_scan_varlen(
    u: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    cu_seqlens: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Packed variable-length Mamba-1 scan: ``(y [T, D], final_state [S, D, N] fp32)`` (see the module docstring)."""
    return torch.ops.hf_tokred.selective_scan_varlen(
        u, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, dt_softplus
    )


def selective_scan_varlen_ref(
    u: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    cu_seqlens: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Slow oracle: one Python step per token and sequence, fp32, written like transformers' loop."""
    _check(u, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens)
    Dm, N = A.shape
    A = A.float()
    dt = _prepared_dt(dt, dt_bias, dt_softplus)
    y = torch.empty(u.shape, dtype=torch.float32, device=u.device)
    finals = []
    bounds = cu_seqlens.tolist()
    for s in range(len(bounds) - 1):
        h = initial_state[s].float() if initial_state is not None else u.new_zeros(Dm, N, dtype=torch.float32)
        for t in range(bounds[s], bounds[s + 1]):
            h = torch.exp(A * dt[t, :, None]) * h + (dt[t] * u[t].float())[:, None] * B[t].float()[None, :]
            y[t] = h @ C[t].float()
        finals.append(h)
    if D is not None:
        y = y + u.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    final = torch.stack(finals) if finals else u.new_zeros(0, Dm, N, dtype=torch.float32)
    return y.to(u.dtype), final
