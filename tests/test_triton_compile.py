"""Every Triton kernel compiles for real GPUs (A100 sm_80, H100 sm_90) at every specialisation it can launch.

The kernel tests run the kernels in Triton's interpreter, which accepts kernels that do not compile for a GPU
(a ``tl.dot`` block under 16, a loop-carried value that changes dtype, ``break``, ...).  Here Triton's real compiler
runs, to cubin, with no GPU: ``tests/kernel_compile.py`` (a subprocess without ``TRITON_INTERPRET``, Triton's cache
in a fresh folder and ``TRITON_ALWAYS_COMPILE=1``) reaches every point of ``dispatch.LAUNCH_SPACE`` through the real
launchers.  Each point must compile, with the constexprs and warps of that point, within the arch's shared memory.
The two arches compile in parallel processes.
"""

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_tokred.ops.dispatch import LAUNCH_SPACE, launch_points

ROOT = Path(__file__).resolve().parents[1]
#: largest shared memory one block may use (opt-in maximum): A100 163 KiB, H100 227 KiB
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}


@pytest.fixture(scope="module")
def compiles(tmp_path_factory):
    """One compile process per arch, started together; ``{arch: (returncode, rows, stderr)}`` as each finishes."""
    procs = {}
    for arch in SHARED_LIMIT:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(TRITON_CACHE_DIR=str(tmp_path_factory.mktemp(f"triton-cache-sm{arch}")), TRITON_ALWAYS_COMPILE="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), PYTHONWARNINGS="ignore")
        procs[arch] = subprocess.Popen([sys.executable, str(ROOT / "tests" / "kernel_compile.py"), str(arch)],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    results = {}
    for arch, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        results[arch] = (proc.returncode, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err)
    return results


def test_launch_space_is_what_the_launchers_read():
    """The space is finite and small, and its axes are the ones the compile worker maps to launcher inputs."""
    assert set(LAUNCH_SPACE) == {"apply_plan_fused", "selective_scan_varlen"}
    for kernel, axes in LAUNCH_SPACE.items():
        assert len(launch_points(kernel)) == math.prod(len(v) for v in axes.values())
        assert launch_points(kernel) == [dict(zip(axes, v)) for v in itertools.product(*axes.values())]


@pytest.mark.parametrize("arch", sorted(SHARED_LIMIT))
def test_every_kernel_specialisation_compiles_to_cubin(compiles, arch):
    code, rows, stderr = compiles[arch]
    assert code == 0, f"sm_{arch} compile worker failed:\n{stderr[-3000:]}"
    errors = [f"{r['kernel']} {r['point']}: {r['error']}" for r in rows if "error" in r]
    assert not errors, f"{len(errors)} specialisation(s) do not compile for sm_{arch}:\n" + "\n".join(errors)
    expected = {k: len(launch_points(k)) for k in LAUNCH_SPACE}
    assert {k: sum(r["kernel"] == k for r in rows) for k in LAUNCH_SPACE} == expected
    for r in rows:
        where = f"{r['kernel']} {r['point']} on sm_{arch}"
        assert r["launched"] == r["expected"], f"{where}: the launcher picked {r['launched']}"
        assert r["cubin"] and r["num_warps"] == r["expected"]["num_warps"], where
        assert 0 <= r["shared"] <= SHARED_LIMIT[arch], f"{where}: {r['shared']} bytes of shared memory"
