"""TokenReductionConfig: schedules against the paper's table, and every bad input raising a clear error."""

import math

import pytest

import hf_tokred
from hf_tokred import TokenReductionConfig, default_anchors
from hf_tokred.config import DEFAULT_MATCH_WINDOW
from hf_tokred.config import schedule_proxy_reduction as proxy_flops_reduction

# method.md b.4: per-anchor keep ratios for 10/20/30 % FLOPs reduction.
PAPER = {
    64: ((12, 17, 22, 27, 32, 37, 42), (0.9729, 0.9415, 0.9043)),
    48: ((10, 15, 20, 25, 30, 35), (0.9651, 0.9248, 0.8768)),
}


@pytest.mark.parametrize("layers", [48, 64])
@pytest.mark.parametrize("i,target", [(0, 0.1), (1, 0.2), (2, 0.3)])
def test_solved_keep_ratio_matches_paper_table(layers, i, target):
    anchors, ratios = PAPER[layers]
    s = TokenReductionConfig(flops_reduction=target).resolve(layers)
    assert s.anchors == anchors
    assert abs(s.keep_ratio - ratios[i]) < 1e-3
    assert abs(s.flops_reduction - target) < 1e-9
    assert s.to_dict()["anchors"] == list(anchors)


def test_proxy_flops_hand_computed():
    # 4 layers, reduce after layer 1 keeping half: layers process 1, 1, .5, .5 -> 25 % saved.
    assert proxy_flops_reduction(4, [1], 0.5) == pytest.approx(0.25)
    # code default 0.905 on the 64-layer anchors is the paper's "30 %" setting (29.8 %).
    assert proxy_flops_reduction(64, PAPER[64][0], 0.905) == pytest.approx(0.298, abs=1e-3)


def test_default_anchor_rule_for_other_depths():
    # 24 layers: 64-layer anchors scaled by 24/64 and rounded half up.
    assert default_anchors(24) == (5, 6, 8, 10, 12, 14, 16)
    assert default_anchors(12) == (2, 3, 4, 5, 6, 7, 8)
    assert default_anchors(2) == (0,)
    for layers in range(2, 80):
        a = default_anchors(layers)
        assert list(a) == sorted(set(a)) and a and a[-1] <= layers - 2


def test_explicit_anchors_and_keep_ratio_are_used_as_given():
    s = TokenReductionConfig(anchors=[1, 3], keep_ratio=0.8).resolve(6)
    assert (s.anchors, s.keep_ratio) == ((1, 3), 0.8)
    # flops target with custom anchors (paper Table 4 alternative: [20..50] at 20 % -> 0.9223)
    s = TokenReductionConfig(anchors=list(range(20, 51, 5)), flops_reduction=0.2).resolve(64)
    assert abs(s.keep_ratio - 0.9223) < 1e-3


def test_zero_flops_is_identity():
    assert TokenReductionConfig(flops_reduction=0.0).resolve(24).keep_ratio == 1.0


def test_round_trip_dict():
    cfg = TokenReductionConfig(method="tome", keep_ratio=0.75, anchors=[2, 4], metric="l2", q=0.25,
                               hidden_strategy="hybrid", residual_strategy="prune")
    d = cfg.to_dict()
    assert d["anchors"] == [2, 4] and isinstance(d["anchors"], list)
    assert TokenReductionConfig.from_dict(d) == cfg


