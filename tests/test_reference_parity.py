"""``utrc_reference`` equals the authors' code: an independent transcription of their selection and merging.

Written from reading the reference implementation (the per-channel sort of the L2-normalised clipped mixer
output, ``a @ b^T`` of the sorted halves, max / arg-max, arg-sort of the best scores, the even/odd ToMe mapping,
``merge_wavg`` with all-ones sizes on the residual branch, and the per-channel top-``r // 2`` hybrid on the hidden
branch), nothing imported from ``hf_tokred.reduce``.  Their choice and ours may differ only at exact
floating-point ties of the link scores (their arg-sort is not stable); the inputs below have none.
"""

import pytest
import torch

import transformers

import hf_tokred
from hf_tokred import TokenReductionConfig
from hf_tokred.families import FAMILIES

from conftest import tiny_config


def link_scores(h: torch.Tensor) -> torch.Tensor:
    """Their best link score of every even token (before the arg-sort)."""
    metric = h.float().clamp(min=0)
    metric = metric / metric.norm(dim=-1, keepdim=True)
    ranked = metric.sort(dim=0, descending=True).values
    n = ranked.shape[0]
    return (ranked[n // 2:] @ ranked[: n // 2].T).max(dim=-1).values


def authors_selection(h: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices into the even tokens (sources) and odd tokens (destinations), one row ``h [N, D]``."""
    metric = h.float().clamp(min=0)
    metric = metric / metric.norm(dim=-1, keepdim=True)
    ranked = metric.sort(dim=0, descending=True).values  # every channel sorted on its own
    n = ranked.shape[0]
    a, b = ranked[n // 2:], ranked[: n // 2]
    scores = a @ b.T
    node_max, node_idx = scores.max(dim=-1)
    edge_idx = node_max.argsort(descending=True)
    src = edge_idx[:r]
    return src, node_idx[src]


def authors_reduce(x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, mode: str) -> torch.Tensor:
    """Their even/odd application: ``merge`` (size-weighted mean, sizes 1) or ``hybrid`` (per channel, the
    ``r // 2`` largest source values merge, the rest are dropped); returns the kept rows in order."""
    n, d = x.shape
    even, odd = x[0::2].double(), x[1::2].double()
    moved = even[src]  # [r, D]
    num, den = odd.clone(), torch.ones_like(odd)
    if mode == "merge":
        num.index_add_(0, dst, moved)
        den.index_add_(0, dst, torch.ones_like(moved))
    else:
        k = len(src) // 2
        top = moved.topk(k, dim=0).indices  # [k, D]: per channel, which sources merge
        for c in range(d):
            num[:, c].index_add_(0, dst[top[:, c]], moved[top[:, c], c])
            den[:, c].index_add_(0, dst[top[:, c]], torch.ones(k, dtype=torch.double))
    odd = num / den
    keep_even = torch.ones(len(even), dtype=torch.bool)
    keep_even[src] = False
    rows = [(2 * i, even[i]) for i in range(len(even)) if keep_even[i]] + [(2 * j + 1, odd[j]) for j in range(len(odd))]
    return torch.stack([v for _, v in sorted(rows, key=lambda t: t[0])]).to(x.dtype)


@torch.no_grad()
def authors_forward(model, ids: torch.Tensor, anchors, keep_ratio: float) -> torch.Tensor:
    """Last-token logits of one row with the authors' reduction after each anchor (their ``r`` rule)."""
    backbone = model.backbone
    hidden = backbone.embeddings(ids)
    for i, block in enumerate(backbone.layers):
        residual = hidden.float() if block.residual_in_fp32 else hidden
        h = block.mixer(block.norm(hidden.to(block.norm.weight.dtype)))
        if i in anchors:
            n = h.shape[1]
            r = min(n - int(torch.tensor(n * keep_ratio).ceil()), n // 2)
            best = link_scores(h[0]).sort(descending=True).values
            assert best[r - 1] != best[r], "an exact tie decides the authors' choice: the inputs must avoid it"
            src, dst = authors_selection(h[0], r)
            hidden = (authors_reduce(residual[0], src, dst, "merge") + authors_reduce(h[0], src, dst, "hybrid"))[None]
        else:
            hidden = residual + h
    return model.lm_head(backbone.norm_f(hidden)[:, -1]).float()


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_utrc_reference_matches_the_authors_code(family):
    torch.manual_seed(0)
    cls = getattr(transformers, FAMILIES[family].lm_class)
    config = tiny_config(family, layers=24)
    config.use_bias = True
    model = cls(config).eval()
    anchors = (3, 8, 13, 18)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for a in anchors:  # mixer outputs positive in (nearly) every channel: clipping leaves no zero-score ties
            model.backbone.layers[a].mixer.out_proj.bias.add_(1.0)
    ids = torch.randint(2, config.vocab_size, (1, 160), generator=torch.Generator().manual_seed(1))
    want = authors_forward(model, ids, anchors, 0.9)
    hf_tokred.apply_token_reduction(model, TokenReductionConfig(method="utrc_reference", keep_ratio=0.9,
                                                                anchors=list(anchors)))
    with torch.no_grad():
        out = model(ids)
    assert [a for a, _ in out.plans] == list(anchors)
    assert torch.allclose(out.logits[:, -1], want, atol=1e-4, rtol=0), (out.logits[:, -1] - want).abs().max()


def test_authors_selection_thins_the_front_on_positive_inputs():
    """The transcription itself, on strictly positive features (no ties): removes 0, 2, ..., 2r-2 into token 1."""
    h = torch.rand(40, 16, generator=torch.Generator().manual_seed(2)) + 0.1
    src, dst = authors_selection(h, 5)
    assert sorted((2 * src).tolist()) == [0, 2, 4, 6, 8] and set((2 * dst + 1).tolist()) == {1}


def test_selection_equals_the_authors_on_content_dependent_inputs():
    """Unclipped features (``metric="noclip"``) make the selection content-dependent, so near-ties between
    link scores are common: no tie grid may reorder them (a 2**-16 grid changed 5 of these 300 choices)."""
    from hf_tokred.reduce import select

    checked = 0
    for seed in range(300):
        g = torch.Generator().manual_seed(seed)
        n, d = int(torch.randint(40, 300, (1,), generator=g)), int(torch.randint(2, 16, (1,), generator=g))
        h = torch.randn(n, d, generator=g) * torch.rand(d, generator=g) * 3
        r = max(1, n // 10)
        metric = h / h.norm(dim=-1, keepdim=True)
        ranked = metric.sort(dim=0, descending=True).values
        scores = (ranked[n // 2:] @ ranked[: n // 2].T).max(dim=-1).values
        order = scores.argsort(descending=True)
        if scores[order[r - 1]] == scores[order[r]]:
            continue  # an exact tie: the authors' unstable arg-sort may pick either
        sel = select("reference", h[None], torch.zeros(1, n, dtype=torch.bool), torch.tensor([r]), "noclip")
        assert set(sel.src[0][sel.valid[0]].tolist()) == set((2 * order[:r]).tolist()), seed
        checked += 1
    assert checked > 250
