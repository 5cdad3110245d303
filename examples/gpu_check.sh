#!/usr/bin/env bash
# GPU check for hf_tokred (H100/H200 class machine, CUDA torch + triton installed; target < 8 minutes):
#   1. the kernel tests with real Triton compilation on CUDA tensors (no TRITON_INTERPRET);
#   2. the dense-vs-reduced benchmark on a random-weight Mamba-2 2.7B, then the speed-up ratios.
#
# Usage: bash examples/gpu_check.sh            (from anywhere; runs in the repository root)
# Env:   PYTHON=python   TEST_TIMEOUT=180   BENCH_TIMEOUT=330   BENCH_JSON=runs/gpu_bench.json
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python}"
TEST_TIMEOUT="${TEST_TIMEOUT:-180}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-330}"
BENCH_JSON="${BENCH_JSON:-runs/gpu_bench.json}"
unset TRITON_INTERPRET  # real compilation
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
start=$SECONDS

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" - <<'EOF'
import importlib.util, sys
import torch
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch: this script is for a GPU machine")
import triton
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"device {torch.cuda.get_device_name()}, mamba_ssm importable: {importlib.util.find_spec('mamba_ssm') is not None}")
EOF

echo "== kernel tests (compiled Triton on CUDA)"
timeout "$TEST_TIMEOUT" "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_kernels.py --durations=5
echo "   tests done after $((SECONDS - start)) s"

echo "== benchmark"
mkdir -p "$(dirname "$BENCH_JSON")"
if command -v hf-tokred >/dev/null 2>&1; then
  BENCH=(hf-tokred)
else
  BENCH=("$PYTHON" -m hf_tokred.cli)
fi
timeout "$BENCH_TIMEOUT" "${BENCH[@]}" bench --model random:mamba2-2.7b --batch 16 --length 2048 \
  --flops 0.1,0.2,0.3 --json "$BENCH_JSON"
echo "   benchmark done after $((SECONDS - start)) s"

echo "== speed-up ratios (prefill, median; ideal = 1 / (1 - FLOPs reduction))"
"$PYTHON" - "$BENCH_JSON" <<'EOF'
import json, sys
result = json.load(open(sys.argv[1]))
print(f"model {result.get('model')}  batch {result.get('batch')}  length {result.get('length')}  "
      f"device {result.get('device')}  dtype {result.get('dtype')}")
print(f"{'setting':<28}{'speed-up':>10}{'ideal':>8}{'FLOPs red.':>12}{'overhead':>10}")
for row in result["rows"]:
    ideal = row.get("ideal_speedup")
    flops = row.get("flops_reduction_exact")
    print(f"{row['setting']:<28}{row['speedup_vs_dense']:>9.3f}x"
          f"{(f'{ideal:.2f}x' if ideal else '-'):>8}"
          f"{(f'{flops:.1%}' if flops is not None else '-'):>12}"
          f"{row.get('reduction_overhead_share', 0.0):>10.1%}")
EOF
echo "== total $((SECONDS - start)) s"
