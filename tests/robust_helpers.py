"""Helpers shared by test_batch.py and test_properties.py: padded batches, row-local plans, a dtype-aware slow
reference forward, and the per-row removal counts the schedule promises (the oracle for the kept counts).

Everything here is deliberately independent of hf_tokred's internals except the Plan fields it reads: the
removal counts come from ``slow_reference.documented_num_to_remove`` (exact arithmetic on the ratio the user meant).
"""

from __future__ import annotations

import torch

from slow_reference import documented_num_to_remove, slow_apply, slow_weights  # noqa: F401

ATOL = 1e-5
VOCAB = 96

#: (hidden, residual) strategies of each method (the method table of config.py, restated independently).
METHOD_STRATEGIES = {
    "utrc": ("hybrid", "merge"),
    "utrc_reference": ("hybrid_channel", "merge"),
    "evit": ("prune", "prune"),
    "tome": ("merge", "merge"),
    "prune_only": ("prune", "prune"),
    "merge_only": ("merge", "merge"),
    "utrc_frozen": ("hybrid", "merge"),
    "front_prune": ("prune", "prune"),
    "prefilter": ("before", "before"),  # prunes the anchor's input; the anchor block then runs on the kept tokens
}
#: selection rule of each method, and whether it pairs tokens (caps removal at half).
METHOD_SELECTION = {
    "utrc": ("importance_similarity", True),
    "utrc_reference": ("reference", True),
    "evit": ("importance", False),
    "tome": ("bipartite", True),
    "prune_only": ("importance_similarity", True),
    "merge_only": ("importance_similarity", True),
    "utrc_frozen": ("importance_similarity", True),
    "front_prune": ("front", False),
    "prefilter": ("blocks", False),
}
#: selections that do not pair tokens (an anchor may remove more than half)
UNPAIRED = frozenset(sel for sel, pairs in METHOD_SELECTION.values() if not pairs)


def branch_strategies(cfg) -> tuple[str, str]:
    """The (hidden, residual) strategies the slow references apply for ``cfg``: ``before`` for a method that prunes
    before its anchor and re-runs it (``prefilter``), else the configured branch strategies."""
    return ("before", "before") if cfg.spec.rerun else (cfg.hidden, cfg.residual)


def random_rows(seed: int, lengths, low: int = 2, high: int = VOCAB) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (n,), generator=g) for n in lengths]


def pad_rows(rows, side: str = "left", width: int | None = None, pad_id: int = 0):
    """Stack 1-D id rows into ``ids [B, W]`` and ``mask [B, W]`` with left or right padding."""
    W = width if width is not None else max([len(r) for r in rows] + [1])
    ids = torch.full((len(rows), W), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), W, dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r)
        if n == 0:
            continue
        if side == "left":
            ids[b, W - n :], mask[b, W - n :] = r, 1
        else:
            ids[b, :n], mask[b, :n] = r, 1
    return ids, mask


def kept_positions(out, b) -> list[int]:
    kp = out.kept_positions[b]
    return kp[kp >= 0].tolist()


def row_local_plans(plans, mask: torch.Tensor, row: int):
    """Batch plans -> row-local ``(layer, pairs, scores)`` for any padding pattern (left, right, holes).

    Positions of plan k are mapped to their rank among that plan's real tokens: the input mask for the first
    plan, the previous plan's ``keep_mask`` afterwards.
    """
    real = mask[row].bool()
    out = []
    for layer, plan in plans:
        local = torch.cumsum(real.long(), 0) - 1
        ok = plan.src_mask[row]
        srcs, dsts = plan.src[row][ok], plan.dst[row][ok]
        assert bool(real[srcs].all()), "a removed token is padding"
        pairs = [(int(local[s]), int(local[d])) for s, d in zip(srcs, dsts)]
        out.append((layer, pairs, plan.src_score[row][ok].tolist()))
        real = plan.keep_mask[row]
    return out


def slow_forward_any_dtype(model, ids, plans, hidden_strategy, residual_strategy, q, inputs_embeds=None):
    """Like ``slow_reference.slow_forward`` for a whole prompt (stock blocks with transformers' own kernels), but
    casting like the real block does (norm in the norm's dtype, residual in fp32 when ``residual_in_fp32``), so it
    also runs in bf16/fp16.  Returns ``(logits of the surviving tokens, [dtype of what leaves each block])``."""
    from conftest import stock_transformers

    with torch.no_grad(), stock_transformers():
        return _slow_forward_any_dtype(model, ids, plans, hidden_strategy, residual_strategy, q, inputs_embeds)


