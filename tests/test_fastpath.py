"""The CPU fast path is installed and gives stock transformers' results (fp32, atol 1e-5).

The reference is always ``conftest.STOCK``: transformers' own functions captured before ``import hf_tokred``.
"""

import pytest
import torch
from transformers.models.mamba import modeling_mamba

from hf_tokred import fastpath
from hf_tokred.compat import cache_kwargs, cache_of

from conftest import STOCK, stock_forward, tiny_model


def test_installed_and_restorable():
    assert modeling_mamba.mamba_selective_scan is fastpath.mamba_selective_scan
    with fastpath.stock_kernels():
        assert modeling_mamba.mamba_selective_scan is STOCK.mamba_selective_scan
        assert modeling_mamba.causal_conv1d_fn is STOCK.causal_conv1d_fn
    assert modeling_mamba.mamba_selective_scan is fastpath.mamba_selective_scan


def test_dense_model_and_cache_equal_stock_loop():
    model = tiny_model("mamba", layers=3)
    ids = torch.randint(2, 96, (2, 70), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    with torch.no_grad():
        ours = model(ids, attention_mask=mask, use_cache=True)
        ref = stock_forward(model, ids, attention_mask=mask, use_cache=True)
        nxt = torch.tensor([[5], [7]])
        ours_step = model(nxt, **cache_kwargs(cache_of(ours)))
        ref_step = stock_forward(model, nxt, **cache_kwargs(cache_of(ref)))
    assert torch.allclose(ours.logits, ref.logits, atol=1e-5, rtol=0)
    for layer in range(3):  # the final SSM state the cache holds for decoding
        assert torch.allclose(cache_of(ours).layers[layer].recurrent_states[0],
                              cache_of(ref).layers[layer].recurrent_states[0], atol=1e-5, rtol=0)
    assert torch.allclose(ours_step.logits, ref_step.logits, atol=1e-5, rtol=0)


def test_cuda_without_mamba_ssm_routes_to_the_triton_scan(monkeypatch):
    """The CUDA branch's layout conversion, run on CPU tensors through the same packed kernel API."""
    torch.manual_seed(0)
    b, d, n, L = 2, 8, 4, 13
    u, dt, z = torch.randn(b, d, L), torch.randn(b, d, L), torch.randn(b, d, L)
    A, B, C = -torch.rand(d, n) - 0.1, torch.randn(b, n, L), torch.randn(b, n, L)
    D, bias = torch.randn(d), torch.randn(d)
    ref_y, ref_s = STOCK.mamba_selective_scan(u, dt, A, B, C, D=D, z=z, delta_bias=bias,
                                              delta_softplus=True, return_last_state=True)
    y, s = fastpath._triton_scan(u, dt, A, B, C, D=D, z=z, delta_bias=bias, delta_softplus=True,
                                 return_last_state=True, use_mambapy=False)
    assert torch.allclose(y, ref_y, atol=1e-5) and torch.allclose(s, ref_s, atol=1e-5)


def test_compiled_cpu_scan_equals_stock_loop():
    """The compiled CPU kernel (built on first use) against transformers' loop, with every option."""
    from hf_tokred.ops import cpu as cpu_kernel

    assert cpu_kernel.available(), "the C++ scan must build on this machine (gcc + ninja are installed by CI)"
    torch.manual_seed(3)
    b, d, n, L = 2, 24, 16, 77
    u, dt, z = torch.randn(b, d, L), torch.randn(b, d, L), torch.randn(b, d, L)
    A, B, C = -torch.rand(d, n) * 3 - 0.1, torch.randn(b, n, L), torch.randn(b, n, L)
    D, bias = torch.randn(d), torch.randn(d)
    ref_y, ref_s = STOCK.mamba_selective_scan(u, dt, A, B, C, D=D, z=z, delta_bias=bias,
                                              delta_softplus=True, return_last_state=True)
    y, s = cpu_kernel.selective_scan_cpu(u, dt, A, B, C, D=D, z=z, delta_bias=bias, delta_softplus=True,
                                         return_last_state=True)
    assert torch.allclose(y, ref_y, atol=1e-5) and torch.allclose(s, ref_s, atol=1e-5)
    # an initial state continues a sequence: two halves chained equal the whole
    y1, s1 = cpu_kernel.selective_scan_cpu(u[..., :40], dt[..., :40], A, B[..., :40], C[..., :40],
                                           delta_softplus=True, return_last_state=True)
    y2, s2 = cpu_kernel.selective_scan_cpu(u[..., 40:], dt[..., 40:], A, B[..., 40:], C[..., 40:],
                                           delta_softplus=True, return_last_state=True, initial_state=s1)
    whole_y, whole_s = cpu_kernel.selective_scan_cpu(u, dt, A, B, C, delta_softplus=True, return_last_state=True)
    assert torch.allclose(torch.cat([y1, y2], -1), whole_y, atol=1e-5) and torch.allclose(s2, whole_s, atol=1e-5)


@pytest.mark.parametrize("d, n", [(24, 16), (13, 5), (8, 64)])
def test_compiled_scan_reads_transformers_views(d, n):
    """The mixer hands over transposed views (u, z out of the in-projection, B, C out of x_proj): the kernel
    reads them in place, including a channel count that is not a multiple of its 8-channel blocks."""
    from hf_tokred.ops import cpu as cpu_kernel

    torch.manual_seed(d + n)
    b, L, r = 2, 37, 5
    xz = torch.randn(b, L, 2 * d).transpose(1, 2)
    u, z = xz[:, :d], xz[:, d:]
    xp = torch.randn(b, L, r + 2 * n)
    B, C = xp[..., r:r + n].transpose(1, 2), xp[..., r + n:].transpose(1, 2)
    dt, A = torch.randn(b, d, L), -torch.rand(d, n) - 0.1
    D, bias = torch.randn(d), torch.randn(d)
    h0 = torch.randn(b, d, n)
    ref_y, ref_s = STOCK.mamba_selective_scan(u, dt, A, B, C, D=D, z=z, delta_bias=bias,
                                              delta_softplus=True, return_last_state=True)
    ref_plain = STOCK.mamba_selective_scan(u, dt.abs() * 0.1, A, B, C)
    y, s = cpu_kernel.selective_scan_cpu(u, dt, A, B, C, D=D, z=z, delta_bias=bias, delta_softplus=True,
                                         return_last_state=True)
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(cpu_kernel.selective_scan_cpu(u, dt.abs() * 0.1, A, B, C), ref_plain,
                               atol=1e-5, rtol=1e-6)
    # an initial state: the scan from h0 equals the slow obvious recurrence
    y0, s0 = cpu_kernel.selective_scan_cpu(u, dt, A, B, C, delta_bias=bias, delta_softplus=True,
                                           return_last_state=True, initial_state=h0)
    delta = torch.nn.functional.softplus(dt + bias[:, None])
    h, ys = h0.clone(), []
    for t in range(L):
        h = torch.exp(delta[..., t, None] * A) * h + (delta[..., t] * u[..., t])[..., None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    torch.testing.assert_close(y0, torch.stack(ys, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s0, h, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_compiled_conv_equals_stock(activation, with_bias):
    """The fused depthwise causal convolution against transformers' F.conv1d fallback, on the strided view the
    mixer passes (the first half of the in-projection output), with and without the cache's prefix."""
    from hf_tokred.ops import cpu as cpu_kernel

    torch.manual_seed(1)
    b, d, L, k = 3, 21, 19, 4
    x = torch.randn(b, L, 2 * d).transpose(1, 2)[:, :d]
    w, bias = torch.randn(d, k), (torch.randn(d) if with_bias else None)
    ref = STOCK.causal_conv1d_fn(x, w, bias, activation=activation)
    out = fastpath.causal_conv1d_fn(x, w, bias, activation=activation)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    assert out.shape == (b, d, L) and out.dtype == x.dtype
    torch.testing.assert_close(cpu_kernel.causal_conv1d_cpu(x[..., :1], w, bias, activation),
                               STOCK.causal_conv1d_fn(x[..., :1], w, bias, activation=activation))
    with torch.enable_grad():  # gradients: transformers' own code runs
        xg = x.clone().requires_grad_()
        fastpath.causal_conv1d_fn(xg, w, bias, activation=activation).sum().backward()
        assert xg.grad is not None
