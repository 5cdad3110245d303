"""Quality under token reduction, measured the same way for every method (``shared/reference/quality.md``).

* :func:`suffix_scores` -- the last ``suffix`` tokens of each held-out passage are protected from reduction and
  scored: per passage, the NLL and the arg-max at those positions (dense and reduced models score exactly the
  same positions);
* :func:`fidelity` -- perplexity there, top-1 agreement and KL(dense || reduced) against the dense model's
  scores, each with a 95 % bootstrap interval over passages;
* :func:`context_benefit` -- perplexity of the suffix with 8 / 32 / 128 / all tokens of context: a model that
  does not use its context cannot tell a good reduction method from one that drops old tokens;
* :func:`mqar_accuracy` -- multi-query associative recall at the query positions (protected), per query;
* :func:`bootstrap_ci` -- the percentile bootstrap of a mean (seeded).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..settings import get_token_reduction
from .meter import FlopsMeter
from .mqar import MQARSettings, make_batch, recall_hits

__all__ = ["SuffixScores", "bootstrap_ci", "context_benefit", "fidelity", "mqar_accuracy", "passage_ids",
           "suffix_scores"]


@dataclass
class SuffixScores:
    """Per passage: summed NLL of the suffix, its token count, and the log-probabilities at the scored positions
    (kept for KL / agreement against another model's scores)."""

    nll: list[float]
    tokens: list[int]
    logprobs: list[torch.Tensor]  # [suffix, V] per passage
    computed_tokens: int = 0
    real_tokens: int = 0


def passage_ids(tokenizer, passages: Sequence[str], min_tokens: int) -> list[list[int]]:
    """``[bos] + tokens`` of each passage with at least ``min_tokens`` tokens (bos = eos when there is none)."""
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    out = []
    for text in passages:
        ids = ([start] if start is not None else []) + tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= min_tokens:
            out.append(ids)
    return out


@torch.no_grad()
def suffix_scores(model, sequences: Sequence[Sequence[int]], suffix: int = 32, context: int | None = None,
                  batch_size: int = 8, pad_id: int = 0) -> SuffixScores:
    """Score the last ``suffix`` tokens of every sequence given ``context`` tokens before them (``None``: all).

    Rows are left-padded; the scored positions (the token before each target up to the one before the last) are
    protected when the model reduces, so every scored logit was computed at its own position.
    """
    device = next(model.parameters()).device
    reducing = get_token_reduction(model) is not None
    rows = [list(s)[-(suffix + 1 + (context if context is not None else len(s))):] for s in sequences]
    scores = SuffixScores([], [], [])
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        B, N = len(batch), max(len(r) for r in batch)
        ids = torch.full((B, N), pad_id, dtype=torch.long)
        mask = torch.zeros(B, N, dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, N - len(r):], mask[i, N - len(r):] = torch.tensor(r), 1
        scored = torch.zeros(B, N, dtype=torch.bool)
        scored[:, N - 1 - suffix:N - 1] = True
        kwargs = {"protected_mask": scored.to(device)} if reducing else {}
        out = model(ids.to(device), attention_mask=mask.to(device), use_cache=False, **kwargs)
        computed = getattr(out, "computed_mask", None)
        if computed is not None and bool((scored.to(device) & ~computed).any()):
            raise RuntimeError("a scored position was not computed; the model ignored protected_mask")
        logp = F.log_softmax(out.logits[:, N - 1 - suffix:N - 1].float(), -1).cpu()  # [B, suffix, V]
        targets = ids[:, N - suffix:]
        nll = -logp.gather(2, targets[..., None])[..., 0].sum(1)
        scores.nll += nll.tolist()
        scores.tokens += [suffix] * B
        scores.logprobs += list(logp)
        scores.real_tokens += int(mask.sum())
        scores.computed_tokens += int(computed.sum()) if computed is not None else int(mask.sum())
    return scores


def bootstrap_ci(values: Sequence[float], weights: Sequence[float] | None = None, iters: int = 1000,
                 seed: int = 0) -> tuple[float, float, float]:
    """``(estimate, low, high)``: the (weighted) mean and its 95 % percentile bootstrap interval over items."""
    v = torch.tensor(values, dtype=torch.float64)
    w = torch.ones_like(v) if weights is None else torch.tensor(weights, dtype=torch.float64)
    est = float((v * w).sum() / w.sum())
    if len(v) < 2:
        return est, est, est
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(v), (iters, len(v)), generator=g)
    means = ((v[idx] * w[idx]).sum(1) / w[idx].sum(1)).sort().values
    return est, float(means[int(0.025 * iters)]), float(means[min(iters - 1, int(0.975 * iters))])


