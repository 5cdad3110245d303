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

from .blocks import FlopsBreakdown, mamba1_mixer_flops, mamba2_mixer_flops, pre_norm_residual, rms_norm_flops
from .hybrid_layers import (ANCHOR_KINDS, bamba_feed_forward, bamba_layer_flops, bamba_random,
                            falcon_h1_attention_branch, falcon_h1_layer_flops, falcon_h1_random,
                            granite_hybrid_feed_forward, parallel_layer_kinds, granite_hybrid_layer_flops, granite_random,
                            hybrid_layer_kinds,
                            hybrid_pattern, jamba_layer_flops, jamba_random, nemotron_h_layer_flops, nemotron_h_pattern,
                            nemotron_h_random, zamba2_layer_flops, zamba2_layer_kinds, zamba2_pattern, zamba2_random)

__all__ = ["FAMILIES", "Family", "FlopsBreakdown", "family_names", "family_of", "supported_text"]


# ----------------------------------------------------------------------------- FLOPs of one block


def mamba1_layer_flops(config: Any, L: int, B: int) -> FlopsBreakdown:
    mixer = mamba1_mixer_flops(config.hidden_size, config.intermediate_size, config.state_size,
                               int(config.time_step_rank), config.conv_kernel, config.use_bias, config.use_conv_bias, L,
                               B)
    return mixer + pre_norm_residual(config.hidden_size, B * L)


def falcon_mamba_layer_flops(config: Any, L: int, B: int) -> FlopsBreakdown:
    """Mamba-1's block plus Falcon Mamba's three weightless RMS norms on the SSM inputs (``dt`` over the time-step
    rank, ``B`` and ``C`` over the state): square, sum and scale, ``3`` FLOPs per feature and token."""
    extra = rms_norm_flops(int(config.time_step_rank) + 2 * config.state_size, B * L, weighted=False)
    return mamba1_layer_flops(config, L, B) + extra


def mamba2_layer_flops(config: Any, L: int, B: int) -> FlopsBreakdown:
    d = config.hidden_size
    mixer = mamba2_mixer_flops(d, int(config.expand * d), config.num_heads, config.head_dim, config.n_groups,
                               config.state_size, config.conv_kernel, config.chunk_size, config.use_bias,
                               config.use_conv_bias, L, B)
    return mixer + pre_norm_residual(d, B * L)


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
    """As :func:`mamba1_delta`, after the mixer's RMS norm of the time step (``mixer.dt_layernorm``: Falcon Mamba,
    Jamba)."""
    return _mean_step_size(mixer, mixer.dt_layernorm(output[..., : mixer.time_step_rank]))


def mamba2_delta(mixer, inputs, output):
    """Mean step size per token from the output of ``mixer.in_proj`` (its last ``num_heads`` columns are ``dt``):
    ``softplus(dt + dt_bias)`` clamped to the mixer's limits, averaged over the heads -> ``[B, L]``."""
    dt = _softplus(output[..., -mixer.num_heads:].float() + mixer.dt_bias.float())
    low, high = mixer.time_step_limit
    return dt.clamp(min=low, max=high).mean(-1)


