"""Selection details the method tests do not reach: the chunked (linear-cost) matching against a brute-force search
written from its definition, its cost, and frozen destinations of the importance rule, by hand."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hf_tokred import TokenReductionConfig
from hf_tokred.reduce import apply_plan, make_plan
from hf_tokred import select as select_mod
from hf_tokred.select import PREFILTER_BLOCK, best_cosine_chunked, block_scores, select

GRID = 2.0**-16


def brute_chunked(xa, xb, pa, pb, window):
    """For each row of ``xa``: the best grid-rounded cosine among the rows of ``xb`` in its chunk (both sets in
    position order, cut into C = ceil(k / window) chunks of ceil(k / C) destinations and ceil(m / C) candidates),
    the first best in position order winning.  Pure Python loops."""
    g, m = pa.shape
    k = pb.shape[1]
    chunks = math.ceil(k / window)
    per_b = math.ceil(k / chunks)
    chunks = math.ceil(k / per_b)
    per_a = math.ceil(m / chunks)
    best = torch.empty(g, m)
    match = torch.empty(g, m, dtype=torch.long)
    for r in range(g):
        a_order = sorted(range(m), key=lambda i: (int(pa[r, i]), i))
        b_order = sorted(range(k), key=lambda j: (int(pb[r, j]), j))
        for c in range(chunks):
            cand = b_order[c * per_b:(c + 1) * per_b]
            for i in a_order[c * per_a:(c + 1) * per_a]:
                scores = []
                for j in cand:
                    cos = float(xa[r, i] @ xb[r, j]) / max(float(xa[r, i].norm()), 1e-12) / max(float(xb[r, j].norm()), 1e-12)
                    scores.append(round(cos / GRID))
                top = max(scores)
                best[r, i], match[r, i] = top, cand[scores.index(top)]
    return best, match


def _by_position(xa, xb, pa, pb):
    """One sequence holding the row ``xa[r, i]`` at position ``pa[r, i]`` and ``xb[r, j]`` at ``pb[r, j]``."""
    h = torch.zeros(xa.shape[0], xa.shape[1] + xb.shape[1], xa.shape[2])
    for r in range(xa.shape[0]):
        h[r, pa[r]], h[r, pb[r]] = xa[r], xb[r]
    return h


@pytest.mark.parametrize("m,k,window", [(9, 8, 3), (16, 16, 4), (7, 13, 5), (12, 5, 2), (10, 10, 10), (10, 10, 64)])
def test_chunked_matching_equals_brute_force(m, k, window):
    torch.manual_seed(m * 100 + k)
    xa, xb = torch.randn(2, m, 6), torch.randn(2, k, 6)
    perm = torch.randperm(m + k)
    pa, pb = perm[:m].expand(2, -1).clone(), perm[m:].expand(2, -1).clone()
    pb[1] = pb[1].flip(0)
    best, match = best_cosine_chunked(_by_position(xa, xb, pa, pb), pa, pb, window)
    ref_best, ref_match = brute_chunked(xa, xb, pa, pb, window)
    assert torch.equal(best, ref_best) and torch.equal(match, ref_match)


def test_chunked_matching_respects_allowed_destinations():
    torch.manual_seed(0)
    xa, xb = torch.randn(1, 8, 4), torch.randn(1, 8, 4)
    pa, pb = torch.arange(0, 16, 2)[None], torch.arange(1, 16, 2)[None]
    allowed = torch.ones(1, 8, dtype=torch.bool)
    allowed[0, :2] = False  # the whole first chunk of destinations (window 2): its candidates have no link
    best, match = best_cosine_chunked(_by_position(xa, xb, pa, pb), pa, pb, 2, allowed)
    assert torch.isinf(best[0, :2]).all() and bool(allowed[0, match[0, 2:]].all())


def _matching_flops(n, window):
    torch.manual_seed(0)
    h = torch.randn(1, n, 64)
    with FlopCounterMode(display=False) as counter:
        select("importance_similarity", h, torch.zeros(1, n, dtype=torch.bool), torch.tensor([n // 4]), "clip",
               match_window=window)
    return counter.get_total_flops()


def test_chunked_matching_cost_is_linear_and_the_global_one_quadratic():
    assert _matching_flops(2048, 128) / _matching_flops(1024, 128) == pytest.approx(2.0, rel=0.05)
    assert _matching_flops(2048, 0) / _matching_flops(1024, 0) == pytest.approx(4.0, rel=0.05)


def test_window_at_least_half_the_length_is_the_global_matching():
    torch.manual_seed(1)
    h = torch.randn(3, 40, 16)
    mask, prot = torch.ones(3, 40, dtype=torch.bool), torch.zeros(3, 40, dtype=torch.bool)
    prot[:, -1] = True
    plans = [make_plan(h, mask, prot, 0.6, "importance_similarity", "clip", True, match_window=w) for w in (0, 20)]
    assert all(torch.equal(getattr(plans[0], f), getattr(plans[1], f)) for f in ("keep", "src", "dst"))
    bounded = make_plan(h, mask, prot, 0.6, "importance_similarity", "clip", True, match_window=4)
    assert torch.equal(bounded.num_removed, plans[0].num_removed)  # the same count, other pairs
    assert not torch.equal(bounded.dst, plans[0].dst)


def test_importance_rule_merges_before_a_frozen_token_by_hand():
    # 8 tokens, importance = position order except token 5 (least) and 1 (next); the last 2 tokens are frozen
    s = torch.tensor([[5.0, 1.0, 6.0, 7.0, 8.0, 0.0, 9.0, 9.5]])
    h = s[..., None].expand(1, 8, 3).clone()
    frozen = torch.zeros(1, 8, dtype=torch.bool)
    frozen[0, 6:] = True
    sel = select("importance", h, frozen.clone(), torch.tensor([2]), "clip", scores=None, frozen=frozen)
    removed = sorted(zip(sel.src[0].tolist(), sel.dst[0].tolist(), sel.mergeable[0].tolist()))
    # token 1 merges into the next kept token (2); token 5's next kept token (6) is frozen: into 4, before it
    assert removed == [(1, 2, True), (5, 4, True)]
    frozen_all = torch.zeros(1, 8, dtype=torch.bool)
    frozen_all[0, 2:] = True
    sel = select("importance", h, frozen_all.clone(), torch.tensor([1]), "clip", frozen=frozen_all)
    assert sel.src.tolist() == [[1]] and sel.mergeable.tolist() == [[True]] and sel.dst.tolist() == [[0]]
    s2 = torch.tensor([[0.0, 5.0, 6.0]])
    only = torch.tensor([[False, True, True]])
    sel = select("importance", s2[..., None].expand(1, 3, 2).clone(), only.clone(), torch.tensor([1]), "clip",
                 frozen=only)
    assert sel.src.tolist() == [[0]] and sel.mergeable.tolist() == [[False]]  # nothing to merge into: pruned


def test_unmergeable_sources_are_pruned_by_every_strategy():


    h = torch.arange(12.0).view(1, 4, 3)
    mask = torch.ones(1, 4, dtype=torch.bool)
    frozen = torch.tensor([[False, True, True, True]])
    plan = make_plan(h, mask, frozen.clone(), 0.75, "importance", "clip", False, frozen=frozen)
    assert plan.src.tolist() == [[0]] and plan.mergeable.tolist() == [[False]]
    for strategy in ("merge", "hybrid", "hybrid_channel", "prune"):
        torch.testing.assert_close(apply_plan(h, plan, strategy, q=0.0), h[:, 1:])


def test_match_window_reaches_the_model_only_for_similarity_methods():
    assert TokenReductionConfig(method="utrc", keep_ratio=0.7, match_window=0).match_window == 0
    with pytest.raises(ValueError, match="no effect"):
        TokenReductionConfig(method="evit", keep_ratio=0.7, match_window=0)


def test_block_scores_by_hand():
    s = torch.tensor([[1.0, 5.0, 2.0, 0.0, -4.0, 3.0, 9.0]])
    assert block_scores(s, 3).tolist() == [[5.0, 5.0, 5.0, 3.0, 3.0, 3.0, 9.0]]
    assert block_scores(s, 7).tolist() == [[9.0] * 7] and torch.equal(block_scores(s, 1), s)


def test_prefilter_removes_the_least_important_blocks_by_hand():
    """Blocks of 32 tokens scored by their most important token (clip metric: h >= 0, so importance = mean of h):
    the lowest block goes whole, then the earliest tokens of the next lowest; protected tokens stay."""
    assert PREFILTER_BLOCK == 32  # the blocks below
    imp = torch.full((80,), 0.1)
    imp[3], imp[40], imp[66] = 0.9, 0.5, 0.7  # block scores: 0.9 (tokens 0-31), 0.5 (32-63), 0.7 (64-79)
    h = imp[None, :, None].expand(1, 80, 4).clone()
    protected = torch.zeros(1, 80, dtype=torch.bool)
    protected[0, [33, 79]] = True
    sel = select("blocks", h, protected, torch.tensor([36]), "clip")
    # block 32-63 loses its 31 unprotected tokens (33 stays), then 64-68 of block 64-79
    assert sorted(sel.src[0][sel.valid[0]].tolist()) == [32] + list(range(34, 64)) + list(range(64, 69))


def test_utrc_reference_on_a_long_prompt_says_its_cost_once(caplog, monkeypatch):
    monkeypatch.setattr(select_mod, "_warned", set())
    h = torch.rand(1, select_mod.REFERENCE_LONG + 2, 2)
    protected = torch.zeros(h.shape[:2], dtype=torch.bool)
    with caplog.at_level("WARNING", logger="hf_tokred"):
        select("reference", h[:, :64], protected[:, :64], torch.tensor([4]), "clip")
        assert not caplog.records  # a short prompt: nothing to say
        for _ in range(2):
            select("reference", h, protected, torch.tensor([4]), "clip")
    assert len(caplog.records) == 1 and "use utrc" in caplog.records[0].getMessage()
