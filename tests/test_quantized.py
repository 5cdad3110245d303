"""Quantized weights: optimum-quanto int8 (transformers' ``QuantoConfig``, and quanto's own ``quantize`` + ``freeze``)
on Mamba and Mamba-2, against the quantized stock model and the suite's slow reference on the same weights.

* keep ratio 1.0 is the quantized stock model (transformers' own code, the same quantized modules), within the
  float rounding the unquantized test allows (hf_tokred's compiled Mamba-1 scan sums in another order);
* a reduced forward equals :func:`slow_reference.slow_forward` (stock blocks, the plans applied row by row) on the
  same quantized model, and differs from the unquantized one (so the weights really are int8);
* generate: cached and uncached greedy tokens agree, the first one is the slow reference's arg-max;
* settings: saved with the (unquantized) checkpoint or a settings-only variant, they come back when it is loaded
  quantized; stock transformers itself refuses to ``save_pretrained`` a quanto model (not serializable).
"""

import json

import pytest
import torch
from optimum.quanto import QLinear, freeze, qint8, quantize
from transformers import AutoModelForCausalLM, QuantoConfig

import hf_tokred
from hf_tokred import TokenReductionConfig, hub

from conftest import stock_forward, tiny_model
from slow_reference import row_plans, slow_forward

ATOL = 1e-5
SETTINGS = TokenReductionConfig(method="utrc", keep_ratio=0.7, anchors=[1, 3])


@pytest.fixture
def folder(tmp_path, family):
    """A tiny seeded checkpoint (unquantized) on disk, as a user's local model."""
    path = tmp_path / f"base-{family}"
    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return path


def load_int8(path, **kwargs):
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=QuantoConfig(weights="int8"), **kwargs)
    assert isinstance(model.backbone.layers[0].mixer.in_proj, QLinear)  # the mixers' projections are int8
    return model.eval()


def padded_ids():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 96, (2, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding
    return ids.masked_fill(mask == 0, 0), mask


def assert_matches_slow_reference(model, cfg, ids, mask):
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    assert len(out.plans) == len(cfg.anchors)
    for b in range(ids.shape[0]):
        kept = out.kept_positions[b][out.kept_positions[b] >= 0].tolist()
        real = mask[b].nonzero().flatten()
        assert len(kept) < len(real)  # reduced
        ref = slow_forward(model, ids[b, real], row_plans(out.plans, mask.bool(), b), len(real), cfg.hidden,
                           cfg.residual, cfg.q)
        torch.testing.assert_close(out.logits[b, kept], ref, atol=ATOL, rtol=0)
    return out


def test_keep_ratio_one_is_the_quantized_stock_model(folder):
    model = load_int8(folder)
    ids, mask = padded_ids()
    with torch.no_grad():
        stock = stock_forward(model, ids, attention_mask=mask).logits
        hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_ratio=1.0, anchors=[1, 3]))
        out = model(ids, attention_mask=mask)
    assert bool(out.computed_mask.all())  # the reducing forward ran (and kept every token)
    torch.testing.assert_close(out.logits, stock, atol=ATOL, rtol=0)


def test_reduced_quantized_forward_matches_the_slow_reference_on_the_same_weights(folder):
    model = load_int8(folder, token_reduction=SETTINGS)
    ids, mask = padded_ids()
    out = assert_matches_slow_reference(model, SETTINGS, ids, mask)
    dense = AutoModelForCausalLM.from_pretrained(folder, token_reduction=SETTINGS).eval()
    with torch.no_grad():
        unquantized = dense(ids, attention_mask=mask).logits[:, -1]
    assert (out.logits[:, -1] - unquantized).abs().max() > 1e-4  # int8 weights: not the fp32 model


def test_quanto_quantize_and_freeze_reduce_too(family):
    model = tiny_model(family)
    quantize(model, weights=qint8)
    freeze(model)
    assert isinstance(model.backbone.layers[0].mixer.out_proj, QLinear)
    cfg = TokenReductionConfig(method="front_prune", metric="delta", keep_ratio=0.6, anchors=[1, 3])
    hf_tokred.apply_token_reduction(model, cfg)
    assert_matches_slow_reference(model, cfg, *padded_ids())


def test_generate_on_quantized_weights(folder):
    model = load_int8(folder, token_reduction=SETTINGS)
    ids, mask = padded_ids()
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(ids, **kwargs)
        uncached = model.generate(ids, use_cache=False, **kwargs)
        out = model(ids, attention_mask=mask)
    assert torch.equal(cached, uncached) and cached.shape == (2, 34)
    for b in range(2):
        real = mask[b].nonzero().flatten()
        ref = slow_forward(model, ids[b, real], row_plans(out.plans, mask.bool(), b), len(real), SETTINGS.hidden,
                           SETTINGS.residual, SETTINGS.q)
        assert int(cached[b, 30]) == int(ref[-1].argmax())


def test_saved_settings_come_back_on_a_quantized_load(folder, tmp_path):
    reduced = tmp_path / "reduced"
    AutoModelForCausalLM.from_pretrained(folder, token_reduction=SETTINGS).save_pretrained(reduced)
    assert json.loads((reduced / "config.json").read_text())["token_reduction"] == SETTINGS.to_dict()
    variant = hub.save_variant(folder, SETTINGS, tmp_path / "variant")  # settings-only: names the base folder
    ids, mask = padded_ids()
    explicit = load_int8(folder, token_reduction=SETTINGS)
    with torch.no_grad():
        expected = explicit(ids, attention_mask=mask).logits
    for path in (reduced, variant):
        model = load_int8(path)
        assert hf_tokred.get_token_reduction(model) == SETTINGS
        with torch.no_grad():
            torch.testing.assert_close(model(ids, attention_mask=mask).logits, expected, equal_nan=True, atol=0,
                                       rtol=0)
    # stock transformers' own limit: a quanto model is not serializable (save the unquantized checkpoint instead)
    with pytest.raises(ValueError, match=r"(?i)quantized with (QuantizationMethod\.)?quanto and is not serializable"):
        explicit.save_pretrained(tmp_path / "quantized")
