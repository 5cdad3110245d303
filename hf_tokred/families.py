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

__all__ = ["FAMILIES", "Family", "FlopsBreakdown", "family_names", "family_of", "supported_text"]


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


def falcon_mamba_layer_flops(config: Any, L: int, B: int) -> FlopsBreakdown:
    """Mamba-1's block plus Falcon Mamba's three weightless RMS norms on the SSM inputs (``dt`` over the time-step
    rank, ``B`` and ``C`` over the state): square, sum and scale, ``3`` FLOPs per feature and token."""
    extra = 3 * B * L * (int(config.time_step_rank) + 2 * config.state_size)
    return mamba1_layer_flops(config, L, B) + FlopsBreakdown(0, 0, 0, extra, 0, elementwise=extra)


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


def _mean_step_size(mixer, time_step):
    dt = time_step.float() @ mixer.dt_proj.weight.float().t() + mixer.dt_proj.bias.float()
    return _softplus(dt).mean(-1)


def mamba1_delta(mixer, inputs, output):
    """Mean step size per token from the output of ``mixer.x_proj`` (``[B, L, rank + 2N]``): ``softplus(dt_proj(
    time_step))`` averaged over the SSM's channels -> ``[B, L]``."""
    return _mean_step_size(mixer, output[..., : mixer.time_step_rank])


def falcon_mamba_delta(mixer, inputs, output):
    """As :func:`mamba1_delta`, after Falcon Mamba's RMS norm of the time step (``mixer.dt_layernorm``)."""
    return _mean_step_size(mixer, mixer.dt_layernorm(output[..., : mixer.time_step_rank]))


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
    modeling_module: str  # the transformers module that defines them
    mixer_takes_kwargs: bool  # the block forwards **kwargs to its mixer (Mamba2Block does, MambaBlock does not)
    layer_flops: Callable[[Any, int, int], FlopsBreakdown]
    #: the mixer submodule whose forward hook sees the step sizes, and how to read them (``[B, L]`` per token)
    delta_source: str = ""
    delta: Callable[[Any, Any, Any], Any] | None = None
    #: size name -> (hidden_size, num_hidden_layers) of the public checkpoints
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: config kwargs of a random model of hidden size ``d`` (besides hidden_size, layers, token ids; may set vocab)
    random_kwargs: Callable[[int, bool], dict] = lambda d, tiny: {}
    #: module-level functions of ``modeling_module`` that hf_tokred's fast Mamba-1 kernels replace (the selective
    #: scan and the causal convolution, looked up as globals by the mixer at call time)
    fast_functions: tuple[str, ...] = ()


def _mamba2_random(d: int, tiny: bool) -> dict:
    head_dim = 16 if tiny else 64
    return dict(state_size=16 if tiny else 128, expand=2, head_dim=head_dim, num_heads=2 * d // head_dim,
                n_groups=1, chunk_size=32 if tiny else 256)


_MAMBA1_FAST = ("mamba_selective_scan", "causal_conv1d_fn")

FAMILIES: dict[str, Family] = {
    "mamba": Family(
        model_type="mamba", name="Mamba", lm_class="MambaForCausalLM", backbone_class="MambaModel",
        config_class="MambaConfig", modeling_module="transformers.models.mamba.modeling_mamba",
        mixer_takes_kwargs=False, layer_flops=mamba1_layer_flops, delta_source="x_proj", delta=mamba1_delta,
        sizes={"tiny": (64, 12), "130m": (768, 24), "370m": (1024, 48), "790m": (1536, 48), "1.4b": (2048, 48),
               "2.8b": (2560, 64)},
        random_kwargs=lambda d, tiny: dict(state_size=16), fast_functions=_MAMBA1_FAST,
    ),
    "mamba2": Family(
        model_type="mamba2", name="Mamba-2", lm_class="Mamba2ForCausalLM", backbone_class="Mamba2Model",
        config_class="Mamba2Config", modeling_module="transformers.models.mamba2.modeling_mamba2",
        mixer_takes_kwargs=True, layer_flops=mamba2_layer_flops, delta_source="in_proj", delta=mamba2_delta,
        sizes={"tiny": (64, 12), "130m": (768, 24), "370m": (1024, 48), "780m": (1536, 48), "1.3b": (2048, 48),
               "2.7b": (2560, 64)},
        random_kwargs=_mamba2_random,
    ),
    # Mamba-1 blocks whose mixer normalises dt, B and C (weightless RMS norms) before the scan
    "falcon_mamba": Family(
        model_type="falcon_mamba", name="Falcon Mamba", lm_class="FalconMambaForCausalLM",
        backbone_class="FalconMambaModel", config_class="FalconMambaConfig",
        modeling_module="transformers.models.falcon_mamba.modeling_falcon_mamba", mixer_takes_kwargs=False,
        layer_flops=falcon_mamba_layer_flops, delta_source="x_proj", delta=falcon_mamba_delta,
        sizes={"tiny": (64, 12), "7b": (4096, 64)},
        random_kwargs=lambda d, tiny: dict(state_size=16, **({} if tiny else {"vocab_size": 65024})),
        fast_functions=_MAMBA1_FAST,
    ),
}


def family_names() -> str:
    """``Mamba / Mamba-2 / Falcon Mamba``: the supported families, for messages."""
    return " / ".join(f.name for f in FAMILIES.values())


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
