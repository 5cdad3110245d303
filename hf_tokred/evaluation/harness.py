"""Zero-shot evaluation of a (token-reducing) Mamba / Mamba-2 model with lm-eval-harness 0.4.13.

:class:`ReducingHFLM` (``lm_class()``; built lazily because lm-eval is optional) is lm-eval's ``HFLM`` built
from an in-memory model object and tokenizer, with ``_loglikelihood_tokens`` replaced by a position-correct
version.  (Overriding only ``_model_call`` is not enough: it receives just the right-padded batch, padded with
token id 0 -- a real token, NeoX's ``<|endoftext|>`` -- so neither the rows' real lengths nor their
continuation lengths can be recovered there.)  What it does:

* every request row is right-padded and sent with an ``attention_mask`` (padding never takes part in
  reduction, and each row's reduction depends only on its own tokens);
* the positions whose logits are scored -- the last context token and every continuation token except the
  final one (which is not part of the input) -- are passed as ``protected_mask``, so the reducing model
  cannot remove them;
* the scored log-probabilities are read at those exact input positions (the reducing model returns logits
  aligned with the input, NaN where a position was removed), and the harness raises
  :class:`UncomputedPositionError` if any scored position was not computed or is not finite.

The reference implementation (method.md (e)) instead kept lm-eval's slice ``logits[inplen-contlen:inplen]``
of a *shortened* output and truncated the labels to the number of logits left ("the label logits are reduced
to their first 1-m%").  That is only right when every removed token lies before the continuation; with
content-dependent selection (ToMe/PuMer, EViT, paper-faithful UTRC) removed tokens can fall inside the
continuation or the padding, and the scored logits belonged to other positions.  Here no scored position can
be removed, and the continuation is never truncated.  Requests are ordered, batched and cached
(one-token-continuation grouping) exactly as lm-eval does; the grouping is safe because all requests of a
group share the same input tokens, and the protection covers the longest continuation of the group (each
member then reads its own trailing positions).  The reference also derived the number of removed tokens from
the padded batch length, so a request's score depended on its batch; here each row is reduced according to
its own real length only.

Beyond lm-eval's metrics the harness measures:

* the FLOPs reduction of the forwards it actually ran -- the analytic figure of :mod:`hf_tokred.flops`
  (``1 - sum reduced / sum dense`` over all rows, real tokens only, LM head on the kept positions) and the
  paper's proxy (``1 - sum_rows sum_layers len / sum_rows (layers * dense_len)``), per task and overall;
* fidelity on held-out BoolQ passages: top-1 agreement with the dense model's next-token prediction and
  the mean ``KL(dense || reduced)`` of the next-token distribution (nats), over the positions computed by
  both (no protection beyond the last token, i.e. the reduction as it would run in a prefill).
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import re
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..config import TokenReductionConfig, setting_text
from ..models import weights_fingerprint
from ..flops import model_flops
from ..patch import apply_token_reduction, get_token_reduction
from . import data as data_mod
from .tasks import LOCAL_TASKS, helpers, write_task_configs

__all__ = [
    "ALL_TASKS",
    "DEFAULT_TASKS",
    "ONLINE_TASKS",
    "OPTIONAL_COLUMNS",
    "ROW_COLUMNS",
    "FlopsMeter",
    "UncomputedPositionError",
    "evaluate_model",
    "format_row",
    "heldout_fidelity",
    "lm_class",
    "method_label",
    "paper_row",
    "reduction_disabled",
    "save_results",
]

DEFAULT_TASKS = ("lambada_openai", "hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande")
ONLINE_TASKS = ("lambada_openai",)
ALL_TASKS = tuple(dict.fromkeys(DEFAULT_TASKS + LOCAL_TASKS))
SCHEMA = "hf_tokred.eval/1"

log = logging.getLogger(__name__)


class UncomputedPositionError(RuntimeError):
    """A position whose logits were to be scored was removed by token reduction (or is not finite)."""


@contextlib.contextmanager
def reduction_disabled(model):
    """Run ``model`` dense inside the block (its token_reduction settings are restored afterwards)."""
    cfg = get_token_reduction(model)
    apply_token_reduction(model, None)
    try:
        yield model
    finally:
        if cfg is not None:
            apply_token_reduction(model, cfg)


def data_parallel_accelerator(cpu: bool | None = None):
    """accelerate's ``Accelerator`` when this process is one of several data-parallel workers, else ``None``.

    Launchers (``accelerate launch --multi_gpu``, ``torchrun``) set ``WORLD_SIZE`` > 1; each process then scores
    its own share of every task's documents (and of the held-out passages) and rank 0 gathers the results.
    ``cpu`` (default: when CUDA is unavailable) selects the gloo backend, so this runs on CPU machines too.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cpu = (not torch.cuda.is_available()) if cpu is None else cpu
    return Accelerator(cpu=cpu, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(hours=24))])


