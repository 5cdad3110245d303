"""Tests for hf_tokred.flops: analytic counts vs torch's FlopCounterMode on tiny random models."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

from hf_tokred import fastpath  # the analytic count describes transformers' own ops
from hf_tokred.flops import (
    FlopsBreakdown,
    flops_reduction,
    layer_flops,
    model_flops,
    proxy_flops_reduction,
)

BATCH = 2
REL_TOL = 0.01


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


def _rel_diff(analytic: int, counted: int) -> float:
    return abs(analytic - counted) / counted


# ----------------------------------------------------------------------------- 1. full forward


@pytest.mark.parametrize(
    ("kind", "seq_len"),
    [("mamba", 5), ("mamba", 23), ("mamba2", 5), ("mamba2", 16), ("mamba2", 37)],
)
def test_full_forward_matmul_matches_flop_counter(kind: str, seq_len: int) -> None:
    model = _model(kind)
    input_ids = torch.randint(0, model.config.vocab_size, (BATCH, seq_len))
    with torch.no_grad(), fastpath.stock_kernels(), FlopCounterMode(display=False) as counter:
        model(input_ids, use_cache=False)
    counted = counter.get_total_flops()
    analytic = model_flops(model.config, [seq_len] * model.config.num_hidden_layers, batch=BATCH)
    assert _rel_diff(analytic.matmul, counted) < REL_TOL, (analytic.matmul, counted)
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
    with torch.no_grad(), fastpath.stock_kernels(), FlopCounterMode(display=False) as counter:
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
    assert _rel_diff(analytic.matmul, counted) < REL_TOL, (analytic.matmul, counted)
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
    ],
)
def test_bad_inputs_name_the_field(call, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        call(_mamba1_config())


def test_breakdown_matmul_and_total() -> None:
    b = FlopsBreakdown(projections=10, conv=5, scan=7, norm=4, lm_head=3, elementwise=6)
    assert b.total == 29
    assert b.matmul == 23
    assert (b + b).total == 58