def falcon_h1_delta(mixer, inputs, output):
    """As :func:`mamba2_delta`, after Falcon-H1's μP scaling of ``in_proj``'s output (``mixer.mup_vector``, whose
    last ``num_heads`` entries scale ``dt``)."""
    heads = mixer.num_heads
    return mamba2_delta(mixer, inputs, output[..., -heads:] * mixer.mup_vector[..., -heads:])


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
    #: config attributes that multiply the embeddings / divide or multiply the logits, block attribute scaling the
    #: mixer output; ``multiplier_on_lookup_only``: the embedding multiplier scales looked-up embeddings only, not
    #: ``inputs_embeds`` a caller passes (Falcon-H1)
    embedding_multiplier: str = ""
    logits_divisor: str = ""
    logits_multiplier: str = ""
    residual_multiplier: str = ""
    multiplier_on_lookup_only: bool = False
    #: hybrids: the keywords a decoder layer with attention takes the causal mask and (a layer that also runs an SSM
    #: mixer: Falcon-H1, Zamba2) the SSM's padding mask by
    causal_mask_arg: str = "attention_mask"
    ssm_mask_arg: str = ""
    #: Falcon-H1: what a layer adds beside its SSM mixer, ``parallel_branch(block, normed, attend)`` with
    #: ``attend(module, x)`` running an attention module on the layer's columns; the plan is made from the SSM
    #: mixer's output alone unless ``plan_from_sum`` (the sum of both branches: the measured alternative)
    parallel_branch: Callable[..., Any] | None = None
    plan_from_sum: bool = False
    #: Zamba2: the shared attention block reads the original embeddings (reduced with every plan)
    shared_attention_reads_embeddings: bool = False
    #: hybrids: ``layers_block_type`` of a random model with this many layers (tiny or not)
    random_layers: Callable[[int, bool], dict] = lambda layers, tiny: {}
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

    def anchor_layers(self, config: Any) -> list[int]:
        """The layers that may be anchors: those whose SSM mixer's output a plan can be made from."""
        return [i for i, kind in enumerate(self.kinds(config)) if kind in ANCHOR_KINDS]

    def block_flops(self, config: Any, L: int, B: int, layer: int) -> FlopsBreakdown:
        """FLOPs of block ``layer`` on ``B x L`` tokens (a hybrid's blocks differ by kind)."""
        return self.layer_flops(config, L, B, layer) if self.hybrid else self.layer_flops(config, L, B)


def _mamba2_random(d: int, tiny: bool) -> dict:
    head_dim = 16 if tiny else 64
    return dict(state_size=16 if tiny else 128, expand=2, head_dim=head_dim, num_heads=2 * d // head_dim,
                n_groups=1, chunk_size=32 if tiny else 256)


