"""``evaluate_model``: lm-eval tasks, held-out fidelity and measured FLOPs of one (reduced or dense) model.

Data parallel: under ``accelerate launch`` / ``torchrun`` with several processes each process scores its share
of every task's documents and of the held-out passages, and rank 0 gathers metrics, FLOPs counts and fidelity
sums.  lm-eval sets up data parallelism only when it builds the model from a path; the position-correct adapter
passes it a model object, so the set-up happens here (rank, world size, accelerate's gather).
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from ..models import weights_fingerprint
from ..settings import get_token_reduction, resolve_schedule
from ..version import __version__
from . import data as data_mod
from .fidelity import fidelity_result, fidelity_sums
from .lm import ReducingHFLM
from .meter import FlopsMeter
from .mqar import MQARSettings
from .quality import mqar_accuracy
from .results import SCHEMA, method_label, paper_row, save_results
from .tasks import LOCAL_TASKS, write_task_configs

try:  # optional dependency (pip install 'hf-tokred[eval]')
    import lm_eval
    import lm_eval.tasks as lm_eval_tasks
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
    from lm_eval.evaluator import evaluate as lm_eval_evaluate
    from lm_eval.tasks import TaskManager

    from .tasks import helpers
except ImportError:  # pragma: no cover - exercised by the no-lm-eval test in a subprocess
    lm_eval = None

__all__ = ["ALL_TASKS", "DEFAULT_TASKS", "ONLINE_TASKS", "data_parallel_accelerator", "evaluate_model"]

DEFAULT_TASKS = ("lambada_openai", "hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande")
ONLINE_TASKS = ("lambada_openai",)
#: tasks hf_tokred scores itself (not through lm-eval)
OWN_TASKS = ("mqar",)
ALL_TASKS = tuple(dict.fromkeys(DEFAULT_TASKS + LOCAL_TASKS + OWN_TASKS))


def data_parallel_accelerator(cpu: bool | None = None):
    """accelerate's ``Accelerator`` when this process is one of several data-parallel workers, else ``None``.

    Launchers (``accelerate launch --multi_gpu``, ``torchrun``) set ``WORLD_SIZE`` > 1; ``cpu`` (default: when
    CUDA is unavailable) selects the gloo backend, so this runs on CPU machines too.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    cpu = (not torch.cuda.is_available()) if cpu is None else cpu
    return Accelerator(cpu=cpu, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(hours=24))])


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
    path = Path(lm_eval_tasks.__file__).parent / "lambada" / f"{name}.yaml"
    return TaskManager(include_defaults=False).load([str(path)])["tasks"][name]


def _task_entries(tasks: Sequence[str], root) -> tuple[dict[str, dict[str, Any]], list[Any]]:
    """Per task: where its data comes from (or why it is missing), and the loaded online task objects."""
    entries: dict[str, dict[str, Any]] = {}
    online: list[Any] = []
    for name in tasks:
        if name in OWN_TASKS:
            continue
        if name not in ONLINE_TASKS:
            entries[name] = {"status": "ok", "source": str(data_mod.arrow_file(
                "boolq" if name.startswith("boolq_") else name, root))}
            continue
        try:
            online.append(_load_online_task(name))
            entries[name] = {"status": "ok", "source": "lm-eval built-in task (Hugging Face Hub dataset)"}
        except Exception as err:  # noqa: BLE001 -- offline: OfflineModeIsEnabled, ConnectionError, no cache, ...
            entries[name] = {
                "status": "missing", "metrics": {},
                "note": (f"{name} could not be loaded ({type(err).__name__}: {str(err)[:300]}). LAMBADA is not "
                         "available offline; it is reported as missing and no other dataset is substituted."),
            }
    return entries, online


def mqar_settings(model) -> MQARSettings:
    """The MQAR setting a model was trained on (``config.mqar``, written by ``examples/train_recall.py``), else
    the benchmark default; refuses a model whose vocabulary cannot hold its tokens."""
    saved = getattr(model.config, "mqar", None)
    settings = MQARSettings(**saved) if saved else MQARSettings()
    if model.config.vocab_size < settings.vocab_size:
        raise ValueError(f"the mqar task needs a model trained on multi-query associative recall (vocabulary of at "
                         f"least {settings.vocab_size} tokens, config.mqar); this model has vocab_size="
                         f"{model.config.vocab_size}. Use a recall model, e.g. --model bundled:recall-mamba2")
    return settings


def _mqar_entry(model, limit: int | None, meter) -> dict[str, Any]:
    settings = mqar_settings(model)
    result = mqar_accuracy(model, settings, n=limit or 256, meter=meter)
    acc, low, high = result["accuracy"]
    return {"status": "ok", "source": f"hf_tokred.evaluation.mqar {settings.to_dict()} (seed 1000000)",
            "metrics": {"acc": acc, "acc_ci_low": low, "acc_ci_high": high,
                        "computed_share": result["computed_share"]}, "documents": result["sequences"]}


def _collect_metrics(raw: dict) -> dict[str, Any]:
    out = {}
    for key, value in raw.items():
        if key in ("alias", "sample_len") or not isinstance(value, (int, float)):
            continue
        metric, _, filt = key.partition(",")
        out[metric if filt in ("none", "") else key] = float(value)
    return out


