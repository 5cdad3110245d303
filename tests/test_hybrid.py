"""Hybrid SSM-attention models (issues 14, 23): Bamba (rotary attention), Granite 4.0 MoE hybrid (rotary attention +
MoE), Nemotron-H (attention without positions, MoE layers), Jamba (Mamba-1 mixers with dt/B/C norms, attention
without positions, MoE halves), Falcon-H1 (attention beside Mamba-2 in every layer, μP multipliers) and Zamba2 (a
shared attention block reading the original embeddings), on tiny random models of each.

References are independent of the reducing loop: stock transformers (``conftest.stock_transformers``: its own forwards
and kernels, recorded below with hf_tokred uninstalled, so Jamba's reference runs transformers' Mamba-1 loop, not
hf_tokred's fast kernels), transformers' own attention module called on the captured reduced input with the original
positions and a plain causal mask, a fresh forward for every decode step, one-at-a-time forwards for padded batches,
and ``FlopCounterMode`` and the dispatched ops for the FLOPs.
"""

import contextlib
import copy
import importlib
import json
import types
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.utils.flop_counter import FlopCounterMode
from transformers import ZambaConfig

import hf_tokred
from hf_tokred import TokenReductionConfig, fastpath
from hf_tokred.bench import format_table, run_bench
from hf_tokred.cli import main
from hf_tokred.compat import cache_of, layer_cache_kwargs
from hf_tokred.families import FAMILIES
from hf_tokred.hybrid import default_positions, note_seen
from hf_tokred.hybrid_layers import ANCHOR_KINDS, ATTENTION_KINDS
from hf_tokred.flops import flops_reduction, layer_flops, model_flops
from hf_tokred.loop import generation_prompt
from hf_tokred.models import random_config
from hf_tokred.settings import apply_token_reduction, resolve_schedule

import conftest
from conftest import STOCK, stock_transformers
from test_flops import DispatchCount

HYBRIDS = ["bamba", "granitemoehybrid", "nemotron_h", "jamba", "falcon_h1", "zamba2"]
ATOL = 1e-5


def _record_stock_hybrids() -> None:
    """transformers' own modules of the hybrid families, read with hf_tokred uninstalled (the kernels it replaces,
    the forwards it wraps), so that ``stock_transformers()`` restores them."""
    hf_tokred.uninstall()
    try:
        for name in HYBRIDS:
            family = FAMILIES[name]
            module = importlib.import_module(family.modeling_module)
            STOCK.modules[module] = conftest._module_functions(module)
            for cls in (getattr(transformers, family.lm_class), getattr(transformers, family.backbone_class)):
                STOCK.methods[cls] = {k: cls.__dict__.get(k) for k in ("forward", "generate")}
    finally:
        hf_tokred.install()


_record_stock_hybrids()


def hybrid_model(name: str, seed: int = 0, **config_kw):
    config = random_config(f"{name}-tiny")
    for k, v in config_kw.items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[name].lm_class)(config).eval()
    with torch.no_grad():  # perturb the structured init so tokens and channels differ
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def ssm_layers(model) -> list[int]:
    """The layers an anchor may sit on (an SSM mixer's output to plan from)."""
    return FAMILIES[model.config.model_type].anchor_layers(model.config)


def attention_after_anchors(model) -> list[int]:
    """The layers that run attention after both of :func:`reduce`'s anchors (on the twice-reduced sequence)."""
    kinds = FAMILIES[model.config.model_type].kinds(model.config)
    last = ssm_layers(model)[1]
    return [i for i, k in enumerate(kinds) if k in ATTENTION_KINDS and i > last]


def reduce(model, keep_ratio: float = 0.7):
    """Anchors on the first two SSM layers: every attention layer runs after one or two reductions."""
    apply_token_reduction(model, TokenReductionConfig(keep_ratio=keep_ratio, anchors=ssm_layers(model)[:2]))
    return model


def stock(model, fn):
    saved = model.config.token_reduction
    apply_token_reduction(model, None)
    try:
        with torch.no_grad(), stock_transformers():
            return fn()
    finally:
        model.config.token_reduction = saved


def prompt(n: int = 20, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, 500, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=HYBRIDS)
def model(request):
    return hybrid_model(request.param)


# ----------------------------------------------------------------------------- schedule, errors


def test_layer_kinds_and_default_anchors_sit_on_ssm_layers():
    config = random_config("granitemoehybrid-tiny")
    config.layer_types = ["linear_attention"] * 3 + ["full_attention"] * 2 + ["linear_attention"] * 3
    kinds = FAMILIES["granitemoehybrid"].kinds(config)
    assert kinds == ("ssm",) * 3 + ("attention",) * 2 + ("ssm",) * 3
    schedule = resolve_schedule(TokenReductionConfig(keep_ratio=0.8), config)
    # the default rule's anchors (2, 3, 4, 5 for 8 layers) move to the last SSM layer at or before each
    assert schedule.anchors and all(kinds[a] == "ssm" for a in schedule.anchors)
    assert schedule.anchors == (2, 5)


