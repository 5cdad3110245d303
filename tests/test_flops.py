"""Tests for hf_tokred.flops: analytic counts vs the ops stock transformers' forward actually dispatches.

Two independent counts of a tiny model's forward (transformers' own code: ``conftest.stock_transformers``):

* ``FlopCounterMode`` for the matmul / conv kernels (torch's own formulas);
* :class:`DispatchCount`, a dispatch mode that sees every aten op the forward runs, attributes it to a component
  (norm, projection, conv, scan, LM head, block residual) and counts element-wise arithmetic by the module's
  convention: ``add/sub/mul/div/pow`` one FLOP per output element, ``sum/mean/cumsum`` one per input element, a
  conv / linear bias one per output element; transcendentals, masking and copies none.

Every field of the analytic breakdown must equal the dispatched count exactly (tolerance 0), up to two
conventions of the analytic count, stated here by hand: the RMSNorm's ``+ eps`` (one add per token per norm) is
not counted, and the Mamba-1 scan is counted as ``9 B L D N`` where the stock loop dispatches ``7 B L D N``
(5 element-wise, 2 in the ``C . h`` matmul).
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry
from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM
from transformers.models.mamba import modeling_mamba
from transformers.models.mamba2 import modeling_mamba2

from hf_tokred.flops import (
    FlopsBreakdown,
    flops_reduction,
    layer_flops,
    model_flops,
    measured_proxy_reduction as proxy_flops_reduction,
)

from conftest import stock_transformers

BATCH = 2


def _mamba1_config() -> MambaConfig:
    return MambaConfig(vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2)


def _mamba2_config() -> Mamba2Config:
    return Mamba2Config(
        vocab_size=256,
        hidden_size=64,
        state_size=16,
        num_hidden_layers=2,
        expand=2,
        num_heads=8,
        head_dim=16,
        n_groups=1,
        chunk_size=16,
    )


_BUILDERS = {
    "mamba": (_mamba1_config, MambaForCausalLM),
    "mamba2": (_mamba2_config, Mamba2ForCausalLM),
}
_MODELS: dict[str, torch.nn.Module] = {}


def _model(kind: str) -> torch.nn.Module:
    if kind not in _MODELS:
        make_config, cls = _BUILDERS[kind]
        torch.manual_seed(0)
        _MODELS[kind] = cls(make_config()).eval()
    return _MODELS[kind]


# ----------------------------------------------------------------------------- 1. full forward


@pytest.mark.parametrize(
    ("kind", "seq_len"),
    [("mamba", 5), ("mamba", 23), ("mamba2", 5), ("mamba2", 16), ("mamba2", 37)],
)
def test_full_forward_matmul_matches_flop_counter(kind: str, seq_len: int) -> None:
    model = _model(kind)
    input_ids = torch.randint(0, model.config.vocab_size, (BATCH, seq_len))
    with torch.no_grad(), stock_transformers(), FlopCounterMode(display=False) as counter:
        model(input_ids, use_cache=False)
    counted = counter.get_total_flops()
    analytic = model_flops(model.config, [seq_len] * model.config.num_hidden_layers, batch=BATCH)
    assert analytic.matmul == counted
    assert analytic.total > analytic.matmul  # elementwise work exists but is invisible to the counter
    # The conv is a small share of the total, so check it on its own: HF's padded conv1d computes
    # L+K-1 positions.  Without the (elementwise) bias, `conv` is exactly the conv kernel's FLOPs.
    no_bias = copy.deepcopy(model.config)
    no_bias.use_conv_bias = False
    conv_counted = counter.get_flop_counts()["Global"][torch.ops.aten.convolution]
    assert model_flops(no_bias, [seq_len] * no_bias.num_hidden_layers, batch=BATCH).conv == conv_counted


# ----------------------------------------------------------------------------- 2. per-layer lengths


def _count_reduced_forward(model: torch.nn.Module, lengths: list[int], head_positions: int) -> int:
    """Run each block on a prefix of the previous block's output, as a token-reduction schedule would."""
    input_ids = torch.randint(0, model.config.vocab_size, (BATCH, max(lengths)))
    with torch.no_grad(), stock_transformers(), FlopCounterMode(display=False) as counter:
        hidden = model.backbone.embeddings(input_ids)
        for block, length in zip(model.backbone.layers, lengths):
            hidden = block(hidden[:, :length])
        hidden = model.backbone.norm_f(hidden)
        model.lm_head(hidden[:, hidden.shape[1] - head_positions :])
    return counter.get_total_flops()


