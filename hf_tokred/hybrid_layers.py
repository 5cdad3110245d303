"""The hybrid SSM-attention families' layers, for the families table (:mod:`hf_tokred.families`): each layer's
kind, its FLOPs (see :mod:`hf_tokred.flops` for the conventions), what an SSM layer does after its mixer, and the
shapes of random models.  Pure: no torch, no model code.

Kinds of layer: ``"ssm"`` (an SSM mixer, maybe with a feed-forward half), ``"attention"``, ``"mlp"``, ``"moe"``, and
two that hold an SSM mixer *and* attention: ``"parallel"`` (Falcon-H1: attention and Mamba-2 side by side on the same
normalised input) and ``"shared_attention"`` (Zamba2: the shared attention block, then a Mamba-2 layer).
"""

from __future__ import annotations

from typing import Any

from .blocks import (FlopsBreakdown, attention_flops, mamba1_mixer_flops, mamba2_mixer_flops, mlp_flops, moe_flops,
                     pre_norm_residual, rms_norm_flops)

__all__ = ["ANCHOR_KINDS", "ATTENTION_KINDS", "bamba_feed_forward", "bamba_layer_flops", "bamba_random",
           "falcon_h1_attention_branch", "falcon_h1_layer_flops", "falcon_h1_random", "granite_hybrid_feed_forward",
           "granite_hybrid_layer_flops", "granite_random", "hybrid_layer_kinds", "parallel_layer_kinds",
           "hybrid_pattern", "jamba_layer_flops", "jamba_random", "nemotron_h_layer_flops", "nemotron_h_pattern",
           "nemotron_h_random", "zamba2_layer_flops", "zamba2_layer_kinds", "zamba2_pattern", "zamba2_random"]

#: kinds of layer whose SSM mixer may be an anchor (the plan is made from its output)
ANCHOR_KINDS = ("ssm", "parallel")
#: kinds of layer that run attention (over the reduced sequence after an anchor, at the original positions)
ATTENTION_KINDS = ("attention", "parallel", "shared_attention")

#: a layer's kind, from the names transformers' hybrid configs use in ``layers_block_type``
_KINDS = {"linear_attention": "ssm", "mamba": "ssm", "full_attention": "attention", "attention": "attention",
          "mlp": "mlp", "moe": "moe"}


def _kinds(config: Any, known: dict[str, str]) -> tuple[str, ...]:
    names = list(config.layers_block_type)
    unknown = sorted({n for n in names if n not in known})
    if unknown:
        raise ValueError(f"{type(config).__name__}.layers_block_type has layer types {unknown} that token reduction "
                         f"does not know; known: {', '.join(known)}")
    return tuple(known[n] for n in names)


def hybrid_layer_kinds(config: Any) -> tuple[str, ...]:
    """``"ssm"`` / ``"attention"`` / ``"mlp"`` / ``"moe"`` for each layer of a hybrid config."""
    return _kinds(config, _KINDS)


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
    return mixer + ffn + pre_norm_residual(d, tokens) + pre_norm_residual(d, tokens)


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
    return mixer + ffn + pre_norm_residual(d, tokens, True) + pre_norm_residual(d, tokens, True)


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
    return mixer + pre_norm_residual(d, tokens)


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


def hybrid_pattern(layers: int) -> list[str]:
    """A random hybrid's layers: attention at every fourth layer from the third (``M M A M M M A M ...``)."""
    return ["full_attention" if i % 4 == 2 else "linear_attention" for i in range(layers)]


def granite_random(d: int, tiny: bool) -> dict:
    heads = 4 if tiny else d // 64
    return dict(num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), intermediate_size=d // 2,
                shared_intermediate_size=d, mamba_n_heads=2 * d // 16 if tiny else 2 * d // 64,
                mamba_d_head=16 if tiny else 64, mamba_d_state=16 if tiny else 128, mamba_n_groups=1,
                mamba_chunk_size=32 if tiny else 256, position_embedding_type="rope", num_local_experts=4 if tiny else 32,
                num_experts_per_tok=2 if tiny else 8)


def bamba_random(d: int, tiny: bool) -> dict:
    heads = 4 if tiny else d // 64
    return dict(num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), intermediate_size=2 * d,
                mamba_n_heads=2 * d // 16 if tiny else 2 * d // 64, mamba_d_head=16 if tiny else 64,
                mamba_d_state=16 if tiny else 128, mamba_n_groups=1, mamba_chunk_size=32 if tiny else 256)


def nemotron_h_random(d: int, tiny: bool) -> dict:
    heads = 4 if tiny else d // 128
    return dict(num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), head_dim=d // heads,
                mamba_num_heads=2 * d // 16 if tiny else 2 * d // 64, mamba_head_dim=16 if tiny else 64,
                ssm_state_size=16 if tiny else 128, n_groups=1, chunk_size=32 if tiny else 256,
                intermediate_size=2 * d, n_routed_experts=4 if tiny else 64, num_experts_per_tok=2 if tiny else 6,
                moe_intermediate_size=d // 2, moe_shared_expert_intermediate_size=d)


