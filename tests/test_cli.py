"""The hf-tokred command: generate / schedule / bench end to end on tiny random models, and exit codes."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_tokred
from hf_tokred import TokenReductionConfig
from hf_tokred.cli import build_parser, main
from hf_tokred.models import byte_tokenizer, load_model


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
        (["schedule", "--layers", "24", "--method", "utrc", "--keep-ratio", "0.3"], 2,
         "--keep-ratio must be in [0.5, 1]"),  # pairs: >= 0.5; settings named as the flags
        (["generate", "x", "--model", "random:mamba-tiny", "--anchors", "1,x", "--keep-ratio", "0.9"], 2, "--anchors"),
        (["generate", "x", "--model", "random:mamba-tiny", "--method", "tome"], 2, "--flops-reduction or --keep-ratio"),
        (["generate", "x", "--model", "/nonexistent/model"], 2, "no such folder '/nonexistent/model'"),
        (["generate", "x", "--model", "./no-such-folder"], 2, "no such folder './no-such-folder'"),
        (["convert", "/no/such/source", "/tmp/hf_tokred_never_written"], 2, "SRC: no such folder '/no/such/source'"),
        (["bench", "--flops", "0.1,abc"], 2, "--flops"),
        (["generate", "x", "--method", "pumer", "--keep-ratio", "0.9"], 2, "invalid choice"),
        (["generate", "--flops-reduction", "abc"], 2, "argument --flops-reduction: invalid float value: 'abc'"),
        # reduction flags without a level were silently dense before
        (["generate", "x", "--model", "random:mamba-tiny", "--q", "0.3"], 2, "--q needs a reduction level"),
        (["generate", "x", "--model", "random:mamba-tiny", "--metric", "delta"], 2, "--metric needs a reduction level"),
        (["generate", "x", "--model", "random:mamba-tiny", "--protect-recent", "0.5"], 2,
         "--protect-recent needs a reduction level"),
        (["eval", "--model", "random:mamba-tiny", "--hidden-strategy", "merge"], 2,
         "--hidden-strategy needs a reduction level: add --flops-reduction or --keep-ratio"),
        (["schedule", "--layers", "1", "--flops-reduction", "0.1"], 2, "pass --anchors A,B,..."),  # not anchors=[...]
    ],
)
def test_errors_have_exit_codes_and_name_the_flag(argv, code, needle):
    proc = run(*argv)
    assert proc.returncode == code, proc.stderr
    assert needle in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # one line: no usage block, no traceback
    assert "anchors=[" not in proc.stderr and "TokenReductionConfig." not in proc.stderr


SUBCOMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)


def test_the_subcommands_are_all_there():
    assert SUBCOMMANDS == ["bench", "convert", "data", "eval", "generate", "push", "report", "schedule"]


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_reports_a_bad_flag_in_one_line(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--no-such-flag"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hf-tokred {command}: error: ") and f"(see hf-tokred {command} --help)" in err, err
    assert len(err.strip().splitlines()) == 1 and "usage:" not in err, err


@pytest.fixture
def reduced_folder(tmp_path):
    """A reduced tiny model saved with save_pretrained (settings in its config.json), with its tokenizer."""
    model, tok = load_model("random:mamba-tiny", token_reduction=TokenReductionConfig(method="evit", keep_ratio=0.6))
    model.save_pretrained(tmp_path / "reduced")
    tok.save_pretrained(tmp_path / "reduced")
    return tmp_path / "reduced"


def _python_generate(folder, prompt, **kwargs):
    """The Python API on the same folder: from_pretrained, greedy generate, what reduction kept."""
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    enc = byte_tokenizer()(prompt, return_tensors="pt")
    with hf_tokred.record_reduction() as records:
        out = model.generate(**enc, max_new_tokens=3, do_sample=False, pad_token_id=1)
    text = byte_tokenizer().decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return hf_tokred.get_token_reduction(model), text, records[0].layer_lengths[0]


def test_generate_honours_the_settings_saved_in_the_folder_and_flags_replace_them(reduced_folder):
    prompt = "the settings travel in config.json, " * 3
    saved, text, lengths = _python_generate(reduced_folder, prompt)
    assert saved == TokenReductionConfig(method="evit", keep_ratio=0.6) and lengths[-1] < lengths[0]
    proc = run("generate", prompt, "--model", str(reduced_folder), "--max-new-tokens", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert TokenReductionConfig.coerce(out["token_reduction"]) == saved
    assert out["completion"] == text and out["reduction"]["layer_lengths"] == lengths
    proc = run("generate", prompt, "--model", str(reduced_folder), "--max-new-tokens", "3")
    assert proc.returncode == 0 and "[token reduction evit (the model's saved settings): kept" in proc.stdout
    # flags replace the saved settings as a whole, as token_reduction= does
    flags = TokenReductionConfig(keep_ratio=0.9)
    _, text, lengths = _python_generate(reduced_folder, prompt, token_reduction=flags)
    proc = run("generate", prompt, "--model", str(reduced_folder), "--keep-ratio", "0.9", "--max-new-tokens", "3",
               "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert TokenReductionConfig.coerce(out["token_reduction"]) == flags
    assert out["completion"] == text and out["reduction"]["layer_lengths"] == lengths


def test_push_output_of_a_bundled_model_names_it_portably(tmp_path):
    """A settings-only variant of a bundled model stores ``bundled:NAME`` (every installation has it), not this
    machine's folder, and loads as the bundled model with the settings."""
    out = tmp_path / "variant"
    proc = run("push", "--model", "bundled:mamba", "--keep-ratio", "0.8", "--output", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["base_model"] == "bundled:mamba"
    assert json.loads((out / "config.json").read_text())["base_model"] == "bundled:mamba"
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    reference, _ = hf_tokred.load_bundled("mamba", token_reduction=TokenReductionConfig(keep_ratio=0.8),
                                          dtype=loaded.dtype)
    ids = torch.arange(2, 60)[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, equal_nan=True, atol=0, rtol=0)


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
