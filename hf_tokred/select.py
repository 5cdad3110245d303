"""Selection: which tokens an anchor removes and where they merge, as pure functions on tensors.

Importance (paper Eq. 5 and its Table 3 variants), cosine matching, and the selection rules of every method
(:data:`hf_tokred.config.METHODS` names them).  Shapes: ``g`` rows of equal real length ``n`` (no padding: the
plan in :mod:`hf_tokred.reduce` groups rows by length), ``D`` channels.

Tie-breaking (deterministic): importance ties are broken by position (earlier = less important);
similarity ties by the order of the less-important set; equal best matches pick the first candidate.
Cosine similarities are snapped to a grid of ``_SIM_GRID`` before they are compared, so values that differ
only by float rounding (e.g. runs of a repeated token, computed with or without padding / neighbours) are
ties decided by position, not by rounding noise.

Matching cost: the exact matching compares every candidate with every destination (``(n/2)^2 D`` per anchor).
With ``match_window = w`` (> 0) the candidates and the destinations, each in position order, are cut into the same
number of consecutive chunks of at most ``w`` destinations, and a candidate is matched within its chunk only:
``n w D / 2`` per anchor, linear in ``n``, and exactly the global matching while there are at most ``w``
destinations (one chunk).

Frozen tokens (a question the caller keeps exactly as written) are protected and never merge destinations
either: the similarity selections search the other tokens only, and a removed token whose next kept token to the
right is frozen merges into the nearest kept token before it instead (or is pruned, when there is none).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .ops import cpu as cpu_ops

__all__ = ["FRONT_WINDOW", "PREFILTER_BLOCK", "Selection", "best_cosine_chunked", "block_scores", "flat_index",
           "importance", "select", "take_rows"]


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
        return _clip_mean(h)
    if metric == "l1":
        return h.abs().mean(-1)
    if metric == "l2":
        return h.norm(dim=-1)
    if metric == "noclip":
        return h.mean(-1)
    raise ValueError(f"unknown importance metric {metric!r}; allowed: clip, l1, l2, noclip, delta")


#: Tokens whose clipped mean is computed at a time (the clipped block stays in cache instead of a copy of ``h``)
_IMPORTANCE_BLOCK = 1024


def _clip_mean(h: torch.Tensor) -> torch.Tensor:
    """``h.clamp_min(0).mean(-1)``, a block of tokens at a time."""
    out = h.new_empty(h.shape[:-1])
    for i in range(0, h.shape[-2], _IMPORTANCE_BLOCK):
        out[..., i:i + _IMPORTANCE_BLOCK] = h[..., i:i + _IMPORTANCE_BLOCK, :].clamp_min(0).mean(-1)
    return out


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
    ``xa`` is normalised in place (callers pass their own copies).

    With ``allowed [g, k]`` only those rows of ``xb`` are searched (the others score ``-inf``; a source with no
    allowed row gets ``-inf``, no link); that search takes the plain torch pass.

    The ``[g, m, k]`` matrix is never held whole: blocks of rows (of unit-norm ``xa`` rows) are multiplied,
    scaled by the inverse norms of ``xb``, rounded and reduced while in cache.
    """
    xa.mul_(xa.norm(dim=-1, keepdim=True).clamp_min_(1e-12).reciprocal_())  # unit rows (the smaller operand)
    inv_b = xb.norm(dim=-1).clamp_min_(1e-12).reciprocal_().div_(_SIM_GRID)
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




def _chunks(k: int, window: int) -> tuple[int, int]:
    """``(chunks, destinations per chunk)`` for ``k`` destinations in chunks of at most ``window`` (every chunk,
    the last one included, holds at least one)."""
    per = math.ceil(k / math.ceil(k / window))
    return math.ceil(k / per), per


def _two_sets(h: torch.Tensor, ia: torch.Tensor, ib: torch.Tensor, clip: bool):
    """The rows ``ia [g, m]`` and ``ib [g, k]`` of ``h [g, n, D]`` as fp32 copies, gathered in one pass (clipped at
    0 when ``clip``)."""
    both = take_rows(h, torch.cat([ia, ib], 1)).float()
    if clip:
        both.clamp_min_(0)
    m = ia.shape[1]
    return both[:, :m], both[:, m:]


