#!/usr/bin/env python
"""Train the bundled MQAR recall models of ``hf_tokred`` (``bundled:recall-mamba``, ``bundled:recall-mamba2``).

Multi-query associative recall (``hf_tokred.evaluation.mqar``): key-value pairs, filler, then queries; the loss
is the cross-entropy of the bound value at each query position only (as in Zoology).  Every training batch is
drawn fresh from the seeded generator (set ``seed`` + step), so the run is reproducible and resumable, and the
evaluation set (seed 1_000_000, never a training seed) is never trained on.

    python examples/train_recall.py train --family mamba2 --out /work/train_runs/recall_mamba2 --steps 4000
    python examples/train_recall.py train --family mamba2 --out /work/train_runs/recall_mamba2 --steps 4000 --resume
    python examples/train_recall.py export --family mamba2 --out /work/train_runs/recall_mamba2 \
        --dest hf_tokred/bundled/recall-mamba2
    python examples/train_recall.py eval --model hf_tokred/bundled/recall-mamba2
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hf_tokred.evaluation.mqar import MQARSettings, make_batch, recall_hits, tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_loop import EVAL_SEED, add_train_arguments, train  # noqa: E402  (the loop the task-model scripts share)
from train_loop import build as build_tiny  # noqa: E402


def build(family, settings, hidden, layers, state=16):
    return build_tiny(family, settings.vocab_size, hidden, layers, state, bos=1, pad=0)


@torch.no_grad()
def accuracy(model, settings: MQARSettings, n: int = 256, batch: int = 64, depth: float | None = 0.0) -> float:
    model.eval()
    hits = []
    for start in range(0, n, batch):
        b = make_batch(settings, min(batch, n - start), EVAL_SEED, start, depth=depth)
        hits.append(recall_hits(model(input_ids=b.input_ids, use_cache=False).logits.float(), b))
    model.train()
    return torch.cat(hits).float().mean().item()


def curriculum(settings: MQARSettings, step: int, warm: int) -> MQARSettings:
    """The setting of training step ``step``: the sequence grows from pairs + queries alone (no filler) to the
    target length over the first ``warm`` steps, in powers of two."""
    if warm <= 0 or step >= warm:
        return settings
    core = 2 * (settings.num_pairs + settings.num_queries)
    length = core
    stages = max(1, math.ceil(math.log2(settings.seq_len / core)))
    for _ in range(int(stages * step / warm)):
        length *= 2
    return replace(settings, seq_len=min(length, settings.seq_len), min_filler_share=0.0)


def training_batch(settings: MQARSettings, n: int, seed: int, step: int, mix: bool, depth: float | None = 0.0):
    """``(input_ids, labels)`` for one step.  With ``mix``, half the rows use the target setting and the other
    half fewer pairs (1, 2, 4, ... queries = pairs, same length): easy rows give a learning signal early.
    ``depth``: where the key-value block sits in the filler (``None``: random per row)."""
    if not mix:
        b = make_batch(settings, n, seed, step * n, depth=depth)
        return b.input_ids, b.labels
    counts = [settings.num_pairs]
    while counts[-1] > 1:
        counts.append(counts[-1] // 2)
    easy = counts[1:] or counts
    parts = [(settings, n - n // 2)] + [
        (replace(settings, num_pairs=c, num_queries=min(c, settings.num_queries)), n // 2 // len(easy)
         + (i < n // 2 % len(easy))) for i, c in enumerate(easy)]
    ids, labels = [], []
    for k, (s, rows) in enumerate(parts):
        b = make_batch(s, rows, seed + 7919 * k, step * n, depth=depth)
        ids.append(b.input_ids)
        labels.append(b.labels)
    return torch.cat(ids), torch.cat(labels)


def depth_arg(text: str) -> float | None:
    """``--depth``: a share of the filler in [0, 1], or ``random``."""
    if text == "random":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1] or 'random', got {text!r}")
    return value


def cmd_train(args):
    settings = MQARSettings(**json.loads(args.settings)) if args.settings else MQARSettings()
    torch.manual_seed(args.seed)
    model = build(args.family, settings, args.hidden, args.layers, args.state)
    if args.init:  # fine-tune a saved model of the same shape (e.g. the bundled one, for another layout)
        model.load_state_dict(AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32).state_dict())

    def batch(step):
        return training_batch(curriculum(settings, step, args.curriculum), args.batch, args.seed, step,
                              args.mix_pairs, args.depth)

    def evaluate():
        rec = {"eval_acc": accuracy(model, settings)}
        if args.depth != 0.0:  # also the layout it trains on
            rec["eval_acc_trained_depth"] = accuracy(model, settings, depth=args.depth)
        return rec
    train(model, args, settings.to_dict(), batch, evaluate, "recall")


def cmd_export(args):
    st = torch.load(Path(args.out) / "ckpt.pt", map_location="cpu", weights_only=False)
    settings = MQARSettings(**st["settings"])
    a = st["args"]
    model = build(a["family"], settings, a["hidden"], a["layers"], a.get("state", 16))
    model.load_state_dict(st["model"])
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    model.config.mqar = settings.to_dict()  # the setting it was trained on travels in config.json
    model.to(torch.float16).save_pretrained(str(dest))
    (dest / "generation_config.json").unlink(missing_ok=True)
    tokenizer(settings).save_pretrained(str(dest))
    print(f"[export] step {st['step']} -> {dest}")


def cmd_eval(args):
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    settings = MQARSettings(**model.config.mqar)
    print(json.dumps({"model": args.model, "dense_recall": accuracy(model, settings, n=args.n)}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("train")
    add_train_arguments(p, layers=8, steps=4000, warmup=200)
    p.add_argument("--settings", default="", help="MQARSettings as JSON (default: the benchmark default)")
    p.add_argument("--mix-pairs", action="store_true", help="half the rows with fewer pairs (a curriculum)")
    p.add_argument("--curriculum", type=int, default=0,
                   help="steps over which the sequence grows from no filler to seq_len (0: none)")
    p.add_argument("--depth", type=depth_arg, default=0.0, help="where the key-value block sits in the filler: a share in [0, 1], "
                   "or 'random' (per row)")
    p.add_argument("--init", default="", help="start from this saved model's weights (same shape)")
    p = sub.add_parser("export")
    p.add_argument("--family", choices=["mamba", "mamba2"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dest", required=True)
    p = sub.add_parser("eval")
    p.add_argument("--model", required=True)
    p.add_argument("--n", type=int, default=1024)
    args = ap.parse_args(argv)
    {"train": cmd_train, "export": cmd_export, "eval": cmd_eval}[args.cmd](args)


if __name__ == "__main__":
    main()
