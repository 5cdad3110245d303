"""Multi-query associative recall (MQAR, Zoology: Arora et al. 2023): a seeded generator and its scoring rule.

A sequence holds ``num_pairs`` key-value pairs at the start, a block of filler tokens, then ``num_queries``
queries: a key seen earlier, followed by the value bound to it.  The model is scored at each query key's own
position: its next-token prediction there must be the bound value.  The right answer therefore depends on
tokens far back, which is what a token-reduction method must keep::

    k1 v1 k2 v2 ... kP vP | f f f ... f (filler, >= half the sequence) | q1 a1 q2 a2 ... qQ aQ

Token ids (``vocab_size`` >= 2 + ``num_keys`` + ``num_values`` + 1)::

    0                      padding (never generated; a model may use it as pad_token_id)
    1                      unused (reserved, so that bos/eos conventions never collide with data)
    [2, 2 + K)             keys
    [2 + K, 2 + K + V)     values
    [2 + K + V, vocab)     filler

Keys within a sequence are distinct (drawn without replacement), values are drawn with replacement, queries
are distinct keys of the sequence in random order, filler is uniform over the filler range.  Everything
depends only on ``(seed, index)``, so a set is reproducible on any machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["MQARBatch", "MQARSettings", "make_batch", "recall_hits", "tokenizer"]


@dataclass(frozen=True)
class MQARSettings:
    """One MQAR setting; the defaults are the benchmark's (and the bundled recall models') default."""

    seq_len: int = 128
    num_pairs: int = 8
    num_queries: int = 8
    num_keys: int = 32
    num_values: int = 32
    vocab_size: int = 128
    #: smallest share of the sequence that is filler (the benchmark's 0.5; training curricula may use less)
    min_filler_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("seq_len", "num_pairs", "num_queries", "num_keys", "num_values", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MQARSettings.{name} must be a positive int, got {value!r}")
        if not 0.0 <= self.min_filler_share < 1.0:
            raise ValueError(f"MQARSettings.min_filler_share must be in [0, 1), got {self.min_filler_share!r}")
        if self.num_pairs > self.num_keys:
            raise ValueError(f"MQARSettings.num_pairs ({self.num_pairs}) cannot exceed num_keys ({self.num_keys}): "
                             "keys within a sequence are distinct")
        if self.num_queries > self.num_pairs:
            raise ValueError(f"MQARSettings.num_queries ({self.num_queries}) cannot exceed num_pairs "
                             f"({self.num_pairs}): each query asks a distinct key of the sequence")
        if self.filler_start >= self.vocab_size:
            raise ValueError(f"MQARSettings.vocab_size must exceed 2 + num_keys + num_values = {self.filler_start} "
                             f"(room for filler tokens), got {self.vocab_size}")
        if self.filler_len < 0 or self.filler_len < self.min_filler_share * self.seq_len:
            raise ValueError(
                f"MQARSettings: filler must be at least {self.min_filler_share:g} of the sequence, got "
                f"{self.filler_len} of {self.seq_len} tokens; use a longer seq_len or fewer pairs/queries"
            )

    @property
    def key_start(self) -> int:
        return 2

    @property
    def value_start(self) -> int:
        return 2 + self.num_keys

    @property
    def filler_start(self) -> int:
        return 2 + self.num_keys + self.num_values

    @property
    def filler_len(self) -> int:
        return self.seq_len - 2 * (self.num_pairs + self.num_queries)

    @property
    def query_positions(self) -> torch.Tensor:
        """Positions of the query keys (where the model must predict the value), ``[num_queries]``."""
        start = 2 * self.num_pairs + self.filler_len
        return torch.arange(start, self.seq_len, 2)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class MQARBatch:
    """``input_ids [n, seq_len]``; ``query_positions [num_queries]`` (same in every row); ``answers [n, num_queries]``."""

    input_ids: torch.Tensor
    query_positions: torch.Tensor
    answers: torch.Tensor

    @property
    def labels(self) -> torch.Tensor:
        """Causal-LM labels (``labels[:, t+1]`` is predicted at ``t``): the answers after each query key, -100 elsewhere."""
        labels = torch.full_like(self.input_ids, -100)
        labels[:, self.query_positions + 1] = self.answers
        return labels

    @property
    def protected_mask(self) -> torch.Tensor:
        """The scored positions (the query keys), to protect from reduction like lm-eval continuations."""
        mask = torch.zeros_like(self.input_ids, dtype=torch.bool)
        mask[:, self.query_positions] = True
        return mask


def make_batch(settings: MQARSettings, n: int, seed: int, start: int = 0, depth: float | None = 0.0) -> MQARBatch:
    """Sequences ``start, ..., start + n - 1`` of the set ``seed`` (each row depends only on ``(seed, index)``).

    ``depth``: the share of the filler placed before the key-value block (0: the block opens the sequence, the
    benchmark's layout; 1: it ends right before the queries); ``None`` draws it per row, uniformly (training for
    any depth).  Every depth uses the same keys, values, filler and queries, so depths differ only in layout."""
    if depth is not None and not (isinstance(depth, (int, float)) and 0.0 <= depth <= 1.0):
        raise ValueError(f"make_batch: depth must be in [0, 1] (or None for a random depth per row), got {depth!r}")
    s = settings
    rows, answers = [], []
    for index in range(start, start + n):
        g = torch.Generator().manual_seed((int(seed) * 0x9E37_79B9 + int(index)) % 2**63)
        keys = torch.randperm(s.num_keys, generator=g)[: s.num_pairs] + s.key_start
        values = torch.randint(s.num_values, (s.num_pairs,), generator=g) + s.value_start
        filler = torch.randint(s.filler_start, s.vocab_size, (s.filler_len,), generator=g)
        asked = torch.randperm(s.num_pairs, generator=g)[: s.num_queries]
        pairs = torch.stack([keys, values], 1).reshape(-1)
        queries = torch.stack([keys[asked], values[asked]], 1).reshape(-1)
        share = depth if depth is not None else float(torch.rand((), generator=g))
        before = round(share * s.filler_len)
        rows.append(torch.cat([filler[:before], pairs, filler[before:], queries]))
        answers.append(values[asked])
    return MQARBatch(torch.stack(rows), s.query_positions, torch.stack(answers))


def recall_hits(logits: torch.Tensor, batch: MQARBatch) -> torch.Tensor:
    """``[n, num_queries]`` bool: whether the arg-max next token at each query position is the bound value.

    ``logits [n, seq_len, vocab]`` are aligned with the input positions (a reduced model's NaN columns at the
    query positions would fail here: queries are protected, so they are always computed).
    """
    at = logits[:, batch.query_positions]
    if bool(torch.isnan(at).any()):
        raise ValueError("a query position was not computed (NaN logits); pass batch.protected_mask to the model")
    return at.argmax(-1) == batch.answers


def tokenizer(settings: MQARSettings) -> PreTrainedTokenizerFast:
    """A word-level tokenizer for the setting's ids, so sequences print readably: ``<pad>`` (0), ``<unused>``
    (1), keys ``k0 k1 ...``, values ``v0 v1 ...``, filler ``f0 f1 ...``."""
    names = ["<pad>", "<unused>"] + [f"k{i}" for i in range(settings.num_keys)] + \
        [f"v{i}" for i in range(settings.num_values)] + [f"f{i}" for i in range(settings.vocab_size - settings.filler_start)]
    tok = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token="<unused>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unused>",
                                   eos_token="<unused>", bos_token="<unused>")