def _check_placement(model, accelerator) -> None:
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        raise ValueError("data-parallel evaluation (several launched processes) cannot be combined with a model "
                         "spread by device_map; launch one process, or load the whole model on each process's device")
    have, want = next(model.parameters()).device, accelerator.device
    if have.type != want.type or (want.type != "cpu" and have.index != want.index):
        raise ValueError(f"process {accelerator.process_index} of a data-parallel launch has its model on {have}, "
                         f"expected {want}: move it with model.to(accelerator.device) before evaluating")


# ----------------------------------------------------------------------------- FLOPs of what ran


def row_layer_lengths(out, real_lengths: Sequence[int], num_layers: int) -> list[list[int]]:
    """Tokens each block processed, per row, from a forward's ``plans`` (dense: ``real_lengths`` everywhere).

    An anchor block still sees its full input; the blocks after anchor ``a`` see ``keep_mask.sum()`` of the
    plan made at ``a``.
    """
    lengths = [[int(n)] * num_layers for n in real_lengths]
    for anchor, plan in getattr(out, "plans", None) or ():
        kept = plan.keep_mask.sum(1).tolist()
        for row, k in enumerate(kept):
            for layer in range(anchor + 1, num_layers):
                lengths[row][layer] = int(k)
    return lengths


class FlopsMeter:
    """Accumulates analytic and proxy FLOPs of the forwards that ran, grouped by task."""

    def __init__(self, config):
        self.config = config
        self.layers = config.num_hidden_layers
        self._cache: dict[tuple[int, ...], int] = {}
        # per group: dense flops, reduced flops, dense token-layers, reduced token-layers, rows, tokens
        self._acc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0, 0])

    def _flops(self, lengths: tuple[int, ...]) -> int:
        if lengths not in self._cache:
            self._cache[lengths] = model_flops(self.config, lengths).total
        return self._cache[lengths]

    def add(self, group: str, lengths_per_row: Iterable[Sequence[int]]) -> None:
        acc = self._acc[group]
        for lengths in lengths_per_row:
            n = lengths[0]
            acc[0] += self._flops((n,) * self.layers)
            acc[1] += self._flops(tuple(lengths))
            acc[2] += n * self.layers
            acc[3] += sum(lengths)
            acc[4] += 1
            acc[5] += n

    def state(self) -> dict[str, list[int]]:
        return {k: list(v) for k, v in self._acc.items()}

    def merge(self, state: dict[str, Sequence[int]]) -> None:
        """Add another meter's :meth:`state` (e.g. gathered from another data-parallel process)."""
        for group, values in state.items():
            acc = self._acc[group]
            for i, v in enumerate(values):
                acc[i] += v

    @staticmethod
    def _summary(acc: Sequence[int]) -> dict[str, Any]:
        dense, reduced, dense_tl, reduced_tl, rows, tokens = acc
        return {
            "exact": 1.0 - reduced / dense if dense else float("nan"),
            "proxy": 1.0 - reduced_tl / dense_tl if dense_tl else float("nan"),
            "rows": rows,
            "tokens": tokens,
            "dense_flops": dense,
            "reduced_flops": reduced,
        }

    def summary(self, groups: Iterable[str] | None = None) -> dict[str, Any]:
        keys = list(self._acc) if groups is None else [g for g in groups if g in self._acc]
        total = [sum(self._acc[k][i] for k in keys) for i in range(6)]
        return {**self._summary(total), "per_task": {k: self._summary(self._acc[k]) for k in sorted(keys)}}


