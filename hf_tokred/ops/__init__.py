"""Kernels: tensors in, tensors out (this package never imports the method's code in :mod:`hf_tokred.reduce`).

* :mod:`.cpu` -- compiled CPU kernels (Mamba-1 selective scan and causal conv, the anchor's similarity arg-max);
* :mod:`.scan` -- the chunked torch Mamba-1 selective scan (the CPU fallback);
* :func:`fused_apply_plan` -- ``apply(residual) + apply(hidden)`` of one anchor in one Triton launch
  (custom op ``torch.ops.hf_tokred.apply_plan_fused``);
* :func:`selective_scan_varlen` -- Mamba-1 selective scan over packed variable-length sequences with
  initial/final states (custom op ``torch.ops.hf_tokred.selective_scan_varlen``), beside its torch reference.

Triton is optional: importing this package does not import it (the Triton kernel modules load on first use, so
``TRITON_INTERPRET=1`` may be set any time before the first kernel call).  On CUDA tensors the Triton kernels
run (an error if Triton is missing, never a silent fallback); on CPU the torch implementations run unless
``TRITON_INTERPRET=1``.  See :mod:`.dispatch`.
"""

from .apply_plan import fused_apply_plan
from .dispatch import choose_backend, force_backend, interpret_requested, triton_available
from .selective_scan import (
    cu_seqlens_from_lengths,
    pack_padded,
    selective_scan_varlen,
    selective_scan_varlen_ref,
    unpack_padded,
)

__all__ = [
    "choose_backend",
    "cu_seqlens_from_lengths",
    "force_backend",
    "fused_apply_plan",
    "interpret_requested",
    "pack_padded",
    "selective_scan_varlen",
    "selective_scan_varlen_ref",
    "triton_available",
    "unpack_padded",
]
