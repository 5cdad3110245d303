"""The reduction math against slow, obvious per-token implementations and hand-computed cases."""

import math

import pytest
import torch

from hf_tokred.reduce import (Plan, apply_plan, apply_plan_pair, extend_plan, importance, make_plan, num_to_remove,
                              select)

from robust_helpers import UNPAIRED
from slow_reference import documented_merge_count, documented_num_to_remove

# ----------------------------------------------------------------------------- slow references


def slow_importance(row, metric):
    vals = []
    for tok in row.double().tolist():
        if metric == "clip":
            vals.append(sum(max(0.0, v) for v in tok) / len(tok))
        elif metric == "l1":
            vals.append(sum(abs(v) for v in tok) / len(tok))
        elif metric == "l2":
            vals.append(math.sqrt(sum(v * v for v in tok)))
        else:
            vals.append(sum(tok) / len(tok))
    return vals


def slow_cos(u, v):
    nu = math.sqrt(sum(a * a for a in u)) or 1e-12
    nv = math.sqrt(sum(b * b for b in v)) or 1e-12
    return sum(a * b for a, b in zip(u, v)) / (nu * nv)


def slow_feat(row, metric):
    rows = row.double().tolist()
    return [[max(0.0, v) for v in t] for t in rows] if metric == "clip" else rows


def slow_links(row, protected, r, metric, a_set, b_set):
    feat = slow_feat(row, metric)
    links = []
    for ai, a in enumerate(a_set):
        if protected[a]:
            continue
        sims = [slow_cos(feat[a], feat[b]) for b in b_set]
        j = max(range(len(b_set)), key=lambda k: (sims[k], -k))
        links.append((-sims[j], ai, a, b_set[j]))
    links.sort()
    return [(a, b) for _, _, a, b in links[:r]]


