"""Write a token-reduced variant with its model card, reload it with AutoModelForCausalLM, and generate.

By default a **settings-only** variant (config + tokenizer + card + loader stub; no weights: it points at its
base model); ``--full-copy`` writes the reduced model's weights too.  Offline by default: the random-weight
model is first saved to ``<out>/base`` as a stand-in for a Hub checkpoint::

    python examples/publish_variant.py
    python examples/publish_variant.py --full-copy --model random:mamba2-tiny
    python examples/publish_variant.py --model state-spaces/mamba-130m-hf --repo your-name/mamba-130m-utrc-20

``--repo`` also uploads it (needs ``huggingface-cli login``); the same as
``hf-tokred push --model M --flops-reduction 0.2 --repo your-name/...``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import hf_tokred  # noqa: E402,F401
from hf_tokred import METHODS, TokenReductionConfig  # noqa: E402
from hf_tokred.hub import push_variant, save_variant  # noqa: E402  (importing hf_tokred.hub registers the loader)
from hf_tokred.models import load_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:mamba-tiny", help="base model (default: random:mamba-tiny)")
    p.add_argument("--method", default="utrc", choices=sorted(METHODS))
    p.add_argument("--flops-reduction", type=float, default=0.2)
    p.add_argument("--full-copy", action="store_true", help="save the weights too")
    p.add_argument("--out", default=None, help="working folder (default: a temporary one)")
    p.add_argument("--repo", default=None, help="also upload to this Hub repo (owner/name)")
    p.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog because")
    p.add_argument("--max-new-tokens", type=int, default=12)
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = TokenReductionConfig(method=args.method, flops_reduction=args.flops_reduction)
    with tempfile.TemporaryDirectory(prefix="hf_tokred_example_") as tmp:
        work = Path(args.out or tmp)
        base = args.model
        if base.startswith("random:"):  # random weights exist only in memory: save them as the "base checkpoint"
            model, tok = load_model(base, token_reduction=None)
            base = str(work / "base")
            model.save_pretrained(base)
            tok.save_pretrained(base)
        folder = save_variant(base, cfg, work / "variant", full_copy=args.full_copy, repo_id=args.repo)
        kind = "full copy" if args.full_copy else "settings-only variant"
        print(f"wrote {kind}: {folder}")
        print(f"files: {sorted(f.name for f in folder.iterdir())}")
        card = (folder / "README.md").read_text()
        print("card: " + next(line for line in card.splitlines() if line.startswith("# ")))
        print("card: " + next(line for line in card.splitlines() if "analytic FLOPs" in line))

        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        tok = AutoTokenizer.from_pretrained(folder)
        print(f"reloaded: {type(model).__name__} with token_reduction={hf_tokred.get_token_reduction(model).to_dict()}")
        enc = tok(args.prompt, return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        print(f"generated: {tok.decode(gen[0, enc['input_ids'].shape[1]:], skip_special_tokens=True)!r}")

        if args.repo:
            info = push_variant(base, cfg, args.repo, full_copy=args.full_copy)
            print(f"uploaded: {getattr(info, 'commit_url', info)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
