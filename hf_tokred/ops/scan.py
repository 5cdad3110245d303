"""Chunked pure-torch selective scan for Mamba-1.

Drop-in replacement for ``transformers.models.mamba.modeling_mamba.mamba_selective_scan``,
which runs one Python-level step per time step. The recurrence (per batch ``b``, channel ``d``
and state index ``n``) is::

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t * u_t        y_t = C_t . h_t (+ D * u_t) (* silu(z_t))

The sequence is cut into ``n_chunks`` chunks of ``T`` steps and evaluated in two passes:

1. **Local pass** (``T`` Python steps): every chunk is scanned from a zero state, all chunks
   in parallel (tensors ``[batch, n_chunks, d_inner, N]``). This gives each position's output
   "as if the chunk started from zero" and each chunk's local end state.
2. **Carry pass** (``n_chunks`` Python steps): the true state entering chunk ``c`` is carried
   forward, ``H_c = exp(A * S_T) * H_{c-1} + local_end_c``, and its effect on the chunk's
   outputs is added, ``y_t += C_t . (exp(A * S_t) * H_{c-1})``. ``S_t`` is the within-chunk
   cumulative sum of ``dt`` (log-space cumulative decay; ``A * S_t <= 0`` because ``A < 0``
   and ``dt >= 0``), so the decays are computed per chunk as one ``[batch, T, d_inner, N]`` tensor.

Every exponent is ``<= 0`` (all decays lie in ``(0, 1]``) and nothing is divided, so the
scan is as stable as the step-by-step loop, while the number of Python-level steps drops
from ``L`` to about ``T + L / T``. Besides ``O(batch * d_inner * L)`` for re-laid-out inputs and
outputs, the working tensors are ``O(batch * d_inner * N * max(T, L / T))``: never
``[batch, d_inner, L, N]`` (which the reference materialises) or anything quadratic in ``L``.
When no gradient is needed the loops update preallocated buffers in place; otherwise they use
autograd-safe out-of-place ops.

Why not the "segment-sum" form of Mamba-2 (``y = (C B^T * exp(segsum)) x``)? In Mamba-1 the
decay ``exp(dt_t * A[d, n])`` depends on the state index ``n``, so the segment matrix would be
``[batch, d_inner, T, T, N]``: ``T`` times more exponentials than the recurrence needs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["DEFAULT_CHUNK_SIZE", "finish_output", "prepare_dt", "selective_scan"]

#: Default chunk length. The two passes cost ``T`` and ``L / T`` Python-level steps, so the
#: best ``T`` is near ``sqrt(L)``. On a 130m-shaped layer (d_inner 1536, N 16, one CPU thread)
#: the optimum is flat between about 32 and 64; 48 was fastest for L = 2048 and 4096 and within
#: ~5% of the best for L = 256 and 1024, while 16 and 128 were 15-60% slower (measured with
#: ``examples/bench_scan.py``). Chunks are also shrunk to ``<= L`` and balanced so that padding
#: stays below one step per chunk.
DEFAULT_CHUNK_SIZE = 48

# Flags that transformers' Mamba mixers pass to ``mamba_selective_scan``; they pick one of
# its own code paths and are meaningless here, so they are accepted and ignored.
_IGNORED_TRANSFORMERS_FLAGS = frozenset({"use_mambapy", "use_associative_scan"})


def _to_chunks(x: torch.Tensor, n_chunks: int, chunk: int) -> torch.Tensor:
    """``[batch, C, L]`` -> ``[batch, n_chunks, chunk, C]`` (channels last), zero-padding the time axis."""
    batch, channels, length = x.shape
    x = F.pad(x, (0, n_chunks * chunk - length)).transpose(1, 2).contiguous()
    return x.view(batch, n_chunks, chunk, channels)


def selective_scan(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    initial_state: torch.Tensor | None = None,
    chunk_size: int | None = None,
    **kwargs: object,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mamba-1 selective scan, same semantics as transformers' ``mamba_selective_scan``.

    Args:
        hidden_states: ``u``, shape ``[batch, d_inner, L]``.
        dt: time steps before bias/softplus, ``[batch, d_inner, L]``.
        A: state matrix (diagonal, normally negative), ``[d_inner, N]``.
        B, C: input-dependent projections, ``[batch, N, L]``.
        D: optional skip weight, ``[d_inner]``; adds ``D * u``.
        z: optional gate, ``[batch, d_inner, L]``; multiplies the output by ``silu(z)``.
        delta_bias: optional ``[d_inner]`` bias added to ``dt``.
        delta_softplus: apply ``softplus`` to ``dt`` (after the bias).
        return_last_state: also return the state after the last step.
        initial_state: state before the first step, ``[batch, d_inner, N]``; default zeros.
        chunk_size: chunk length ``T``; default :data:`DEFAULT_CHUNK_SIZE`.
        **kwargs: only ``use_mambapy`` / ``use_associative_scan`` (ignored), for drop-in use.

    Returns:
        ``y`` of shape ``[batch, d_inner, L]`` in ``hidden_states.dtype`` and, if
        ``return_last_state``, the final state ``[batch, d_inner, N]`` in float32.
        All arithmetic is done in float32.

    Raises:
        TypeError: for an unknown keyword argument.
        ValueError: for inconsistent shapes or a non-positive ``chunk_size``.
    """
    for name in kwargs:
        if name not in _IGNORED_TRANSFORMERS_FLAGS:
            raise TypeError(f"selective_scan() got an unexpected keyword argument '{name}'")
    _check_shapes(hidden_states, dt, A, B, C, initial_state)
    chunk = DEFAULT_CHUNK_SIZE if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")

    batch, d_inner, length = hidden_states.shape
    u = hidden_states.float()
    state = u.new_zeros(batch, d_inner, A.shape[-1]) if initial_state is None else initial_state.float()
    if length == 0:
        return (hidden_states.clone(), state.clone()) if return_last_state else hidden_states.clone()
    y, state = _chunked_scan(u, prepare_dt(dt, delta_bias, delta_softplus), A.float(), B.float(), C.float(), state,
                             chunk)
    y = finish_output(y, u, D, z, hidden_states.dtype)
    return (y, state) if return_last_state else y


