"""Speed/memory benchmark of the issue's targets: dense vs reduced prefill, side by side in one run.

    python examples/bench.py                      # 130m-shaped Mamba and Mamba-2, batch 1 x 2048, 2 threads
    python examples/bench.py --memory --batch 4   # peak memory of a 4 x 2048 prefill

Same as `hf-tokred bench`, for both families in one go; results go to runs/bench_<family>.json.
"""

import argparse
import json
from pathlib import Path

import hf_tokred  # noqa: F401
from hf_tokred.bench import format_table, run_bench


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="random:mamba-130m,random:mamba2-130m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--flops", default="0.1,0.2,0.3")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--memory", action="store_true")
    p.add_argument("--no-stock", action="store_true", help="skip timing stock transformers")
    p.add_argument("--out", default="runs")
    args = p.parse_args()
    for spec in args.models.split(","):
        result = run_bench(spec, args.batch, args.length, tuple(float(f) for f in args.flops.split(",")),
                           repeats=args.repeats, threads=args.threads, compare_stock=not args.no_stock,
                           memory=args.memory)
        print(format_table(result))
        out = Path(args.out) / f"bench_{spec.split(':')[-1]}_b{args.batch}{'_mem' if args.memory else ''}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
