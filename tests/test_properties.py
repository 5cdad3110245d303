"""Property-based tests (hypothesis): random configs x random shapes x random padding.

Reproducible in CI: the ``ci`` hypothesis profile (``conftest.py``) is ``derandomize=True`` (examples are derived
from the test itself, not from a random seed) and all tensors come from seeded ``torch.Generator``s whose seeds
hypothesis draws.  Fresh random examples, ten times as many::

    HF_TOKRED_HYPOTHESIS_PROFILE=explore .venv/bin/python -m pytest -q tests/test_properties.py \
        --hypothesis-show-statistics

Coverage is by construction, not by luck: the method / selection is a test parameter (every one runs), ratios
and ``q`` are drawn from the open interval *and* from the rounding boundaries (``keep * n`` within 1e-12 of an
integer, ``q`` with ``r (1 - q)`` an integer in exact arithmetic), and one strategy makes every row of a batch
remove tokens.  ``event``s report what was drawn (``--hypothesis-show-statistics``).

Oracles: the documented schedule in exact arithmetic (``slow_reference.documented_num_to_remove``) limited by the
tokens a selection may not take (``robust_helpers.expected_removed``), the slow per-row reference with merge
counts in exact arithmetic, the row run alone, stock transformers, and JSON / save_pretrained round trips.
"""

import functools
import json
import math
import tempfile

import pytest
import torch
from hypothesis import event, given, note
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import hf_tokred
from hf_tokred import METHODS, METRICS, STRATEGIES, TokenReductionConfig
from hf_tokred.config import schedule_proxy_reduction as proxy_flops_reduction
from hf_tokred.reduce import apply_plan, make_plan, num_to_remove
from hf_tokred.select import PREFILTER_BLOCK

from conftest import examples, stock_forward, tiny_model
from robust_helpers import (
    branch_strategies,
    ATOL,
    METHOD_SELECTION,
    UNPAIRED,
    assert_close_where_computed,
    documented_num_to_remove,
    expected_removed,
    kept_positions,
    pad_rows,
    random_rows,
    row_local_plans,
    slow_forward_any_dtype,
)
from slow_reference import documented_merge_count, in_tolerance_band, intended_ratio, slow_apply, slow_weights

LAYERS = 4
fast = examples  # max_examples for the ci profile, scaled (and re-seeded) by the explore profile


@functools.lru_cache(maxsize=None)
def model_for(family):
    return tiny_model(family, layers=LAYERS)


# ============================================================================ strategies


@st.composite
def boundary_ratio(draw, low=0.0, high=1.0):
    """A ratio in (low, high] on a rounding boundary: ``k / m`` as a float, or a short decimal, so ``n * ratio`` is
    an integer in exact arithmetic for every multiple ``n`` of ``m`` (and float arithmetic may miss it by 1 ulp)."""
    m = draw(st.integers(1, 40))
    k = draw(st.integers(max(1, math.floor(low * m) + 1), m).filter(lambda k: k / m <= high))
    if draw(st.booleans()):
        return k / m
    digits = draw(st.integers(1, 4))
    value = round(draw(st.floats(low, high, exclude_min=True)), digits)
    return value if low < value <= high else k / m


def _float_ratios(low, high, **kw):
    """Floats in the interval, except the few within 2e-9 of a rounding boundary that are neither short decimals
    nor simple fractions (``slow_reference.in_tolerance_band``: e.g. 1e-9, where no rounding is specified)."""
    return st.floats(low, high, **kw).filter(lambda x: not in_tolerance_band(x))


def ratios(low=0.0, high=1.0):
    """Keep ratios in (low, high]: anywhere, or on a rounding boundary."""
    return st.one_of(_float_ratios(low, high, exclude_min=True), boundary_ratio(low, high))


#: q values where float arithmetic gets floor(r (1 - q)) wrong for some r <= 24 (0.8: r = 5, 10, ...; 5/6: r = 6,
#: 12, ...; 0.9: r = 10, 20; 5/12: r = 12, 24; 9/11: r = 11, 22): the merge count's rounding guard matters.
GUARD_Q = [0.8, 5 / 6, 0.9, 5 / 12, 9 / 11]


def q_values():
    """q in the open interval (0, 1), on a boundary (0.8: 5 sources merge exactly one), or at its ends."""
    return st.one_of(_float_ratios(0.0, 1.0, exclude_min=True, exclude_max=True),
                     boundary_ratio(0.0, 1.0).filter(lambda q: q < 1.0),
                     st.sampled_from(GUARD_Q), st.sampled_from([0.0, 1.0]))