def _run_lm_eval(lm, local, online, root, output, limit, bootstrap_iters) -> dict:
    """``lm_eval.evaluator.evaluate`` with what ``simple_evaluate`` sets up for zero-shot runs (its seeds, 0-shot
    for tasks without a default), minus its environment probe (``pip list`` etc., seconds per run)."""
    if not (local or online):
        return {"results": {}, "n-samples": {}}
    with tempfile.TemporaryDirectory(prefix="hf_tokred_tasks_") as tmp:
        task_dir = Path(output) / "lm_eval_tasks" if output is not None else Path(tmp)
        task_dir.mkdir(parents=True, exist_ok=True)
        if local:
            write_task_configs(task_dir, local, root)
        loaded = TaskManager(include_path=str(task_dir), include_defaults=False).load(local + online)
        random.seed(DEFAULT_RANDOM_SEED)
        np.random.seed(DEFAULT_OTHER_SEED)
        torch.manual_seed(DEFAULT_OTHER_SEED)
        for task in loaded["tasks"].values():
            if task.get_config("num_fewshot") is None:
                task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
        with helpers.bind_lm(lm), torch.no_grad():
            return lm_eval_evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=bootstrap_iters,
                                    log_samples=False)


def _gather(lm, model, fid):
    """Rank 0 collects what every process measured (lm-eval already gathered the task metrics); other ranks
    get ``None``."""
    parts = lm.gather_object({"flops": lm.flops.state(), "scoring": lm.scoring, "fidelity": fid})
    if lm.rank != 0:
        lm.barrier()
        return None
    lm.flops = FlopsMeter(model.config)
    lm.scoring = {k: sum(p["scoring"][k] for p in parts) for k in lm.scoring}
    for part in parts:
        lm.flops.merge(part["flops"])
    return [f for p in parts for f in (p["fidelity"] or [])] or None


def _result(model, model_name, cfg, entries, lm, fid, settings, timing) -> dict[str, Any]:
    ran = [g for g in lm.flops.summary()["per_task"] if g != "heldout_fidelity"]
    if fid is not None and "heldout_fidelity" in lm.flops.summary()["per_task"]:
        fsum = lm.flops.summary(["heldout_fidelity"])
        fid["flops_exact"], fid["flops_proxy"] = fsum["exact"], fsum["proxy"]
    schedule = resolve_schedule(cfg, model.config).to_dict() if cfg is not None else None
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
        "flops": {**lm.flops.summary(ran),
                  "note": "measured on the rows actually run (real tokens, per row, protection included)"},
        "fidelity": fid,
        "scoring": {**lm.scoring, "protection": "last context token + continuation positions (protected_mask)"},
        "settings": {**settings, "versions": {"hf_tokred": __version__, "lm_eval": getattr(lm_eval, "__version__", "?"),
                                              "transformers": transformers.__version__, "torch": torch.__version__}},
        "timing_s": timing,
        "processes": lm.world_size,
    }
    result["row"] = paper_row(result)
    return result


def evaluate_model(model, tokenizer, tasks: Sequence[str] = DEFAULT_TASKS, *, limit: int | None = None,
                   batch_size: int = 8, max_length: int = 2048, data_dir: str | os.PathLike | None = None,
                   output: str | os.PathLike | None = None, model_name: str | None = None, fidelity: bool = True,
                   bootstrap_iters: int = 100, progress: bool = True, accelerator=None) -> dict[str, Any] | None:
    """Evaluate ``model`` (reduced or dense, as configured) on ``tasks``; returns the result dict.

    ``limit`` caps the documents per task (and the held-out passages for the fidelity columns).  When
    ``output`` is given, the result is saved there as JSON + CSV (see :func:`~.results.save_results`) and the
    task YAMLs used are kept in ``<output>/lm_eval_tasks/``.  ``lambada_openai`` that cannot be loaded (offline)
    is reported with ``status: "missing"`` and NaN metrics; nothing is substituted for it.  In a data-parallel
    launch the other ranks return ``None`` (rank 0 returns and saves the result); each process's model must be
    on its ``accelerator.device``.
    """
    if lm_eval is None:
        raise ImportError("evaluate_model needs lm-eval: pip install 'lm-eval==0.4.13' (or 'hf-tokred[eval]')")
    tasks = _check_tasks(tasks)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int (documents per task), got {limit!r}")
    local = [t for t in tasks if t in LOCAL_TASKS]
    root = data_mod.find_data(data_dir) if (local or fidelity) else None
    cfg = get_token_reduction(model)
    t0 = time.perf_counter()
    entries, online = _task_entries(tasks, root)
    if accelerator is None:
        accelerator = data_parallel_accelerator(cpu=next(model.parameters()).device.type == "cpu")
    lm = ReducingHFLM(model, tokenizer, batch_size=batch_size, max_length=max_length, accelerator=accelerator)
    raw = _run_lm_eval(lm, local, online, root, output, limit, bootstrap_iters)
    if "mqar" in tasks:
        entries["mqar"] = _mqar_entry(model, limit, lm.flops)
    t_tasks = time.perf_counter() - t0
    fid = None
    if fidelity:
        passages = data_mod.heldout_passages(root)[:limit]
        fid = [fidelity_sums(model, tokenizer, passages[lm.rank::lm.world_size], batch_size, max_length,
                             progress and lm.rank == 0, lm.flops)]
    if lm.world_size > 1:
        fid = _gather(lm, model, fid)
        if lm.rank != 0:
            return None
    fid = fidelity_result(*fid) if fid else None
    for name, entry in entries.items():
        if entry["status"] == "ok" and name not in OWN_TASKS:
            entry["metrics"] = _collect_metrics(raw["results"].get(name, {}))
            n = raw.get("n-samples", {}).get(name, {})
            entry["documents"] = n.get("effective", n.get("original"))
    settings = {"limit": limit, "batch_size": batch_size, "max_length": max_length,
                "data_dir": str(root) if root else None, "bootstrap_iters": bootstrap_iters}
    result = _result(model, model_name, cfg, entries, lm, fid, settings,
                     {"tasks": round(t_tasks, 3), "total": round(time.perf_counter() - t0, 3)})
    if output is not None:
        result["files"] = {k: str(v) for k, v in save_results(result, output).items()}
    lm.barrier()
    return result
