"""Slow, obvious reference implementations used by the tests (per token, per row, float64 where it matters)."""

import math

import torch


def slow_apply(x, pairs, weights):
    """Reduce one row ``x [n, D]``: ``pairs`` = [(src, dst)], ``weights[i]`` = per-channel 0/1 merge weights."""
    out = x.double().clone()
    for dst in {d for _, d in pairs}:
        num, den = x[dst].double().clone(), torch.ones(x.shape[1], dtype=torch.double)
        for (s, d), w in zip(pairs, weights):
            if d == dst:
                w = torch.as_tensor(w, dtype=torch.double)
                num += w * x[s].double()
                den += w
        out[dst] = num / den
    removed = {s for s, _ in pairs}
    return out[[i for i in range(len(x)) if i not in removed]].to(x.dtype)


def slow_weights(strategy, pairs, scores, x, q):
    """0/1 merge weights per source and channel, by the documented rule of each strategy."""
    r, D = len(pairs), x.shape[1]
    if strategy == "prune":
        return [[0.0] * D for _ in pairs]
    if strategy == "merge":
        return [[1.0] * D for _ in pairs]
    k = math.floor(r * (1 - q) + 1e-9)
    if strategy == "hybrid":
        chosen = sorted(range(r), key=lambda i: (-scores[i], i))[:k]
        return [[1.0 if i in chosen else 0.0] * D for i in range(r)]
    weights = [[0.0] * D for _ in pairs]
    for d in range(D):
        vals = [float(x[s, d]) for s, _ in pairs]
        for i in sorted(range(r), key=lambda i: (-vals[i], i))[:k]:
            weights[i][d] = 1.0
    return weights


def row_plans(plans, real_mask, row):
    """Convert a batch forward's plans into row-local ``(layer, pairs, scores)``, dropping left padding."""
    out = []
    width, n_real = real_mask.shape[1], int(real_mask[row].sum())
    for layer, plan in plans:
        offset = width - n_real
        ok = plan.src_mask[row]
        pairs = [(int(s) - offset, int(d) - offset) for s, d in zip(plan.src[row][ok], plan.dst[row][ok])]
        out.append((layer, pairs, plan.src_score[row][ok].tolist()))
        width, n_real = plan.keep.shape[1], int(plan.keep_mask[row].sum())
    return out


@torch.no_grad()
def slow_forward(model, ids, plans, n_prompt, hidden_strategy, residual_strategy, q):
    """One unpadded row through the stock blocks, applying row-local ``plans`` to its first ``n_prompt`` tokens.

    Tokens after the prompt (e.g. generated ones) are kept as they are.  Returns logits for the
    surviving tokens, in order.
    """
    backbone = model.backbone
    x = backbone.embeddings(ids[None])
    by_layer = {layer: (pairs, scores) for layer, pairs, scores in plans}
    n_cur = n_prompt  # prompt tokens still in the sequence
    for i, block in enumerate(backbone.layers):
        if i not in by_layer:
            x = block(x)
            continue
        pairs, scores = by_layer[i]
        residual = x.float() if block.residual_in_fp32 else x
        h = block.mixer(block.norm(x))
        parts = []
        for branch, strategy in ((residual[0], residual_strategy), (h[0], hidden_strategy)):
            head = branch[:n_cur]
            reduced = slow_apply(head, pairs, slow_weights(strategy, pairs, scores, head, q))
            parts.append(torch.cat([reduced, branch[n_cur:]]))
        x = (parts[0] + parts[1])[None]
        n_cur -= len(pairs)
    return model.lm_head(backbone.norm_f(x))[0].float()