def _slow_forward_any_dtype(model, ids, plans, hidden_strategy, residual_strategy, q, inputs_embeds):
    backbone = model.backbone
    x = backbone.embeddings(ids[None]) if inputs_embeds is None else inputs_embeds[None]
    by_layer = {layer: (pairs, scores) for layer, pairs, scores in plans}
    dtypes = []
    for i, block in enumerate(backbone.layers):
        if i in by_layer and hidden_strategy == "before":  # drop the removed tokens, then the whole block
            gone = {src for src, _ in by_layer[i][0]}
            x = block(x[:, [j for j in range(x.shape[1]) if j not in gone]])
        elif i not in by_layer:
            x = block(x)
        else:
            pairs, scores = by_layer[i]
            residual = x.float() if block.residual_in_fp32 else x
            h = block.mixer(block.norm(x.to(block.norm.weight.dtype)))
            parts = []
            for branch, strategy in ((residual[0], residual_strategy), (h[0], hidden_strategy)):
                parts.append(slow_apply(branch, pairs, slow_weights(strategy, pairs, scores, branch, q)))
            x = (parts[0] + parts[1])[None]
        dtypes.append(x.dtype)
    logits = model.lm_head(backbone.norm_f(x).to(model.lm_head.weight.dtype))[0].float()
    return logits, dtypes


def expected_removed(n: int, protected_local: list[bool], keep_ratio: float, selection: str, pairs: bool,
                     receive: bool = True) -> int:
    """How many tokens one anchor removes from a row of ``n`` real tokens: the documented schedule
    (``documented_num_to_remove``, exact arithmetic), limited only by the tokens the selection may not take.

    * importance_similarity: sources come from the less-important half ``A`` (|A| = n - n//2); protected tokens
      sort to the important end, so only protected tokens beyond n//2 spill into ``A`` and are ineligible.
    * bipartite / reference: sources are the row's even tokens (0, 2, ...) that are not protected.
    * importance (EViT): any unprotected token; front: the oldest 2r unprotected tokens, which hold r of them
      whenever the row has r unprotected tokens, so the same limit.

    ``receive=False`` (utrc_frozen): protected tokens are no merge destinations either, so a selection whose
    destination set (the important half ``B``; the odd tokens) holds only protected tokens removes nothing.
    """
    r = documented_num_to_remove(n, keep_ratio, pairs)
    if n < 2 or r == 0:
        return 0
    p = sum(protected_local)
    if selection == "importance_similarity":
        eligible = (n - n // 2) - max(0, p - n // 2)
        if not receive and min(p, n // 2) == n // 2:  # every token of B is protected
            return 0
    elif selection in ("bipartite", "reference"):
        eligible = sum(1 for i in range(0, n, 2) if not protected_local[i])
        if not receive and all(protected_local[i] for i in range(1, n, 2)):
            return 0
    else:
        eligible = n - p
    return min(r, eligible)


def schedule_kept(n: int, num_anchors: int, keep_ratio: float, selection: str, pairs: bool,
                  receive: bool = True) -> list[int]:
    """Real-token count after each anchor when only the row's last token is protected (the model's default)."""
    counts = []
    for _ in range(num_anchors):
        n -= expected_removed(n, [False] * (n - 1) + [True] if n else [], keep_ratio, selection, pairs, receive)
        counts.append(n)
    return counts


def assert_close_where_computed(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL, what: str = ""):
    """Same NaN pattern (not computed) and values within atol elsewhere."""
    assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{what}: different computed positions"
    diff = (a - b).abs().nan_to_num(0.0).max().item() if a.numel() else 0.0
    assert diff <= atol, f"{what}: max |diff| = {diff:.3g} > {atol}"


def plans_equal(p, q) -> bool:
    if len(p) != len(q):
        return False
    for (la, a), (lb, b) in zip(p, q):
        if la != lb:
            return False
        for f in ("keep", "keep_mask", "src", "dst", "dst_slot", "src_mask", "src_score"):
            if not torch.equal(getattr(a, f), getattr(b, f)):
                return False
    return True
