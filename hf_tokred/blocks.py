"""FLOPs of the building blocks the families are made of: one formula each, from plain numbers (no config).

:class:`FlopsBreakdown` splits a count by component (see :mod:`hf_tokred.flops` for the conventions: a
multiply-add is 2 FLOPs, an elementwise add/multiply 1, transcendentals free).  The families table
(:mod:`hf_tokred.families`) reads a config and calls these: the Mamba-2 mixer (pure Mamba-2 and the SSM layers
of the hybrids), grouped-query attention with rotary positions, gated / plain MLPs and top-k mixtures of experts.

Attention counts both score products (``Q K^T`` and ``A V``, ``2 * L * S * head_dim`` each per query head) over the
whole ``L x S`` score matrix, as dense kernels compute it (the causal half is masked, not skipped).  ``S`` is the
key/value length: ``L`` for a forward without a cache, the cached length plus ``L`` for a decode step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

__all__ = ["FlopsBreakdown", "attention_flops", "mamba1_mixer_flops", "mamba2_mixer_flops", "mlp_flops", "moe_flops",
           "pre_norm_residual", "rms_norm_flops"]


@dataclass(frozen=True)
class FlopsBreakdown:
    """FLOPs of a forward pass, split by component (multiply-add = 2 FLOPs, whole batch).

    ``elementwise`` is not a separate component: it is the part of the other fields (bias adds, residual adds,
    scan arithmetic, norms) that is not a matmul/conv kernel.  ``attention`` is the score and value products of
    attention layers (and their scaling / mask adds); ``mlp`` the feed-forward and expert layers.
    """

    projections: int
    conv: int
    scan: int
    norm: int
    lm_head: int
    elementwise: int = 0
    attention: int = 0
    mlp: int = 0

    @property
    def total(self) -> int:
        """All counted FLOPs."""
        return self.projections + self.conv + self.scan + self.norm + self.lm_head + self.attention + self.mlp

    @property
    def matmul(self) -> int:
        """Linear + (b)mm/einsum + conv FLOPs: what ``torch.utils.flop_counter.FlopCounterMode`` sees."""
        return self.total - self.elementwise

    def __add__(self, other: FlopsBreakdown) -> FlopsBreakdown:
        if not isinstance(other, FlopsBreakdown):
            return NotImplemented
        return FlopsBreakdown(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def mamba1_mixer_flops(d: int, D: int, N: int, R: int, K: int, use_bias: bool, use_conv_bias: bool, L: int,
                       B: int) -> FlopsBreakdown:
    """The Mamba-1 mixer (``in_proj``, causal conv, ``x_proj``, ``dt_proj``, selective scan, gate, ``out_proj``) on
    ``B x L`` tokens: model width ``d``, inner width ``D``, state ``N``, time-step rank ``R``, conv kernel ``K``.
    ``dt_proj``'s bias is always there (added inside the scan).  No block norm and no residual add."""
    tokens = B * L
    proj_mm = 2 * tokens * (d * 2 * D + D * (R + 2 * N) + R * D + D * d)
    proj_ew = tokens * D + (tokens * (2 * D + d) if use_bias else 0)

    conv_positions = B * (L + K - 1)
    conv_mm = 2 * conv_positions * D * K
    conv_ew = conv_positions * D if use_conv_bias else 0

    scan_mm = 2 * tokens * D * N  # C . h, a batched matmul in HF
    scan_ew = 7 * tokens * D * N + 2 * tokens * D + tokens * D  # rest of 9BLDN, D skip, gate
    return FlopsBreakdown(projections=proj_mm + proj_ew, conv=conv_mm + conv_ew, scan=scan_mm + scan_ew, norm=0,
                          lm_head=0, elementwise=proj_ew + conv_ew + scan_ew)


def pre_norm_residual(d: int, tokens: int, scaled: bool = False) -> FlopsBreakdown:
    """A block's RMSNorm (``4*d`` per token) and residual add (``d``; ``scaled``: also a multiplier, ``d``)."""
    add = tokens * d * (2 if scaled else 1)
    return FlopsBreakdown(add, 0, 0, 0, 0, elementwise=add) + rms_norm_flops(d, tokens)


def rms_norm_flops(features: int, tokens: int, weighted: bool = True) -> FlopsBreakdown:
    """An RMSNorm over ``features`` on ``tokens`` tokens: square, sum and scale (``3`` per feature), and the weight
    (``1``) unless weightless."""
    n = (4 if weighted else 3) * tokens * features
    return FlopsBreakdown(0, 0, 0, n, 0, elementwise=n)


