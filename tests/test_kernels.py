"""Kernels against their torch references: the fused plan application and the varlen selective scans.

Without a GPU the Triton kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, set below
before anything imports the kernel modules), so every shape here is tiny.  On a CUDA machine the same
tests compile and run the real kernels on CUDA tensors.
"""

import os

import torch

from robust_helpers import branch_strategies

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ast  # noqa: E402
import contextlib  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from hf_tokred import reduce  # noqa: E402
from hf_tokred.ops import (  # noqa: E402
    cu_seqlens_from_lengths,
    dispatch,
    force_backend,
    pack_padded,
    selective_scan_varlen,
    selective_scan_varlen_ref,
    unpack_padded,
)
from hf_tokred.ops.scan import selective_scan  # noqa: E402

from fused_reference import apply_plan_fused_reference, fused_apply_plan  # noqa: E402

from conftest import STOCK  # noqa: E402

mamba_selective_scan = STOCK.mamba_selective_scan  # transformers' own loop (captured before import hf_tokred)

torch.set_num_threads(1)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ["triton", "torch"]
needs_triton = pytest.mark.skipif(not dispatch.triton_available(), reason="triton is not installed")

SELECTIONS = ["importance_similarity", "reference", "bipartite", "importance"]
STRATEGY_PAIRS = [  # (residual, hidden): every strategy on both branches, incl. all the methods' pairs
    ("merge", "hybrid"),
    ("merge", "hybrid_channel"),
    ("prune", "prune"),
    ("merge", "merge"),
    ("hybrid", "prune"),
    ("hybrid_channel", "merge"),
]


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at the magnitude of ``x`` (fp32 values of that dtype)."""
    fi = torch.finfo(dtype)
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(fi.tiny)))) * fi.eps


def assert_within_one_ulp(out: torch.Tensor, ref_fp32: torch.Tensor) -> None:
    ref = ref_fp32.to(out.dtype).float()
    diff = (out.float() - ref).abs()
    bad = diff > ulp(ref, out.dtype)
    assert not bad.any(), f"{int(bad.sum())} values off by more than one ulp; max diff {diff.max().item():.3g}"


# ---------------------------------------------------------------------------------------------------
# fused plan application


def make_case(selection, lengths=(10, 7, 2), D=8, keep_ratio=0.6, seed=0, dtype=torch.float32, hid_dtype=None):
    """Left-padded batch (rows of different real lengths), random branches, and a plan from make_plan."""
    B, N = len(lengths), max(lengths)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, N, D, generator=g)
    res = torch.randn(B, N, D, generator=g)
    mask = torch.arange(N)[None, :] >= (N - torch.tensor(lengths))[:, None]
    protected = torch.zeros(B, N, dtype=torch.bool)
    protected[:, -1] = True  # the last real token (left padding)
    plan = reduce.make_plan(h, mask, protected, keep_ratio, selection, "clip", selection != "importance")
    assert plan is not None
    plan = reduce.Plan(*(getattr(plan, f).to(DEVICE) if torch.is_tensor(getattr(plan, f)) else getattr(plan, f)
                        for f in plan.__dataclass_fields__))
    res = res.to(DEVICE, dtype)
    h = h.to(DEVICE, hid_dtype or dtype)
    return res, h, mask.to(DEVICE), protected.to(DEVICE), plan


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize("strategies", STRATEGY_PAIRS, ids="+".join)
@needs_triton
def test_fused_plan_matches_reference(selection, strategies):
    res, h, mask, protected, plan = make_case(selection)
    assert not bool(plan.keep_mask.all())  # the padded layout is exercised
    ref = apply_plan_fused_reference(res, h, plan, *strategies, q=0.5)
    for backend in BACKENDS:
        with force_backend(backend):
            out = fused_apply_plan(res, h, plan, *strategies, q=0.5)
        assert out.dtype == torch.float32 and out.shape == ref.shape
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=lambda m: f"{backend}: {m}")
        torch.testing.assert_close(out, reduce.apply_plan_pair(res, h, plan, *strategies, q=0.5), atol=1e-5, rtol=0)


@needs_triton
@pytest.mark.parametrize("q", [0.0, 0.2, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("strategies", [("hybrid_channel", "hybrid"), ("merge", "hybrid"), ("hybrid", "prune")],
                         ids="+".join)
def test_fused_plan_hybrid_q(q, strategies):
    """q != 0.5 (where pruning and merging shares differ), rows of 5 sources (q = 0.8 merges exactly one)."""
    res, h, _, _, plan = make_case("importance_similarity", lengths=(10, 10, 7), keep_ratio=0.5, seed=1)
    assert plan.num_removed.tolist() == [5, 5, 3]
    ref = apply_plan_fused_reference(res, h, plan, *strategies, q=q)
    for backend in BACKENDS:
        with force_backend(backend):
            out = fused_apply_plan(res, h, plan, *strategies, q=q)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=lambda m: f"{backend}: {m}")


def test_fused_reference_weights_by_hand():
    """The reference's documented rule on a hand-made plan: one row, sources 0, 2, 4, 6, 8 (importance 5, 1, 4, 2,
    3) fold into 1, 3, 5, 7, 9; q = 0.8 merges the single most important source (token 0), q = 0.4 the top three."""
    keep = torch.tensor([[1, 3, 5, 7, 9, 10]])
    src = torch.tensor([[0, 2, 4, 6, 8]])
    plan = reduce.Plan(keep, torch.ones_like(keep, dtype=torch.bool), src, src + 1, torch.arange(5)[None],
                       torch.ones_like(src, dtype=torch.bool), torch.tensor([[5.0, 1.0, 4.0, 2.0, 3.0]]))
    x = torch.arange(11.0)[None, :, None].repeat(1, 1, 2)
    x[0, 0, 1] = -100.0  # channel 1: source 0 is the smallest value
    zero = torch.zeros_like(x)
    out = apply_plan_fused_reference(zero, x, plan, "prune", "hybrid", q=0.8)[0, :, 0]
    assert out.tolist() == [0.5, 3.0, 5.0, 7.0, 9.0, 10.0]  # (1 + 0) / 2, the rest unchanged
    out = apply_plan_fused_reference(zero, x, plan, "prune", "hybrid", q=0.4)[0, :, 0]
    assert out.tolist() == [0.5, 3.0, 4.5, 7.0, 8.5, 10.0]  # sources 0, 4, 8 (importance 5, 4, 3)
    out = apply_plan_fused_reference(zero, x, plan, "prune", "hybrid_channel", q=0.8)[0]
    assert out[:, 0].tolist() == [1.0, 3.0, 5.0, 7.0, 8.5, 10.0]  # channel 0: the largest value, source 8
    assert out[:, 1].tolist() == [1.0, 3.0, 5.0, 7.0, 8.5, 10.0]  # channel 1 too (source 0 is -100 there)
    out = apply_plan_fused_reference(x, zero, plan, "merge", "prune")[0, :, 0]
    assert out.tolist() == [0.5, 2.5, 4.5, 6.5, 8.5, 10.0]


@needs_triton
def test_fused_plan_strided_inputs_and_empty_rows():
    res, h, _, _, plan = make_case("bipartite", lengths=(10, 0, 1, 4), seed=2)  # an all-padding row, a 1-token row
    assert not bool(plan.keep_mask[1].any())
    wide = torch.randn(res.shape[0], res.shape[1], 2 * res.shape[2], device=DEVICE)
    res_v = wide[..., ::2]  # non-contiguous channels
    h_v = h.transpose(0, 1).contiguous().transpose(0, 1)  # permuted strides
    ref = apply_plan_fused_reference(res_v, h_v, plan, "merge", "hybrid_channel")
    out = fused_apply_plan(res_v, h_v, plan, "merge", "hybrid_channel")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strategies", [("merge", "hybrid_channel"), ("merge", "hybrid"), ("prune", "prune")],
                         ids="+".join)
def test_fused_plan_low_precision_within_one_ulp(dtype, strategies):
    res, h, _, _, plan = make_case("importance_similarity", dtype=dtype, seed=3)
    ref32 = apply_plan_fused_reference(res.float(), h.float(), plan, *strategies)
    for backend in BACKENDS:
        with force_backend(backend):
            out = fused_apply_plan(res, h, plan, *strategies)
        assert out.dtype == dtype
        assert_within_one_ulp(out, ref32)


@needs_triton
def test_fused_plan_fp32_residual_bf16_hidden():
    res, h, _, _, plan = make_case("importance_similarity", hid_dtype=torch.bfloat16, seed=4)
    assert res.dtype == torch.float32 and h.dtype == torch.bfloat16
    out = fused_apply_plan(res, h, plan, "merge", "hybrid")
    assert out.dtype == (res + h).dtype == torch.float32
    ref = apply_plan_fused_reference(res, h.float(), plan, "merge", "hybrid")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # the unfused path rounds the hidden branch to bf16 first: the fused result is at most that far away
    unfused = apply_plan_fused_reference(res, h, plan, "merge", "hybrid")
    assert (out - unfused).abs().max() <= ulp(unfused, torch.bfloat16).max()


@needs_triton
@pytest.mark.parametrize("dtypes", [(torch.float16, torch.bfloat16), (torch.float64, torch.float64),
                                    (torch.bfloat16, torch.float32)], ids=str)
def test_fused_plan_other_dtype_pairs_run_exactly_cast(dtypes):
    """Pairs outside the kernel's launch space (dispatch.LAUNCH_SPACE) run as ``kernel_dtype(pair)`` for both
    branches: the result in the promoted dtype, equal to the fp32 reference on the fp32 inputs."""
    res, h, _, _, plan = make_case("importance_similarity", dtype=dtypes[0], hid_dtype=dtypes[1], seed=8)
    assert (res.dtype, h.dtype) not in dispatch.LAUNCH_SPACE["apply_plan_fused"]["dtypes"]
    out = fused_apply_plan(res, h, plan, "merge", "hybrid_channel")
    assert out.dtype == torch.promote_types(*dtypes)
    ref = apply_plan_fused_reference(res.float(), h.float(), plan, "merge", "hybrid_channel")
    torch.testing.assert_close(out.float(), ref, atol=1e-5, rtol=0)


@needs_triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_plan_gradients(backend):
    res, h, _, _, plan = make_case("importance_similarity", seed=5)
    strategies = ("merge", "hybrid_channel")
    res1, h1 = res.clone().requires_grad_(), h.clone().requires_grad_()
    res2, h2 = res.clone().requires_grad_(), h.clone().requires_grad_()
    g = torch.randn(plan.keep.shape[0], plan.keep.shape[1], res.shape[-1], device=DEVICE)
    ref = apply_plan_fused_reference(res1, h1, plan, *strategies)
    ref_grads = torch.autograd.grad((ref * g).sum(), (res1, h1))
    with force_backend(backend):
        out = fused_apply_plan(res2, h2, plan, *strategies)
    grads = torch.autograd.grad((out * g).sum(), (res2, h2))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@needs_triton
def test_fused_plan_opcheck():
    res, h, mask, _, plan = make_case("importance_similarity", lengths=(6, 4), D=4, seed=6)
    w_res = reduce.merge_weights(plan, "merge", 0.5, None)
    w_hid = reduce.merge_weights(plan, "hybrid_channel", 0.5, h.gather(1, plan.src[..., None].expand(-1, -1, 4)))
    args = (res.requires_grad_(), h.requires_grad_(), plan.keep, plan.keep_mask, plan.src, plan.dst_slot,
            w_res, w_hid)
    op = torch.ops.hf_tokred.apply_plan_fused.default
    # schema, autograd registration and fake-vs-real metadata on the kernel path; the (slow, traced)
    # AOT-dispatch check does not depend on the implementation, so it runs on the torch path
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    with force_backend("torch"):
        torch.library.opcheck(op, args, test_utils="test_aot_dispatch_dynamic")


@needs_triton
def test_fused_plan_flops_counted():
    res, h, _, _, plan = make_case("importance_similarity", seed=7)
    with FlopCounterMode(display=False) as counter:
        fused_apply_plan(res, h, plan, "merge", "hybrid")
    B, M = plan.keep.shape
    R, D = plan.src.shape[1], res.shape[-1]
    assert counter.get_total_flops() == B * M * D + 2 * (2 * B * R * D + B * M * D) > 0


def test_fused_plan_rejects_unknown_strategy():
    res, h, _, _, plan = make_case("importance_similarity")
    with pytest.raises(ValueError, match="unknown strategy"):
        fused_apply_plan(res, h, plan, "average", "hybrid")


# ---------------------------------------------------------------------------------------------------
# Mamba-1 selective scan (packed varlen)


def scan_inputs(lengths, Dm=8, N=4, seed=0, dtype=torch.float32, full=True):
    g = torch.Generator().manual_seed(seed)
    T, S = sum(lengths), len(lengths)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    kw = dict(
        u=r(T, Dm), dt=r(T, Dm) - 1.0, A=-torch.exp(r(Dm, N)), B=r(T, N), C=r(T, N),
        cu_seqlens=cu_seqlens_from_lengths(torch.tensor(lengths)),
    )
    if not full:  # no softplus: time steps must be positive
        kw["dt"] = torch.nn.functional.softplus(kw["dt"])
    if full:
        kw.update(D=r(Dm), z=r(T, Dm), dt_bias=0.5 * r(Dm), dt_softplus=True, initial_state=r(S, Dm, N))
    for k, v in kw.items():
        if isinstance(v, torch.Tensor):
            v = v.to(DEVICE)
            kw[k] = v.to(dtype) if v.is_floating_point() and k in ("u", "dt", "B", "C", "z") else v
    return kw


@needs_triton
@pytest.mark.parametrize("lengths", [(5, 0, 1, 9), (1, 1, 1), (12,)], ids=str)
@pytest.mark.parametrize("full", [True, False], ids=["D-z-bias-softplus-h0", "bare"])
def test_scan_varlen_matches_reference(lengths, full):
    kw = scan_inputs(lengths, full=full, seed=len(lengths))
    ref_y, ref_h = selective_scan_varlen_ref(**kw)
    for backend in BACKENDS:
        with force_backend(backend):
            y, h = selective_scan_varlen(**kw)
        assert y.dtype == kw["u"].dtype and h.dtype == torch.float32 and h.shape == ref_h.shape
        torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5, msg=lambda m: f"{backend} y: {m}")
        torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=1e-5, msg=lambda m: f"{backend} state: {m}")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scan_varlen_low_precision_within_one_ulp(dtype):
    kw = scan_inputs((6, 1, 4), dtype=dtype, seed=11)
    kw32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    ref_y, ref_h = selective_scan_varlen_ref(**kw32)
    for backend in BACKENDS:
        with force_backend(backend):
            y, h = selective_scan_varlen(**kw)
        assert y.dtype == dtype
        assert_within_one_ulp(y, ref_y)
        torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float64, torch.float64)], ids=str)
def test_scan_varlen_other_dtypes_run_exactly_cast(dtypes):
    """Activations outside the launch space (mixed dtypes, fp64) run in ``kernel_dtype`` of them, exactly: equal to
    the fp32 reference on the same values; ``y`` comes back in ``u``'s dtype."""
    kw = scan_inputs((6, 1, 4), seed=13)
    kw["u"], kw["z"] = kw["u"].to(dtypes[0]), kw["z"].to(dtypes[0])
    kw["dt"] = kw["dt"].to(dtypes[1])
    kw32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    ref_y, ref_h = selective_scan_varlen_ref(**kw32)
    y, h = selective_scan_varlen(**kw)
    assert y.dtype == dtypes[0]
    torch.testing.assert_close(y.float(), ref_y.to(dtypes[0]).float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=1e-5)


