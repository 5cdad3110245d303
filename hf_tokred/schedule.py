"""Schedules: which blocks are anchors, how many tokens each anchor removes, and what a schedule saves.

Pure functions of numbers (the settings in :mod:`hf_tokred.config` call them).  Two kinds of level:

* a keep ratio: every anchor keeps ``keep_ratio`` of the tokens entering it, so a block's share of the tokens is
  ``keep_ratio ** (anchors before it)`` in the long-sequence limit (a FLOPs target solves for the ratio);
* a token budget ``keep_tokens = K``: every block after the last anchor processes at most ``K`` tokens of a row;
  a row of at most ``K`` tokens is not reduced, a longer one is brought down to ``K`` geometrically over the
  anchors (each of the ``m`` remaining anchors keeps the same share ``(K / n) ** (1 / m)`` of its input, the last
  one exactly ``K``), as DeciMamba's decimation lengths shrink by a constant factor from layer to layer.

Pure SSMs weigh every block alike (the paper's proxy); hybrids weigh each block by its FLOPs at a reference length,
split into a part linear in the length and attention's quadratic part (:func:`hf_tokred.flops.layer_costs`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

__all__ = ["ResolvedSchedule", "budget_anchors", "budget_removal_count", "check_depth", "default_anchors",
           "merge_count", "proxy_flops_reduction", "removal_count", "schedule_fractions", "schedule_proxy_reduction",
           "schedule_reduction", "solve_keep_ratio", "ssm_anchors"]


def check_depth(num_hidden_layers: Any) -> None:
    if isinstance(num_hidden_layers, bool) or not isinstance(num_hidden_layers, int) or num_hidden_layers < 1:
        raise ValueError(f"num_hidden_layers must be a positive int, got {num_hidden_layers!r}")


# The paper's anchor layers for the checkpoint depths it evaluates (method.md, b.4).
_PAPER_ANCHORS: dict[int, tuple[int, ...]] = {
    64: (12, 17, 22, 27, 32, 37, 42),
    48: (10, 15, 20, 25, 30, 35),
}
_RULE_DEPTH = 64


def default_anchors(num_hidden_layers: int) -> tuple[int, ...]:
    """Anchor layers (0-based, reduce *after* them) for a model of the given depth.

    Depths 48 and 64 use the paper's anchors.  Any other depth scales the 64-layer rule
    (first anchor 12, then every 5 layers, 7 anchors) proportionally: anchor ``a`` becomes
    ``floor(a * L / 64 + 0.5)``; duplicates and anchors past ``L - 2`` are dropped, so every anchor
    leaves at least one block that runs on the reduced sequence.
    """
    check_depth(num_hidden_layers)
    if num_hidden_layers in _PAPER_ANCHORS:
        return _PAPER_ANCHORS[num_hidden_layers]
    scaled = (math.floor(a * num_hidden_layers / _RULE_DEPTH + 0.5) for a in _PAPER_ANCHORS[_RULE_DEPTH])
    return tuple(sorted({a for a in scaled if a <= num_hidden_layers - 2}))


def budget_anchors(ssm_layers: Sequence[int]) -> tuple[int, ...]:
    """The anchors a token budget uses unless told: the first SSM layer alone.  Reducing early and hard is what
    gives back the recall a Mamba loses past its training length, and what saves most of a long prefill (docs/long-prompts.md
    has the measurements behind this rule)."""
    return (min(ssm_layers),) if ssm_layers else ()


def proxy_flops_reduction(fractions: Sequence[float]) -> float:
    """The paper's FLOPs measure: ``1 - mean_l fraction_l``, with ``fraction_l`` the share of the tokens that
    block ``l`` processes."""
    return 1.0 - sum(fractions) / len(fractions)


def schedule_fractions(num_hidden_layers: int, anchors: Sequence[int], keep_ratio: float) -> list[float]:
    """Share of the tokens each block processes in the long-sequence limit: ``keep_ratio ** (anchors before l)``
    (an anchor block itself still sees its full input)."""
    anchors = sorted(anchors)
    return [keep_ratio ** sum(a < layer for a in anchors) for layer in range(num_hidden_layers)]


def schedule_proxy_reduction(num_hidden_layers: int, anchors: Sequence[int], keep_ratio: float) -> float:
    """:func:`proxy_flops_reduction` of a schedule in the long-sequence limit (rounding makes short sequences
    reduce less)."""
    return proxy_flops_reduction(schedule_fractions(num_hidden_layers, anchors, keep_ratio))


def merge_count(r: int, q: float) -> int:
    """How many of ``r`` selected tokens the hybrid strategies merge: ``floor(r * (1 - q))`` in double precision,
    the ``1e-9`` absorbing float noise (``5 * (1 - 0.8)`` is ``0.9999999999999998``)."""
    return math.floor(r * (1.0 - q) + 1e-9)


def removal_count(n: int, keep_ratio: float, pairs: bool) -> int:
    """Tokens an anchor removes from a row of ``n`` real tokens: ``n - ceil(n * keep_ratio)`` (a non-empty row
    keeps at least one), capped at ``n // 2`` when every removed token is paired with a kept one.  The ``1e-9``
    absorbs float noise in ``n * keep_ratio`` (``100 * 0.55`` is ``55.00000000000001``)."""
    keep = math.ceil(n * keep_ratio - 1e-9)
    if n > 0:
        keep = max(keep, 1)
    r = n - keep
    if pairs:
        r = min(r, n // 2)
    return max(r, 0)


def budget_removal_count(n: int, keep_tokens: int, anchors_left: int, pairs: bool) -> int:
    """Tokens an anchor removes from a row of ``n`` real tokens under a budget of ``keep_tokens`` after the last
    anchor, ``anchors_left`` anchors (this one included) remaining: none when ``n <= keep_tokens``, else down to
    ``max(K, ceil(n * (K / n) ** (1 / anchors_left)))`` tokens (exactly ``K`` at the last anchor), capped at
    ``n // 2`` when every removed token is paired with a kept one."""
    if n <= keep_tokens:
        return 0
    target = keep_tokens * (n / keep_tokens) ** ((anchors_left - 1) / anchors_left)
    r = n - max(keep_tokens, math.ceil(target - 1e-9))
    return min(r, n // 2) if pairs else r


@dataclass(frozen=True)
class ResolvedSchedule:
    """What will run on a model of a given depth: the anchors, and either a per-anchor ``keep_ratio`` or a token
    budget ``keep_tokens`` (the other is ``None``)."""

    num_hidden_layers: int
    anchors: tuple[int, ...]
    keep_ratio: float | None
    flops_reduction: float  # the paper's proxy (1 - mean fraction of tokens per layer), long-sequence limit
    pairs: bool = True  # the method pairs removed tokens with kept ones (an anchor removes at most half)
    keep_tokens: int | None = None
    rerun: bool = False  # the method prunes before its anchors, which then run again on the kept tokens

    def removal(self, n: int, anchor_index: int) -> int:
        """Tokens the ``anchor_index``-th anchor (0-based, in order) removes from a row of ``n`` real tokens when
        nothing is protected."""
        if self.keep_tokens is None:
            return removal_count(n, self.keep_ratio, self.pairs)
        return budget_removal_count(n, self.keep_tokens, len(self.anchors) - anchor_index, self.pairs)

    def layer_lengths(self, length: int) -> list[int]:
        """Tokens each block processes for one sequence of ``length`` tokens (nothing protected); an anchor of a
        method that re-runs it counts both its passes (the scoring pass over its input, then the kept tokens)."""
        lengths, n = [], length
        for layer in range(self.num_hidden_layers):
            lengths.append(n)
            if layer in self.anchors:
                removed = self.removal(n, self.anchors.index(layer))
                n -= removed
                if self.rerun and removed:  # (an anchor that removes nothing skips its scoring pass)
                    lengths[-1] += n
        return lengths

    def check_budget(self, lengths: Sequence[int]) -> None:
        """Raise when a pairing method cannot bring rows of these real lengths down to the budget (each of its
        anchors removes at most half)."""
        if self.keep_tokens is None or not self.pairs:
            return
        worst = max(lengths, default=0)
        final = self.layer_lengths(worst)[-1]
        if final > self.keep_tokens:
            raise ValueError(
                f"keep_tokens={self.keep_tokens} cannot be met on a {worst}-token prompt: the method pairs every removed "
                f"token with a kept one, so each of its {len(self.anchors)} anchor(s) removes at most half (it reaches "
                f"{final} tokens); name more anchors (anchors=[0, 1, 2, ...]), or a method that prunes (front_prune, "
                "evit)")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "anchors": list(self.anchors)}


