"""Which implementation runs: Triton kernels on CUDA, the torch references on CPU.

Rules (:func:`choose_backend`):

* CUDA tensors -> ``"triton"``.  If Triton cannot be imported this raises a :class:`RuntimeError`
  that says what to install; there is never a silent fallback to the (much slower) torch path on a GPU.
* CPU tensors -> ``"torch"``, unless the Triton interpreter was requested explicitly with
  ``TRITON_INTERPRET=1`` (the way the tests run the kernels without a GPU), then ``"triton"``.
* ``HF_TOKRED_KERNEL_BACKEND=torch|triton|auto`` (environment) or :func:`force_backend` (context
  manager) override the choice explicitly, e.g. to time the torch path on a GPU.  Asking for Triton on a
  CPU tensor without the interpreter raises.

The first time an op runs on a given path, one INFO record goes to the ``"hf_tokred"`` logger, e.g.
``hf_tokred kernels: apply_plan_fused runs on triton (cuda)``.

Triton is not imported by this module (it is looked up lazily), so ``import hf_tokred.ops`` works on machines
without it.

:data:`LAUNCH_SPACE` lists every specialisation the Triton launchers can compile on a GPU, axis by axis: the
launchers take their block sizes, warps and dtypes from it (casting inputs of other dtypes exactly, see
:func:`kernel_dtype`), and ``tests/test_triton_compile.py`` compiles every combination for sm_80 and sm_90.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import itertools
import logging
import os
import threading
from collections.abc import Iterator
from types import ModuleType

import torch

__all__ = [
    "BACKENDS",
    "KERNEL_DTYPES",
    "LAUNCH_SPACE",
    "choose_backend",
    "force_backend",
    "interpret_requested",
    "kernel_dtype",
    "launch_points",
    "triton_available",
]

logger = logging.getLogger("hf_tokred")

BACKENDS = ("auto", "torch", "triton")
_ENV = "HF_TOKRED_KERNEL_BACKEND"

#: The activation dtypes the Triton kernels are compiled for (they compute in fp32 and round once on storing).
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_F32, _F16, _BF16 = KERNEL_DTYPES

#: Every specialisation a launcher compiles on a GPU: per kernel, the values of each axis (all combinations run).
#: Under TRITON_INTERPRET=1 smaller blocks run instead (interpreted kernels are never compiled).
LAUNCH_SPACE: dict[str, dict[str, tuple]] = {
    "apply_plan_fused": {
        # (residual, hidden): one dtype, or an fp32 residual (residual_in_fp32) beside a half-precision hidden state;
        # any other pair runs as kernel_dtype(pair) for both
        "dtypes": ((_F32, _F32), (_F16, _F16), (_BF16, _BF16), (_F32, _F16), (_F32, _BF16)),
        "RES_MODE": (0, 1, 2),  # per branch: 0 prune, 1 one merge weight per token, 2 one per channel
        "HID_MODE": (0, 1, 2),
        "block": ((512, 4),),  # (BLOCK_D, num_warps): one output row's channels in blocks of 512 lanes
    },
    "selective_scan_varlen": {
        "dtype": KERNEL_DTYPES,  # u, dt, B, C, z and y; A, D, dt_bias and the states are fp32
        "HAS_Z": (False, True),
        "SOFTPLUS": (False, True),
        # (BLOCK_N, BLOCK_D, num_warps): the smallest BLOCK_N >= the state size (16 for every released Mamba-1;
        # larger states are refused), the fp32 state tile BLOCK_D x BLOCK_N kept at <= 4096 elements
        "block": ((16, 64, 4), (64, 32, 4), (256, 16, 4)),
    },
}


def launch_points(kernel: str) -> list[dict]:
    """Every combination of :data:`LAUNCH_SPACE` ``[kernel]``'s axes, as ``{axis: value}`` dicts."""
    axes = LAUNCH_SPACE[kernel]
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def kernel_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype of :data:`KERNEL_DTYPES` that inputs of ``dtypes`` run in: their promoted dtype when it is one, else
    fp32.  Exact: the kernels load every input as fp32, so casting a wider input to fp32 first changes nothing."""
    promoted = functools.reduce(torch.promote_types, dtypes)
    return promoted if promoted in KERNEL_DTYPES else torch.float32


_lock = threading.Lock()
_logged: set[tuple[str, str, str]] = set()
_forced: list[str] = []  # stack set by force_backend()


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def interpret_requested() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels then run on CPU tensors (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@contextlib.contextmanager
def force_backend(name: str) -> Iterator[None]:
    """Use backend ``name`` (``"torch"``, ``"triton"`` or ``"auto"``) for every op inside the block."""
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; allowed: {', '.join(BACKENDS)}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def _requested() -> str:
    if _forced:
        return _forced[-1]
    name = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"{_ENV}={name!r} is not a kernel backend; allowed: {', '.join(BACKENDS)}")
    return name


def _log_once(op: str, backend: str, device: torch.device) -> None:
    key = (op, backend, device.type)
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    extra = " (Triton interpreter)" if backend == "triton" and device.type != "cuda" else ""
    logger.info("hf_tokred kernels: %s runs on %s (%s)%s", op, backend, device.type, extra)


def choose_backend(op: str, device: torch.device | str) -> str:
    """``"triton"`` or ``"torch"`` for running ``op`` on ``device`` (see the module docstring)."""
    device = torch.device(device)
    requested = _requested()
    if requested == "torch":
        backend = "torch"
    elif requested == "triton" or device.type == "cuda" or interpret_requested():
        if device.type != "cuda" and not interpret_requested():
            raise RuntimeError(
                f"hf_tokred: the Triton kernel for {op} needs a CUDA tensor (got {device.type}); set "
                "TRITON_INTERPRET=1 before importing to run it in the Triton interpreter, or use the torch backend"
            )
        if not triton_available():
            raise RuntimeError(
                f"hf_tokred: {op} on {device.type} needs Triton, which is not installed "
                "(pip install 'hf-tokred[triton]'); to run the slow torch path on purpose, set "
                f"{_ENV}=torch or use hf_tokred.ops.force_backend('torch')"
            )
        backend = "triton"
    else:
        backend = "torch"
    _log_once(op, backend, device)
    return backend


def load_triton_module(name: str) -> ModuleType:
    """Import a sibling module that defines Triton kernels (deferred so TRITON_INTERPRET is read late)."""
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError as err:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            f"hf_tokred: could not import the Triton kernels ({err}); pip install 'hf-tokred[triton]'"
        ) from err