def test_scan_launcher_refuses_state_sizes_past_its_blocks(monkeypatch):
    """On a GPU the scan's blocks come from dispatch.LAUNCH_SPACE; a state size no block holds is an error naming
    the torch backend (not a kernel that was never compiled)."""
    scan_triton = dispatch.load_triton_module("_selective_scan_triton")
    monkeypatch.setattr(scan_triton, "_INTERPRET", False)
    largest = dispatch.LAUNCH_SPACE["selective_scan_varlen"]["block"][-1][0]
    assert scan_triton._blocks(1536, 16)[1] == 16
    assert scan_triton._blocks(1536, largest)[1] == largest
    with pytest.raises(ValueError, match=f"at most {largest} state indices.*force_backend"):
        scan_triton._blocks(1536, largest + 1)


def test_scan_reference_equals_transformers():
    """The oracle is transformers' mamba_selective_scan, sequence by sequence (zero initial state)."""
    kw = scan_inputs((7, 1, 4), seed=12)
    kw["initial_state"] = None
    y, h = selective_scan_varlen_ref(**kw)
    cu = kw["cu_seqlens"].tolist()
    for s in range(len(cu) - 1):
        sl = slice(cu[s], cu[s + 1])
        t = lambda x: x[sl].T[None]  # noqa: E731  [L, C] -> [1, C, L]
        ys, hs = mamba_selective_scan(
            t(kw["u"]), t(kw["dt"]), kw["A"], t(kw["B"]), t(kw["C"]), D=kw["D"], z=t(kw["z"]),
            delta_bias=kw["dt_bias"], delta_softplus=True, return_last_state=True,
        )
        torch.testing.assert_close(y[sl], ys[0].T, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h[s], hs[0], atol=1e-5, rtol=1e-5)


