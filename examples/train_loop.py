"""The training loop the task-model scripts share (``train_recall.py``, ``train_passkey.py``): a tiny Mamba / Mamba-2
of the bundled models' shape, AdamW with weight decay on matrices, warm-up + cosine schedule, a log line per step,
an evaluation every ``--eval-every`` steps, and a checkpoint every two minutes that ``--resume`` continues from.
Batches must depend only on (seed, step), so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bundled import install_fast_mamba_scan, lr_at  # noqa: E402  (the LM script's scan and schedule)

EVAL_SEED = 1_000_000  # training uses seeds < EVAL_SEED

__all__ = ["EVAL_SEED", "add_train_arguments", "build", "train"]


def add_train_arguments(p, layers: int, steps: int, warmup: int) -> None:
    """The ``train`` subcommand's flags every task-model script shares (defaults: the script's model and run)."""
    p.add_argument("--family", choices=["mamba", "mamba2"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--state", type=int, default=16, help="state_size (N) of every block")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--minutes", type=float, default=0, help="stop after this many minutes of training (0: no limit)")
    p.add_argument("--stop-at", type=int, default=0, help="stop at this step (the LR schedule still spans --steps)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")


def build(family: str, vocab: int, hidden: int, layers: int, state: int, bos: int, pad: int):
    """A tiny ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` (tied embeddings, expand 2, Mamba-2 heads of 16)."""
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, state_size=state, expand=2,
                  conv_kernel=4, tie_word_embeddings=True, bos_token_id=bos, eos_token_id=bos, pad_token_id=pad,
                  layer_norm_epsilon=1e-5, residual_in_fp32=True, use_cache=True)
    if family == "mamba":
        return MambaForCausalLM(MambaConfig(**common, use_mambapy=False))
    return Mamba2ForCausalLM(Mamba2Config(**common, head_dim=16, num_heads=2 * hidden // 16, n_groups=1,
                                          chunk_size=64))


def train(model, args, settings: dict, batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
          evaluate: Callable[[], dict], tag: str, logits_to_keep: int = 0) -> None:
    """Train ``model`` in ``args.out`` until ``args.steps`` (or ``args.stop_at`` / ``args.minutes``).

    ``batch(step) -> (input_ids, labels)`` (labels -100 where no loss); ``evaluate() -> {name: value}`` runs every
    ``args.eval_every`` steps (in eval mode); ``logits_to_keep``: compute logits for the last positions only (the
    labels must be -100 before them)."""
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(model, MambaForCausalLM):
        install_fast_mamba_scan()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "A_log" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "A_log" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))
    step, elapsed_prev, ckpt = 0, 0.0, out / "ckpt.pt"
    if args.resume and ckpt.exists():
        st = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed_prev = st["step"], st["elapsed"]
        print(f"[{tag}] resumed at step {step}", flush=True)
    log = open(out / "train_log.jsonl", "a")
    if step == 0:
        log.write(json.dumps({"event": "start", "args": vars(args), "settings": settings,
                              "params": sum(p.numel() for p in model.parameters())}) + "\n")
    t0, last_save = time.time(), time.time()
    stop = min(args.steps, args.stop_at or args.steps)

    def save():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "elapsed": elapsed_prev + time.time() - t0, "args": vars(args), "settings": settings},
                   out / "ckpt.pt.tmp")
        os.replace(out / "ckpt.pt.tmp", ckpt)

    model.train()
    while step < stop:
        if args.minutes and elapsed_prev + time.time() - t0 > args.minutes * 60:
            break
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        ids, labels = batch(step)
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=logits_to_keep).logits
        target = labels[:, ids.shape[1] - logits.shape[1] + 1:]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        rec = {"step": step, "loss": round(loss.item(), 4), "lr": lr,
               "elapsed_s": round(elapsed_prev + time.time() - t0, 1)}
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            with torch.no_grad():
                rec.update({k: round(v, 4) for k, v in evaluate().items()})
            model.train()
            print(f"[{tag}] {rec}", flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if time.time() - last_save > 120 or step == args.steps:
            save()
            last_save = time.time()
    save()