def test_anchor_on_attention_layer_is_refused():
    model = hybrid_model("bamba")
    with pytest.raises(ValueError, match=r"layer\(s\) \[2\] .* not SSM layers.*pick anchors among the SSM layers"):
        apply_token_reduction(model, TokenReductionConfig(keep_ratio=0.8, anchors=[1, 2]))


def test_unsupported_hybrid_class_is_refused():
    zamba = types.SimpleNamespace(config=ZambaConfig(num_hidden_layers=4))  # Zamba (v1): not in the families table
    with pytest.raises(ValueError, match="token reduction supports .*JambaForCausalLM.*model_type='zamba'"):
        apply_token_reduction(zamba, TokenReductionConfig(keep_ratio=0.8))


@pytest.mark.parametrize("name", ["bamba", "jamba", "falcon_h1", "zamba2"])
def test_attention_without_explicit_mask_is_refused(name):
    model = reduce(hybrid_model(name))
    model.config._attn_implementation_internal = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'.*load the model with "
                                         "attn_implementation='sdpa'"):
        model(prompt())


def test_loss_terms_the_reduced_forward_cannot_compute_are_refused():
    model = reduce(hybrid_model("bamba"))
    model.config.z_loss_coefficient = 1e-3
    with pytest.raises(ValueError, match="z-loss"):
        model(prompt(), labels=prompt())


def test_flops_target_weighs_layer_types():
    """A FLOPs target on a hybrid is met by the analytic FLOPs of its layers (attention's quadratic term, MoE),
    which the paper's proxy (every layer alike) misses."""
    config = random_config("granitemoehybrid-tiny")
    cfg = TokenReductionConfig(flops_reduction=0.2, anchors=[0, 1])
    schedule = resolve_schedule(cfg, config)
    L = 2048
    got = flops_reduction(config, schedule.layer_lengths(L), L, lm_head_positions=0, dense_lm_head_positions=0)
    assert got == pytest.approx(0.2, abs=2e-3)
    assert schedule.keep_ratio != pytest.approx(cfg.resolve(config.num_hidden_layers).keep_ratio, abs=1e-3)


# ----------------------------------------------------------------------------- keep ratio 1.0 = stock


def test_keep_ratio_one_equals_stock_with_granites_multipliers():
    """Granite 4.0 scales each residual branch, the embeddings and the logits: with multipliers other than 1 (real
    checkpoints use e.g. 0.22 / 12 / 8), the anchor blocks split into branches still equal stock."""
    test_keep_ratio_one_equals_stock(hybrid_model("granitemoehybrid", residual_multiplier=0.3, embedding_multiplier=2.0,
                                                  logits_scaling=1.7))


def test_keep_ratio_one_equals_stock(model):
    ids = prompt(20, batch=2)
    ref = stock(model, lambda: model(ids, labels=ids))
    ref_gen = stock(model, lambda: model.generate(ids, max_new_tokens=5, do_sample=False))
    reduce(model, keep_ratio=1.0)
    with torch.no_grad():
        out = model(ids, labels=ids)
        gen = model.generate(ids, max_new_tokens=5, do_sample=False)
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.loss, ref.loss, atol=ATOL, rtol=0)
    assert torch.equal(gen, ref_gen)


# ----------------------------------------------------------------------------- attention on the reduced sequence


def _attention_module(block):
    shared = getattr(block, "shared_transformer", None)  # Zamba2's shared block
    return shared.self_attn if shared is not None else getattr(block, "self_attn", None) or block.mixer


def test_attention_sees_reduced_sequence_at_original_positions(model):
    """The attention layer after both anchors, called by transformers' own code on its captured (reduced) input with
    the original positions of the kept tokens (composed from the plans' keep indices) and a plain causal mask,
    gives what it gave inside the reducing loop."""
    reduce(model)
    family = FAMILIES[model.config.model_type]
    layer = attention_after_anchors(model)[0]
    attn = _attention_module(getattr(model, family.backbone_attr).layers[layer])
    seen = {}
    hook = attn.register_forward_hook(lambda m, args, kwargs, out: seen.update(kwargs=kwargs, out=out[0]),
                                      with_kwargs=True)
    ids = prompt(24)
    with torch.no_grad():
        out = model(ids, use_cache=False)
    hook.remove()
    (_, p0), (_, p1) = out.plans
    original = p0.keep.gather(1, p1.keep)  # input position of each column after the second anchor
    assert torch.equal(original, out.kept_positions)
    hidden = seen["kwargs"]["hidden_states"]
    assert hidden.shape[1] == original.shape[1] < ids.shape[1]
    kwargs = {}
    rotary = getattr(getattr(model, family.backbone_attr), "rotary_emb", None)
    if rotary is not None:
        kwargs["position_embeddings"] = rotary(hidden, original)
    M = hidden.shape[1]
    causal = torch.ones(M, M, dtype=torch.bool).tril()[None, None]
    kwargs.update({k: v for k, v in seen["kwargs"].items() if k == "layer_idx"})  # Zamba2: which use of the block
    with torch.no_grad():
        ref = attn(hidden_states=hidden, attention_mask=causal, **kwargs)[0]
    torch.testing.assert_close(seen["out"], ref, atol=ATOL, rtol=0)