def schedule_reduction(num_hidden_layers: int, anchors: Sequence[int], keep_ratio: float,
                       layer_costs: Sequence[tuple[float, float]] | None = None) -> float:
    """The FLOPs reduction of a schedule in the long-sequence limit: the paper's proxy ``1 - mean_l fraction_l`` (every
    block linear in its length), or with ``layer_costs`` (``(a, b)`` per block: its cost at a fraction ``f`` of the
    reference length is ``a*f + b*f**2``, ``b`` being attention's score products) the cost-weighted reduction.
    ``keep_ratio=0`` gives a token budget's limit (the blocks after the first anchor process a vanishing share)."""
    fractions = schedule_fractions(num_hidden_layers, anchors, keep_ratio)
    layer_costs = [(1.0, 0.0)] * num_hidden_layers if layer_costs is None else layer_costs
    full = sum(a + b for a, b in layer_costs)
    return 1.0 - sum(a * f + b * f * f for (a, b), f in zip(layer_costs, fractions)) / full


def ssm_anchors(anchors: Sequence[int], ssm_layers: Sequence[int], num_hidden_layers: int) -> tuple[int, ...]:
    """Default anchors moved onto SSM layers (a hybrid's attention layers cannot be anchors): each to the last SSM
    layer at or before it, duplicates and the last block dropped."""
    snapped = {max((s for s in ssm_layers if s <= a), default=None) for a in anchors}
    return tuple(sorted(a for a in snapped if a is not None and a <= num_hidden_layers - 2))


def solve_keep_ratio(num_hidden_layers: int, anchors: Sequence[int], flops_reduction: float, min_keep: float,
                     layer_costs: Sequence[tuple[float, float]] | None = None) -> float:
    """Per-anchor keep ratio in ``[min_keep, 1]`` whose FLOPs reduction (:func:`schedule_reduction`) equals
    ``flops_reduction``."""
    if flops_reduction == 0.0:
        return 1.0
    reachable = schedule_reduction(num_hidden_layers, anchors, min_keep, layer_costs)
    if flops_reduction > reachable + 1e-12:
        raise ValueError(
            f"flops_reduction={flops_reduction} is not reachable for a {num_hidden_layers}-layer model with anchors "
            f"{list(anchors)}: at most {reachable:.4f} when each anchor keeps {min_keep:g} of its tokens. "
            "Use a smaller flops_reduction, or earlier/more anchors."
        )
    lo, hi = min_keep, 1.0  # proxy reduction decreases monotonically as the keep ratio grows
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if schedule_reduction(num_hidden_layers, anchors, mid, layer_costs) > flops_reduction:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)
