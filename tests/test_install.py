"""install() / uninstall() restore transformers exactly; services that need no lm-eval work without it;
settings name the version that wrote them."""

import copy
import importlib.metadata
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, MambaForCausalLM

import hf_tokred
from hf_tokred import TokenReductionConfig
from hf_tokred.version import __version__

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, tmp_path: Path) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=tmp_path,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "", "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": str(ROOT)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


SNAPSHOT = """
import logging, torch, transformers
from transformers import (AutoConfig, AutoModelForCausalLM, Mamba2Config, Mamba2ForCausalLM, Mamba2Model,
                          MambaConfig, MambaForCausalLM, MambaModel, PreTrainedModel)
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.mamba import modeling_mamba

def snapshot():
    owners = [MambaForCausalLM, Mamba2ForCausalLM, MambaModel, Mamba2Model, MambaConfig, Mamba2Config,
              PreTrainedModel, AutoConfig] + [c for c in vars(modeling_auto).values() if isinstance(c, type)]
    state = {f"{o.__module__}.{o.__qualname__}": dict(vars(o)) for o in owners}
    state["modeling_mamba"] = dict(vars(modeling_mamba))
    state["config_mapping"] = dict(CONFIG_MAPPING._extra_content)
    state["lm_mapping"] = dict(AutoModelForCausalLM._model_mapping._extra_content)
    state["filters"] = list(logging.getLogger("transformers.integrations.hub_kernels").filters)
    return state

def logits():
    out = []
    for cfg in (MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=3),
                Mamba2Config(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=3, num_heads=4,
                             head_dim=16, n_groups=1, chunk_size=8)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            out.append(model(ids).logits)
    return out
"""


def test_uninstall_restores_transformers_exactly(tmp_path):
    out = run_python(SNAPSHOT + """
stock = logits()  # first: running a model may fill class-level caches
before = snapshot()
import hf_tokred
assert hf_tokred.installed() and snapshot() != before
hf_tokred.uninstall()
after = snapshot()
for key in before:
    assert before[key] == after[key], key
assert all(torch.equal(a, b) for a, b in zip(stock, logits())), "stock logits changed after uninstall"
hf_tokred.install()  # and back: reducing again
import hf_tokred
from hf_tokred import TokenReductionConfig
model = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=4))
hf_tokred.apply_token_reduction(model, TokenReductionConfig(keep_ratio=0.6, anchors=[1]))
assert len(model(torch.randint(0, 64, (1, 20))).plans) == 1
print("ok")
""", tmp_path)
    assert out.strip().endswith("ok")


def test_token_reduction_after_uninstall_says_the_plugin_is_uninstalled(tmp_path):
    """After uninstall(), stock transformers gets token_reduction=TokenReductionConfig(...): the error names the cause
    and the fix (hf_tokred.install()), for a concrete and an Auto class, and for a folder whose config.json already
    carries settings (where transformers would fail on JSON); deep copies elsewhere still work; install() restores
    reducing."""
    cfg = TokenReductionConfig(keep_ratio=0.8)
    plain = tmp_path / "plain"
    model, tok = hf_tokred.models.load_model("random:mamba-tiny")
    model.save_pretrained(plain)
    reduced = tmp_path / "reduced"
    hf_tokred.apply_token_reduction(model, cfg).save_pretrained(reduced)
    hf_tokred.uninstall()
    try:
        assert copy.deepcopy({"settings": cfg})["settings"] == cfg
        for cls in (MambaForCausalLM, AutoModelForCausalLM):
            for folder in (plain, reduced):
                with pytest.raises(TypeError, match=r"while hf_tokred is uninstalled .*call hf_tokred\.install\(\)"):
                    cls.from_pretrained(folder, token_reduction=cfg)
    finally:
        hf_tokred.install()
    assert hf_tokred.get_token_reduction(AutoModelForCausalLM.from_pretrained(plain, token_reduction=cfg)) == cfg


def test_fast_kernels_have_their_own_switch(tmp_path):
    out = run_python(SNAPSHOT + """
before = dict(vars(modeling_mamba))
import hf_tokred
from hf_tokred import fastpath
assert modeling_mamba.mamba_selective_scan is fastpath.mamba_selective_scan
hf_tokred.set_fast_kernels(False)
assert dict(vars(modeling_mamba)) == before and hf_tokred.installed()
hf_tokred.set_fast_kernels(True)
assert modeling_mamba.causal_conv1d_fn is fastpath.causal_conv1d_fn
print("ok")
""", tmp_path)
    assert out.strip().endswith("ok")


def _result_file(folder: Path, cfg: dict, model: str) -> Path:
    from hf_tokred.evaluation.results import SCHEMA, method_label, paper_row

    result = {"schema": SCHEMA, "model": model, "model_type": "mamba", "num_hidden_layers": 12,
              "method": method_label(cfg), "token_reduction": cfg, "flops_target": cfg["flops_reduction"],
              "tasks": {"piqa": {"status": "ok", "metrics": {"acc": 0.6, "acc_norm": 0.55}, "documents": 10}},
              "flops": {"exact": 0.18, "proxy": 0.17}, "settings": {"limit": 10}}
    result["row"] = paper_row(result)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "eval_bundled-mamba_utrc_flops20.json"
    path.write_text(json.dumps(result))
    return path


def test_report_and_push_eval_results_work_without_lm_eval(tmp_path):
    cfg = TokenReductionConfig(flops_reduction=0.2).to_dict()
    path = _result_file(tmp_path / "results", cfg, "bundled:mamba")
    out = run_python(f"""
import sys
sys.modules["lm_eval"] = None  # import lm_eval -> ImportError, as on a machine without it
from hf_tokred.cli import main
assert main(["report", "{path.parent}", "--output", "{tmp_path / 'report'}"]) == 0
assert main(["push", "--model", "bundled:mamba", "--flops-reduction", "0.2", "--eval-results", "{path}",
             "--output", "{tmp_path / 'variant'}"]) == 0
assert main(["eval", "--model", "bundled:mamba", "--tasks", "piqa", "--limit", "2"]) == 2  # says: install lm-eval
assert "lm_eval" not in [m for m in sys.modules if sys.modules[m] is not None]
print("ok")
""", tmp_path)
    assert out.strip().endswith("ok")
    assert "| PIQA |" in (tmp_path / "variant" / "README.md").read_text()
    assert (tmp_path / "report" / "report.md").is_file()


def test_settings_record_the_version_and_name_it_for_unknown_fields():
    d = TokenReductionConfig(flops_reduction=0.2).to_dict()
    assert d["version"] == __version__
    assert TokenReductionConfig.from_dict(d) == TokenReductionConfig(flops_reduction=0.2)
    newer = {**d, "version": "9.0.0", "window": 4}
    with pytest.raises(ValueError, match=r"written by hf_tokred 9\.0\.0; this is hf_tokred .*upgrade"):
        TokenReductionConfig.from_dict(newer)
    with pytest.raises(ValueError, match="unknown token_reduction field"):
        TokenReductionConfig.from_dict({**d, "window": 4})


def test_installed_version_is_the_package_version():
    """pip's metadata (pyproject reads it from hf_tokred/version.py) and ``hf_tokred.__version__`` agree: settings
    saved in config.json name the version a user can look up with ``pip show hf-tokred``."""
    assert importlib.metadata.version("hf-tokred") == __version__ == hf_tokred.__version__