def test_cache_holds_reduced_keys_and_decoding_continues_at_the_original_position(model):
    reduce(model)
    family = FAMILIES[model.config.model_type]
    layers = attention_after_anchors(model)
    ids = prompt(24)
    with torch.no_grad():
        out = model(ids, use_cache=True)
    assert out.cache.get_seq_length(layers[0]) == out.kept_positions.shape[1] < ids.shape[1]
    block = getattr(model, family.backbone_attr).layers[layers[0]]
    seen = {}
    hook = block.register_forward_hook(lambda m, args, kwargs, o: seen.update(kwargs), with_kwargs=True)
    with torch.no_grad():
        model(prompt(1, seed=5), cache=out.cache, use_cache=True)
    hook.remove()
    assert out.cache.get_seq_length(layers[0]) == out.kept_positions.shape[1] + 1
    if "position_ids" in seen:
        assert seen["position_ids"].tolist() == [[24]]


# ----------------------------------------------------------------------------- decoding is exact


@pytest.mark.parametrize("mode", ["greedy", "greedy-no-cache", "sample"])
def test_every_decode_step_equals_a_fresh_forward_with_the_same_plan(model, mode):
    reduce(model)
    ids = prompt(20)
    kw = dict(do_sample=mode == "sample", use_cache=mode != "greedy-no-cache", output_logits=True,
              return_dict_in_generate=True, max_new_tokens=4, pad_token_id=1)
    torch.manual_seed(3)
    with torch.no_grad():
        gen = model.generate(ids, **kw)
    P = ids.shape[1]
    for t, step_logits in enumerate(gen.logits):
        with torch.no_grad(), generation_prompt(P, None):
            fresh = model(gen.sequences[:, : P + t], use_cache=False).logits[:, -1]
        torch.testing.assert_close(step_logits, fresh, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- padding


def test_left_padded_batch_equals_one_at_a_time(model):
    reduce(model)
    long, short = prompt(22, seed=2)[0], prompt(15, seed=3)[0]
    pad = long.shape[0] - short.shape[0]
    ids = torch.stack([long, torch.cat([torch.full((pad,), 1), short])])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    with torch.no_grad():
        batch = model(ids, attention_mask=mask)
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=1)
        for row, (alone, offset) in enumerate(((long, 0), (short, pad))):
            single = model(alone[None])
            torch.testing.assert_close(batch.logits[row, offset:], single.logits[0], atol=ATOL, rtol=0,
                                       equal_nan=True)
            alone_gen = model.generate(alone[None], max_new_tokens=4, do_sample=False, pad_token_id=1)
            assert torch.equal(gen[row, ids.shape[1]:], alone_gen[0, alone.shape[0]:])


# ----------------------------------------------------------------------------- FLOPs


def _eager(name: str, **config_kw):
    model = hybrid_model(name, **config_kw)
    model.config._attn_implementation_internal = "eager"  # sdpa on CPU is invisible to FlopCounterMode
    model.config._experts_implementation_internal = "eager"  # the per-expert loop: active experts only
    return model


@pytest.mark.parametrize("name", HYBRIDS)
def test_flops_match_flop_counter(name):
    model = _eager(name)
    n = model.config.num_hidden_layers
    for L in (12, 40):  # one Mamba-2 chunk, and two
        with torch.no_grad(), stock_transformers(), FlopCounterMode(display=False) as counter:
            model(prompt(L, batch=2))
        assert counter.get_total_flops() == model_flops(model.config, [L] * n, batch=2).matmul, L


@pytest.mark.parametrize("name", HYBRIDS)
def test_attention_flops_at_each_layers_reduced_length(name):
    """In a reduced forward, each attention layer costs what the analytic count says at its own (reduced) length:
    the score products shrink quadratically."""
    model = reduce(_eager(name))
    family = FAMILIES[name]
    backbone = family.backbone_attr
    attention = attention_after_anchors(model)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out = model(prompt(30), use_cache=False)
    counts = counter.get_flop_counts()
    M = out.kept_positions.shape[1]
    assert M < 30
    for i in attention:
        key = next(k for k in counts if k.endswith(f"{backbone}.layers.{i}"))
        assert sum(counts[key].values()) == layer_flops(model.config, M, 1, layer=i).matmul
    with pytest.raises(ValueError, match="pass layer=<block index>"):
        layer_flops(model.config, M)