# ----------------------------------------------------------------------------- the lm-eval model


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


def _hflm_class():
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils import Collator

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
            return self._without_padding(requests, lambda r: super(ReducingHFLM, self).loglikelihood(
                r, disable_tqdm=disable_tqdm))

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            names = sorted({req.task_name for req in requests if req.task_name})
            self._rolling_task = "+".join(names) or "loglikelihood_rolling"

            def run(reqs):
                # HFLM pads each rank's perplexity windows to the longest rank's count (lock-step for DDP/FSDP);
                # our forwards hold no collectives, so every rank runs just its own windows
                world, self._world_size = self._world_size, 1
                try:
                    return super(ReducingHFLM, self).loglikelihood_rolling(reqs, disable_tqdm=disable_tqdm)
                finally:
                    self._world_size = world

            return self._without_padding(requests, run)

        def _model_call(self, inps, attn_mask=None, labels=None):
            # Only lm-eval's batch-size probing reaches this; scoring goes through _loglikelihood_tokens.
            with torch.no_grad():
                return self.model(inps, attention_mask=torch.ones_like(inps), use_cache=False).logits

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
            reducing = get_token_reduction(self.model) is not None
            max_len = self.max_length
            # requests sharing ctx+cont[:-1] share one forward (lm-eval's one-token-continuation cache):
            # protect the longest continuation of each group
            longest: dict[tuple[int, ...], int] = {}
            for _, ctx, cont in requests:
                key = tuple(ctx + cont[:-1])
                longest[key] = max(longest.get(key, 0), len(cont))

            def _collate(req):
                toks = req[1] + req[2]
                return -len(toks), tuple(toks)

            re_ord = Collator(requests, sort_fn=_collate, group_by="contexts" if self.logits_cache else None,
                              group_fn=lambda req: req[-2] + req[-1][:-1])
            pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            res = []
            pbar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                        desc="loglikelihood (position-checked)")
            for chunk in re_ord.get_batched(n=self.batch_size, batch_fn=None):
                rows = []
                for _, ctx, cont in chunk:
                    assert len(ctx) > 0 and len(cont) > 0, "empty context or continuation"
                    if len(cont) > max_len:
                        raise ValueError(f"a continuation of {len(cont)} tokens exceeds max_length={max_len}; use a larger "
                                         "max_length (hf-tokred eval --max-length)")
                    inp = (ctx + cont)[-(max_len + 1):][:-1]
                    k = longest[tuple(ctx + cont[:-1])] if self.logits_cache else len(cont)
                    rows.append((inp, min(k, len(inp))))
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
                if reducing:
                    kwargs["protected_mask"] = scored
                with torch.no_grad():
                    out = self.model(**kwargs)
                logits = out.logits
                computed = getattr(out, "computed_mask", None)
                if computed is None:
                    computed = attn.bool()
                missed = scored & ~computed
                if bool(missed.any()):
                    row, pos = (int(x) for x in missed.nonzero()[0])
                    raise UncomputedPositionError(
                        f"{int(missed.sum())} scored position(s) were not computed by the model (first: row {row}, "
                        f"position {pos}); the scored logits would belong to other positions"
                    )
                lengths = row_layer_lengths(out, [len(inp) for inp, _ in rows], self.flops.layers)
                for req, ls in zip(chunk, lengths):
                    group = self._rolling_task if req[0] is None else self._task_of.get(tuple(req[0]), "unattributed")
                    self.flops.add(group, [ls])
                s = self.scoring
                s["rows"] += B
                s["scored_positions"] += int(scored.sum())
                s["real_tokens"] += int(attn.sum())
                s["computed_tokens"] += int((computed & attn.bool()).sum())

                for i, (req, (inp, k)) in enumerate(zip(chunk, rows)):
                    n = len(inp)
                    logp = F.log_softmax(logits[i, n - k:n].float(), dim=-1)  # [k, V]
                    if not bool(torch.isfinite(logp).all()):
                        raise UncomputedPositionError(
                            f"non-finite log-probabilities at scored positions {n - k}..{n - 1} of a request"
                        )
                    for request_str, cont_toks, lp in re_ord.get_cache(
                        req_str=req[0], cxt_toks=req[1], cont_toks=req[2], logits=logp.unsqueeze(0)
                    ):
                        c = torch.tensor(cont_toks, dtype=torch.long, device=lp.device)
                        sel = lp[:, -len(cont_toks):]  # [1, len(cont), V]
                        answer = (float(sel.gather(2, c[None, :, None]).sum()), bool((sel.argmax(-1) == c).all()))
                        res.append(answer)
                        if request_str is not None:
                            self.cache_hook.add_partial("loglikelihood", request_str, answer)
                        pbar.update(1)
            pbar.close()
            return re_ord.get_original(res)

    return ReducingHFLM