@pytest.mark.parametrize(
    "kwargs,exc,needle",
    [
        (dict(method="pumer", flops_reduction=0.1), ValueError, "method"),
        (dict(method=3, flops_reduction=0.1), ValueError, "method"),
        (dict(metric="cosine", flops_reduction=0.1), ValueError, "metric"),
        (dict(keep_ratio=0.0), ValueError, "keep_ratio"),
        (dict(keep_ratio=1.5), ValueError, "keep_ratio"),
        (dict(method="utrc", keep_ratio=0.3), ValueError, "at most half"),
        (dict(keep_ratio=0.9, q=0.3), ValueError, "q=0.3 would have no effect"),  # the default prunes only
        (dict(method="evit", keep_ratio=0.9, q=0.8, residual_strategy="merge"), ValueError, "uses prune / merge"),
        (dict(keep_ratio=math.nan), ValueError, "keep_ratio"),
        (dict(keep_ratio="0.9"), TypeError, "keep_ratio"),
        (dict(keep_ratio=True), TypeError, "keep_ratio"),
        (dict(flops_reduction=1.0), ValueError, "flops_reduction"),
        (dict(flops_reduction=-0.1), ValueError, "flops_reduction"),
        (dict(flops_reduction=0.1, keep_ratio=0.9), ValueError, "exactly one"),
        (dict(), ValueError, "needs a reduction level, exactly one of flops_reduction .* none is given"),
        (dict(keep_ratio=0.9, q=1.5), ValueError, "q"),
        (dict(keep_ratio=0.9, q=-0.1), ValueError, "q"),
        (dict(keep_ratio=0.9, anchors=[3, 1]), ValueError, "strictly increasing"),
        (dict(keep_ratio=0.9, anchors=[1, 1]), ValueError, "strictly increasing"),
        (dict(keep_ratio=0.9, anchors=[-1, 2]), ValueError, "non-negative"),
        (dict(keep_ratio=0.9, anchors=[1.0]), TypeError, "anchors"),
        (dict(keep_ratio=0.9, anchors="1,2"), TypeError, "anchors"),
        (dict(keep_ratio=0.9, anchors=[]), ValueError, "anchors"),
        (dict(keep_ratio=0.9, hidden_strategy="drop"), ValueError, "hidden_strategy"),
        (dict(keep_ratio=0.9, protect_recent=1.0), ValueError, "protect_recent"),
        (dict(keep_ratio=0.9, metric="deltas"), ValueError, "metric"),
    ],
)
def test_bad_settings_name_the_field(kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        TokenReductionConfig(**kwargs)


def test_evit_allows_removing_more_than_half():
    assert TokenReductionConfig(method="evit", keep_ratio=0.3).keep_ratio == 0.3


@pytest.mark.parametrize("method, keep_ratio, interval", [
    ("evit", 0.0, r"\(0, 1\], got 0.0"), ("evit", 1.5, r"\(0, 1\], got 1.5"),  # removal only: any share
    ("utrc", 0.4, r"\[0.5, 1\] \(method 'utrc' pairs"),  # pairs: an anchor removes at most half
])
def test_keep_ratio_error_states_the_methods_own_interval(method, keep_ratio, interval):
    with pytest.raises(ValueError, match=f"keep_ratio must be in {interval}"):
        TokenReductionConfig(method=method, keep_ratio=keep_ratio)


def test_bad_schedules_for_a_depth():
    with pytest.raises(ValueError, match="reach outside a 6-layer model"):
        TokenReductionConfig(anchors=[2, 6], keep_ratio=0.9).resolve(6)
    with pytest.raises(ValueError, match="flops_reduction=0.9 is not reachable for a 24-layer model"):
        TokenReductionConfig(flops_reduction=0.9).resolve(24)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        TokenReductionConfig(flops_reduction=0.1).resolve(0)


def test_unknown_keys_in_a_saved_block_are_rejected():
    with pytest.raises(ValueError, match=r"unknown token_reduction field\(s\) \['ratio'\]"):
        TokenReductionConfig.from_dict({"method": "utrc", "ratio": 0.9})
    with pytest.raises(TypeError, match="dict"):
        TokenReductionConfig.coerce([("method", "utrc")])


def test_explicit_anchors_must_sit_on_the_ssm_layers_of_a_hybrid():
    """``resolve(..., ssm_layers=...)``: an explicit anchor on a non-SSM layer is refused naming it and the SSM
    layers; anchors all on SSM layers resolve as given; pure models (no ``ssm_layers``) take any layer."""
    ssm = [0, 1, 3, 4, 5, 7]
    with pytest.raises(ValueError, match=r"layer\(s\) \[2\] of this hybrid model are not SSM layers.*\[0, 1, 3, 4, 5, 7\]"):
        TokenReductionConfig(keep_ratio=0.9, anchors=[1, 2]).resolve(8, ssm_layers=ssm)
    assert TokenReductionConfig(keep_ratio=0.9, anchors=[1, 3]).resolve(8, ssm_layers=ssm).anchors == (1, 3)
    assert TokenReductionConfig(keep_ratio=0.9, anchors=[1, 2]).resolve(8).anchors == (1, 2)


def test_settings_written_by_0_3_0_load_with_its_stored_window():
    """hf_tokred 0.3.0 stored its default match_window (1024) with every method; on a method that matches
    nothing it is dropped (not refused), while a matching method keeps the window it was saved with."""
    old = {"method": "front_prune", "flops_reduction": 0.2, "match_window": 1024, "version": "0.3.0"}
    assert TokenReductionConfig.from_dict(old).match_window == DEFAULT_MATCH_WINDOW
    assert TokenReductionConfig.from_dict({**old, "method": "utrc"}).match_window == 1024
    with pytest.raises(ValueError, match="would have no effect"):  # written now: an explicit window is refused
        TokenReductionConfig.from_dict({**old, "version": hf_tokred.__version__})
