"""Slow, obvious reference implementations used by the tests (per token, per row, float64 where it matters).

Nothing here imports ``hf_tokred``: the removal / merge counts come from exact rational arithmetic on the ratio the
user meant (:func:`intended_ratio`), the scans and the convolution from their equations.
"""

import math
from decimal import Decimal
from fractions import Fraction

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------- counts (exact arithmetic)

#: Float noise: when the ratio is neither a short decimal nor a simple fraction (e.g. 0.7000000001), a product this
#: close to an integer counts as that integer (the only place where the exact arithmetic needs a tolerance).
BAND = Fraction(1, 10**9)


def _intended(x: float) -> tuple[Fraction, bool]:
    """``(ratio, fallback)``: the ratio a user meant by the float ``x``, exactly -- the decimal they typed when
    ``repr(x)`` has at most 8 decimal places (0.55, 0.9729), else the simplest fraction within 1e-12 of ``x``
    (5/7, 1/3); ``fallback`` when neither applies and the float's exact binary value is used."""
    d = Decimal(repr(float(x)))
    if d.as_tuple().exponent >= -8:
        return Fraction(d), False
    exact = Fraction(float(x))
    simple = exact.limit_denominator(10**4)
    if abs(simple - exact) <= Fraction(1, 10**12):
        return simple, False
    return exact, True


def intended_ratio(x: float) -> Fraction:
    return _intended(x)[0]


def in_tolerance_band(x: float, max_n: int = 64) -> bool:
    """True for a ratio that is neither a short decimal nor a simple fraction (e.g. 1e-9, 0.7000000001) when some
    ``n x`` or ``n (1 - x)`` (``n <= max_n``) lies within 2e-9 of an integer without being one: there the plugin's
    float tolerance and this module's exact arithmetic may round differently, which no one specifies.  Property
    tests do not draw such ratios."""
    if not _intended(x)[1]:
        return False
    for n in range(1, max_n + 1):
        for v in (n * x, n * (1 - x)):
            if 0 < abs(v - round(v)) < 2e-9:
                return True
    return False


