"""The method itself, as pure functions on tensors: plans and applying a plan (selection rules: select.py).

Shapes: ``B`` batch rows, ``N`` current sequence length, ``D`` channels.  Within a row, the "real"
tokens are those whose mask is set; padding never takes part in importance or matching, and each row's
number of removed tokens comes from its own real length.

A :class:`Plan` is computed once per anchor from the anchor block's mixer output ``h`` and applied to
both branches (hidden state and residual).  The reduced sequence uses a left-padded layout: each row's
kept tokens, in their original order, are right-aligned; shorter rows get padding on the left (which
the Mamba mixers handle exactly, like left-padded input).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from .config import merge_count, removal_count
from .select import Selection, flat_index, importance, select, take_rows

__all__ = ["Plan", "Selection", "apply_plan", "apply_plan_pair", "extend_plan", "importance", "make_plan",
           "merge_weights", "num_to_remove", "select"]


def num_to_remove(n_real: torch.Tensor, keep_ratio: float | None, pairs: bool,
                  removal: Callable[[int], int] | None = None) -> torch.Tensor:
    """Tokens to remove per row: ``removal(n)`` of each row's real length ``n`` (a schedule's rule, e.g. a token
    budget's), else :func:`hf_tokred.config.removal_count` with ``keep_ratio``."""
    counts = [removal(n) if removal is not None else removal_count(n, keep_ratio, pairs) for n in n_real.tolist()]
    return torch.tensor(counts, dtype=torch.long, device=n_real.device)


@dataclass
class Plan:
    """One anchor's reduction for a whole batch, in indices of the current sequence (length ``N``).

    ``keep [B, M]``/``keep_mask``: kept tokens, ascending and right-aligned (left padding, index 0, mask False).
    ``src/dst/src_mask [B, R]``: removed tokens and where they merge (``dst_slot`` = column of ``dst`` in ``keep``).
    ``src_score``: importance of each removed token.  ``mergeable [B, R]``: sources that may merge (``None``: all;
    a source whose only possible destinations are frozen tokens is pruned by every strategy).  ``rerun``: made by a
    method that prunes before its anchor (``prefilter``), so the anchor block processed the kept tokens too.
    """

    keep: torch.Tensor
    keep_mask: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    dst_slot: torch.Tensor
    src_mask: torch.Tensor
    src_score: torch.Tensor
    mergeable: torch.Tensor | None = None
    rerun: bool = False  # the plan pruned its anchor's input and the anchor block ran again on the kept tokens

    @property
    def num_removed(self) -> torch.Tensor:
        return self.src_mask.sum(1)