def test_scan_reference_initial_state_chains():
    """With initial states: equal to the chunked scan, and scanning a+b equals a, then b from a's state."""
    kw = scan_inputs((10,), seed=13)
    y, h = selective_scan_varlen_ref(**kw)
    t = lambda x: x.T[None]  # noqa: E731
    ys, hs = selective_scan(t(kw["u"]), t(kw["dt"]), kw["A"], t(kw["B"]), t(kw["C"]), D=kw["D"], z=t(kw["z"]),
                            delta_bias=kw["dt_bias"], delta_softplus=True, return_last_state=True,
                            initial_state=kw["initial_state"], chunk_size=3)
    torch.testing.assert_close(y, ys[0].T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, hs, atol=1e-5, rtol=1e-5)
    split = {**kw, "cu_seqlens": torch.tensor([0, 4], device=DEVICE)}
    split.update({k: kw[k][:4] for k in ("u", "dt", "B", "C", "z")})
    y1, h1 = selective_scan_varlen_ref(**split)
    split.update({k: kw[k][4:] for k in ("u", "dt", "B", "C", "z")}, cu_seqlens=torch.tensor([0, 6]), initial_state=h1)
    y2, h2 = selective_scan_varlen_ref(**split)
    torch.testing.assert_close(torch.cat([y1, y2]), y, atol=1e-6, rtol=0)
    torch.testing.assert_close(h2, h, atol=1e-6, rtol=0)


