"""What the attention layers of a hybrid SSM-attention model need inside the reducing loop.

After an anchor, attention layers see the reduced sequence: each kept token keeps its **original** position id
(rotary embeddings use it; a merged token is its destination, so it has the destination's position), the causal
mask runs over the reduced columns (their order is the original order), and padding columns (left padding, and the
slots a plan leaves when rows keep different numbers of tokens) are masked out.  The KV cache then holds the
reduced keys/values; the cache also records, per attention layer, which of its cached columns are real, so a
decode step masks the same columns a fresh forward over prompt + generated tokens would.  Zamba2's shared attention
block also reads the original embeddings: they follow every plan as the residual stream does.
"""

from __future__ import annotations

import inspect

import torch

from .compat import layer_cache_kwargs
from .reduce import Plan, apply_plan, reduce_along

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
    every anchor), their rotary embeddings (computed once per length), the cache's real-column record, and (Zamba2,
    whose shared attention block reads them) the original embeddings of the current columns, which follow every
    plan as the hidden states do."""

    def __init__(self, backbone, family, cache, positions: torch.Tensor, use_cache: bool, fresh: bool,
                 embeddings: torch.Tensor | None = None) -> None:
        if fresh and cache is not None:  # a cache object used again from the start: forget its old record
            cache.__dict__.pop(_KV_REAL, None)
        self.impl = backbone.config._attn_implementation or "eager"
        self.rotary = getattr(backbone, "rotary_emb", None)
        self.family, self.cache, self.use_cache = family, cache, use_cache
        self.positions = positions
        self.embeddings = embeddings
        self._rotary_embeddings = None

    def shrink(self, plan: Plan, strategy: str, q: float) -> None:
        """Follow an anchor's plan: kept tokens keep their positions (padding slots get 0); the original embeddings
        are reduced with the ``strategy`` the plan applies to the residual stream (``prune`` for a plan that prunes
        its anchor's input)."""
        self.positions = reduce_along(self.positions, plan, 0)
        if self.embeddings is not None:
            self.embeddings = apply_plan(self.embeddings, plan, strategy, q)
        self._rotary_embeddings = None

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

    def _inputs(self, layer: int, hidden: torch.Tensor, real: torch.Tensor, mask_arg: str) -> dict:
        """What a layer (or attention module) may take: the mask over the reduced columns (under ``mask_arg``), the
        original positions and their rotary embeddings, ``use_cache``, the layer's index and the original
        embeddings (Zamba2's shared block)."""
        if self._rotary_embeddings is None and self.rotary is not None:
            self._rotary_embeddings = self.rotary(hidden, self.positions)
        mask = causal_mask(self.impl, real, self._kv_real(layer, real), hidden.dtype)
        return {mask_arg: mask, "position_ids": self.positions, "position_embeddings": self._rotary_embeddings,
                "use_cache": self.use_cache, "layer_idx": layer, "original_hidden_states": self.embeddings}

    def __call__(self, block, layer: int, hidden: torch.Tensor, real: torch.Tensor, ssm_mask=None) -> torch.Tensor:
        """Decoder layer ``layer`` on the current columns; a layer that also runs an SSM mixer (Falcon-H1, Zamba2)
        gets its mask too, under the family's name for it."""
        offered = self._inputs(layer, hidden, real, self.family.causal_mask_arg)
        if self.family.ssm_mask_arg:
            offered[self.family.ssm_mask_arg] = ssm_mask
        return _called(block, hidden, self.cache, offered)

    def attend(self, module, x: torch.Tensor, layer: int, real: torch.Tensor) -> torch.Tensor:
        """transformers' attention ``module`` of layer ``layer`` (called by an anchor that splits its layer) on
        ``x``."""
        return _called(module, x, self.cache, self._inputs(layer, x, real, "attention_mask"))


def _called(module, x: torch.Tensor, cache, offered: dict) -> torch.Tensor:
    """``module(x, cache, ...)`` with the ``offered`` keywords its forward takes; its first output."""
    accepted = _accepted(module)
    out = module(x, **layer_cache_kwargs(cache), **{k: v for k, v in offered.items() if k in accepted})
    return out[0] if isinstance(out, tuple) else out
