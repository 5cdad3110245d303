"""Every "equals transformers" claim, checked against references the plugin cannot have touched.

* ``conftest.STOCK``: transformers' own Mamba-1 scan / convolution and Mamba-2 chunked scan, captured before
  ``import hf_tokred`` rebinds ``modeling_mamba.mamba_selective_scan`` and ``causal_conv1d_fn``;
* ``slow_reference.equation_*``: the same kernels written from their equations (float64 step loops);
* a fresh Python process that imports transformers and never hf_tokred (:func:`stock_in_subprocess`).

Forward outputs *and* the gradient of every input / parameter are compared, for Mamba-1 and Mamba-2, dense and
(where a reduced reference exists) reduced.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the Triton kernels run in the interpreter (set before they are loaded)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

import hf_tokred  # noqa: E402
from hf_tokred import TokenReductionConfig, fastpath  # noqa: E402
from hf_tokred.ops import cpu as cpu_kernel  # noqa: E402
from hf_tokred.ops import cu_seqlens_from_lengths, force_backend, selective_scan_varlen  # noqa: E402
from hf_tokred.ops.scan import selective_scan  # noqa: E402
from transformers.models.mamba import modeling_mamba  # noqa: E402

from conftest import STOCK, tiny_model  # noqa: E402
from robust_helpers import branch_strategies, pad_rows, random_rows  # noqa: E402
from slow_reference import equation_conv, equation_scan, equation_ssd, row_plans, slow_forward  # noqa: E402

ATOL = 1e-5
SCAN_INPUTS = ("hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias")


def test_stock_references_are_transformers_own():
    """The captured functions' code lies in transformers' installed package and not in hf_tokred's (compared as
    resolved folders, so a virtualenv or checkout whose path contains "hf_tokred" does not matter)."""
    transformers_dir = Path(transformers.__file__).resolve().parent
    plugin_dir = Path(hf_tokred.__file__).resolve().parent
    for fn in (STOCK.mamba_selective_scan, STOCK.causal_conv1d_fn, STOCK.mamba2_chunk_scan):
        assert fn.__module__.startswith("transformers.models.mamba"), fn
        source = Path(fn.__code__.co_filename).resolve()
        assert source.is_relative_to(transformers_dir), (source, transformers_dir)
        assert not source.is_relative_to(plugin_dir), source
    assert modeling_mamba.mamba_selective_scan is not STOCK.mamba_selective_scan  # the plugin's dispatcher
    assert modeling_mamba.causal_conv1d_fn is not STOCK.causal_conv1d_fn


# ============================================================================ Mamba-1 selective scan


def scan_inputs(b=2, d=6, n=4, L=23, seed=0, optional=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    kw = dict(hidden_states=r(b, d, L), dt=0.5 * r(b, d, L) - 1.0, A=-torch.exp(r(d, n)), B=r(b, n, L), C=r(b, n, L))
    if optional:
        kw.update(D=r(d), z=r(b, d, L), delta_bias=0.3 * r(d))
    return kw


def _varlen_as_transformers(backend):
    """The packed varlen kernel behind transformers' ``[batch, d, L]`` interface (every row full length)."""

    def scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
             return_last_state=False):
        b, _, L = hidden_states.shape
        t = lambda x: None if x is None else x.transpose(1, 2).reshape(b * L, -1)  # noqa: E731
        with force_backend(backend):
            y, state = selective_scan_varlen(t(hidden_states), t(dt), A, t(B), t(C),
                                             cu_seqlens_from_lengths(torch.full((b,), L)), D=D, z=t(z),
                                             dt_bias=delta_bias, dt_softplus=delta_softplus)
        y = y.view(b, L, -1).transpose(1, 2)
        return (y, state) if return_last_state else y

    return scan


SCANS = {
    "chunked": lambda **kw: selective_scan(**kw, chunk_size=5),
    "chunked-default": selective_scan,
    "dispatcher": fastpath.mamba_selective_scan,  # what transformers' mixer calls after import hf_tokred
}
#: inference-only kernels (no backward): the forward is compared
FORWARD_ONLY = {
    "compiled": cpu_kernel.selective_scan_cpu,
    "varlen-torch": _varlen_as_transformers("torch"),
    "varlen-triton": _varlen_as_transformers("triton"),
    "cuda-dispatch": fastpath._triton_scan,  # the dispatcher's CUDA route without mamba_ssm (layout conversion)
}


