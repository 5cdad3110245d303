"""The method itself, as pure functions on tensors: importance, selection, plans, and applying a plan.

Shapes: ``B`` batch rows, ``N`` current sequence length, ``D`` channels.  Within a row, the "real"
tokens are those whose mask is set; padding never takes part in importance or matching, and each row's
number of removed tokens comes from its own real length.

A :class:`Plan` is computed once per anchor from the anchor block's mixer output ``h`` and applied to
both branches (hidden state and residual).  The reduced sequence uses a left-padded layout: each row's
kept tokens, in their original order, are right-aligned; shorter rows get padding on the left (which
the Mamba mixers handle exactly, like left-padded input).

Tie-breaking (deterministic): importance ties are broken by position (earlier = less important);
similarity ties by the order of the less-important set; equal best matches pick the first candidate.
Cosine similarities are snapped to a grid of ``_SIM_GRID`` before they are compared, so values that differ
only by float rounding (e.g. runs of a repeated token, computed with or without padding / neighbours) are
ties decided by position, not by rounding noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .config import merge_count, removal_count
from .ops import cpu as cpu_ops

__all__ = ["Plan", "Selection", "apply_plan", "apply_plan_pair", "extend_plan", "importance", "make_plan",
           "merge_weights", "num_to_remove", "select"]


def importance(h: torch.Tensor, metric: str = "clip", scores: torch.Tensor | None = None) -> torch.Tensor:
    """Token importance ``[..., N]`` from mixer output ``h [..., N, D]`` (paper Eq. 5 and Table 3 variants), or the
    precomputed ``scores [..., N]`` of a metric that needs the mixer's internals (``delta``)."""
    if metric == "delta":
        if scores is None:
            raise ValueError("the 'delta' importance metric needs the anchor's step sizes (scores=...); the reducing "
                             "loop captures them from the mixer")
        return scores.float()
    h = h.float()
    if metric == "clip":
        return h.clamp_min(0).mean(-1)
    if metric == "l1":
        return h.abs().mean(-1)
    if metric == "l2":
        return h.norm(dim=-1)
    if metric == "noclip":
        return h.mean(-1)
    raise ValueError(f"unknown importance metric {metric!r}; allowed: clip, l1, l2, noclip, delta")


def _features(h: torch.Tensor, metric: str) -> torch.Tensor:
    """Token features for cosine similarity (not normalised): the clipped output for ``clip``, else the output."""
    h = h.float()
    return h.clamp_min(0) if metric == "clip" else h


#: Cosine similarities closer than this are ties (fp32 noise of a cosine is ~1e-7; 2**-16 ~ 1.5e-5).
_SIM_GRID = 2.0**-16


#: Rows of the similarity matrix computed at a time (a block stays in cache while it is scaled, rounded, reduced).
_SIM_BLOCK = 256