_MAMBA1_FAST = ("mamba_selective_scan", "causal_conv1d_fn")
#: where most hybrids keep their parts (transformers' ``*Model`` with ``embed_tokens``, decoder layers with an
#: ``input_layernorm`` and a ``mamba`` mixer), and their ``use_cache`` rule
_HYBRID_PARTS = dict(backbone_attr="model", embeddings_attr="embed_tokens", norm_attr="input_layernorm",
                     mixer_attr="mamba", merged_use_cache=True)

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
        sizes={"tiny": (64, 8), "1b": (2048, 24)}, random_kwargs=bamba_random, **_HYBRID_PARTS,
        final_norm_attr="final_layernorm", layer_kinds=hybrid_layer_kinds, feed_forward=bamba_feed_forward,
        random_layers=lambda n, tiny: {"attn_layer_indices": [i for i, t in enumerate(hybrid_pattern(n)) if t != "linear_attention"]},
    ),
    "granitemoehybrid": Family(
        model_type="granitemoehybrid", name="Granite 4.0 (MoE hybrid)", lm_class="GraniteMoeHybridForCausalLM",
        backbone_class="GraniteMoeHybridModel", config_class="GraniteMoeHybridConfig",
        modeling_module="transformers.models.granitemoehybrid.modeling_granitemoehybrid", mixer_takes_kwargs=True,
        layer_flops=granite_hybrid_layer_flops, delta_source="in_proj", delta=mamba2_delta,
        sizes={"tiny": (64, 8)}, random_kwargs=granite_random, **_HYBRID_PARTS, final_norm_attr="norm",
        layer_kinds=hybrid_layer_kinds, feed_forward=granite_hybrid_feed_forward,
        embedding_multiplier="embedding_multiplier", logits_divisor="logits_scaling",
        residual_multiplier="residual_multiplier",
        random_layers=lambda n, tiny: {"layer_types": hybrid_pattern(n)},
    ),
    "nemotron_h": Family(
        model_type="nemotron_h", name="Nemotron-H", lm_class="NemotronHForCausalLM",
        backbone_class="NemotronHModel", config_class="NemotronHConfig",
        modeling_module="transformers.models.nemotron_h.modeling_nemotron_h", mixer_takes_kwargs=True,
        layer_flops=nemotron_h_layer_flops, delta_source="in_proj", delta=mamba2_delta,
        sizes={"tiny": (64, 8)}, random_kwargs=nemotron_h_random,
        backbone_attr="model", layer_kinds=hybrid_layer_kinds, merged_use_cache=True,
        random_layers=lambda n, tiny: {"layers_block_type": nemotron_h_pattern(n)},
    ),
    # Mamba-1 mixers (RMS norms with weights on dt, B, C) among attention layers without positions
    # (attn_layer_period / offset), MLP or MoE halves (expert_layer_period / offset).  "1b": a ~1.1 B-parameter
    # shape with Jamba's own layout (attention 1 in 8, MoE 1 in 2, 4 experts), not a specific checkpoint
    "jamba": Family(
        model_type="jamba", name="Jamba", lm_class="JambaForCausalLM", backbone_class="JambaModel",
        config_class="JambaConfig", modeling_module="transformers.models.jamba.modeling_jamba",
        mixer_takes_kwargs=False, layer_flops=jamba_layer_flops, delta_source="x_proj", delta=falcon_mamba_delta,
        sizes={"tiny": (64, 8), "1b": (2048, 16)}, random_kwargs=jamba_random, fast_functions=_MAMBA1_FAST,
        **_HYBRID_PARTS, final_norm_attr="final_layernorm", layer_kinds=hybrid_layer_kinds,
        feed_forward=bamba_feed_forward,
    ),
    # every layer: Mamba-2 and rotary attention side by side on one normalised input, μP multipliers on both
    # branches, the embeddings and the logits; a gated-MLP half.  "1b": a ~1.1 B-parameter shape (hidden 1536,
    # 24 layers), not a specific checkpoint
    "falcon_h1": Family(
        model_type="falcon_h1", name="Falcon-H1", lm_class="FalconH1ForCausalLM", backbone_class="FalconH1Model",
        config_class="FalconH1Config", modeling_module="transformers.models.falcon_h1.modeling_falcon_h1",
        mixer_takes_kwargs=True, layer_flops=falcon_h1_layer_flops, delta_source="in_proj", delta=falcon_h1_delta,
        sizes={"tiny": (64, 4), "1b": (1536, 24)}, random_kwargs=falcon_h1_random, **_HYBRID_PARTS,
        final_norm_attr="final_layernorm", layer_kinds=parallel_layer_kinds, feed_forward=bamba_feed_forward,
        embedding_multiplier="embedding_multiplier", multiplier_on_lookup_only=True,
        logits_multiplier="lm_head_multiplier", residual_multiplier="ssm_out_multiplier",
        ssm_mask_arg="mamba_attention_mask", parallel_branch=falcon_h1_attention_branch,
    ),
    # Mamba-2 layers; at the "hybrid" layers a shared attention block (weights shared by every use, per-use
    # adapters) reads [hidden states, original embeddings] and its output joins the Mamba-2 layer's input.  Anchors
    # sit on the plain Mamba-2 layers.  "1b": Zamba2-1.2B's shape (hidden 2048, 38 layers, the shared block at every
    # sixth), random weights
    "zamba2": Family(
        model_type="zamba2", name="Zamba2", lm_class="Zamba2ForCausalLM", backbone_class="Zamba2Model",
        config_class="Zamba2Config", modeling_module="transformers.models.zamba2.modeling_zamba2",
        mixer_takes_kwargs=True, layer_flops=zamba2_layer_flops, delta_source="in_proj", delta=mamba2_delta,
        sizes={"tiny": (64, 8), "1b": (2048, 38)}, random_kwargs=zamba2_random, **_HYBRID_PARTS,
        final_norm_attr="final_layernorm", layer_kinds=zamba2_layer_kinds, causal_mask_arg="causal_mask",
        ssm_mask_arg="attention_mask", shared_attention_reads_embeddings=True,
        random_layers=lambda n, tiny: {"layers_block_type": zamba2_pattern(n, tiny)},
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
