"""Property-based tests (hypothesis): random configs x random shapes x random padding.

Reproducible in CI: every test is ``derandomize=True`` (examples are derived from the test itself, not from a
random seed) and all tensors come from seeded ``torch.Generator``s whose seeds hypothesis draws.  Run with
``--hypothesis-show-statistics`` to see how many examples each test ran (and the ``event`` breakdown).

Oracles: ``hf_tokred.reduce.num_to_remove`` (the documented schedule, named by the issue) limited by the tokens a
selection may not take (``robust_helpers.expected_removed``), the slow per-row reference, the row run alone,
stock transformers, exact integer arithmetic, and JSON / save_pretrained round trips.
"""

import functools
import json
import tempfile

import torch
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import hf_tokred
from hf_tokred import METHODS, METRICS, STRATEGIES, TokenReductionConfig
from hf_tokred.config import proxy_flops_reduction
from hf_tokred.reduce import apply_plan, make_plan, num_to_remove

from conftest import stock_forward, tiny_model
from robust_helpers import (
    ATOL,
    assert_close_where_computed,
    expected_removed,
    kept_positions,
    pad_rows,
    random_rows,
    row_local_plans,
    slow_forward_any_dtype,
)
from slow_reference import slow_apply, slow_weights

LAYERS = 4


def fast(n):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.lru_cache(maxsize=None)
def model_for(family):
    return tiny_model(family, layers=LAYERS)


# ============================================================================ strategies


