#!/usr/bin/env python
"""Train the bundled passkey models of ``hf_tokred`` (``bundled:passkey-mamba``, ``bundled:passkey-mamba2``).

Passkey retrieval (``hf_tokred.evaluation.passkey``): a haystack with one needle sentence holding a random
number, then "What is the pass key? The pass key is" and the number; the loss is the cross-entropy of the number's
tokens only.  Half the rows of a batch use the noise haystack, half natural text from the *training* split of the
project's BoolQ passages (``hf-tokred data``; the evaluation's natural haystack is the held-out split), the needle
at a random depth.  Batches depend only on (seed, step), so runs are reproducible and resumable; evaluation uses
seed 1_000_000, which training never draws.  The tokenizer is the bundled language models' (8,192 tokens).

    python examples/train_passkey.py train --family mamba2 --out /work/train_runs/passkey_mamba2 --steps 1500
    python examples/train_passkey.py train --family mamba2 --out /work/train_runs/passkey_mamba2 --steps 1500 --resume
    python examples/train_passkey.py export --out /work/train_runs/passkey_mamba2 --dest hf_tokred/bundled/passkey-mamba2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from hf_tokred.bundled_models import bundled_path
from hf_tokred.evaluation import data
from hf_tokred.evaluation.passkey import PasskeySettings, make_passkey_batch, passkey_hits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_loop import EVAL_SEED, add_train_arguments, train  # noqa: E402  (the loop the task-model scripts share)
from train_loop import build as build_tiny  # noqa: E402

ANSWER_WINDOW = 16  # the answer (at most a few digit tokens) lies in the rows' last ANSWER_WINDOW positions


def build(family: str, vocab: int, hidden: int, layers: int, state: int):
    return build_tiny(family, vocab, hidden, layers, state, bos=0, pad=1)


def train_passages() -> list[str]:
    """The BoolQ passages outside the held-out split (the evaluation's natural haystack never trains)."""
    return sorted(p for p in set(data.load_split("boolq")["passage"]) if not data.is_heldout(p))


def batch(tok, settings: PasskeySettings, texts, n: int, seed: int, step: int):
    """``(input_ids, labels)``: half noise, half natural haystack, the needle at a random depth per row."""
    half = n // 2
    noise = make_passkey_batch(tok, settings, n - half, seed, step * n, depth=None)
    natural = make_passkey_batch(tok, PasskeySettings(settings.seq_len, settings.digits, "natural"), half,
                                 seed + 7919, step * n, depth=None, texts=texts)
    return torch.cat([noise.input_ids, natural.input_ids]), torch.cat([noise.labels, natural.labels])


@torch.no_grad()
def accuracy(model, tok, settings: PasskeySettings, texts, n: int = 128, chunk: int = 32) -> float:
    hits = []
    for start in range(0, n, chunk):
        b = make_passkey_batch(tok, settings, min(chunk, n - start), EVAL_SEED, start, depth=None, texts=texts)
        hits.append(passkey_hits(model(input_ids=b.input_ids, use_cache=False).logits.float(), b))
    return torch.cat(hits).float().mean().item()


def cmd_train(args):
    tok = AutoTokenizer.from_pretrained(str(bundled_path("mamba2")))
    settings = PasskeySettings(seq_len=args.seq_len, digits=args.digits)
    natural = PasskeySettings(settings.seq_len, settings.digits, "natural")
    texts, heldout = train_passages(), data.heldout_passages()
    torch.manual_seed(args.seed)
    model = build(args.family, len(tok), args.hidden, args.layers, args.state)

    def evaluate():
        return {"eval_noise": accuracy(model, tok, settings, None),
                "eval_natural_heldout": accuracy(model, tok, natural, heldout)}
    # the answer is the rows' suffix: logits of the last ANSWER_WINDOW positions only (the rest carry no loss)
    train(model, args, settings.to_dict(), lambda step: batch(tok, settings, texts, args.batch, args.seed, step),
          evaluate, "passkey", logits_to_keep=ANSWER_WINDOW + 1)


def cmd_export(args):
    st = torch.load(Path(args.out) / "ckpt.pt", map_location="cpu", weights_only=False)
    a = st["args"]
    tok = AutoTokenizer.from_pretrained(str(bundled_path("mamba2")))
    model = build(a["family"], len(tok), a["hidden"], a["layers"], a["state"])
    model.load_state_dict(st["model"])
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    model.config.passkey = st["settings"]  # the setting it was trained on travels in config.json
    model.to(torch.float16).save_pretrained(str(dest))
    (dest / "generation_config.json").unlink(missing_ok=True)
    tok.save_pretrained(str(dest))
    print(f"[export] step {st['step']} -> {dest}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("train")
    add_train_arguments(p, layers=4, steps=1500, warmup=100)
    p.add_argument("--seq-len", type=int, default=256, help="prompt length in tokens")
    p.add_argument("--digits", type=int, default=5, help="digits of the pass key")
    p = sub.add_parser("export")
    p.add_argument("--out", required=True)
    p.add_argument("--dest", required=True)
    args = ap.parse_args(argv)
    {"train": cmd_train, "export": cmd_export}[args.cmd](args)


if __name__ == "__main__":
    main()