@needs_triton
def test_scan_pack_left_padded_batch():
    """Left-padded [B, D, L] rows -> packed -> scan -> unpacked equals transformers per row."""
    g = torch.Generator().manual_seed(14)
    Bn, Dm, L, N = 3, 4, 6, 2
    mask = torch.arange(L)[None] >= torch.tensor([0, 2, 5])[:, None]
    u, dt, z = (torch.randn(Bn, Dm, L, generator=g) for _ in range(3))
    Bm, Cm = (torch.randn(Bn, N, L, generator=g) for _ in range(2))
    A = -torch.rand(Dm, N, generator=g) - 0.1
    packed = {k: pack_padded(v.to(DEVICE), mask.to(DEVICE))[0] for k, v in dict(u=u, dt=dt, z=z, B=Bm, C=Cm).items()}
    cu = pack_padded(u, mask)[1]
    y, h = selective_scan_varlen(packed["u"], packed["dt"], A.to(DEVICE), packed["B"], packed["C"], cu.to(DEVICE),
                                 z=packed["z"], dt_softplus=True)
    y = unpack_padded(y, mask.to(DEVICE)).cpu()
    for b in range(Bn):
        keep = mask[b]
        ys, hs = mamba_selective_scan(u[b:b + 1, :, keep], dt[b:b + 1, :, keep], A, Bm[b:b + 1, :, keep],
                                      Cm[b:b + 1, :, keep], z=z[b:b + 1, :, keep], delta_softplus=True,
                                      return_last_state=True)
        torch.testing.assert_close(y[b][:, keep], ys[0], atol=1e-5, rtol=1e-5)
        assert bool((y[b][:, ~keep] == 0).all())
        torch.testing.assert_close(h[b].cpu(), hs[0], atol=1e-5, rtol=1e-5)


