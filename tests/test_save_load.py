"""Settings travel with the model: save_pretrained / from_pretrained / push_to_hub, and loading errors."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_tokred
from hf_tokred import TokenReductionConfig

from conftest import stock_forward, tiny_model

SETTINGS = dict(method="utrc", keep_ratio=0.6, anchors=[1, 3])
IDS = torch.randint(2, 96, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def saved(tmp_path, family):
    model = tiny_model(family)
    hf_tokred.apply_token_reduction(model, SETTINGS)
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        return tmp_path, model, model(IDS).logits


def test_config_json_holds_a_plain_dict(saved):
    path, _, _ = saved
    block = json.loads((path / "config.json").read_text())["token_reduction"]
    assert block == TokenReductionConfig(**SETTINGS).to_dict()


@pytest.mark.parametrize("loader", ["class", "auto"])
def test_reload_reduces_with_identical_outputs(saved, loader):
    path, model, logits = saved
    cls = AutoModelForCausalLM if loader == "auto" else type(model)
    again = cls.from_pretrained(path).eval()
    assert type(again) is type(model)
    with torch.no_grad():
        out = again(IDS)
    assert out.plans and torch.equal(out.computed_mask, torch.isfinite(logits[..., 0]))
    assert torch.allclose(out.logits, logits, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("loader", ["class", "auto"])
def test_token_reduction_none_switches_it_off(saved, loader):
    path, model, _ = saved
    cls = AutoModelForCausalLM if loader == "auto" else type(model)
    plain = cls.from_pretrained(path, token_reduction=None).eval()
    assert getattr(plain.config, "token_reduction", None) is None
    with torch.no_grad():
        out = plain(IDS)
        ref = stock_forward(plain, IDS)
    assert not hasattr(out, "plans") or out.plans is None
    assert torch.allclose(out.logits, ref.logits, atol=1e-6)
    plain.save_pretrained(path / "plain")
    assert "token_reduction" not in json.loads((path / "plain" / "config.json").read_text())


@pytest.mark.parametrize("loader", ["class", "auto"])
def test_from_pretrained_overrides_and_accepts_dicts(saved, loader):
    path, model, _ = saved
    cls = AutoModelForCausalLM if loader == "auto" else type(model)
    other = cls.from_pretrained(path, token_reduction={"method": "tome", "keep_ratio": 0.8, "anchors": [2]})
    assert hf_tokred.get_token_reduction(other) == TokenReductionConfig(method="tome", keep_ratio=0.8, anchors=[2])
    with torch.no_grad():
        assert [layer for layer, _ in other(IDS).plans] == [2]


def test_stock_transformers_loads_the_folder_as_a_normal_model(saved):
    path, model, _ = saved
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
        "assert 'hf_tokred' not in sys.modules\n"
        "ids = torch.load(sys.argv[2])\n"
        "with torch.no_grad(): torch.save(m(ids).logits, sys.argv[3])\n"
    )
    torch.save(IDS, path / "ids.pt")
    subprocess.run([sys.executable, "-c", script, str(path), str(path / "ids.pt"), str(path / "out.pt")], check=True,
                   env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    with torch.no_grad():
        ref = stock_forward(model, IDS).logits
    assert torch.allclose(torch.load(path / "out.pt"), ref, atol=1e-6)


def test_push_to_hub_uploads_the_settings(saved, monkeypatch):
    """push_to_hub uploads what save_pretrained writes; capture it at the upload call (no network)."""
    import transformers.utils.hub as hub

    path, model, _ = saved
    uploaded = {}

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            return type("Repo", (), {"repo_id": repo_id})()

    def fake_upload(self, working_dir, repo_id, files_timestamps, **kwargs):
        uploaded["repo_id"] = repo_id
        uploaded["config"] = json.loads((working_dir / "config.json" if hasattr(working_dir, "joinpath") else
                                         __import__("pathlib").Path(working_dir) / "config.json").read_text())

    monkeypatch.setattr(hub, "hf_api", lambda: FakeApi())
    monkeypatch.setattr(hub, "create_and_tag_model_card", lambda *a, **k: type("Card", (), {"save": lambda s, p: None})())
    monkeypatch.setattr(type(model), "_upload_modified_files", fake_upload)
    model.push_to_hub("someone/tiny-reduced")
    assert uploaded["repo_id"] == "someone/tiny-reduced"
    assert uploaded["config"]["token_reduction"] == TokenReductionConfig(**SETTINGS).to_dict()


def test_corrupt_block_is_rejected_on_load(saved):
    path, model, _ = saved
    cfg = json.loads((path / "config.json").read_text())
    cfg["token_reduction"]["method"] = "bogus"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"token_reduction block in the config of .* is invalid: .*method='bogus'"):
        type(model).from_pretrained(path)
    with pytest.raises(ValueError, match="token_reduction=None to ignore it"):
        AutoModelForCausalLM.from_pretrained(path)
    assert getattr(type(model).from_pretrained(path, token_reduction=None).config, "token_reduction", None) is None


def test_schedule_that_does_not_fit_is_rejected_on_load(saved):
    path, model, _ = saved
    with pytest.raises(ValueError, match="reach outside a 6-layer model"):
        type(model).from_pretrained(path, token_reduction={"keep_ratio": 0.9, "anchors": [9]})
    with pytest.raises(ValueError, match="method"):
        type(model).from_pretrained(path, token_reduction={"keep_ratio": 0.9, "method": "nope"})


def test_non_mamba_models_refuse_token_reduction(tmp_path):
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    llama.save_pretrained(tmp_path)
    for cls in (LlamaForCausalLM, AutoModelForCausalLM):
        with pytest.raises(ValueError, match="LlamaForCausalLM .*cannot reduce tokens"):
            cls.from_pretrained(tmp_path, token_reduction={"keep_ratio": 0.9})
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path), LlamaForCausalLM)  # plain loading unaffected
