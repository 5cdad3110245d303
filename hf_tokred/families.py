"""The model families hf_tokred supports: one table, used everywhere a family matters.

Each :class:`Family` names the transformers classes (by name: this module imports no model code, so the pure
layer stays usable without loading transformers' Mamba modules), what differs when the reducing loop calls a
block, the FLOPs of one block (see :mod:`hf_tokred.flops` for the counting conventions), and the shapes of the
public checkpoints (for random-weight models of the real sizes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .blocks import FlopsBreakdown, attention_flops, mamba2_mixer_flops, mlp_flops, moe_flops

__all__ = ["FAMILIES", "Family", "FlopsBreakdown", "family_names", "family_of", "supported_text"]


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
    mixer = mamba2_mixer_flops(d, int(config.expand * d), config.num_heads, config.head_dim, config.n_groups,
                               config.state_size, config.conv_kernel, config.chunk_size, config.use_bias,
                               config.use_conv_bias, L, B)
    return mixer + _pre_norm_residual(d, B * L)


def _pre_norm_residual(d: int, tokens: int, scaled: bool = False) -> FlopsBreakdown:
    """A block's RMSNorm (``4*d`` per token) and residual add (``d``; ``scaled``: also a multiplier, ``d``)."""
    add = tokens * d * (2 if scaled else 1)
    return FlopsBreakdown(add, 0, 0, 4 * tokens * d, 0, elementwise=add + 4 * tokens * d)


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


# ----------------------------------------------------------------------------- hybrid SSM-attention layers

#: a layer's kind, from the names transformers' hybrid configs use in ``layers_block_type``
_KINDS = {"linear_attention": "ssm", "mamba": "ssm", "full_attention": "attention", "attention": "attention",
          "mlp": "mlp", "moe": "moe"}


def hybrid_layer_kinds(config: Any) -> tuple[str, ...]:
    """``"ssm"`` / ``"attention"`` / ``"mlp"`` / ``"moe"`` for each layer of a hybrid config."""
    names = list(config.layers_block_type)
    unknown = sorted({n for n in names if n not in _KINDS})
    if unknown:
        raise ValueError(f"{type(config).__name__}.layers_block_type has layer types {unknown} that token reduction "
                         f"does not know; known: {', '.join(_KINDS)}")
    return tuple(_KINDS[n] for n in names)


