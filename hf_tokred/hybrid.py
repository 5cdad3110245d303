"""What the attention layers of a hybrid SSM-attention model need inside the reducing loop.

After an anchor, attention layers see the reduced sequence: each kept token keeps its **original** position id
(rotary embeddings use it; a merged token is its destination, so it has the destination's position), the causal
mask runs over the reduced columns (their order is the original order), and padding columns (left padding, and the
slots a plan leaves when rows keep different numbers of tokens) are masked out.  The KV cache then holds the
reduced keys/values; the cache also records, per attention layer, which of its cached columns are real, so a
decode step masks the same columns a fresh forward over prompt + generated tokens would.
"""

from __future__ import annotations

import inspect

import torch

from .compat import layer_cache_kwargs
from .reduce import Plan, reduce_along

__all__ = ["AttentionLayers", "causal_mask", "check_attention_implementation", "default_positions", "note_seen"]

_KV_REAL = "_hf_tokred_kv_real"  # cache attribute: {layer index: [B, S] bool, which cached key/value columns are real}
_SEEN = "_hf_tokred_seen"  # cache attribute: how many input positions the cache has seen (the next original position)
_MASKS = ("sdpa", "eager")
_PARAMETERS: dict[type, frozenset] = {}


def check_attention_implementation(config) -> None:
    """Reduced sequences need an explicit mask: sdpa (boolean) and eager (additive) take one."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in _MASKS:
        raise ValueError(f"token reduction on a hybrid model runs its attention layers with an explicit mask over the "
                         f"reduced sequence, which attn_implementation={impl!r} does not take here; load the model "
                         "with attn_implementation='sdpa' (or 'eager')")


def causal_mask(impl: str, q_real: torch.Tensor, kv_real: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, L, S]`` mask of ``L`` query columns (the last ``L`` of the ``S`` key/value columns): a query sees the
    real columns at or before its own.  A padding query sees only itself (its output is never used, but a fully
    masked row would be NaN).  Boolean for sdpa, additive (0 / dtype minimum) for eager."""
    L, S = q_real.shape[1], kv_real.shape[1]
    cols = torch.arange(S, device=kv_real.device)
    own = torch.arange(S - L, S, device=kv_real.device)[:, None]
    allowed = (cols[None, :] <= own)[None] & kv_real[:, None, :]
    allowed |= (cols[None, :] == own)[None] & ~q_real[:, :, None]
    allowed = allowed[:, None]
    if impl == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def default_positions(cache, B: int, N: int, fresh: bool, device) -> torch.Tensor:
    """Position ids when the caller gives none: ``0 .. N-1`` for a fresh forward, else continuing at the next
    original position: the number of input positions the cache has seen (not its reduced length), or, for a cache
    filled without hf_tokred (no record: nothing was reduced), what stock transformers starts at,
    ``cache.get_seq_length()``."""
    if fresh or cache is None:
        start = 0
    else:
        start = cache.__dict__.get(_SEEN)
        if start is None:
            start = cache.get_seq_length()
    return (torch.arange(N, device=device) + start).expand(B, N)


def note_seen(cache, N: int, fresh: bool) -> None:
    """After a forward of ``N`` input positions: the positions ``cache`` has seen (a cache filled without hf_tokred
    has no record; nothing was reduced in it, so its length, which now includes these ``N``, is what it saw)."""
    if cache is None:
        return
    seen = cache.__dict__.get(_SEEN)
    if fresh:
        seen = N
    elif seen is None:
        seen = cache.get_seq_length()
    else:
        seen += N
    cache.__dict__[_SEEN] = seen


def _accepted(block) -> frozenset:
    cls = type(block)
    if cls not in _PARAMETERS:
        _PARAMETERS[cls] = frozenset(inspect.signature(cls.forward).parameters)
    return _PARAMETERS[cls]


class AttentionLayers:
    """State the attention layers of one forward share: the original positions of the current columns (shrinking at
    every anchor), their rotary embeddings (computed once per length), and the cache's real-column record."""

    def __init__(self, backbone, cache, positions: torch.Tensor, use_cache: bool, fresh: bool) -> None:
        if fresh and cache is not None:  # a cache object used again from the start: forget its old record
            cache.__dict__.pop(_KV_REAL, None)
        self.impl = backbone.config._attn_implementation or "eager"
        self.rotary = getattr(backbone, "rotary_emb", None)
        self.cache, self.use_cache = cache, use_cache
        self.positions = positions
        self._embeddings = None

    def shrink(self, plan: Plan) -> None:
        """Follow an anchor's plan: kept tokens keep their positions (padding slots get 0)."""
        self.positions = reduce_along(self.positions, plan, 0)
        self._embeddings = None

    def _kv_real(self, layer: int, real: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            return real
        store = self.cache.__dict__.setdefault(_KV_REAL, {})
        past = store.get(layer)
        if past is None:  # a cache filled without hf_tokred: every cached column is real
            cached = self.cache.get_seq_length(layer)
            past = torch.ones(real.shape[0], cached, dtype=torch.bool, device=real.device)
        store[layer] = torch.cat([past, real], 1)
        return store[layer]

    def __call__(self, block, layer: int, hidden: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        if self._embeddings is None and self.rotary is not None:
            self._embeddings = self.rotary(hidden, self.positions)
        mask = causal_mask(self.impl, real, self._kv_real(layer, real), hidden.dtype)
        offered = {"attention_mask": mask, "position_ids": self.positions, "position_embeddings": self._embeddings,
                   "use_cache": self.use_cache}
        accepted = _accepted(block)
        out = block(hidden, **layer_cache_kwargs(self.cache), **{k: v for k, v in offered.items() if k in accepted})
        return out[0] if isinstance(out, tuple) else out
