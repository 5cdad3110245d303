"""Load a Mamba / Mamba-2 model, switch token reduction on, generate, and print the schedule.

Runs offline on a random-weight model by default (its text is noise; the point is the mechanics)::

    python examples/reduce_and_generate.py
    python examples/reduce_and_generate.py --model random:mamba2-tiny --method tome
    python examples/reduce_and_generate.py --model state-spaces/mamba-130m-hf --prompt "The capital of France is"

The prompt's forward pass (prefill) is token-reduced; decoding is not.  The schedule printed is what runs:
the anchor blocks after which tokens are removed or merged, the keep ratio per anchor, the paper's FLOPs
proxy, and the number of tokens each block processed for this prompt.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import hf_tokred  # noqa: E402  (installs the hooks)
from hf_tokred import METHODS, TokenReductionConfig  # noqa: E402
from hf_tokred.models import load_model  # noqa: E402

PROMPT = ("The history of the Roman Empire spans more than a thousand years, from the founding of the city "
          "to the fall of Constantinople. Its language, law and roads shaped")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:mamba-tiny", help="model spec (default: random:mamba-tiny)")
    p.add_argument("--method", default="utrc", choices=sorted(METHODS))
    p.add_argument("--flops-reduction", type=float, default=0.2)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    cfg = TokenReductionConfig(method=args.method, flops_reduction=args.flops_reduction)
    model, tok = load_model(args.model, token_reduction=cfg, seed=args.seed)  # a stock *ForCausalLM
    layers = model.config.num_hidden_layers
    schedule = cfg.resolve(layers)
    print(f"model: {args.model} ({type(model).__name__}, {layers} blocks)")
    print(f"settings: {hf_tokred.get_token_reduction(model).to_dict()}")
    print(f"schedule: anchors {list(schedule.anchors)}, keep ratio {schedule.keep_ratio:.4f} per anchor, "
          f"FLOPs reduction (paper proxy, long sequences) {100 * schedule.flops_reduction:.1f} %")

    enc = tok(args.prompt, return_tensors="pt")
    n = enc["input_ids"].shape[1]
    with torch.no_grad():
        out = model(**enc)
    per_block = [n] * layers
    for anchor, plan in out.plans:
        kept = int(plan.keep_mask.sum())
        per_block[anchor + 1:] = [kept] * (layers - anchor - 1)
    print(f"prompt: {n} tokens; tokens per block: {per_block}; "
          f"computed positions: {int(out.computed_mask.sum())}/{n} (the last one always)")

    gen = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    completion = tok.decode(gen[0, n:], skip_special_tokens=True)
    print(f"completion: {completion!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