def _scan_grads(fn, inputs, **flags):
    inputs = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    y, state = fn(**inputs, return_last_state=True, **flags)
    g = torch.Generator().manual_seed(123)
    (y.double() * torch.randn(y.shape, generator=g, dtype=torch.double)).sum().add(
        (state.double() * torch.randn(state.shape, generator=g, dtype=torch.double)).sum()).backward()
    return y.detach(), state.detach(), {k: v.grad for k, v in inputs.items()}


@pytest.mark.parametrize("optional", [True, False], ids=["D-z-bias", "bare"])
@pytest.mark.parametrize("name", sorted(SCANS))
def test_mamba1_scan_forward_and_every_gradient_equal_transformers(name, optional):
    inputs = scan_inputs(optional=optional, seed=1 + optional)
    flags = dict(delta_softplus=True) if optional else {}
    if not optional:
        inputs["dt"] = F.softplus(inputs["dt"])  # no softplus inside: time steps must be positive
    y, state, grads = _scan_grads(SCANS[name], inputs, **flags)
    y_ref, state_ref, grads_ref = _scan_grads(STOCK.mamba_selective_scan, inputs, **flags)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(state, state_ref, atol=ATOL, rtol=1e-5)
    assert set(grads_ref) == set(inputs) and set(inputs) >= {"hidden_states", "dt", "A", "B", "C"}
    for k, g_ref in grads_ref.items():
        assert g_ref is not None and grads[k] is not None, f"no gradient for {k}"
        torch.testing.assert_close(grads[k], g_ref, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name} d/d{k}: {m}")


