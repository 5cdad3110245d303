"""Passkey retrieval (a needle in a haystack, RULER's ``niah_single`` style): a seeded generator and its scoring rule.

A prompt is a haystack with one needle sentence carrying a random number, then the question, then the answer::

    [bos] hay hay ... | The pass key is 38291. Remember it. 38291 is the pass key. | hay ... hay | What is the
    pass key? The pass key is | 38291

The haystack is either ``noise`` (the same few sentences repeated, as in the passkey tests of Landmark Attention
and LongMamba) or ``natural``: passages of held-out text run together (the caller passes them, e.g.
``data.heldout_passages()``; a passkey model trains on the other split).  ``depth`` is the share of the haystack
before the needle (for noise, rounded to a whole sentence).  Every row has exactly ``seq_len`` tokens: the
haystack fills what the needle, question and answer leave.

Scoring is teacher-forced: a row is retrieved when the arg-max next token at every answer position is the answer's
token, which is exactly when greedy decoding after the question would write the answer.  The question and answer
are the row's ``question_length`` suffix, so a reduced model never removes them.  Each row depends only on
``(seed, index)`` and the tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

__all__ = ["HAYSTACKS", "NOISE", "PasskeyBatch", "PasskeySettings", "make_passkey_batch", "passkey_hits"]

#: the repeated noise haystack (one sentence per unit; the needle goes between two units)
NOISE = (" The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.", " There and back again.")
HAYSTACKS = ("noise", "natural")
_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
_QUESTION = " What is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeySettings:
    """One passkey setting: prompt length in tokens, digits of the key, and the haystack kind."""

    seq_len: int = 256
    digits: int = 5
    haystack: str = "noise"

    def __post_init__(self) -> None:
        for name in ("seq_len", "digits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PasskeySettings.{name} must be a positive int, got {value!r}")
        if self.haystack not in HAYSTACKS:
            raise ValueError(f"PasskeySettings.haystack must be one of {', '.join(HAYSTACKS)}, got {self.haystack!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class PasskeyBatch:
    """``input_ids [n, seq_len]``; ``labels`` (the answer tokens, -100 elsewhere: a causal-LM loss on the answer);
    ``question_length [n]`` (question + answer, the suffix never reduced); ``needle_start [n]``; ``keys``."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    question_length: torch.Tensor
    needle_start: torch.Tensor
    keys: list[str]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _noise_stream(tokenizer, length: int, before: int) -> tuple[list[int], int]:
    """``length`` noise tokens (whole sentences, cycled, the last one cut) and the sentence boundary nearest
    ``before``."""
    units = [_ids(tokenizer, s) for s in NOISE]
    stream, bounds, i = [], [0], 0
    while len(stream) < length:
        stream += units[i % len(units)]
        bounds.append(len(stream))
        i += 1
    cut = min((b for b in bounds if b <= length), key=lambda b: abs(b - before))
    return stream[:length], cut


def _natural_stream(tokenizer, texts: Sequence[str], length: int, g: torch.Generator) -> list[int]:
    """``length`` tokens of ``texts`` run together from a random passage on (cycling through them)."""
    first = int(torch.randint(len(texts), (), generator=g))
    stream, i = [], 0
    while len(stream) < length:
        stream += _ids(tokenizer, texts[(first + i) % len(texts)])
        i += 1
        if i > len(texts) and not stream:
            raise ValueError("the natural haystack's passages tokenize to nothing")
    return stream[:length]


def make_passkey_batch(tokenizer, settings: PasskeySettings, n: int, seed: int, start: int = 0,
                       depth: float | None = 0.5, texts: Sequence[str] | None = None) -> PasskeyBatch:
    """Prompts ``start, ..., start + n - 1`` of the set ``seed``; ``depth`` in [0, 1] (``None``: random per row);
    ``texts`` are the passages of a ``natural`` haystack."""
    if depth is not None and not (isinstance(depth, (int, float)) and 0.0 <= depth <= 1.0):
        raise ValueError(f"make_passkey_batch: depth must be in [0, 1] (or None for a random depth per row), got "
                         f"{depth!r}")
    s = settings
    if s.haystack == "natural" and not texts:
        raise ValueError("a natural haystack needs texts= (passages, e.g. hf_tokred.evaluation.data."
                         "heldout_passages(); run `hf-tokred data` once to fetch them)")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    prefix = [bos] if bos is not None else []
    rows, labels, qlens, needles, keys = [], [], [], [], []
    for index in range(start, start + n):
        g = torch.Generator().manual_seed((int(seed) * 0x9E37_79B9 + int(index)) % 2**63)
        key = str(int(torch.randint(10 ** (s.digits - 1), 10 ** s.digits, (), generator=g)))
        share = depth if depth is not None else float(torch.rand((), generator=g))
        needle, question, answer = _ids(tokenizer, _NEEDLE.format(key=key)), _ids(tokenizer, _QUESTION), \
            _ids(tokenizer, " " + key)
        hay = s.seq_len - len(prefix) - len(needle) - len(question) - len(answer)
        if hay < 0:
            raise ValueError(f"PasskeySettings.seq_len={s.seq_len} is too short for the needle, question and answer "
                             f"({s.seq_len - hay} tokens with this tokenizer); use a longer seq_len")
        if s.haystack == "noise":
            stream, before = _noise_stream(tokenizer, hay, round(share * hay))
        else:
            stream, before = _natural_stream(tokenizer, texts, hay, g), round(share * hay)
        row = prefix + stream[:before] + needle + stream[before:] + question + answer
        rows.append(row)
        label = [-100] * (s.seq_len - len(answer)) + answer
        labels.append(label)
        qlens.append(len(question) + len(answer))
        needles.append(len(prefix) + before)
        keys.append(key)
    return PasskeyBatch(torch.tensor(rows), torch.tensor(labels), torch.tensor(qlens), torch.tensor(needles), keys)


def passkey_hits(logits: torch.Tensor, batch: PasskeyBatch) -> torch.Tensor:
    """``[n]`` bool: whether the arg-max next token before every answer token is that token (greedy decoding after
    the question would write the key).  ``logits [n, k, vocab]``: the logits of the last ``k`` input positions
    (``k = seq_len``: all of them; ``logits_to_keep=k`` with ``k`` above the answer's length suffices)."""
    k = logits.shape[1]
    target = batch.labels[:, batch.labels.shape[1] - k + 1:]
    if bool((batch.labels[:, :batch.labels.shape[1] - k + 1] != -100).any()):
        raise ValueError(f"passkey_hits: the logits of the last {k} positions do not reach every answer token; "
                         f"keep more positions (logits_to_keep)")
    scored = target != -100
    pred = logits[:, :-1].argmax(-1)
    if bool(torch.isnan(logits[:, :-1][scored]).any()):
        raise ValueError("an answer position was not computed (NaN logits); pass question_length=batch."
                         "question_length to the model")
    return ((pred == target) | ~scored).all(1)