_LM_CLASS = None


def lm_class():
    """The :class:`ReducingHFLM` class (built on first use: lm-eval is optional and slow to import)."""
    global _LM_CLASS
    if _LM_CLASS is None:
        _LM_CLASS = _hflm_class()
    return _LM_CLASS


def __getattr__(name):
    if name == "ReducingHFLM":
        return lm_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------- held-out fidelity


def heldout_fidelity(model, tokenizer, passages: Sequence[str], batch_size: int = 8, max_length: int = 2048,
                     progress: bool = True, meter: FlopsMeter | None = None) -> dict[str, Any]:
    """Top-1 agreement and mean KL(dense || reduced) of next-token distributions on ``passages``.

    Each passage is ``[bos/eos] + tokens`` (truncated to ``max_length``), right-padded in batches with an
    attention mask.  Compared positions: real positions the reduced model computed (the dense model computes
    all).  A dense model gives agreement 1 and KL 0 without running.
    """
    return _fidelity_result(_fidelity_sums(model, tokenizer, passages, batch_size, max_length, progress, meter))


def _fidelity_sums(model, tokenizer, passages, batch_size, max_length, progress, meter) -> dict[str, Any]:
    """The additive parts of :func:`heldout_fidelity` (data-parallel ranks each sum their own passages)."""
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    seqs = []
    for text in passages:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        seqs.append(([prefix] if prefix is not None else []) + list(ids))
    seqs = [s[:max_length] for s in seqs if len(s) >= 2]
    sums = {"passages": len(seqs), "positions_total": sum(len(s) for s in seqs), "agree": 0.0, "kl": 0.0,
            "compared": 0, "dense": get_token_reduction(model) is None}
    if sums["dense"]:
        return sums
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    for start in tqdm(range(0, len(order), batch_size), disable=not progress, desc="held-out fidelity"):
        batch = [seqs[i] for i in order[start:start + batch_size]]
        B, N = len(batch), max(len(s) for s in batch)
        ids = torch.full((B, N), pad_id, dtype=torch.long)
        attn = torch.zeros(B, N, dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, :len(s)] = torch.tensor(s)
            attn[i, :len(s)] = 1
        ids, attn = ids.to(device), attn.to(device)
        with torch.no_grad():
            red = model(input_ids=ids, attention_mask=attn, use_cache=False)
            with reduction_disabled(model):
                dense = model(input_ids=ids, attention_mask=attn, use_cache=False)
        if meter is not None:
            meter.add("heldout_fidelity", row_layer_lengths(red, [len(s) for s in batch], meter.layers))
        mask = attn.bool() & red.computed_mask
        lr = F.log_softmax(red.logits[mask].float(), -1)
        ld = F.log_softmax(dense.logits[mask].float(), -1)
        sums["kl"] += float((ld.exp() * (ld - lr)).sum(-1).double().sum())
        sums["agree"] += float((ld.argmax(-1) == lr.argmax(-1)).sum())
        sums["compared"] += int(mask.sum())
    return sums


