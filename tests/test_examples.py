"""The scripts in ``examples/`` run offline with tiny settings: exit code 0 and their key output lines.

All of them start together (each spends most of its time importing torch / transformers), offline.  The commands
the README and ``docs/`` show (these scripts' included) are checked by ``tests/test_docs.py``.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hf_tokred
from hf_tokred.evaluation import data

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
    "train_passkey": ["train", "--family", "mamba2", "--out", "passkey", "--steps", "2", "--hidden", "16", "--batch",
                      "4", "--eval-every", "2", "--warmup", "1", "--seq-len", "64", "--layers", "2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("examples")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_MODULES_CACHE": str(tmp / "modules"), "OMP_NUM_THREADS": "1"}
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


def _quality_table_module():
    spec = importlib.util.spec_from_file_location("quality_table", EXAMPLES / "quality_table.py")
    qt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qt)
    return qt


def test_quality_table(runs):
    rows = [json.loads(line) for line in _output(runs, "quality_table").splitlines() if line.startswith("{")]
    assert [r["method"] for r in rows] == ["dense", *_quality_table_module().METHODS]  # one level: every method
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


def test_train_passkey(runs):
    out = _output(runs, "train_passkey")
    assert "'step': 2" in out and "eval_noise" in out and "eval_natural_heldout" in out


def test_quality_table_report_from_hand_made_rows(tmp_path):
    """``--report``: the summary's cells are the rows' estimates and intervals (MQAR relative to the dense
    accuracy, hand-computed), the full table and the context-benefit table list every file."""
    qt = _quality_table_module()
    base = {"flops_exact": 0.25, "flops_proxy": 0.2}
    rows = [("mamba", "dense", 0.0, {"top1_agreement": [1, 1, 1], "suffix_ppl": [10, 10, 10], "kl": [0, 0, 0]}),
            ("mamba", "evit", 0.2, {"top1_agreement": [0.9, 0.85, 0.95], "suffix_ppl": [11, 10, 12],
                                    "kl": [0.1, 0.05, 0.2]}),
            ("recall-mamba2", "dense", 0.0, {"mqar_acc": [0.8, 0.75, 0.85]}),
            ("recall-mamba2", "evit", 0.2, {"mqar_acc": [0.4, 0.36, 0.44]})]
    for model, method, level, row in rows:
        (tmp_path / f"{model}__{method}__{level:g}.json").write_text(json.dumps(
            {"model": f"bundled:{model}", "method": method, "flops_target": level, **base, **row}))
    (tmp_path / "mamba__context.txt").write_text(json.dumps(
        {"model": "bundled:mamba", "passages": 3, "8": [30, 29, 31], "32": [20, 19, 21], "128": [16, 15, 17],
         "all": [15, 14, 16], "benefit_all_vs_32": 0.25}))
    summary = qt.summary(tmp_path)
    evit = next(line for line in summary.splitlines() if line.startswith("| evit |"))
    assert evit == "| evit | 90.0 (85.0–95.0) | - | 50.0 (45.0–55.0) | - |"
    full = qt.report(tmp_path)
    assert full.count("| bundled:") == 5 and "| bundled:mamba | 3 | 30.0 (29.0–31.0) |" in full and "25.0 %" in full