@st.composite
def configs(draw, layers=LAYERS, max_keep=1.0):
    """Any valid TokenReductionConfig, over every field; with ``layers`` it also fits a model of that depth."""
    method = draw(st.sampled_from(sorted(METHODS)))
    spec = METHODS[method]
    min_keep = 0.5 if spec.pairs else 0.0
    if spec.selection == "importance":  # EViT can only prune
        hidden = draw(st.sampled_from([None, "prune"]))
        residual = draw(st.sampled_from([None, "prune"]))
    else:
        hidden = draw(st.sampled_from([None, *sorted(STRATEGIES)]))
        residual = draw(st.sampled_from([None, *sorted(STRATEGIES)]))
    if layers is None:
        anchors = draw(st.one_of(st.none(), st.lists(st.integers(0, 10**6), min_size=1, max_size=8, unique=True)
                                 .map(sorted).map(tuple)))
    else:
        anchors = draw(st.one_of(st.none(), st.lists(st.integers(0, layers - 1), min_size=1, max_size=layers,
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
    return TokenReductionConfig(
        method=method, anchors=anchors, metric=draw(st.sampled_from(sorted(METRICS))),
        q=draw(st.floats(min_value=0.0, max_value=1.0)), hidden_strategy=hidden, residual_strategy=residual, **kw,
    )


# ============================================================================ 5. round trips


@fast(200)
@given(cfg=configs(layers=None))
def test_config_round_trips_through_json(cfg):
    d = cfg.to_dict()
    assert set(d) == {"method", "flops_reduction", "keep_ratio", "anchors", "metric", "q", "hidden_strategy",
                      "residual_strategy"}  # every field, always
    again = TokenReductionConfig.from_dict(json.loads(json.dumps(d)))
    assert again == cfg and again.to_dict() == d
    assert TokenReductionConfig.coerce(d) == cfg
    event(f"method={cfg.method}")


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
    assert int(num_to_remove(torch.tensor([n]), keep, pairs)[0]) == expect


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


@fast(100)
@given(n=st.integers(1, 50), keep=st.floats(min_value=0.0, max_value=1e-6, exclude_min=True))
def test_tiny_keep_ratio_never_empties_a_row(n, keep):
    """TokenReductionConfig accepts any keep_ratio in (0, 1] for EViT; n - ceil(n * keep) <= n - 1 for them all."""
    TokenReductionConfig(method="evit", keep_ratio=keep)  # accepted
    assert int(num_to_remove(torch.tensor([n]), keep, False)[0]) <= n - 1


# ============================================================================ 6. make_plan / apply_plan directly


@st.composite
def plan_cases(draw):
    B = draw(st.integers(1, 5))
    N = draw(st.integers(1, 24))
    selection = draw(st.sampled_from(["importance_similarity", "bipartite", "reference", "importance"]))
    pairs = selection != "importance"
    return dict(
        B=B, N=N, D=draw(st.integers(1, 8)), selection=selection, pairs=pairs,
        layout=draw(st.sampled_from(["left", "right", "holes", "full"])),
        lengths=draw(st.lists(st.integers(0, N), min_size=B, max_size=B)),
        keep=draw(st.floats(min_value=0.5 if pairs else 0.01, max_value=1.0)),
        metric=draw(st.sampled_from(sorted(METRICS))),
        values=draw(st.sampled_from(["normal", "ties"])),
        protect=draw(st.sampled_from([0.0, 0.2, 0.6, 1.0])),
        q=draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])),
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
    protected = mask & (torch.rand(B, N, generator=g) < c["protect"])
    return h, mask, protected, g


@fast(200)
@given(c=plan_cases())
def test_make_plan_invariants(c):
    h, mask, protected, g = build_plan_inputs(c)
    sel, pairs, keep = c["selection"], c["pairs"], c["keep"]
    plan = make_plan(h, mask, protected, keep, sel, c["metric"], pairs)
    n_real = mask.sum(1)
    if int(num_to_remove(n_real, keep, pairs).max()) == 0:
        assert plan is None
        event("no plan")
        return
    assert plan is not None
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
        assert len(src) == expected_removed(n, plocal, keep, sel, pairs), (b, n, sum(plocal))
        assert len(set(src)) == len(src) and set(src) <= set(real)  # padding is never removed/merged
        assert kept == sorted(kept) and set(kept) == set(real) - set(src)  # order kept, nothing else lost
        assert plan.keep_mask[b].tolist() == [False] * (M - len(kept)) + [True] * len(kept)  # right-aligned
        assert set(protected[b].nonzero().flatten().tolist()) <= set(kept)  # protected survive
        if pairs:
            assert set(dst) <= set(kept)  # merges go into surviving real tokens only
            assert plan.keep[b][plan.dst_slot[b][ok]].tolist() == dst
        # batch invariance of the plan: the row alone (padding dropped) makes the same row-local choice
        alone = make_plan(h[b : b + 1, real], torch.ones(1, n, dtype=torch.bool), protected[b : b + 1, real], keep,
                          sel, c["metric"], pairs)
        local = {p: i for i, p in enumerate(real)}
        pairs_here = [(local[s], local[d]) for s, d in zip(src, dst)]
        if alone is None:
            assert pairs_here == []
        else:
            oka = alone.src_mask[0]
            assert pairs_here == list(zip(alone.src[0][oka].tolist(), alone.dst[0][oka].tolist()))
    assert M == max(kept_counts)
    event(f"selection={sel}")

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
def model_cases(draw):
    B = draw(st.integers(1, 4))
    return dict(
        family=draw(st.sampled_from(["mamba", "mamba2"])),
        cfg=draw(configs(max_keep=0.9)),
        lengths=draw(st.lists(st.one_of(st.integers(9, 16), st.integers(1, 16)), min_size=B, max_size=B)),
        side=draw(st.sampled_from(["left", "right"])),
        protect=draw(st.sampled_from([0.0, 0.0, 0.3])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@fast(50)
@given(c=model_cases())
def test_model_forward_properties(c):
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
                                    spec.pairs)
            if plan is None:
                assert want == 0, (anchor, b)
                continue
            assert int(plan.src_mask[b].sum()) == want, (anchor, b)
        if plan is not None:
            positions = positions.gather(1, plan.keep).masked_fill(~plan.keep_mask, -1)
            live = [[p for p in positions[b].tolist() if p >= 0] for b in range(len(rows))]
    event(f"plans={len(out.plans)}")
    for b, row in enumerate(rows):
        kept = kept_positions(out, b)
        if out.plans:
            assert kept == live[b] == sorted(kept)  # order preserved, exactly the planned survivors
            assert set(kept) <= set(mask[b].nonzero().flatten().tolist())  # padding is never computed
        else:  # nothing reduced: every position is computed, as in stock
            assert kept == list(range(N))
        assert set(protected[b].nonzero().flatten().tolist()) <= set(kept)  # protected survive
        real = mask[b].nonzero().flatten()
        ref, _ = slow_forward_any_dtype(model, ids[b, real], row_local_plans(out.plans, mask, b), cfg.hidden,
                                        cfg.residual, cfg.q)
        kept_real = [p for p in kept if mask[b, p]]
        assert torch.allclose(out.logits[b, kept_real], ref, atol=ATOL, rtol=0), b
        with torch.no_grad():
            alone = model(row[None], protected_mask=protected[b, real][None])
        assert_close_where_computed(out.logits[b, real], alone.logits[0], what=f"row {b} alone vs in batch")
        if not out.plans:
            with torch.no_grad():
                stock = stock_forward(model, row[None]).logits[0]
            assert torch.allclose(alone.logits[0], stock, atol=ATOL, rtol=0)


@fast(8)
@given(family=st.sampled_from(["mamba", "mamba2"]), cfg=configs(),
       lengths=st.lists(st.integers(1, 12), min_size=2, max_size=3), seed=st.integers(0, 2**31 - 1))
def test_generation_batch_invariance_property(family, cfg, lengths, seed):
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
