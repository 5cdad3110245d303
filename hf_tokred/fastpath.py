"""CPU fast paths installed into transformers' Mamba code (``import hf_tokred`` installs them).

transformers' CPU fallback for the Mamba-1 selective scan steps through time in Python. We rebind the
module-level ``mamba_selective_scan`` (looked up as a global at call time by ``MambaMixer.forward``)
to a dispatcher: CPU tensors go to :func:`hf_tokred.scan.selective_scan` (chunked, numerically equal
to the stock loop), anything else keeps transformers' own choice (mamba-ssm's CUDA kernel when
installed).  Dense and reduced runs use the same path.  Mamba-2 keeps transformers' chunked SSD code.
"""

from __future__ import annotations

import contextlib
import logging

from transformers.models.mamba import modeling_mamba

from .scan import selective_scan

__all__ = ["install", "mamba_selective_scan", "stock_kernels"]

logger = logging.getLogger("hf_tokred")
_STOCK = {"mamba_selective_scan": modeling_mamba.mamba_selective_scan}
_logged: set[str] = set()


def _log_once(path: str) -> None:
    if path not in _logged:
        _logged.add(path)
        logger.info("hf_tokred: Mamba-1 selective scan runs on the %s path", path)


def mamba_selective_scan(hidden_states, *args, **kwargs):
    """Dispatch transformers' Mamba-1 scan: our chunked torch scan on CPU, transformers' own elsewhere."""
    if hidden_states.device.type == "cpu":
        _log_once("hf_tokred chunked torch (CPU)")
        return selective_scan(hidden_states, *args, **kwargs)
    _log_once(f"transformers ({hidden_states.device.type})")
    return _STOCK["mamba_selective_scan"](hidden_states, *args, **kwargs)


def install() -> None:
    modeling_mamba.mamba_selective_scan = mamba_selective_scan


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
