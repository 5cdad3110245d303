"""Tests for ``hf_tokred.scan.selective_scan`` against transformers' per-step reference loop.

The reference is ``conftest.STOCK.mamba_selective_scan``: transformers' own function, captured before
``import hf_tokred`` rebinds ``modeling_mamba.mamba_selective_scan`` to the plugin's dispatcher.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from transformers import MambaConfig, MambaForCausalLM
from transformers.models.mamba import modeling_mamba

from hf_tokred import fastpath
from hf_tokred.ops.scan import selective_scan

from conftest import STOCK, examples, stock_transformers

mamba_selective_scan = STOCK.mamba_selective_scan  # transformers' own loop, not the plugin's dispatcher

ATOL = 1e-5


def make_inputs(
    batch: int = 2,
    d_inner: int = 32,
    n_state: int = 16,
    length: int = 100,
    seed: int = 0,
    dt_shift: float = -2.0,
) -> dict[str, torch.Tensor]:
    """Random fp32 scan inputs; ``dt_shift`` sets the pre-softplus time-step level (larger = faster decay)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, d_inner, length, generator=g),
        "dt": 0.5 * torch.randn(batch, d_inner, length, generator=g) + dt_shift,
        "A": -torch.exp(torch.randn(d_inner, n_state, generator=g)),
        "B": torch.randn(batch, n_state, length, generator=g),
        "C": torch.randn(batch, n_state, length, generator=g),
        "D": torch.randn(d_inner, generator=g),
        "z": torch.randn(batch, d_inner, length, generator=g),
        "delta_bias": 0.1 * torch.randn(d_inner, generator=g),
    }


