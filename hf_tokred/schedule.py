"""The schedule solver: how much a schedule of anchors and a keep ratio saves, and the keep ratio for a target.

Pure functions of numbers (the settings in :mod:`hf_tokred.config` call them).  A block's share of the tokens is
``keep_ratio ** (anchors before it)`` in the long-sequence limit.  Pure SSMs weigh every block alike (the paper's
proxy); hybrids weigh each block by its FLOPs at a reference length, split into a part linear in the length and
attention's quadratic part (:func:`hf_tokred.flops.layer_costs`).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["schedule_reduction", "solve_keep_ratio", "ssm_anchors"]


def schedule_reduction(num_hidden_layers: int, anchors: Sequence[int], keep_ratio: float,
                       layer_costs: Sequence[tuple[float, float]] | None = None) -> float:
    """The FLOPs reduction of a schedule in the long-sequence limit: the paper's proxy ``1 - mean_l fraction_l`` (every
    block linear in its length), or with ``layer_costs`` (``(a, b)`` per block: its cost at a fraction ``f`` of the
    reference length is ``a*f + b*f**2``, ``b`` being attention's score products) the cost-weighted reduction."""
    anchors = sorted(anchors)
    fractions = [keep_ratio ** sum(a < layer for a in anchors) for layer in range(num_hidden_layers)]
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