def _fidelity_result(*parts: dict[str, Any]) -> dict[str, Any]:
    """Combine :func:`_fidelity_sums` of one or several data-parallel shards into the reported columns."""
    total = {k: sum(p[k] for p in parts) for k in ("passages", "positions_total", "agree", "kl", "compared")}
    result = {"passages": total["passages"], "positions_total": total["positions_total"]}
    if all(p["dense"] for p in parts):
        return {**result, "top1_agreement": 1.0, "kl_mean": 0.0, "positions_compared": total["positions_total"],
                "note": "dense model: identical to itself by definition (not run)"}
    compared = total["compared"]
    return {**result, "top1_agreement": total["agree"] / compared if compared else float("nan"),
            "kl_mean": total["kl"] / compared if compared else float("nan"), "positions_compared": compared}


# ----------------------------------------------------------------------------- the paper-style row

#: (key, header, kind) of the paper-style row; kind: text | pct | ppl | num | int
ROW_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("model", "Model", "text"),
    ("method", "Method", "text"),
    ("flops_target", "FLOPs target", "pct"),
    ("flops_exact", "FLOPs red. (exact)", "pct"),
    ("flops_proxy", "FLOPs red. (proxy)", "pct"),
    ("lambada_ppl", "LAMBADA PPL", "ppl"),
    ("lambada_acc", "LAMBADA", "pct"),
    ("hellaswag_acc_norm", "HellaSwag", "pct"),
    ("piqa_acc", "PIQA", "pct"),
    ("arc_easy_acc", "Arc-E", "pct"),
    ("arc_challenge_acc_norm", "Arc-C", "pct"),
    ("winogrande_acc", "WinoGrande", "pct"),
    ("avg_acc", "Avg", "pct"),
    ("avg_tasks", "Avg over", "int"),
    ("heldout_suffix_ppl", "Held-out suffix PPL", "ppl"),
    ("heldout_ppl", "Held-out PPL", "ppl"),
    ("heldout_top1_agreement", "Held-out top-1 agr.", "pct"),
    ("heldout_kl", "Held-out KL", "num"),
)

#: accuracy columns of the paper: task -> (lm-eval metric, row key)
PAPER_ACC = {
    "lambada_openai": ("acc", "lambada_acc"),
    "hellaswag": ("acc_norm", "hellaswag_acc_norm"),
    "piqa": ("acc", "piqa_acc"),
    "arc_easy": ("acc", "arc_easy_acc"),
    "arc_challenge": ("acc_norm", "arc_challenge_acc_norm"),
    "winogrande": ("acc", "winogrande_acc"),
}


def method_label(cfg: TokenReductionConfig | dict | None) -> str:
    """``dense``, the method name, or the method with its non-default settings, e.g. ``utrc[metric=l1]``."""
    if cfg is None:
        return "dense"
    cfg = TokenReductionConfig.coerce(cfg)
    short = {"keep_ratio": "keep", "hidden_strategy": "hidden", "residual_strategy": "residual"}
    extra = [f"{short.get(k, k)}={setting_text(v, '-')}" for k, v in cfg.non_default_settings().items()]
    return cfg.method + (f"[{','.join(extra)}]" if extra else "")


def _metric(result: dict, task: str, metric: str) -> float:
    t = result.get("tasks", {}).get(task)
    if not t or t.get("status") != "ok":
        return float("nan")
    v = t.get("metrics", {}).get(metric)
    return float(v) if isinstance(v, (int, float)) else float("nan")


