"""The FLOPs of what an evaluation actually ran: per row, per block, with the lengths each block saw."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from ..flops import model_flops

__all__ = ["FlopsMeter", "row_layer_lengths"]


def row_layer_lengths(out, real_lengths: Sequence[int], num_layers: int) -> list[list[int]]:
    """Tokens each block processed, per row, from a forward's ``plans`` (dense: ``real_lengths`` everywhere).

    An anchor block still sees its full input; the blocks after anchor ``a`` see ``keep_mask.sum()`` of the
    plan made at ``a`` (a plan that re-ran its anchor, ``plan.rerun``: the anchor also processed the kept tokens).
    """
    lengths = [[int(n)] * num_layers for n in real_lengths]
    for anchor, plan in getattr(out, "plans", None) or ():
        kept = plan.keep_mask.sum(1).tolist()
        for row, k in enumerate(kept):
            if plan.rerun:
                lengths[row][anchor] += int(k)
            for layer in range(anchor + 1, num_layers):
                lengths[row][layer] = int(k)
    return lengths


class FlopsMeter:
    """Accumulates analytic and proxy FLOPs of the forwards that ran, grouped by task.  ``lm_head_positions``: the
    positions per row whose logits were computed (``None``: every position of the last block), in the dense and
    the reduced forward alike."""

    def __init__(self, config, lm_head_positions: int | None = None):
        self.config = config
        self.lm_head_positions = lm_head_positions
        self.layers = config.num_hidden_layers
        self._cache: dict[tuple[int, ...], int] = {}
        # per group: dense flops, reduced flops, dense token-layers, reduced token-layers, rows, tokens
        self._acc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0, 0])

    def _flops(self, lengths: tuple[int, ...]) -> int:
        if lengths not in self._cache:
            head = None if self.lm_head_positions is None else min(self.lm_head_positions, lengths[-1])
            self._cache[lengths] = model_flops(self.config, lengths, lm_head_positions=head).total
        return self._cache[lengths]

    def add(self, group: str, lengths_per_row: Iterable[Sequence[int]], real_lengths: Iterable[int]) -> None:
        """Rows whose blocks processed ``lengths_per_row[b]`` tokens, of ``real_lengths[b]`` real input tokens (the
        dense forward's length: an anchor that re-ran processed more than that)."""
        acc = self._acc[group]
        for n, lengths in zip(real_lengths, lengths_per_row, strict=True):
            acc[0] += self._flops((n,) * self.layers)
            acc[1] += self._flops(tuple(lengths))
            acc[2] += n * self.layers
            acc[3] += sum(lengths)
            acc[4] += 1
            acc[5] += n

    def add_forward(self, group: str, out, real_lengths: Sequence[int]) -> None:
        """A forward's rows (its ``plans``; dense: none) of ``real_lengths`` real tokens each."""
        self.add(group, row_layer_lengths(out, real_lengths, self.layers), real_lengths)

    def state(self) -> dict[str, list[int]]:
        return {k: list(v) for k, v in self._acc.items()}

    def merge(self, state: dict[str, Sequence[int]]) -> None:
        """Add another meter's :meth:`state` (e.g. gathered from another data-parallel process)."""
        for group, values in state.items():
            acc = self._acc[group]
            for i, v in enumerate(values):
                acc[i] += v

    @staticmethod
    def _summary(acc: Sequence[int]) -> dict[str, Any]:
        dense, reduced, dense_tl, reduced_tl, rows, tokens = acc
        return {
            "exact": 1.0 - reduced / dense if dense else float("nan"),
            "proxy": 1.0 - reduced_tl / dense_tl if dense_tl else float("nan"),
            "rows": rows,
            "tokens": tokens,
            "dense_flops": dense,
            "reduced_flops": reduced,
        }

    def summary(self, groups: Iterable[str] | None = None) -> dict[str, Any]:
        keys = list(self._acc) if groups is None else [g for g in groups if g in self._acc]
        total = [sum(self._acc[k][i] for k in keys) for i in range(6)]
        return {**self._summary(total), "per_task": {k: self._summary(self._acc[k]) for k in sorted(keys)}}


# ----------------------------------------------------------------------------- the lm-eval model