def mamba2_mixer_flops(d: int, D: int, H: int, P: int, G: int, N: int, K: int, Q: int, use_bias: bool,
                       use_conv_bias: bool, L: int, B: int, *, out_bias: bool | None = None,
                       gated_norm: bool = True) -> FlopsBreakdown:
    """The Mamba-2 mixer (``in_proj``, causal conv, chunked SSD scan, gated RMSNorm, ``out_proj``) on ``B x L``
    tokens: model width ``d``, inner width ``D``, ``H`` heads of ``P`` channels, ``G`` groups, state ``N``, conv
    kernel ``K``, chunk ``Q``.  No block norm and no residual add (the block adds those).  ``out_bias``:
    ``out_proj``'s bias when it differs from ``in_proj``'s (``use_bias``); ``gated_norm=False``: the scan's output
    is only gated (``y * silu(z)``, ``D`` per token, booked under the scan), not normalised."""
    conv_dim = D + 2 * G * N
    tokens = B * L
    in_out = D + conv_dim + H
    proj_mm = 2 * tokens * (d * in_out + D * d)
    out_bias = use_bias if out_bias is None else out_bias
    proj_ew = tokens * ((in_out if use_bias else 0) + (d if out_bias else 0))

    conv_positions = B * (L + K - 1)
    conv_mm = 2 * conv_positions * conv_dim * K
    conv_ew = conv_positions * conv_dim if use_conv_bias else 0

    nc = math.ceil(L / Q)
    Lp = nc * Q
    scan_mm = 2 * B * H * (Lp * Q * N + Lp * Q * P + Lp * P * N + (nc + 1) ** 2 * P * N + Lp * N * P)
    scan_ew = B * (
        2 * L * H  # dt + dt_bias, A * dt
        + L * D  # x * dt
        + 4 * Lp * D  # D * x, + D_residual, Y_off decay scaling, Y_diag + Y_off
        + 2 * H * Lp  # cumsum(A), decay_states subtraction
        + 2 * H * Lp * Q  # intra-chunk segment-sum cumsum, G * L
        + H * Lp * N  # B * decay_states
        + H * (nc + 1) ** 2  # inter-chunk segment-sum cumsum
    ) + (0 if gated_norm else tokens * D)  # the gate alone
    norm = 5 * tokens * D if gated_norm else 0  # gated RMSNorm: x * silu(z), then RMSNorm
    return FlopsBreakdown(projections=proj_mm + proj_ew, conv=conv_mm + conv_ew, scan=scan_mm + scan_ew, norm=norm,
                          lm_head=0, elementwise=proj_ew + conv_ew + scan_ew + norm)


def attention_flops(d: int, heads: int, kv_heads: int, head_dim: int, bias: bool, rotary_dim: int, L: int, S: int,
                    B: int, d_in: int | None = None) -> FlopsBreakdown:
    """Grouped-query attention of ``L`` queries over ``S`` keys/values (``B`` sequences): the q/k/v/o projections,
    both score products over the whole ``L x S`` matrix, the score scaling and mask add, and the rotary embedding of
    the first ``rotary_dim`` channels of each query and key head (``q*cos + rotate(q)*sin``: 3 FLOPs per element;
    ``rotary_dim=0``: no positions in attention).  ``d_in``: the width q/k/v read when it is not the output's ``d``
    (Zamba2's shared block reads ``2 d``)."""
    tokens = B * L
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    d_in = d if d_in is None else d_in
    proj_mm = 2 * tokens * (d_in * q_dim + 2 * d_in * kv_dim + q_dim * d)
    proj_ew = tokens * (q_dim + 2 * kv_dim + d) if bias else 0
    scores_mm = 2 * 2 * B * heads * L * S * head_dim
    scores_ew = 2 * B * heads * L * S
    rope = 3 * tokens * (heads + kv_heads) * rotary_dim
    return FlopsBreakdown(projections=proj_mm + proj_ew, conv=0, scan=0, norm=0, lm_head=0,
                          attention=scores_mm + scores_ew + rope, elementwise=proj_ew + scores_ew + rope)


def mlp_flops(d: int, inner: int, gated: bool, bias: bool, tokens: int) -> FlopsBreakdown:
    """A feed-forward ``d -> inner -> d`` on ``tokens`` tokens; ``gated``: ``down(act(gate(x)) * up(x))`` (one
    more ``d x inner`` projection and the product)."""
    up = 2 if gated else 1
    mm = 2 * tokens * (up * d * inner + inner * d)
    ew = (tokens * inner if gated else 0) + (tokens * (up * inner + d) if bias else 0)
    return FlopsBreakdown(0, 0, 0, 0, 0, mlp=mm + ew, elementwise=ew)


def moe_flops(d: int, inner: int, experts: int, top_k: int, gated: bool, tokens: int) -> FlopsBreakdown:
    """A top-``top_k`` mixture of ``experts`` (no bias): the router (``d -> experts``), each token's ``top_k``
    active experts, their routing-weight products and the sum of their outputs."""
    router = 2 * tokens * d * experts
    active = mlp_flops(d, inner, gated, False, tokens * top_k)
    ew = 2 * tokens * top_k * d  # weight * output, index_add
    return active + FlopsBreakdown(0, 0, 0, 0, 0, mlp=router + ew, elementwise=ew)