def _rotary_dim(config: Any, head_dim: int) -> int:
    """Channels of each head the rotary embedding rotates: ``head_dim * partial_rotary_factor`` (Bamba: 0.5), as
    the even number of channels its inverse frequencies ``arange(0, dim, 2)`` cover."""
    factor = (getattr(config, "rope_parameters", None) or {}).get(
        "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return 2 * len(range(0, int(head_dim * factor), 2))


def _attention(config: Any, L: int, B: int, rotary: bool, bias: bool) -> FlopsBreakdown:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rotary_dim = _rotary_dim(config, head_dim) if rotary else 0
    return attention_flops(config.hidden_size, heads, config.num_key_value_heads, head_dim, bias, rotary_dim, L, L, B)


def _granite_mamba2(config: Any, L: int, B: int) -> FlopsBreakdown:
    """The Mamba-2 mixer of Bamba / Granite 4.0 (``mamba_*`` config names)."""
    d = config.hidden_size
    return mamba2_mixer_flops(d, int(config.mamba_expand * d), config.mamba_n_heads, config.mamba_d_head,
                              config.mamba_n_groups, config.mamba_d_state, config.mamba_d_conv,
                              config.mamba_chunk_size, config.mamba_proj_bias, config.mamba_conv_bias, L, B)


def bamba_layer_flops(config: Any, L: int, B: int, layer: int) -> FlopsBreakdown:
    """A Bamba decoder layer: Mamba-2 mixer or rotary attention, then a gated MLP; two pre-norms and residuals."""
    d, tokens = config.hidden_size, B * L
    ssm = hybrid_layer_kinds(config)[layer] == "ssm"
    mixer = _granite_mamba2(config, L, B) if ssm else _attention(config, L, B, True, config.attention_bias)
    ffn = mlp_flops(d, config.intermediate_size, True, config.mlp_bias, tokens)
    return mixer + ffn + _pre_norm_residual(d, tokens) + _pre_norm_residual(d, tokens)


def granite_hybrid_layer_flops(config: Any, L: int, B: int, layer: int) -> FlopsBreakdown:
    """A Granite 4.0 layer: Mamba-2 mixer or attention (rotary or none), then the shared MLP plus a top-k MoE;
    each residual branch scaled by ``residual_multiplier``."""
    d, tokens = config.hidden_size, B * L
    ssm = hybrid_layer_kinds(config)[layer] == "ssm"
    rotary = config.position_embedding_type == "rope"
    mixer = _granite_mamba2(config, L, B) if ssm else _attention(config, L, B, rotary, config.attention_bias)
    ffn = mlp_flops(d, config.shared_intermediate_size, True, False, tokens)
    if config.num_local_experts > 0:
        ffn = ffn + moe_flops(d, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok,
                              True, tokens) + FlopsBreakdown(0, 0, 0, 0, 0, mlp=tokens * d, elementwise=tokens * d)
    return mixer + ffn + _pre_norm_residual(d, tokens, True) + _pre_norm_residual(d, tokens, True)


def nemotron_h_layer_flops(config: Any, L: int, B: int, layer: int) -> FlopsBreakdown:
    """A Nemotron-H block: one pre-norm, one mixer (Mamba-2, attention without positions, ReLU^2 MLP or MoE with a
    shared expert), one residual add."""
    d, tokens = config.hidden_size, B * L
    kind = hybrid_layer_kinds(config)[layer]
    if kind == "ssm":
        H, P = config.mamba_num_heads, config.mamba_head_dim
        mixer = mamba2_mixer_flops(d, H * P, H, P, config.n_groups, config.ssm_state_size, config.conv_kernel,
                                   config.chunk_size, config.use_bias, config.use_conv_bias, L, B)
    elif kind == "attention":
        mixer = _attention(config, L, B, False, False)
    elif kind == "mlp":
        mixer = mlp_flops(d, config.intermediate_size, False, config.mlp_bias, tokens)
    else:
        latent = config.moe_latent_size
        mixer = (moe_flops(latent or d, config.moe_intermediate_size, config.n_routed_experts,
                           config.num_experts_per_tok, False, tokens)
                 + mlp_flops(d, config.moe_shared_expert_intermediate_size, False, config.mlp_bias, tokens)
                 + FlopsBreakdown(0, 0, 0, 0, 0, mlp=tokens * d, elementwise=tokens * d))  # experts + shared
        if latent:  # the router reads d, not the latent width; the latent projections in and out (+ biases)
            bias = tokens * (latent + d) if config.mlp_bias else 0
            mixer = mixer + FlopsBreakdown(0, 0, 0, 0, 0, mlp=2 * tokens * config.n_routed_experts * (d - latent)
                                           + 2 * 2 * tokens * d * latent + bias, elementwise=bias)
    return mixer + _pre_norm_residual(d, tokens)


def bamba_feed_forward(block: Any, x: Any) -> Any:
    """What a Bamba layer does after ``x = residual + mixer(norm(residual))``."""
    return x + block.feed_forward(block.pre_ff_layernorm(x))


def granite_hybrid_feed_forward(block: Any, x: Any) -> Any:
    """What a Granite 4.0 layer does after its scaled mixer residual: shared MLP (+ MoE), scaled, added."""
    y = block.post_attention_layernorm(x)
    out = block.shared_mlp(y)
    if block.block_sparse_moe is not None:
        out = block.block_sparse_moe(y) + out
    return x + out * block.residual_multiplier


def _hybrid_pattern(layers: int) -> list[str]:
    """A random hybrid's layers: attention at every fourth layer from the third (``M M A M M M A M ...``)."""
    return ["full_attention" if i % 4 == 2 else "linear_attention" for i in range(layers)]


def _granite_random(d: int, tiny: bool) -> dict:
    heads = 4 if tiny else d // 64
    return dict(num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), intermediate_size=d // 2,
                shared_intermediate_size=d, mamba_n_heads=2 * d // 16 if tiny else 2 * d // 64,
                mamba_d_head=16 if tiny else 64, mamba_d_state=16 if tiny else 128, mamba_n_groups=1,
                mamba_chunk_size=32 if tiny else 256, position_embedding_type="rope", num_local_experts=4 if tiny else 32,
                num_experts_per_tok=2 if tiny else 8)


def _bamba_random(d: int, tiny: bool) -> dict:
    heads = 4 if tiny else d // 64
    return dict(num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), intermediate_size=2 * d,
                mamba_n_heads=2 * d // 16 if tiny else 2 * d // 64, mamba_d_head=16 if tiny else 64,
                mamba_d_state=16 if tiny else 128, mamba_n_groups=1, mamba_chunk_size=32 if tiny else 256)


def _nemotron_h_random(d: int, tiny: bool) -> dict:
    heads = 4 if tiny else d // 128
    return dict(num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), head_dim=d // heads,
                mamba_num_heads=2 * d // 16 if tiny else 2 * d // 64, mamba_head_dim=16 if tiny else 64,
                ssm_state_size=16 if tiny else 128, n_groups=1, chunk_size=32 if tiny else 256,
                intermediate_size=2 * d, n_routed_experts=4 if tiny else 64, num_experts_per_tok=2 if tiny else 6,
                moe_intermediate_size=d // 2, moe_shared_expert_intermediate_size=d)