def slow_paper_selection(row, protected, r, metric):
    n = len(row)
    s = slow_importance(row, metric)
    order = sorted(range(n), key=lambda i: (math.inf if protected[i] else s[i], i))
    return slow_links(row, protected, r, metric, order[: n - n // 2], order[n - n // 2 :])


def slow_bipartite_selection(row, protected, r, metric):
    n = len(row)
    return slow_links(row, protected, r, metric, list(range(0, n, 2)), list(range(1, n, 2)))


def slow_apply(x, pairs, weights):
    """x [n, D]; pairs [(src, dst)]; weights[i] = per-channel list of 0/1 merge weights of source i."""
    x = x.double()
    out = x.clone()
    for dst in {d for _, d in pairs}:
        num, den = x[dst].clone(), torch.ones(x.shape[1], dtype=torch.double)
        for (s, d), w in zip(pairs, weights):
            if d == dst:
                w = torch.tensor(w, dtype=torch.double)
                num += w * x[s]
                den += w
        out[dst] = num / den
    removed = {s for s, _ in pairs}
    return out[[i for i in range(len(x)) if i not in removed]]


def plan_pairs(plan, b=0):
    return [(int(s), int(d)) for s, d, ok in zip(plan.src[b], plan.dst[b], plan.src_mask[b]) if ok]


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("metric", ["clip", "l1", "l2", "noclip"])
def test_importance_metrics(metric):
    h = torch.randn(2, 7, 5)
    for b in range(2):
        assert importance(h, metric)[b].tolist() == pytest.approx(slow_importance(h[b], metric), abs=1e-6)


def test_num_to_remove():
    n = torch.tensor([0, 1, 2, 10, 37, 100])
    assert num_to_remove(n, 0.9, pairs=True).tolist() == [0, 0, 0, 1, 3, 10]
    assert num_to_remove(n, 0.3, pairs=True).tolist() == [0, 0, 1, 5, 18, 50]  # capped at n // 2
    assert num_to_remove(n, 0.3, pairs=False).tolist() == [0, 0, 1, 7, 25, 70]
    assert num_to_remove(torch.tensor([10]), 0.7, pairs=False).tolist() == [3]


GUARD_CASES = [(100, 0.55, 55), (25, 0.56, 14), (25, 0.28, 7), (200, 0.55, 110)]  # float product > the integer


@pytest.mark.parametrize("n, keep, kept", [*GUARD_CASES, (100, 0.29, 29), (1000, 0.9729, 973), (3, 1 / 3, 1),
                                           (7, 5 / 7, 5), (14, 5 / 7, 10), (10, 0.7, 7)])
@pytest.mark.parametrize("pairs", [False, True])
def test_num_to_remove_rounding_guard(n, keep, kept, pairs):
    """Ratios whose product with n is an integer exactly, but not in float arithmetic (100 * 0.55 is
    55.00000000000001, 25 * 0.56 is 14.000000000000002): exactly n * keep tokens are kept (hand-computed and the
    exact-arithmetic oracle agree), not one more."""
    assert documented_num_to_remove(n, keep, False) == n - kept
    want = min(n - kept, n // 2) if pairs else n - kept
    assert num_to_remove(torch.tensor([n]), keep, pairs).tolist() == [want]
    assert num_to_remove(torch.tensor([n, 2 * n]), keep, pairs).tolist() == [
        documented_num_to_remove(n, keep, pairs), documented_num_to_remove(2 * n, keep, pairs)]


def test_rounding_guard_cases_are_real():
    """The cases above need the guard: float arithmetic puts the product just above the integer."""
    assert all(n * keep > kept for n, keep, kept in GUARD_CASES)
    assert 5 * (1 - 0.8) < 1 and 10 * (1 - 0.9) < 1  # q = 0.8 / 0.9: floor would merge one token too few


def _plan_with_sources(n_src: int, scores: list[float]) -> tuple[Plan, torch.Tensor]:
    """A one-row plan on 2 n_src + 1 tokens: source 2i (importance scores[i]) merges into token 2i + 1."""
    n = 2 * n_src + 1
    keep = torch.tensor([[i for i in range(n) if i % 2 or i == n - 1]])
    src = torch.arange(0, 2 * n_src, 2)[None]
    dst = src + 1
    slot = torch.tensor([[list(keep[0]).index(int(d)) for d in dst[0]]])
    plan = Plan(keep, torch.ones_like(keep, dtype=torch.bool), src, dst, slot, torch.ones_like(src, dtype=torch.bool),
                torch.tensor([scores]))
    return plan, torch.randn(1, n, 3, generator=torch.Generator().manual_seed(n_src))


@pytest.mark.parametrize("q, n_src, merged", [
    (0.8, 5, 1), (0.6, 5, 2), (0.7, 10, 3), (0.9, 10, 1), (0.2, 5, 4), (0.0, 5, 5), (1.0, 5, 0), (0.5, 3, 1),
    (0.3, 10, 7), (5 / 6, 12, 2), (0.8, 20, 4),
    (9 / 22, 22, 13), (16 / 23, 23, 7), (14 / 29, 29, 15)])
def test_hybrid_merge_count_rounding_guard(q, n_src, merged):
    """The hybrid strategies merge floor(r (1 - q)) of r sources, computed exactly: q = 0.8 with 5 sources merges 1
    (5 * (1 - 0.8) is 0.9999999999999998 in doubles), q = 9/22 with 22 sources merges 13 (12.999999 in float32),
    for the token-level and the per-channel hybrid alike."""
    assert documented_merge_count(n_src, q) == merged
    scores = [float(v) for v in torch.randperm(n_src, generator=torch.Generator().manual_seed(1))]
    plan, x = _plan_with_sources(n_src, scores)
    for strategy in ("hybrid", "hybrid_channel"):
        out = apply_plan(x, plan, strategy, q)[0]
        if strategy == "hybrid":  # the `merged` most important sources fold into their destination
            chosen = sorted(range(n_src), key=lambda i: -scores[i])[:merged]
            w = torch.zeros(n_src, 3)
            w[chosen] = 1.0
        else:  # per channel, the `merged` largest source values
            vals = x[0, 0 : 2 * n_src : 2]
            w = torch.zeros(n_src, 3)
            w.scatter_(0, torch.sort(vals, dim=0, descending=True, stable=True).indices[:merged], 1.0)
        want = (x[0, 1 : 2 * n_src : 2] + w * x[0, 0 : 2 * n_src : 2]) / (1 + w)
        torch.testing.assert_close(out[:n_src], want, msg=lambda m: f"{strategy}: {m}")
        both = apply_plan_pair(x, 2 * x, plan, "merge", strategy, q)[0]
        torch.testing.assert_close(both[:n_src], (x[0, 1 : 2 * n_src : 2] + x[0, 0 : 2 * n_src : 2]) / 2 + 2 * want)


@pytest.mark.parametrize("metric", ["clip", "l2", "noclip"])
@pytest.mark.parametrize("n,r", [(9, 3), (12, 6), (2, 1), (15, 1)])
def test_paper_selection_matches_slow_reference(metric, n, r):
    torch.manual_seed(n * 7 + r)
    h = torch.randn(3, n, 6)
    protected = torch.zeros(3, n, dtype=torch.bool)
    protected[:, -1] = True
    protected[1, min(2, n - 1)] = True
    sel = select("importance_similarity", h, protected, torch.full((3,), r), metric)
    for b in range(3):
        got = [(int(s), int(d)) for s, d, ok in zip(sel.src[b], sel.dst[b], sel.valid[b]) if ok]
        assert got == slow_paper_selection(h[b], protected[b].tolist(), r, metric)


@pytest.mark.parametrize("n,r", [(10, 4), (11, 5), (5, 2)])
def test_bipartite_selection_matches_slow_reference(n, r):
    torch.manual_seed(n + r)
    h = torch.randn(2, n, 6)
    protected = torch.zeros(2, n, dtype=torch.bool)
    protected[:, -1] = True
    sel = select("bipartite", h, protected, torch.full((2,), r), "clip")
    for b in range(2):
        got = [(int(s), int(d)) for s, d, ok in zip(sel.src[b], sel.dst[b], sel.valid[b]) if ok]
        assert got == slow_bipartite_selection(h[b], protected[b].tolist(), r, "clip")


def test_evit_removes_least_important_unprotected():
    torch.manual_seed(3)
    h = torch.randn(1, 12, 4)
    protected = torch.zeros(1, 12, dtype=torch.bool)
    protected[0, [3, 11]] = True
    sel = select("importance", h, protected, torch.tensor([5]), "clip")
    s = slow_importance(h[0], "clip")
    expect = sorted((i for i in range(12) if i not in (3, 11)), key=lambda i: (s[i], i))[:5]
    assert sorted(sel.src[0].tolist()) == sorted(expect)


def test_front_removes_the_least_important_of_the_oldest_2r_unprotected():
    """By hand from the rule: the candidates are the oldest 2r unprotected tokens (protected ones are skipped, not
    counted); of those, the r least important go (ties: the earlier one), and nothing after the window is touched,
    however unimportant."""
    torch.manual_seed(4)
    n, r = 14, 3
    h = torch.rand(1, n, 6) + 0.1
    h[0, 10] = 0.0  # the least important token of all, but far beyond the window
    protected = torch.zeros(1, n, dtype=torch.bool)
    protected[0, [1, 4, n - 1]] = True
    sel = select("front", h, protected, torch.tensor([r]), "clip")
    window = [0, 2, 3, 5, 6, 7]  # the first 2r = 6 unprotected positions
    s = slow_importance(h[0], "clip")
    expect = sorted(window, key=lambda i: (s[i], i))[:r]
    assert sorted(sel.src[0][sel.valid[0]].tolist()) == sorted(expect)
    # with fewer unprotected tokens than 2r the window is all of them, and r still go
    protected[0, 5:n] = True
    sel = select("front", h, protected, torch.tensor([r]), "clip")
    assert sorted(sel.src[0][sel.valid[0]].tolist()) == sorted(sorted([0, 2, 3], key=lambda i: (s[i], i))[:r])


@pytest.mark.parametrize("n", [20, 33, 64])
def test_reference_selection_thins_the_front(n):
    """method.md b.2: on strictly positive inputs the reference code removes 0, 2, ..., 2r-2 into token 1."""
    torch.manual_seed(n)
    h = torch.rand(2, n, 16) + 0.01
    r = n // 5
    mask = torch.ones(2, n, dtype=torch.bool)
    protected = torch.zeros_like(mask)
    plan = make_plan(h, mask, protected, 1 - r / n, "reference", "clip", pairs=True)
    for b in range(2):
        assert sorted(plan.src[b].tolist()) == list(range(0, 2 * r, 2))
        assert set(plan.dst[b].tolist()) == {1}
    # residual branch (merge): token 1 becomes the (r+1)-way mean
    res = torch.randn(2, n, 5)
    out = apply_plan(res, plan, "merge")
    expect = torch.cat([res[:, 1:2], res[:, 0 : 2 * r : 2]], 1).mean(1)
    assert torch.allclose(out[:, 0], expect, atol=1e-6)
    # hidden branch (per-channel hybrid, q = .5): per channel the k = r // 2 largest removed values fold in
    k = r // 2
    top = res[:, 0 : 2 * r : 2].sort(1, descending=True).values[:, :k].sum(1)
    assert torch.allclose(apply_plan(res, plan, "hybrid_channel", 0.5)[:, 0], (res[:, 1] + top) / (1 + k), atol=1e-6)
    kept = [i for i in range(n) if i == 1 or i >= 2 * r or i % 2]
    assert plan.keep[0].tolist() == kept


@pytest.mark.parametrize("strategy", ["prune", "merge", "hybrid", "hybrid_channel"])
@pytest.mark.parametrize("selection", ["importance_similarity", "bipartite", "reference"])
def test_apply_plan_matches_slow_reference(strategy, selection):
    torch.manual_seed(11)
    n, q = 17, 0.4
    h = torch.randn(1, n, 6)
    mask = torch.ones(1, n, dtype=torch.bool)
    protected = torch.zeros_like(mask)
    protected[0, -1] = True
    plan = make_plan(h, mask, protected, 0.6, selection, "clip", pairs=True)
    x = torch.randn(1, n, 6)
    pairs = plan_pairs(plan)
    r = len(pairs)
    assert r == n - math.ceil(n * 0.6)
    if strategy == "prune":
        weights = [[0.0] * 6 for _ in pairs]
    elif strategy == "merge":
        weights = [[1.0] * 6 for _ in pairs]
    elif strategy == "hybrid":  # the floor(r (1-q)) most important sources merge
        scores = [float(s) for s, ok in zip(plan.src_score[0], plan.src_mask[0]) if ok]
        ranked = sorted(range(r), key=lambda i: (-scores[i], i))[: documented_merge_count(r, q)]
        weights = [[1.0 if i in ranked else 0.0] * 6 for i in range(r)]
    else:  # per channel, the floor(r (1-q)) largest source values merge
        k = documented_merge_count(r, q)
        weights = [[0.0] * 6 for _ in pairs]
        for d in range(6):
            vals = [float(x[0, s, d]) for s, _ in pairs]
            for i in sorted(range(r), key=lambda i: (-vals[i], i))[:k]:
                weights[i][d] = 1.0
    got = apply_plan(x, plan, strategy, q)[0].double()
    assert torch.allclose(got, slow_apply(x[0], pairs, weights), atol=1e-6)


@pytest.mark.parametrize("strategy", ["merge", "hybrid", "hybrid_channel"])
def test_merge_weights_sum_to_one(strategy):
    """A constant sequence stays constant under any merge: weights form a convex combination."""
    h = torch.randn(2, 30, 8)
    mask = torch.ones(2, 30, dtype=torch.bool)
    plan = make_plan(h, mask, torch.zeros_like(mask), 0.5, "importance_similarity", "clip", pairs=True)
    x = torch.full((2, 30, 4), 3.25)
    assert torch.allclose(apply_plan(x, plan, strategy), torch.full((2, 15, 4), 3.25))


@pytest.mark.parametrize("selection", ["importance_similarity", "bipartite", "reference", "importance", "front"])
def test_order_last_token_protection_and_padding(selection):
    torch.manual_seed(5)
    B, N = 4, 23
    h = torch.randn(B, N, 8).abs()
    lengths = [23, 18, 9, 1]
    mask = torch.zeros(B, N, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, N - n :] = True  # left padding
    protected = torch.zeros_like(mask)
    protected[:, -1] = True
    protected[0, 4] = protected[1, 10] = True
    keep_ratio = 0.7
    pairs = selection not in UNPAIRED
    plan = make_plan(h, mask, protected, keep_ratio, selection, "clip", pairs)
    expect_removed = torch.tensor([documented_num_to_remove(n, keep_ratio, pairs) for n in lengths])
    assert plan.num_removed.tolist() == expect_removed.tolist()
    M = plan.keep.shape[1]
    for b, n in enumerate(lengths):
        kept = plan.keep[b][plan.keep_mask[b]].tolist()
        assert kept == sorted(kept) and len(set(kept)) == len(kept)  # order preserved
        assert len(kept) == n - expect_removed[b]
        assert plan.keep_mask[b].tolist() == [False] * (M - len(kept)) + [True] * len(kept)  # left padded
        assert all(mask[b, k] for k in kept)  # padding never kept
        assert all(k in kept for k in protected[b].nonzero().flatten().tolist())
        assert all(mask[b, s] for s, _ in plan_pairs(plan, b))  # padding never selected
        # each row's plan equals the plan for that row alone, without padding
        alone = make_plan(h[b : b + 1, N - n :], mask[b : b + 1, N - n :], protected[b : b + 1, N - n :],
                          keep_ratio, selection, "clip", pairs)
        alone_removed = [] if alone is None else sorted(s + N - n for s, _ in plan_pairs(alone))
        assert sorted(s for s, _ in plan_pairs(plan, b)) == alone_removed


def test_nothing_to_remove_returns_none():
    h = torch.randn(2, 8, 4)
    mask = torch.ones(2, 8, dtype=torch.bool)
    assert make_plan(h, mask, torch.zeros_like(mask), 1.0, "importance_similarity", "clip", True) is None
    assert make_plan(h[:, :1], mask[:, :1], mask[:, :1], 0.5, "importance_similarity", "clip", True) is None


def test_protection_limits_the_removed_count():
    h = torch.randn(1, 6, 4)
    mask = torch.ones(1, 6, dtype=torch.bool)
    protected = torch.tensor([[True, True, True, True, False, True]])
    plan = make_plan(h, mask, protected, 0.5, "importance_similarity", "clip", True)
    assert plan_pairs(plan) and [s for s, _ in plan_pairs(plan)] == [4]


def test_deterministic_under_ties():
    h = torch.ones(2, 16, 4)  # every importance and every similarity ties
    mask = torch.ones(2, 16, dtype=torch.bool)
    protected = torch.zeros_like(mask)
    protected[:, -1] = True
    plans = [make_plan(h, mask, protected, 0.75, "importance_similarity", "clip", True) for _ in range(3)]
    assert all(torch.equal(p.keep, plans[0].keep) and torch.equal(p.src, plans[0].src) for p in plans)
    # ties in importance are broken by position: the earliest tokens are the "less important" ones
    assert sorted(plan_pairs(plans[0])) == [(0, 8), (1, 8), (2, 8), (3, 8)]


@pytest.mark.parametrize("selection", ["importance_similarity", "bipartite", "importance", "reference", "front"])
def test_apply_plan_pair_equals_two_branches(selection):
    """The CPU two-branch apply (one gather of the kept rows, merged rows recomputed) equals the two separate
    applies bit for bit, for every pair of strategies, with padding and mixed dtypes."""
    torch.manual_seed(5)
    h, res = torch.randn(3, 41, 12).to(torch.bfloat16), torch.randn(3, 41, 12)
    mask = torch.ones(3, 41, dtype=torch.bool)
    mask[1, :9] = False
    plan = make_plan(h, mask, torch.zeros(3, 41, dtype=torch.bool), 0.7, selection, "clip",
                     selection not in UNPAIRED)
    for sa in ("merge", "prune", "hybrid", "hybrid_channel"):
        for sb in ("merge", "prune", "hybrid", "hybrid_channel"):
            two = apply_plan(res, plan, sa, 0.5) + apply_plan(h, plan, sb, 0.5)
            pair = apply_plan_pair(res, h, plan, sa, sb, 0.5)
            assert pair.dtype == two.dtype and torch.equal(pair, two), (sa, sb)


def test_compiled_grid_argmax_equals_torch_path(monkeypatch):
    """The compiled scale/round/arg-max pass picks the same best similarities and first matches as torch ops,
    including exact ties (duplicated candidates) and an all-zero feature row."""
    import hf_tokred.select as reduce_mod

    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        xa = (torch.rand(2, 300, 64, generator=g) - 0.3).clamp_min(0)
        xb = (torch.rand(2, 280, 64, generator=g) - 0.3).clamp_min(0)
        xb[:, 5] = xb[:, 9]
        xa[:, 3] = 0
        assert reduce_mod._cpu_grid_argmax(xa) is not None, "the compiled CPU kernels must build here"
        fused = reduce_mod._best_cosine(xa.clone(), xb)  # it normalises its first argument in place
        with monkeypatch.context() as m:
            m.setattr(reduce_mod, "_cpu_grid_argmax", lambda x: None)
            plain = reduce_mod._best_cosine(xa.clone(), xb)
        assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
        assert not bool((fused[1] == 9).any())  # column 9 duplicates column 5: a tie goes to the first


def test_importance_selection_merges_into_the_next_kept_token():
    """EViT-style selection with a merging strategy: each removed token folds into the next token to its right
    that stays (hand-computed: importance 5 1 4 2 3 9, two removals -> tokens 1 and 3 go, into 2 and 4)."""
    s = torch.tensor([[5.0, 1.0, 4.0, 2.0, 3.0, 9.0]])
    h = s[..., None].repeat(1, 1, 2)
    protected = torch.zeros(1, 6, dtype=torch.bool)
    protected[0, 5] = True
    plan = make_plan(h, torch.ones(1, 6, dtype=torch.bool), protected, 4 / 6, "importance", "noclip", False)
    assert sorted(plan.src[0][plan.src_mask[0]].tolist()) == [1, 3]
    assert dict(zip(plan.src[0].tolist(), plan.dst[0].tolist())) == {1: 2, 3: 4}
    x = torch.arange(6.0)[None, :, None]
    assert apply_plan(x, plan, "merge")[0, :, 0].tolist() == [0.0, 1.5, 3.5, 5.0]


def test_delta_metric_uses_the_given_scores_and_needs_them():
    h = torch.randn(1, 8, 4)
    scores = torch.tensor([[0.1, 5.0, 0.2, 4.0, 0.3, 3.0, 0.4, 9.0]])
    protected = torch.zeros(1, 8, dtype=torch.bool)
    plan = make_plan(h, torch.ones(1, 8, dtype=torch.bool), protected, 0.5, "importance", "delta", False, scores)
    assert sorted(plan.keep[0].tolist()) == [1, 3, 5, 7]  # the four largest step sizes stay
    with pytest.raises(ValueError, match="needs the anchor's step sizes"):
        make_plan(h, torch.ones(1, 8, dtype=torch.bool), protected, 0.5, "importance", "delta", False)


@pytest.mark.parametrize("selection", ["importance_similarity", "bipartite"])
def test_select_takes_a_removal_count_per_row(selection):
    """``select`` removes r[g] tokens from row g (rows of one call may differ): each row's links equal the slow
    reference's for that row's own count."""
    torch.manual_seed(21)
    h = torch.randn(3, 12, 6)
    protected = torch.zeros(3, 12, dtype=torch.bool)
    protected[:, -1] = True
    r = torch.tensor([1, 4, 2])
    sel = select(selection, h, protected, r, "clip")
    slow = slow_paper_selection if selection == "importance_similarity" else slow_bipartite_selection
    for b in range(3):
        got = [(int(s), int(d)) for s, d, ok in zip(sel.src[b], sel.dst[b], sel.valid[b]) if ok]
        assert got == slow(h[b], protected[b].tolist(), int(r[b]), "clip"), b


def test_compiled_grid_argmax_is_used_only_where_it_applies():
    """The compiled similarity pass takes fp32 CPU tensors without gradients (its documented contract); anything
    else gets ``None`` and the torch ops."""
    import hf_tokred.select as reduce_mod

    x = torch.zeros(2, 3, 4)
    assert reduce_mod._cpu_grid_argmax(x) is not None
    assert reduce_mod._cpu_grid_argmax(x.double()) is None
    assert reduce_mod._cpu_grid_argmax(x.bfloat16()) is None
    assert reduce_mod._cpu_grid_argmax(torch.zeros(2, 3, 4, device="meta")) is None
    with torch.enable_grad():
        assert reduce_mod._cpu_grid_argmax(x.clone().requires_grad_()) is None
    with torch.no_grad():
        assert reduce_mod._cpu_grid_argmax(x.clone().requires_grad_()) is not None


@pytest.mark.parametrize("selection, want", [
    ("importance_similarity", [(i, 24) for i in range(12)]),  # A = tokens 0..23 (ties: earlier = less important)
    ("bipartite", [(i, 1) for i in range(0, 24, 2)]),  # even tokens in order, all into the first odd one
    ("reference", [(i, 1) for i in range(0, 24, 2)]),  # the reference code's front thinning
])
def test_ties_are_broken_by_position_on_long_rows(selection, want):
    """Exact ties everywhere on a row of 48 tokens (sorts of more than 16 elements are where an unstable sort
    reorders ties): importance ties go to the earlier token, equal links to the earlier source, equal best matches to
    the first candidate."""
    h = torch.ones(1, 48, 4)
    mask = torch.ones(1, 48, dtype=torch.bool)
    protected = torch.zeros_like(mask)
    protected[0, -1] = True
    plan = make_plan(h, mask, protected, 0.75, selection, "clip", True)
    assert sorted(plan_pairs(plan)) == want


def test_importance_ties_on_long_rows():
    """EViT on 48 equally important tokens removes the earliest ones."""
    h = torch.ones(1, 48, 4)
    mask = torch.ones(1, 48, dtype=torch.bool)
    protected = torch.zeros_like(mask)
    protected[0, -1] = True
    plan = make_plan(h, mask, protected, 0.5, "importance", "clip", False)
    assert sorted(plan.src[0][plan.src_mask[0]].tolist()) == list(range(24))


@pytest.mark.parametrize("selection", ["importance_similarity", "bipartite"])
def test_protected_tokens_receive_no_merge_when_frozen(selection):
    """``receive=False`` (utrc_frozen): a protected token is neither removed nor a merge destination, so it stays
    exactly as computed; with the paper's rule (``receive=True``) it may receive merges."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(2, 20, 6, generator=g)
    h[:, 1::2] = h[:, 0::2] + 0.01  # every even token is most similar to the odd one after it
    protected = torch.zeros(2, 20, dtype=torch.bool)
    protected[:, 1:8] = True
    mask = torch.ones(2, 20, dtype=torch.bool)
    for receive in (True, False):
        plan = make_plan(h, mask, protected, 0.6, selection, "noclip", True, receive=receive)
        dst = plan.dst[plan.src_mask]
        assert not protected[0][plan.src[0][plan.src_mask[0]]].any()
        hit = bool(protected.gather(1, plan.dst).masked_select(plan.src_mask).any())
        assert hit == receive, (selection, receive, dst.tolist())
    x = torch.randn(2, 20, 3, generator=g)
    out = apply_plan(x, plan, "merge")
    kept = plan.keep[0].tolist()
    for p in range(1, 8):
        assert torch.equal(out[0, kept.index(p)], x[0, p])  # protected rows come through untouched


def test_frozen_bipartite_links_to_the_most_similar_unprotected_destination():
    """``receive=False`` against brute force: each removed even token's destination is the odd, unprotected token
    of highest cosine (``noclip``: cosines may be negative, a negative best still links)."""
    g = torch.Generator().manual_seed(9)
    h = torch.randn(1, 16, 4, generator=g)
    protected = torch.zeros(1, 16, dtype=torch.bool)
    protected[0, [1, 5, 9, 15]] = True
    plan = make_plan(h, torch.ones(1, 16, dtype=torch.bool), protected, 0.5, "bipartite", "noclip", True,
                     receive=False)
    allowed = [j for j in range(1, 16, 2) if not protected[0, j]]
    cos = torch.nn.functional.cosine_similarity(h[0][:, None], h[0][None], dim=-1)
    ok = plan.src_mask[0]
    assert int(ok.sum()) == 8  # keep 0.5 of 16: every even token goes (the protected ones are odd)
    for s, d in zip(plan.src[0][ok].tolist(), plan.dst[0][ok].tolist()):
        assert d in allowed and cos[s, d] >= max(cos[s, j] for j in allowed) - 1e-4


@pytest.mark.parametrize("selection", ["reference", "importance", "front"])
def test_receive_false_is_refused_where_the_selection_has_no_rule_for_it(selection):
    h = torch.randn(1, 8, 4)
    with pytest.raises(ValueError, match="receive=False"):
        make_plan(h, torch.ones(1, 8, dtype=torch.bool), torch.zeros(1, 8, dtype=torch.bool), 0.5, selection,
                  "clip", True, receive=False)


def test_extend_plan_keeps_the_tail_columns_after_the_reduced_prefix():
    """A plan made on the first ``prefix`` columns, extended to ``length``: by hand, the extended keep indices are
    the plan's followed by ``prefix .. length-1`` in every row, all valid, and applying it equals applying the plan
    to the prefix and appending the tail unchanged (two rows of different lengths: a padded batch)."""
    torch.manual_seed(0)
    B, prefix, length, D = 2, 9, 13, 4
    h = torch.randn(B, length, D)
    mask = torch.ones(B, prefix, dtype=torch.bool)
    mask[1, :3] = False  # left padding in row 1
    protected = torch.zeros(B, prefix, dtype=torch.bool)
    plan = make_plan(h[:, :prefix], mask, protected, 0.6, "importance_similarity", "l2", True)
    ext = extend_plan(plan, prefix, length)
    tail = torch.tensor([[9, 10, 11, 12], [9, 10, 11, 12]])
    assert torch.equal(ext.keep, torch.cat([plan.keep, tail], 1))
    assert torch.equal(ext.keep_mask, torch.cat([plan.keep_mask, torch.ones(B, 4, dtype=torch.bool)], 1))
    assert torch.equal(ext.src, plan.src) and torch.equal(ext.dst_slot, plan.dst_slot)
    got = apply_plan(h, ext, "merge", 0.5)
    want = torch.cat([apply_plan(h[:, :prefix], plan, "merge", 0.5), h[:, prefix:]], 1)
    assert torch.equal(got, want)
