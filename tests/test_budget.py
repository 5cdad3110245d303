"""The token budget (``keep_tokens``): its schedule by hand, a slow per-row implementation of it written from the
definition, batches, generation, saved settings and the errors a user can meet."""

import json
import logging
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_tokred
from conftest import stock_forward, stock_transformers, tiny_model
from hf_tokred import TokenReductionConfig, record_reduction
from hf_tokred.schedule import budget_removal_count
from robust_helpers import pad_rows, random_rows

ATOL = 1e-5


# ----------------------------------------------------------------------------- the schedule, by hand


@pytest.mark.parametrize("n,k,anchors,expected", [
    (2048, 128, 1, [128]),
    (2048, 128, 3, [813, 323, 128]),  # 2048 (1/16)^(1/3) = 812.7 -> 813; sqrt(813 * 128) = 322.6 -> 323; 128
    (1152, 128, 2, [384, 128]),  # sqrt(1152 * 128) = 384 exactly: no float noise may push it to 385
    (100, 128, 2, [100, 100]),  # at most K tokens: not reduced
    (129, 128, 1, [128]),
])
def test_budget_lengths_by_hand(n, k, anchors, expected):
    kept, cur = [], n
    for j in range(anchors):
        cur -= budget_removal_count(cur, k, anchors - j, pairs=False)
        kept.append(cur)
    assert kept == expected
    s = TokenReductionConfig(keep_tokens=k, method="front_prune", anchors=list(range(anchors))).resolve(anchors + 1)
    assert s.layer_lengths(n)[1:] == expected
    # the long-context default re-runs each anchor on what it keeps: the anchor computes its input and its output
    s = TokenReductionConfig(keep_tokens=k, anchors=list(range(anchors))).resolve(anchors + 1)
    inputs = [n] + expected[:-1]
    assert s.layer_lengths(n) == [i + o if o < i else i for i, o in zip(inputs, expected)] + [expected[-1]]


def test_pairing_cap_and_the_error_that_names_the_fix():
    assert budget_removal_count(1000, 100, 1, pairs=True) == 500  # at most half
    s = TokenReductionConfig(method="utrc", keep_tokens=100, anchors=[0, 1]).resolve(4)
    assert s.layer_lengths(1000) == [1000, 500, 250, 250]
    with pytest.raises(ValueError, match=r"keep_tokens=100 cannot be met on a 1000-token prompt.*more anchors"):
        s.check_budget([1000, 20])
    s.check_budget([400])  # 400 -> 200 -> 100: reachable


def test_defaults_of_a_budget():
    cfg = TokenReductionConfig(keep_tokens=64)
    assert cfg.method == hf_tokred.config.LONG_CONTEXT_METHOD
    assert cfg.resolve(8).anchors == (0,)
    assert cfg.resolve(8, ssm_layers=[2, 3, 5, 6]).anchors == (2,)  # a hybrid: its first SSM layer
    s = cfg.resolve(8)
    assert s.keep_ratio is None and s.keep_tokens == 64
    assert s.flops_reduction == pytest.approx(7 / 8)  # the limit: only block 0 sees the whole prompt
    assert TokenReductionConfig(keep_tokens=64, method="evit").method == "evit"
    assert TokenReductionConfig(flops_reduction=0.2).method == hf_tokred.config.DEFAULT_METHOD


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(keep_tokens=0), ValueError, "positive int"),
    (dict(keep_tokens=2.5), TypeError, "positive int"),
    (dict(keep_tokens=True), TypeError, "positive int"),
    (dict(keep_tokens=8, keep_ratio=0.5), ValueError, "exactly one of"),
    (dict(keep_tokens=8, flops_reduction=0.2), ValueError, "exactly one of"),
    (dict(), ValueError, "keep_tokens"),
    (dict(keep_tokens=8, match_window=-1), ValueError, "match_window"),
    (dict(keep_tokens=8, match_window=64), ValueError, "no effect"),  # front_prune matches nothing
])
def test_bad_budget_settings(kwargs, error, match):
    with pytest.raises(error, match=match):
        TokenReductionConfig(**kwargs)


def test_budget_round_trips_through_json():
    cfg = TokenReductionConfig(keep_tokens=300, anchors=[0, 2], protect_recent=0.1)
    assert TokenReductionConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


# ----------------------------------------------------------------------------- a slow implementation


