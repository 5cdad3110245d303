"""mamba_ssm's ``MambaLMHeadModel`` written out slowly from its equations, on the ORIGINAL weights (mamba_ssm's names
and layouts), one token at a time in float64; and tiny checkpoints in mamba_ssm's layout for the tests.

Nothing here imports ``hf_tokred`` or transformers' Mamba code.  The equations (state-spaces/mamba, ``mixer_seq_simple``,
``block``, ``mamba_simple``, ``mamba2``, ``layernorm_gated``):

* residual stream (``Block`` with ``fused_add_norm``): ``residual = hidden + residual`` (``hidden`` alone for the
  first block); ``hidden = mixer(norm(residual))``; at the end ``norm_f(hidden + residual)``, then ``lm_head``
  (the embedding when tied).  ``norm`` is RMSNorm ``x / sqrt(mean(x^2) + eps) * w`` or LayerNorm
  ``(x - mean) / sqrt(var + eps) * w + b`` per ``rms_norm``; ``eps = 1e-5``;
* Mamba-1 mixer: ``x, z = in_proj(u)``; ``x = silu(causal depthwise conv(x) + conv bias)``;
  ``dt, B, C = x_proj(x)``; ``dt = softplus(dt_proj(dt))`` (weight and bias); ``A = -exp(A_log)``;
  ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t``; ``y_t = h_t C_t + D x_t``; ``out_proj(y * silu(z))``;
* Mamba-2 mixer: ``z, xBC, dt = in_proj(u)``; ``xBC = silu(conv(xBC))``; ``x, B, C = xBC`` (``B, C`` per group);
  ``dt = clamp(softplus(dt + dt_bias), dt_limit)`` per head; per head ``h`` (head dim x state) of group
  ``head // (heads / ngroups)``: ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t + D x_t``;
  gated RMSNorm: ``y * silu(z)`` normalised over each group of ``d_inner / ngroups`` channels, times ``norm.weight``
  (``norm_before_gate=False``, eps 1e-5); ``out_proj``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from slow_reference import slow_apply, slow_weights

EPS = 1e-5


# ----------------------------------------------------------------------------- the configuration, as mamba_ssm reads it


def settings(config: dict) -> dict:
    """Every number the forward needs, from a mamba_ssm ``config.json`` dict (mamba_ssm's defaults filled in)."""
    ssm = dict(config.get("ssm_cfg", {}))
    layer = ssm.get("layer", "Mamba1")
    d = config["d_model"]
    s = {"layer": layer, "d": d, "n_layer": config["n_layer"], "rms_norm": config.get("rms_norm", True),
         "tied": config.get("tie_embeddings", True), "expand": ssm.get("expand", 2), "K": ssm.get("d_conv", 4),
         "bias": ssm.get("bias", False), "conv_bias": ssm.get("conv_bias", True)}
    multiple = config.get("pad_vocab_size_multiple", 8)
    s["vocab"] = math.ceil(config.get("vocab_size", 50277) / multiple) * multiple
    s["E"] = s["expand"] * d
    if layer == "Mamba1":
        s["N"] = ssm.get("d_state", 16)
        s["R"] = math.ceil(d / 16) if ssm.get("dt_rank", "auto") == "auto" else ssm["dt_rank"]
    else:
        s["N"] = ssm.get("d_state", 128)
        s["P"] = ssm.get("headdim", 64)
        s["G"] = ssm.get("ngroups", 1)
        s["H"] = s["E"] // s["P"]
        s["dt_limit"] = tuple(ssm.get("dt_limit", (0.0, math.inf)))
    return s


# ----------------------------------------------------------------------------- the forward, token by token


def norm(x, w, b, rms: bool):
    if rms:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt((x - mean).pow(2).mean(-1, keepdim=True) + EPS) * w + b


def linear(x, W, prefix, name):
    out = x @ W[f"{prefix}{name}.weight"].T
    bias = W.get(f"{prefix}{name}.bias")
    return out if bias is None else out + bias


def causal_conv(x, weight, bias):
    """``x [L, C]``, ``weight [C, 1, K]``: ``out[t, c] = bias[c] + sum_k weight[c, k] x[t - K + 1 + k, c]``."""
    L, K = x.shape[0], weight.shape[-1]
    out = torch.zeros_like(x) if bias is None else bias.expand_as(x).clone()
    for t in range(L):
        for k in range(K):
            src = t - K + 1 + k
            if src >= 0:
                out[t] += weight[:, 0, k] * x[src]
    return out


def mamba1_mixer(W, p, u, s):
    xz = linear(u, W, p, "in_proj")
    x, z = xz[:, : s["E"]], xz[:, s["E"]:]
    x = F.silu(causal_conv(x, W[p + "conv1d.weight"], W.get(p + "conv1d.bias")))
    dbc = x @ W[p + "x_proj.weight"].T
    dt, B, C = dbc[:, : s["R"]], dbc[:, s["R"]: s["R"] + s["N"]], dbc[:, s["R"] + s["N"]:]
    dt = F.softplus(dt @ W[p + "dt_proj.weight"].T + W[p + "dt_proj.bias"])
    A = -torch.exp(W[p + "A_log"])
    h = torch.zeros(s["E"], s["N"], dtype=u.dtype)
    ys = []
    for t in range(u.shape[0]):
        h = torch.exp(dt[t, :, None] * A) * h + dt[t, :, None] * B[t][None, :] * x[t][:, None]
        ys.append(h @ C[t] + W[p + "D"] * x[t])
    y = torch.stack(ys) * F.silu(z)
    return linear(y, W, p, "out_proj")


def mamba2_mixer(W, p, u, s):
    E, G, N, H, P = s["E"], s["G"], s["N"], s["H"], s["P"]
    zxbcdt = linear(u, W, p, "in_proj")
    z, xBC, dt = zxbcdt[:, :E], zxbcdt[:, E: 2 * E + 2 * G * N], zxbcdt[:, 2 * E + 2 * G * N:]
    xBC = F.silu(causal_conv(xBC, W[p + "conv1d.weight"], W.get(p + "conv1d.bias")))
    x, B, C = xBC[:, :E], xBC[:, E: E + G * N].reshape(-1, G, N), xBC[:, E + G * N:].reshape(-1, G, N)
    dt = F.softplus(dt + W[p + "dt_bias"]).clamp(min=s["dt_limit"][0], max=s["dt_limit"][1])
    A = -torch.exp(W[p + "A_log"])
    L = u.shape[0]
    y = torch.zeros(L, E, dtype=u.dtype)
    for head in range(H):
        g = head // (H // G)
        state = torch.zeros(P, N, dtype=u.dtype)
        for t in range(L):
            xh = x[t, head * P: (head + 1) * P]
            state = torch.exp(dt[t, head] * A[head]) * state + dt[t, head] * xh[:, None] * B[t, g][None, :]
            y[t, head * P: (head + 1) * P] = state @ C[t, g] + W[p + "D"][head] * xh
    gated = (y * F.silu(z)).reshape(L, G, E // G)
    gated = gated / torch.sqrt(gated.pow(2).mean(-1, keepdim=True) + EPS)
    return linear(gated.reshape(L, E) * W[p + "norm.weight"], W, p, "out_proj")


def reference_logits(state_dict: dict, config: dict, ids, plans=(), hidden_strategy="merge",
                     residual_strategy="merge", q=0.5):
    """Logits ``[kept, vocab]`` of one unpadded sequence ``ids``: mamba_ssm's forward on its own weights, float64.

    ``plans`` (``(layer, pairs, scores)``, row-local, as ``slow_reference.row_plans`` gives them) reduce the two
    branches of the residual stream after that layer's mixer, each with its strategy (``slow_reference``'s
    documented rules), so the reference also covers a reducing forward.
    """
    s = settings(config)
    W = {k: v.double() for k, v in state_dict.items()}
    mixer = mamba1_mixer if s["layer"] == "Mamba1" else mamba2_mixer
    head = W["backbone.embedding.weight"] if s["tied"] else W["lm_head.weight"]
    by_layer = {layer: (pairs, scores) for layer, pairs, scores in plans}
    hidden, residual = W["backbone.embedding.weight"][ids], None
    for i in range(s["n_layer"]):
        p = f"backbone.layers.{i}."
        residual = hidden if residual is None else hidden + residual
        hidden = mixer(W, p + "mixer.", norm(residual, W[p + "norm.weight"], W.get(p + "norm.bias"), s["rms_norm"]), s)
        if i in by_layer:
            pairs, scores = by_layer[i]
            residual = slow_apply(residual, pairs, slow_weights(residual_strategy, pairs, scores, residual, q))
            hidden = slow_apply(hidden, pairs, slow_weights(hidden_strategy, pairs, scores, hidden, q))
    out = norm(hidden + residual, W["backbone.norm_f.weight"], W.get("backbone.norm_f.bias"), s["rms_norm"])
    return out @ head.T


# ----------------------------------------------------------------------------- tiny checkpoints in mamba_ssm's layout


def random_state_dict(config: dict, seed: int = 0) -> dict:
    """Weights with mamba_ssm's names and shapes for ``config`` (random, scaled so activations stay moderate)."""
    s = settings(config)
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, scale=0.3: torch.randn(*shape, generator=g) * scale  # noqa: E731
    d, E, K = s["d"], s["E"], s["K"]
    sd = {"backbone.embedding.weight": rnd(s["vocab"], d, scale=1.0)}
    for i in range(s["n_layer"]):
        p = f"backbone.layers.{i}."
        sd[p + "norm.weight"] = 1 + rnd(d, scale=0.1)
        if not s["rms_norm"]:
            sd[p + "norm.bias"] = rnd(d, scale=0.1)
        m = p + "mixer."
        if s["layer"] == "Mamba1":
            channels, in_out = E, 2 * E
            sd[m + "x_proj.weight"] = rnd(s["R"] + 2 * s["N"], E)
            sd[m + "dt_proj.weight"] = rnd(E, s["R"])
            sd[m + "dt_proj.bias"] = rnd(E, scale=0.5) - 2.0
            sd[m + "A_log"] = torch.log(torch.arange(1, s["N"] + 1, dtype=torch.float).repeat(E, 1)) + rnd(E, s["N"], scale=0.1)
            sd[m + "D"] = 1 + rnd(E, scale=0.1)
        else:
            channels = E + 2 * s["G"] * s["N"]
            in_out = 2 * E + 2 * s["G"] * s["N"] + s["H"]
            sd[m + "dt_bias"] = rnd(s["H"], scale=0.5) - 2.0
            sd[m + "A_log"] = torch.log(torch.linspace(1, 8, s["H"])) + rnd(s["H"], scale=0.1)
            sd[m + "D"] = 1 + rnd(s["H"], scale=0.1)
            sd[m + "norm.weight"] = 1 + rnd(E, scale=0.1)
        sd[m + "in_proj.weight"] = rnd(in_out, d)
        sd[m + "conv1d.weight"] = rnd(channels, 1, K)
        sd[m + "out_proj.weight"] = rnd(d, E)
        if s["conv_bias"]:
            sd[m + "conv1d.bias"] = rnd(channels, scale=0.1)
        if s["bias"]:
            sd[m + "in_proj.bias"] = rnd(in_out, scale=0.1)
            sd[m + "out_proj.bias"] = rnd(d, scale=0.1)
    sd["backbone.norm_f.weight"] = 1 + rnd(d, scale=0.1)
    if not s["rms_norm"]:
        sd["backbone.norm_f.bias"] = rnd(d, scale=0.1)
    # MambaLMHeadModel.state_dict() lists the tied head under its own name, sharing the embedding's storage
    sd["lm_head.weight"] = sd["backbone.embedding.weight"] if s["tied"] else rnd(s["vocab"], d)
    return sd


def write_checkpoint(folder: Path, config: dict, state_dict: dict, weights: str = "bin") -> Path:
    """A folder as mamba_ssm's ``save_pretrained`` writes it (``config.json`` + ``pytorch_model.bin``), or with
    ``model.safetensors`` (how some Hub repos re-upload them; shared tensors cloned)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=4))
    if weights == "bin":
        torch.save(state_dict, folder / "pytorch_model.bin")
    else:
        save_file({k: v.clone().contiguous() for k, v in state_dict.items()}, str(folder / "model.safetensors"))
    return folder
