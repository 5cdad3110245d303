"""Falcon Mamba (``FalconMambaForCausalLM``) gets every guarantee Mamba has, through the families table.

Falcon Mamba's blocks are Mamba-1 blocks whose mixer normalises the SSM's ``dt``, ``B`` and ``C`` (weightless RMS
norms), in a modeling module with its own copies of the scan and convolution functions.  Here:

* the model-level tests of ``test_model``, ``test_batch`` and ``test_save_load`` run again on a tiny Falcon Mamba:
  they are imported below and take this module's ``model`` / ``m4`` / ``saved`` fixtures.  Their independent
  references (``conftest.stock_forward``, ``stock_transformers``, the slow per-row forwards) use transformers' own
  code: at import this module records stock transformers' Falcon Mamba functions and forwards in ``conftest.STOCK``
  (read with hf_tokred uninstalled), so ``stock_transformers()`` restores them as it does Mamba's;
* FLOPs against ``FlopCounterMode`` and against every dispatched op (the three extra norms included);
* the compiled CPU scan and convolution in Falcon Mamba's module, against stock, with the cache;
* the ``delta`` metric reads the step sizes after the ``dt`` norm (hand-computed from the weights);
* ``uninstall()`` restores Falcon Mamba's classes and module exactly.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import (FalconMambaConfig, FalconMambaForCausalLM, FalconMambaModel, MambaConfig,
                          MambaForCausalLM)
from transformers.models.falcon_mamba import modeling_falcon_mamba

import hf_tokred
from hf_tokred import TokenReductionConfig, fastpath
from hf_tokred.compat import cache_kwargs, cache_of
from hf_tokred.families import FAMILIES
from hf_tokred.flops import layer_flops, model_flops
from hf_tokred.reduce import make_plan

import conftest
from conftest import STOCK, VOCAB, stock_forward, stock_transformers
from test_flops import DispatchCount, region_hooks

# ----------------------------------------------------------------------------- stock Falcon Mamba for the references


def _record_stock_falcon() -> None:
    hf_tokred.uninstall()
    try:
        STOCK.modules[modeling_falcon_mamba] = conftest._module_functions(modeling_falcon_mamba)
        for cls in (FalconMambaModel, FalconMambaForCausalLM):
            STOCK.methods[cls] = {k: cls.__dict__.get(k) for k in ("forward", "generate")}
    finally:
        hf_tokred.install()


_record_stock_falcon()
assert STOCK.modules[modeling_falcon_mamba]["mamba_selective_scan"].__module__ == modeling_falcon_mamba.__name__
assert modeling_falcon_mamba.mamba_selective_scan is not STOCK.modules[modeling_falcon_mamba]["mamba_selective_scan"]


def falcon_config(layers: int = 6, **kw) -> FalconMambaConfig:
    return FalconMambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=layers, expand=2,
                             pad_token_id=0, eos_token_id=1, bos_token_id=1, **kw)


def falcon_model(layers: int = 6, seed: int = 0, **kw) -> FalconMambaForCausalLM:
    torch.manual_seed(seed)
    model = FalconMambaForCausalLM(falcon_config(layers, **kw)).eval()
    with torch.no_grad():  # perturb the structured init so every channel differs (as conftest.tiny_model does)
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


@pytest.fixture
def model():
    return falcon_model()


@pytest.fixture
def m4():
    return falcon_model(layers=4)


@pytest.fixture
def saved(tmp_path):
    model = falcon_model()
    hf_tokred.apply_token_reduction(model, SETTINGS)
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        return tmp_path, model, model(IDS).logits


# ----------------------------------------------------------------------------- the Mamba model tests, on Falcon Mamba

from test_batch import (  # noqa: E402,F401
    test_all_padding_rows,
    test_batch_of_one_and_of_64,
    test_generation_is_batch_invariant_with_left_padding,
    test_inputs_embeds_in_a_padded_batch,
    test_logits_to_keep,
    test_loss_is_batch_invariant,
    test_negative_logits_to_keep_is_stock_or_a_clear_error,
    test_padding_content_never_matters,
    test_repeated_token_rows_are_batch_invariant,
    test_row_in_batch_equals_row_alone,
    test_rows_too_short_for_an_anchor_equal_stock_in_a_batch,
    test_same_input_same_plan_run_to_run,
    test_short_rows,
    test_use_cache_false_and_tuple_outputs,
)
from test_model import (  # noqa: E402,F401
    test_apply_rejects_unsupported_models_and_schedules,
    test_backbone_output_is_position_aligned,
    test_flops_zero_and_short_inputs_generate_like_stock,
    test_generate_after_reduced_prefill,
    test_inputs_embeds_equals_input_ids,
    test_keep_ratio_one_equals_stock,
    test_logits_to_keep_and_tuple_outputs,
    test_pipeline_text_generation,
    test_plan_is_made_from_the_anchor_mixer_output,
    test_reduced_logits_and_loss_match_slow_reference,
)
from test_save_load import (  # noqa: E402,F401
    IDS,
    SETTINGS,
    test_config_json_holds_a_plain_dict,
    test_corrupt_block_is_rejected_on_load,
    test_from_pretrained_overrides_and_accepts_dicts,
    test_push_to_hub_uploads_the_settings,
    test_reload_reduces_with_identical_outputs,
    test_schedule_that_does_not_fit_is_rejected_on_load,
    test_stock_transformers_loads_the_folder_as_a_normal_model,
    test_token_reduction_none_switches_it_off,
)


def test_the_fixtures_are_falcon_mamba(model, m4, saved):
    assert type(model) is type(m4) is type(saved[1]) is FalconMambaForCausalLM
    assert FAMILIES["falcon_mamba"].lm_class == "FalconMambaForCausalLM"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_the_residual_in_fp32(dtype):
    m = falcon_model(layers=4).to(dtype)
    hf_tokred.apply_token_reduction(m, TokenReductionConfig(keep_ratio=1.0, anchors=[0, 2]))
    ids = torch.randint(2, VOCAB, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = m(ids, output_hidden_states=True)
        ref = stock_forward(m, ids, output_hidden_states=True)
    assert out.logits.dtype == ref.logits.dtype
    # nothing removed: the same blocks; the compiled scan accumulates in fp32 (README), so half precision differs a
    # little from stock's loop
    torch.testing.assert_close(out.logits, ref.logits, atol=0.1, rtol=0.05)
    assert all(h.dtype == torch.float32 for h in out.hidden_states[:-1])  # residual_in_fp32


def test_generate_without_cache_equals_with_cache():
    m = falcon_model(layers=8)
    hf_tokred.apply_token_reduction(m, TokenReductionConfig(keep_ratio=0.6, anchors=[2, 5]))
    m.generation_config.eos_token_id = None
    ids = torch.randint(2, VOCAB, (2, 24), generator=torch.Generator().manual_seed(4))
    with_cache = m.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    without = m.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(with_cache, without)


# ----------------------------------------------------------------------------- FLOPs


def _flops_model(layers=2, **kw):
    torch.manual_seed(0)
    config = FalconMambaConfig(vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=layers, **kw)
    return FalconMambaForCausalLM(config).eval()


@pytest.mark.parametrize("lengths, head_positions", [([23, 23], 23), ([21, 9], 9), ([12, 4], 1)])
def test_flops_matmuls_equal_flop_counter(lengths, head_positions):
    model = _flops_model()
    ids = torch.randint(0, 256, (2, max(lengths)))
    with torch.no_grad(), stock_transformers(), FlopCounterMode(display=False) as counter:
        hidden = model.backbone.embeddings(ids)
        for block, length in zip(model.backbone.layers, lengths):
            hidden = block(hidden[:, :length])
        model.lm_head(model.backbone.norm_f(hidden)[:, hidden.shape[1] - head_positions:])
    analytic = model_flops(model.config, lengths, batch=2, lm_head_positions=head_positions)
    assert analytic.matmul == counter.get_total_flops()
    mamba = MambaConfig(**{k: getattr(model.config, k) for k in ("vocab_size", "hidden_size", "state_size",
                                                                  "num_hidden_layers", "expand", "conv_kernel")})
    extra = model_flops(model.config, lengths, 2, head_positions).norm - model_flops(mamba, lengths, 2,
                                                                                      head_positions).norm
    R, N = model.config.time_step_rank, model.config.state_size
    assert extra == sum(3 * 2 * L * (R + 2 * N) for L in lengths) > 0  # the three weightless norms


@pytest.mark.parametrize("use_bias, use_conv_bias", [(False, True), (True, False)])
def test_every_flops_term_equals_the_dispatched_ops(use_bias, use_conv_bias):
    """As ``test_flops.test_every_term_equals_the_dispatched_ops``, on Falcon Mamba's stock forward."""
    lengths, head_positions, B = [20, 12, 5], 4, 2
    model = _flops_model(layers=3, use_bias=use_bias, use_conv_bias=use_conv_bias)
    counter = DispatchCount()
    hooks = region_hooks(model, counter)
    ids = torch.randint(0, 256, (B, max(lengths)))
    try:
        with torch.no_grad(), stock_transformers(), pytest.MonkeyPatch.context() as mp:
            for name, region in (("causal_conv1d_fn", "conv"), ("mamba_selective_scan", "scan")):
                mp.setattr(modeling_falcon_mamba, name, counter.tagged(getattr(modeling_falcon_mamba, name), region))
            hidden = model.backbone.embeddings(ids)
            with counter:
                for block, length in zip(model.backbone.layers, lengths):
                    hidden = block(hidden[:, :length])
                model.lm_head(model.backbone.norm_f(hidden)[:, hidden.shape[1] - head_positions:])
    finally:
        for h in hooks:
            h.remove()
    got = counter.flops
    config = model.config
    analytic = model_flops(config, lengths, batch=B, lm_head_positions=head_positions)
    eps_adds = B * (sum(lengths) * 4 + lengths[-1])  # + eps: block norm and three mixer norms per token, norm_f
    convention = sum(2 * B * L * config.intermediate_size * config.state_size for L in lengths)  # 9BLDN vs 7
    assert analytic.norm == got["norm", "ew"] - eps_adds
    assert analytic.conv == got["conv", "mm"] + got["conv", "bias"]
    assert analytic.scan == got["scan", "mm"] + got["scan", "ew"] + convention
    assert analytic.projections == (got["proj", "mm"] + got["proj", "bias"] + got["mixer", "mm"]
                                    + got["scan", "dt_bias"] + got["block", "ew"])
    assert analytic.lm_head == got["lm_head", "mm"]
    assert analytic.total == sum(got.values()) - eps_adds + convention
    assert layer_flops(config, 7, B).norm == B * 7 * (4 * 64 + 3 * (config.time_step_rank + 2 * 16))