def make_plan(
    h: torch.Tensor,
    mask: torch.Tensor,
    protected: torch.Tensor,
    keep_ratio: float,
    selection: str,
    metric: str,
    pairs: bool,
    scores: torch.Tensor | None = None,
    receive: bool = True,
    removal: Callable[[int], int] | None = None,
    frozen: torch.Tensor | None = None,
    match_window: int = 0,
) -> Plan | None:
    """Plan one anchor from its mixer output ``h [B, N, D]``; ``None`` when no row loses a token.

    ``mask [B, N]`` marks real tokens, ``protected [B, N]`` tokens that must survive, ``frozen [B, N]`` tokens that
    must survive exactly as they are (never merge destinations either).  ``removal(n)``: tokens to remove from a
    row of ``n`` real tokens, instead of ``keep_ratio`` (a token budget's rule).  Rows are grouped by real length
    so every selection runs on a dense, padding-free tensor.
    """
    B, N, _ = h.shape
    n_real = mask.sum(1)
    r_all = num_to_remove(n_real, keep_ratio, pairs, removal)
    if int(r_all.max()) == 0:
        return None
    device = h.device
    R = int(r_all.max())
    src = torch.zeros(B, R, dtype=torch.long, device=device)
    dst = torch.zeros_like(src)
    ok = torch.zeros(B, R, dtype=torch.bool, device=device)
    score = torch.zeros(B, R, device=device)
    mergeable = None
    for n in torch.unique(n_real[r_all > 0]).tolist():
        rows = ((n_real == n) & (r_all > 0)).nonzero().squeeze(1)
        if n == N and len(rows) == B:  # no padding anywhere: select on h itself, no copies
            pos, h_rows, prot_rows, s_rows, f_rows = None, h, protected, scores, frozen
        else:
            pos = mask[rows].nonzero()[:, 1].view(len(rows), n)  # real positions, ascending
            h_rows, prot_rows = take_rows(h[rows], pos), protected[rows].gather(1, pos)
            s_rows = None if scores is None else scores[rows].gather(1, pos)
            f_rows = None if frozen is None else frozen[rows].gather(1, pos)
        sel = select(selection, h_rows, prot_rows, r_all[rows], metric, s_rows, receive, f_rows, match_window)
        k = sel.src.shape[1]
        src[rows, :k] = sel.src if pos is None else pos.gather(1, sel.src)
        dst[rows, :k] = sel.dst if pos is None else pos.gather(1, sel.dst)
        ok[rows, :k] = sel.valid
        score[rows, :k] = sel.score
        if sel.mergeable is not None:
            mergeable = torch.ones_like(ok) if mergeable is None else mergeable
            mergeable[rows, :k] = sel.mergeable
    if not bool(ok.any()):  # every candidate was ineligible (e.g. utrc_frozen with only protected destinations)
        return None
    rows_of = torch.arange(B, device=device)[:, None]
    removed = torch.zeros(B, N, dtype=torch.bool, device=device)
    removed[rows_of.expand(B, R)[ok], src[ok]] = True
    kept = mask.bool() & ~removed
    M = int(kept.sum(1).max())
    ar = torch.arange(N, device=device).expand(B, N)
    keep = torch.sort(torch.where(kept, ar, -1), dim=1).values[:, N - M :]
    keep_mask = keep >= 0
    keep = keep.clamp_min(0)
    slot_of = torch.full((B, N), -1, dtype=torch.long, device=device)
    slot_of[rows_of.expand(B, M)[keep_mask], keep[keep_mask]] = torch.arange(M, device=device).expand(B, M)[keep_mask]
    dst_slot = slot_of.gather(1, dst).clamp_min(0)  # unused (invalid or pruned) entries point at slot 0
    return Plan(keep, keep_mask, src, dst, dst_slot, ok, score, mergeable)


def extend_plan(plan: Plan, prefix: int, length: int) -> Plan:
    """A plan made on the first ``prefix`` columns, extended to a sequence of ``length`` columns whose columns
    ``prefix, ..., length - 1`` are all kept, unchanged, after the reduced prefix (no columns after it: the plan
    itself)."""
    if length == prefix:
        return plan
    tail = torch.arange(prefix, length, device=plan.keep.device).expand(plan.keep.shape[0], -1)
    return replace(plan, keep=torch.cat([plan.keep, tail], 1),
                   keep_mask=torch.cat([plan.keep_mask, torch.ones_like(tail, dtype=torch.bool)], 1))


def _merge_counts(valid: torch.Tensor, q: float) -> torch.Tensor:
    """:func:`hf_tokred.config.merge_count` of each row's number of valid sources, ``[B]`` long."""
    counts = [merge_count(r, q) for r in valid.sum(1).tolist()]
    return torch.tensor(counts, dtype=torch.long, device=valid.device)