@st.composite
def configs(draw, layers=LAYERS, max_keep=1.0, method=None):
    """Any valid TokenReductionConfig, over every field; with ``layers`` it also fits a model of that depth
    (anchors before its last block)."""
    method = method or draw(st.sampled_from(sorted(METHODS)))
    spec = METHODS[method]
    min_keep = 0.5 if spec.pairs else 0.0
    if not spec.pairs:  # EViT and front_prune (no matched destination) can only prune
        hidden = draw(st.sampled_from([None, "prune"]))
        residual = draw(st.sampled_from([None, "prune"]))
    else:
        hidden = draw(st.sampled_from([None, *sorted(STRATEGIES)]))
        residual = draw(st.sampled_from([None, *sorted(STRATEGIES)]))
    if layers is None:
        anchors = draw(st.one_of(st.none(), st.lists(st.integers(0, 10**6), min_size=1, max_size=8, unique=True)
                                 .map(sorted).map(tuple)))
    else:
        anchors = draw(st.one_of(st.none(), st.lists(st.integers(0, layers - 2), min_size=1, max_size=layers - 1,
                                                     unique=True).map(sorted).map(tuple)))
    if draw(st.booleans()):
        keep = draw(st.floats(min_value=max(min_keep, 0.05 if layers else 0.0), max_value=max_keep,
                              exclude_min=min_keep == 0.0 and layers is None))
        kw = dict(keep_ratio=keep)
    else:
        top = 0.999999
        if layers is not None:  # reachable for this depth
            used = anchors if anchors is not None else hf_tokred.default_anchors(layers)
            top = proxy_flops_reduction(layers, used, max(min_keep, 0.05)) * 0.999
        kw = dict(flops_reduction=draw(st.floats(min_value=0.0 if max_keep == 1.0 else 0.05, max_value=top)))
    hybrid = {hidden or spec.hidden, residual or spec.residual} & {"hybrid", "hybrid_channel"}
    return TokenReductionConfig(  # q only where a hybrid strategy reads it (elsewhere the settings refuse it)
        method=method, anchors=anchors, metric=draw(st.sampled_from(sorted(METRICS))),
        q=draw(q_values()) if hybrid else 0.5, hidden_strategy=hidden, residual_strategy=residual, **kw,
    )


# ============================================================================ 5. round trips


@fast(200)
@given(cfg=configs(layers=None))
def test_config_round_trips_through_json(cfg):
    d = cfg.to_dict()
    assert set(d) == {"method", "flops_reduction", "keep_ratio", "keep_tokens", "anchors", "metric", "q",
                      "hidden_strategy", "residual_strategy", "protect_recent", "match_window",
                      "version"}  # every field, always, and the version
    again = TokenReductionConfig.from_dict(json.loads(json.dumps(d)))
    assert again == cfg and again.to_dict() == d
    assert TokenReductionConfig.coerce(d) == cfg
    event(f"method={cfg.method}")


@fast(100)
@given(k=st.integers(1, 10**6), method=st.sampled_from([None, "front_prune", "evit", "prefilter", "utrc", "tome"]),
       window=st.integers(0, 4096), recent=st.floats(0.0, 0.9))
def test_budget_config_round_trips_through_json(k, method, window, recent):
    windowed = method in ("utrc", "tome")
    cfg = TokenReductionConfig(keep_tokens=k, method=method, protect_recent=recent,
                               **({"match_window": window} if windowed else {}))
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["keep_tokens"] == k and d["keep_ratio"] is None and d["flops_reduction"] is None
    assert d["match_window"] == (window if windowed else hf_tokred.config.DEFAULT_MATCH_WINDOW)
    assert TokenReductionConfig.from_dict(d) == cfg


@fast(20)
@given(cfg=configs(), family=st.sampled_from(["mamba", "mamba2"]), auto=st.booleans())
def test_save_and_reload_never_drops_or_changes_a_setting(cfg, family, auto):
    model = model_for(family)
    hf_tokred.apply_token_reduction(model, cfg)
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        assert json.loads(open(f"{path}/config.json").read())["token_reduction"] == cfg.to_dict()
        loader = AutoModelForCausalLM if auto else type(model)
        again = loader.from_pretrained(path)
    got = hf_tokred.get_token_reduction(again)
    assert got == cfg and got.to_dict() == cfg.to_dict()
    assert got.resolve(LAYERS) == cfg.resolve(LAYERS)


