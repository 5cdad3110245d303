"""The hf-tokred command: generate / schedule / bench end to end on tiny random models, and exit codes."""

import json
import subprocess
import sys

import pytest

from hf_tokred.cli import main


def run(*argv):
    return subprocess.run([sys.executable, "-m", "hf_tokred.cli", *argv], capture_output=True, text=True,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "", "OMP_NUM_THREADS": "1"})


def test_schedule_matches_the_paper_table(capsys):
    assert main(["schedule", "--layers", "48", "--flops-reduction", "0.3", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["anchors"] == [10, 15, 20, 25, 30, 35] and abs(row["keep_ratio"] - 0.8768) < 1e-3


def test_schedule_reports_exact_flops_for_a_model(capsys):
    assert main(["schedule", "--model", "random:mamba2-tiny", "--flops-reduction", "0.2", "--length", "256",
                 "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert len(row["layer_lengths"]) == 12 and row["layer_lengths"][0] == 256
    assert abs(row["flops_reduction_proxy_at_length"] - 0.2) < 0.02 and row["flops_reduction_exact_scoring"] > row["flops_reduction_exact_prefill"] > 0


def test_generate_json(capsys):
    assert main(["generate", "hello there", "--model", "random:mamba-tiny", "--keep-ratio", "0.7",
                 "--max-new-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt"] == "hello there" and out["token_reduction"]["keep_ratio"] == 0.7


@pytest.mark.parametrize(
    "argv,code,needle",
    [
        (["schedule", "--layers", "24", "--flops-reduction", "0.95"], 2, "not reachable for a 24-layer model"),
        (["schedule", "--layers", "24", "--method", "utrc", "--keep-ratio", "0.3"], 2, "keep_ratio"),  # pairs: >= 0.5
        (["generate", "x", "--model", "random:mamba-tiny", "--anchors", "1,x", "--keep-ratio", "0.9"], 2, "--anchors"),
        (["generate", "x", "--model", "random:mamba-tiny", "--method", "tome"], 2, "--flops-reduction or --keep-ratio"),
        (["generate", "x", "--model", "/nonexistent/model"], 1, "error"),
        (["bench", "--flops", "0.1,abc"], 2, "--flops"),
        (["generate", "x", "--method", "pumer", "--keep-ratio", "0.9"], 2, "invalid choice"),
    ],
)
def test_errors_have_exit_codes_and_name_the_flag(argv, code, needle):
    proc = run(*argv)
    assert proc.returncode == code, proc.stderr
    assert needle in proc.stderr


def test_bench_runs_side_by_side(tmp_path):
    out = tmp_path / "bench.json"
    proc = run("bench", "--model", "random:mamba-tiny", "--length", "64", "--flops", "0.3", "--repeats", "1",
               "--warmup", "0", "--decode-tokens", "2", "--compare-stock", "--threads", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    names = [r["setting"] for r in result["rows"]]
    assert names == ["dense", "stock transformers (dense)", "front_prune 30%"]
    reduced = result["rows"][2]
    assert reduced["layer_lengths"][-1] < 64 and 0.2 < reduced["flops_reduction_proxy"] < 0.35
    assert "| front_prune 30% |" in proc.stdout


def test_bench_memory_with_all_logits(tmp_path):
    """--memory --memory-logits all: each setting's peak is measured in a fresh process, reduced ones with
    compact logits; the overhead share is taken against the dense forward."""
    out = tmp_path / "bench.json"
    proc = run("bench", "--model", "random:mamba-tiny", "--length", "64", "--flops", "0.3", "--repeats", "1",
               "--warmup", "0", "--decode-tokens", "0", "--threads", "1", "--memory", "--memory-logits", "all",
               "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["memory_logits"] == "all"
    dense, red = result["rows"]
    assert dense["peak_mib"] > 0 and red["peak_mib"] > 0 and "peak_memory_saving" in red
    assert red["reduction_overhead_share"] == pytest.approx(
        red["reduction_overhead_share_of_own_forward"] * red["prefill_s"]["median"] / dense["prefill_s"]["median"])
