"""The compiled CPU kernels of the Mamba-1 mixer (``csrc/selective_scan_cpu.cpp``), built on first use.

* ``selective_scan_cpu``: the whole SSM step (``softplus(dt + bias)``, the scan, ``+ D*u``, ``* silu(z)``)
  in one pass over time, vectorised over blocks of 8 channels with the state in a small array and an
  inlined polynomial ``exp`` for the decay factors; it reads transformers' transposed views in place (any strides) and writes the
  output time-major, the layout the output projection reads.
* ``causal_conv1d_cpu``: the depthwise causal convolution + bias + silu in one pass (transformers'
  fallback runs ``F.conv1d`` on a strided copy, then silu, then another copy).
* ``grid_argmax``: at an anchor, each similarity row scaled, rounded to the tie grid and arg-maxed in one
  pass (:func:`hf_tokred.reduce` uses it on fp32 CPU tensors; torch ops elsewhere, same result).

Built with torch's C++ extension machinery the first time a CPU Mamba-1 mixer runs (about a minute; cached
under ``~/.cache/torch_extensions``).  Where it cannot be built (no C++ compiler), a warning is logged once
and the chunked torch scan (:mod:`hf_tokred.ops.scan`) and transformers' convolution run instead.
``HF_TOKRED_CPU_KERNEL=0`` disables it.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch


__all__ = ["available", "causal_conv1d_cpu", "grid_argmax", "selective_scan_cpu"]

logger = logging.getLogger("hf_tokred")
_SOURCE = Path(__file__).parent / "csrc" / "selective_scan_cpu.cpp"
MAX_STATE = 64  # largest ssm_state_size the compiled scan takes (N_MAX in the C++ source); larger: torch scan
_ARCH_FLAGS = {"AVX512": ["-mavx512f", "-mavx2", "-mfma"], "AVX2": ["-mavx2", "-mfma"]}


@functools.lru_cache(maxsize=1)
def _extension():
    if os.environ.get("HF_TOKRED_CPU_KERNEL", "1") == "0":
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    try:
        from torch.utils.cpp_extension import load

        return load(
            name=f"hf_tokred_scan_cpu_{capability.lower()}",
            sources=[str(_SOURCE)],
            # -fopenmp: at::parallel_for is header code that only runs in parallel when compiled with OpenMP
            # (torch's own libgomp.so.1 is already loaded and is the one used at run time)
            extra_cflags=["-O3", "-ffast-math", "-fopenmp", *_ARCH_FLAGS.get(capability, [])],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as err:  # no compiler / ninja / headers: keep working on the torch path
        logger.warning("hf_tokred: the compiled CPU scan could not be built (%s); using the chunked torch scan", err)
        return None


def available() -> bool:
    return _extension() is not None


def _or_empty(t):
    return torch.empty(0) if t is None else t.float().contiguous()


def selective_scan_cpu(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False, initial_state=None):
    """Same contract as :func:`hf_tokred.scan.selective_scan` (fp32 inside, ``y`` in the input dtype).

    ``y`` is returned as a ``[batch, d_inner, L]`` view of time-major storage, which is the layout the
    mixer's output projection reads next (``y.transpose(1, 2)`` is contiguous).
    """
    batch, d_inner, _ = hidden_states.shape
    h0 = (torch.zeros(batch, d_inner, A.shape[-1]) if initial_state is None else initial_state.float()).contiguous()
    y, state = _extension().selective_scan_fwd(
        hidden_states.float(), dt.float(), A.float().contiguous(), B.float(), C.float(), h0,
        _or_empty(delta_bias), bool(delta_softplus), _or_empty(D), torch.empty(0) if z is None else z.float(),
    )
    y = y.transpose(1, 2).to(hidden_states.dtype)
    return (y, state) if return_last_state else y


def causal_conv1d_cpu(hidden_states, weight, bias=None, activation=None):
    """transformers' ``causal_conv1d_fn`` (depthwise causal conv, optional silu) in one fused pass.

    ``hidden_states`` ``[batch, d_inner, L]`` (any strides), ``weight`` ``[d_inner, K]``; the result is a
    ``[batch, d_inner, L]`` view of time-major storage, in the input dtype.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d_cpu supports activation None or 'silu', got {activation!r}")
    out = _extension().causal_conv1d_fwd(hidden_states.float(), weight.float().contiguous(), _or_empty(bias),
                                         activation is not None)
    return out.transpose(1, 2).to(hidden_states.dtype)


def grid_argmax(sim, scale):
    """Row-wise ``round(sim * scale[:, None, :]).max(-1)`` (values and first index of the maximum), fp32 CPU;
    ``sim [G, m, k]``, ``scale [G, k]``."""
    return _extension().grid_argmax(sim.contiguous(), scale.contiguous())
