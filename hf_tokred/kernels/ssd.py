"""Mamba-2 (SSD) scan over variable-length packed sequences in torch: the CPU path and the test oracle.

Layout (mamba_ssm's ``mamba_chunk_scan_combined`` with the batch axis dropped)
    ``x [T, H, P]``, ``dt [T, H]``, ``A [H]``, ``B, C [T, G, N]`` (``H % G == 0``), ``D [H]`` or
    ``[H, P]``, ``z [T, H, P]``, ``dt_bias [H]``, ``initial_states [S, H, P, N]``, ``cu_seqlens [S + 1]``.

Semantics (per sequence, per head ``h`` with group ``g = h // (H / G)``)::

    dt <- clamp(softplus(dt + dt_bias), *dt_limit)       state = exp(dt A_h) state + dt x_t B_t^T
    y_t = state C_t + D x_t                              y_t *= silu(z_t)

Returns ``y [T, H, P]`` in ``x.dtype`` and the final states ``[S, H, P, N]`` in fp32.

:func:`ssd_varlen_torch` right-pads the sequences to a multiple of the chunk length with ``dt = 0``
(padding leaves the state unchanged) and evaluates the chunked SSD form in one call: intra-chunk
``(C B^T * L) X`` with ``L = exp(segment sums of dt A)``, chunk end states, a short loop passing states
across chunks, and the inter-chunk term ``C state * exp(cumsum dt A)``.  :func:`ssd_varlen_ref` is the
step-by-step loop used to test it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ssd_varlen_ref", "ssd_varlen_torch"]


def _prepared_dt(dt, dt_bias, dt_softplus, dt_limit) -> Tensor:
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi < math.inf:
        dt = dt.clamp(lo, hi)
    return dt


def _finish(y: Tensor, x: Tensor, D: Tensor | None, z: Tensor | None) -> Tensor:
    if D is not None:
        Df = D.float()
        y = y + x.float() * (Df[:, None] if Df.dim() == 1 else Df)
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


def ssd_varlen_ref(x, dt, A, B, C, cu_seqlens, D=None, z=None, dt_bias=None, initial_states=None,
                   dt_softplus=False, dt_limit=(0.0, math.inf)) -> tuple[Tensor, Tensor]:
    """Slow oracle: one Python step per token and sequence, fp32."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    dt = _prepared_dt(dt, dt_bias, dt_softplus, dt_limit)
    Bh = B.float().repeat_interleave(H // G, dim=1)  # [T, H, N]
    Ch = C.float().repeat_interleave(H // G, dim=1)
    y = torch.empty(T, H, P, dtype=torch.float32, device=x.device)
    finals = []
    bounds = cu_seqlens.tolist()
    for s in range(len(bounds) - 1):
        h = initial_states[s].float() if initial_states is not None else x.new_zeros(H, P, N, dtype=torch.float32)
        for t in range(bounds[s], bounds[s + 1]):
            decay = torch.exp(dt[t] * A.float())[:, None, None]
            h = decay * h + (dt[t][:, None] * x[t].float())[..., None] * Bh[t][:, None]
            y[t] = (h * Ch[t][:, None]).sum(-1)
        finals.append(h)
    final = torch.stack(finals) if finals else x.new_zeros(0, H, P, N, dtype=torch.float32)
    return _finish(y, x, D, z), final


def ssd_varlen_torch(x, dt, A, B, C, cu_seqlens, chunk_size=64, D=None, z=None, dt_bias=None,
                     initial_states=None, dt_softplus=False, dt_limit=(0.0, math.inf)) -> tuple[Tensor, Tensor]:
    """Chunked SSD in torch over right-padded sequences (see the module docstring)."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    S = cu_seqlens.numel() - 1
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    L = int(lengths.max()) if S else 0
    h0 = initial_states.float() if initial_states is not None else x.new_zeros(S, H, P, N, dtype=torch.float32)
    if L == 0:
        return torch.empty_like(x), h0.clone()
    Q = max(1, min(chunk_size, L))
    nc = math.ceil(L / Q)
    Lp = nc * Q
    t = torch.arange(Lp, device=x.device)
    valid = t[None, :] < lengths[:, None]
    idx = torch.where(valid, cu[:-1, None] + t[None, :], 0)

    def pad(v: Tensor) -> Tensor:  # [T, ...] -> [S, Lp, ...] with zeros at padding
        v = v[idx]
        return v.masked_fill(~valid.view(S, Lp, *([1] * (v.dim() - 2))), 0)

    dt_p = pad(_prepared_dt(dt, dt_bias, dt_softplus, dt_limit))  # [S, Lp, H]
    X = (pad(x.float()) * dt_p[..., None]).view(S, nc, Q, H, P)
    Bc = pad(B.float()).repeat_interleave(H // G, dim=2).view(S, nc, Q, H, N)
    Cc = pad(C.float()).repeat_interleave(H // G, dim=2).view(S, nc, Q, H, N)
    a = (dt_p * A.float()).view(S, nc, Q, H).permute(0, 3, 1, 2)  # [S, H, nc, Q]
    acs = a.cumsum(-1)

    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    seg = (acs[..., :, None] - acs[..., None, :]).masked_fill(~causal, -math.inf)  # [S, H, nc, Q, Q]
    y = torch.einsum("scihn,scjhn,shcij,scjhp->scihp", Cc, Bc, seg.exp(), X)

    decay_to_end = (acs[..., -1:] - acs).exp()  # [S, H, nc, Q]
    local = torch.einsum("scjhn,shcj,scjhp->schpn", Bc, decay_to_end, X)  # chunk end states from zero
    chunk_decay = acs[..., -1].exp()  # [S, H, nc]
    state = h0
    entering = []
    for c in range(nc):
        entering.append(state)
        state = chunk_decay[:, :, c, None, None] * state + local[:, c]
    entering = torch.stack(entering, 1)  # [S, nc, H, P, N]
    y = y + torch.einsum("scihn,schpn,shci->scihp", Cc, entering, acs.exp())
    y = y.reshape(S, Lp, H, P)[valid]
    return _finish(y, x, D, z), state
