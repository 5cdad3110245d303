"""The scripts in ``examples/`` run offline with tiny settings: exit code 0 and their key output lines.

All of them start together (each spends most of its time importing torch / transformers), offline.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


RUNS = {
    "reduce_and_generate": ["--max-new-tokens", "4", "--prompt", "The history of the Roman Empire spans"],
    "compare_methods": ["--batch", "1", "--length", "48"],
    "evaluate_checkpoint": ["--model", "random:mamba2-tiny", "--limit", "2", "--max-length", "256", "--batch-size", "4",
                            "--no-fidelity"],
    "publish_variant": ["--max-new-tokens", "3", "--prompt", "The quick brown fox"],
    "quality_table": ["--out", "quality", "--models", "mamba", "--passages", "3", "--levels", "0.3"],
    "train_recall": ["train", "--family", "mamba2", "--out", "recall", "--steps", "3", "--hidden", "16", "--batch", "4",
                     "--eval-every", "3", "--warmup", "1"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("examples")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_MODULES_CACHE": str(tmp / "modules"), "OMP_NUM_THREADS": "1"}
    from hf_tokred.evaluation import data

    data.fetch_data()  # evaluate_checkpoint.py reads the offline splits (a no-op once fetched)
    procs = {}
    for name, args in RUNS.items():
        procs[name] = subprocess.Popen([sys.executable, str(EXAMPLES / f"{name}.py"), *args], cwd=tmp, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                       text=True)
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[name] = (proc.returncode, out, err)
    return results


def _output(runs, name) -> str:
    code, out, err = runs[name]
    assert code == 0, f"{name}.py exited with {code}:\n{err[-3000:]}"
    return out


def test_reduce_and_generate(runs):
    out = _output(runs, "reduce_and_generate")
    assert "MambaForCausalLM, 12 blocks" in out
    assert "schedule: anchors [2, 3, 4, 5, 6, 7, 8], keep ratio" in out and "20.0 %" in out
    assert "tokens per block:" in out and "completion:" in out


def test_compare_methods(runs):
    import hf_tokred

    out = _output(runs, "compare_methods")
    assert "top-1 agr." in out and "KL (nats)" in out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in hf_tokred.METHODS]
    assert [r[0] for r in rows] == list(hf_tokred.METHODS)
    for r in rows:
        assert 0.0 <= float(r[1]) <= 1.0 and float(r[2]) >= 0.0


def test_evaluate_checkpoint(runs):
    out = _output(runs, "evaluate_checkpoint")
    assert "| PIQA |" in out and "| random:mamba2-tiny | utrc |" in out
    assert "piqa: {" in out and "over 2 documents" in out


def test_publish_variant(runs):
    out = _output(runs, "publish_variant")
    assert "wrote settings-only variant" in out and "hf_tokred_variant.py" in out
    assert "card: | analytic FLOPs, one 2048-token sequence |" in out
    assert "reloaded: MambaForCausalLM with token_reduction={'method': 'utrc', 'flops_reduction': 0.2" in out
    assert "generated: " in out


def test_quality_table(runs):
    import json

    rows = [json.loads(line) for line in _output(runs, "quality_table").splitlines() if line.startswith("{")]
    assert [r["method"] for r in rows][0] == "dense" and len(rows) == 12
    benefit = json.loads(_output(runs, "quality_table").split("context benefit of bundled:mamba: ")[1].splitlines()[0])
    assert set(benefit) == {"8", "32", "128", "all", "benefit_all_vs_32"}
    assert benefit["benefit_all_vs_32"] == 1 - benefit["all"][0] / benefit["32"][0]
    assert all(benefit[k][1] <= benefit[k][0] <= benefit[k][2] for k in ("8", "32", "128", "all"))
    for r in rows[1:]:
        low, est, high = r["top1_agreement"][1], r["top1_agreement"][0], r["top1_agreement"][2]
        assert 0 <= low <= est <= high <= 1 and r["flops_exact"] > 0.2


def test_train_recall(runs):
    out = _output(runs, "train_recall")
    assert "'step': 3" in out and "eval_acc" in out