# ----------------------------------------------------------------------------- fast kernels in Falcon Mamba's module


def test_falcon_module_gets_the_fast_kernels_and_equals_stock_with_the_cache():
    assert modeling_falcon_mamba.mamba_selective_scan is fastpath.REPLACEMENTS[modeling_falcon_mamba][
        "mamba_selective_scan"]
    assert modeling_falcon_mamba.causal_conv1d_fn is fastpath.REPLACEMENTS[modeling_falcon_mamba]["causal_conv1d_fn"]
    model = falcon_model(layers=3)
    ids = torch.randint(2, VOCAB, (2, 70), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    calls = []
    scan = modeling_falcon_mamba.mamba_selective_scan
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(modeling_falcon_mamba, "mamba_selective_scan", lambda *a, **k: calls.append(1) or scan(*a, **k))
        ours = model(ids, attention_mask=mask, use_cache=True)
    assert calls, "Falcon Mamba's mixer did not call the rebound scan"
    with torch.no_grad():
        ref = stock_forward(model, ids, attention_mask=mask, use_cache=True)
        nxt = torch.tensor([[5], [7]])
        ours_step = model(nxt, **cache_kwargs(cache_of(ours)))
        ref_step = stock_forward(model, nxt, **cache_kwargs(cache_of(ref)))
    torch.testing.assert_close(ours.logits, ref.logits, atol=1e-5, rtol=0)
    for layer in range(3):
        torch.testing.assert_close(cache_of(ours).layers[layer].recurrent_states[0],
                                   cache_of(ref).layers[layer].recurrent_states[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_step.logits, ref_step.logits, atol=1e-5, rtol=0)
    with fastpath.stock_kernels():
        assert modeling_falcon_mamba.mamba_selective_scan is STOCK.modules[modeling_falcon_mamba][
            "mamba_selective_scan"]
    assert modeling_falcon_mamba.mamba_selective_scan is scan


# ----------------------------------------------------------------------------- the delta metric


def _step_sizes_by_hand(mixer, x, dt_norm: bool):
    """Mean ``softplus(dt)`` per token of a Mamba-1 / Falcon Mamba mixer on its input ``x [1, L, d]``, from the
    weights: in_proj, causal conv + silu, x_proj, (Falcon: dt / sqrt(mean(dt^2) + eps)), dt_proj."""
    L = x.shape[1]
    xz = x[0] @ mixer.in_proj.weight.T
    u = xz[:, : mixer.intermediate_size]
    w = mixer.conv1d.weight[:, 0]
    K = w.shape[-1]
    padded = torch.nn.functional.pad(u.T, (K - 1, 0))
    conv = sum(w[:, k, None] * padded[:, k:k + L] for k in range(K)) + mixer.conv1d.bias[:, None]
    u = torch.nn.functional.silu(conv).T
    dt = (u @ mixer.x_proj.weight.T)[:, : mixer.time_step_rank]
    if dt_norm:
        dt = dt / torch.sqrt(dt.pow(2).mean(-1, keepdim=True) + mixer.rms_eps)
    return torch.nn.functional.softplus(dt @ mixer.dt_proj.weight.T + mixer.dt_proj.bias).mean(-1)[None]


@pytest.mark.parametrize("family", ["falcon_mamba", "mamba"])
def test_delta_metric_reads_the_step_sizes_after_the_dt_norm(family):
    if family == "falcon_mamba":
        m = falcon_model(layers=4, seed=3)
    else:
        torch.manual_seed(3)
        m = MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=4)).eval()
    cfg = TokenReductionConfig(method="evit", metric="delta", keep_ratio=0.6, anchors=[2])
    hf_tokred.apply_token_reduction(m, cfg)
    ids = torch.randint(2, VOCAB, (1, 25), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plan = m(ids).plans[0][1]
        with stock_transformers():
            x = m.backbone.embeddings(ids)
            for block in m.backbone.layers[:2]:
                x = block(x)
            anchor = m.backbone.layers[2]
            h = anchor.mixer(anchor.norm(x))
        scores = _step_sizes_by_hand(anchor.mixer, anchor.norm(x), family == "falcon_mamba")
    protected = torch.zeros(1, 25, dtype=torch.bool)
    protected[0, -1] = True
    want = make_plan(h, torch.ones(1, 25, dtype=torch.bool), protected, 0.6, cfg.spec.selection, "delta",
                     cfg.spec.pairs, scores)
    assert plan.keep.tolist() == want.keep.tolist() and plan.keep.shape[1] < 25
    if family == "falcon_mamba":  # without the dt norm the step sizes would differ
        with torch.no_grad():
            assert not torch.allclose(_step_sizes_by_hand(anchor.mixer, anchor.norm(x), False), scores, atol=1e-3)


# ----------------------------------------------------------------------------- uninstall, random specs


def test_uninstall_restores_falcon_mamba_exactly(tmp_path):
    code = textwrap.dedent("""
        import torch
        from transformers import FalconMambaConfig, FalconMambaForCausalLM, FalconMambaModel
        from transformers.models.falcon_mamba import modeling_falcon_mamba as module

        def snapshot():
            state = {c.__qualname__: dict(vars(c)) for c in (FalconMambaConfig, FalconMambaForCausalLM,
                                                             FalconMambaModel)}
            state["module"] = dict(vars(module))
            return state

        before = snapshot()
        import hf_tokred
        assert snapshot() != before
        hf_tokred.uninstall()
        after = snapshot()
        for key in before:
            assert before[key] == after[key], key
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "", "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_random_falcon_mamba_specs():
    model, _ = hf_tokred.load_model("random:falcon_mamba-tiny", token_reduction={"keep_ratio": 0.7, "anchors": [3]})
    assert type(model) is FalconMambaForCausalLM and model.config.num_hidden_layers == 12
    with torch.no_grad():
        assert model(torch.randint(3, 200, (1, 30))).plans
    config = hf_tokred.models.random_config("falcon_mamba-7b")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (4096, 64, 65024)
