"""Time transformers' per-step selective scan against ``hf_tokred.ops.scan.selective_scan`` on CPU.

The inputs have the shape of one Mamba-130m mixer layer (d_inner 1536, state size 16) and are
initialised like ``MambaMixer`` (S4D-real ``A``, ``dt`` bias giving time steps in [1e-3, 1e-1]).

Example::

    python examples/bench_scan.py --length 2048 --repeats 3 --threads 1 --json bench.json
    python examples/bench_scan.py --length 2048 --no-reference --chunk-size 32 48 64 96
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.models.mamba.modeling_mamba import mamba_selective_scan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from hf_tokred.ops.scan import DEFAULT_CHUNK_SIZE, selective_scan  # noqa: E402


def make_inputs(
    batch: int, length: int, d_inner: int, n_state: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random fp32 scan inputs shaped and scaled like a Mamba-1 mixer layer."""
    g = torch.Generator().manual_seed(seed)
    dt_init = torch.exp(torch.rand(d_inner, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    return {
        "hidden_states": torch.randn(batch, d_inner, length, generator=g),
        "dt": 0.1 * torch.randn(batch, d_inner, length, generator=g),
        "A": -torch.arange(1, n_state + 1, dtype=torch.float32).repeat(d_inner, 1),
        "B": torch.randn(batch, n_state, length, generator=g),
        "C": torch.randn(batch, n_state, length, generator=g),
        "D": torch.ones(d_inner),
        "z": torch.randn(batch, d_inner, length, generator=g),
        "delta_bias": dt_init + torch.log(-torch.expm1(-dt_init)),  # inverse softplus
    }


def time_fn(fn: Callable[[], object], repeats: int) -> list[float]:
    """Run ``fn`` once to warm up, then ``repeats`` times; return the wall times in seconds."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=2048, help="sequence length L")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--d-inner", type=int, default=1536)
    parser.add_argument("--state-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up run")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument(
        "--chunk-size", type=int, nargs="+", default=[DEFAULT_CHUNK_SIZE], help="one or more chunk sizes"
    )
    parser.add_argument("--no-reference", action="store_true", help="skip the (slow) transformers loop")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    inputs = make_inputs(args.batch, args.length, args.d_inner, args.state_size)
    kwargs = {"delta_softplus": True, "return_last_state": True}

    rows: list[dict[str, object]] = []
    with torch.inference_mode():
        ref_out = None
        if not args.no_reference:
            ref_out = mamba_selective_scan(**inputs, **kwargs)
            times = time_fn(lambda: mamba_selective_scan(**inputs, **kwargs), args.repeats)
            rows.append({"impl": "transformers loop", "chunk_size": None, "times_s": times,
                         "max_abs_diff": 0.0})
        for chunk in args.chunk_size:
            out = selective_scan(**inputs, **kwargs, chunk_size=chunk)
            diff = None if ref_out is None else max((a - b).abs().max().item() for a, b in zip(out, ref_out))
            times = time_fn(lambda: selective_scan(**inputs, **kwargs, chunk_size=chunk), args.repeats)
            rows.append({"impl": "hf_tokred chunked", "chunk_size": chunk, "times_s": times,
                         "max_abs_diff": diff})

    for row in rows:
        row["median_s"] = statistics.median(row["times_s"])
        row["tokens_per_s"] = args.batch * args.length / row["median_s"]

    print(f"batch={args.batch} L={args.length} d_inner={args.d_inner} N={args.state_size} "
          f"threads={args.threads} repeats={args.repeats} (median after 1 warm-up)")
    print(f"{'impl':<20}{'chunk':>6}{'median s':>11}{'min s':>9}{'tok/s':>10}{'max|diff|':>11}")
    for row in rows:
        diff = "-" if row["max_abs_diff"] is None else f"{row['max_abs_diff']:.1e}"
        chunk = "-" if row["chunk_size"] is None else row["chunk_size"]
        print(f"{row['impl']:<20}{chunk:>6}{row['median_s']:>11.4f}{min(row['times_s']):>9.4f}"
              f"{row['tokens_per_s']:>10.0f}{diff:>11}")
    if not args.no_reference:
        for row in rows[1:]:
            row["speedup"] = rows[0]["median_s"] / row["median_s"]
            print(f"speed-up (chunk {row['chunk_size']}): {row['speedup']:.1f}x")

    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        with open(args.json, "w") as f:
            json.dump({"config": config, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
