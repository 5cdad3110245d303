"""``hf-tokred bench``: dense vs reduced prefill/decode speed, the reduction's own overhead, and peak memory.

Everything is measured side by side in one run: repeats are interleaved across the settings (dense,
each FLOPs level, and optionally stock transformers), so machine noise hits all of them alike.
Reported figures are medians with min/max; speed-ups are ratios of medians.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from . import fastpath
from .config import DEFAULT_METHOD, TokenReductionConfig
from .compat import cache_kwargs, cache_of, layer_cache_kwargs
from .families import family_of
from .flops import flops_reduction, measured_proxy_reduction
from .models import load_model
from .outputs import record_reduction
from .settings import apply_token_reduction

__all__ = ["BenchSetting", "format_table", "kv_cache_bytes", "run_bench"]


@dataclass
class BenchSetting:
    name: str
    token_reduction: dict | None
    stock: bool = False  # run transformers' own code paths (no hf_tokred fast paths)
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    overhead_s: list[float] = field(default_factory=list)
    score_s: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stock_paths(enabled: bool):
    return fastpath.stock_kernels() if enabled else contextlib.nullcontext()


@torch.no_grad()
def _prefill_and_decode(model, ids, setting: BenchSetting, decode_tokens: int, device) -> None:
    apply_token_reduction(model, setting.token_reduction)
    with _stock_paths(setting.stock):
        _sync(device)
        with record_reduction(timing=True) as records:  # the reduction's own cost, timed by the loop itself
            t0 = time.perf_counter()
            out = model(ids, use_cache=True, logits_to_keep=1)
            _sync(device)
            setting.prefill_s.append(time.perf_counter() - t0)
        setting.overhead_s.append(sum(r.plan_seconds + r.apply_seconds for r in records))
        setting.score_s.append(sum(r.score_seconds for r in records))
        hybrid = family_of(model).hybrid
        cache, nxt = cache_of(out, hybrid), out.logits[:, -1:].argmax(-1)
        setting.extra["kv_cache_mib"] = kv_cache_bytes(cache) / 2**20
        if decode_tokens:
            t0 = time.perf_counter()
            for t in range(decode_tokens):
                # hybrids: the decode step's original position (the stock forwards would start from 0)
                extra = {"position_ids": torch.full_like(nxt, ids.shape[1] + t)} if hybrid else {}
                step = model(nxt, **(layer_cache_kwargs if hybrid else cache_kwargs)(cache), use_cache=True, **extra)
                cache, nxt = cache_of(step, hybrid), step.logits[:, -1:].argmax(-1)
            _sync(device)
            setting.decode_s.append(time.perf_counter() - t0)
    if records:
        setting.extra["layer_lengths"] = [max(col) for col in zip(*records[0].layer_lengths)]


def kv_cache_bytes(cache) -> int:
    """Bytes of the keys and values an attention cache holds (0 for a pure SSM's cache)."""
    layers = getattr(cache, "layers", ())
    return sum(t.numel() * t.element_size() for layer in layers for t in (getattr(layer, "keys", None),
                                                                         getattr(layer, "values", None))
               if isinstance(t, torch.Tensor))


def _prefill_kwargs(logits: str) -> dict:
    """``last``: next-token logits only (a generation prefill); ``all``: logits at every computed position
    (scoring / perplexity), compact for a reducing model (dense models compute every position anyway)."""
    return {"logits_to_keep": 1} if logits == "last" else {"logits_to_keep": 0, "compact_logits": True}


def _memory_probe(spec: str, setting: dict | None, stock: bool, batch: int, length: int, threads: int, logits: str,
                  q) -> None:
    """Child process: peak RSS during one prefill minus the RSS just before it (MiB), via Linux's VmHWM reset."""
    torch.set_num_threads(threads)
    model, _ = load_model(spec, token_reduction=setting)
    ids = torch.randint(2, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), _stock_paths(stock):
        model(ids[:, :64], use_cache=True, logits_to_keep=1)
        before = _rss_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset the peak-RSS counter (VmHWM)
        model(ids, use_cache=True, **_prefill_kwargs(logits))
        after = _rss_kib("VmHWM")
    q.put((after - before) / 1024.0)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}; CPU peak memory needs Linux")