def best_cosine_chunked(h: torch.Tensor, ia: torch.Tensor, ib: torch.Tensor, window: int,
                        allowed: torch.Tensor | None = None, clip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """For each token ``ia[g, i]`` of ``h [g, n, D]``: its best cosine similarity (grid-rounded, as
    :func:`_best_cosine`) with the tokens ``ib [g, k]`` of its chunk, and the matched column of ``ib``.  Both sets
    are put in position order (a token's index in ``h`` is its position) and cut into the same number of
    consecutive chunks of at most ``window`` destinations; ``window <= 0`` or ``k <= window``: the global search,
    with ties going to the first destination in ``ib``'s order.  ``clip``: the features are ``max(h, 0)``
    (the ``clip`` metric).  ``allowed [g, k]``: the destinations that may be matched."""
    g, m = ia.shape
    k = ib.shape[1]
    if window <= 0 or k <= window:
        return _best_cosine(*_two_sets(h, ia, ib, clip), allowed)
    n_chunks, per_b = _chunks(k, window)
    per_a = math.ceil(m / n_chunks)
    # position order, padded to whole chunks with copies of the last row (a copy of a destination comes after
    # its original, so it never wins a tie; padded candidates are dropped below)
    sa = _pad_last(torch.sort(ia, dim=1, stable=True).indices, n_chunks * per_a)
    sb = _pad_last(torch.sort(ib, dim=1, stable=True).indices, n_chunks * per_b)
    xa, xb = _two_sets(h, ia.gather(1, sa), ib.gather(1, sb), clip)
    chunk_a = xa.reshape(g * n_chunks, per_a, h.shape[-1])
    chunk_b = xb.reshape(g * n_chunks, per_b, h.shape[-1])
    chunk_allowed = None if allowed is None else allowed.gather(1, sb).view(g * n_chunks, per_b)
    best_c, match_c = _best_cosine(chunk_a, chunk_b, chunk_allowed)
    offset = (torch.arange(n_chunks, device=h.device) * per_b).repeat(g)[:, None]
    match_c = sb.gather(1, (match_c + offset).view(g, -1))  # the matched row of xb
    best, match = torch.empty(g, m, dtype=best_c.dtype, device=h.device), torch.empty_like(ia)
    best.scatter_(1, sa[:, :m], best_c.view(g, -1)[:, :m])
    match.scatter_(1, sa[:, :m], match_c[:, :m])
    return best, match


def _pad_last(idx: torch.Tensor, width: int) -> torch.Tensor:
    """``idx [g, k]`` padded on the right to ``width`` columns with copies of its last column."""
    return torch.cat([idx, idx[:, -1:].expand(-1, width - idx.shape[1])], 1)


@dataclass
class Selection:
    """Which tokens of a group of equal-length rows go, relative to that group's real tokens.

    ``src[g, i]`` is removed and (for merging strategies) folded into ``dst[g, i]``; entries with
    ``valid`` False are unused.  ``score`` is the importance of each source (the token-level hybrid
    prunes the least important sources and merges the rest).  ``mergeable`` False: the source has no destination
    it may merge into (only frozen tokens), so it is pruned whatever the strategy (``None``: all may merge).
    """

    src: torch.Tensor  # [g, R] long
    dst: torch.Tensor  # [g, R] long
    valid: torch.Tensor  # [g, R] bool
    score: torch.Tensor  # [g, R] float
    mergeable: torch.Tensor | None = None  # [g, R] bool


def flat_index(idx: torch.Tensor, n: int) -> torch.Tensor:
    """Indices ``idx [g, k]`` into rows of length ``n``, as indices into the flattened ``[g * n]`` rows."""
    return idx + (torch.arange(idx.shape[0], device=idx.device) * n)[:, None]


def take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Gather rows of ``x [g, n, ...]`` along dim 1 with ``idx [g, k]`` (whole rows: one index_select, not a
    gather per element)."""
    g, n = x.shape[:2]
    return x.reshape(g * n, *x.shape[2:]).index_select(0, flat_index(idx, n).reshape(-1)).view(*idx.shape, *x.shape[2:])


def _top_links(link: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the ``r[g]`` highest link scores per row (stable: ties keep their order) and their validity."""
    R = int(r.max()) if r.numel() else 0
    order = torch.sort(link, dim=1, descending=True, stable=True).indices[:, :R]
    ok = torch.arange(R, device=link.device)[None, :] < r[:, None]
    ok &= torch.isfinite(link.gather(1, order))  # never take an ineligible (protected) source
    return order, ok


def _no_destination(protected, receive, frozen):
    """Tokens that may not receive merges: the frozen ones, and every protected one when ``receive`` is False
    (``None`` when there are none)."""
    barred = frozen if receive else protected
    return barred if barred is not None and bool(barred.any()) else None


def _select_importance_similarity(h, s, protected, r, metric, receive=True, frozen=None, match_window=0) -> Selection:
    """Paper Sec. 4: less important half matched to the more important half by cosine; keep the top links."""
    n = h.shape[1]
    order = torch.sort(s.masked_fill(protected, math.inf), dim=1, stable=True).indices
    n_a = n - n // 2
    a, b = order[:, :n_a], order[:, n_a:]  # tokens by importance: the less important half, then the rest
    barred = _no_destination(protected, receive, frozen)
    best, match = best_cosine_chunked(h, a, b, match_window, None if barred is None else ~barred.gather(1, b),
                                      clip=metric == "clip")
    best = best.masked_fill(protected.gather(1, a), -math.inf)
    sel, ok = _top_links(best, r)
    src = a.gather(1, sel)
    return Selection(src, b.gather(1, match.gather(1, sel)), ok, s.gather(1, src))


def _odd_destinations(sel, match, ok, s, frozen) -> Selection:
    """Even sources ``2 * sel`` into odd destinations ``2 * match + 1``; a frozen destination is not merged into."""
    src, dst = 2 * sel, 2 * match.gather(1, sel) + 1
    mergeable = None if frozen is None or not bool(frozen.any()) else ~frozen.gather(1, dst)
    return Selection(src, dst, ok, s.gather(1, src), mergeable)


logger = logging.getLogger("hf_tokred")
_warned: set[str] = set()
#: tokens at an anchor above which utrc_reference's global matching is logged (once per process) as costly
REFERENCE_LONG = 4096


def _select_reference(h, s, protected, r, metric, receive=True, frozen=None, match_window=0) -> Selection:
    """The reference code's selection, operation for operation: a per-channel sort along the token axis,
    then ``a @ b^T`` on the sorted halves, with row ``i`` of ``a`` read as even token ``2i`` and row ``j``
    of ``b`` as odd token ``2j+1``.  On non-negative inputs this removes 0, 2, ..., 2r-2 into token 1.

    Unlike the other selections, link scores are compared as computed (no tie grid), so the choice equals the
    authors' whenever theirs is not an exact floating-point tie; padding invariance therefore holds only up to
    float rounding of the scores (rows computed with and without padding may split a near-tie differently).
    The matching is the authors' global one (``match_window`` does not apply: its cost is that of their code)."""
    n = h.shape[1]
    if n > REFERENCE_LONG and "reference" not in _warned:
        _warned.add("reference")
        logger.warning("hf_tokred: utrc_reference matches every token with every other, as the authors' code does "
                       "(%d tokens at this anchor): its cost grows as the square of the prompt (36 %% of the dense "
                       "forward at 16k tokens); for long prompts use utrc, whose matching window keeps it linear",
                       n)
    feat = _features(h, metric)
    feat = feat / feat.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # normalised before the per-channel sort
    ranked = torch.sort(feat, dim=1, descending=True, stable=True).values
    a, b = ranked[:, n // 2 :], ranked[:, : n // 2]
    # raw scores, no tie grid: the authors' arg-sort separates near-ties by their float values, and so do we
    best, match = (a @ b.transpose(1, 2)).max(-1)
    even = torch.arange(0, n, 2, device=h.device)
    best = best.masked_fill(protected[:, even], -math.inf)
    sel, ok = _top_links(best, r)
    return _odd_destinations(sel, match, ok, s, frozen)


def _select_bipartite(h, s, protected, r, metric, receive=True, frozen=None, match_window=0) -> Selection:
    """ToMe / PuMer: even tokens matched to odd tokens by cosine; the most similar pairs merge."""
    barred = _no_destination(protected, receive, frozen)
    pos = torch.arange(h.shape[1], device=h.device).expand(h.shape[0], -1)
    best, match = best_cosine_chunked(h, pos[:, 0::2], pos[:, 1::2], match_window,
                                      None if barred is None else ~barred[:, 1::2], clip=metric == "clip")
    best = best.masked_fill(protected[:, 0::2], -math.inf)
    sel, ok = _top_links(best, r)
    return _odd_destinations(sel, match, ok, s, None)


def _select_importance(h, s, protected, r, metric, receive=True, frozen=None, match_window=0) -> Selection:
    """EViT: remove the least important tokens; a removed token's destination (for merging strategies) is the
    next token to its right that stays (the last token is always protected, so one exists), or, when that one
    is frozen, the nearest kept token before it that is not."""
    sel, ok = _top_links(-s.masked_fill(protected, math.inf), r)
    n = s.shape[1]
    removed = torch.zeros_like(protected)
    removed.scatter_(1, sel, ok)
    ar = torch.arange(n, device=s.device).expand_as(removed)
    next_kept = torch.where(removed, n - 1, ar).flip(1).cummin(1).values.flip(1)
    dst = next_kept.gather(1, sel)
    if frozen is None or not bool(frozen.any()):
        return Selection(sel, dst, ok, s.gather(1, sel))
    open_ = ~removed & ~frozen  # kept tokens that may receive merges
    before = torch.where(open_, ar, -1).cummax(1).values.gather(1, sel)
    dst_frozen = frozen.gather(1, dst)
    dst = torch.where(dst_frozen, before.clamp_min(0), dst)
    return Selection(sel, dst, ok, s.gather(1, sel), ~dst_frozen | (before >= 0))


FRONT_WINDOW = 2  # front looks at the oldest 2r unprotected tokens (the window the authors' code thins)


def _select_front(h, s, protected, r, metric, receive=True, frozen=None, match_window=0, window=FRONT_WINDOW,
                  rule=_select_importance) -> Selection:
    """Content-aware front-thinning: EViT's rule (remove the least important) within the oldest ``window * r``
    unprotected tokens, so recent context is never touched and important old tokens stay."""
    beyond = (~protected).cumsum(1) > window * r[:, None]
    return rule(h, s, protected | beyond, r, metric, receive, frozen, match_window)


#: the tokens before an important one that the lookahead selection keeps with it: a Mamba block's causal
#: convolution reads the 3 tokens before each token (conv_kernel 4 in every supported family), so a token
#: re-run without them would see another context than the one it was scored in
#: prefilter keeps whole blocks of this many consecutive tokens
PREFILTER_BLOCK = 32


def block_scores(s: torch.Tensor, size: int) -> torch.Tensor:
    """Each token's block score: the highest importance in its block of ``size`` consecutive tokens, blocks counted
    from the first token (``s [g, n]``, no padding)."""
    g, n = s.shape
    blocks = F.pad(s, (0, (-n) % size), value=-math.inf).view(g, -1, size).amax(-1)
    return blocks.repeat_interleave(size, dim=1)[:, :n]


def _select_blocks(h, s, protected, r, metric, receive=True, frozen=None, match_window=0,
                   size=PREFILTER_BLOCK) -> Selection:
    """EViT's rule on block scores: the least important blocks of ``size`` consecutive tokens go first (a block
    scores its most important token), so what is kept is whole runs of text around the tokens that matter; within
    a block that is cut, its earliest tokens go first."""
    return _select_importance(h, block_scores(s, size), protected, r, metric, receive, frozen, match_window)


_SELECTORS = {
    "importance_similarity": _select_importance_similarity,
    "reference": _select_reference,
    "bipartite": _select_bipartite,
    "importance": _select_importance,
    "front": _select_front,
    "blocks": _select_blocks,
}


#: selections that can keep protected tokens from being merge destinations (``receive=False``)
_RECEIVE_AWARE = frozenset({"importance_similarity", "bipartite"})


def select(selection: str, h: torch.Tensor, protected: torch.Tensor, r: torch.Tensor, metric: str,
           scores: torch.Tensor | None = None, receive: bool = True, frozen: torch.Tensor | None = None,
           match_window: int = 0) -> Selection:
    """Run one selection rule on ``h [g, n, D]`` (all tokens real), ``protected [g, n]``, ``r [g]`` (``scores
    [g, n]``: the precomputed importance of metrics that need the mixer's internals; ``receive=False``: protected
    tokens are not merge destinations either; ``frozen [g, n]``: protected tokens that are never destinations;
    ``match_window``: the similarity selections' chunk of destinations, 0 = global)."""
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
    if frozen is not None:
        protected = protected | frozen
    return fn(h, importance(h, metric, scores), protected, r, metric, receive, frozen, match_window)