def _check_shapes(hidden_states, dt, A, B, C, initial_state) -> None:
    batch, d_inner, length = hidden_states.shape
    n_state = A.shape[-1]
    expected = {"dt": hidden_states.shape, "A": (d_inner, n_state), "B": (batch, n_state, length),
                "C": (batch, n_state, length), "initial_state": (batch, d_inner, n_state)}
    given = {"dt": dt, "A": A, "B": B, "C": C, "initial_state": initial_state}
    for name, tensor in given.items():
        if tensor is not None and tuple(tensor.shape) != tuple(expected[name]):
            raise ValueError(f"{name} must have shape {tuple(expected[name])}, got {tuple(tensor.shape)}")


def _chunked_scan(u, dt, A, B, C, state, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t``, ``y_t = C_t . h_t`` in fp32, chunk by chunk:
    ``y [batch, d_inner, L]`` (before the D skip and the gate) and the final state."""
    batch, d_inner, length = u.shape
    n_state = A.shape[-1]
    # Balanced chunks: n_chunks * chunk >= length with less than one padded step per chunk.
    # Padded steps have dt = 0 (decay 1, input 0), so they leave the state unchanged.
    n_chunks = math.ceil(length / min(chunk, length))
    chunk = math.ceil(length / n_chunks)
    dt_c = _to_chunks(dt, n_chunks, chunk)  # [batch, n_chunks, T, d_inner]
    x_c = _to_chunks(dt * u, n_chunks, chunk)
    B_c = _to_chunks(B, n_chunks, chunk)  # [batch, n_chunks, T, N]
    C_c = _to_chunks(C, n_chunks, chunk)

    # Without autograd, reuse buffers and update in place (about 1.3x faster on CPU).
    inplace = not (torch.is_grad_enabled() and any(t.requires_grad for t in (u, dt, A, B, C, state)))

    # 1. Local pass: scan each chunk from a zero state, all chunks at once.
    local = u.new_zeros(batch, n_chunks, d_inner, n_state)
    buf = torch.empty_like(local) if inplace else None
    y_local = []
    for t in range(chunk):
        decay = torch.mul(dt_c[:, :, t, :, None], A, out=buf).exp_()
        local = local.mul_(decay) if inplace else local * decay
        local.addcmul_(x_c[:, :, t, :, None], B_c[:, :, t, None, :])
        y_local.append(torch.einsum("bcdn,bcn->bcd", local, C_c[:, :, t]))
    y = torch.stack(y_local, dim=2)  # [batch, n_chunks, T, d_inner]

    # 2. Carry pass: propagate the state entering each chunk and add its contribution.
    cum_dt = dt_c.cumsum(2)  # A * cum_dt <= 0: log of the decay since the chunk start
    buf = u.new_empty(batch, chunk, d_inner, n_state) if inplace else None
    for c in range(n_chunks):
        decay = torch.mul(cum_dt[:, c, :, :, None], A, out=buf).exp_()  # [batch, T, d_inner, N]
        next_state = (decay[:, -1] * state).add_(local[:, c])
        carried = decay.mul_(state[:, None]) if inplace else decay * state[:, None]
        y[:, c] += torch.einsum("btdn,btn->btd", carried, C_c[:, c])
        state = next_state
    return y.view(batch, n_chunks * chunk, d_inner)[:, :length].transpose(1, 2).contiguous(), state


def prepare_dt(dt: torch.Tensor, delta_bias: torch.Tensor | None, delta_softplus: bool) -> torch.Tensor:
    """``softplus(dt + bias)`` in fp32 (each step optional), for ``dt`` of shape ``[batch, d_inner, L]``."""
    dt = dt.float()
    if delta_bias is not None:
        dt = dt + delta_bias.float()[:, None]
    return F.softplus(dt) if delta_softplus else dt


def finish_output(y, u, D, z, dtype) -> torch.Tensor:
    """``(y + D * u) * silu(z)`` (each optional) cast to ``dtype``; ``[batch, d_inner, L]`` tensors."""
    if D is not None:
        y = y + u * D.float()[:, None]
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(dtype)
