"""Fast paths installed into transformers' Mamba code (``import hf_tokred`` installs them).

transformers' fallback for the Mamba-1 selective scan steps through time in Python. We rebind the
module-level ``mamba_selective_scan`` (looked up as a global at call time by ``MambaMixer.forward``)
to a dispatcher, in every family's modeling module that has one (the families table's ``fast_functions``:
``modeling_mamba`` and ``modeling_falcon_mamba``, which carries its own copies; each dispatcher falls back to its
own module's function):

* CPU tensors: the compiled scan of :mod:`hf_tokred.ops.cpu` when it can be built, else
  :func:`hf_tokred.ops.scan.selective_scan` (chunked torch; both equal the stock loop in fp32 — in bf16/fp16 they
  accumulate in fp32, so they are more accurate than the stock loop and differ slightly).  When a gradient is
  needed, the compiled forward is wrapped so that ``backward()`` re-runs the torch scan on the saved inputs and
  differentiates it (a plain ``model(ids)`` is as fast as one under ``torch.no_grad()``);
* CUDA tensors with ``mamba_ssm`` installed: transformers' own choice (mamba-ssm's CUDA kernel);
* CUDA tensors without it: our Triton scan (:func:`hf_tokred.ops.selective_scan_varlen`), never the
  Python loop.

The Mamba-1 depthwise convolution (``causal_conv1d_fn``) is rebound the same way: on CPU the fused compiled
convolution + silu of :mod:`hf_tokred.ops.cpu` (backward through transformers' own), else transformers' own.

Dense and reduced runs use the same path; the path taken is logged once (logger ``hf_tokred``).
Mamba-2 keeps transformers' chunked SSD code (mamba-ssm's Triton kernels when installed).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
from collections.abc import Callable

import torch

from .families import FAMILIES
from .ops import cpu as cpu_kernel
from .ops import pack_padded, selective_scan_varlen, unpack_padded
from .ops.scan import selective_scan

__all__ = ["CUDA_ADVICE_FILTER", "REPLACEMENTS", "causal_conv1d_fn", "mamba_selective_scan", "stock_kernels"]

logger = logging.getLogger("hf_tokred")
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
    mask = torch.ones(hidden_states.shape[0], hidden_states.shape[-1], dtype=torch.bool, device=hidden_states.device)
    pack = lambda x: None if x is None else pack_padded(x, mask)[0]  # noqa: E731
    u, cu = pack_padded(hidden_states, mask)
    y, state = selective_scan_varlen(u, pack(dt), A, pack(B), pack(C), cu, D=D, z=pack(z), dt_bias=delta_bias,
                                     dt_softplus=delta_softplus)
    y = unpack_padded(y, mask)
    return (y, state) if return_last_state else y


class _CompiledForward(torch.autograd.Function):
    """Forward with a compiled CPU kernel; backward through the equal torch implementation, recomputed.

    A plain ``model(ids)`` (parameters that require grad, no ``torch.no_grad()``) gets the compiled kernel's speed;
    if ``backward()`` is called, the torch implementation is re-run on the saved inputs and differentiated.
    """

    @staticmethod
    def forward(ctx, fast, slow, names, static, *tensors):
        ctx.slow, ctx.names, ctx.static = slow, names, static
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            out = fast(**dict(zip(names, tensors)), **static)
        return out if isinstance(out, tuple) else (out,)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(t.requires_grad) if t is not None else None for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.slow(**dict(zip(ctx.names, inputs)), **ctx.static)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                   if pairs and wanted else [None] * len(wanted))
        return (None, None, None, None, *(next(got) if t is not None and t.requires_grad else None for t in inputs))


def _call_compiled(fast, slow, tensor_args: dict, static: dict):
    """``fast(**tensor_args, **static)``; when a gradient is needed, through :class:`_CompiledForward`."""
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensor_args.values())
    if not needs_grad:
        return fast(**tensor_args, **static)
    names = tuple(tensor_args)
    out = _CompiledForward.apply(fast, slow, names, static, *tensor_args.values())
    return out if len(out) > 1 else out[0]


_SCAN_TENSORS = ("hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias")


def _cuda_scan(hidden_states, *args, **kwargs):
    """The Triton scan; it has no backward, so when a gradient is needed, backward re-runs the torch scan."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("use_mambapy", "use_associative_scan")}
    call = dict(zip(_SCAN_TENSORS, (hidden_states, *args)), **kwargs)
    tensors = {k: call.get(k) for k in _SCAN_TENSORS}
    static = {k: v for k, v in call.items() if k not in _SCAN_TENSORS}
    return _call_compiled(_triton_scan, selective_scan, tensors, static)


