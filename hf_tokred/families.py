"""The model families hf_tokred supports: one table, used everywhere a family matters.

Each :class:`Family` names the transformers classes (by name: this module imports no model code, so the pure
layer stays usable without loading transformers' Mamba modules), what differs when the reducing loop calls a
block, the FLOPs of one block (see :mod:`hf_tokred.flops` for the counting conventions), and the shapes of the
public checkpoints (for random-weight models of the real sizes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["FAMILIES", "Family", "FlopsBreakdown", "family_of", "supported_text"]


@dataclass(frozen=True)
class FlopsBreakdown:
    """FLOPs of a forward pass, split by component (multiply-add = 2 FLOPs, whole batch).

    ``elementwise`` is not a separate component: it is the part of the other five fields
    (bias adds, residual adds, scan arithmetic, norms) that is not a matmul/conv kernel.
    """

    projections: int
    conv: int
    scan: int
    norm: int
    lm_head: int
    elementwise: int = 0

    @property
    def total(self) -> int:
        """All counted FLOPs."""
        return self.projections + self.conv + self.scan + self.norm + self.lm_head

    @property
    def matmul(self) -> int:
        """Linear + (b)mm/einsum + conv FLOPs: what ``torch.utils.flop_counter.FlopCounterMode`` sees."""
        return self.total - self.elementwise

    def __add__(self, other: FlopsBreakdown) -> FlopsBreakdown:
        if not isinstance(other, FlopsBreakdown):
            return NotImplemented
        return FlopsBreakdown(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})



# ----------------------------------------------------------------------------- FLOPs of one block


def mamba1_layer_flops(config: Any, L: int, B: int) -> FlopsBreakdown:
    d = config.hidden_size
    D = config.intermediate_size
    N = config.state_size
    R = int(config.time_step_rank)
    K = config.conv_kernel
    tokens = B * L

    proj_mm = 2 * tokens * (d * 2 * D + D * (R + 2 * N) + R * D + D * d)
    proj_ew = tokens * D + tokens * d  # dt_proj bias (added inside the scan in HF), residual add
    if config.use_bias:
        proj_ew += tokens * (2 * D + d)

    conv_positions = B * (L + K - 1)
    conv_mm = 2 * conv_positions * D * K
    conv_ew = conv_positions * D if config.use_conv_bias else 0

    scan_mm = 2 * tokens * D * N  # C . h, a batched matmul in HF
    scan_ew = 7 * tokens * D * N + 2 * tokens * D + tokens * D  # rest of 9BLDN, D skip, gate

    norm = 4 * tokens * d
    return FlopsBreakdown(
        projections=proj_mm + proj_ew,
        conv=conv_mm + conv_ew,
        scan=scan_mm + scan_ew,
        norm=norm,
        lm_head=0,
        elementwise=proj_ew + conv_ew + scan_ew + norm,
    )


def mamba2_layer_flops(config: Any, L: int, B: int) -> FlopsBreakdown:
    d = config.hidden_size
    D = int(config.expand * d)
    H = config.num_heads
    P = config.head_dim
    G = config.n_groups
    N = config.state_size
    K = config.conv_kernel
    Q = config.chunk_size
    conv_dim = D + 2 * G * N
    tokens = B * L

    in_out = D + conv_dim + H
    proj_mm = 2 * tokens * (d * in_out + D * d)
    proj_ew = tokens * d  # residual add
    if config.use_bias:
        proj_ew += tokens * (in_out + d)

    conv_positions = B * (L + K - 1)
    conv_mm = 2 * conv_positions * conv_dim * K
    conv_ew = conv_positions * conv_dim if config.use_conv_bias else 0

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
    )

    norm = 4 * tokens * d + 5 * tokens * D  # block RMSNorm, gated RMSNorm
    return FlopsBreakdown(
        projections=proj_mm + proj_ew,
        conv=conv_mm + conv_ew,
        scan=scan_mm + scan_ew,
        norm=norm,
        lm_head=0,
        elementwise=proj_ew + conv_ew + scan_ew + norm,
    )



# ----------------------------------------------------------------------------- the SSM's step sizes (the "delta" metric)


def _softplus(x):
    """``softplus`` with tensor methods only (this module imports no torch): ``log1p(exp(x))``, ``x`` above 20."""
    return x.clamp(max=20.0).exp().log1p().where(x <= 20.0, x)


def mamba1_delta(mixer, inputs, output):
    """Mean step size per token from the output of ``mixer.x_proj`` (``[B, L, rank + 2N]``): ``softplus(dt_proj(
    time_step))`` averaged over the SSM's channels -> ``[B, L]``."""
    time_step = output[..., : mixer.time_step_rank].float()
    dt = time_step @ mixer.dt_proj.weight.float().t() + mixer.dt_proj.bias.float()
    return _softplus(dt).mean(-1)


