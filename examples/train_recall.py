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
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

from hf_tokred.evaluation.mqar import MQARSettings, make_batch, recall_hits, tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bundled import install_fast_mamba_scan, lr_at  # noqa: E402  (the LM script's scan and schedule)

EVAL_SEED = 1_000_000  # training uses seeds < EVAL_SEED


def make_config(family: str, settings: MQARSettings, hidden: int, layers: int, state: int = 16):
    common = dict(vocab_size=settings.vocab_size, hidden_size=hidden, num_hidden_layers=layers, state_size=state,
                  expand=2, conv_kernel=4, tie_word_embeddings=True, bos_token_id=1, eos_token_id=1, pad_token_id=0,
                  layer_norm_epsilon=1e-5, residual_in_fp32=True, use_cache=True)
    if family == "mamba":
        return MambaConfig(**common, use_mambapy=False)
    return Mamba2Config(**common, head_dim=16, num_heads=2 * hidden // 16, n_groups=1, chunk_size=64)


def build(family, settings, hidden, layers, state=16):
    cfg = make_config(family, settings, hidden, layers, state)
    return (MambaForCausalLM if family == "mamba" else Mamba2ForCausalLM)(cfg)


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
    torch.set_num_threads(args.threads)
    settings = MQARSettings(**json.loads(args.settings)) if args.settings else MQARSettings()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    model = build(args.family, settings, args.hidden, args.layers, args.state)
    if args.init:  # fine-tune a saved model of the same shape (e.g. the bundled one, for another layout)
        model.load_state_dict(AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32).state_dict())
    depth = args.depth
    if args.family == "mamba":
        install_fast_mamba_scan()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "A_log" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "A_log" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))
    step, elapsed_prev = 0, 0.0
    ckpt = out / "ckpt.pt"
    if args.resume and ckpt.exists():
        st = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed_prev = st["step"], st["elapsed"]
        print(f"[recall] resumed at step {step}", flush=True)
    log = open(out / "train_log.jsonl", "a")
    if step == 0:
        log.write(json.dumps({"event": "start", "args": vars(args), "settings": settings.to_dict(),
                              "params": sum(p.numel() for p in model.parameters())}) + "\n")
    t0, last_save = time.time(), time.time()
    model.train()

    def save():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "elapsed": elapsed_prev + time.time() - t0, "args": vars(args),
                    "settings": settings.to_dict()}, out / "ckpt.pt.tmp")
        os.replace(out / "ckpt.pt.tmp", ckpt)

    while step < min(args.steps, args.stop_at or args.steps):
        if args.minutes and elapsed_prev + time.time() - t0 > args.minutes * 60:
            break
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        ids, labels = training_batch(curriculum(settings, step, args.curriculum), args.batch, args.seed, step,
                                     args.mix_pairs, depth)
        logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        rec = {"step": step, "loss": round(loss.item(), 4), "lr": lr,
               "elapsed_s": round(elapsed_prev + time.time() - t0, 1)}
        if step % args.eval_every == 0 or step == args.steps:
            rec["eval_acc"] = round(accuracy(model, settings), 4)
            if depth != 0.0:  # also the layout it trains on
                rec["eval_acc_trained_depth"] = round(accuracy(model, settings, depth=depth), 4)
            print(f"[recall] {rec}", flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if time.time() - last_save > 120 or step == args.steps:
            save()
            last_save = time.time()
    save()


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
    p.add_argument("--family", choices=["mamba", "mamba2"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--settings", default="", help="MQARSettings as JSON (default: the benchmark default)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--state", type=int, default=16, help="state_size (N) of every block")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--minutes", type=float, default=0)
    p.add_argument("--stop-at", type=int, default=0, help="stop at this step (the LR schedule still spans --steps)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--mix-pairs", action="store_true", help="half the rows with fewer pairs (a curriculum)")
    p.add_argument("--curriculum", type=int, default=0,
                   help="steps over which the sequence grows from no filler to seq_len (0: none)")
    p.add_argument("--resume", action="store_true")
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