def documented_num_to_remove(n: int, keep_ratio: float, pairs: bool) -> int:
    """``n - ceil(n * keep_ratio)`` as the docstring states it, in exact arithmetic on the intended ratio (so
    100 x 0.55 keeps exactly 55 and 7 x 5/7 keeps 5, where float arithmetic gives 55.00000000000001 and
    5.000000000000001); a non-empty row keeps at least one token; capped at ``n // 2`` when tokens are paired."""
    ratio, fallback = _intended(keep_ratio)
    keep = math.ceil(n * ratio - (BAND if fallback else 0))
    if n > 0:
        keep = max(keep, 1)
    r = n - keep
    if pairs:
        r = min(r, n // 2)
    return max(r, 0)


def documented_merge_count(r: int, q: float) -> int:
    """How many of ``r`` selected tokens the hybrid strategies merge: ``floor(r * (1 - q))`` in exact arithmetic
    on the intended ``q`` (``q = 0.8`` with 5 sources merges 1, where float arithmetic gives 0.9999999999999998)."""
    ratio, fallback = _intended(q)
    return math.floor(r * (1 - ratio) + (BAND if fallback else 0))


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
    k = documented_merge_count(r, q)
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


def slow_forward(model, ids, plans, n_prompt, hidden_strategy, residual_strategy, q, grad=False):
    """One unpadded row through the stock blocks (transformers' own kernels), applying row-local ``plans`` to its
    first ``n_prompt`` tokens.

    Tokens after the prompt (e.g. generated ones) are kept as they are.  Returns logits for the
    surviving tokens, in order (differentiable with ``grad=True``).
    """
    from conftest import stock_transformers

    backbone = model.backbone
    with torch.set_grad_enabled(grad), stock_transformers():
        x = backbone.embeddings(ids[None])
        by_layer = {layer: (pairs, scores) for layer, pairs, scores in plans}
        n_cur = n_prompt  # prompt tokens still in the sequence
        for i, block in enumerate(backbone.layers):
            if i not in by_layer:
                x = block(x)
                continue
            pairs, scores = by_layer[i]
            if hidden_strategy == "before":  # a method that prunes before its anchor, then runs the whole block
                gone = {src for src, _ in pairs}
                x = block(x[:, [j for j in range(x.shape[1]) if j not in gone]])
                n_cur -= len(pairs)
                continue
            residual = x.float() if block.residual_in_fp32 else x
            h = block.mixer(block.norm(x))
            parts = []
            for branch, strategy in ((residual[0], residual_strategy), (h[0], hidden_strategy)):
                head = branch[:n_cur]
                reduced = slow_apply(head, pairs, slow_weights(strategy, pairs, scores, head.detach(), q))
                parts.append(torch.cat([reduced, branch[n_cur:]]))
            x = (parts[0] + parts[1])[None]
            n_cur -= len(pairs)
        return model.lm_head(backbone.norm_f(x))[0].float()


# ----------------------------------------------------------------------------- kernels from their equations


def equation_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                  initial_state=None, return_last_state=True):
    """Mamba-1 selective scan, one step at a time in float64 (differentiable), transformers' layout:
    ``u, dt, z [b, d, L]``, ``A [d, n]``, ``B, C [b, n, L]``; returns ``(y [b, d, L], final state [b, d, n])``::

        dt <- softplus(dt + bias)    h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t    y_t = C_t . h_t + D u_t, * silu(z_t)
    """
    u, dt, A, B, C = (t.double() for t in (hidden_states, dt, A, B, C))
    if delta_bias is not None:
        dt = dt + delta_bias.double()[:, None]
    if delta_softplus:
        dt = F.softplus(dt)
    b, d, L = u.shape
    h = u.new_zeros(b, d, A.shape[-1]) if initial_state is None else initial_state.double()
    ys = []
    for t in range(L):
        h = torch.exp(dt[:, :, t, None] * A) * h + (dt[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, -1) if ys else u.new_zeros(b, d, 0)
    if D is not None:
        y = y + D.double()[:, None] * u
    if z is not None:
        y = y * F.silu(z.double())
    return (y, h) if return_last_state else y


def equation_conv(x, weight, bias=None, activation=None):
    """Depthwise causal convolution, float64: ``out[c, t] = bias[c] + sum_k weight[c, k] x[c, t - K + 1 + k]``
    (zeros before the start), then silu; ``x [b, c, L]``, ``weight [c, K]``."""
    x, weight = x.double(), weight.double()
    K, L = weight.shape[-1], x.shape[-1]
    padded = F.pad(x, (K - 1, 0))
    out = sum(weight[None, :, k, None] * padded[:, :, k : k + L] for k in range(K))
    if bias is not None:
        out = out + bias.double()[None, :, None]
    return F.silu(out) if activation in ("silu", "swish") else out


def equation_ssd(x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, initial_state=None):
    """Mamba-2 (SSD) recurrence for one sequence, one step at a time in float64: ``x [L, H, P]``, ``dt [L, H]``,
    ``A [H]``, ``B, C [L, G, N]``, ``D [H]``; returns ``(y [L, H, P], final state [H, P, N])``::

        dt <- softplus(dt + bias)    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T    y_t = h_t C_t + D x_t
    """
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = F.softplus(dt)
    L, H, P = x.shape
    G, N = B.shape[1:]
    Bh, Ch = B.repeat_interleave(H // G, dim=1), C.repeat_interleave(H // G, dim=1)  # [L, H, N]
    h = x.new_zeros(H, P, N) if initial_state is None else initial_state.double()
    ys = []
    for t in range(L):
        h = torch.exp(dt[t] * A)[:, None, None] * h + (dt[t][:, None] * x[t])[..., None] * Bh[t][:, None, :]
        ys.append((h * Ch[t][:, None, :]).sum(-1))
    y = torch.stack(ys) if ys else x.new_zeros(0, H, P)
    if D is not None:
        y = y + D.double()[:, None] * x
    return y, h