@pytest.mark.parametrize("name", HYBRIDS)
def test_eager_and_sdpa_attention_agree_on_a_reduced_padded_batch(name):
    """The reduced layers' mask in both forms (boolean for sdpa, additive for eager) masks the same columns."""
    ids = prompt(24, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    logits = []
    for impl in ("sdpa", "eager"):
        model = reduce(hybrid_model(name))
        model.config._attn_implementation_internal = impl
        with torch.no_grad():
            out = model(ids, attention_mask=mask)
        assert out.kept_positions.shape[1] < 24
        logits.append(out.logits.masked_fill(~out.computed_mask[..., None], 0))
    torch.testing.assert_close(logits[0], logits[1], atol=ATOL, rtol=0)


def test_default_positions_start_at_zero_and_continue_at_the_positions_seen():
    """Without position ids: ``0 .. N-1`` for a fresh forward (with or without a cache object), else the next
    original position, the number of input positions the cache has seen (by hand)."""
    assert torch.equal(default_positions(None, 2, 4, True, "cpu"), torch.tensor([[0, 1, 2, 3]] * 2))
    cache = types.SimpleNamespace()
    assert torch.equal(default_positions(cache, 1, 3, True, "cpu"), torch.tensor([[0, 1, 2]]))
    note_seen(cache, 30, True)
    note_seen(cache, 1, False)
    assert torch.equal(default_positions(cache, 1, 2, False, "cpu"), torch.tensor([[31, 32]]))
    # the same cache object used again from the start: its old record is not read
    assert torch.equal(default_positions(cache, 1, 2, True, "cpu"), torch.tensor([[0, 1]]))
    # a cache filled without hf_tokred (no record): where stock starts, the cache's get_seq_length()
    stock_filled = types.SimpleNamespace(get_seq_length=lambda layer_idx=0: 17)
    assert torch.equal(default_positions(stock_filled, 1, 2, False, "cpu"), torch.tensor([[17, 18]]))


@pytest.mark.parametrize("name", ["bamba", "granitemoehybrid", "falcon_h1", "zamba2"])
def test_decoding_on_a_cache_filled_without_reduction_continues_at_its_length(name):
    """A cache filled by stock transformers (reduction off), then a decode step with reduction on and no position
    ids: the new token sits at position 20, the cache's length (rotary attention would see another distance
    otherwise); the reference is stock given that position explicitly (stock Bamba restarts at 0 without it)."""
    model = reduce(hybrid_model(name))
    ids = prompt(21)
    with torch.no_grad():
        cache = stock(model, lambda: cache_of(model(ids[:, :20], use_cache=True), hybrid=True))
        want = stock(model, lambda: model(ids[:, 20:], **layer_cache_kwargs(copy.deepcopy(cache)), use_cache=True,
                                          position_ids=torch.tensor([[20]])))
        got = model(ids[:, 20:], **layer_cache_kwargs(copy.deepcopy(cache)), use_cache=True)
        torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)
        # and the next step continues at 21
        nxt = torch.tensor([[5]])
        want = stock(model, lambda: model(nxt, **layer_cache_kwargs(cache_of(want, hybrid=True)), use_cache=True,
                                          position_ids=torch.tensor([[21]])))
        got = model(nxt, **layer_cache_kwargs(cache_of(got, hybrid=True)), use_cache=True)
    torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- every term, against the dispatched ops

# Free by the FLOPs conventions (hf_tokred.flops): activation functions (ReLU^2's square included) and the router's
# top-k bookkeeping (its matmul is counted); every other element-wise op a layer dispatches is counted.
_FREE = {"act_fn", "activation", "act", "router", "gate"}


