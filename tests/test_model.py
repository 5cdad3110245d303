"""Token reduction inside transformers' Mamba / Mamba-2: equality with stock, generation, loss, errors."""

import pytest
import torch
from transformers import pipeline

import hf_tokred
from hf_tokred import TokenReductionConfig

from conftest import stock_forward, tiny_model, word_tokenizer
from robust_helpers import METHOD_STRATEGIES, branch_strategies
from slow_reference import row_plans, slow_forward

ATOL = 1e-5


def batch(seed=0, lengths=(20, 13), vocab=96):
    """Left-padded batch of random token ids (ids >= 2 so no pad/eos inside)."""
    g = torch.Generator().manual_seed(seed)
    N = max(lengths)
    ids = torch.zeros(len(lengths), N, dtype=torch.long)
    mask = torch.zeros(len(lengths), N, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, N - n :] = torch.randint(2, vocab, (n,), generator=g)
        mask[b, N - n :] = 1
    return ids, mask


def reduced(model, **settings):
    return hf_tokred.apply_token_reduction(model, TokenReductionConfig(**settings))


# ----------------------------------------------------------------------------- 1. identity when nothing is reduced


@pytest.mark.parametrize("use_cache", [False, True])
def test_keep_ratio_one_equals_stock(model, use_cache):
    ids, mask = batch()
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        ref = stock_forward(model, ids, attention_mask=mask, labels=labels, use_cache=use_cache)
        reduced(model, keep_ratio=1.0, anchors=[1, 3])
        out = model(ids, attention_mask=mask, labels=labels, use_cache=use_cache)
    assert out.plans == ()
    assert torch.allclose(out.logits, ref.logits, atol=ATOL, rtol=0)
    assert torch.allclose(out.loss, ref.loss, atol=ATOL)
    assert out.computed_mask.all()
    assert (out.cache is None) == (not use_cache)


def test_flops_zero_and_short_inputs_generate_like_stock(model):
    ids, mask = batch(1)
    model.generation_config.eos_token_id = None
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    reduced(model, flops_reduction=0.0)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0), stock)
    reduced(model, keep_ratio=1.0)
    no_cache = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(no_cache, stock)


# ----------------------------------------------------------------------------- 2/4. what survives, logits, loss


METHOD_Q = [(m, 0.5) for m in sorted(METHOD_STRATEGIES)] + [  # q != 0.5: the prune and merge shares differ
    ("utrc", 0.2), ("utrc", 0.8), ("utrc_reference", 0.25), ("utrc_reference", 0.8)]


@pytest.mark.parametrize("method, q", METHOD_Q)
def test_reduced_logits_and_loss_match_slow_reference(model, method, q):
    ids, mask = batch(2, lengths=(24, 17))
    labels = ids.masked_fill(mask == 0, -100)
    protect = torch.zeros_like(mask, dtype=torch.bool)
    protect[0, 10] = protect[1, 20] = True
    reduced(model, method=method, keep_ratio=0.7, anchors=[1, 3], q=q)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels, protected_mask=protect)
    assert len(out.plans) == 2
    hidden, residual = METHOD_STRATEGIES[method]
    N = ids.shape[1]
    for b in range(2):
        kept = out.kept_positions[b][out.kept_positions[b] >= 0].tolist()
        assert kept == sorted(kept)  # order preserved
        assert kept[-1] == N - 1  # the last real token survives
        assert all(p in kept for p in protect[b].nonzero().flatten().tolist())
        assert out.computed_mask[b].nonzero().flatten().tolist() == kept
        real = mask[b].nonzero().flatten()
        plans = row_plans(out.plans, mask.bool(), b)
        ref = slow_forward(model, ids[b, real], plans, len(real), hidden, residual, q)
        assert torch.allclose(out.logits[b, kept], ref, atol=ATOL, rtol=0)
        dropped = [p for p in range(N) if p not in kept]
        assert torch.isnan(out.logits[b, dropped]).all()
    # loss: mean next-token cross entropy over the computed positions that have a label
    rows, cols = out.computed_mask[:, :-1].nonzero(as_tuple=True)
    targets = labels[rows, cols + 1]
    ok = targets != -100
    expect = torch.nn.functional.cross_entropy(out.logits[rows[ok], cols[ok]], targets[ok])
    assert torch.allclose(out.loss, expect, atol=ATOL)