def _scan_dispatcher(stock: Callable) -> Callable:
    def mamba_selective_scan(hidden_states, *args, **kwargs):
        """Dispatch transformers' Mamba-1 scan by device (see the module docstring)."""
        if hidden_states.device.type == "cpu":
            kwargs = {k: v for k, v in kwargs.items() if k not in ("use_mambapy", "use_associative_scan")}
            call = dict(zip(_SCAN_TENSORS, (hidden_states, *args)), **kwargs)
            A = call.get("A")
            if A is not None and A.shape[-1] <= cpu_kernel.MAX_STATE and cpu_kernel.available():
                _log_once("hf_tokred compiled (CPU)")
                tensors = {k: call.get(k) for k in _SCAN_TENSORS}
                static = {k: v for k, v in call.items() if k not in _SCAN_TENSORS}
                return _call_compiled(cpu_kernel.selective_scan_cpu, selective_scan, tensors, static)
            _log_once("hf_tokred chunked torch (CPU)")
            return selective_scan(hidden_states, *args, **kwargs)
        if hidden_states.device.type == "cuda" and not _mamba_ssm_installed():
            _log_once("hf_tokred Triton (CUDA)")
            return _cuda_scan(hidden_states, *args, **kwargs)
        _log_once(f"transformers / mamba-ssm ({hidden_states.device.type})")
        return stock(hidden_states, *args, **kwargs)

    return mamba_selective_scan


def _conv_dispatcher(stock: Callable) -> Callable:
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        """transformers' Mamba-1 convolution: fused compiled kernel on CPU (no extra options), else stock."""
        if (hidden_states.device.type == "cpu" and activation in (None, "silu", "swish")
                and not any(v is not None for v in kwargs.values()) and cpu_kernel.available()):
            return _call_compiled(cpu_kernel.causal_conv1d_cpu, stock,
                                  {"hidden_states": hidden_states, "weight": weight, "bias": bias},
                                  {"activation": activation})
        return stock(hidden_states, weight, bias, activation=activation, **kwargs)

    return causal_conv1d_fn


_DISPATCHERS = {"mamba_selective_scan": _scan_dispatcher, "causal_conv1d_fn": _conv_dispatcher}


class _NoCudaAdviceOnCpu(logging.Filter):
    """Drop transformers' "falling back ... install mamba_ssm / causal_conv1d" warnings on machines without CUDA:
    those packages cannot run there, and hf_tokred's compiled kernels already replace the slow Mamba-1 paths."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is falling back to its reference PyTorch implementation" not in record.getMessage() \
            or torch.cuda.is_available()


CUDA_ADVICE_FILTER = _NoCudaAdviceOnCpu()
HUB_KERNELS_LOGGER = "transformers.integrations.hub_kernels"


def _stock_functions() -> dict:
    """transformers' own functions, per modeling module of every family with fast functions (read at import,
    before ``install()`` replaces them)."""
    found = {}
    for family in FAMILIES.values():
        if family.fast_functions:
            module = importlib.import_module(family.modeling_module)
            found[module] = {name: getattr(module, name) for name in family.fast_functions}
    return found


_STOCK = _stock_functions()
#: ``{module: {function name: replacement}}`` (``install()`` applies and records them)
REPLACEMENTS = {module: {name: _DISPATCHERS[name](fn) for name, fn in stock.items()}
                for module, stock in _STOCK.items()}
_MAMBA = importlib.import_module(FAMILIES["mamba"].modeling_module)
#: the dispatchers installed into ``modeling_mamba``
mamba_selective_scan = REPLACEMENTS[_MAMBA]["mamba_selective_scan"]
causal_conv1d_fn = REPLACEMENTS[_MAMBA]["causal_conv1d_fn"]


@contextlib.contextmanager
def stock_kernels():
    """Temporarily restore transformers' own code paths (for side-by-side benchmarks and tests)."""
    saved = [(module, name, getattr(module, name)) for module, stock in _STOCK.items() for name in stock]
    for module, stock in _STOCK.items():
        for name, fn in stock.items():
            setattr(module, name, fn)
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