@pytest.mark.parametrize(
    ("kind", "lengths", "head_positions"),
    [
        ("mamba", [21, 9], 9),
        ("mamba", [12, 4], 1),
        ("mamba2", [37, 20], 20),  # neither a multiple of chunk_size=16
        ("mamba2", [32, 7], 1),
    ],
)
def test_per_layer_lengths_match_flop_counter(kind: str, lengths: list[int], head_positions: int) -> None:
    model = _model(kind)
    counted = _count_reduced_forward(model, lengths, head_positions)
    analytic = model_flops(model.config, lengths, batch=BATCH, lm_head_positions=head_positions)
    assert analytic.matmul == counted
    # The per-layer schedule really differs from a dense one at the first length.
    dense = model_flops(model.config, [lengths[0]] * len(lengths), batch=BATCH, lm_head_positions=head_positions)
    assert dense.matmul != analytic.matmul


def test_model_flops_is_sum_of_layers_plus_head() -> None:
    config = _mamba2_config()
    lengths = [37, 20]
    summed = layer_flops(config, 37, BATCH) + layer_flops(config, 20, BATCH)
    full = model_flops(config, lengths, batch=BATCH)
    d, vocab = config.hidden_size, config.vocab_size
    assert full.lm_head == 2 * BATCH * 20 * d * vocab
    assert full.norm == summed.norm + 4 * BATCH * 20 * d  # + norm_f on the last length
    assert (full.projections, full.conv, full.scan) == (summed.projections, summed.conv, summed.scan)


def test_mamba1_scan_convention() -> None:
    config = _mamba1_config()
    B, L, D, N = 3, 10, config.intermediate_size, config.state_size
    assert layer_flops(config, L, B).scan == 9 * B * L * D * N + 2 * B * L * D + B * L * D


