"""What a reducing forward returns, and what it can report about itself (:func:`record_reduction`)."""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.utils import ModelOutput

from .reduce import Plan

__all__ = [
    "ReductionRecord",
    "TokenReductionCausalLMOutput",
    "TokenReductionModelOutput",
    "computed_mask",
    "record_reduction",
    "scatter_to_positions",
]


@dataclass
class TokenReductionModelOutput(ModelOutput):
    """Backbone output of a reducing model.

    ``last_hidden_state`` is aligned with the input positions; positions that were removed hold NaN.
    ``computed_mask [B, N]`` tells which input positions were computed; ``kept_positions [B, M]`` lists
    them per row (-1 = padding); ``plans`` holds ``(anchor_layer, Plan)`` per anchor that reduced.
    ``hidden_states`` (if requested) are per block, in each block's own reduced layout.
    """

    last_hidden_state: torch.Tensor | None = None
    cache: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    computed_mask: torch.Tensor | None = None
    kept_positions: torch.Tensor | None = None
    plans: tuple[tuple[int, Plan], ...] | None = None


@dataclass
class TokenReductionCausalLMOutput(ModelOutput):
    """Causal-LM output of a reducing model: ``logits`` aligned with the input positions (NaN where a
    position was not computed), loss over the computed positions, plus the fields of the backbone output.

    With ``model(..., compact_logits=True)`` the logits are only those computed: ``[B, M, V]`` with column
    ``j`` at input position ``kept_positions[:, j]`` (-1: padding column), or the last ``cols`` columns of
    that when ``logits_to_keep`` limits them.  This saves the ``[B, N, V]`` NaN-filled tensor, which for a
    full-logits forward (scoring, perplexity) is most of the memory reduction can save."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    computed_mask: torch.Tensor | None = None
    kept_positions: torch.Tensor | None = None
    plans: tuple[tuple[int, Plan], ...] | None = None


@dataclass
class ReductionRecord:
    """What one reducing forward did: ``layer_lengths[b][i]`` real tokens of row ``b`` processed by block ``i``
    (for one row: ``layer_lengths[0]``), ``input_lengths[b]`` real input tokens, the anchors that reduced,
    ``kept_positions[b]`` (the input positions of row ``b`` that reached the last block), and -- when recorded
    with ``timing=True`` -- the seconds spent choosing plans and applying them (the reduction's own cost)."""

    input_lengths: list[int] = field(default_factory=list)
    layer_lengths: list[list[int]] = field(default_factory=list)
    anchors: list[int] = field(default_factory=list)
    kept_positions: list[list[int]] = field(default_factory=list)
    plan_seconds: float = 0.0
    apply_seconds: float = 0.0
    score_seconds: float = 0.0  # the extra scoring pass of a method that re-runs its anchor (prefilter)


@dataclass
class _Recorder:
    records: list[ReductionRecord]
    timing: bool

    @contextlib.contextmanager
    def timed(self, record: ReductionRecord, what: str, device: torch.device):
        """Add the wall time of the block to ``record.<what>_seconds`` (device synchronised when timing)."""
        if not self.timing:
            yield
            return
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
        sync(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            sync(device)
            setattr(record, f"{what}_seconds", getattr(record, f"{what}_seconds") + time.perf_counter() - start)


_RECORDER: contextvars.ContextVar = contextvars.ContextVar("hf_tokred_recorder", default=None)


@contextlib.contextmanager
def record_reduction(timing: bool = False):
    """Collect a :class:`ReductionRecord` for every reducing forward run inside the block (prefills; decode steps
    are not reduced and not recorded)::

        with hf_tokred.record_reduction() as records:
            model.generate(**inputs)
        print(records[0].layer_lengths[0])   # tokens each block computed for the prompt

    ``timing=True`` also measures the reduction's own cost (``plan_seconds``, ``apply_seconds``), synchronising
    the device around each part (what ``hf-tokred bench`` reports as overhead), and the scoring pass of a method
    that re-runs its anchor (``score_seconds``, reported beside it).
    """
    recorder = _Recorder([], timing)
    token = _RECORDER.set(recorder)
    try:
        yield recorder.records
    finally:
        _RECORDER.reset(token)


def current_recorder() -> _Recorder | None:
    return _RECORDER.get()


def scatter_to_positions(values: torch.Tensor, positions: torch.Tensor, length: int, offset: int = 0) -> torch.Tensor:
    """Place ``values [B, M, ...]`` at ``positions - offset`` of a NaN-filled ``[B, length, ...]`` tensor."""
    B = values.shape[0]
    out = values.new_full((B, length, *values.shape[2:]), float("nan"))
    ok = (positions >= offset) & (positions < offset + length)
    rows = torch.arange(B, device=values.device)[:, None].expand_as(positions)
    out[rows[ok], positions[ok] - offset] = values[ok]
    return out


def computed_mask(positions: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, length]`` bool: which input positions appear in ``positions`` (-1 = padding, ignored)."""
    mask = torch.zeros(positions.shape[0], length, dtype=torch.bool, device=positions.device)
    ok = positions >= 0
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)
    mask[rows[ok], positions[ok]] = True
    return mask