def _ppl_ci(scores: SuffixScores, seed: int) -> tuple[float, float, float]:
    per_token = [n / t for n, t in zip(scores.nll, scores.tokens)]
    est, lo, hi = bootstrap_ci(per_token, scores.tokens, seed=seed)
    return math.exp(est), math.exp(lo), math.exp(hi)


def fidelity(dense: SuffixScores, reduced: SuffixScores, seed: int = 0) -> dict:
    """Suffix perplexity of the reduced model, and its top-1 agreement and KL(dense || reduced) with the dense
    model at the same positions, each ``(estimate, low, high)`` with 95 % bootstrap intervals over passages."""
    agree, kl = [], []
    for d, r in zip(dense.logprobs, reduced.logprobs):
        agree.append(float((d.argmax(-1) == r.argmax(-1)).double().mean()))
        kl.append(float((d.exp() * (d - r)).sum(-1).double().mean()))
    return {"suffix_ppl": _ppl_ci(reduced, seed), "top1_agreement": bootstrap_ci(agree, seed=seed),
            "kl": bootstrap_ci(kl, seed=seed), "passages": len(agree),
            "computed_share": reduced.computed_tokens / max(reduced.real_tokens, 1)}


def context_benefit(model, sequences: Sequence[Sequence[int]], suffix: int = 32,
                    contexts: Sequence[int | None] = (8, 32, 128, None), batch_size: int = 8,
                    pad_id: int = 0) -> dict:
    """Suffix perplexity with each context length (``None`` = the whole passage) and the benefit of the whole
    passage over ``suffix`` tokens of context: ``1 - ppl(all) / ppl(32)``."""
    out = {}
    for c in contexts:
        ppl = _ppl_ci(suffix_scores(model, sequences, suffix, c, batch_size, pad_id), seed=0)
        out["all" if c is None else str(c)] = ppl
    if "32" in out and "all" in out:
        out["benefit_all_vs_32"] = 1.0 - out["all"][0] / out["32"][0]
    return out


@torch.no_grad()
def mqar_accuracy(model, settings: MQARSettings, n: int = 256, seed: int = 1_000_000, batch_size: int = 64,
                  meter: FlopsMeter | None = None) -> dict:
    """Recall accuracy at the query positions (protected, so they are always computed), with its 95 % bootstrap
    interval over sequences, and the share of positions the model computed; ``meter`` (a
    :class:`~.meter.FlopsMeter`) also counts the FLOPs of the forwards, as group ``mqar``."""
    device = next(model.parameters()).device
    reducing = get_token_reduction(model) is not None
    per_row, computed, real = [], 0, 0
    for start in range(0, n, batch_size):
        b = make_batch(settings, min(batch_size, n - start), seed, start)
        kwargs = {"protected_mask": b.protected_mask.to(device)} if reducing else {}
        out = model(b.input_ids.to(device), use_cache=False, **kwargs)
        per_row += recall_hits(out.logits.float().cpu(), b).double().mean(1).tolist()
        mask = getattr(out, "computed_mask", None)
        computed += int(mask.sum()) if mask is not None else b.input_ids.numel()
        if meter is not None:
            meter.add_forward("mqar", out, [b.input_ids.shape[1]] * b.input_ids.shape[0])
        real += b.input_ids.numel()
    return {"accuracy": bootstrap_ci(per_row), "sequences": len(per_row), "computed_share": computed / real}