def test_stock_scan_equals_its_equations():
    """The two oracles agree (so neither is wrong in a way the other would share)."""
    inputs = scan_inputs(seed=3)
    y, state = STOCK.mamba_selective_scan(**inputs, delta_softplus=True, return_last_state=True)
    y_eq, state_eq = equation_scan(**inputs, delta_softplus=True)
    torch.testing.assert_close(y, y_eq.float(), atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(state, state_eq.float(), atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_mamba1_scan_initial_state_gradient_equals_equations(chunk_size):
    """transformers' scan has no initial state; the chunked scan's (used for decoding continuations) is checked,
    forward and every gradient including d/d(initial_state), against the float64 equations."""
    inputs = scan_inputs(seed=4)
    inputs["initial_state"] = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(5))
    y, state, grads = _scan_grads(lambda **kw: selective_scan(**kw, chunk_size=chunk_size), inputs,
                                  delta_softplus=True)
    y_ref, state_ref, grads_ref = _scan_grads(equation_scan, inputs, delta_softplus=True)
    torch.testing.assert_close(y, y_ref.float(), atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(state, state_ref.float(), atol=ATOL, rtol=1e-5)
    for k, g_ref in grads_ref.items():
        torch.testing.assert_close(grads[k], g_ref.float(), atol=1e-4, rtol=1e-4, msg=lambda m: f"d/d{k}: {m}")


@pytest.mark.parametrize("regime", ["plain", "strong-decay"])
@pytest.mark.parametrize("optional", [True, False], ids=["D-z-bias", "bare"])
@pytest.mark.parametrize("name", sorted(FORWARD_ONLY))
@torch.no_grad()
def test_mamba1_inference_scans_equal_transformers(name, optional, regime):
    """Every inference scan against transformers' loop; "strong-decay": time steps of 3 to 8 (softplus far from
    linear) and decays exp(dt A) down to e^-200 (a state forgotten within a step)."""
    assert cpu_kernel.available(), "the C++ kernels must build on this machine"
    inputs = scan_inputs(d=13, n=5, L=31, seed=6 + optional, optional=optional)
    if regime == "strong-decay":
        inputs["dt"] = inputs["dt"] + 6.0
        inputs["A"] = inputs["A"] * 5
    if not optional:
        inputs["dt"] = F.softplus(inputs["dt"])
    y, state = FORWARD_ONLY[name](**inputs, delta_softplus=optional, return_last_state=True)
    y_ref, state_ref = STOCK.mamba_selective_scan(**inputs, delta_softplus=optional, return_last_state=True)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(state, state_ref, atol=ATOL, rtol=1e-5)


def test_cuda_dispatch_route_supports_backward():
    """On CUDA without mamba_ssm the dispatcher's scan (Triton forward) has gradients: those of the torch scan."""
    inputs = {k: v.requires_grad_() for k, v in scan_inputs(seed=9).items()}
    y = fastpath._cuda_scan(**inputs, delta_softplus=True)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad((y * g).sum(), list(inputs.values()), allow_unused=True)
    ref_inputs = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    ref = STOCK.mamba_selective_scan(**ref_inputs, delta_softplus=True)
    want = torch.autograd.grad((ref * g).sum(), list(ref_inputs.values()), allow_unused=True)
    for name, a, b in zip(inputs, got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"d/d{name}: {m}")


# ============================================================================ Mamba-1 causal convolution


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_mamba1_conv_forward_and_gradients_equal_transformers(activation, with_bias):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 19, 9, generator=g).transpose(1, 2)  # the strided view the mixer passes
    w = torch.randn(9, 4, generator=g)
    bias = torch.randn(9, generator=g) if with_bias else None
    ref = STOCK.causal_conv1d_fn(x, w, bias, activation=activation)
    torch.testing.assert_close(ref, equation_conv(x, w, bias, activation).float(), atol=1e-6, rtol=1e-6)
    with torch.no_grad():  # the compiled path
        torch.testing.assert_close(fastpath.causal_conv1d_fn(x, w, bias, activation=activation), ref,
                                   atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(cpu_kernel.causal_conv1d_cpu(x, w, bias, activation), ref, atol=1e-6, rtol=1e-6)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, bias) if t is not None]
        out = fn(*leaves[:2], leaves[2] if with_bias else None, activation=activation)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(8))).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    out, got = grads(fastpath.causal_conv1d_fn)
    out_ref, want = grads(STOCK.causal_conv1d_fn)
    torch.testing.assert_close(out, out_ref, atol=1e-6, rtol=1e-6)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ============================================================================ Mamba-2 (SSD)