def _nemotron_h_pattern(layers: int) -> list[str]:
    """Nemotron-H's layers alternate a mixer and a feed-forward: ``M E M E A E M E ...``."""
    mixers = _hybrid_pattern((layers + 1) // 2)
    return [mixers[i // 2] if i % 2 == 0 else "moe" for i in range(layers)]


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
    #: where the reducing loop finds the parts (attribute names): the LM's backbone, its embeddings and final
    #: norm, a block's pre-mixer norm and SSM mixer
    backbone_attr: str = "backbone"
    embeddings_attr: str = "embeddings"
    final_norm_attr: str = "norm_f"
    norm_attr: str = "norm"
    mixer_attr: str = "mixer"
    #: hybrids: each layer's kind (``"ssm"``, ``"attention"``, ``"mlp"``, ``"moe"``); ``None``: all SSM layers
    layer_kinds: Callable[[Any], tuple[str, ...]] | None = None
    #: hybrids: what an SSM layer does after ``residual + mixer(norm(x))`` (its feed-forward half), or ``None``
    feed_forward: Callable[[Any, Any], Any] | None = None
    #: config attributes that multiply the embeddings / divide the logits, block attribute scaling the mixer output
    embedding_multiplier: str = ""
    logits_divisor: str = ""
    residual_multiplier: str = ""
    #: hybrids: ``layers_block_type`` of a random model with this many layers
    random_layers: Callable[[int], dict] = lambda layers: {}
    #: the backbone's forward resolves ``use_cache`` with transformers' ``merge_with_config_defaults`` (the hybrids:
    #: the config's value, off under gradient checkpointing while training); otherwise as the pure Mamba models do
    #: (the config's value in eval mode, off while training unless passed, off under gradient checkpointing)
    merged_use_cache: bool = False

    @property
    def hybrid(self) -> bool:
        return self.layer_kinds is not None

    def kinds(self, config: Any) -> tuple[str, ...]:
        """Each layer's kind (``"ssm"`` everywhere for pure SSM families)."""
        return self.layer_kinds(config) if self.hybrid else ("ssm",) * config.num_hidden_layers

    def block_flops(self, config: Any, L: int, B: int, layer: int) -> FlopsBreakdown:
        """FLOPs of block ``layer`` on ``B x L`` tokens (a hybrid's blocks differ by kind)."""
        return self.layer_flops(config, L, B, layer) if self.hybrid else self.layer_flops(config, L, B)


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
    # hybrids: Mamba-2 layers among attention layers (and feed-forward / MoE halves or layers).  Random models use
    # the pattern M M A M (attention every fourth layer from the third); "1b" is a ~1.2 B-parameter shape with it,
    # not a specific checkpoint
    "bamba": Family(
        model_type="bamba", name="Bamba", lm_class="BambaForCausalLM", backbone_class="BambaModel",
        config_class="BambaConfig", modeling_module="transformers.models.bamba.modeling_bamba",
        mixer_takes_kwargs=True, layer_flops=bamba_layer_flops, delta_source="in_proj", delta=mamba2_delta,
        sizes={"tiny": (64, 8), "1b": (2048, 24)}, random_kwargs=_bamba_random,
        backbone_attr="model", embeddings_attr="embed_tokens", final_norm_attr="final_layernorm",
        norm_attr="input_layernorm", mixer_attr="mamba", layer_kinds=hybrid_layer_kinds,
        feed_forward=bamba_feed_forward, merged_use_cache=True,
        random_layers=lambda n: {"attn_layer_indices": [i for i, t in enumerate(_hybrid_pattern(n)) if t != "linear_attention"]},
    ),
    "granitemoehybrid": Family(
        model_type="granitemoehybrid", name="Granite 4.0 (MoE hybrid)", lm_class="GraniteMoeHybridForCausalLM",
        backbone_class="GraniteMoeHybridModel", config_class="GraniteMoeHybridConfig",
        modeling_module="transformers.models.granitemoehybrid.modeling_granitemoehybrid", mixer_takes_kwargs=True,
        layer_flops=granite_hybrid_layer_flops, delta_source="in_proj", delta=mamba2_delta,
        sizes={"tiny": (64, 8)}, random_kwargs=_granite_random,
        backbone_attr="model", embeddings_attr="embed_tokens", final_norm_attr="norm",
        norm_attr="input_layernorm", mixer_attr="mamba", layer_kinds=hybrid_layer_kinds,
        feed_forward=granite_hybrid_feed_forward, embedding_multiplier="embedding_multiplier",
        logits_divisor="logits_scaling", residual_multiplier="residual_multiplier", merged_use_cache=True,
        random_layers=lambda n: {"layer_types": _hybrid_pattern(n)},
    ),
    "nemotron_h": Family(
        model_type="nemotron_h", name="Nemotron-H", lm_class="NemotronHForCausalLM",
        backbone_class="NemotronHModel", config_class="NemotronHConfig",
        modeling_module="transformers.models.nemotron_h.modeling_nemotron_h", mixer_takes_kwargs=True,
        layer_flops=nemotron_h_layer_flops, delta_source="in_proj", delta=mamba2_delta,
        sizes={"tiny": (64, 8)}, random_kwargs=_nemotron_h_random,
        backbone_attr="model", layer_kinds=hybrid_layer_kinds, merged_use_cache=True,
        random_layers=lambda n: {"layers_block_type": _nemotron_h_pattern(n)},
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