def test_logits_to_keep_and_tuple_outputs(model):
    ids, mask = batch(3)
    reduced(model, keep_ratio=0.6, anchors=[1, 3])
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
        last = model(ids, attention_mask=mask, logits_to_keep=1)
        last3 = model(ids, attention_mask=mask, logits_to_keep=3)
        as_tuple = model(ids, attention_mask=mask, return_dict=False, use_cache=False)
    assert last.logits.shape[1] == 1 and torch.allclose(last.logits[:, 0], full.logits[:, -1], atol=ATOL)
    assert torch.allclose(last3.logits, full.logits[:, -3:], atol=ATOL, equal_nan=True)
    assert isinstance(as_tuple, tuple) and torch.allclose(as_tuple[0], full.logits, equal_nan=True)


def test_backbone_output_is_position_aligned(model):
    ids, mask = batch(4)
    reduced(model, keep_ratio=0.6, anchors=[1, 3])
    with torch.no_grad():
        lm = model(ids, attention_mask=mask)
        base = model.backbone(ids, attention_mask=mask)
    assert base.last_hidden_state.shape[:2] == ids.shape
    assert torch.equal(base.computed_mask, lm.computed_mask)
    logits = model.lm_head(base.last_hidden_state)
    assert torch.allclose(logits[lm.computed_mask], lm.logits[lm.computed_mask], atol=ATOL)


def test_inputs_embeds_equals_input_ids(model):
    ids, mask = batch(5)
    reduced(model, keep_ratio=0.7, anchors=[2])
    with torch.no_grad():
        a = model(ids, attention_mask=mask)
        b = model(inputs_embeds=model.backbone.embeddings(ids), attention_mask=mask)
    assert torch.allclose(a.logits, b.logits, equal_nan=True)


# ----------------------------------------------------------------------------- 3. generation after a reduced prefill


def check_steps(model, ids, mask, gen, settings):
    """Every decode step's logits equal a fresh forward over prompt + generated tokens with the prefill plan."""
    with torch.no_grad():
        prefill = model(ids, attention_mask=mask)
    cfg = TokenReductionConfig(**settings)
    new = gen.sequences[:, ids.shape[1] :]
    for b in range(ids.shape[0]):
        real = mask[b].nonzero().flatten()
        plans = row_plans(prefill.plans, mask.bool(), b)
        assert plans, "the prefill should have reduced"
        seq = torch.cat([ids[b, real], new[b]])
        ref = slow_forward(model, seq, plans, len(real), *branch_strategies(cfg), cfg.q)
        for t, step_logits in enumerate(gen.logits):
            assert torch.allclose(step_logits[b], ref[-len(new[b]) - 1 + t], atol=ATOL, rtol=0), (b, t)


@pytest.mark.parametrize("do_sample", [False, True])
def test_generate_after_reduced_prefill(model, do_sample):
    settings = dict(method="utrc", keep_ratio=0.6, anchors=[1, 3])
    reduced(model, **settings)
    model.generation_config.eos_token_id = None
    ids, mask = batch(6, lengths=(22, 15))
    torch.manual_seed(0)
    gen = model.generate(
        ids, attention_mask=mask, max_new_tokens=5, do_sample=do_sample, top_k=0, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True,
    )
    check_steps(model, ids, mask, gen, settings)


