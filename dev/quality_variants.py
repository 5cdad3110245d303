#!/usr/bin/env python
"""Quick probes of method variants on the quality table's measures (how the variants docs/quality.md lists as tried
and dropped were measured).  Not part of the package: the window variants are registered here, on the selector
table, for this process only.

    python dev/quality_variants.py '<variants as JSON>' --out runs/variants --models recall-mamba2,mamba \
        --passages 100 --sequences 256 --levels 0.2,0.3

The JSON maps a row name to settings (as in ``examples/quality_table.py``'s ``METHODS``), e.g.
``{"front_l2": {"method": "front_prune", "metric": "l2"}}``; besides hf_tokred's methods it may name
``front{w}_prune`` (EViT's rule in the oldest w*r unprotected tokens) and ``fsim{w}_prune`` (UTRC's selection in
that window), for w in 2, 3, 4.  The remaining arguments are ``examples/quality_table.py``'s.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

from hf_tokred import config, select
from hf_tokred.config import MethodSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import quality_table  # noqa: E402


def register_window_variants() -> None:
    for w in (2, 3, 4):
        for kind, rule in (("front", select._select_importance), ("fsim", select._select_importance_similarity)):
            select._SELECTORS[f"{kind}{w}"] = functools.partial(select._select_front, window=w, rule=rule)
            config.METHODS[f"{kind}{w}_prune"] = MethodSpec(f"{kind}{w}", "prune", "prune", False, "probe")


def main(argv: list[str]) -> None:
    register_window_variants()
    quality_table.METHODS.clear()
    quality_table.METHODS.update(json.loads(argv[0]))
    quality_table.main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