def _best_cosine(xa: torch.Tensor, xb: torch.Tensor, allowed: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of ``xa [g, m, D]``: its best cosine similarity with the rows of ``xb [g, k, D]``, rounded to
    the tie grid (in grid units: only the ordering is used), and the first row of ``xb`` that attains it.

    With ``allowed [g, k]`` only those rows of ``xb`` are searched (the others score ``-inf``; a source with no
    allowed row gets ``-inf``, no link); that search takes the plain torch pass.

    The ``[g, m, k]`` matrix is never held whole: blocks of rows (of unit-norm ``xa`` rows) are multiplied,
    scaled by the inverse norms of ``xb``, rounded and reduced while in cache.
    """
    xa = xa * xa.norm(dim=-1, keepdim=True).clamp_min(1e-12).reciprocal()  # unit rows (the smaller operand)
    inv_b = xb.norm(dim=-1).clamp_min(1e-12).reciprocal().div_(_SIM_GRID)
    xbt = xb.transpose(1, 2)
    g, m = xa.shape[:2]
    best = torch.empty(g, m, dtype=xa.dtype, device=xa.device)
    match = torch.empty(g, m, dtype=torch.long, device=xa.device)
    fused = _cpu_grid_argmax(xa) if allowed is None else None
    for i in range(0, m, _SIM_BLOCK):
        j = min(m, i + _SIM_BLOCK)
        sim = torch.matmul(xa[:, i:j], xbt)
        if fused is not None:  # compiled CPU pass: scale, round and arg-max each row while it is in cache
            best[:, i:j], match[:, i:j] = fused(sim, inv_b)
        else:
            sim = sim.mul_(inv_b[:, None, :]).round_()
            if allowed is not None:
                sim.masked_fill_(~allowed[:, None, :], -math.inf)
            torch.max(sim, dim=-1, out=(best[:, i:j], match[:, i:j]))
    return best, match


def _cpu_grid_argmax(x: torch.Tensor):
    """The compiled row-wise scale/round/arg-max for fp32 CPU tensors without gradients, else ``None``."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or (torch.is_grad_enabled() and x.requires_grad):
        return None
    return cpu_ops.grid_argmax if cpu_ops.available() else None


def num_to_remove(n_real: torch.Tensor, keep_ratio: float, pairs: bool) -> torch.Tensor:
    """Tokens to remove per row (:func:`hf_tokred.config.removal_count` of each row's real length)."""
    counts = [removal_count(n, keep_ratio, pairs) for n in n_real.tolist()]
    return torch.tensor(counts, dtype=torch.long, device=n_real.device)


@dataclass
class Selection:
    """Which tokens of a group of equal-length rows go, relative to that group's real tokens.

    ``src[g, i]`` is removed and (for merging strategies) folded into ``dst[g, i]``; entries with
    ``valid`` False are unused.  ``score`` is the importance of each source (the token-level hybrid
    prunes the least important sources and merges the rest).
    """

    src: torch.Tensor  # [g, R] long
    dst: torch.Tensor  # [g, R] long
    valid: torch.Tensor  # [g, R] bool
    score: torch.Tensor  # [g, R] float


def _flat(idx: torch.Tensor, n: int) -> torch.Tensor:
    """Indices ``idx [g, k]`` into rows of length ``n``, as indices into the flattened ``[g * n]`` rows."""
    return idx + (torch.arange(idx.shape[0], device=idx.device) * n)[:, None]


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Gather rows of ``x [g, n, ...]`` along dim 1 with ``idx [g, k]`` (whole rows: one index_select, not a
    gather per element)."""
    g, n = x.shape[:2]
    return x.reshape(g * n, *x.shape[2:]).index_select(0, _flat(idx, n).reshape(-1)).view(*idx.shape, *x.shape[2:])


def _top_links(link: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the ``r[g]`` highest link scores per row (stable: ties keep their order) and their validity."""
    R = int(r.max()) if r.numel() else 0
    order = torch.sort(link, dim=1, descending=True, stable=True).indices[:, :R]
    ok = torch.arange(R, device=link.device)[None, :] < r[:, None]
    ok &= torch.isfinite(link.gather(1, order))  # never take an ineligible (protected) source
    return order, ok


def _select_importance_similarity(h, s, protected, r, metric, receive=True) -> Selection:
    """Paper Sec. 4: less important half matched to the more important half by cosine; keep the top links."""
    n = h.shape[1]
    order = torch.sort(s.masked_fill(protected, math.inf), dim=1, stable=True).indices
    n_a = n - n // 2
    ranked = _take(h.float(), order)  # tokens by importance; the less important half first
    if metric == "clip":
        ranked.clamp_min_(0)  # the features, made in place on the copy
    a, b = order[:, :n_a], order[:, n_a:]
    best, match = _best_cosine(ranked[:, :n_a], ranked[:, n_a:], None if receive else ~protected.gather(1, b))
    best = best.masked_fill(protected.gather(1, a), -math.inf)
    sel, ok = _top_links(best, r)
    src = a.gather(1, sel)
    return Selection(src, b.gather(1, match.gather(1, sel)), ok, s.gather(1, src))


def _select_reference(h, s, protected, r, metric, receive=True) -> Selection:
    """The reference code's selection, operation for operation: a per-channel sort along the token axis,
    then ``a @ b^T`` on the sorted halves, with row ``i`` of ``a`` read as even token ``2i`` and row ``j``
    of ``b`` as odd token ``2j+1``.  On non-negative inputs this removes 0, 2, ..., 2r-2 into token 1.

    Unlike the other selections, link scores are compared as computed (no tie grid), so the choice equals the
    authors' whenever theirs is not an exact floating-point tie; padding invariance therefore holds only up to
    float rounding of the scores (rows computed with and without padding may split a near-tie differently)."""
    n = h.shape[1]
    feat = _features(h, metric)
    feat = feat / feat.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # normalised before the per-channel sort
    ranked = torch.sort(feat, dim=1, descending=True, stable=True).values
    a, b = ranked[:, n // 2 :], ranked[:, : n // 2]
    # raw scores, no tie grid: the authors' arg-sort separates near-ties by their float values, and so do we
    best, match = (a @ b.transpose(1, 2)).max(-1)
    even = torch.arange(0, n, 2, device=h.device)
    best = best.masked_fill(protected[:, even], -math.inf)
    sel, ok = _top_links(best, r)
    src = 2 * sel
    return Selection(src, 2 * match.gather(1, sel) + 1, ok, s.gather(1, src))


def _select_bipartite(h, s, protected, r, metric, receive=True) -> Selection:
    """ToMe / PuMer: even tokens matched to odd tokens by cosine; the most similar pairs merge."""
    feat = _features(h, metric)
    best, match = _best_cosine(feat[:, 0::2], feat[:, 1::2], None if receive else ~protected[:, 1::2])
    best = best.masked_fill(protected[:, 0::2], -math.inf)
    sel, ok = _top_links(best, r)
    src = 2 * sel
    return Selection(src, 2 * match.gather(1, sel) + 1, ok, s.gather(1, src))


def _select_importance(h, s, protected, r, metric, receive=True) -> Selection:
    """EViT: remove the least important tokens; a removed token's destination (for merging strategies) is the
    next token to its right that stays (the last token is always protected, so one exists)."""
    sel, ok = _top_links(-s.masked_fill(protected, math.inf), r)
    n = s.shape[1]
    removed = torch.zeros_like(protected)
    removed.scatter_(1, sel, ok)
    ar = torch.arange(n, device=s.device).expand_as(removed)
    next_kept = torch.where(removed, n - 1, ar).flip(1).cummin(1).values.flip(1)
    return Selection(sel, next_kept.gather(1, sel), ok, s.gather(1, sel))


FRONT_WINDOW = 2  # front looks at the oldest 2r unprotected tokens (the window the authors' code thins)


def _select_front(h, s, protected, r, metric, receive=True, window=FRONT_WINDOW,
                  rule=_select_importance) -> Selection:
    """Content-aware front-thinning: EViT's rule (remove the least important) within the oldest ``window * r``
    unprotected tokens, so recent context is never touched and important old tokens stay."""
    beyond = (~protected).cumsum(1) > window * r[:, None]
    return rule(h, s, protected | beyond, r, metric, receive)


_SELECTORS = {
    "importance_similarity": _select_importance_similarity,
    "reference": _select_reference,
    "bipartite": _select_bipartite,
    "importance": _select_importance,
    "front": _select_front,
}


#: selections that can keep protected tokens from being merge destinations (``receive=False``)
_RECEIVE_AWARE = frozenset({"importance_similarity", "bipartite"})


def select(selection: str, h: torch.Tensor, protected: torch.Tensor, r: torch.Tensor, metric: str,
           scores: torch.Tensor | None = None, receive: bool = True) -> Selection:
    """Run one selection rule on ``h [g, n, D]`` (all tokens real), ``protected [g, n]``, ``r [g]`` (``scores
    [g, n]``: the precomputed importance of metrics that need the mixer's internals; ``receive=False``: protected
    tokens are not merge destinations either)."""
    try:
        fn = _SELECTORS[selection]
    except KeyError:
        raise ValueError(f"unknown selection {selection!r}; allowed: {', '.join(_SELECTORS)}") from None
    if not receive and selection not in _RECEIVE_AWARE:
        raise ValueError(f"selection {selection!r} has no protected-destination rule; receive=False needs one of "
                         f"{sorted(_RECEIVE_AWARE)}")
    if h.shape[1] < 2 or int(r.max()) == 0:
        empty = torch.zeros(h.shape[0], 0, dtype=torch.long, device=h.device)
        return Selection(empty, empty, empty.bool(), empty.float())
    return fn(h, importance(h, metric, scores), protected, r, metric, receive)


@dataclass
class Plan:
    """One anchor's reduction for a whole batch, in indices of the current sequence (length ``N``).

    ``keep [B, M]``/``keep_mask``: kept tokens, ascending and right-aligned (left padding, index 0, mask False).
    ``src/dst/src_mask [B, R]``: removed tokens and where they merge (``dst_slot`` = column of ``dst`` in ``keep``).
    ``src_score``: importance of each removed token.
    """

    keep: torch.Tensor
    keep_mask: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    dst_slot: torch.Tensor
    src_mask: torch.Tensor
    src_score: torch.Tensor

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
) -> Plan | None:
    """Plan one anchor from its mixer output ``h [B, N, D]``; ``None`` when no row loses a token.

    ``mask [B, N]`` marks real tokens, ``protected [B, N]`` tokens that must survive.  Rows are grouped
    by real length so every selection runs on a dense, padding-free tensor.
    """
    B, N, _ = h.shape
    n_real = mask.sum(1)
    r_all = num_to_remove(n_real, keep_ratio, pairs)
    if int(r_all.max()) == 0:
        return None
    device = h.device
    R = int(r_all.max())
    src = torch.zeros(B, R, dtype=torch.long, device=device)
    dst = torch.zeros_like(src)
    ok = torch.zeros(B, R, dtype=torch.bool, device=device)
    score = torch.zeros(B, R, device=device)
    for n in torch.unique(n_real[r_all > 0]).tolist():
        rows = ((n_real == n) & (r_all > 0)).nonzero().squeeze(1)
        if n == N and len(rows) == B:  # no padding anywhere: select on h itself, no copies
            pos, h_rows, prot_rows, s_rows = None, h, protected, scores
        else:
            pos = mask[rows].nonzero()[:, 1].view(len(rows), n)  # real positions, ascending
            h_rows, prot_rows = _take(h[rows], pos), protected[rows].gather(1, pos)
            s_rows = None if scores is None else scores[rows].gather(1, pos)
        sel = select(selection, h_rows, prot_rows, r_all[rows], metric, s_rows, receive)
        k = sel.src.shape[1]
        src[rows, :k] = sel.src if pos is None else pos.gather(1, sel.src)
        dst[rows, :k] = sel.dst if pos is None else pos.gather(1, sel.dst)
        ok[rows, :k] = sel.valid
        score[rows, :k] = sel.score
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
    return Plan(keep, keep_mask, src, dst, dst_slot, ok, score)


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
        return (valid[..., None] & (rank < k[:, None, None])).float()
    else:
        raise ValueError(f"unknown strategy {strategy!r}; allowed: prune, merge, hybrid, hybrid_channel")
    return w[..., None].float()


def apply_plan_pair(a: torch.Tensor, b: torch.Tensor | None, plan: Plan, strategy_a: str,
                    strategy_b: str | None = None, q: float = 0.5) -> torch.Tensor:
    """``apply_plan(a, plan, strategy_a, q) + apply_plan(b, plan, strategy_b, q)`` (``b`` may be ``None``).

    The one torch implementation of applying a plan.  The kept rows (of ``a + b``) are gathered once; only the
    rows that receive merges are recomputed, branch by branch: ``dst <- (dst + sum_i w_i src_i) / (1 + sum_i
    w_i)`` over the sources mapped to ``dst`` (the size-weighted mean with sizes reset at every anchor), in
    fp32, cast back to the branch's dtype before the branches are added.  Padding slots are zero.
    """
    branches = [(a, strategy_a)] + ([] if b is None else [(b, strategy_b)])
    out = _take(a if b is None else a + b, plan.keep)
    if plan.src.shape[1]:
        weights = [merge_weights(plan, st, q, _take(x, plan.src) if st == "hybrid_channel" else None)
                   for x, st in branches]
        merged = torch.zeros_like(plan.src_mask)
        for w in weights:
            if w is not None:
                merged |= (w > 0).any(-1)
        if bool(merged.any()):
            M, N = plan.keep.shape[1], a.shape[1]
            dst = _flat(plan.dst_slot, M)[merged]  # output row of each merged source's destination
            rows = torch.unique(dst)  # the rows that change
            slot_of_src = torch.searchsorted(rows, dst)
            tokens = _flat(plan.keep, N).reshape(-1)[rows]  # their input rows
            sources = _flat(plan.src, N)[merged]
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
