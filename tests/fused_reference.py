"""The fused plan kernel's independent reference (tests only): merge weights from the documented rule of each
strategy, row by row in Python, and each branch reduced on its own in fp32 -- nothing from ``hf_tokred.reduce``'s
weight helpers.  Also :func:`fused_apply_plan`, the kernel called the way the reducing loop calls it (weights from
``hf_tokred.reduce.merge_weights``)."""

import math
from fractions import Fraction

import torch
from torch import Tensor

from hf_tokred import reduce
from hf_tokred.reduce import Plan
from hf_tokred.ops import fused_apply_plan as fused_op

_STRATEGIES = ("prune", "merge", "hybrid", "hybrid_channel")


def _take(x: Tensor, idx: Tensor) -> Tensor:
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


def fused_apply_plan(residual, hidden, plan, residual_strategy="merge", hidden_strategy="hybrid", q=0.5):
    """The fused op with the loop's weights (``reduce.merge_weights``); unknown strategies raise."""
    weights = []
    for x, st in ((residual, residual_strategy), (hidden, hidden_strategy)):
        if st not in _STRATEGIES:
            raise ValueError(f"unknown strategy {st!r}; allowed: {', '.join(_STRATEGIES)}")
        weights.append(reduce.merge_weights(plan, st, q, _take(x, plan.src) if st == "hybrid_channel" else None)
                       if plan.src.shape[1] else None)
    return fused_op(residual, hidden, plan.keep, plan.keep_mask, plan.src, plan.dst_slot, *weights)


def documented_merge_count(r: int, q: float) -> int:
    """``floor(r * (1 - q))`` for the ``q`` the user meant: ``q`` is read as the simplest fraction within float
    rounding of it (``0.8`` -> 4/5, ``1/3`` -> 1/3), so ``r * (1 - q)`` is exact (``5 * (1 - 0.8)`` is 1, not
    0.9999999999999998)."""
    return math.floor(r * (1 - Fraction(q).limit_denominator(10**6)))


def documented_weights(x: Tensor, plan: Plan, strategy: str, q: float) -> Tensor | None:
    """0/1 merge weights ``[B, R, D]`` by the documented rule of each strategy, row by row in Python (independent
    of :func:`hf_tokred.reduce._merge_weights`, which the kernel uses):

    * ``prune``: none; ``merge``: every valid source;
    * ``hybrid``: of a row's ``r`` valid sources, the ``floor(r (1 - q))`` with the highest importance
      (``src_score``; ties: the earlier source) merge, the others are pruned;
    * ``hybrid_channel``: per channel, the ``floor(r (1 - q))`` sources with the largest value in that channel
      (ties: the earlier source) merge.
    """
    if strategy not in _STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; allowed: {', '.join(_STRATEGIES)}")
    if strategy == "prune":
        return None
    B, R = plan.src.shape
    D = x.shape[-1]
    w = torch.zeros(B, R, D)
    for b in range(B):
        valid = [i for i in range(R) if bool(plan.src_mask[b, i])]
        k = documented_merge_count(len(valid), q)
        if strategy == "merge":
            w[b, valid] = 1.0
        elif strategy == "hybrid":
            score = plan.src_score[b].tolist()
            for i in sorted(valid, key=lambda i: (-score[i], i))[:k]:
                w[b, i] = 1.0
        else:
            values = x[b, plan.src[b]].detach().float().cpu()  # [R, D]
            for d in range(D):
                col = values[:, d].tolist()
                for i in sorted(valid, key=lambda i: (-col[i], i))[:k]:
                    w[b, i, d] = 1.0
    return w.to(x.device)


def reference_branch(x: Tensor, plan: Plan, strategy: str, q: float) -> Tensor:
    """One branch: kept rows, each destination ``(x_dst + sum_i w_i x_src_i) / (1 + sum_i w_i)`` in fp32, padding
    zeroed, cast back to ``x.dtype``."""
    w = documented_weights(x, plan, strategy, q)
    out = _take(x, plan.keep).float()
    if w is not None and plan.src.shape[1]:
        slot = plan.dst_slot[..., None].expand(-1, -1, x.shape[-1])
        out = out.scatter_add(1, slot, _take(x, plan.src).float() * w)
        den = torch.ones_like(out).scatter_add(1, slot, w)
        out = out / den
    return out.masked_fill(~plan.keep_mask[..., None], 0).to(x.dtype)


def apply_plan_fused_reference(
    residual: Tensor, hidden: Tensor, plan: Plan, residual_strategy: str = "merge", hidden_strategy: str = "hybrid",
    q: float = 0.5,
) -> Tensor:
    """The torch reference: each branch reduced on its own (merge weights from the documented rule, not from the
    helpers the kernel shares with :mod:`hf_tokred.reduce`) and rounded to its dtype, then summed."""
    return reference_branch(residual, plan, residual_strategy, q) + reference_branch(hidden, plan, hidden_strategy, q)
