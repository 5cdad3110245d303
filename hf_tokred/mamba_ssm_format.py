"""The original mamba_ssm checkpoint layout (``state-spaces/mamba-*``, ``state-spaces/mamba2-*``), mapped onto
transformers' Mamba / Mamba-2 configs and weight names.  Pure: dictionaries and names in, dictionaries and names out.

mamba_ssm's ``MambaLMHeadModel`` saves ``config.json`` with the fields of its ``MambaConfig`` dataclass (``d_model``,
``n_layer``, ``vocab_size``, ``ssm_cfg``, ``rms_norm``, ``residual_in_fp32``, ``fused_add_norm``,
``pad_vocab_size_multiple``; since mamba_ssm 2 also ``d_intermediate``, ``attn_layer_idx``, ``attn_cfg``,
``tie_embeddings``) and ``pytorch_model.bin`` with ``backbone.embedding.weight``,
``backbone.layers.{i}.norm.weight``, ``backbone.layers.{i}.mixer.*``, ``backbone.norm_f.weight`` and
``lm_head.weight``.  Each block is ``residual += hidden; hidden = mixer(norm(residual))`` (the add fused into the
norm), which is transformers' ``hidden = hidden + mixer(norm(hidden))`` written differently; the mixers' parameter
names are transformers' own, so only the embedding is renamed.

Everything that would make a converted model compute something else is refused with :class:`UnsupportedCheckpoint`
naming the field: attention layers, MLP blocks, LayerNorm instead of RMSNorm, Mamba-3 mixers, Mamba-2 mixers with
a partial SSM (``d_ssm``), per-channel ``D`` or an un-normed / norm-before-gate output, and any key this module
does not know.  Fields that only steer initialisation or kernel choice are dropped (listed below).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["UnsupportedCheckpoint", "is_mamba_ssm_config", "transformers_config", "transformers_weight_name"]

#: the fields of mamba_ssm's ``MambaConfig`` and their defaults (a field missing from config.json takes its default)
TOP_LEVEL_DEFAULTS: dict[str, Any] = {
    "d_model": 2560, "d_intermediate": 0, "n_layer": 64, "vocab_size": 50277, "ssm_cfg": {}, "attn_layer_idx": [],
    "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 8,
    "tie_embeddings": True,
}
#: the epsilon of every norm (``MixerModel(norm_epsilon=1e-5)``, not a config field; Mamba-2's gated norm: 1e-5)
NORM_EPSILON = 1e-5
#: ssm_cfg keys of each mixer: mamba_ssm name -> (transformers config field, mamba_ssm default); None = dropped
#: (initialisation or kernel choice only)
MAMBA1_KEYS: dict[str, tuple[str | None, Any]] = {
    "d_state": ("state_size", 16), "d_conv": ("conv_kernel", 4), "expand": ("expand", 2),
    "dt_rank": ("time_step_rank", "auto"), "conv_bias": ("use_conv_bias", True), "bias": ("use_bias", False),
    "dt_min": ("time_step_min", 0.001), "dt_max": ("time_step_max", 0.1), "dt_init": ("time_step_init_scheme", "random"),
    "dt_scale": ("time_step_scale", 1.0), "dt_init_floor": ("time_step_floor", 1e-4), "use_fast_path": (None, True),
}
MAMBA2_KEYS: dict[str, tuple[str | None, Any]] = {
    "d_state": ("state_size", 128), "d_conv": ("conv_kernel", 4), "expand": ("expand", 2), "headdim": ("head_dim", 64),
    "ngroups": ("n_groups", 1), "chunk_size": ("chunk_size", 256), "dt_limit": ("time_step_limit", (0.0, math.inf)),
    "conv_bias": ("use_conv_bias", True), "bias": ("use_bias", False), "dt_min": ("time_step_min", 0.001),
    "dt_max": ("time_step_max", 0.1), "dt_init_floor": ("time_step_floor", 1e-4), "conv_init": (None, None),
    "A_init_range": (None, (1, 16)), "use_mem_eff_path": (None, True), "sequence_parallel": (None, True),
}
#: Mamba-2 options transformers' Mamba2Mixer computes only at this value: key -> (required value, what it means)
MAMBA2_FIXED: dict[str, tuple[Any, str]] = {
    "d_ssm": (None, "an SSM over only part of the channels (the rest a gated MLP)"),
    "D_has_hdim": (False, "a D skip per channel instead of per head"),
    "rmsnorm": (True, "no gated RMSNorm on the SSM output"),
    "norm_before_gate": (False, "the gated RMSNorm normalising before the gate"),
}
_LAYERS = {"Mamba1": ("mamba", MAMBA1_KEYS), "Mamba2": ("mamba2", MAMBA2_KEYS)}
_LM_CLASS = {"mamba": "MambaForCausalLM", "mamba2": "Mamba2ForCausalLM"}


class UnsupportedCheckpoint(ValueError):
    """An original mamba_ssm checkpoint that transformers' Mamba / Mamba-2 classes cannot reproduce."""


