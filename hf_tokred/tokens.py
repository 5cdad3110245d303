"""What the reducing loop carries per column while the sequence shrinks (:mod:`hf_tokred.loop`): which columns are
real tokens, protected (the last token, the recent share, the caller's mask, the question), frozen (the question),
their input positions, and how many leading columns are the prompt."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ResolvedSchedule
from .reduce import Plan, reduce_along

__all__ = ["Tokens", "start_tokens", "warn_over_budget"]

logger = logging.getLogger("hf_tokred")


def _protected_for(mask: torch.Tensor, B: int, prefix: int, N: int) -> torch.Tensor:
    """A caller's ``protected_mask [b, prefix]`` as ``[B, N]`` bool: rows repeated when generate expanded the batch
    (beams, ``num_return_sequences``), columns after the prompt False."""
    if mask.dim() != 2 or mask.shape[1] != prefix or mask.shape[0] == 0 or B % mask.shape[0]:
        raise ValueError(f"protected_mask must have shape (batch, sequence) = {(B, prefix)}, got {tuple(mask.shape)}")
    mask = mask.to(torch.bool).repeat_interleave(B // mask.shape[0], dim=0)
    return F.pad(mask, (0, N - prefix), value=False)


def _initial_protection(real: torch.Tensor, prefix: int, extra_masks, recent: float) -> torch.Tensor:
    """The last real token of every row (of the prompt) always survives (next-token logits and the decode cache
    need it), so do the ``recent`` share of each row's most recent prompt tokens, plus the callers' protected
    positions."""
    B, N = real.shape
    ar = torch.arange(N, device=real.device)
    in_prompt = real & (ar < prefix)
    last = torch.where(in_prompt, ar, -1).max(1).values
    protected = real & (ar[None, :] == last[:, None])
    if recent > 0:
        from_end = in_prompt.flip(1).cumsum(1).flip(1)  # 1 for the last prompt token, 2 for the one before, ...
        protected |= in_prompt & (from_end <= torch.ceil(in_prompt.sum(1, keepdim=True) * recent))
    for extra in extra_masks:
        if extra is not None:
            protected |= _protected_for(extra, B, prefix, N).to(real.device) & real
    return protected


@dataclass
class Tokens:
    """What the loop carries per column while the sequence shrinks: which columns are real tokens, protected,
    frozen (the question), their input positions, and how many leading columns are the prompt."""

    real: torch.Tensor
    protected: torch.Tensor | None
    frozen: torch.Tensor | None
    positions: torch.Tensor
    prefix: int

    def shrink(self, plan: Plan) -> None:
        self.prefix = plan.keep.shape[1] - (self.real.shape[1] - self.prefix)  # the suffix columns are all kept
        self.real = reduce_along(self.real, plan, False)
        self.protected = reduce_along(self.protected, plan, False)
        self.frozen = None if self.frozen is None else reduce_along(self.frozen, plan, False)
        self.positions = reduce_along(self.positions, plan, -1)

    def prompt_lengths(self) -> list[int]:
        return self.real[:, : self.prefix].sum(1).tolist()


def start_tokens(B, N, device, attention_mask, prompt, reducing, cfg, schedule, protected_mask,
                  question_length) -> Tokens:
    """The columns' state before block 0: real tokens, and for a reducing forward the protected and frozen ones
    (the question; from ``generate``'s prompt when not given), checked against the budget."""
    real = (torch.ones(B, N, dtype=torch.bool, device=device) if attention_mask is None
            else attention_mask[:, -N:].to(device=device, dtype=torch.bool))
    t = Tokens(real, None, None, torch.arange(N, device=device).expand(B, N), min(prompt.length, N))
    question_length = question_length if question_length is not None else prompt.question_length
    if reducing:
        t.frozen = None if question_length is None else _question_mask(question_length, real, t.prefix)
        t.protected = _initial_protection(real, t.prefix, (protected_mask, prompt.protected_mask), cfg.protect_recent)
        if t.frozen is not None:
            t.protected |= t.frozen
        schedule.check_budget(t.prompt_lengths())
    return t


def _question_mask(question_length, real: torch.Tensor, prefix: int) -> torch.Tensor:
    """``[B, N]`` bool: the last ``question_length`` real prompt tokens of each row (an int for every row, or one per
    row; rows repeated when generate expanded the batch)."""
    B, N = real.shape
    q = torch.as_tensor(question_length)
    if q.dtype.is_floating_point or q.dtype == torch.bool or q.is_complex() or q.dim() > 1:
        raise TypeError(f"question_length must be an int or one int per row, got {question_length!r}")
    q = q.to(device=real.device, dtype=torch.long).reshape(-1).expand(B) if q.dim() == 0 else q.to(real.device)
    if q.numel() == 0 or B % q.numel():
        raise ValueError(f"question_length must be an int or have one entry per row ({B}), got {q.numel()} entries")
    q = q.repeat_interleave(B // q.numel())
    in_prompt = real & (torch.arange(N, device=real.device) < prefix)
    n_prompt = in_prompt.sum(1)
    if bool((q < 0).any()) or bool((q > n_prompt).any()):
        raise ValueError(f"question_length {q.tolist()} must be between 0 and each row's real prompt length "
                         f"{n_prompt.tolist()}: the question is a suffix of the prompt")
    return in_prompt & (in_prompt.flip(1).cumsum(1).flip(1) <= q[:, None])


def warn_over_budget(schedule: ResolvedSchedule, tokens: Tokens) -> None:
    """A budget that protected tokens kept from being met is reported, not silently exceeded."""
    if schedule.keep_tokens is None:
        return
    over = [n for n in tokens.prompt_lengths() if n > schedule.keep_tokens]
    if over:
        logger.warning("hf_tokred: keep_tokens=%d was exceeded (%s tokens kept in %d row(s)) because more tokens "
                       "than that are protected (the last token, the question, protected_mask, protect_recent); "
                       "protect fewer, or raise keep_tokens", schedule.keep_tokens, max(over), len(over))