def paper_row(result: dict) -> dict[str, Any]:
    """The paper-style row of one result (accuracies as fractions; NaN where a task was not run / missing)."""
    row: dict[str, Any] = {
        "model": result.get("model"),
        "method": result.get("method"),
        "flops_target": result.get("flops_target"),
        "flops_exact": result.get("flops", {}).get("exact", float("nan")),
        "flops_proxy": result.get("flops", {}).get("proxy", float("nan")),
        "lambada_ppl": _metric(result, "lambada_openai", "perplexity"),
    }
    accs = []
    for task, (metric, key) in PAPER_ACC.items():
        row[key] = _metric(result, task, metric)
        if not math.isnan(row[key]):
            accs.append(row[key])
    row["avg_acc"] = sum(accs) / len(accs) if accs else float("nan")
    row["avg_tasks"] = len(accs)
    row["heldout_suffix_ppl"] = _metric(result, "boolq_heldout_suffix", "token_perplexity")
    row["heldout_ppl"] = _metric(result, "boolq_heldout_ppl", "token_perplexity")
    fid = result.get("fidelity") or {}
    row["heldout_top1_agreement"] = fid.get("top1_agreement", float("nan"))
    row["heldout_kl"] = fid.get("kl_mean", float("nan"))
    return row


def _fmt(value, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}"
    if kind == "ppl":
        return f"{value:.2f}"
    if kind == "num":
        return f"{value:.4f}"
    if kind == "int":
        return str(int(value))
    return str(value)


#: columns shown only when some row has a value (the paper's columns are always shown)
OPTIONAL_COLUMNS = ("heldout_suffix_ppl", "heldout_ppl", "heldout_top1_agreement", "heldout_kl")


def _empty(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def format_row(rows: dict | Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """A markdown table (header + one line per row); percentages for accuracies and FLOPs.

    ``columns`` (keys of :data:`ROW_COLUMNS`) defaults to the paper's columns plus the optional columns that
    have a value in some row.
    """
    rows = [rows] if isinstance(rows, dict) else list(rows)
    if columns is None:
        columns = [k for k, _, _ in ROW_COLUMNS
                   if k not in OPTIONAL_COLUMNS or any(not _empty(r.get(k)) for r in rows)]
    cols = [c for c in ROW_COLUMNS if c[0] in columns]
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(k), kind) for k, _, kind in cols) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- running and saving


