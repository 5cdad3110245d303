#!/usr/bin/env bash
# The published results table: both bundled models, dense and utrc / utrc_reference / evit / tome at
# 10/20/30 % FLOPs reduction, on the offline benchmarks plus held-out perplexity / agreement / KL.
#   bash examples/paper_table.sh [LIMIT] [OUT]
# LIMIT = documents per task (default 50); results in OUT (default runs/table), report in OUT/report.
set -euo pipefail
LIMIT=${1:-50}
OUT=${2:-runs/table}
TASKS=hellaswag,piqa,arc_easy,arc_challenge,winogrande,boolq_heldout_suffix
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
hf-tokred data
for model in mamba mamba2; do
  hf-tokred eval --model "bundled:$model" --tasks "$TASKS" --limit "$LIMIT" --output "$OUT/${model}_dense" --bootstrap-iters 0
  for method in utrc utrc_reference evit tome; do
    for f in 0.1 0.2 0.3; do
      hf-tokred eval --model "bundled:$model" --method "$method" --flops-reduction "$f" --tasks "$TASKS" \
        --limit "$LIMIT" --output "$OUT/${model}_${method}_${f}" --bootstrap-iters 0
    done
  done
done
hf-tokred report "$OUT" --output "$OUT/report"
hf-tokred report "$OUT" --output "$OUT/report/heldout_ppl.png" --y heldout_suffix_ppl
