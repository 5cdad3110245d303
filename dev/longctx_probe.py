#!/usr/bin/env python
"""Quick probes of long-context selection variants on the bundled recall model (dev tool; docs/long-prompts.md cites its output).

MQAR sequences of the model's own setting, stretched to ``--lengths`` with more filler, the key-value block at
each of ``--depths`` (share of the filler before it); the queries are the question (``question_length``), so
they are never reduced.  Prints recall per (variant, length, depth) with 95 % bootstrap intervals as JSON lines.

    python dev/longctx_probe.py --model hf_tokred/bundled/recall-mamba2 --variants dense,front_prune:128 \
        --lengths 128,1024,2048 --depths 0,0.5,1 --n 128
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch
from transformers import AutoModelForCausalLM

import hf_tokred
from hf_tokred import TokenReductionConfig
from hf_tokred.evaluation.mqar import MQARSettings, make_batch
from hf_tokred.evaluation.quality import bootstrap_ci

EVAL_SEED = 1_000_000


def at_depth(settings: MQARSettings, n: int, length: int, depth: float, seed: int = EVAL_SEED):
    """A batch of ``length``-token sequences: the key-value block after ``depth`` of the filler."""
    s = replace(settings, seq_len=length)
    b = make_batch(s, n, seed, depth=depth)
    ids = b.input_ids
    return ids, b.query_positions, b.answers, 2 * s.num_queries


def variant_config(text: str) -> TokenReductionConfig | None:
    """``dense`` or ``method:K[:key=value,...]`` (e.g. ``evit:128:metric=delta,anchors=1``)."""
    if text == "dense":
        return None
    method, k, *rest = text.split(":")
    kw = {}
    for item in (rest[0].split(",") if rest else []):
        key, value = item.split("=")
        kw[key] = [int(a) for a in value.split("+")] if key == "anchors" else (
            float(value) if key in ("protect_recent", "q") else value)
    return TokenReductionConfig(method=method, keep_tokens=int(k), **kw)


@torch.no_grad()
def recall(model, ids, qpos, answers, question, batch=64):
    hits = []
    for i in range(0, len(ids), batch):
        out = model(ids[i:i + batch], question_length=question, use_cache=False)
        hits.append(out.logits[:, qpos].argmax(-1) == answers[i:i + batch])
    return torch.cat(hits).float()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="hf_tokred/bundled/recall-mamba2")
    ap.add_argument("--variants", default="dense,front_prune:128")
    ap.add_argument("--lengths", default="128,1024,2048")
    ap.add_argument("--depths", default="0,0.5,1")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--seed", type=int, default=EVAL_SEED)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    settings = MQARSettings(**model.config.mqar)
    for length in map(int, args.lengths.split(",")):
        for depth in map(float, args.depths.split(",")):
            ids, qpos, answers, question = at_depth(settings, args.n, length, depth, args.seed)
            for v in args.variants.split(";" if ";" in args.variants else ","):
                hf_tokred.apply_token_reduction(model, variant_config(v))
                h = recall(model, ids, qpos, answers, question)
                per_seq = h.mean(1).tolist()
                _, lo, hi = bootstrap_ci(per_seq)
                print(json.dumps({"variant": v, "length": length, "depth": depth, "recall": round(h.mean().item(), 4),
                                  "ci": [round(lo, 4), round(hi, 4)], "n": args.n}), flush=True)


if __name__ == "__main__":
    main()