@needs_triton
def test_scan_opcheck_and_flops():
    kw = scan_inputs((3, 0, 2), Dm=4, N=2, seed=15)
    args = (kw["u"], kw["dt"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["dt_bias"], kw["initial_state"],
            kw["cu_seqlens"], True)
    op = torch.ops.hf_tokred.selective_scan_varlen.default
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    with force_backend("torch"):
        torch.library.opcheck(op, args, test_utils="test_aot_dispatch_dynamic")
    with FlopCounterMode(display=False) as counter:
        selective_scan_varlen(**kw)
    T, Dm, N = 5, 4, 2
    assert counter.get_total_flops() == 9 * T * Dm * N + 3 * T * Dm > 0


# ---------------------------------------------------------------------------------------------------
# dispatch


def test_dispatch_rules(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "_logged", set())
    monkeypatch.delenv("HF_TOKRED_KERNEL_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with caplog.at_level(logging.INFO, logger="hf_tokred"):
        assert dispatch.choose_backend("op", "cpu") == "torch"
        assert dispatch.choose_backend("op", "cpu") == "torch"
    assert len([r for r in caplog.records if "op runs on torch" in r.getMessage()]) == 1  # logged once
    with pytest.raises(RuntimeError, match="needs a CUDA tensor"):
        with force_backend("triton"):
            dispatch.choose_backend("op", "cpu")
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    assert dispatch.choose_backend("op", "cuda") == "triton"
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs Triton"):  # never a silent fallback on CUDA
        dispatch.choose_backend("op", "cuda")
    monkeypatch.setenv("HF_TOKRED_KERNEL_BACKEND", "torch")  # explicit opt-in only
    assert dispatch.choose_backend("op", "cuda") == "torch"
    monkeypatch.setenv("HF_TOKRED_KERNEL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="not a kernel backend"):
        dispatch.choose_backend("op", "cpu")
    monkeypatch.setenv("HF_TOKRED_KERNEL_BACKEND", "auto")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    assert dispatch.choose_backend("op", "cpu") == "triton"


def test_no_hard_import_of_triton_or_mamba_ssm():
    """The public kernel modules import neither at module level (the Triton ones load on first use)."""
    root = Path(dispatch.__file__).parent
    for name in ("__init__", "apply_plan", "selective_scan", "dispatch"):
        tree = ast.parse((root / f"{name}.py").read_text())
        for node in tree.body:  # module level only
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(m.split(".")[0] in ("triton", "mamba_ssm") for m in mods), (name, mods)


def test_runs_without_triton_or_mamba_ssm(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError, find_spec -> None
    monkeypatch.setitem(sys.modules, "mamba_ssm", None)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not dispatch.triton_available()
    assert dispatch.choose_backend("op", "cpu") == "torch"
    with pytest.raises(RuntimeError, match="needs Triton"):
        dispatch.choose_backend("op", "cuda")
    kw = scan_inputs((3, 2), seed=30)
    y, _ = selective_scan_varlen(**{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
    assert torch.isfinite(y).all()


# ---------------------------------------------------------------------------------------------------
# the reducing model's CUDA branch, run on CPU


@contextlib.contextmanager
def cuda_anchor_branch():
    """Within the block, the reducing loop's anchor code takes its CUDA branch on CPU tensors: only inside
    ``hf_tokred.loop._apply_both`` does a tensor report device type ``"cuda"`` (the branch test); everything else
    sees the real device.  Yields the list of ``fused_apply_plan`` calls made through that branch."""
    from hf_tokred import loop

    calls = []
    fused = loop.fused_apply_plan

    def spy(*args, **kwargs):
        calls.append(args[6:8])  # the two branches' merge weights
        return fused(*args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        real = torch._C.TensorBase.device.__get__
        branch = loop._apply_both.__code__

        class _Cuda:
            type = "cuda"

        def device(self):
            return _Cuda if sys._getframe(1).f_code is branch else real(self)

        m.setattr(torch.Tensor, "device", property(device))
        m.setattr(loop, "fused_apply_plan", spy)
        yield calls


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["mamba", "mamba2"])
@pytest.mark.parametrize("method, q", [("utrc", 0.2), ("utrc", 0.8), ("utrc_reference", 0.3), ("evit", 0.5)])
def test_reducing_model_cuda_branch(backend, family, method, q):
    """The anchor code's CUDA branch (the fused op: residual and hidden branch each with its own strategy and q)
    gives the slow reference's logits and the CPU branch's logits and gradients, kernel or torch backend."""
    import hf_tokred
    from hf_tokred import TokenReductionConfig

    from conftest import tiny_model
    from slow_reference import row_plans, slow_forward

    model = tiny_model(family, layers=4)
    cfg = TokenReductionConfig(method=method, keep_ratio=0.55, anchors=[0, 2], q=q)
    hf_tokred.apply_token_reduction(model, cfg)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 96, (2, 21), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0

    def run(fused_path, grad_weights=None):
        model.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as stack:
            calls = stack.enter_context(cuda_anchor_branch()) if fused_path else []
            stack.enter_context(force_backend(backend))
            stack.enter_context(torch.set_grad_enabled(grad_weights is not None))
            out = model(ids, attention_mask=mask)
            if grad_weights is not None:
                (out.logits.nan_to_num(0) * grad_weights).sum().backward()
        return out, calls, {k: p.grad for k, p in model.named_parameters()}

    cpu_branch, _, _ = run(False)
    out, calls, _ = run(True)
    assert len(calls) == len(out.plans) == 2  # every anchor went through the fused op
    for w_res, w_hid in calls:  # each branch with its own strategy: merge weights where it merges, none to prune
        assert (w_res is None) == (cfg.residual == "prune") and (w_hid is None) == (cfg.hidden == "prune")
    torch.testing.assert_close(out.logits, cpu_branch.logits, atol=1e-5, rtol=0, equal_nan=True)
    for b in range(2):
        real = mask[b].nonzero().flatten()
        kept = out.computed_mask[b].nonzero().flatten()
        ref = slow_forward(model, ids[b, real], row_plans(out.plans, mask.bool(), b), len(real), *branch_strategies(cfg), q)
        torch.testing.assert_close(out.logits[b, kept], ref, atol=1e-5, rtol=0)
    if backend == "torch":  # the fused op's backward equals the CPU branch's autograd
        w = torch.randn(out.logits.shape, generator=g).masked_fill(~out.computed_mask[..., None], 0)
        fused_grads, cpu_grads = run(True, w)[2], run(False, w)[2]
        for k, grad in cpu_grads.items():
            torch.testing.assert_close(fused_grads[k], grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"d/d{k}: {m}")
