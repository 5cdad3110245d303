"""lm-eval-harness 0.4.13 over an in-memory (possibly token-reducing) model, with position-correct scoring.

:class:`ReducingHFLM` is lm-eval's ``HFLM`` built from a model object and tokenizer, with
``_loglikelihood_tokens`` replaced by a position-correct version.  (Overriding only ``_model_call`` is not enough:
it receives just the right-padded batch, padded with the last token, so it cannot tell real from padded positions
or protect the scored ones.)  Each request's scored positions -- the last context token and the continuation --
are protected from reduction, so every scored logit is one the model computed at that position; a scored
position that was not computed raises :class:`UncomputedPositionError`.

lm-eval is an optional dependency (``pip install 'hf-tokred[eval]'``): without it this module still imports, and
:data:`ReducingHFLM` is ``None``.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..settings import get_token_reduction
from .meter import FlopsMeter, row_layer_lengths

try:  # optional dependency: the adapter exists only where lm-eval is installed
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils import Collator
except ImportError:  # pragma: no cover - exercised by the no-lm-eval test in a subprocess
    HFLM = Collator = None

__all__ = ["ReducingHFLM", "UncomputedPositionError", "lm_eval_available"]


class UncomputedPositionError(RuntimeError):
    """A position whose logits were to be scored was removed by token reduction (or is not finite)."""


def lm_eval_available() -> bool:
    return HFLM is not None


def _lm_eval_quiet():
    return _LoggerLevel("lm_eval", logging.ERROR)


class _LoggerLevel(contextlib.ContextDecorator):
    def __init__(self, name, level):
        self.logger, self.level = logging.getLogger(name), level

    def __enter__(self):
        self.old = self.logger.level
        self.logger.setLevel(self.level)

    def __exit__(self, *exc):
        self.logger.setLevel(self.old)


def _check_placement(model, accelerator) -> None:
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        raise ValueError("data-parallel evaluation (several launched processes) cannot be combined with a model "
                         "spread by device_map; launch one process, or load the whole model on each process's device")
    have, want = next(model.parameters()).device, accelerator.device
    if have.type != want.type or (want.type != "cpu" and have.index != want.index):
        raise ValueError(f"process {accelerator.process_index} of a data-parallel launch has its model on {have}, "
                         f"expected {want}: move it with model.to(accelerator.device) before evaluating")


if HFLM is None:
    ReducingHFLM = None
else:

    class ReducingHFLM(HFLM):
        """lm-eval ``HFLM`` over an in-memory (possibly token-reducing) model, with position-correct scoring.

        ``lm.flops`` (a :class:`FlopsMeter`) and ``lm.scoring`` (counts) describe the forwards that ran.
        """

        def __init__(self, model, tokenizer, batch_size: int = 8, max_length: int = 2048, logits_cache: bool = True,
                     accelerator=None):
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
                raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
            with _lm_eval_quiet():
                super().__init__(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size,
                                 max_length=max_length, logits_cache=logits_cache)
            if accelerator is not None and accelerator.num_processes > 1:
                # HFLM skips its data-parallel set-up for a model object; this is that set-up (lm-eval's evaluate()
                # then gives each rank its share of the documents and gathers the metrics on rank 0)
                _check_placement(model, accelerator)
                self.accelerator = accelerator
                self._device = accelerator.device
                self._rank, self._world_size = accelerator.process_index, accelerator.num_processes
            self.flops = FlopsMeter(model.config)
            self.scoring = {"rows": 0, "scored_positions": 0, "real_tokens": 0, "computed_tokens": 0}
            self._task_of: dict[tuple[str, str], str] = {}
            self._rolling_task = "loglikelihood_rolling"

        def get_model_info(self) -> dict:
            p = next(self.model.parameters())
            return {"model_num_parameters": sum(x.numel() for x in self.model.parameters()),
                    "model_dtype": str(p.dtype), "token_reduction": getattr(self.model.config, "token_reduction", None)}

        # --- task attribution for the FLOPs meter (lm-eval sends all tasks' requests in one call)
        def _without_padding(self, requests, run):
            """lm-eval pads a data-parallel rank's requests with extra copies of its last one (so all ranks run
            equally many); run only the real ones, so the FLOPs meter and counts see each request once."""
            pad = 0
            if self.world_size > 1 and requests:
                last, same = requests[-1], 0
                for req in reversed(requests):
                    if req is not last:
                        break
                    same += 1
                pad = max(0, same - max(1, int(getattr(last, "repeats", 1))))
            res = run(requests[:len(requests) - pad])
            return res + [res[-1]] * pad

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            for req in requests:
                self._task_of[tuple(req.args)] = req.task_name
            return self._without_padding(requests, lambda r: HFLM.loglikelihood(self, r, disable_tqdm=disable_tqdm))

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            names = sorted({req.task_name for req in requests if req.task_name})
            self._rolling_task = "+".join(names) or "loglikelihood_rolling"

            def run(reqs):
                # HFLM pads each rank's perplexity windows to the longest rank's count (lock-step for DDP/FSDP);
                # our forwards hold no collectives, so every rank runs just its own windows
                world, self._world_size = self._world_size, 1
                try:
                    return HFLM.loglikelihood_rolling(self, reqs, disable_tqdm=disable_tqdm)
                finally:
                    self._world_size = world

            return self._without_padding(requests, run)

        def _model_call(self, inps, attn_mask=None, labels=None):
            # Only lm-eval's batch-size probing reaches this; scoring goes through _loglikelihood_tokens.
            with torch.no_grad():
                return self.model(inps, attention_mask=torch.ones_like(inps), use_cache=False).logits

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
            # requests sharing ctx+cont[:-1] share one forward (lm-eval's one-token-continuation cache):
            # protect the longest continuation of each group
            longest: dict[tuple[int, ...], int] = {}
            for _, ctx, cont in requests:
                key = tuple(ctx + cont[:-1])
                longest[key] = max(longest.get(key, 0), len(cont))
            re_ord = Collator(requests, sort_fn=lambda req: (-len(req[1] + req[2]), tuple(req[1] + req[2])),
                              group_by="contexts" if self.logits_cache else None,
                              group_fn=lambda req: req[-2] + req[-1][:-1])
            res = []
            pbar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                        desc="loglikelihood (position-checked)")
            for chunk in re_ord.get_batched(n=self.batch_size, batch_fn=None):
                rows = [self._row(ctx, cont, longest) for _, ctx, cont in chunk]
                logits = self._scored_forward(chunk, rows)
                for i, (req, (inp, k)) in enumerate(zip(chunk, rows)):
                    for answer in self._answers(re_ord, req, logits[i], inp, k):
                        res.append(answer)
                        pbar.update(1)
            pbar.close()
            return re_ord.get_original(res)

        def _row(self, ctx, cont, longest) -> tuple[list[int], int]:
            """The input tokens of one request (left-truncated to max_length) and how many positions are scored."""
            if not ctx or not cont:
                raise ValueError("lm-eval sent a request with an empty context or continuation")
            if len(cont) > self.max_length:
                raise ValueError(f"a continuation of {len(cont)} tokens exceeds max_length={self.max_length}; use a "
                                 "larger max_length (hf-tokred eval --max-length)")
            inp = (ctx + cont)[-(self.max_length + 1):][:-1]
            k = longest[tuple(ctx + cont[:-1])] if self.logits_cache else len(cont)
            return inp, min(k, len(inp))

        def _scored_forward(self, chunk, rows) -> torch.Tensor:
            """One right-padded batch, scored positions protected; checks every scored position was computed and
            meters the FLOPs.  Returns the logits aligned with the input positions."""
            pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            B, N = len(rows), max(len(inp) for inp, _ in rows)
            ids = torch.full((B, N), pad_id, dtype=torch.long)
            attn = torch.zeros(B, N, dtype=torch.long)
            scored = torch.zeros(B, N, dtype=torch.bool)
            for i, (inp, k) in enumerate(rows):
                n = len(inp)
                ids[i, :n] = torch.tensor(inp, dtype=torch.long)
                attn[i, :n] = 1
                scored[i, n - k:n] = True  # logits at p predict token p+1: last ctx token .. cont[-2]
            ids, attn, scored = ids.to(self.device), attn.to(self.device), scored.to(self.device)
            kwargs = {"input_ids": ids, "attention_mask": attn, "use_cache": False}
            if get_token_reduction(self.model) is not None:
                kwargs["protected_mask"] = scored
            with torch.no_grad():
                out = self.model(**kwargs)
            computed = getattr(out, "computed_mask", None)
            computed = attn.bool() if computed is None else computed
            missed = scored & ~computed
            if bool(missed.any()):
                row, pos = (int(x) for x in missed.nonzero()[0])
                raise UncomputedPositionError(
                    f"{int(missed.sum())} scored position(s) were not computed by the model (first: row {row}, "
                    f"position {pos}); the scored logits would belong to other positions"
                )
            reals = [len(inp) for inp, _ in rows]
            lengths = row_layer_lengths(out, reals, self.flops.layers)
            for req, ls, n in zip(chunk, lengths, reals):
                group = self._rolling_task if req[0] is None else self._task_of.get(tuple(req[0]), "unattributed")
                self.flops.add(group, [ls], [n])
            s = self.scoring
            s["rows"] += B
            s["scored_positions"] += int(scored.sum())
            s["real_tokens"] += int(attn.sum())
            s["computed_tokens"] += int((computed & attn.bool()).sum())
            return out.logits

        def _answers(self, re_ord, req, logits, inp, k):
            """``(log-likelihood, is greedy)`` of each continuation served by one row (lm-eval's cache may serve
            several requests from one forward)."""
            n = len(inp)
            logp = F.log_softmax(logits[n - k:n].float(), dim=-1)  # [k, V]
            if not bool(torch.isfinite(logp).all()):
                raise UncomputedPositionError(f"non-finite log-probabilities at scored positions {n - k}..{n - 1} of a "
                                              "request")
            for request_str, cont_toks, lp in re_ord.get_cache(req_str=req[0], cxt_toks=req[1], cont_toks=req[2],
                                                               logits=logp.unsqueeze(0)):
                c = torch.tensor(cont_toks, dtype=torch.long, device=lp.device)
                sel = lp[:, -len(cont_toks):]  # [1, len(cont), V]
                answer = (float(sel.gather(2, c[None, :, None]).sum()), bool((sel.argmax(-1) == c).all()))
                if request_str is not None:
                    self.cache_hook.add_partial("loglikelihood", request_str, answer)
                yield answer