def nemotron_h_pattern(layers: int) -> list[str]:
    """Nemotron-H's layers alternate a mixer and a feed-forward: ``M E M E A E M E ...``."""
    mixers = hybrid_pattern((layers + 1) // 2)
    return [mixers[i // 2] if i % 2 == 0 else "moe" for i in range(layers)]


# ----------------------------------------------------------------------------- Jamba


def jamba_layer_flops(config: Any, L: int, B: int, layer: int) -> FlopsBreakdown:
    """A Jamba layer: a Mamba-1 mixer whose ``dt``, ``B`` and ``C`` pass through RMS norms with weights (``4`` per
    feature and token), or attention without positions; then a gated MLP, or a top-k MoE in the layers
    ``expert_layer_period`` / ``expert_layer_offset`` pick; two pre-norms and residual adds."""
    d, tokens = config.hidden_size, B * L
    if hybrid_layer_kinds(config)[layer] == "ssm":
        R, N = int(config.mamba_dt_rank), config.mamba_d_state
        mixer = mamba1_mixer_flops(d, config.mamba_expand * d, N, R, config.mamba_d_conv, config.mamba_proj_bias,
                                   config.mamba_conv_bias, L, B) + rms_norm_flops(R + 2 * N, tokens)
    else:
        mixer = _attention(config, L, B, False, False)
    experts = config.layers_num_experts[layer]
    ffn = (moe_flops(d, config.intermediate_size, experts, config.num_experts_per_tok, True, tokens) if experts > 1
           else mlp_flops(d, config.intermediate_size, True, False, tokens))
    return mixer + ffn + pre_norm_residual(d, tokens) + pre_norm_residual(d, tokens)


def jamba_random(d: int, tiny: bool) -> dict:
    """Tiny: attention every fourth layer from the third, as the other random hybrids; otherwise Jamba's own layout
    (attention every eighth layer from the fifth); MoE every other layer from the second (Jamba's) in both."""
    heads = 4 if tiny else d // 128
    return dict(num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1),
                intermediate_size=2 * d if tiny else d, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, attn_layer_period=4 if tiny else 8,
                attn_layer_offset=2 if tiny else 4, expert_layer_period=2, expert_layer_offset=1,
                num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)


# ----------------------------------------------------------------------------- Falcon-H1


def parallel_layer_kinds(config: Any) -> tuple[str, ...]:
    """Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side (``"parallel"``)."""
    return ("parallel",) * config.num_hidden_layers


def falcon_h1_layer_flops(config: Any, L: int, B: int, layer: int) -> FlopsBreakdown:
    """A Falcon-H1 layer: one pre-norm; the Mamba-2 mixer (input scaled by ``ssm_in_multiplier``, ``in_proj``'s
    output by the μP vector, its own ``out_proj`` bias, a gated RMSNorm only if ``mamba_rms_norm``, output scaled by
    ``ssm_out_multiplier``) beside rotary attention (input scaled by ``attention_in_multiplier``, keys by
    ``key_multiplier``, output by ``attention_out_multiplier``); the branches' sum added to the residual; then the
    gated MLP (gate and output scaled by ``mlp_multipliers``) with its pre-norm and residual add."""
    d, tokens = config.hidden_size, B * L
    D = config.mamba_d_ssm if config.mamba_d_ssm is not None else int(config.mamba_expand * d)
    H, G, N = config.mamba_n_heads, config.mamba_n_groups, config.mamba_d_state
    ssm = mamba2_mixer_flops(d, D, H, config.mamba_d_head, G, N, config.mamba_d_conv, config.mamba_chunk_size,
                             config.mamba_proj_bias, config.mamba_conv_bias, L, B, out_bias=config.projectors_bias,
                             gated_norm=config.mamba_rms_norm)
    heads = config.num_attention_heads
    kv_dim = config.num_key_value_heads * (getattr(config, "head_dim", None) or d // heads)
    ssm_scaling = tokens * (d + (2 * D + 2 * G * N + H) + d)  # ssm_in, μP vector, ssm_out
    attention_scaling = tokens * (d + kv_dim + d)  # attention_in, keys, attention_out
    mlp_scaling = tokens * (config.intermediate_size + d)  # gate, down
    scaling = FlopsBreakdown(ssm_scaling + tokens * d, 0, 0, 0, 0, attention=attention_scaling, mlp=mlp_scaling,
                             elementwise=ssm_scaling + tokens * d + attention_scaling + mlp_scaling)  # + branch sum
    return (ssm + _attention(config, L, B, True, config.attention_bias) + scaling
            + mlp_flops(d, config.intermediate_size, True, config.mlp_bias, tokens)
            + pre_norm_residual(d, tokens) + pre_norm_residual(d, tokens))


def falcon_h1_attention_branch(block: Any, normed: Any, attend: Any) -> Any:
    """What a Falcon-H1 layer adds beside its scaled Mamba-2 output: its attention on the same normalised input,
    scaled going in and coming out."""
    return attend(block.self_attn, normed * block.attention_in_multiplier) * block.attn_out_multiplier


def falcon_h1_random(d: int, tiny: bool) -> dict:
    """Falcon-H1's shapes (Mamba-2 heads of 64 channels, state 256 at full size); tiny: small heads and chunks.  The
    μP multipliers are left at transformers' defaults (1.0); tests set others."""
    heads = 4 if tiny else d // 128
    return dict(num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), intermediate_size=2 * d if tiny
                else 3 * d, mamba_d_ssm=2 * d if tiny else None, mamba_n_heads=2 * d // 16 if tiny else 2 * d // 64,
                mamba_d_head=16 if tiny else 64, mamba_d_state=16 if tiny else 128, mamba_n_groups=1,
                mamba_chunk_size=32 if tiny else 256, tie_word_embeddings=False)


# ----------------------------------------------------------------------------- Zamba2

#: Zamba2's layer types: a Mamba-2 layer, or the shared attention block followed by one ("hybrid")
_ZAMBA2_KINDS = {"linear_attention": "ssm", "mamba": "ssm", "hybrid": "shared_attention"}


def zamba2_layer_kinds(config: Any) -> tuple[str, ...]:
    """``"ssm"`` for a Mamba-2 layer, ``"shared_attention"`` for a hybrid layer (the shared attention block on the
    hidden states and the original embeddings, then a Mamba-2 layer)."""
    return _kinds(config, _ZAMBA2_KINDS)


def _low_rank(d_in: int, rank: int, d_out: int, tokens: int) -> FlopsBreakdown:
    """An adapter ``d_in -> rank -> d_out`` (two linears, no bias) whose output is added to a projection's."""
    return FlopsBreakdown(2 * tokens * (d_in * rank + rank * d_out) + tokens * d_out, 0, 0, 0, 0,
                          elementwise=tokens * d_out)


def zamba2_layer_flops(config: Any, L: int, B: int, layer: int) -> FlopsBreakdown:
    """A Zamba2 Mamba-2 layer (pre-norm, mixer with a gated RMSNorm and an always-biased convolution, residual add);
    a hybrid layer adds, before it, the shared block on ``[hidden, embeddings]`` (``2 d`` wide: its RMSNorm, rotary
    attention if ``use_mem_rope``, the q/k/v adapters if ``use_shared_attention_adapter``, then an RMSNorm and the
    gated MLP with its gate/up adapter), its ``d x d`` output linear, and the add onto the mixer's input."""
    d, tokens = config.hidden_size, B * L
    D = int(config.mamba_expand * d)
    mixer = mamba2_mixer_flops(d, D, config.n_mamba_heads, config.mamba_headdim, config.mamba_ngroups,
                               config.mamba_d_state, config.mamba_d_conv, config.chunk_size, config.add_bias_linear,
                               True, L, B)
    total = mixer + pre_norm_residual(d, tokens)
    if zamba2_layer_kinds(config)[layer] == "ssm":
        return total
    wide, heads, r = 2 * d, config.num_attention_heads, config.adapter_rank
    head_dim = config.attention_head_dim
    rotary = _rotary_dim(config, head_dim) if config.use_mem_rope else 0
    shared = (rms_norm_flops(wide, tokens)
              + attention_flops(d, heads, config.num_key_value_heads, head_dim, False, rotary, L, L, B, d_in=wide)
              + rms_norm_flops(d, tokens) + mlp_flops(d, config.intermediate_size, True, config.add_bias_linear, tokens)
              + _low_rank(d, r, 2 * config.intermediate_size, tokens))
    if config.use_shared_attention_adapter:
        kv = config.num_key_value_heads * head_dim
        shared = shared + _low_rank(wide, r, heads * head_dim, tokens) + _low_rank(wide, r, kv, tokens) + _low_rank(
            wide, r, kv, tokens)
    out = FlopsBreakdown(2 * tokens * d * d + tokens * d, 0, 0, 0, 0, elementwise=tokens * d)  # linear, add
    return total + shared + out


def zamba2_random(d: int, tiny: bool) -> dict:
    """Zamba2's shapes (Zamba2-1.2B at full size: Mamba-2 heads of 64 channels, state 128, one shared block with
    adapters of rank 128, rotary attention); tiny: small heads, two shared blocks used in turn, rank 8."""
    return dict(num_attention_heads=4 if tiny else d // 64, mamba_d_state=16 if tiny else 128,
                n_mamba_heads=2 * d // 16 if tiny else 2 * d // 64, chunk_size=32 if tiny else 256,
                num_mem_blocks=2 if tiny else 1, use_shared_attention_adapter=True, adapter_rank=8 if tiny else 128,
                use_mem_rope=True, intermediate_size=2 * d if tiny else 4 * d, tie_word_embeddings=True)


def zamba2_pattern(layers: int, tiny: bool) -> list[str]:
    """Tiny: the shared block at every fourth layer from the third (as the other random hybrids); otherwise at
    every sixth from the sixth (Zamba2-1.2B's)."""
    if tiny:
        return ["hybrid" if t == "full_attention" else t for t in hybrid_pattern(layers)]
    return ["hybrid" if i % 6 == 5 else "linear_attention" for i in range(layers)]