# ============================================================================ 6. the schedule


@fast(200)
@given(n=st.integers(0, 10_000), k=st.integers(1, 10_000), pairs=st.booleans())
def test_num_to_remove_exact_for_decimal_ratios(n, k, pairs):
    """For ratios written with up to 4 decimals (0.7, 0.905, 0.9729 ...) the removal is exactly
    n - ceil(n * k / 10000), computed in integers, capped at n // 2 for pairing methods."""
    keep = k / 10_000
    expect = n - (-(-n * k // 10_000))
    if pairs:
        expect = min(expect, n // 2)
    assert int(num_to_remove(torch.tensor([n]), keep, pairs)[0]) == expect == documented_num_to_remove(n, keep, pairs)


@fast(300)
@given(m=st.integers(1, 60), k=st.integers(1, 60), multiple=st.integers(1, 60), offset=st.sampled_from([0, 0, 1, -1]),
       as_fraction=st.booleans(), pairs=st.booleans())
def test_num_to_remove_on_rounding_boundaries(m, k, multiple, offset, as_fraction, pairs):
    """keep = k / m (as the float k / m, or as the decimal rounded to 4 places) on rows of n = multiple * m (+-1):
    n * keep is an integer, or within 1e-12 of one, where float arithmetic may land on either side; the removal is
    exactly the documented count in exact arithmetic."""
    keep = k / m if as_fraction else round(k / m, 4)
    if not 0 < keep <= 1:
        return
    n = max(multiple * m + offset, 1)
    product = n * keep
    near = abs(product - round(product)) < 1e-12 * max(1.0, product)
    event(f"n*keep within 1e-12 of an integer: {near}; float product above the exact one: "
          f"{product > n * intended_ratio(keep)}")
    assert int(num_to_remove(torch.tensor([n]), keep, pairs)[0]) == documented_num_to_remove(n, keep, pairs)


@fast(200)
@given(n=st.integers(1, 100_000), keep=st.floats(min_value=1e-6, max_value=1.0), pairs=st.booleans())
def test_num_to_remove_bounds_and_monotonicity(n, keep, pairs):
    r = [int(v) for v in num_to_remove(torch.tensor([n, n + 1]), keep, pairs)]
    kept = n - r[0]
    assert 0 <= r[0] <= n - 1  # a non-empty row always keeps a token
    assert r[0] <= r[1] <= r[0] + 1  # one more token removes at most one more
    if pairs:
        assert r[0] <= n // 2
        assert r[0] == min(int(num_to_remove(torch.tensor([n]), keep, False)[0]), n // 2)
    else:
        assert n * keep - 1e-6 <= kept < n * keep + 1  # ceil semantics
    assert r[0] == documented_num_to_remove(n, keep, pairs)


@fast(100)
@given(n=st.integers(1, 50), keep=st.floats(min_value=0.0, max_value=1e-6, exclude_min=True))
def test_tiny_keep_ratio_never_empties_a_row(n, keep):
    """TokenReductionConfig accepts any keep_ratio in (0, 1] for EViT; n - ceil(n * keep) <= n - 1 for them all."""
    TokenReductionConfig(method="evit", keep_ratio=keep)  # accepted
    assert int(num_to_remove(torch.tensor([n]), keep, False)[0]) <= n - 1


# ============================================================================ 6. make_plan / apply_plan directly


SELECTIONS = ["importance_similarity", "bipartite", "reference", "importance", "front", "blocks"]


def documented_importance(h: torch.Tensor, metric: str, scores) -> torch.Tensor:
    """Paper Eq. 5 and its Table 3 variants, written out (``delta``: the step sizes given)."""
    return {"clip": lambda: h.clamp_min(0).mean(-1), "l1": lambda: h.abs().mean(-1), "l2": lambda: h.norm(dim=-1),
            "noclip": lambda: h.mean(-1), "delta": lambda: scores}[metric]()


@st.composite
def plan_cases(draw, selection):
    """A batch for one selection rule; with ``every_row`` (half of the cases) every row is long enough to lose
    tokens and only its last token is protected, so every row of the batch removes."""
    B = draw(st.integers(1, 5))
    N = draw(st.integers(2, 24))
    pairs = selection not in UNPAIRED
    keep = draw(ratios(0.5 if pairs else 0.01, 1.0).filter(lambda k: k >= (0.5 if pairs else 0.01)))
    every_row = draw(st.booleans())
    if every_row:
        keep = min(keep, 0.9)
        n_min = next((n for n in range(2, N + 1) if documented_num_to_remove(n, keep, pairs) > 0), None)
        if n_min is None:  # no row this short can lose a token at this ratio
            N, n_min = 24, next(n for n in range(2, 25) if documented_num_to_remove(n, keep, pairs) > 0)
        lengths = draw(st.lists(st.integers(n_min, N), min_size=B, max_size=B))
    else:
        lengths = draw(st.lists(st.integers(0, N), min_size=B, max_size=B))
    return dict(
        B=B, N=N, D=draw(st.integers(1, 8)), selection=selection, pairs=pairs, every_row=every_row,
        layout=draw(st.sampled_from(["left", "right", "holes", "full"])),
        lengths=lengths, keep=keep,
        metric=draw(st.sampled_from(sorted(METRICS))),
        values=draw(st.sampled_from(["normal", "ties"])),
        protect="last" if every_row else draw(st.sampled_from([0.0, 0.2, 0.6, 1.0])),
        q=draw(q_values()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def build_plan_inputs(c):
    g = torch.Generator().manual_seed(c["seed"])
    B, N, D = c["B"], c["N"], c["D"]
    mask = torch.zeros(B, N, dtype=torch.bool)
    for b, n in enumerate(c["lengths"]):
        n = N if c["layout"] == "full" else n
        if c["layout"] == "left":
            mask[b, N - n :] = True
        elif c["layout"] in ("right", "full"):
            mask[b, :n] = True
        else:
            mask[b, torch.randperm(N, generator=g)[:n]] = True
    if c["values"] == "normal":
        h = torch.randn(B, N, D, generator=g)
    else:  # few distinct rows -> exact ties in importance and similarity
        h = torch.tensor([-1.0, 0.0, 1.0])[torch.randint(0, 3, (B, N, D), generator=g)]
    if c["protect"] == "last":  # each row's last real token, as the model protects it
        last = torch.where(mask, torch.arange(N), -1).max(1).values
        protected = mask & (torch.arange(N)[None, :] == last[:, None])
    else:
        protected = mask & (torch.rand(B, N, generator=g) < c["protect"])
    return h, mask, protected, g


@pytest.mark.parametrize("selection", SELECTIONS)
@fast(80)
@given(data=st.data())
def test_make_plan_invariants(selection, data):
    c = data.draw(plan_cases(selection))
    h, mask, protected, g = build_plan_inputs(c)
    sel, pairs, keep = c["selection"], c["pairs"], c["keep"]
    # the delta metric reads the anchor's step sizes: here, positive scores drawn from the same generator
    scores = torch.rand(h.shape[:2], generator=g) if c["metric"] == "delta" else None
    receive = data.draw(st.booleans(), label="protected tokens receive merges") if sel in ("importance_similarity", "bipartite") else True
    plan = make_plan(h, mask, protected, keep, sel, c["metric"], pairs, scores, receive)
    n_real = mask.sum(1)
    if int(num_to_remove(n_real, keep, pairs).max()) == 0:
        assert plan is None
        event("no plan")
        return
    if plan is None:  # only when no row has an eligible source (with a destination it may merge into)
        for b in range(c["B"]):
            real = mask[b].nonzero().flatten().tolist()
            assert expected_removed(len(real), [bool(protected[b, p]) for p in real], keep, sel, pairs, receive) == 0
        event("nothing eligible")
        return
    M = plan.keep.shape[1]
    kept_counts = []
    for b in range(c["B"]):
        real = mask[b].nonzero().flatten().tolist()
        n = len(real)
        plocal = [bool(protected[b, p]) for p in real]
        ok = plan.src_mask[b]
        src, dst = plan.src[b][ok].tolist(), plan.dst[b][ok].tolist()
        kept = plan.keep[b][plan.keep_mask[b]].tolist()
        kept_counts.append(len(kept))
        # exactly the schedule, limited only by the tokens the selection may not take
        assert len(src) == expected_removed(n, plocal, keep, sel, pairs, receive), (b, n, sum(plocal))
        if not receive:
            assert not any(protected[b, d] for d in dst)  # protected tokens stay exactly as computed
        assert len(set(src)) == len(src) and set(src) <= set(real)  # padding is never removed/merged
        assert kept == sorted(kept) and set(kept) == set(real) - set(src)  # order kept, nothing else lost
        assert plan.keep_mask[b].tolist() == [False] * (M - len(kept)) + [True] * len(kept)  # right-aligned
        assert set(protected[b].nonzero().flatten().tolist()) <= set(kept)  # protected survive
        if sel == "front":  # only the oldest 2r unprotected tokens are candidates (r: the documented count)
            window = [p for p in real if not protected[b, p]][: 2 * documented_num_to_remove(n, keep, pairs)]
            assert set(src) <= set(window)
        if sel == "blocks":  # whole blocks of PREFILTER_BLOCK real tokens, scored by their most important token, go first
            imp = documented_importance(h[b, real], c["metric"], None if scores is None else scores[b, real])
            block = [max(imp[i - i % PREFILTER_BLOCK:i - i % PREFILTER_BLOCK + PREFILTER_BLOCK].tolist())
                     for i in range(n)]
            gone = [block[real.index(p)] for p in src]
            stay = [block[i] for i, p in enumerate(real) if p in kept and not protected[b, p]]
            assert not gone or not stay or max(gone) <= min(stay), (gone, stay)
        if pairs:
            assert set(dst) <= set(kept)  # merges go into surviving real tokens only
            assert plan.keep[b][plan.dst_slot[b][ok]].tolist() == dst
        # batch invariance of the plan: the row alone (padding dropped) makes the same row-local choice
        alone = make_plan(h[b : b + 1, real], torch.ones(1, n, dtype=torch.bool), protected[b : b + 1, real], keep,
                          sel, c["metric"], pairs, None if scores is None else scores[b : b + 1, real], receive)
        local = {p: i for i, p in enumerate(real)}
        pairs_here = [(local[s], local[d]) for s, d in zip(src, dst)]
        if alone is None:
            assert pairs_here == []
        else:
            oka = alone.src_mask[0]
            assert pairs_here == list(zip(alone.src[0][oka].tolist(), alone.dst[0][oka].tolist()))
    assert M == max(kept_counts)
    removed = [int(plan.src_mask[b].sum()) for b in range(c["B"])]
    if c["every_row"] and receive:
        assert all(r > 0 for r in removed), removed  # the strategy promised it: every row loses tokens
    event(f"rows removing tokens: {'all' if all(removed) else 'some'}")
    boundary = any(documented_merge_count(r, c["q"]) != math.floor(r * (1 - c["q"])) for r in removed)
    event(f"q on a rounding boundary for a row: {boundary}")

    # apply_plan against the slow per-row reference, and merge weights summing to one
    strategies = ["prune", "merge", "hybrid", "hybrid_channel"] if pairs else ["prune"]
    x = torch.randn(c["B"], c["N"], 5, generator=g)
    const = torch.where(mask[..., None], torch.tensor(2.5), 100 * torch.randn(c["B"], c["N"], 5, generator=g))
    for strategy in strategies:
        out = apply_plan(x, plan, strategy, c["q"])
        flat = apply_plan(const, plan, strategy, c["q"])
        for b in range(c["B"]):
            real = mask[b].nonzero().flatten().tolist()
            local = {p: i for i, p in enumerate(real)}
            ok = plan.src_mask[b]
            prs = [(local[s], local[d]) for s, d in zip(plan.src[b][ok].tolist(), plan.dst[b][ok].tolist())]
            scores = plan.src_score[b][ok].tolist()
            xr = x[b, real]
            ref = slow_apply(xr, prs, slow_weights(strategy, prs, scores, xr, c["q"]))
            got = out[b][plan.keep_mask[b]]
            assert torch.allclose(got, ref, atol=1e-5), (strategy, b)
            assert (out[b][~plan.keep_mask[b]] == 0).all()
            # a constant sequence stays constant: weights sum to one per destination, padding never leaks in
            assert torch.allclose(flat[b][plan.keep_mask[b]], torch.tensor(2.5), atol=1e-5), (strategy, b)


# ============================================================================ 6. full model forwards


@st.composite
def model_cases(draw, method):
    B = draw(st.integers(1, 4))
    every_row = draw(st.booleans())  # every row long enough that the first anchor removes from it
    return dict(
        family=draw(st.sampled_from(["mamba", "mamba2"])),
        cfg=draw(configs(max_keep=0.9, method=method)),
        lengths=draw(st.lists(st.integers(9, 16) if every_row else st.one_of(st.integers(9, 16), st.integers(1, 16)),
                              min_size=B, max_size=B)),
        side=draw(st.sampled_from(["left", "right"])),
        protect=0.0 if every_row else draw(st.sampled_from([0.0, 0.0, 0.3])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@pytest.mark.parametrize("method", sorted(METHODS))
@fast(15)
@given(data=st.data())
def test_model_forward_properties(method, data):
    c = data.draw(model_cases(method))
    model, cfg = model_for(c["family"]), c["cfg"]
    hf_tokred.apply_token_reduction(model, cfg)
    sched = cfg.resolve(LAYERS)
    spec = cfg.spec
    rows = random_rows(c["seed"], c["lengths"])
    ids, mask = pad_rows(rows, c["side"])
    g = torch.Generator().manual_seed(c["seed"] + 1)
    protected = mask.bool() & (torch.rand(ids.shape, generator=g) < c["protect"])
    note(f"cfg={cfg} schedule={sched}")
    with torch.no_grad():
        out = model(ids, attention_mask=mask, protected_mask=protected)
    by_layer = dict(out.plans)
    assert list(by_layer) == sorted(by_layer) and set(by_layer) <= set(sched.anchors)
    N = ids.shape[1]
    positions = torch.arange(N).expand(len(rows), N)
    live = [mask[b].nonzero().flatten().tolist() for b in range(len(rows))]  # real positions still present
    for anchor in sched.anchors:
        plan = by_layer.get(anchor)
        for b in range(len(rows)):
            prot = set(protected[b].nonzero().flatten().tolist()) | {live[b][-1]}
            want = expected_removed(len(live[b]), [p in prot for p in live[b]], sched.keep_ratio, spec.selection,
                                    spec.pairs, spec.protected_receive)
            if plan is None:
                assert want == 0, (anchor, b)
                continue
            assert int(plan.src_mask[b].sum()) == want, (anchor, b)
        if plan is not None:
            positions = positions.gather(1, plan.keep).masked_fill(~plan.keep_mask, -1)
            live = [[p for p in positions[b].tolist() if p >= 0] for b in range(len(rows))]
    event(f"plans={len(out.plans)}")
    if out.plans:
        first = out.plans[0][1]
        event(f"rows removing at the first anchor: {'all' if bool((first.num_removed > 0).all()) else 'some'}")
    event(f"q={'0.5' if cfg.q == 0.5 else 'other'}, hidden={cfg.hidden}")
    for b, row in enumerate(rows):
        kept = kept_positions(out, b)
        if out.plans:
            assert kept == live[b] == sorted(kept)  # order preserved, exactly the planned survivors
            assert set(kept) <= set(mask[b].nonzero().flatten().tolist())  # padding is never computed
        else:  # nothing reduced: every position is computed, as in stock
            assert kept == list(range(N))
        assert set(protected[b].nonzero().flatten().tolist()) <= set(kept)  # protected survive
        real = mask[b].nonzero().flatten()
        ref, _ = slow_forward_any_dtype(model, ids[b, real], row_local_plans(out.plans, mask, b),
                                        *branch_strategies(cfg), cfg.q)
        kept_real = [p for p in kept if mask[b, p]]
        assert torch.allclose(out.logits[b, kept_real], ref, atol=ATOL, rtol=0), b
        with torch.no_grad():
            alone = model(row[None], protected_mask=protected[b, real][None])
        assert_close_where_computed(out.logits[b, real], alone.logits[0], what=f"row {b} alone vs in batch")
        if not out.plans:
            with torch.no_grad():
                stock = stock_forward(model, row[None]).logits[0]
            assert torch.allclose(alone.logits[0], stock, atol=ATOL, rtol=0)


@pytest.mark.parametrize("method", sorted(METHODS))
@fast(5)
@given(data=st.data(), family=st.sampled_from(["mamba", "mamba2"]),
       lengths=st.lists(st.integers(1, 12), min_size=2, max_size=3), seed=st.integers(0, 2**31 - 1))
def test_generation_batch_invariance_property(method, data, family, lengths, seed):
    cfg = data.draw(configs(method=method))
    model = model_for(family)
    hf_tokred.apply_token_reduction(model, cfg)
    model.generation_config.eos_token_id = None
    rows = random_rows(seed, lengths)
    ids, mask = pad_rows(rows, "left")
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    batch = model.generate(ids, attention_mask=mask, **kw)
    for b, row in enumerate(rows):
        alone = model.generate(row[None], **kw)
        assert torch.equal(batch[b, ids.shape[1] :], alone[0, len(row) :]), b
