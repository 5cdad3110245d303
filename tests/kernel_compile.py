"""Compile every Triton kernel at every point of ``hf_tokred.ops.dispatch.LAUNCH_SPACE`` for one GPU arch, no GPU.

Run as ``python tests/kernel_compile.py ARCH`` (80: A100, 90: H100) by ``tests/test_triton_compile.py``, in a
process without ``TRITON_INTERPRET`` (the real compiler must run).  A compile-only Triton driver answers "the
current device is an sm_ARCH GPU"; each kernel object is swapped for a proxy whose launch calls the kernel's
``warmup`` (Triton's own specialisation and compile, all the way to cubin with the ptxas in the triton wheel)
instead of running it.  Each point of the launch space is then reached through the real launcher, with small CPU
tensors chosen so that the launcher picks exactly that point.  Prints one JSON line per point: the constexprs and
``num_warps`` the launcher passed, the compiled kernel's shared memory, or the compile error.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from hf_tokred.ops.dispatch import LAUNCH_SPACE, launch_points, load_triton_module


class CompileOnlyDriver:
    """What ``JITFunction.run(..., warmup=True)`` asks the active driver: device, stream, target."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_device(self):
        return self.target.arch

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


class CompileOnlyKernel:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kw)`` compiles and records, never runs."""

    def __init__(self, kernel, records: list):
        self.kernel, self.records = kernel, records

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.records.append((kwargs, self.kernel.warmup(*args, grid=grid, **kwargs)))

        return launch


def apply_plan_call(point: dict):
    """Inputs for which the apply-plan launcher picks ``point`` (channel width = the point's block)."""
    res_dtype, hid_dtype = point["dtypes"]
    B, N, M, R, D = 2, 12, 6, 4, point["block"][0]
    weights = {0: None, 1: torch.rand(B, R, 1), 2: torch.rand(B, R, D)}
    keep = torch.arange(M).repeat(B, 1) + R
    src = torch.arange(R).repeat(B, 1)
    return ("_apply_plan_triton", "apply_plan_fused", "_apply_plan_fused_kernel",
            (torch.randn(B, N, D, dtype=res_dtype), torch.randn(B, N, D, dtype=hid_dtype), keep,
             torch.ones(B, M, dtype=torch.bool), src, src % M, weights[point["RES_MODE"]], weights[point["HID_MODE"]],
             torch.promote_types(res_dtype, hid_dtype)),
            {"RES_MODE": point["RES_MODE"], "HID_MODE": point["HID_MODE"], "BLOCK_D": point["block"][0],
             "num_warps": point["block"][1]})


def selective_scan_call(point: dict):
    """Inputs for which the scan launcher picks ``point`` (state size = the point's BLOCK_N)."""
    block_n, block_d, warps = point["block"]
    T, DIM, dtype = 10, 128, point["dtype"]
    act = lambda *shape: torch.randn(*shape, dtype=dtype)  # noqa: E731
    return ("_selective_scan_triton", "selective_scan_varlen", "_selective_scan_varlen_kernel",
            (act(T, DIM), act(T, DIM), -torch.rand(DIM, block_n), act(T, block_n), act(T, block_n), torch.randn(DIM),
             act(T, DIM) if point["HAS_Z"] else None, torch.randn(DIM), None, torch.tensor([0, 4, T]),
             point["SOFTPLUS"]),
            {"HAS_Z": point["HAS_Z"], "SOFTPLUS": point["SOFTPLUS"], "BLOCK_D": block_d, "BLOCK_N": block_n,
             "num_warps": warps})


CALLS = {"apply_plan_fused": apply_plan_call, "selective_scan_varlen": selective_scan_call}


def error_line(err: Exception, kernel_name: str) -> str:
    """One line: Triton's ``CompilationError`` text is ``at LINE:COL:``, the source, ``^``, then the cause."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [""]
    where = f" ({lines[0].rstrip(':')} of {kernel_name})" if len(lines) > 1 and lines[0].startswith("at ") else ""
    if not where:
        frame = traceback.extract_tb(err.__traceback__)[-1]
        where = f" ({Path(frame.filename).name}:{frame.lineno})"
    return f"{type(err).__name__}: {lines[-1]}{where}"


def compile_point(kernel: str, point: dict) -> dict:
    module_name, launcher, kernel_name, args, expected = CALLS[kernel](point)
    module = load_triton_module(module_name)
    records: list = []
    real = getattr(module, kernel_name)
    setattr(module, kernel_name, CompileOnlyKernel(real, records))
    row = {"kernel": kernel, "point": {k: str(v) for k, v in point.items()}}
    try:
        getattr(module, launcher)(*args)
    except Exception as err:  # noqa: BLE001 - every compile error is reported: its cause and where
        return {**row, "error": error_line(err, kernel_name)}
    finally:
        setattr(module, kernel_name, real)
    (kwargs, compiled), = records
    launched = {k: kwargs[k] for k in expected}
    return {**row, "launched": launched, "expected": expected, "shared": compiled.metadata.shared,
            "num_warps": compiled.metadata.num_warps, "cubin": "cubin" in compiled.asm}


def main(arch: int) -> None:
    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", arch, 32)))
    for kernel in LAUNCH_SPACE:
        for point in launch_points(kernel):
            print(json.dumps(compile_point(kernel, point)), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
