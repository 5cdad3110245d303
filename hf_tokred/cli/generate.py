"""``hf-tokred generate``: continue a prompt with a (reduced) model, then say what reduction did."""

from __future__ import annotations

import argparse
import json

import torch

from ..flops import flops_reduction
from ..outputs import record_reduction
from ..question import encode_document_question
from ..settings import get_token_reduction
from .common import UsageError, add_model_argument, add_reduction_arguments, load_for_command, positive, \
    reduction_from_args

__all__ = ["DEMO_PROMPT", "add_parser", "reduction_summary"]

#: The prompt of the main job when none is given: long enough for every anchor of the bundled models to reduce.
DEMO_PROMPT = (
    "The history of the city begins with a small settlement on the river, where farmers and traders built their "
    "houses near the old bridge. In the following centuries the town grew into an important market, and its "
    "harbour connected the region with the rest of the country. During the nineteenth century the railway "
    "arrived, new factories were built, and the population increased rapidly. Today the city is known for its "
    "university, its museums and its parks, and many visitors come every year to see the old town and the "
    "cathedral. The history of the"
)


def reduction_summary(model, record, prompt_tokens: int) -> dict:
    """What reduction did to one prompt's prefill: tokens per anchor and the analytic prefill FLOPs saved."""
    lengths = record.layer_lengths[0] if record is not None else [prompt_tokens] * model.config.num_hidden_layers
    after = {a: lengths[a + 1] for a in (record.anchors if record is not None else [])
             if a + 1 < len(lengths)}
    return {
        "prompt_tokens": prompt_tokens,
        "layer_lengths": lengths,
        "kept_after_anchor": after,
        "tokens_removed": prompt_tokens - lengths[-1],
        # generation computes the logits of the last position only
        "prefill_flops_reduction": flops_reduction(model.config, lengths, prompt_tokens, lm_head_positions=1,
                                                   dense_lm_head_positions=1),
    }


def _format_summary(summary: dict, cfg, saved: bool = False) -> str:
    n, after = summary["prompt_tokens"], summary["kept_after_anchor"]
    if cfg is None:
        return f"[dense model: no token reduction; {n} prompt tokens computed by every layer]"
    name = f"{cfg.method} (the model's saved settings)" if saved else cfg.method
    if not after:
        rule = (f"prompts of at most keep_tokens={cfg.keep_tokens} tokens are not reduced" if cfg.keep_tokens
                else "each anchor removes n - ceil(n * keep_ratio)")
        return (f"[token reduction {name}: the {n}-token prompt is too short for any anchor to remove a token "
                f"({rule}); try a longer prompt]")
    steps = ", ".join(f"layer {a}: {m}" for a, m in after.items())
    last = summary["layer_lengths"][-1]
    return (f"[token reduction {name}: kept {last}/{n} prompt tokens ({steps}); "
            f"prefill FLOPs {-100 * summary['prefill_flops_reduction']:+.1f} % (analytic, next-token logits only); "
            "decoding is not reduced]")


def _generate(args: argparse.Namespace) -> int:
    prompt = DEMO_PROMPT if args.prompt is None else args.prompt
    if not prompt.strip():
        raise UsageError("the prompt is empty: give some text to continue (or omit it for the built-in demo prompt)")
    positive("--max-new-tokens", args.max_new_tokens, "40")
    flags = reduction_from_args(args)
    model, tok = load_for_command(args.model, flags)
    cfg = get_token_reduction(model)  # the flags' settings, else those saved with the model (or None: dense)
    torch.manual_seed(args.seed)
    if args.question is not None and not args.question.strip():
        raise UsageError("--question is empty: give the question that follows the document (or leave it out)")
    enc = (tok(prompt, return_tensors="pt") if args.question is None
           else encode_document_question(tok, prompt, args.question))
    if enc["input_ids"].shape[1] == 0:
        raise UsageError("the prompt encodes to no tokens: give some text to continue")
    with record_reduction() as records:
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                             pad_token_id=tok.pad_token_id, return_dict_in_generate=True)
    prompt = prompt if args.question is None else prompt + args.question
    text = tok.decode(out.sequences[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    summary = reduction_summary(model, records[0] if records else None, enc["input_ids"].shape[1])
    if args.json:
        print(json.dumps({"model": args.model, "prompt": prompt, "completion": text,
                          "token_reduction": None if cfg is None else cfg.to_dict(), "reduction": summary}))
    else:
        print(prompt + text)
        print(_format_summary(summary, cfg, saved=flags is None))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with a (reduced) model",
                       description="Generate a continuation; the prompt's prefill is token-reduced, decoding is not. "
                                   "Without reduction flags a model runs with the settings saved in its config.json "
                                   "(if any); the flags replace them.")
    p.add_argument("prompt", nargs="?", default=None,
                   help="text to continue (default: a built-in paragraph long enough to show the reduction)")
    add_model_argument(p)
    p.add_argument("--question", default=None,
                   help="a question after the prompt (the document): kept exactly as written, never reduced")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_reduction_arguments(p)
    p.set_defaults(func=_generate)