def test_pipeline_text_generation(model):
    tok = word_tokenizer()
    reduced(model, keep_ratio=0.6, anchors=[1, 3])
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompt = " ".join(f"w{i}" for i in range(10, 40))
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    text = pipe(prompt, max_new_tokens=6, do_sample=False)[0]["generated_text"]
    enc = tok(prompt, return_tensors="pt")
    direct = model.generate(**enc, max_new_tokens=6, do_sample=False)
    new_words = tok.decode(direct[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text == prompt + new_words  # the pipeline appends the decoded continuation to the prompt
    assert len(new_words.split()) == 6
    # ... and the reduction really happened in that generation
    with torch.no_grad():
        assert model(**enc).plans


# ----------------------------------------------------------------------------- 6. bad inputs at the model level


def test_apply_rejects_unsupported_models_and_schedules(model):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="LlamaForCausalLM with model_type='llama'"):
        hf_tokred.apply_token_reduction(llama, {"keep_ratio": 0.9})
    with pytest.raises(ValueError, match="reach outside a 6-layer model"):
        hf_tokred.apply_token_reduction(model, {"keep_ratio": 0.9, "anchors": [2, 7]})
    with pytest.raises(ValueError, match="not reachable for a 6-layer model"):
        hf_tokred.apply_token_reduction(model, {"flops_reduction": 0.8})
    with pytest.raises(ValueError, match="protected_mask must have shape"):
        reduced(model, keep_ratio=0.9)
        model(torch.ones(1, 8, dtype=torch.long), protected_mask=torch.ones(1, 4, dtype=torch.bool))


def test_computed_mask_ignores_padding_entries():
    from hf_tokred.outputs import computed_mask as _computed_mask, scatter_to_positions as _scatter_to_positions

    positions = torch.tensor([[-1, -1, 0, 3], [0, 1, 2, 3]])
    assert _computed_mask(positions, 5).tolist() == [[True, False, False, True, False], [True, True, True, True, False]]
    values = torch.arange(8.0).view(2, 4, 1)
    out = _scatter_to_positions(values, positions, 3, offset=1)  # input positions 1..3
    assert torch.equal(torch.isnan(out[..., 0]), torch.tensor([[True, True, False], [False, False, False]]))
    assert out[0, 2, 0] == 3 and out[1, :, 0].tolist() == [5.0, 6.0, 7.0]


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_compact_logits_are_the_computed_columns(family):
    """compact_logits=True returns exactly the computed logits, in kept_positions order, without NaN columns."""
    model = hf_tokred.apply_token_reduction(tiny_model(family), TokenReductionConfig(keep_ratio=0.6, anchors=[1, 3]))
    ids = torch.randint(3, model.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    with torch.no_grad():
        aligned = model(ids, attention_mask=mask)
        compact = model(ids, attention_mask=mask, compact_logits=True)
        last3 = model(ids, attention_mask=mask, compact_logits=True, logits_to_keep=3)
        labelled = model(ids, attention_mask=mask, labels=ids, compact_logits=True)
    pos = compact.kept_positions
    assert compact.logits.shape[:2] == pos.shape and pos.shape[1] < ids.shape[1]
    rows = torch.arange(2)[:, None].expand_as(pos)
    ok = pos >= 0
    torch.testing.assert_close(compact.logits[ok], aligned.logits[rows[ok], pos[ok]])
    assert bool(torch.isfinite(compact.logits[ok]).all())
    torch.testing.assert_close(last3.logits, compact.logits[:, -3:])
    with torch.no_grad():
        torch.testing.assert_close(labelled.loss, model(ids, attention_mask=mask, labels=ids).loss)
    with pytest.raises(ValueError, match="compact_logits=True takes an int logits_to_keep"):
        model(ids, compact_logits=True, logits_to_keep=torch.tensor([1, 2]))
    dense = tiny_model(family)
    with torch.no_grad():  # nothing reduced: the stock logits (every position computed)
        assert dense(ids, compact_logits=True).logits.shape == (2, 23, dense.config.vocab_size)


@pytest.mark.parametrize("method", ["utrc", "utrc_reference", "tome", "evit"])
def test_plan_is_made_from_the_anchor_mixer_output(model, method):
    """The first anchor's plan is the selection rule applied to that block's mixer output (computed here with stock
    blocks and transformers' kernels, row by row without padding): not to the block input or the branch sum."""
    from hf_tokred.reduce import make_plan

    from conftest import stock_transformers

    cfg = TokenReductionConfig(method=method, keep_ratio=0.6, anchors=[2, 4])
    hf_tokred.apply_token_reduction(model, cfg)
    ids, mask = batch(7, lengths=(22, 15))
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    assert out.plans and out.plans[0][0] == 2
    plan = out.plans[0][1]
    for b in range(2):
        real = mask[b].nonzero().flatten()
        with torch.no_grad(), stock_transformers():
            x = model.backbone.embeddings(ids[b, real][None])
            for block in model.backbone.layers[:2]:
                x = block(x)
            h = model.backbone.layers[2].mixer(model.backbone.layers[2].norm(x))
        n = len(real)
        protected = torch.zeros(1, n, dtype=torch.bool)
        protected[0, -1] = True
        want = make_plan(h, torch.ones(1, n, dtype=torch.bool), protected, 0.6, cfg.spec.selection, cfg.importance_metric,
                         cfg.spec.pairs)
        offset = ids.shape[1] - n  # left padding
        ok = plan.src_mask[b]
        got_pairs = sorted(zip((plan.src[b][ok] - offset).tolist(), (plan.dst[b][ok] - offset).tolist()))
        want_pairs = sorted(zip(want.src[0][want.src_mask[0]].tolist(), want.dst[0][want.src_mask[0]].tolist()))
        assert got_pairs and (got_pairs == want_pairs if cfg.spec.pairs else
                              [s for s, _ in got_pairs] == [s for s, _ in want_pairs]), (b, got_pairs, want_pairs)
