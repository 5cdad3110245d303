"""Fused kernels for token reduction, each beside its torch reference, dispatched by device.

* :func:`fused_apply_plan` - ``apply_plan(residual) + apply_plan(hidden)`` (and ``reduce_along`` for
  mask/positions) in one Triton launch: custom op ``torch.ops.hf_tokred.apply_plan_fused``.
* :func:`selective_scan_varlen` - Mamba-1 selective scan over packed variable-length sequences with
  initial/final states: custom op ``torch.ops.hf_tokred.selective_scan_varlen``.
* :func:`mamba2_chunk_scan_varlen` - Mamba-2 varlen scan through ``mamba_ssm`` when importable, else torch.

Triton and mamba_ssm are optional: importing this package imports neither (the Triton kernel modules
load on first use, so ``TRITON_INTERPRET=1`` may be set any time before the first kernel call).  On
CUDA tensors the Triton kernels run (an error if Triton is missing, never a silent fallback); on CPU
the torch implementations run unless ``TRITON_INTERPRET=1``.  See :mod:`.dispatch`.
"""

from .apply_plan import apply_plan_fused_reference, fused_apply_plan
from .dispatch import (
    choose_backend,
    force_backend,
    interpret_requested,
    mamba2_chunk_scan_varlen,
    triton_available,
)
from .selective_scan import (
    cu_seqlens_from_lengths,
    pack_padded,
    selective_scan_varlen,
    selective_scan_varlen_ref,
    unpack_padded,
)
from .ssd import ssd_varlen_ref, ssd_varlen_torch

__all__ = [
    "apply_plan_fused_reference",
    "choose_backend",
    "cu_seqlens_from_lengths",
    "force_backend",
    "fused_apply_plan",
    "interpret_requested",
    "mamba2_chunk_scan_varlen",
    "pack_padded",
    "selective_scan_varlen",
    "selective_scan_varlen_ref",
    "ssd_varlen_ref",
    "ssd_varlen_torch",
    "triton_available",
    "unpack_padded",
]