def ssd_inputs(lengths, H=4, P=3, G=2, N=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    T, S = sum(lengths), len(lengths)
    return dict(x=r(T, H, P), dt=r(T, H), A=-torch.rand(H, generator=g) * 2 - 0.1, B=r(T, G, N), C=r(T, G, N),
                D=r(H), dt_bias=0.5 * r(H), initial_states=r(S, H, P, N))


def test_stock_mamba2_scan_equals_its_equations():
    kw = ssd_inputs((11,), seed=12)
    y, final = STOCK.mamba2_chunk_scan(kw["x"][None], kw["dt"][None], kw["A"], kw["B"][None], kw["C"][None], 4,
                                       D=kw["D"], dt_bias=kw["dt_bias"], initial_states=kw["initial_states"],
                                       dt_softplus=True, return_final_states=True)
    y_eq, final_eq = equation_ssd(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], D=kw["D"], dt_bias=kw["dt_bias"],
                                  dt_softplus=True, initial_state=kw["initial_states"][0])
    torch.testing.assert_close(y[0], y_eq.float(), atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(final[0], final_eq.float(), atol=ATOL, rtol=1e-5)


# ============================================================================ whole models: dense, against a fresh process

_WORKER = textwrap.dedent('''
    import json, sys
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    job = torch.load(sys.argv[1])
    out = {}
    for name, case in job.items():
        model = AutoModelForCausalLM.from_pretrained(case["path"]).eval()
        res = model(case["ids"], attention_mask=case["mask"], labels=case["labels"], use_cache=False)
        res.loss.backward()
        out[name] = {"loss": res.loss.detach(), "logits": res.logits.detach(),
                     "grads": {k: p.grad for k, p in model.named_parameters()}}
    assert not any(m == "hf_tokred" or m.startswith("hf_tokred.") for m in sys.modules), "hf_tokred was imported"
    torch.save(out, sys.argv[2])
''')


def stock_in_subprocess(cases: dict, tmp_path: Path) -> dict:
    """Loss, logits and parameter gradients from stock transformers in a fresh process (no hf_tokred)."""
    job, result = tmp_path / "job.pt", tmp_path / "result.pt"
    torch.save(cases, job)
    proc = subprocess.run([sys.executable, "-c", _WORKER, str(job), str(result)], capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(result)


def _batch(seed=0, lengths=(17, 11)):
    ids, mask = pad_rows(random_rows(seed, lengths), "left")
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _ours(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=mask, labels=labels, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {k: p.grad for k, p in model.named_parameters()}


def test_dense_backward_equals_stock_in_a_fresh_process(tmp_path):
    """Reduction off (and configured with keep_ratio 1.0, so the reducing loop runs but removes nothing): loss,
    logits and the gradient of every parameter equal stock transformers' in a process without hf_tokred."""
    ids, mask, labels = _batch()
    cases, models = {}, {}
    for family in ("mamba", "mamba2"):
        model = tiny_model(family, layers=3)
        model.save_pretrained(tmp_path / family)
        models[family] = model
        cases[family] = {"path": str(tmp_path / family), "ids": ids, "mask": mask, "labels": labels}
    stock = stock_in_subprocess(cases, tmp_path)
    assert json.loads((tmp_path / "mamba" / "config.json").read_text()).get("token_reduction") is None
    for family, model in models.items():
        want = stock[family]
        assert len(want["grads"]) == len(dict(model.named_parameters()))
        for setting in (None, TokenReductionConfig(keep_ratio=1.0, anchors=[0, 1])):
            hf_tokred.apply_token_reduction(model, setting)
            loss, logits, grads = _ours(model, ids, mask, labels)
            torch.testing.assert_close(loss, want["loss"], atol=ATOL, rtol=1e-5)
            torch.testing.assert_close(logits, want["logits"], atol=ATOL, rtol=1e-5)
            for k, g in want["grads"].items():
                assert grads[k] is not None, (family, setting, k)
                torch.testing.assert_close(grads[k], g, atol=1e-5, rtol=1e-4,
                                           msg=lambda m: f"{family} {setting} d/d{k}: {m}")


# ============================================================================ whole models: reduced, against the slow reference


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
@pytest.mark.parametrize("method, q", [("utrc", 0.3), ("utrc", 0.8), ("utrc_reference", 0.4), ("tome", 0.5),
                                       ("evit", 0.5), ("merge_only", 0.5)])
def test_reduced_backward_equals_slow_reference(family, method, q):
    """A reduced forward's gradients (every parameter) equal those of the slow reference: stock blocks with
    transformers' own kernels and per-row float64 merges from the documented rules, under the same plans."""
    model = tiny_model(family, layers=4)
    cfg = TokenReductionConfig(method=method, keep_ratio=0.6, anchors=[0, 2], q=q)
    hf_tokred.apply_token_reduction(model, cfg)
    ids, mask, _ = _batch(seed=3, lengths=(16, 11))
    out = model(ids, attention_mask=mask, use_cache=False)
    assert len(out.plans) == 2
    weights = torch.randn(out.logits.shape, generator=torch.Generator().manual_seed(4))
    kept = out.computed_mask & mask.bool()
    (out.logits[kept] * weights[kept]).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    total = 0.0
    for b in range(ids.shape[0]):
        real = mask[b].nonzero().flatten()
        ref = slow_forward(model, ids[b, real], row_plans(out.plans, mask.bool(), b), len(real), *branch_strategies(cfg), q, grad=True)
        cols = kept[b].nonzero().flatten()
        torch.testing.assert_close(ref.detach(), out.logits[b, cols].detach(), atol=ATOL, rtol=1e-5)
        total = total + (ref * weights[b, cols]).sum()
    total.backward()
    for k, p in model.named_parameters():
        assert p.grad is not None and grads[k] is not None, k
        torch.testing.assert_close(grads[k], p.grad, atol=5e-5, rtol=1e-4, msg=lambda m: f"d/d{k}: {m}")