def mamba2_delta(mixer, inputs, output):
    """Mean step size per token from the output of ``mixer.in_proj`` (its last ``num_heads`` columns are ``dt``):
    ``softplus(dt + dt_bias)`` clamped to the mixer's limits, averaged over the heads -> ``[B, L]``."""
    dt = _softplus(output[..., -mixer.num_heads:].float() + mixer.dt_bias.float())
    low, high = mixer.time_step_limit
    return dt.clamp(min=low, max=high).mean(-1)


# ----------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Family:
    """One supported model family."""

    model_type: str
    name: str  # for people: "Mamba", "Mamba-2"
    lm_class: str  # transformers class names
    backbone_class: str
    config_class: str
    mixer_takes_kwargs: bool  # the block forwards **kwargs to its mixer (Mamba2Block does, MambaBlock does not)
    layer_flops: Callable[[Any, int, int], FlopsBreakdown]
    #: the mixer submodule whose forward hook sees the step sizes, and how to read them (``[B, L]`` per token)
    delta_source: str = ""
    delta: Callable[[Any, Any, Any], Any] | None = None
    #: size name -> (hidden_size, num_hidden_layers) of the public checkpoints
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: config kwargs of a random model of hidden size ``d`` (besides hidden_size, layers, vocab, token ids)
    random_kwargs: Callable[[int, bool], dict] = lambda d, tiny: {}


def _mamba2_random(d: int, tiny: bool) -> dict:
    head_dim = 16 if tiny else 64
    return dict(state_size=16 if tiny else 128, expand=2, head_dim=head_dim, num_heads=2 * d // head_dim,
                n_groups=1, chunk_size=32 if tiny else 256)


FAMILIES: dict[str, Family] = {
    "mamba": Family(
        "mamba", "Mamba", "MambaForCausalLM", "MambaModel", "MambaConfig", False, mamba1_layer_flops, "x_proj",
        mamba1_delta, {"tiny": (64, 12), "130m": (768, 24), "370m": (1024, 48), "790m": (1536, 48), "1.4b": (2048, 48),
         "2.8b": (2560, 64)},
        lambda d, tiny: dict(state_size=16),
    ),
    "mamba2": Family(
        "mamba2", "Mamba-2", "Mamba2ForCausalLM", "Mamba2Model", "Mamba2Config", True, mamba2_layer_flops, "in_proj",
        mamba2_delta, {"tiny": (64, 12), "130m": (768, 24), "370m": (1024, 48), "780m": (1536, 48), "1.3b": (2048, 48),
         "2.7b": (2560, 64)},
        _mamba2_random,
    ),
}


def supported_text() -> str:
    """The supported classes, for error messages."""
    return ", ".join(f"{f.lm_class} / {f.backbone_class}" for f in FAMILIES.values())


def family_of(model_or_config: Any) -> Family:
    """The family of a model or config (by ``config.model_type``); ``ValueError`` naming the supported ones."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"token reduction supports {supported_text()}; got {type(model_or_config).__name__} with "
            f"model_type={model_type!r} (supported model_type values: {', '.join(FAMILIES)})"
        )
    return FAMILIES[model_type]
