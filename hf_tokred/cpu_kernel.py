"""The compiled CPU selective scan (``csrc/selective_scan_cpu.cpp``), built on first use.

One sequential pass over time per (batch, channel) row with the state in registers and ``exp``
vectorised over the state dimension (glibc's libmvec).  It is built with torch's C++ extension
machinery the first time a CPU Mamba-1 scan runs (about a minute; cached under
``~/.cache/torch_extensions``).  Where it cannot be built (no C++ compiler), a warning is logged once
and the chunked torch scan (:mod:`hf_tokred.scan`) runs instead.  ``HF_TOKRED_CPU_KERNEL=0`` disables it.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from .scan import finish_output, prepare_dt

__all__ = ["available", "selective_scan_cpu"]

logger = logging.getLogger("hf_tokred")
_SOURCE = Path(__file__).parent / "csrc" / "selective_scan_cpu.cpp"
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
            extra_cflags=["-O3", "-ffast-math", "-fopenmp-simd", *_ARCH_FLAGS.get(capability, [])],
            verbose=False,
        )
    except Exception as err:  # no compiler / ninja / headers: keep working on the torch path
        logger.warning("hf_tokred: the compiled CPU scan could not be built (%s); using the chunked torch scan", err)
        return None


def available() -> bool:
    return _extension() is not None


def selective_scan_cpu(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False, initial_state=None):
    """Same contract as :func:`hf_tokred.scan.selective_scan` (fp32 inside, ``y`` in the input dtype)."""
    u = hidden_states.float().contiguous()
    dt = prepare_dt(dt, delta_bias, delta_softplus)
    batch, d_inner, _ = u.shape
    h0 = (torch.zeros(batch, d_inner, A.shape[-1]) if initial_state is None else initial_state.float()).contiguous()
    y, state = _extension().selective_scan_fwd(
        u, dt.contiguous(), A.float().contiguous(), B.float().transpose(1, 2).contiguous(),
        C.float().transpose(1, 2).contiguous(), h0,
    )
    y = finish_output(y, u, D, z, hidden_states.dtype)
    return (y, state) if return_last_state else y
