"""Fast paths installed into transformers' Mamba code (``import hf_tokred`` installs them).

transformers' fallback for the Mamba-1 selective scan steps through time in Python. We rebind the
module-level ``mamba_selective_scan`` (looked up as a global at call time by ``MambaMixer.forward``)
to a dispatcher:

* CPU tensors: the compiled scan of :mod:`hf_tokred.cpu_kernel` when it can be built and no gradient is
  needed, else :func:`hf_tokred.scan.selective_scan` (chunked torch; both equal the stock loop in fp32 —
  in bf16/fp16 it accumulates in fp32, so it is more accurate than the stock loop and differs slightly);
* CUDA tensors with ``mamba_ssm`` installed: transformers' own choice (mamba-ssm's CUDA kernel);
* CUDA tensors without it: our Triton scan (:func:`hf_tokred.kernels.selective_scan_varlen`), never the
  Python loop.

The Mamba-1 depthwise convolution (``causal_conv1d_fn``) is rebound the same way: on CPU without gradients
the fused compiled convolution + silu of :mod:`hf_tokred.cpu_kernel`, else transformers' own.

Dense and reduced runs use the same path; the path taken is logged once (logger ``hf_tokred``).
Mamba-2 keeps transformers' chunked SSD code (mamba-ssm's Triton kernels when installed).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging

import torch
from transformers.models.mamba import modeling_mamba

from . import cpu_kernel
from .scan import selective_scan

__all__ = ["causal_conv1d_fn", "install", "mamba_selective_scan", "stock_kernels"]

logger = logging.getLogger("hf_tokred")
_STOCK = {"mamba_selective_scan": modeling_mamba.mamba_selective_scan,
          "causal_conv1d_fn": modeling_mamba.causal_conv1d_fn}
_logged: set[str] = set()


def _log_once(path: str) -> None:
    if path not in _logged:
        _logged.add(path)
        logger.info("hf_tokred: Mamba-1 selective scan runs on the %s path", path)


def _mamba_ssm_installed() -> bool:
    return importlib.util.find_spec("mamba_ssm") is not None


def _triton_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                 return_last_state=False, **_flags):
    """transformers' ``[batch, d_inner, L]`` layout through the packed Triton kernel (every row full length)."""
    from .kernels import pack_padded, selective_scan_varlen, unpack_padded

    mask = torch.ones(hidden_states.shape[0], hidden_states.shape[-1], dtype=torch.bool, device=hidden_states.device)
    pack = lambda x: None if x is None else pack_padded(x, mask)[0]  # noqa: E731
    u, cu = pack_padded(hidden_states, mask)
    y, state = selective_scan_varlen(u, pack(dt), A, pack(B), pack(C), cu, D=D, z=pack(z), dt_bias=delta_bias,
                                     dt_softplus=delta_softplus)
    y = unpack_padded(y, mask)
    return (y, state) if return_last_state else y


def mamba_selective_scan(hidden_states, *args, **kwargs):
    """Dispatch transformers' Mamba-1 scan by device (see the module docstring)."""
    if hidden_states.device.type == "cpu":
        needs_grad = torch.is_grad_enabled() and (hidden_states.requires_grad or any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())))
        A = args[1] if len(args) > 1 else kwargs.get("A")
        if not needs_grad and A is not None and A.shape[-1] <= cpu_kernel.MAX_STATE and cpu_kernel.available():
            _log_once("hf_tokred compiled (CPU)")
            kwargs = {k: v for k, v in kwargs.items() if k not in ("use_mambapy", "use_associative_scan")}
            return cpu_kernel.selective_scan_cpu(hidden_states, *args, **kwargs)
        _log_once("hf_tokred chunked torch (CPU)")
        return selective_scan(hidden_states, *args, **kwargs)
    if hidden_states.device.type == "cuda" and not _mamba_ssm_installed():
        _log_once("hf_tokred Triton (CUDA)")
        return _triton_scan(hidden_states, *args, **kwargs)
    _log_once(f"transformers / mamba-ssm ({hidden_states.device.type})")
    return _STOCK["mamba_selective_scan"](hidden_states, *args, **kwargs)


def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' Mamba-1 convolution: fused compiled kernel on CPU (no gradient, no extra options), else stock."""
    if (hidden_states.device.type == "cpu" and activation in (None, "silu", "swish")
            and not any(v is not None for v in kwargs.values())
            and not (torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad))
            and cpu_kernel.available()):
        return cpu_kernel.causal_conv1d_cpu(hidden_states, weight, bias, activation)
    return _STOCK["causal_conv1d_fn"](hidden_states, weight, bias, activation=activation, **kwargs)


def install() -> None:
    modeling_mamba.mamba_selective_scan = mamba_selective_scan
    modeling_mamba.causal_conv1d_fn = causal_conv1d_fn


@contextlib.contextmanager
def stock_kernels():
    """Temporarily restore transformers' own code paths (for side-by-side benchmarks and tests)."""
    saved = {name: getattr(modeling_mamba, name) for name in _STOCK}
    for name, fn in _STOCK.items():
        setattr(modeling_mamba, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(modeling_mamba, name, fn)