def test_mamba2_scan_depends_on_chunk_padding() -> None:
    config = _mamba2_config()  # chunk_size 16: 17 tokens are padded to 32
    assert layer_flops(config, 17).scan > layer_flops(config, 16).scan + (layer_flops(config, 16).scan // 16) * 2


# ----------------------------------------------------------------------------- 3. reductions


@pytest.mark.parametrize(
    ("lengths", "dense", "expected"),
    [([10, 10, 5, 5], 10, 0.25), ([8, 8], 8, 0.0), ([4, 2, 1, 1], 4, 0.5), ([3], 4, 0.25)],
)
def test_proxy_flops_reduction_hand_computed(lengths: list[int], dense: int, expected: float) -> None:
    assert proxy_flops_reduction(lengths, dense) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("make_config", [_mamba1_config, _mamba2_config])
def test_flops_reduction_dense_is_zero(make_config) -> None:
    config = make_config()
    assert flops_reduction(config, [48, 48], dense_length=48) == 0.0
    assert flops_reduction(config, [48, 48], 48, lm_head_positions=1, dense_lm_head_positions=1) == 0.0


@pytest.mark.parametrize("make_config", [_mamba1_config, _mamba2_config])
def test_exact_reduction_close_to_proxy_without_lm_head(make_config) -> None:
    config = make_config()
    # Multiples of chunk_size, long enough that the conv's constant K-1 padding is negligible, and few
    # enough chunks that Mamba-2's (n_chunks+1)^2 inter-chunk term stays small (it grows the gap).
    lengths, dense = [64, 32], 64
    proxy = proxy_flops_reduction(lengths, dense)
    assert proxy == pytest.approx(0.25)
    exact = flops_reduction(config, lengths, dense, lm_head_positions=0, dense_lm_head_positions=0)
    assert exact == pytest.approx(proxy, abs=0.01)
    # With the LM head on all (fewer) final positions, the exact reduction differs from the proxy.
    with_head = flops_reduction(config, lengths, dense)
    assert abs(with_head - proxy) > 0.02


# ----------------------------------------------------------------------------- 4. bad inputs


def test_unsupported_model_type_is_rejected() -> None:
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match=r"model_type='llama'.*mamba, mamba2"):
        layer_flops(LlamaConfig(), 8)
    with pytest.raises(ValueError, match="model_type"):
        model_flops(object(), [8, 8])


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c: layer_flops(c, 0), "seq_len"),
        (lambda c: layer_flops(c, -3), "seq_len"),
        (lambda c: layer_flops(c, 4, batch=0), "batch"),
        (lambda c: model_flops(c, []), "layer_lengths must not be empty"),
        (lambda c: model_flops(c, [8, 0]), r"layer_lengths\[1\]"),
        (lambda c: model_flops(c, [-1, 8]), r"layer_lengths\[0\]"),
        (lambda c: model_flops(c, [8, 8, 8]), "layer_lengths has 3 entries"),
        (lambda c: model_flops(c, [8, 4], lm_head_positions=5), "lm_head_positions"),
        (lambda c: model_flops(c, [8, 4], lm_head_positions=-1), "lm_head_positions"),
        (lambda c: flops_reduction(c, [8, 4], dense_length=0), "dense_length"),
        (lambda c: proxy_flops_reduction([], 8), "layer_lengths"),
        (lambda c: proxy_flops_reduction([8, 0], 8), r"layer_lengths\[1\]"),
        (lambda c: proxy_flops_reduction([8, 8], -2), "dense_length"),
        (lambda c: model_flops(c, 48), "layer_lengths must be a sequence"),
        (lambda c: model_flops(c, "48"), "layer_lengths must be a sequence"),
        (lambda c: model_flops(c, [8.0, 8]), r"layer_lengths\[0\] must be an integer"),
        (lambda c: model_flops(c, [True, 8]), r"layer_lengths\[0\] must be an integer"),
        (lambda c: layer_flops(c, 4, batch=2.5), "batch must be an integer"),
        (lambda c: model_flops(c, [8, 8], batch=0), "batch must be >= 1"),
        (lambda c: flops_reduction(c, [8, 4], dense_length=8, batch=0), "batch must be >= 1"),
        (lambda c: proxy_flops_reduction([8, 8], 0), "dense_length must be >= 1"),
        (lambda c: flops_reduction(c, [8, 4], dense_length=0), "dense_length must be >= 1"),
    ],
)
def test_bad_inputs_name_the_field(call, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        call(_mamba1_config())


@pytest.mark.parametrize("make_config", [_mamba1_config, _mamba2_config])
def test_defaults_and_the_smallest_valid_inputs(make_config) -> None:
    """batch defaults to 1 (each count is linear in the batch); one token, one position, a dense length of 1 are
    valid inputs, not errors."""
    config = make_config()
    assert model_flops(config, [8, 3]) == model_flops(config, [8, 3], batch=1)
    assert layer_flops(config, 5) == layer_flops(config, 5, batch=1)
    doubled = model_flops(config, [8, 3], batch=2)
    assert all(getattr(doubled, f) == 2 * getattr(model_flops(config, [8, 3]), f)
               for f in ("projections", "conv", "scan", "norm", "lm_head", "elementwise"))
    one = layer_flops(config, 1)
    assert one.total > 0 and one.matmul > 0
    assert model_flops(config, [1, 1], lm_head_positions=1).lm_head == 2 * config.hidden_size * config.vocab_size
    assert flops_reduction(config, [1, 1], dense_length=1) == 0.0 and proxy_flops_reduction([1, 1], 1) == 0.0
    assert flops_reduction(config, [8, 3], 8) == flops_reduction(config, [8, 3], 8, batch=3)  # a ratio


def test_breakdown_matmul_and_total() -> None:
    b = FlopsBreakdown(projections=10, conv=5, scan=7, norm=4, lm_head=3, elementwise=6)
    assert b.total == 29
    assert b.matmul == 23
    assert (b + b).total == 58


# ----------------------------------------------------------------------------- 5. every term, against the dispatched ops

_EW_OUT = {"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "pow"}  # one FLOP per output element
_EW_IN = {"sum", "mean", "cumsum"}  # one FLOP per input element


class DispatchCount(TorchDispatchMode):
    """Every aten op a forward dispatches, attributed to the innermost tagged region: FLOPs of matmul / conv kernels
    (torch's formulas) and of element-wise arithmetic (see the module docstring), per region and kind."""

    def __init__(self):
        super().__init__()
        self.region = ["block"]
        self.flops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op, region = func._overloadpacket, self.region[-1]
        name = op.__name__
        if op in flop_registry:
            self.flops[region, "mm"] += flop_registry[op](*args, **kwargs, out_val=out)
            bias = args[0] if name == "addmm" else args[2] if name == "convolution" else None
            if bias is not None:
                self.flops[region, "bias"] += out.numel()
        elif name in _EW_OUT:
            # the Mamba-1 scan adds the dt_proj bias ([D] broadcast over [B, D, L]): the analytic count books it
            # under the projections
            is_dt_bias = region == "scan" and name == "add" and any(
                isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[-1] == 1 for a in args)
            kind = "dt_bias" if is_dt_bias else "bias" if region == "proj" else "ew"  # linear bias, unfused
            self.flops[region, kind] += out.numel()
        elif name in _EW_IN:
            self.flops[region, "ew"] += args[0].numel()
        return out

    def tagged(self, fn, region):
        def wrapper(*args, **kwargs):
            self.region.append(region)
            try:
                return fn(*args, **kwargs)
            finally:
                self.region.pop()

        return wrapper


def region_hooks(model, counter: DispatchCount) -> list:
    """Tag the ops each module dispatches with its region (LM head, linears, norms, the rest of the mixer);
    returns the hook handles to remove."""
    hooks = []
    for name, module in model.named_modules():
        region = ("lm_head" if name == "lm_head" else "proj" if isinstance(module, torch.nn.Linear)
                  else "norm" if "RMSNorm" in type(module).__name__ else "mixer" if name.endswith("mixer") else None)
        if region is not None:
            hooks.append(module.register_forward_pre_hook(lambda m, a, r=region: counter.region.append(r) and None))
            hooks.append(module.register_forward_hook(lambda m, a, o: counter.region.pop() and None))
    return hooks


def _dispatched(model, lengths, head_positions):
    """Run stock transformers' blocks on per-layer prefixes (as a reduction schedule would) and count."""
    counter = DispatchCount()
    hooks = region_hooks(model, counter)
    family = modeling_mamba if model.config.model_type == "mamba" else modeling_mamba2
    scan_name = "mamba_selective_scan" if model.config.model_type == "mamba" else "mamba2_chunk_scan"
    input_ids = torch.randint(0, model.config.vocab_size, (BATCH, max(lengths)))
    try:
        with torch.no_grad(), stock_transformers(), pytest.MonkeyPatch.context() as m:
            m.setattr(family, "causal_conv1d_fn", counter.tagged(family.causal_conv1d_fn, "conv"))
            m.setattr(family, scan_name, counter.tagged(getattr(family, scan_name), "scan"))
            hidden = model.backbone.embeddings(input_ids)
            with counter:
                for block, length in zip(model.backbone.layers, lengths):
                    hidden = block(hidden[:, :length])
                hidden = model.backbone.norm_f(hidden)
                model.lm_head(hidden[:, hidden.shape[1] - head_positions :])
    finally:
        for h in hooks:
            h.remove()
    return counter.flops


def _config(kind, use_bias, use_conv_bias, layers=2):
    config = (_mamba1_config if kind == "mamba" else _mamba2_config)()
    config.num_hidden_layers = layers
    if kind == "mamba2-groups":  # B and C shared by groups of heads
        config.n_groups = 2
    config.use_bias, config.use_conv_bias = use_bias, use_conv_bias
    return config


@pytest.mark.parametrize("kind, lengths, head_positions", [
    ("mamba", [23, 23], 23), ("mamba", [21, 9], 9), ("mamba", [12, 4], 1),
    ("mamba2", [23, 23], 23), ("mamba2", [37, 20], 20), ("mamba2", [32, 7], 1), ("mamba2", [16, 16], 16),
    ("mamba2-groups", [19, 11], 11), ("mamba", [20, 12, 5], 4), ("mamba2", [20, 12, 5], 5),
])
@pytest.mark.parametrize("use_bias, use_conv_bias", [(False, True), (True, False)], ids=["conv-bias", "linear-bias"])
def test_every_term_equals_the_dispatched_ops(kind, lengths, head_positions, use_bias, use_conv_bias):
    config = _config(kind, use_bias, use_conv_bias, layers=len(lengths))
    torch.manual_seed(0)
    model = (MambaForCausalLM if kind == "mamba" else Mamba2ForCausalLM)(config).eval()
    got = _dispatched(model, lengths, head_positions)
    kind = kind.split("-")[0]
    analytic = model_flops(config, lengths, batch=BATCH, lm_head_positions=head_positions)
    norms = 2 * len(lengths) if kind == "mamba2" else len(lengths)  # per-block RMSNorms (+ Mamba-2's gated norm)
    # the gated norm's groups as this transformers release computes them (5.22 normalises the whole width at once,
    # later releases each of the n_groups groups, as mamba_ssm does): one eps add per group and token
    norm = getattr(model.backbone.layers[0].mixer, "norm", None)
    group_count = 1 if kind == "mamba" else config.expand * config.hidden_size // getattr(
        norm, "group_size", config.expand * config.hidden_size)
    eps_adds = BATCH * (sum(lengths) * (1 + (group_count if kind == "mamba2" else 0)) + lengths[-1])
    if kind == "mamba":
        convention = sum(2 * BATCH * L * config.intermediate_size * config.state_size for L in lengths)
    else:
        convention = 0
    assert norms > 0
    assert analytic.lm_head == got["lm_head", "mm"] > 0
    assert analytic.conv == got["conv", "mm"] + got["conv", "bias"]
    assert (got["conv", "bias"] > 0) == use_conv_bias
    assert analytic.norm == got["norm", "ew"] - eps_adds  # the + eps of every RMSNorm is not counted
    assert analytic.projections == (got["proj", "mm"] + got["proj", "bias"] + got["mixer", "mm"] + got["scan", "dt_bias"]
                                    + got["block", "ew"])  # linears, dt_proj (Mamba-1), biases, residual adds
    assert (got["proj", "bias"] > 0) == use_bias and (got["scan", "dt_bias"] > 0) == (kind == "mamba")
    assert analytic.scan == got["scan", "mm"] + got["scan", "ew"] + convention
    assert got["mixer", "ew"] == got["mixer", "bias"] == got["block", "mm"] == got["scan", "bias"] == got["proj", "ew"] == 0
    counted_ew = (got["conv", "bias"] + got["norm", "ew"] - eps_adds + got["proj", "bias"] + got["scan", "dt_bias"]
                  + got["block", "ew"] + got["scan", "ew"] + convention)
    assert analytic.elementwise == counted_ew
    assert analytic.matmul == got["lm_head", "mm"] + got["conv", "mm"] + got["proj", "mm"] + got["mixer", "mm"] + got[
        "scan", "mm"]
    assert analytic.total == sum(got.values()) - eps_adds + convention


def test_mamba1_scan_convention_is_what_the_docstring_enumerates_plus_two():
    """The Mamba-1 scan's ``9 B L D N`` (flops module docstring) against the ops it enumerates: dt*A, dt*B, dt*B*u,
    h = dA*h + dBu (2) and C.h (2) make 7 per (b, l, d, n), the number the stock loop dispatches."""
    config = _mamba1_config()
    model = MambaForCausalLM(config).eval()
    got = _dispatched(model, [10, 10], 10)
    B, L, D, N = BATCH, 10, config.intermediate_size, config.state_size
    per_scan = got["scan", "mm"] + got["scan", "ew"]
    assert per_scan == 2 * (7 * B * L * D * N + 3 * B * L * D)  # 2 layers: + D skip (2 BLD), gate (BLD)
    assert layer_flops(config, L, B).scan == 9 * B * L * D * N + 3 * B * L * D


@pytest.mark.parametrize("make_config", [_mamba1_config, _mamba2_config])
def test_layer_zero_of_a_pure_model_is_its_every_layer(make_config):
    """Pure families: every layer costs the same, ``layer=0`` (the first block) included; a negative layer is
    refused."""
    config = make_config()
    assert layer_flops(config, 17, 2, layer=0) == layer_flops(config, 17, 2) == layer_flops(config, 17, 2, layer=1)
    with pytest.raises(ValueError, match="layer"):
        layer_flops(config, 17, 2, layer=-1)


@pytest.mark.parametrize("make_config", [_mamba1_config, _mamba2_config])
def test_lm_head_defaults_to_every_position_of_the_last_block(make_config):
    """Without ``lm_head_positions`` the head runs on every token the last block computed (by hand:
    ``2 * B * P * d * V`` with ``P = layer_lengths[-1]``), not on another block's length."""
    config = make_config()
    config.num_hidden_layers = 3
    got = model_flops(config, [20, 12, 5], batch=2)
    assert got.lm_head == 2 * 2 * 5 * config.hidden_size * config.vocab_size
