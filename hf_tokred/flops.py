"""Analytic forward-pass FLOPs for the supported causal LMs (Mamba, Mamba-2, hybrids) with per-layer lengths.

When tokens are removed or merged between blocks, block ``i`` processes ``layer_lengths[i]``
tokens.  The functions here count the FLOPs of such a forward pass from the config alone
(no model, no tensors), following the op shapes of the stock torch code paths in
``transformers.models.mamba.modeling_mamba`` and ``transformers.models.mamba2.modeling_mamba2``
(inference, ``use_cache=False``, no attention mask).

Conventions (all counts are for the whole batch):

* A multiply-add is 2 FLOPs; an elementwise add / multiply / subtract is 1 FLOP.
  Transcendentals and other pointwise non-arithmetic ops (``exp``, ``softplus``, ``silu``,
  ``rsqrt``, ``clamp``, masking, padding, copies) are not counted.  Embedding lookups are free.
* ``projections``: the linear layers as matmuls (``2*M*N*K``), plus their elementwise
  epilogues -- ``in_proj``/``out_proj`` bias adds when ``config.use_bias`` (Mamba-1 also the
  always-present ``dt_proj`` bias), and the block's residual add.
* ``conv``: the depthwise causal conv as HF's torch fallback runs it: ``F.conv1d`` with
  ``padding=K-1`` computes ``L+K-1`` output positions (the last ``K-1`` are sliced away), so
  ``2*B*C*K*(L+K-1)`` plus the conv bias add on those positions.  This is also what
  ``torch.utils.flop_counter.FlopCounterMode`` reports; a fused causal kernel would do
  ``2*B*C*K*L`` (a constant ``2*B*C*K*(K-1)`` less per layer).
* ``scan``:

  - Mamba-1 (``D`` = intermediate size, ``N`` = state size): ``9*B*L*D*N`` (the usual
    selective-scan convention: discretisation ``dt*A``, ``dt*B``, ``dt*B*u``, the recurrence
    ``h = dA*h + dBu`` and the ``C.h`` contraction, the latter being ``2*B*L*D*N`` of it and a
    batched matmul in HF), plus the D skip ``y + D*u`` (``2*B*L*D``) and the gate ``y*silu(z)``
    (``B*L*D``).
  - Mamba-2 (SSD, chunked, as ``mamba2_chunk_scan``'s torch reference does it): the sequence
    is zero-padded to ``Lp = nc*Q`` (``Q = chunk_size``, ``nc = ceil(L/Q)``), with ``H`` heads,
    head dim ``P``, state ``N``.  Einsums (batched matmuls): ``C.B^T`` per chunk
    ``2*B*H*Lp*Q*N``, ``(M) @ x`` ``2*B*H*Lp*Q*P``, chunk states ``2*B*H*Lp*P*N``, inter-chunk
    recurrence ``2*B*H*(nc+1)^2*P*N``, state->output ``2*B*H*Lp*N*P``.  Elementwise: dt bias and
    ``A*dt`` (``2*B*L*H``), ``x*dt`` (``B*L*D``), D skip mul+add, ``Y_off`` decay scaling and
    ``Y_diag+Y_off`` (``4*B*Lp*D``), cumsums of ``A`` and the decay subtraction (``2*B*H*Lp``),
    the intra-chunk segment-sum cumsum and the ``G*L`` masking (``2*B*H*Lp*Q``), ``B*decay``
    (``B*H*Lp*N``) and the inter-chunk segment sum (``B*H*(nc+1)^2``).

* ``norm``: an RMSNorm over ``d`` features costs ``4*d`` per token (square, sum, scale,
  weight).  Each block has one (pre-norm); the model adds ``norm_f`` on the last block's
  ``layer_lengths[-1]`` tokens.  Mamba-2's gated norm costs ``5*D`` per token (``x*silu(g)``
  then RMSNorm).
* ``lm_head``: ``2*B*P*d*V`` for ``P = lm_head_positions`` positions.
* Hybrids (:mod:`hf_tokred.blocks`): ``attention`` counts both score products over the whole ``L x L`` matrix
  of a block's real length (quadratic), plus the score scaling and mask add and the rotary embedding of the
  rotated channels (``partial_rotary_factor``: Bamba rotates half of each head); ``mlp`` counts feed-forward
  layers and, for a mixture of experts, the router's matmul and each token's active experts only (the router's
  top-k bookkeeping and integer routing masks are free; activation functions, ReLU^2's square included, are
  free like ``silu``).

``FlopsBreakdown.matmul`` is the part made of linear / matmul / bmm / einsum / conv kernels,
i.e. what ``FlopCounterMode`` counts for the stock eager forward.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from .config import proxy_flops_reduction
from .families import FAMILIES, FlopsBreakdown, family_of

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "FlopsBreakdown",
    "layer_costs",
    "layer_flops",
    "model_flops",
    "flops_reduction",
    "measured_proxy_reduction",
]

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)
_ZERO = FlopsBreakdown(0, 0, 0, 0, 0, 0)
#: the sequence length at which a hybrid's layers are weighed against each other for a FLOPs target
SCHEDULE_REFERENCE_LENGTH = 2048


# --------------------------------------------------------------------------- validation


def _int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _lengths(config: Any, layer_lengths: Sequence[int], name: str = "layer_lengths") -> list[int]:
    if isinstance(layer_lengths, (str, bytes)) or not isinstance(layer_lengths, Sequence):
        raise ValueError(f"{name} must be a sequence of positive integers, got {type(layer_lengths).__name__}")
    if len(layer_lengths) == 0:
        raise ValueError(f"{name} must not be empty")
    lengths = [_int(n, f"{name}[{i}]", 1) for i, n in enumerate(layer_lengths)]
    n_layers = getattr(config, "num_hidden_layers", None)
    if n_layers is not None and len(lengths) != n_layers:
        raise ValueError(f"{name} has {len(lengths)} entries but config.num_hidden_layers is {n_layers}")
    return lengths


def _lm_head_positions(value: int | None, last_length: int, name: str) -> int:
    if value is None:
        return last_length
    value = _int(value, name, 0)
    if value > last_length:
        raise ValueError(f"{name}={value} exceeds the last layer length {last_length}")
    return value


# --------------------------------------------------------------------------- public API


def layer_flops(config: Any, seq_len: int, batch: int = 1, layer: int | None = None) -> FlopsBreakdown:
    """FLOPs of one block (pre-norm, mixer, residual) processing ``seq_len`` tokens per sequence.

    ``config`` is the config of a supported family (detected by ``config.model_type``); a hybrid's blocks differ
    by kind, so ``layer`` (the block's index) is required there.  ``lm_head`` is 0 here.  See the module
    docstring for the counting conventions.
    """
    family = family_of(config)
    seq_len = _int(seq_len, "seq_len", 1)
    batch = _int(batch, "batch", 1)
    if layer is None and family.hybrid:
        raise ValueError(f"{family.name} is a hybrid whose layers differ (SSM, attention, feed-forward); pass "
                         "layer=<block index>")
    return family.block_flops(config, seq_len, batch, 0 if layer is None else _int(layer, "layer", 0))


def layer_costs(config: Any, length: int = SCHEDULE_REFERENCE_LENGTH) -> list[tuple[float, float]]:
    """Each block's FLOPs at a fraction ``f`` of ``length`` tokens as ``a*f + b*f**2`` (``b``: attention's score
    products), relative to the whole stack at ``length``: what the schedule solver weighs a hybrid's layers by
    (:func:`hf_tokred.schedule.schedule_reduction`).  Fitted exactly from the counts at ``length`` and
    ``length / 2``."""
    family = family_of(config)
    full = [family.block_flops(config, length, 1, i).total for i in range(config.num_hidden_layers)]
    half = [family.block_flops(config, length // 2, 1, i).total for i in range(config.num_hidden_layers)]
    scale = float(sum(full))
    return [((f - 2 * (f - 2 * h)) / scale, 2 * (f - 2 * h) / scale) for f, h in zip(full, half)]


def model_flops(
    config: Any,
    layer_lengths: Sequence[int],
    batch: int = 1,
    lm_head_positions: int | None = None,
) -> FlopsBreakdown:
    """FLOPs of a full ``*ForCausalLM`` forward where block ``i`` processes ``layer_lengths[i]`` tokens.

    ``len(layer_lengths)`` must equal ``config.num_hidden_layers``.  ``norm_f`` runs on
    ``layer_lengths[-1]`` tokens; the LM head on ``lm_head_positions`` of them (default: all,
    ``0`` excludes the head, e.g. ``1`` for ``logits_to_keep=1``).
    """
    family = family_of(config)
    lengths = _lengths(config, layer_lengths)
    batch = _int(batch, "batch", 1)
    positions = _lm_head_positions(lm_head_positions, lengths[-1], "lm_head_positions")

    total = _ZERO
    for i, length in enumerate(lengths):
        total = total + family.block_flops(config, length, batch, i)
    d = config.hidden_size
    norm_f = 4 * batch * lengths[-1] * d
    head = 2 * batch * positions * d * config.vocab_size
    return total + FlopsBreakdown(0, 0, 0, norm_f, head, elementwise=norm_f)


def flops_reduction(
    config: Any,
    layer_lengths: Sequence[int],
    dense_length: int,
    batch: int = 1,
    lm_head_positions: int | None = None,
    dense_lm_head_positions: int | None = None,
) -> float:
    """``1 - model_flops(reduced).total / model_flops(dense).total``.

    The dense model runs every block on ``dense_length`` tokens; its LM head runs on
    ``dense_lm_head_positions`` positions (default ``dense_length``).
    """
    dense_length = _int(dense_length, "dense_length", 1)
    n_layers = len(_lengths(config, layer_lengths))
    reduced = model_flops(config, layer_lengths, batch, lm_head_positions)
    dense = model_flops(config, [dense_length] * n_layers, batch, dense_lm_head_positions)
    return 1.0 - reduced.total / dense.total


def measured_proxy_reduction(layer_lengths: Sequence[int], dense_length: int) -> float:
    """The reference code's proxy on real lengths: ``1 - mean_l(layer_lengths[l] / dense_length)``.

    It treats every block as linear in its length and ignores the LM head and chunk padding.
    """
    lengths = _lengths(None, layer_lengths)
    dense_length = _int(dense_length, "dense_length", 1)
    return proxy_flops_reduction([n / dense_length for n in lengths])