class _LayerDispatch(DispatchCount):
    """:class:`test_flops.DispatchCount` plus the ops the hybrids' feed-forward layers use: ``index_add_`` adds its
    source (one FLOP per source element); integer arithmetic (the experts' routing masks) is not FLOPs; an
    RMSNorm's ``+ eps`` (an add of a Python number) is kept apart."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
            return func(*args, **(kwargs or {}))
        if name in ("index_add", "index_add_"):
            self.flops[self.region[-1], "ew"] += args[3].numel()
            return func(*args, **(kwargs or {}))
        if name == "add" and self.region[-1] == "norm" and not isinstance(args[1], torch.Tensor):
            self.flops["norm", "eps"] += args[0].numel()
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _mamba1_scan_convention(config, kind: str, L: int, B: int) -> int:
    """The Mamba-1 scan is counted as ``9 B L D N`` where transformers' loop dispatches ``7 B L D N`` element-wise and
    matmul FLOPs (``tests/test_flops.py``): the difference, for a Jamba SSM layer (by hand)."""
    if config.model_type != "jamba" or kind != "ssm":
        return 0
    return 2 * B * L * config.mamba_expand * config.hidden_size * config.mamba_d_state


def _dispatched_per_layer(model, L: int, B: int) -> list:
    counter = _LayerDispatch()
    layers = getattr(model, FAMILIES[model.config.model_type].backbone_attr).layers
    snapshots, hooks = [], []
    for layer in layers:
        for name, module in layer.named_modules():
            last = name.rsplit(".", 1)[-1]
            region = "free" if last in _FREE else "norm" if "RMSNorm" in type(module).__name__ else None
            if region is not None:
                hooks.append(module.register_forward_pre_hook(lambda m, a, r=region: counter.region.append(r) and None))
                hooks.append(module.register_forward_hook(lambda m, a, o: counter.region.pop() and None))
        hooks.append(layer.register_forward_pre_hook(lambda m, a: snapshots.append(Counter(counter.flops)) and None))
        hooks.append(layer.register_forward_hook(lambda m, a, o: snapshots.append(Counter(counter.flops)) and None))
    try:
        with torch.no_grad(), stock_transformers(), counter:
            model(prompt(L, batch=B), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [snapshots[2 * i + 1] - snapshots[2 * i] for i in range(len(layers))]


@pytest.mark.parametrize("name, overrides", [
    ("bamba", {}),
    ("bamba", dict(attention_bias=True, mlp_bias=True, mamba_proj_bias=True, mamba_conv_bias=False)),
    ("granitemoehybrid", {}),
    ("granitemoehybrid", dict(attention_bias=True, position_embedding_type=None, num_local_experts=0)),
    ("nemotron_h", {}),
    ("nemotron_h", dict(mlp_bias=True, use_bias=True, use_conv_bias=False, moe_latent_size=16)),
    ("jamba", {}),
    ("jamba", dict(mamba_proj_bias=True, mamba_conv_bias=False, num_experts=1)),
    ("falcon_h1", {}),
    ("falcon_h1", dict(mamba_rms_norm=True, attention_bias=True, mlp_bias=True, mamba_proj_bias=True,
                       projectors_bias=True, mamba_conv_bias=False, mamba_n_groups=2)),
    ("zamba2", {}),
    ("zamba2", dict(add_bias_linear=True, use_shared_attention_adapter=False, use_mem_rope=False, mamba_ngroups=2)),
], ids=["bamba", "bamba-biases", "granite", "granite-nope-biases-no-moe", "nemotron_h", "nemotron_h-biases-latent",
        "jamba", "jamba-biases-no-moe", "falcon_h1", "falcon_h1-gated-norm-biases-groups", "zamba2",
        "zamba2-biases-no-adapters-nope-groups"])
@pytest.mark.parametrize("L", [12, 40])  # one Mamba-2 chunk, and two
def test_every_term_equals_the_dispatched_ops(name, overrides, L):
    """Each layer's analytic count, matmul and element-wise parts, equals what stock transformers' eager forward of
    that layer dispatches (tolerance 0): attention's bias adds, score scaling, mask add and rotary embedding (Bamba
    rotates half of each head), MLP / MoE products and sums, norms, residuals, and the Mamba-2 mixers."""
    model = _eager(name, **overrides)
    B = 2
    kinds = FAMILIES[name].kinds(model.config)
    per_layer = _dispatched_per_layer(model, L, B)
    for i, got in enumerate(per_layer):
        analytic = layer_flops(model.config, L, B, layer=i)
        mm = sum(v for (region, kind), v in got.items() if kind == "mm")
        ew = sum(v for (region, kind), v in got.items() if kind in ("ew", "bias") and region != "free")
        assert got["norm", "eps"] > 0 and mm > 0 and ew > 0
        ew += _mamba1_scan_convention(model.config, kinds[i], L, B)
        assert (analytic.matmul, analytic.elementwise) == (mm, ew), (i, kinds[i])
    if "attention_bias" in overrides:  # the variant's bias adds are dispatched (so the check above sees them)
        attention = next(i for i, k in enumerate(kinds) if k in ATTENTION_KINDS)
        assert per_layer[attention]["block", "bias"] > 0


# ----------------------------------------------------------------------------- command line, random models


@pytest.mark.parametrize("name", HYBRIDS)
def test_schedule_command_prints_layer_types_and_anchor_types(name, capsys):
    assert main(["schedule", "--model", f"random:{name}-tiny", "--flops-reduction", "0.2", "--length", "2048",
                 "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    kinds = list(FAMILIES[name].kinds(random_config(f"{name}-tiny")))
    assert row["layer_types"] == kinds and set(kinds) & set(ATTENTION_KINDS)
    assert set(row["anchor_types"]) <= set(ANCHOR_KINDS) and row["anchors"]
    assert row["flops_reduction_exact_scoring"] == pytest.approx(0.2, abs=0.01)  # the solver weighs the layers


def test_bench_reports_the_kv_cache_a_reduced_prefill_keeps():
    result = run_bench("random:granitemoehybrid-tiny", length=64, flops=(0.3,), repeats=1, warmup=0,
                       decode_tokens=2, progress=False)
    dense, reduced = result["rows"]
    assert dense["kv_cache_mib"] > reduced["kv_cache_mib"] > 0 and reduced["kv_cache_saving"] > 0.1
    assert reduced["flops_reduction_exact"] > 0.1 and "KV cache" in format_table(result)


@pytest.mark.parametrize("name", HYBRIDS)
def test_from_pretrained_with_token_reduction(name, tmp_path):
    hybrid_model(name).save_pretrained(tmp_path)
    cfg = TokenReductionConfig(keep_ratio=0.7, anchors=ssm_layers(hybrid_model(name))[:2])
    for loader in (getattr(transformers, FAMILIES[name].lm_class), transformers.AutoModelForCausalLM):
        model = loader.from_pretrained(tmp_path, token_reduction=cfg).eval()
        assert type(model).__name__ == FAMILIES[name].lm_class
        with torch.no_grad():
            assert len(model(prompt(24)).plans) == 2
    model.save_pretrained(tmp_path / "reduced")
    assert transformers.AutoConfig.from_pretrained(tmp_path / "reduced").token_reduction["anchors"] == list(cfg.anchors)
    no_ssm = [i for i in range(model.config.num_hidden_layers - 1) if i not in ssm_layers(model)]
    if no_ssm:  # (every Falcon-H1 layer has an SSM mixer)
        with pytest.raises(ValueError, match="not SSM layers"):
            loader.from_pretrained(tmp_path, token_reduction=TokenReductionConfig(keep_ratio=0.7, anchors=no_ssm[:1]))


@pytest.mark.parametrize("name", HYBRIDS)
def test_model_card_figures_use_the_hybrid_schedule(name):
    """The variant card's analytic figures resolve the schedule as the model does (anchors on SSM layers, a FLOPs
    target met by the layer-weighted count), not the pure-Mamba rule."""
    from hf_tokred.hub.card import analytic_flops

    config = random_config(f"{name}-tiny")
    cfg = TokenReductionConfig(flops_reduction=0.2)
    card = analytic_flops(config, cfg)
    schedule = resolve_schedule(cfg, config)
    kinds = FAMILIES[name].kinds(config)
    assert card["anchors"] == list(schedule.anchors) and all(kinds[a] in ANCHOR_KINDS for a in card["anchors"])
    assert card["keep_ratio"] == schedule.keep_ratio


def test_default_anchors_snap_to_ssm_layers_by_hand():
    """``ssm_anchors``: each anchor moves to the last SSM layer at or before it; anchors with none before them,
    duplicates and the last block (nothing after it to save) are dropped (hand-computed)."""
    from hf_tokred.schedule import ssm_anchors

    ssm = [1, 2, 4, 7]
    assert ssm_anchors([0, 2, 3, 5, 7], ssm, 8) == (2, 4)  # 0: no SSM layer before; 2, 3 -> 2; 7 is the last block
    assert ssm_anchors([0, 2, 3, 5, 7], ssm, 9) == (2, 4, 7)  # block 7 of 9 has one block after it
    assert ssm_anchors([6], ssm, 10) == (4,)


def test_the_largest_reachable_target_is_accepted_and_one_beyond_is_refused():
    """``solve_keep_ratio`` at its edge: exactly the reduction of the minimum keep ratio (and that plus float noise)
    solves to the minimum keep ratio; a target 1e-9 beyond it is refused, naming the reachable maximum."""
    from hf_tokred.schedule import schedule_reduction, solve_keep_ratio

    for costs in (None, [(1.0, 0.5)] * 12):
        reach = schedule_reduction(12, [2, 5], 0.5, costs)
        for target in (reach, reach + 1e-13):
            assert solve_keep_ratio(12, [2, 5], target, 0.5, costs) == pytest.approx(0.5, abs=1e-9)
        with pytest.raises(ValueError, match="not reachable"):
            solve_keep_ratio(12, [2, 5], reach + 1e-9, 0.5, costs)


# ----------------------------------------------------------------------------- generation, budgets, shapes (issue 23)


@pytest.mark.parametrize("name", HYBRIDS)
def test_generate_with_and_without_a_cache_agree(name):
    """``use_cache`` changes speed only: greedy and sampled generation after a reduced prefill give the same tokens
    with the cache and without it (a no-cache step re-runs prompt + generated tokens, reducing the prompt alike)."""
    model = reduce(hybrid_model(name))
    ids = prompt(20, batch=2, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kw = dict(attention_mask=mask, max_new_tokens=5, pad_token_id=1)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, do_sample=False, **kw),
                           model.generate(ids, do_sample=False, use_cache=False, **kw))
        torch.manual_seed(7)
        sampled = model.generate(ids, do_sample=True, **kw)
        torch.manual_seed(7)
        assert torch.equal(model.generate(ids, do_sample=True, use_cache=False, **kw), sampled)


@pytest.mark.parametrize("name", HYBRIDS)
def test_keep_tokens_budget(name):
    """A token budget on a hybrid (the long-context default method re-runs each anchor on what it keeps): each row
    keeps at most ``keep_tokens`` real tokens after the last anchor, and every decode step equals a fresh forward."""
    model = hybrid_model(name)
    apply_token_reduction(model, TokenReductionConfig(keep_tokens=9, anchors=ssm_layers(model)[:2]))
    ids = prompt(24, batch=2, seed=6)
    with torch.no_grad():
        out = model(ids, use_cache=False)
        gen = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=1, output_logits=True,
                             return_dict_in_generate=True)
    assert (out.kept_positions >= 0).sum(1).tolist() == [9, 9]
    for t, step_logits in enumerate(gen.logits):
        with torch.no_grad(), generation_prompt(24, None):
            fresh = model(gen.sequences[:, : 24 + t], use_cache=False).logits[:, -1]
        torch.testing.assert_close(step_logits, fresh, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", [n for n in HYBRIDS if "1b" in FAMILIES[n].sizes])
def test_1b_shapes_have_about_a_billion_parameters(name):
    """``random:<family>-1b`` (the bench shape) is built on the meta device and counted: 0.9 to 1.5 B parameters."""
    config = random_config(f"{name}-1b")
    with torch.device("meta"):
        model = getattr(transformers, FAMILIES[name].lm_class)(config)
    assert 0.9e9 < sum(p.numel() for p in model.parameters()) < 1.5e9


def test_jamba_fast_kernels_are_installed_and_equal_stock():
    """hf_tokred's CPU Mamba-1 kernels (selective scan, convolution) replace Jamba's own, and a dense forward with a
    cache (logits, final SSM states) and a decode step equal transformers' loop (fp32, atol 1e-5)."""
    module = importlib.import_module(FAMILIES["jamba"].modeling_module)
    assert module.mamba_selective_scan is fastpath.REPLACEMENTS[module]["mamba_selective_scan"]
    assert module.causal_conv1d_fn is fastpath.REPLACEMENTS[module]["causal_conv1d_fn"]
    model = hybrid_model("jamba")
    ids, nxt = prompt(40, batch=2), torch.tensor([[5], [7]])
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    outs = []
    for ctx in (stock_transformers, contextlib.nullcontext):
        with torch.no_grad(), ctx():
            out = model(ids, attention_mask=mask, use_cache=True)
            cache = cache_of(out, hybrid=True)
            states = [cache.layers[i].recurrent_states[0].clone() for i in ssm_layers(model)]
            step = model(nxt, attention_mask=F.pad(mask, (0, 1), value=1), **layer_cache_kwargs(cache), use_cache=True)
        outs.append((out.logits, states, step.logits))
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["jamba", "falcon_h1", "zamba2"])
def test_generate_and_bench_commands_on_a_random_tiny_model(name, capsys):
    assert main(["generate", "hello there", "--model", f"random:{name}-tiny", "--keep-ratio", "0.7",
                 "--max-new-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_reduction"]["keep_ratio"] == 0.7
    result = run_bench(f"random:{name}-tiny", length=48, flops=(0.3,), repeats=1, warmup=0, decode_tokens=2,
                       progress=False)
    dense, reduced = result["rows"]
    assert dense["kv_cache_mib"] > reduced["kv_cache_mib"] > 0 and reduced["flops_reduction_exact"] > 0.1


# ----------------------------------------------------------------------------- Falcon-H1: attention beside the mixer

_MUP = dict(embedding_multiplier=2.5, lm_head_multiplier=0.7, ssm_multipliers=[1.2, 0.8, 1.1, 0.9, 1.3],
            mlp_multipliers=[1.3, 0.8], key_multiplier=0.9, attention_in_multiplier=1.2, attention_out_multiplier=0.6,
            ssm_in_multiplier=1.1, ssm_out_multiplier=0.5)


def test_falcon_h1_keep_ratio_one_equals_stock_with_mup_multipliers():
    """Falcon-H1's μP multipliers (embeddings, logits, both branches' inputs and outputs, the μP vector on the mixer's
    projections, keys, MLP) at values other than 1: the anchors split into branches still equal stock, from ids and
    from ``inputs_embeds`` (which stock does not scale by the embedding multiplier)."""
    model = hybrid_model("falcon_h1", **_MUP)
    test_keep_ratio_one_equals_stock(model)
    embeds = model.model.embed_tokens(prompt(20, batch=2)).detach()
    ref = stock(model, lambda: model(inputs_embeds=embeds).logits)
    with torch.no_grad():
        torch.testing.assert_close(model(inputs_embeds=embeds).logits, ref, atol=ATOL, rtol=0)
    assert model.config.embedding_multiplier == 2.5 and model.model.layers[0].ssm_out_multiplier == 0.5


def _branch_outputs(model, layer: int, ids):
    """The scaled outputs of layer ``layer``'s Mamba-2 and attention branches in a dense forward (stock)."""
    block = model.model.layers[layer]
    seen = {}
    hooks = [block.mamba.register_forward_hook(lambda m, a, o: seen.update(ssm=o * block.ssm_out_multiplier)),
             block.self_attn.register_forward_hook(lambda m, a, o: seen.update(attn=o[0] * block.attn_out_multiplier))]
    try:
        stock(model, lambda: model(ids))
    finally:
        for h in hooks:
            h.remove()
    return seen["ssm"], seen["attn"]


def test_falcon_h1_plan_comes_from_the_mamba_branch():
    """EViT with the l2 metric keeps the last token and the tokens whose anchor output has the largest norm: by hand,
    from the Mamba branch's scaled output (captured in a stock forward), not from the sum of both branches (which
    keeps other tokens here)."""
    model = hybrid_model("falcon_h1", **_MUP)
    apply_token_reduction(model, TokenReductionConfig(method="evit", metric="l2", keep_ratio=0.5, anchors=[1]))
    ids = prompt(20, seed=8)
    ssm, attn = _branch_outputs(model, 1, ids)
    with torch.no_grad():
        kept = model(ids, use_cache=False).kept_positions[0].tolist()

    def by_hand(h):
        top = h[0, :-1].norm(dim=-1).topk(len(kept) - 1).indices
        return sorted(top.tolist()) + [19]

    assert kept == by_hand(ssm) != by_hand(ssm + attn)


def test_falcon_h1_every_later_layer_sees_one_reduced_sequence():
    """After an anchor both branches of every later layer read the same reduced columns, and each layer's KV cache
    holds the columns its attention saw: the anchor's the unreduced ones (its attention runs beside its mixer)."""
    model = reduce(hybrid_model("falcon_h1"))  # anchors 0 and 1
    lengths = {}

    def seen(key):
        def hook(module, args, kwargs):
            lengths[key] = (args[0] if args else kwargs["hidden_states"]).shape[1]
        return hook

    hooks = [m.register_forward_pre_hook(seen((i, name)), with_kwargs=True)
             for i, layer in enumerate(model.model.layers) for name, m in (("ssm", layer.mamba), ("attn", layer.self_attn))]
    with torch.no_grad():
        out = model(prompt(24), use_cache=True)
    for h in hooks:
        h.remove()
    (_, p0), (_, p1) = out.plans
    M0, M1 = p0.keep.shape[1], p1.keep.shape[1]
    assert 24 > M0 > M1
    assert [lengths[i, "ssm"] for i in range(4)] == [lengths[i, "attn"] for i in range(4)] == [24, M0, M1, M1]
    assert [out.cache.get_seq_length(i) for i in range(4)] == [24, M0, M1, M1]


_SCANS = {"jamba": "mamba_selective_scan", "falcon_h1": "mamba2_chunk_scan"}


def _stock_step_sizes(model, ids, layer: int):
    """The mean step size per token of layer ``layer``'s SSM, from the arguments transformers' own scan receives in
    a stock forward (Jamba: ``softplus(dt + delta_bias)`` over the channels; Falcon-H1: ``softplus(dt + dt_bias)``
    clamped to ``dt_limit``, over the heads)."""
    name = model.config.model_type
    module = importlib.import_module(FAMILIES[name].modeling_module)
    original, calls = STOCK.modules[module][_SCANS[name]], []

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    STOCK.modules[module][_SCANS[name]] = recording  # what stock_transformers() puts in place
    try:
        stock(model, lambda: model(ids))
    finally:
        STOCK.modules[module][_SCANS[name]] = original
    args, kwargs = calls[ssm_layers(model).index(layer)]
    if name == "jamba":
        return F.softplus(args[1] + kwargs["delta_bias"][:, None]).mean(1)
    low, high = kwargs["dt_limit"]
    return F.softplus(args[1] + kwargs["dt_bias"]).clamp(low, high).mean(-1)


@pytest.mark.parametrize("name", list(_SCANS))
def test_delta_metric_is_the_stock_scans_mean_step_size(name):
    """EViT with the ``delta`` metric keeps the last token and the tokens with the largest mean step size at the
    anchor: by hand, from what transformers' own scan receives (Falcon-H1's μP vector scales ``dt``)."""
    model = hybrid_model(name, **(_MUP if name == "falcon_h1" else {}))
    anchor = ssm_layers(model)[1]
    apply_token_reduction(model, TokenReductionConfig(method="evit", metric="delta", keep_ratio=0.5, anchors=[anchor]))
    ids = prompt(20, seed=9)
    step = _stock_step_sizes(model, ids, anchor)
    with torch.no_grad():
        kept = model(ids, use_cache=False).kept_positions[0].tolist()
    assert kept == sorted(step[0, :-1].topk(len(kept) - 1).indices.tolist()) + [19]


# ----------------------------------------------------------------------------- Zamba2: the shared block's embeddings


def _merged_by_hand(x: torch.Tensor, plan) -> torch.Tensor:
    """``x [B, N, D]`` after a plan whose strategy merges every removed token into its destination: each kept
    column is the mean of its own row and the rows merged into it (written from the definition, row by row)."""
    B, M = plan.keep.shape
    out = torch.zeros(B, M, x.shape[-1])
    for b in range(B):
        for j in range(M):
            if not plan.keep_mask[b, j]:
                continue
            rows = [int(plan.keep[b, j])] + [int(plan.src[b, r]) for r in range(plan.src.shape[1])
                                             if plan.src_mask[b, r] and int(plan.dst_slot[b, r]) == j]
            out[b, j] = x[b, rows].mean(0)
    return out


@pytest.mark.parametrize("method", ["evit", "utrc"])
def test_zamba2_shared_block_reads_the_original_embeddings_of_the_kept_tokens(method):
    """After the anchors, Zamba2's shared attention block reads the original embeddings reduced by the same plans as
    the hidden states (EViT prunes: the kept tokens' own embeddings; UTRC merges the residual stream: each kept
    column's embedding averaged with those merged into it, anchor by anchor, by hand), and its rotary embeddings at
    the kept tokens' original positions."""
    model = hybrid_model("zamba2")
    apply_token_reduction(model, TokenReductionConfig(method=method, keep_ratio=0.7, anchors=ssm_layers(model)[:2]))
    layer = attention_after_anchors(model)[0]
    seen = {}
    hook = model.model.layers[layer].shared_transformer.register_forward_hook(
        lambda m, args, kwargs, out: seen.update(kwargs), with_kwargs=True)
    ids = prompt(24, batch=2, seed=10)
    with torch.no_grad():
        out = model(ids, use_cache=False)
        embeddings = model.model.embed_tokens(ids)
    hook.remove()
    (_, p0), (_, p1) = out.plans
    if method == "evit":
        want = embeddings.gather(1, out.kept_positions[..., None].expand(-1, -1, embeddings.shape[-1]))
    else:
        want = _merged_by_hand(_merged_by_hand(embeddings, p0), p1)
    torch.testing.assert_close(seen["original_hidden_states"], want, atol=ATOL, rtol=0)
    cos, sin = model.model.rotary_emb(embeddings, out.kept_positions)
    torch.testing.assert_close(seen["position_embeddings"][0], cos, atol=0, rtol=0)
    torch.testing.assert_close(seen["position_embeddings"][1], sin, atol=0, rtol=0)
