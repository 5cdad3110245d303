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

Neither Triton nor ``mamba_ssm`` is imported by this module: both are looked up lazily, so
``import hf_tokred.kernels`` works on machines that have neither.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import threading
from collections.abc import Iterator
from types import ModuleType

import torch

__all__ = [
    "BACKENDS",
    "choose_backend",
    "force_backend",
    "interpret_requested",
    "mamba2_chunk_scan_varlen",
    "mamba_ssm_chunk_scan",
    "triton_available",
]

logger = logging.getLogger("hf_tokred")

BACKENDS = ("auto", "torch", "triton")
_ENV = "HF_TOKRED_KERNEL_BACKEND"

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
                f"{_ENV}=torch or use hf_tokred.kernels.force_backend('torch')"
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


def mamba_ssm_chunk_scan():
    """``mamba_ssm``'s ``mamba_chunk_scan_combined`` if it can be imported, else ``None`` (never raises)."""
    if importlib.util.find_spec("mamba_ssm") is None:
        return None
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:  # noqa: BLE001 - mamba_ssm fails in many ways without its CUDA extensions
        return None
    return mamba_chunk_scan_combined


def _seq_idx(cu: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence index of every packed token, ``[T]`` int32, without a host synchronisation."""
    t = torch.arange(total, device=cu.device)
    return torch.searchsorted(cu[1:].contiguous(), t, right=True).to(torch.int32)


def mamba2_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_size: int = 256,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    use_mamba_ssm: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2 scan over packed variable-length sequences: ``(y [T, H, P], final states [S, H, P, N])``.

    Shapes and semantics: :mod:`hf_tokred.kernels.ssd`.  ``use_mamba_ssm=None`` (auto) uses
    ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` for CUDA tensors when it can be
    imported, and the chunked torch implementation (:func:`~hf_tokred.kernels.ssd.ssd_varlen_torch`)
    otherwise (logged once; a WARNING on CUDA, where that path is slow).

    How mamba_ssm (2.3.x) is called: the sequences stay packed as one row (batch 1) with
    ``seq_idx`` (derived from ``cu_seqlens``) restarting the state at every boundary, and
    ``cu_seqlens=..., return_varlen_states=True`` returning each sequence's final state.  Its
    ``initial_states`` is a single ``[1, H, P, N]`` state for the start of the packed row (later sequences
    restart from zero), and its varlen states leave out that initial state when the first sequence ends
    inside the first chunk (``chunk_state_varlen`` only adds chunk-entry states for sequences that started
    in an earlier chunk).  So with ``initial_states`` every sequence gets its own call
    (``initial_states=initial_states[s:s+1], return_final_states=True``).

    Not tested on a GPU here (mamba_ssm cannot be imported without its CUDA extensions); the glue is
    tested against a stand-in that follows mamba_ssm's documented semantics.
    """
    from .ssd import ssd_varlen_torch

    fn = None
    if use_mamba_ssm is None:
        use_mamba_ssm = x.device.type == "cuda"
    if use_mamba_ssm:
        fn = mamba_ssm_chunk_scan()
        if fn is None and x.device.type == "cuda":
            key = ("mamba2_chunk_scan", "torch", "cuda")
            with _lock:
                first = key not in _logged
                _logged.add(key)
            if first:
                logger.warning("hf_tokred kernels: mamba_ssm is not importable; the Mamba-2 varlen scan runs on "
                               "the (slow) torch path on CUDA. pip install 'hf-tokred[gpu]' for the Triton kernels")
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    if fn is None:
        _log_once("mamba2_chunk_scan", "torch", x.device)
        return ssd_varlen_torch(x, dt, A, B, C, cu_seqlens, chunk_size=min(chunk_size, 64), z=z,
                                initial_states=initial_states, **kw)
    _log_once("mamba2_chunk_scan", "mamba_ssm", x.device)
    S = cu_seqlens.numel() - 1
    T, H, P = x.shape
    N = B.shape[-1]
    if initial_states is None:
        seq_idx = _seq_idx(cu_seqlens, T)[None]
        y, states = fn(x[None], dt[None], A, B[None], C[None], chunk_size, z=None if z is None else z[None],
                       seq_idx=seq_idx, cu_seqlens=cu_seqlens, return_varlen_states=True, **kw)
        return y[0], states.float()
    ys, finals = [], []
    for s, (a, b) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        if b == a:
            finals.append(initial_states[s].float())
            continue
        y, final = fn(x[None, a:b], dt[None, a:b], A, B[None, a:b], C[None, a:b], chunk_size,
                      z=None if z is None else z[None, a:b], initial_states=initial_states[s : s + 1],
                      return_final_states=True, **kw)
        ys.append(y[0])
        finals.append(final[0].float())
    y = torch.cat(ys) if ys else x.new_empty(0, H, P)
    return y, torch.stack(finals) if finals else x.new_zeros(0, H, P, N, dtype=torch.float32)
