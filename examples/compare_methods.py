"""Compare every token-reduction method at the same FLOPs target on one fixed random batch (no lm-eval).

For each method in ``hf_tokred.METHODS`` at ``--flops-reduction`` (default 0.2), one forward pass over the same
batch reports the tokens each block processed (row 0), and, on the positions the reduced model computed, the
top-1 agreement with the dense model's next-token prediction and the mean KL(dense || reduced) in nats::

    python examples/compare_methods.py                       # random:mamba-tiny, offline
    python examples/compare_methods.py --model random:mamba2-tiny --length 512
    python examples/compare_methods.py --model state-spaces/mamba-130m-hf --flops-reduction 0.3

Random-weight models and random tokens make the numbers illustrative only; use ``hf-tokred eval`` for accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import hf_tokred  # noqa: E402
from hf_tokred.models import load_model  # noqa: E402


def compare(model, ids: torch.Tensor, method: str, flops_reduction: float, dense_logp: torch.Tensor) -> dict:
    hf_tokred.apply_token_reduction(model, {"method": method, "flops_reduction": flops_reduction})
    with torch.no_grad():
        out = model(ids, use_cache=False)
    layers = model.config.num_hidden_layers
    per_block = [ids.shape[1]] * layers
    for anchor, plan in out.plans:
        per_block[anchor + 1:] = [int(plan.keep_mask[0].sum())] * (layers - anchor - 1)
    mask = out.computed_mask
    lr = F.log_softmax(out.logits[mask].float(), -1)
    ld = dense_logp[mask]
    return {
        "method": method,
        "tokens_per_block": per_block,
        "computed": int(mask.sum()),
        "top1_agreement": float((lr.argmax(-1) == ld.argmax(-1)).float().mean()),
        "kl": float((ld.exp() * (ld - lr)).sum(-1).mean()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:mamba-tiny", help="model spec (default: random:mamba-tiny)")
    p.add_argument("--flops-reduction", type=float, default=0.2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default=",".join(hf_tokred.METHODS), help="comma-separated (default: all)")
    p.add_argument("--json", action="store_true", help="one JSON object per method instead of a table")
    args = p.parse_args(argv)

    model, tok = load_model(args.model, token_reduction=None, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = min(model.config.vocab_size, len(tok))
    ids = torch.randint(2, vocab, (args.batch, args.length), generator=gen)
    with torch.no_grad():
        dense_logp = F.log_softmax(model(ids, use_cache=False).logits.float(), -1)

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    rows = [compare(model, ids, method, args.flops_reduction, dense_logp) for method in methods]
    hf_tokred.apply_token_reduction(model, None)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"{args.model}: {model.config.num_hidden_layers} blocks, batch {args.batch} x {args.length} random tokens, "
          f"FLOPs target {args.flops_reduction:g}")
    print(f"{'method':<15} {'top-1 agr.':>10} {'KL (nats)':>10} {'computed':>9}  tokens per block (row 0)")
    for r in rows:
        print(f"{r['method']:<15} {r['top1_agreement']:>10.4f} {r['kl']:>10.4f} {r['computed']:>9}  "
              f"{r['tokens_per_block']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