def _check_tasks(tasks: Sequence[str]) -> list[str]:
    tasks = list(dict.fromkeys(t.strip() for t in tasks if t.strip()))
    unknown = [t for t in tasks if t not in ALL_TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; available: {', '.join(ALL_TASKS)}")
    if not tasks:
        raise ValueError(f"no task given; available: {', '.join(ALL_TASKS)}")
    return tasks


def _load_online_task(name: str):
    """lm-eval's own task YAML (loaded by path, without indexing every built-in task)."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    path = Path(lm_eval.tasks.__file__).parent / "lambada" / f"{name}.yaml"
    return TaskManager(include_defaults=False).load([str(path)])["tasks"][name]


def _collect_metrics(raw: dict) -> dict[str, Any]:
    out = {}
    for key, value in raw.items():
        if key in ("alias", "sample_len") or not isinstance(value, (int, float)):
            continue
        metric, _, filt = key.partition(",")
        out[metric if filt in ("none", "") else key] = float(value)
    return out


def _run_lm_eval(lm, loaded, limit, bootstrap_iters) -> dict:
    """``lm_eval.evaluator.evaluate`` with what ``simple_evaluate`` sets up for zero-shot runs (its seeds, 0-shot
    for tasks without a default), minus its environment probe (``pip list`` etc., seconds per run)."""
    import random

    import numpy as np
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
    from lm_eval.evaluator import evaluate

    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)
    for task in loaded["tasks"].values():
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
    with helpers.bind_lm(lm), torch.no_grad():
        return evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=bootstrap_iters, log_samples=False)


def evaluate_model(
    model,
    tokenizer,
    tasks: Sequence[str] = DEFAULT_TASKS,
    *,
    limit: int | None = None,
    batch_size: int = 8,
    max_length: int = 2048,
    data_dir: str | os.PathLike | None = None,
    output: str | os.PathLike | None = None,
    model_name: str | None = None,
    fidelity: bool = True,
    bootstrap_iters: int = 100,
    progress: bool = True,
    accelerator=None,
) -> dict[str, Any] | None:
    """Evaluate ``model`` (reduced or dense, as configured) on ``tasks``; returns the result dict.

    ``limit`` caps the documents per task (and the held-out passages for the fidelity columns).  When
    ``output`` is given, the result is saved there as JSON + CSV (see :func:`save_results`) and the task
    YAMLs used are kept in ``<output>/lm_eval_tasks/``.  ``lambada_openai`` that cannot be loaded (offline)
    is reported with ``status: "missing"`` and NaN metrics; nothing is substituted for it.

    Data parallel: under ``accelerate launch`` / ``torchrun`` with several processes (or with an
    ``accelerator`` of several processes), each process scores its share and rank 0 gathers everything and
    returns (and saves) the result; the other ranks return ``None``.  Each process's model must be on its
    ``accelerator.device``.
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = _check_tasks(tasks)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int (documents per task), got {limit!r}")
    local = [t for t in tasks if t in LOCAL_TASKS]
    root = data_mod.find_data(data_dir) if (local or fidelity) else None
    cfg = get_token_reduction(model)
    t0 = time.perf_counter()

    entries: dict[str, dict[str, Any]] = {}
    task_objs: list[Any] = []
    for name in tasks:
        if name in ONLINE_TASKS:
            try:
                task_objs.append(_load_online_task(name))
                entries[name] = {"status": "ok", "source": "lm-eval built-in task (Hugging Face Hub dataset)"}
            except Exception as err:  # noqa: BLE001 -- offline: OfflineModeIsEnabled, ConnectionError, no cache, ...
                entries[name] = {
                    "status": "missing", "metrics": {},
                    "note": (f"{name} could not be loaded ({type(err).__name__}: {str(err)[:300]}). LAMBADA is not "
                             "available offline; it is reported as missing and no other dataset is substituted."),
                }
        else:
            entries[name] = {"status": "ok", "source": str(data_mod.arrow_file(
                "boolq" if name.startswith("boolq_") else name, root))}

    tmp = None
    if output is not None:
        task_dir = Path(output) / "lm_eval_tasks"
    else:
        tmp = tempfile.TemporaryDirectory(prefix="hf_tokred_tasks_")
        task_dir = Path(tmp.name)
    raw: dict[str, Any] = {"results": {}, "n-samples": {}}
    if accelerator is None:
        accelerator = data_parallel_accelerator(cpu=next(model.parameters()).device.type == "cpu")
    lm = lm_class()(model, tokenizer, batch_size=batch_size, max_length=max_length, accelerator=accelerator)
    rank, world = lm.rank, lm.world_size
    try:
        task_dir.mkdir(parents=True, exist_ok=True)
        if local:
            write_task_configs(task_dir, local, root)
        manager = TaskManager(include_path=str(task_dir), include_defaults=False)
        if local or task_objs:
            raw = _run_lm_eval(lm, manager.load(local + task_objs), limit, bootstrap_iters)
    finally:
        if tmp is not None:
            tmp.cleanup()
    t_tasks = time.perf_counter() - t0

    fid = None
    if fidelity:
        passages = data_mod.heldout_passages(root)
        if limit is not None:
            passages = passages[:limit]
        fid = [_fidelity_sums(model, tokenizer, passages[rank::world], batch_size, max_length,
                              progress and rank == 0, lm.flops)]
    if world > 1:  # rank 0 gathers what every process measured (lm-eval already gathered the task metrics)
        parts = lm.gather_object({"flops": lm.flops.state(), "scoring": lm.scoring, "fidelity": fid})
        if rank != 0:
            lm.barrier()
            return None
        lm.flops = FlopsMeter(model.config)
        lm.scoring = {k: sum(p["scoring"][k] for p in parts) for k in lm.scoring}
        for part in parts:
            lm.flops.merge(part["flops"])
        fid = [f for p in parts for f in (p["fidelity"] or [])] or None
    fid = _fidelity_result(*fid) if fid else None
    for name, entry in entries.items():
        if entry["status"] == "ok":
            entry["metrics"] = _collect_metrics(raw["results"].get(name, {}))
            n = raw.get("n-samples", {}).get(name, {})
            entry["documents"] = n.get("effective", n.get("original"))
    ran = [g for g in lm.flops.summary()["per_task"] if g != "heldout_fidelity"]
    flops = lm.flops.summary(ran)
    if fid is not None and "heldout_fidelity" in lm.flops.summary()["per_task"]:
        fsum = lm.flops.summary(["heldout_fidelity"])
        fid["flops_exact"], fid["flops_proxy"] = fsum["exact"], fsum["proxy"]
    schedule = cfg.resolve(model.config.num_hidden_layers).to_dict() if cfg is not None else None

    import transformers

    from .. import __version__

    result = {
        "schema": SCHEMA,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__,
        "model_fingerprint": weights_fingerprint(model),
        "model_type": model.config.model_type,
        "num_hidden_layers": model.config.num_hidden_layers,
        "method": method_label(cfg),
        "token_reduction": cfg.to_dict() if cfg is not None else None,
        "flops_target": (cfg.flops_reduction if cfg is not None and cfg.flops_reduction is not None
                         else schedule["flops_reduction"] if schedule else 0.0),
        "schedule": schedule,
        "tasks": entries,
        "flops": {**flops, "note": "measured on the rows actually run (real tokens, per row, protection included)"},
        "fidelity": fid,
        "scoring": {**lm.scoring, "protection": "last context token + continuation positions (protected_mask)"},
        "settings": {"limit": limit, "batch_size": batch_size, "max_length": max_length,
                     "data_dir": str(root) if root else None, "bootstrap_iters": bootstrap_iters,
                     "versions": {"hf_tokred": __version__, "lm_eval": getattr(lm_eval, "__version__", "?"),
                                  "transformers": transformers.__version__, "torch": torch.__version__}},
        "timing_s": {"tasks": round(t_tasks, 3), "total": round(time.perf_counter() - t0, 3)},
        "processes": world,
    }
    result["row"] = paper_row(result)
    if output is not None:
        result["files"] = {k: str(v) for k, v in save_results(result, output).items()}
    lm.barrier()
    return result


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=_-]+", "-", str(text)).strip("-") or "x"


def result_stem(result: dict) -> str:
    target = result.get("flops_target") or 0.0
    return _slug(f"eval_{result['model']}_{result['method']}_flops{100 * target:.4g}")


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def save_results(result: dict, output: str | os.PathLike) -> dict[str, Path]:
    """Write ``<output>/<stem>.json`` (everything; NaN as null) and ``<stem>.csv`` (the paper-style row)."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem(result)
    paths = {"json": out / f"{stem}.json", "csv": out / f"{stem}.csv"}
    result = {**result, "files": {k: str(v) for k, v in paths.items()}}
    paths["json"].write_text(json.dumps(_json_safe(result), indent=1, sort_keys=False) + "\n")
    row = paper_row(result)
    with paths["csv"].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([k for k, _, _ in ROW_COLUMNS])
        w.writerow(["" if (isinstance(row[k], float) and math.isnan(row[k])) or row[k] is None else row[k]
                    for k, _, _ in ROW_COLUMNS])
    return paths
