#!/usr/bin/env python
"""Falcon-H1: where an anchor's plan comes from.  hf_tokred makes it from the Mamba-2 branch's (scaled) output; the
alternative measured here makes it from the sum of both branches (Mamba-2 + attention, the layer's whole mixer
output).  Not part of the package: the alternative is switched on for this process only (the families table's
``plan_from_sum``).

    PYTHONPATH=. python dev/falcon_h1_plan_source.py --hidden 256 --layers 8 --length 256 --prompts 16

For each method and plan source, against the dense model on the same prompts: the mean KL divergence of the
next-token distribution at the last position, how often the greedy next token agrees, the mean cosine similarity
of the final hidden states at the kept positions, and how much the two sources' kept sets overlap (Jaccard).  The
model has random (perturbed) weights, as no Falcon-H1 checkpoint can be loaded offline: the figures compare the two
sources' distortion of one network, not task quality.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import transformers

from hf_tokred import TokenReductionConfig, apply_token_reduction
from hf_tokred.families import FAMILIES
from hf_tokred.models import random_config


def build(hidden: int, layers: int, seed: int):
    config = random_config("falcon_h1-tiny")
    config.hidden_size, config.num_hidden_layers = hidden, layers
    config.num_attention_heads, config.num_key_value_heads = hidden // 64, max(hidden // 256, 1)
    config.intermediate_size, config.mamba_d_ssm, config.mamba_n_heads = 2 * hidden, 2 * hidden, 2 * hidden // 32
    config.mamba_d_head, config.mamba_chunk_size = 32, 64
    torch.manual_seed(seed)
    model = transformers.FalconH1ForCausalLM(config).eval()
    with torch.no_grad():  # the structured init makes tokens alike; perturb it
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def run(model, ids, cfg, from_sum: bool):
    family = FAMILIES["falcon_h1"]
    FAMILIES["falcon_h1"] = dataclasses.replace(family, plan_from_sum=from_sum)
    try:
        apply_token_reduction(model, cfg)
        with torch.no_grad():
            return model(ids, output_hidden_states=True, use_cache=False)
    finally:
        FAMILIES["falcon_h1"] = family
        apply_token_reduction(model, None)


def compare(model, ids, cfg) -> dict:
    with torch.no_grad():
        dense = model(ids, output_hidden_states=True, use_cache=False)
    dense_logp = dense.logits[:, -1].float().log_softmax(-1)
    rows, kept = {}, {}
    for source, from_sum in (("mamba branch", False), ("sum of branches", True)):
        out = run(model, ids, cfg, from_sum)
        logp = out.logits[:, -1].float().log_softmax(-1)
        real = out.kept_positions >= 0
        final = dense.hidden_states[-1].gather(1, out.kept_positions.clamp_min(0)[..., None].expand(
            -1, -1, dense.hidden_states[-1].shape[-1]))
        cos = torch.nn.functional.cosine_similarity(out.hidden_states[-1].float(), final.float(), dim=-1)
        rows[source] = {
            "kl_last": float((dense_logp.exp() * (dense_logp - logp)).sum(-1).mean()),
            "top1_agree": float((logp.argmax(-1) == dense_logp.argmax(-1)).float().mean()),
            "cos_final_hidden": float(cos[real].mean()),
        }
        kept[source] = [set(p[r].tolist()) for p, r in zip(out.kept_positions, real)]
    a, b = kept.values()
    jaccard = sum(len(x & y) / len(x | y) for x, y in zip(a, b)) / len(a)
    return {"rows": rows, "kept_jaccard": jaccard}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--keep-ratio", type=float, default=0.7)
    ap.add_argument("--methods", default="utrc,evit,tome")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build(args.hidden, args.layers, args.seed)
    ids = torch.randint(2, model.config.vocab_size, (args.prompts, args.length),
                        generator=torch.Generator().manual_seed(args.seed + 1))
    anchors = [1, args.layers // 2]
    result = {"model": {"hidden": args.hidden, "layers": args.layers}, "length": args.length,
              "prompts": args.prompts, "keep_ratio": args.keep_ratio, "anchors": anchors, "methods": {}}
    for method in args.methods.split(","):
        cfg = TokenReductionConfig(method=method, keep_ratio=args.keep_ratio, anchors=anchors)
        result["methods"][method] = compare(model, ids, cfg)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
