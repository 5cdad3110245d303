"""``hf-tokred eval``: lm-eval accuracy / perplexity of a (reduced) model, the paper-style row, fidelity columns."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from ..evaluation import data
from ..evaluation.lm import lm_eval_available
from ..evaluation.results import format_row
from ..evaluation.runner import ALL_TASKS, data_parallel_accelerator, evaluate_model
from ..evaluation.tasks import LOCAL_TASKS
from .common import UsageError, add_model_argument, add_reduction_arguments, load_for_command, positive_int_text, \
    reduction_from_args
from .longctx import LONG_TASKS, is_long_run, run_long

__all__ = ["add_parser"]

_DEFAULT_TASKS = "lambada_openai,hellaswag,piqa,arc_easy,arc_challenge,winogrande"


def _parse_tasks(text: str) -> list[str]:
    tasks = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [t for t in tasks if t not in ALL_TASKS and t not in LONG_TASKS]
    if unknown or not tasks:
        what = f"unknown task(s) {', '.join(unknown)}" if unknown else "no task given"
        raise UsageError(f"--tasks: {what}; available: {', '.join(dict.fromkeys(ALL_TASKS + LONG_TASKS))} "
                         f"(comma-separated, e.g. --tasks arc_easy,piqa)")
    return tasks


def _eval(args: argparse.Namespace) -> int:
    tasks = _parse_tasks(args.tasks)
    if is_long_run(args, tasks):
        return run_long(args, tasks)
    limit = positive_int_text("--limit", args.limit, "100")
    batch_size = positive_int_text("--batch-size", args.batch_size, "8")
    max_length = positive_int_text("--max-length", args.max_length, "2048")
    cfg = reduction_from_args(args)

    needs_data = [t for t in tasks if t in LOCAL_TASKS]
    # the held-out fidelity columns compare English passages: not for a recall-only run
    fidelity = not args.no_fidelity and tasks != ["mqar"]
    if needs_data or fidelity:
        try:
            data.find_data(args.data_dir)
        except data.DataMissingError as err:
            why = (f"--tasks {','.join(needs_data)} read it" if needs_data
                   else "the held-out fidelity columns read it; or pass --no-fidelity")
            raise UsageError(f"{err} ({why}; or point --data-dir at an existing copy)") from None
    if not lm_eval_available():
        raise UsageError("`hf-tokred eval` needs lm-eval: pip install 'lm-eval==0.4.13' (or 'hf-tokred[eval]')")
    accelerator = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # accelerate launch / torchrun: one process per device
        if args.device_map is not None:
            raise UsageError("--device-map cannot be combined with a data-parallel launch (accelerate launch / "
                             "torchrun with several processes): run one process with --device-map for a model "
                             "that does not fit one device, or launch several processes without it")
        if args.device != "auto":
            raise UsageError(f"--device {args.device}: in a data-parallel launch each process uses its own device "
                             "(cuda:LOCAL_RANK, or cpu); leave --device at auto")
        accelerator = data_parallel_accelerator()
    dtype = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    extra = {"device_map": args.device_map} if args.device_map else {}
    model, tokenizer = load_for_command(args.model, cfg, dtype=dtype, **extra)
    if args.device_map is None:  # with --device-map, accelerate has already placed the blocks
        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        if accelerator is not None:
            device = accelerator.device
        try:
            model.to(device)
        except (RuntimeError, AssertionError) as err:
            raise UsageError(f"--device {args.device}: {err}") from None

    result = evaluate_model(
        model, tokenizer, tasks, limit=limit, batch_size=batch_size, max_length=max_length,
        data_dir=args.data_dir, output=args.output, model_name=args.model, fidelity=fidelity,
        bootstrap_iters=args.bootstrap_iters, accelerator=accelerator,
    )
    if result is None:  # a data-parallel worker other than rank 0: rank 0 prints and saves
        return 0
    for entry in result["tasks"].values():
        if entry["status"] != "ok":
            print(f"note: {entry['note']}", file=sys.stderr)
    if args.json:
        row = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in result["row"].items()}
        print(json.dumps(row))
    else:
        print(format_row(result["row"]))
        f = result.get("files", {})
        print(f"saved: {f.get('json')} and {f.get('csv')}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "eval", help="zero-shot lm-eval accuracy / perplexity of a (reduced) model, paper-style row",
        description="Run lm-eval-harness 0.4.13 on a dense or token-reduced model with position-correct scoring "
                    "(scored positions are protected from reduction). Offline tasks read the data fetched by "
                    "`hf-tokred data`; lambada_openai needs the Hugging Face Hub and is reported as missing "
                    "offline. Also measures the FLOPs reduction on the evaluated sequences and, on held-out BoolQ "
                    "passages, top-1 agreement and KL(dense || reduced).",
        epilog="Example: hf-tokred eval --model bundled:mamba --flops-reduction 0.2 --tasks piqa,arc_easy --limit 200.   "
               "Data parallel (one process per GPU; rank 0 prints and saves): accelerate launch --multi_gpu "
               "--num_processes 8 -m hf_tokred.cli eval --model state-spaces/mamba-2.8b-hf --flops-reduction 0.2",
    )
    add_model_argument(p)
    p.add_argument("--tasks", default=_DEFAULT_TASKS,
                   help=f"comma-separated tasks (default: {_DEFAULT_TASKS}); also available: "
                        "boolq_heldout_suffix (held-out perplexity that reduction affects), boolq_heldout_ppl "
                        "(whole-passage rolling perplexity), mqar (multi-query associative recall at the query "
                        "positions; a recall model such as bundled:recall-mamba2; --limit = sequences, default 256), passkey (a "
                        "needle in a haystack) and position_ppl (perplexity of the last 32 tokens of held-out text of "
                        "each --lengths), with the long-context flags below")
    p.add_argument("--limit", default=None, help="documents per task (and held-out passages), e.g. 100 (default: all)")
    p.add_argument("--batch-size", default="8", help="requests per forward (default: 8)")
    p.add_argument("--max-length", default="2048", help="longest input in tokens; longer inputs are left-truncated")
    p.add_argument("--output", default="eval_results", help="folder for the JSON + CSV results (default: eval_results)")
    p.add_argument("--data-dir", default=None, help="offline data cache (default: $HF_TOKRED_DATA or ~/.cache/hf_tokred)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--device-map", default=None,
                   help="spread a model that does not fit one device with accelerate, e.g. auto (replaces --device)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights dtype (default: as stored)")
    p.add_argument("--no-fidelity", action="store_true",
                   help="skip the held-out top-1 agreement / KL columns (they run the dense model too)")
    p.add_argument("--bootstrap-iters", type=int, default=100, help="lm-eval stderr bootstrap draws (0: no stderr)")
    p.add_argument("--json", action="store_true", help="print the row as one JSON object instead of a table")
    g = p.add_argument_group(
        "long context", "with any of these (or --tasks passkey / position_ppl): recall by prompt length and "
                        "depth for --tasks mqar,passkey (perplexity by length for position_ppl), dense beside each "
                        "method on the same rows, 95 % intervals; writes "
                        "longctx.json/.md/.png to --output; --limit = rows per cell (default 64)")
    g.add_argument("--lengths", default=None, help="prompt lengths in tokens (default: 128,512,1024)")
    g.add_argument("--depths", default=None,
                   help="where the key-value block / needle sits: shares of the filler before it (default: 0,0.5,1)")
    g.add_argument("--methods", default=None,
                   help="run each of these methods at the level the flags give, e.g. prefilter,front_prune")
    g.add_argument("--seed", type=int, default=None,
                   help="the rows' seed (default: the evaluation seed 1000000, which no training run draws)")
    g.add_argument("--haystack", default="noise",
                   help="passkey haystack: noise (repeated sentences) or natural (held-out passages; hf-tokred data)")
    add_reduction_arguments(p)
    p.set_defaults(func=_eval)