def loop_scan(inputs: dict[str, torch.Tensor], h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Obvious float64 loop: softplus(dt + bias), D skip, silu(z) gate, starting from state ``h0``."""
    u, A, B, C = (inputs[k].double() for k in ("hidden_states", "A", "B", "C"))
    dt = F.softplus(inputs["dt"].double() + inputs["delta_bias"].double()[:, None])
    h = h0.double()
    ys = []
    for t in range(u.shape[-1]):
        h = torch.exp(dt[:, :, t, None] * A) * h + (dt[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = (torch.stack(ys, dim=-1) + u * inputs["D"].double()[:, None]) * F.silu(inputs["z"].double())
    return y, h


def assert_matches_reference(
    inputs: dict[str, torch.Tensor], chunk_size: int | None = None, **flags: bool
) -> None:
    y_ref, state_ref = mamba_selective_scan(**inputs, return_last_state=True, **flags)
    y, state = selective_scan(**inputs, return_last_state=True, chunk_size=chunk_size, **flags)
    assert y.shape == y_ref.shape and y.dtype == torch.float32
    assert state.shape == state_ref.shape and state.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(state, state_ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("length", [1, 5, 48, 97, 200])
@pytest.mark.parametrize("chunk_size", [None, 1, 7, 64, 256])
def test_matches_transformers(length: int, chunk_size: int | None) -> None:
    assert_matches_reference(make_inputs(length=length), chunk_size, delta_softplus=True)


@pytest.mark.parametrize("chunk_size", [None, 16])
def test_matches_transformers_without_optional_inputs(chunk_size: int | None) -> None:
    inputs = make_inputs(length=77)
    inputs = {k: v for k, v in inputs.items() if k not in ("D", "z", "delta_bias")}
    inputs["dt"] = F.softplus(inputs["dt"])  # no softplus inside: dt must already be >= 0
    assert_matches_reference(inputs, chunk_size)


def test_strong_decay_is_stable() -> None:
    # softplus(dt) ~ 8 and |A| up to ~20: exp(dt * A) underflows to 0 within a step.
    inputs = make_inputs(length=150, dt_shift=8.0)
    inputs["A"] = inputs["A"] * 5
    inputs["hidden_states"] = inputs["hidden_states"] / 8  # keep y ~ O(1) for the absolute tolerance
    assert_matches_reference(inputs, 64, delta_softplus=True)
    assert torch.isfinite(selective_scan(**inputs, delta_softplus=True)).all()


@examples(8)
@given(
    batch=st.integers(1, 2),
    d_inner=st.integers(1, 12),
    n_state=st.integers(1, 8),
    length=st.integers(1, 60),
    chunk_size=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_matches_transformers_property(
    batch: int, d_inner: int, n_state: int, length: int, chunk_size: int, seed: int
) -> None:
    inputs = make_inputs(batch, d_inner, n_state, length, seed)
    assert_matches_reference(inputs, chunk_size, delta_softplus=True)


@pytest.mark.parametrize("length", [1, 37, 200])
@pytest.mark.parametrize("chunk_size", [None, 5, 64])
def test_initial_state_matches_loop(length: int, chunk_size: int | None) -> None:
    inputs = make_inputs(length=length, seed=1)
    h0 = torch.randn(2, 32, 16, generator=torch.Generator().manual_seed(2))
    y_loop, state_loop = loop_scan(inputs, h0)
    y, state = selective_scan(
        **inputs, delta_softplus=True, return_last_state=True, initial_state=h0, chunk_size=chunk_size
    )
    torch.testing.assert_close(y, y_loop.float(), atol=ATOL, rtol=0)
    torch.testing.assert_close(state, state_loop.float(), atol=ATOL, rtol=0)


def test_initial_state_splits_sequence() -> None:
    """Scanning two halves, passing the state along, equals scanning the whole sequence."""
    inputs = make_inputs(length=90, seed=3)
    y, state = selective_scan(**inputs, delta_softplus=True, return_last_state=True)
    first = {k: v[..., :41] if v.dim() == 3 else v for k, v in inputs.items()}
    second = {k: v[..., 41:] if v.dim() == 3 else v for k, v in inputs.items()}
    y1, s1 = selective_scan(**first, delta_softplus=True, return_last_state=True)
    y2, s2 = selective_scan(**second, delta_softplus=True, return_last_state=True, initial_state=s1)
    torch.testing.assert_close(torch.cat([y1, y2], dim=-1), y, atol=ATOL, rtol=0)
    torch.testing.assert_close(s2, state, atol=ATOL, rtol=0)


def test_empty_sequence_returns_initial_state() -> None:
    inputs = {k: v[..., :0] if v.dim() == 3 else v for k, v in make_inputs(length=4).items()}
    h0 = torch.randn(2, 32, 16)
    y, state = selective_scan(**inputs, return_last_state=True, initial_state=h0)
    assert y.shape == (2, 32, 0)
    torch.testing.assert_close(state, h0)


def test_low_precision_input_returns_input_dtype_and_fp32_state() -> None:
    inputs = make_inputs(length=40)
    low = {k: v.bfloat16() if k in ("hidden_states", "dt", "B", "C", "z") else v for k, v in inputs.items()}
    y, state = selective_scan(**low, delta_softplus=True, return_last_state=True)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    y_fp32 = selective_scan(**{k: v.float() for k, v in low.items()}, delta_softplus=True)
    torch.testing.assert_close(y.float(), y_fp32, atol=0.1, rtol=0.02)  # only bf16 output rounding differs


@pytest.mark.parametrize("scan", ["chunked", "dispatcher"])
def test_gradients_match_transformers(scan) -> None:
    """The gradient of every input (u, dt, A, B, C, D, z, bias) equals transformers' loop's."""
    fn = {"chunked": lambda **kw: selective_scan(**kw, chunk_size=7), "dispatcher": fastpath.mamba_selective_scan}[scan]

    def grads(fn) -> dict[str, torch.Tensor]:
        inputs = {k: v.requires_grad_() for k, v in make_inputs(d_inner=8, n_state=4, length=30).items()}
        y, state = fn(**inputs, delta_softplus=True, return_last_state=True)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(9))
        ((y * w).sum() + state.square().sum()).backward()
        return {k: v.grad for k, v in inputs.items()}

    got, ref = grads(fn), grads(mamba_selective_scan)
    assert set(got) == {"hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias"}
    for name, g_ref in ref.items():
        assert got[name] is not None, f"no gradient for {name}"
        torch.testing.assert_close(got[name], g_ref, atol=1e-4, rtol=1e-4, msg=lambda m: f"d/d{name}: {m}")


def test_transformers_flags_ignored_and_bad_arguments_rejected() -> None:
    inputs = make_inputs(length=10)
    y = selective_scan(**inputs, delta_softplus=True, use_mambapy=True, use_associative_scan=True)
    torch.testing.assert_close(y, selective_scan(**inputs, delta_softplus=True))
    with pytest.raises(TypeError, match="bogus_flag"):
        selective_scan(**inputs, bogus_flag=True)
    with pytest.raises(ValueError, match="chunk_size"):
        selective_scan(**inputs, chunk_size=0)
    with pytest.raises(ValueError, match="B must have shape"):
        selective_scan(**{**inputs, "B": inputs["B"][:, :, :-1]})


def _tiny_mamba() -> tuple[MambaForCausalLM, torch.Tensor]:
    torch.manual_seed(0)
    config = MambaConfig(vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2)
    return MambaForCausalLM(config).eval(), torch.randint(0, 256, (2, 37))


def _counting(fn):
    def wrapper(*args, **kwargs):
        wrapper.calls += 1
        return fn(*args, **kwargs)

    wrapper.calls = 0
    return wrapper


@torch.no_grad()
def test_mamba_model_logits_unchanged_when_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    model, input_ids = _tiny_mamba()
    with stock_transformers():
        expected = model(input_ids, use_cache=False).logits
    patched = _counting(selective_scan)
    monkeypatch.setattr(modeling_mamba, "mamba_selective_scan", patched)
    logits = model(input_ids, use_cache=False).logits
    assert patched.calls == 2  # one scan per layer
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_mamba_generation_unchanged_when_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation with a cache uses the final state returned by the scan for the decode steps."""
    model, input_ids = _tiny_mamba()
    kwargs = {"attention_mask": torch.ones_like(input_ids), "max_new_tokens": 3, "do_sample": False,
              "output_logits": True, "return_dict_in_generate": True, "pad_token_id": 0}
    with stock_transformers():
        expected = model.generate(input_ids, **kwargs)
    monkeypatch.setattr(modeling_mamba, "mamba_selective_scan", selective_scan)
    out = model.generate(input_ids, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    for step, step_ref in zip(out.logits, expected.logits, strict=True):
        torch.testing.assert_close(step, step_ref, atol=ATOL, rtol=0)
