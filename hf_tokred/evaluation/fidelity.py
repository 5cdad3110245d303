"""Fidelity to the dense model on held-out passages: top-1 agreement and KL(dense || reduced) per position."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..settings import apply_token_reduction, get_token_reduction
from .meter import FlopsMeter

__all__ = ["fidelity_result", "fidelity_sums", "heldout_fidelity", "reduction_disabled"]


@contextlib.contextmanager
def reduction_disabled(model):
    """Run ``model`` dense inside the block (its token_reduction settings are restored afterwards)."""
    cfg = get_token_reduction(model)
    apply_token_reduction(model, None)
    try:
        yield model
    finally:
        if cfg is not None:
            apply_token_reduction(model, cfg)


def heldout_fidelity(model, tokenizer, passages: Sequence[str], batch_size: int = 8, max_length: int = 2048,
                     progress: bool = True, meter: FlopsMeter | None = None) -> dict[str, Any]:
    """Top-1 agreement and mean KL(dense || reduced) of next-token distributions on ``passages``.

    Each passage is ``[bos/eos] + tokens`` (truncated to ``max_length``), right-padded in batches with an
    attention mask.  Compared positions: real positions the reduced model computed (the dense model computes
    all).  A dense model gives agreement 1 and KL 0 without running.
    """
    return fidelity_result(fidelity_sums(model, tokenizer, passages, batch_size, max_length, progress, meter))


def fidelity_sums(model, tokenizer, passages, batch_size, max_length, progress, meter) -> dict[str, Any]:
    """The additive parts of :func:`heldout_fidelity` (data-parallel ranks each sum their own passages)."""
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    seqs = []
    for text in passages:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        seqs.append(([prefix] if prefix is not None else []) + list(ids))
    seqs = [s[:max_length] for s in seqs if len(s) >= 2]
    sums = {"passages": len(seqs), "positions_total": sum(len(s) for s in seqs), "agree": 0.0, "kl": 0.0,
            "compared": 0, "dense": get_token_reduction(model) is None}
    if sums["dense"]:
        return sums
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    for start in tqdm(range(0, len(order), batch_size), disable=not progress, desc="held-out fidelity"):
        batch = [seqs[i] for i in order[start:start + batch_size]]
        B, N = len(batch), max(len(s) for s in batch)
        ids = torch.full((B, N), pad_id, dtype=torch.long)
        attn = torch.zeros(B, N, dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, :len(s)] = torch.tensor(s)
            attn[i, :len(s)] = 1
        ids, attn = ids.to(device), attn.to(device)
        with torch.no_grad():
            red = model(input_ids=ids, attention_mask=attn, use_cache=False)
            with reduction_disabled(model):
                dense = model(input_ids=ids, attention_mask=attn, use_cache=False)
        if meter is not None:
            meter.add_forward("heldout_fidelity", red, [len(s) for s in batch])
        mask = attn.bool() & red.computed_mask
        lr = F.log_softmax(red.logits[mask].float(), -1)
        ld = F.log_softmax(dense.logits[mask].float(), -1)
        sums["kl"] += float((ld.exp() * (ld - lr)).sum(-1).double().sum())
        sums["agree"] += float((ld.argmax(-1) == lr.argmax(-1)).sum())
        sums["compared"] += int(mask.sum())
    return sums


def fidelity_result(*parts: dict[str, Any]) -> dict[str, Any]:
    """Combine :func:`fidelity_sums` of one or several data-parallel shards into the reported columns."""
    total = {k: sum(p[k] for p in parts) for k in ("passages", "positions_total", "agree", "kl", "compared")}
    result = {"passages": total["passages"], "positions_total": total["positions_total"]}
    if all(p["dense"] for p in parts):
        return {**result, "top1_agreement": 1.0, "kl_mean": 0.0, "positions_compared": total["positions_total"],
                "note": "dense model: identical to itself by definition (not run)"}
    compared = total["compared"]
    return {**result, "top1_agreement": total["agree"] / compared if compared else float("nan"),
            "kl_mean": total["kl"] / compared if compared else float("nan"), "positions_compared": compared}