def slow_budget_row(model, ids, k, anchors, protected_last=1, question=0):
    """One unpadded row through stock transformers, reduced as the budget is defined: at each anchor (``m`` of
    them left) the row is brought to ``max(K, ceil(n (K/n)^(1/m)))`` tokens (``K`` at the last), pruning the least
    important unprotected tokens (clipped mixer output, earlier first on ties) from both branches; the last token
    and the question (the last ``question`` tokens) are protected.  Returns (logits of kept tokens, positions)."""
    backbone = model.backbone
    positions = list(range(len(ids)))
    with torch.no_grad(), stock_transformers():
        x = backbone.embeddings(ids[None])
        for i, block in enumerate(backbone.layers):
            if i not in anchors:
                x = block(x)
                continue
            left = len(anchors) - anchors.index(i)
            n = x.shape[1]
            target = n if n <= k else max(k, math.ceil(k * (n / k) ** ((left - 1) / left) - 1e-9))
            residual = x.float() if block.residual_in_fp32 else x
            h = block.mixer(block.norm(x))
            score = h[0].float().clamp_min(0).mean(-1).tolist()
            protected = set(range(n - max(protected_last, question), n))
            order = sorted((j for j in range(n) if j not in protected), key=lambda j: (score[j], j))
            drop = set(order[: n - target])
            keep = [j for j in range(n) if j not in drop]
            x = (residual + h)[:, keep]
            positions = [positions[j] for j in keep]
        return model.lm_head(backbone.norm_f(x))[0].float(), positions


@pytest.mark.parametrize("anchors", [[0], [0, 2], [1, 2, 3]])
def test_budget_equals_the_slow_row_implementation(family, anchors):
    model = tiny_model(family)
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(method="evit", keep_tokens=12, anchors=anchors))
    lengths = [40, 12, 9, 25]
    rows = random_rows(3, lengths)
    ids, mask = pad_rows(rows, "left")
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    for b, row in enumerate(rows):
        ref_logits, ref_pos = slow_budget_row(model, row, 12, anchors)
        offset = ids.shape[1] - len(row)
        kept = [p - offset for p in out.kept_positions[b].tolist() if p >= 0]
        assert kept == ref_pos, f"row {b}"
        got = out.logits[b, [p + offset for p in ref_pos]]
        torch.testing.assert_close(got, ref_logits, atol=ATOL, rtol=0)
        assert len(kept) == min(len(row), 12)


def test_front_prune_budget_with_a_question_equals_the_slow_row(family):
    model = tiny_model(family)
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_tokens=10, method="front_prune"))
    row = random_rows(5, [48])[0]
    with torch.no_grad():
        out = model(row[None], question_length=6)
    ref_logits, ref_pos = slow_budget_row(model, row, 10, [0], question=6)  # 2r >= n: the window is every token
    assert out.kept_positions[0].tolist() == ref_pos
    assert ref_pos[-6:] == list(range(42, 48))
    torch.testing.assert_close(out.logits[0, ref_pos], ref_logits, atol=ATOL, rtol=0)


def test_prompts_within_the_budget_are_the_stock_model(family):
    model = tiny_model(family)
    ids = torch.randint(2, 96, (2, 16))
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_tokens=16))
    with torch.no_grad(), record_reduction() as rec:
        out = model(ids)
        ref = stock_forward(model, ids)
    assert out.plans == () and rec[0].layer_lengths[0] == [16] * 6
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-6, rtol=0)


def test_generation_with_a_budget_is_cache_exact(family):
    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_tokens=8, anchors=[0, 3]))
    ids = torch.randint(2, 96, (1, 30))
    with record_reduction() as rec:
        a = model.generate(ids, max_new_tokens=6, do_sample=False)
    b = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(a, b)
    assert rec[0].layer_lengths[0][4:] == [8, 8]


def test_more_protected_tokens_than_the_budget_warn(family, caplog):
    model = tiny_model(family)
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_tokens=4))
    with caplog.at_level(logging.WARNING, logger="hf_tokred"), torch.no_grad():
        out = model(torch.randint(2, 96, (1, 20)), question_length=7)
    assert int(out.computed_mask.sum()) == 7  # every question token, nothing else
    assert "keep_tokens=4 was exceeded (7 tokens kept in 1 row(s))" in caplog.text


def test_pairing_method_that_cannot_meet_the_budget_is_refused_at_forward(family):
    model = tiny_model(family)
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(method="utrc", keep_tokens=4, anchors=[0]))
    with pytest.raises(ValueError, match="cannot be met on a 20-token prompt"):
        model(torch.randint(2, 96, (1, 20)))


def test_budget_survives_save_and_reload(tmp_path, family):
    model = tiny_model(family)
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_tokens=10, anchors=[0, 1]))
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["token_reduction"]["keep_tokens"] == 10
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(2, 96, (1, 30))
    with torch.no_grad():
        assert torch.equal(again(ids).kept_positions, model(ids).kept_positions)
        assert again(ids).kept_positions.shape[1] == 10