def merge_weights(plan: Plan, strategy: str, q: float, x_src: torch.Tensor | None = None) -> torch.Tensor | None:
    """Per-source merge weights (1 = merge, 0 = prune): ``[B, R, 1]``, or per channel ``[B, R, D]`` for
    ``hybrid_channel`` (which ranks the gathered source values ``x_src [B, R, D]``); ``None`` for ``prune``."""
    valid = plan.src_mask
    if strategy == "prune":
        return None
    if strategy == "merge":
        w = valid
    elif strategy == "hybrid":
        # Token level: of each row's r selected sources, the floor(r * (1 - q)) most important merge.
        n_merge = _merge_counts(valid, q)
        rank = torch.sort(
            plan.src_score.masked_fill(~valid, -math.inf), dim=1, descending=True, stable=True
        ).indices.argsort(1)
        w = valid & (rank < n_merge[:, None])
    elif strategy == "hybrid_channel":
        # Channel level (reference code): per channel, the top k = floor(r * (1 - q)) source values merge.
        k = _merge_counts(valid, q)
        vals = x_src.float().masked_fill(~valid[..., None], -math.inf)
        rank = torch.sort(vals, dim=1, descending=True, stable=True).indices.argsort(1)
        w = valid[..., None] & (rank < k[:, None, None])
        return (w if plan.mergeable is None else w & plan.mergeable[..., None]).float()
    else:
        raise ValueError(f"unknown strategy {strategy!r}; allowed: prune, merge, hybrid, hybrid_channel")
    return (w if plan.mergeable is None else w & plan.mergeable)[..., None].float()


def apply_plan_pair(a: torch.Tensor, b: torch.Tensor | None, plan: Plan, strategy_a: str,
                    strategy_b: str | None = None, q: float = 0.5, total: torch.Tensor | None = None) -> torch.Tensor:
    """``apply_plan(a, plan, strategy_a, q) + apply_plan(b, plan, strategy_b, q)`` (``b`` may be ``None``;
    ``total``: ``a + b`` when the caller has it, e.g. a block's own output).

    The one torch implementation of applying a plan.  The kept rows (of ``a + b``) are gathered once; only the
    rows that receive merges are recomputed, branch by branch: ``dst <- (dst + sum_i w_i src_i) / (1 + sum_i
    w_i)`` over the sources mapped to ``dst`` (the size-weighted mean with sizes reset at every anchor), in
    fp32, cast back to the branch's dtype before the branches are added.  Padding slots are zero.
    """
    branches = [(a, strategy_a)] + ([] if b is None else [(b, strategy_b)])
    if total is None:
        total = a if b is None else a + b
    out = take_rows(total, plan.keep)
    if plan.src.shape[1]:
        weights = [merge_weights(plan, st, q, take_rows(x, plan.src) if st == "hybrid_channel" else None)
                   for x, st in branches]
        merged = torch.zeros_like(plan.src_mask)
        for w in weights:
            if w is not None:
                merged |= (w > 0).any(-1)
        if bool(merged.any()):
            M, N = plan.keep.shape[1], a.shape[1]
            dst = flat_index(plan.dst_slot, M)[merged]  # output row of each merged source's destination
            rows = torch.unique(dst)  # the rows that change
            slot_of_src = torch.searchsorted(rows, dst)
            tokens = flat_index(plan.keep, N).reshape(-1)[rows]  # their input rows
            sources = flat_index(plan.src, N)[merged]
            new = None
            for (x, _), w in zip(branches, weights):
                flat_x = x.reshape(-1, x.shape[-1])
                val = flat_x.index_select(0, tokens)
                if w is not None:
                    acc = val.float()
                    acc.index_add_(0, slot_of_src, flat_x.index_select(0, sources).float() * w[merged])
                    den = torch.ones(len(rows), w.shape[-1], device=a.device).index_add_(0, slot_of_src, w[merged])
                    val = acc.div_(den).to(x.dtype)
                new = val if new is None else new + val
            out.view(-1, out.shape[-1])[rows] = new.to(out.dtype)
    if not bool(plan.keep_mask.all()):
        out = out.masked_fill(~plan.keep_mask[..., None], 0)
    return out


def apply_plan(x: torch.Tensor, plan: Plan, strategy: str, q: float = 0.5) -> torch.Tensor:
    """Reduce ``x [B, N, D]`` to ``[B, M, D]`` following ``plan`` (see :func:`apply_plan_pair`)."""
    return apply_plan_pair(x, None, plan, strategy, None, q)


def reduce_along(t: torch.Tensor, plan: Plan, fill) -> torch.Tensor:
    """Carry a per-token tensor ``t [B, N]`` (mask, positions, protection) through the plan."""
    return t.gather(1, plan.keep).masked_fill(~plan.keep_mask, fill)