def _peak_memory_mib(spec, setting: BenchSetting, batch, length, threads, device, logits: str = "last") -> float:
    if device.type == "cuda":
        model, _ = load_model(spec, token_reduction=setting.token_reduction)
        model.to(device)
        ids = torch.randint(2, model.config.vocab_size, (batch, length), device=device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        with torch.no_grad():
            model(ids, use_cache=True, **_prefill_kwargs(logits))
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_memory_probe, args=(spec, setting.token_reduction, setting.stock, batch, length, threads, logits, q))
    p.start()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"memory probe for {setting.name} failed with exit code {p.exitcode}")
    return q.get()


def _summary(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _row(s: BenchSetting, dense: float, config, batch: int, length: int, decode_tokens: int) -> dict[str, Any]:
    med = statistics.median(s.prefill_s)
    lengths = s.extra.get("layer_lengths", [length] * config.num_hidden_layers)
    row = {
        "setting": s.name,
        "token_reduction": s.token_reduction,
        "prefill_s": _summary(s.prefill_s),
        "prefill_tokens_per_s": batch * length / med,
        "speedup_vs_dense": dense / med,
        "decode_tokens_per_s": batch * decode_tokens / statistics.median(s.decode_s) if s.decode_s else None,
        # the yardstick: the reduction's own time as a share of the *dense* forward
        "reduction_overhead_share": statistics.median(s.overhead_s) / dense if s.token_reduction else 0.0,
        "reduction_overhead_share_of_own_forward": (statistics.median(s.overhead_s) / med
                                                    if s.token_reduction else 0.0),
        # a method that re-runs its anchor (prefilter): its scoring pass, a share of the dense forward (the FLOPs
        # figures count it: the anchor's layer length is its input plus the kept tokens)
        "scoring_pass_share": statistics.median(s.score_s) / dense if s.score_s else 0.0,
        "layer_lengths": lengths,
        "flops_reduction_exact": flops_reduction(config, lengths, length, batch=batch,
                                                 lm_head_positions=1, dense_lm_head_positions=1),
        "flops_reduction_proxy": measured_proxy_reduction(lengths, length),
        "peak_mib": s.extra.get("peak_mib"),
        "kv_cache_mib": s.extra.get("kv_cache_mib") or None,  # hybrids: reduced keys/values after the prefill
    }
    if s.token_reduction:  # a FLOPs target's ideal, or (a token budget) the proxy this length reached
        target = s.token_reduction.get("flops_reduction")
        row["ideal_speedup"] = 1 / (1 - (row["flops_reduction_proxy"] if target is None else target))
    return row


def run_bench(
    model_spec: str = "random:mamba-130m",
    batch: int = 1,
    length: int = 2048,
    flops: tuple[float, ...] = (0.1, 0.2, 0.3),
    method: str | None = None,
    repeats: int = 3,
    warmup: int = 1,
    decode_tokens: int = 16,
    threads: int | None = None,
    compare_stock: bool = False,
    memory: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
    progress: bool = True,
    memory_logits: str = "last",
    keep_tokens: tuple[int, ...] = (),
    match_window: int | None = None,
) -> dict[str, Any]:
    """Run the benchmark and return a JSON-safe result dict (see ``print_table``): dense, each FLOPs level and
    each token budget (``keep_tokens``) of ``method`` (default: the config's default for that level)."""
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    torch_dtype = getattr(torch, dtype)
    model, _ = load_model(model_spec, dtype=torch_dtype)
    model.to(dev)
    ids = torch.randint(2, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    ids = ids.to(dev)

    settings = [BenchSetting("dense", None)]
    if compare_stock:
        settings.append(BenchSetting("stock transformers (dense)", None, stock=True))
    extra = {} if match_window is None else {"match_window": match_window}
    levels = [("flops_reduction", f, f"{f:.0%}") for f in flops] + [("keep_tokens", k, f"K={k}") for k in keep_tokens]
    for name, value, label in levels:
        cfg = TokenReductionConfig(method=method, **{name: value}, **extra).to_dict()
        settings.append(BenchSetting(f"{cfg['method']} {label}", cfg))

    for _ in tqdm(range(warmup), desc="warm-up", disable=not progress or not warmup):
        for s in settings:
            _prefill_and_decode(model, ids, s, min(decode_tokens, 2), dev)
            s.prefill_s.clear(), s.decode_s.clear(), s.overhead_s.clear(), s.score_s.clear()
    for _ in tqdm(range(repeats), desc="repeats", disable=not progress):
        for s in settings:  # interleaved, so drift affects every setting alike
            _prefill_and_decode(model, ids, s, decode_tokens, dev)
    if memory:
        for s in tqdm(settings, desc="peak memory", disable=not progress):
            s.extra["peak_mib"] = _peak_memory_mib(model_spec, s, batch, length, torch.get_num_threads(), dev,
                                                   memory_logits)

    dense = statistics.median(settings[0].prefill_s)
    rows = [_row(s, dense, model.config, batch, length, decode_tokens) for s in settings]
    if memory and rows[0]["peak_mib"]:
        for row in rows:
            row["peak_memory_saving"] = 1 - row["peak_mib"] / rows[0]["peak_mib"]
    if rows[0]["kv_cache_mib"]:
        for row in rows:
            row["kv_cache_saving"] = 1 - row["kv_cache_mib"] / rows[0]["kv_cache_mib"]
    return {
        "model": model_spec,
        "batch": batch,
        "length": length,
        "method": method or DEFAULT_METHOD,
        "repeats": repeats,
        "warmup": warmup,
        "decode_tokens": decode_tokens,
        "threads": torch.get_num_threads(),
        "device": str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev),
        "dtype": dtype,
        "memory_logits": memory_logits if memory else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": " ".join(["hf-tokred", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else None,
        "rows": rows,
    }


def format_table(result: dict[str, Any]) -> str:
    head = (f"{result['model']}  batch {result['batch']} x {result['length']} tokens  {result['threads']} threads  "
            f"{result['device']} {result['dtype']}  (median of {result['repeats']})")
    cols = ["setting", "prefill s (min-max)", "tok/s", "speed-up", "ideal", "decode tok/s", "overhead (of dense)",
            "scoring pass",
            "FLOPs red. exact/proxy", "peak MiB", "KV cache MiB (saved)"]
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in result["rows"]:
        p = r["prefill_s"]
        lines.append("| " + " | ".join([
            r["setting"],
            f"{p['median']:.3f} ({p['min']:.3f}-{p['max']:.3f})",
            f"{r['prefill_tokens_per_s']:.0f}",
            f"{r['speedup_vs_dense']:.2f}x",
            f"{r['ideal_speedup']:.2f}x" if "ideal_speedup" in r else "-",
            f"{r['decode_tokens_per_s']:.1f}" if r["decode_tokens_per_s"] else "-",
            f"{r['reduction_overhead_share']:.1%}",
            f"{r['scoring_pass_share']:.1%}" if r.get("scoring_pass_share") else "-",
            f"{r['flops_reduction_exact']:.1%} / {r['flops_reduction_proxy']:.1%}",
            f"{r['peak_mib']:.0f}" if r.get("peak_mib") is not None else "-",
            f"{r['kv_cache_mib']:.2f} (-{r['kv_cache_saving']:.0%})" if r.get("kv_cache_mib") else "-",
        ]) + " |")
    return "\n".join(lines)