def is_mamba_ssm_config(config: Any) -> bool:
    """Whether a ``config.json`` dict is mamba_ssm's (``d_model`` / ``n_layer``, no transformers ``model_type``)."""
    return isinstance(config, dict) and "model_type" not in config and "d_model" in config and "n_layer" in config


def _refuse(source: str, problem: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(f"{source}: {problem}; transformers' Mamba classes cannot load it, so hf_tokred "
                                 "does not convert it (a converted model would compute something else)")


def _top_level(raw: dict, source: str) -> dict:
    unknown = sorted(set(raw) - set(TOP_LEVEL_DEFAULTS))
    if unknown:
        raise _refuse(source, f"config.json has unknown mamba_ssm field(s) {unknown} (known: "
                              f"{', '.join(TOP_LEVEL_DEFAULTS)})")
    cfg = {**TOP_LEVEL_DEFAULTS, **raw}
    if cfg["attn_layer_idx"]:
        raise _refuse(source, f"attn_layer_idx={cfg['attn_layer_idx']} asks for attention layers (a hybrid model)")
    if cfg["d_intermediate"]:
        raise _refuse(source, f"d_intermediate={cfg['d_intermediate']} asks for an MLP block after every mixer")
    if not cfg["rms_norm"]:
        raise _refuse(source, "rms_norm=false asks for LayerNorm (transformers' Mamba blocks use RMSNorm)")
    return cfg


def _mixer(ssm_cfg: dict, source: str) -> tuple[str, dict]:
    """``(model_type, transformers config fields)`` of the mixer described by ``ssm_cfg``."""
    if not isinstance(ssm_cfg, dict):
        raise _refuse(source, f"ssm_cfg must be a JSON object, got {ssm_cfg!r}")
    ssm_cfg = dict(ssm_cfg)
    layer = ssm_cfg.pop("layer", "Mamba1")
    if layer not in _LAYERS:
        raise _refuse(source, f"ssm_cfg layer={layer!r} (supported: {', '.join(_LAYERS)})")
    model_type, keys = _LAYERS[layer]
    fixed = MAMBA2_FIXED if model_type == "mamba2" else {}
    for key, (required, meaning) in fixed.items():
        if key in ssm_cfg and ssm_cfg.pop(key) != required:
            raise _refuse(source, f"ssm_cfg {key} other than {required!r} asks for {meaning}")
    unknown = sorted(set(ssm_cfg) - set(keys))
    if unknown:
        raise _refuse(source, f"unknown ssm_cfg key(s) {unknown} for a {layer} mixer (known: "
                              f"{', '.join(sorted([*keys, *fixed, 'layer']))})")
    fields = {}
    for key, (field, default) in keys.items():
        if field is not None:
            value = ssm_cfg.get(key, default)
            fields[field] = list(value) if isinstance(value, tuple) else value
    return model_type, fields


def transformers_config(raw: dict, source: str = "checkpoint") -> dict:
    """The transformers config dict (``model_type``, ``architectures`` and the fields of ``MambaConfig`` /
    ``Mamba2Config``) of a mamba_ssm ``config.json``; :class:`UnsupportedCheckpoint` naming what cannot be mapped."""
    cfg = _top_level(raw, source)
    model_type, fields = _mixer(cfg["ssm_cfg"], source)
    multiple = cfg["pad_vocab_size_multiple"]
    vocab = cfg["vocab_size"] + (-cfg["vocab_size"]) % multiple  # MambaLMHeadModel pads the vocabulary
    d_model = cfg["d_model"]
    if model_type == "mamba2":
        inner = fields["expand"] * d_model
        if inner % fields["head_dim"]:
            raise _refuse(source, f"expand * d_model = {inner} is not a multiple of ssm_cfg headdim={fields['head_dim']}")
        fields["num_heads"] = inner // fields["head_dim"]
    return {
        "model_type": model_type, "architectures": [_LM_CLASS[model_type]], **fields,
        "hidden_size": d_model, "num_hidden_layers": cfg["n_layer"], "vocab_size": vocab,
        "residual_in_fp32": bool(cfg["residual_in_fp32"]), "tie_word_embeddings": bool(cfg["tie_embeddings"]),
        "layer_norm_epsilon": NORM_EPSILON,
        # GPT-NeoX-20B's tokenizer, which the state-spaces checkpoints use: <|endoftext|> = 0, <|padding|> = 1
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1,
    }


def transformers_weight_name(name: str) -> str:
    """A mamba_ssm weight name as transformers names it (only the embedding differs)."""
    prefix = "backbone.embedding."
    return "backbone.embeddings." + name[len(prefix):] if name.startswith(prefix) else name
