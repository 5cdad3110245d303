"""Reduced variants on the Hub: settings-only variants, full copies, model cards and ``hf-tokred push``.

The Hub is replaced by a local folder: a fake ``api`` whose ``create_repo`` / ``upload_folder`` copy into
``tmp/hub/<repo_id>/``, and everything is loaded back from that folder (transformers treats a local folder like a
repo).  Nothing here touches the network.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, pipeline

import hf_tokred
import hf_tokred.cli
import hf_tokred.hub.publish
import hf_tokred.variant
from hf_tokred import TokenReductionConfig
from hf_tokred import hub
from hf_tokred.flops import flops_reduction

from conftest import tiny_model, word_tokenizer


SETTINGS = {"method": "utrc", "flops_reduction": 0.2, "anchors": [1, 3]}
IDS = torch.randint(2, 96, (2, 20), generator=torch.Generator().manual_seed(0))
BASE_CARD = "---\nlicense: apache-2.0\n---\n# tiny base\n"


class FakeHub:
    """Stands in for ``huggingface_hub.HfApi``: repos are folders under ``root``."""

    def __init__(self, root: Path):
        self.root = root
        self.calls = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        (self.root / repo_id).mkdir(parents=True, exist_ok=True)
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        self.calls.append(("upload_folder", repo_id, kwargs))
        shutil.copytree(folder_path, self.root / repo_id, dirs_exist_ok=True)
        return type("CommitInfo", (), {"commit_url": f"file://{self.root / repo_id}"})()


def make_base(tmp_path, family, card=BASE_CARD):
    """A tiny Mamba / Mamba-2 checkpoint with a tokenizer (and a card declaring its licence)."""
    path = tmp_path / f"base-{family}"
    tiny_model(family).save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    if card:
        (path / "README.md").write_text(card)
    return path


@pytest.fixture
def base(tmp_path, family):
    return make_base(tmp_path, family)


@pytest.fixture
def mamba_base(tmp_path):
    return make_base(tmp_path, "mamba")


@pytest.fixture
def fake_hub(tmp_path):
    return FakeHub(tmp_path / "hub")


def _reference_logits(path, settings):
    model = AutoModelForCausalLM.from_pretrained(path, token_reduction=settings).eval()
    with torch.no_grad():
        return model(IDS).logits


# ----------------------------------------------------------------------------- settings-only variants


def test_push_settings_only_variant_uploads_config_tokenizer_card_and_stub(base, fake_hub):
    with pytest.warns(UserWarning, match="not a Hub id"):
        hub.push_variant(base, SETTINGS, "someone/tiny-utrc", api=fake_hub, private=True)
    repo = fake_hub.root / "someone/tiny-utrc"
    files = {p.name for p in repo.iterdir()}
    assert {"config.json", "hf_tokred_variant.py", "README.md", "tokenizer.json", "tokenizer_config.json"} <= files
    assert not any(name.endswith((".safetensors", ".bin")) for name in files)  # no weights duplicated
    config = json.loads((repo / "config.json").read_text())
    assert config["model_type"] == "hf_tokred_variant"
    assert config["base_model"] == str(base.resolve())
    assert config["token_reduction"] == TokenReductionConfig(**SETTINGS).to_dict()
    assert config["architectures"] == json.loads((base / "config.json").read_text())["architectures"]
    assert config["auto_map"] == {"AutoConfig": "hf_tokred_variant.TokenReductionVariantConfig",
                                  "AutoModelForCausalLM": "hf_tokred_variant.TokenReductionVariant"}
    assert [c[0] for c in fake_hub.calls] == ["create_repo", "upload_folder"]
    assert fake_hub.calls[0][2]["private"] is True
    stub = (repo / "hf_tokred_variant.py").read_text()
    assert "someone/tiny-utrc is a settings-only hf_tokred variant of" in stub and "pip install hf-tokred" in stub


def test_variant_loads_as_the_reduced_base_class(base, fake_hub):
    with pytest.warns(UserWarning):
        hub.push_variant(base, SETTINGS, "someone/v", api=fake_hub)
    repo = fake_hub.root / "someone/v"
    assert isinstance(AutoConfig.from_pretrained(repo), hub.TokenReductionVariantConfig)
    model = AutoModelForCausalLM.from_pretrained(repo).eval()
    assert type(model) is type(AutoModelForCausalLM.from_pretrained(base))  # the stock class, not a wrapper
    assert hf_tokred.get_token_reduction(model) == TokenReductionConfig(**SETTINGS)
    with torch.no_grad():
        out = model(IDS)
    assert [a for a, _ in out.plans] == [1, 3]
    assert torch.allclose(out.logits, _reference_logits(base, SETTINGS), atol=1e-6, equal_nan=True)
    # the caller's token_reduction wins over the saved block; None gives the dense base
    other = AutoModelForCausalLM.from_pretrained(repo, token_reduction={"method": "tome", "keep_ratio": 0.8,
                                                                        "anchors": [2]})
    assert hf_tokred.get_token_reduction(other) == TokenReductionConfig(method="tome", keep_ratio=0.8, anchors=[2])
    dense = AutoModelForCausalLM.from_pretrained(repo, token_reduction=None)
    assert hf_tokred.get_token_reduction(dense) is None
    assert type(hub.TokenReductionVariant.from_pretrained(repo)) is type(model)


def test_pipeline_on_a_variant_generates_like_the_reduced_base(base, fake_hub):
    with pytest.warns(UserWarning):
        hub.push_variant(base, SETTINGS, "someone/v", api=fake_hub)
    repo = str(fake_hub.root / "someone/v")
    generator = pipeline("text-generation", model=repo)
    assert hf_tokred.get_token_reduction(generator.model) == TokenReductionConfig(**SETTINGS)
    prompt = " ".join(f"w{i}" for i in range(10, 30))
    generated = generator(prompt, max_new_tokens=4, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    tok = AutoTokenizer.from_pretrained(repo)
    ref = AutoModelForCausalLM.from_pretrained(base, token_reduction=SETTINGS).eval()
    enc = tok(prompt, return_tensors="pt")
    ids = ref.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert list(generated) == ids[0].tolist()


def test_loader_forwards_base_revision_and_loading_kwargs_only(tmp_path, monkeypatch, base):
    out = hub.save_variant(base, SETTINGS, tmp_path / "v", base_revision="abc123")
    assert json.loads((out / "config.json").read_text())["base_revision"] == "abc123"
    calls = []

    class Recorder:
        @staticmethod
        def from_pretrained(name, *args, **kwargs):
            calls.append((name, kwargs))
            return "model"

    monkeypatch.setattr(hf_tokred.variant, "AutoModelForCausalLM", Recorder)
    expected = (str(base.resolve()), {"dtype": torch.float16, "revision": "abc123",
                                      "token_reduction": TokenReductionConfig(**SETTINGS).to_dict()})
    # called directly: revision applies to the variant folder's config, never to the base
    assert hub.TokenReductionVariant.from_pretrained(out, dtype=torch.float16, revision="variant-rev") == "model"
    # called by AutoModelForCausalLM: the variant's config and hub kwargs come along and are not forwarded
    config = hub.TokenReductionVariantConfig.from_pretrained(out)
    assert hub.TokenReductionVariant.from_pretrained(out, config=config, dtype=torch.float16, revision="variant-rev",
                                                     subfolder="", _from_auto=True, adapter_kwargs={},
                                                     trust_remote_code=False) == "model"
    assert calls == [expected, expected]


def test_variant_errors_are_clear(tmp_path, base):
    with pytest.raises(ValueError, match="not reachable"):
        hub.save_variant(base, {"flops_reduction": 0.9, "anchors": [4]}, tmp_path / "v")
    with pytest.raises(ValueError, match="no token-reduction settings"):
        hub.save_variant(base, None, tmp_path / "v")
    with pytest.raises(ValueError, match="random weights .* full copy"):
        hub.save_variant("random:mamba-tiny", SETTINGS, tmp_path / "v")
    out = hub.save_variant(base, SETTINGS, tmp_path / "v")
    config = json.loads((out / "config.json").read_text())
    config["token_reduction"]["method"] = "bogus"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="token_reduction block in the config of .* is invalid"):
        AutoModelForCausalLM.from_pretrained(out)
    with pytest.raises(TypeError, match="loader, not a model"):
        hub.TokenReductionVariant()


def test_install_is_idempotent():
    hf_tokred.install()
    hf_tokred.install()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    assert CONFIG_MAPPING["hf_tokred_variant"] is hub.TokenReductionVariantConfig


# ----------------------------------------------------------------------------- full copies


def test_full_copy_keeps_model_type_and_weights(base, fake_hub):
    hub.push_variant(base, SETTINGS, "someone/full", api=fake_hub, full_copy=True)
    repo = fake_hub.root / "someone/full"
    config = json.loads((repo / "config.json").read_text())
    assert config["model_type"] == json.loads((base / "config.json").read_text())["model_type"]
    assert config["token_reduction"] == TokenReductionConfig(**SETTINGS).to_dict()
    assert (repo / "model.safetensors").is_file() and (repo / "tokenizer.json").is_file()
    assert "full copy" in (repo / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(repo).eval()
    with torch.no_grad():
        assert torch.allclose(model(IDS).logits, _reference_logits(base, SETTINGS), atol=1e-6, equal_nan=True)


def test_full_copy_of_a_loaded_model_leaves_its_settings_alone(tmp_path):
    model, tok = tiny_model("mamba"), word_tokenizer()
    out = hub.save_variant(model, SETTINGS, tmp_path / "full", tokenizer=tok, full_copy=True)
    assert hf_tokred.get_token_reduction(model) is None
    assert json.loads((out / "config.json").read_text())["token_reduction"]["anchors"] == [1, 3]


# ----------------------------------------------------------------------------- stock transformers, no plugin

_NO_PLUGIN = """
import sys
sys.modules["hf_tokred"] = None  # as if hf-tokred were not installed
from transformers import AutoModelForCausalLM
for trust in (True, False):
    try:
        AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=trust)
    except (ImportError, ValueError) as err:
        print(f"{trust}|{type(err).__name__}|{err}".replace(chr(10), " "))
"""

_STOCK = """
import sys, torch
from transformers import AutoModelForCausalLM
full = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
assert "hf_tokred" not in sys.modules and "token_reduction" not in vars(type(full).forward)
with torch.no_grad():
    torch.save(full(torch.load(sys.argv[3])).logits, sys.argv[4])
# plugin installed but not imported: trust_remote_code=True runs the stub, which imports it
variant = AutoModelForCausalLM.from_pretrained(sys.argv[2], trust_remote_code=True)
print(type(variant).__name__, variant.config.token_reduction["method"], "hf_tokred" in sys.modules)
"""


def _env(tmp_path):
    return {"HF_HUB_OFFLINE": "1", "PATH": os.environ.get("PATH", ""), "HF_MODULES_CACHE": str(tmp_path / "modules"),
            "HOME": str(tmp_path), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def stock_runs(tmp_path_factory):
    """Both stock-transformers subprocesses, started together (each spends most of its time importing)."""
    tmp = tmp_path_factory.mktemp("stock")
    base = tmp / "base"
    tiny_model("mamba").save_pretrained(base)
    word_tokenizer().save_pretrained(base)
    variant = hub.save_variant(base, SETTINGS, tmp / "hub" / "someone" / "v", repo_id="someone/v")
    full = hub.save_variant(base, SETTINGS, tmp / "full", full_copy=True)
    torch.save(IDS, tmp / "ids.pt")
    commands = {
        "no_plugin": [sys.executable, "-c", _NO_PLUGIN, str(variant)],
        "stock": [sys.executable, "-c", _STOCK, str(full), str(variant), str(tmp / "ids.pt"), str(tmp / "out.pt")],
    }
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                    text=True, env=_env(tmp / name)) for name, cmd in commands.items()}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        results[name] = (proc.returncode, out, err)
    return tmp, base, results


def test_without_the_plugin_the_messages_name_the_fix(stock_runs):
    _, base, results = stock_runs
    code, out, err = results["no_plugin"]
    lines = dict(line.split("|", 1) for line in out.splitlines() if "|" in line)
    assert lines["True"] == (f"ImportError|someone/v is a settings-only hf_tokred variant of {base.resolve()}; install "
                             "the plugin: pip install hf-tokred, then `import hf_tokred` before from_pretrained"), err
    assert lines["False"].startswith("ValueError|") and "trust_remote_code=True" in lines["False"], err


def test_stock_transformers_loads_a_full_copy_and_trust_remote_code_finds_the_plugin(stock_runs):
    tmp, base, results = stock_runs
    code, out, err = results["stock"]
    assert code == 0, err[-3000:]
    assert out.split()[-3:] == ["MambaForCausalLM", "utrc", "True"]
    dense = AutoModelForCausalLM.from_pretrained(base, token_reduction=None).eval()
    with torch.no_grad():
        assert torch.allclose(torch.load(tmp / "out.pt"), dense(IDS).logits, atol=1e-6)  # a normal dense model


# ----------------------------------------------------------------------------- model card


def _eval_result(settings, model_type="mamba", layers=6, acc=0.625, model="base"):
    from hf_tokred.evaluation.results import SCHEMA, paper_row

    result = {
        "schema": SCHEMA, "model": str(model), "model_type": model_type, "num_hidden_layers": layers, "method": "utrc",
        "token_reduction": TokenReductionConfig.coerce(settings).to_dict(), "flops_target": 0.2,
        "tasks": {"piqa": {"status": "ok", "metrics": {"acc": acc, "acc_norm": 0.5}, "documents": 8},
                  "lambada_openai": {"status": "missing", "metrics": {}, "note": "offline"}},
        "flops": {"exact": 0.17, "proxy": 0.16},
        "settings": {"limit": 8, "versions": {"lm_eval": "0.4.13"}},
    }
    result["row"] = paper_row(result)
    return result


def test_model_card_states_settings_flops_licence_and_how_to_load(base, tmp_path, family):
    out = hub.save_variant(base, SETTINGS, tmp_path / "v", repo_id="someone/v")
    card = ModelCard.load(out / "README.md")
    assert card.data.license == "apache-2.0" and card.data.library_name == "transformers"
    assert card.data.base_model is None  # a local path is not a Hub id: kept out of the metadata
    assert set(card.data.tags) >= {"hf_tokred", "token-reduction", family, "utrc"}
    text = card.text
    config = AutoConfig.from_pretrained(base)
    schedule = TokenReductionConfig(**SETTINGS).resolve(config.num_hidden_layers)
    lengths = schedule.layer_lengths(2048)
    exact = flops_reduction(config, lengths, 2048)
    assert f"**{100 * exact:.1f} %**" in text and "analytic" in text and "2048-token" in text
    assert "blocks **1, 3**" in text and f"**{schedule.keep_ratio:.4f}**" in text
    assert "settings only" in text and str(base.resolve()) in text
    assert 'from_pretrained("someone/v")' in text and "import hf_tokred" in text
    assert "`apache-2.0`" in text
    assert "No evaluation results were supplied" in text and "| PIQA |" not in text  # never invented


def test_model_card_eval_table_only_from_matching_results(base, tmp_path, family):
    result = _eval_result(SETTINGS, model_type=family, model=base)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(result))
    out = hub.save_variant(base, SETTINGS, tmp_path / "v", eval_results=path)
    text = (out / "README.md").read_text()
    assert "| PIQA |" in text and "62.5" in text and "lambada_openai" in text
    assert "No evaluation results" not in text
    with pytest.raises(ValueError, match="not with this variant's settings"):
        hub.save_variant(base, {"method": "tome", "flops_reduction": 0.2}, tmp_path / "w", eval_results=path)
    with pytest.raises(ValueError, match="hf-tokred eval"):
        hub.save_variant(base, SETTINGS, tmp_path / "w", eval_results={"row": {}})


def test_licence_unknown_says_see_the_base_model(tmp_path):
    base = tmp_path / "base"
    tiny_model("mamba2").save_pretrained(base)
    word_tokenizer().save_pretrained(base)
    text = (hub.save_variant(base, SETTINGS, tmp_path / "v") / "README.md").read_text()
    assert "See the base model" in text and ModelCard.load(tmp_path / "v" / "README.md").data.license is None


def test_hub_ids_go_into_the_card_metadata(family):
    assert hub.is_hub_id("state-spaces/mamba-130m-hf") and hub.is_hub_id("gpt2")
    assert not hub.is_hub_id("random:mamba-tiny") and not hub.is_hub_id("bundled:mamba")
    assert not hub.is_hub_id("/abs/path") and not hub.is_hub_id("../up/one")
    config = tiny_model(family).config
    settings = {"method": "evit", "keep_ratio": 0.7, "anchors": [2]}
    card = hub.make_model_card(base="org/base", config=config, token_reduction=settings, kind="settings",
                               repo_id="someone/v", license=("other", "base-licence", "https://example.org/l"))
    assert card.data.base_model == "org/base" and card.data.base_model_relation == "adapter"
    assert card.data.license == "other" and card.data.license_name == "base-licence"
    assert "https://huggingface.co/org/base" in card.text and "keeping **0.7** of the tokens" in card.text
    full = hub.make_model_card(base="org/base", config=config, token_reduction=settings, kind="full", repo_id="a/b")
    assert full.data.base_model == "org/base" and getattr(full.data, "base_model_relation", None) is None
    assert "See the base model" in full.text and "stock transformers loads it as the ordinary dense model" in full.text


# ----------------------------------------------------------------------------- hf-tokred push


def run_cli(argv, monkeypatch):
    return hf_tokred.cli.main(argv)


def test_push_output_writes_a_settings_only_variant(base, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    assert run_cli(["push", "--model", str(base), "--method", "utrc", "--flops-reduction", "0.2", "--anchors", "1,3",
                    "--output", str(out),
                    "--repo", "someone/v", "--json"], monkeypatch) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["uploaded"] is False and summary["kind"] == "settings-only"
    assert summary["token_reduction"] == TokenReductionConfig(**SETTINGS).to_dict()
    assert 'from_pretrained("someone/v")' in (out / "README.md").read_text()
    assert hf_tokred.get_token_reduction(AutoModelForCausalLM.from_pretrained(out)) == TokenReductionConfig(**SETTINGS)


def test_push_full_copy_uploads_with_the_hf_api(tmp_path, monkeypatch, capsys):
    fake = FakeHub(tmp_path / "hub")
    monkeypatch.setattr(hf_tokred.hub.publish, "HfApi", lambda token=None: fake)
    result = _eval_result({"method": "utrc", "flops_reduction": 0.2}, layers=12, acc=0.4, model="random:mamba-tiny")
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert run_cli(["push", "--model", "random:mamba-tiny", "--method", "utrc", "--flops-reduction", "0.2", "--full-copy",
                    "--private",
                    "--repo", "someone/tiny-full", "--eval-results", str(tmp_path / "r.json"), "--json"],
                   monkeypatch) == 0
    assert json.loads(capsys.readouterr().out)["uploaded"] is True
    repo = tmp_path / "hub" / "someone/tiny-full"
    assert json.loads((repo / "config.json").read_text())["model_type"] == "mamba"
    assert (repo / "model.safetensors").is_file() and (repo / "tokenizer.json").is_file()
    card = (repo / "README.md").read_text()
    assert "| PIQA |" in card and "40.0" in card and "See the base model" in card
    assert "random weights (random:mamba-tiny, for testing only)" in card
    assert fake.calls[0][2]["private"] is True


def test_push_upload_failure_exits_1_with_the_fix(tmp_path, monkeypatch, capsys):
    class Offline:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, **kwargs):
            raise OSError("no network")

    monkeypatch.setattr(hf_tokred.hub.publish, "HfApi", Offline)
    assert run_cli(["push", "--model", "random:mamba2-tiny", "--keep-ratio", "0.8", "--full-copy", "--repo",
                    "someone/x"], monkeypatch) == 1
    err = capsys.readouterr().err
    assert "uploading to someone/x failed (OSError: no network)" in err and "--output DIR" in err


@pytest.mark.parametrize("argv, flag", [
    (["--model", "random:mamba-tiny", "--flops-reduction", "0.2", "--full-copy"], "--repo is required"),
    (["--model", "random:mamba-tiny", "--flops-reduction", "0.2", "--full-copy", "--repo", "noslash"], "--repo must"),
    (["--model", "org/model", "--repo", "someone/v"], "--flops-reduction"),
    (["--model", "random:mamba-tiny", "--flops-reduction", "0.2", "--repo", "someone/v"], "--full-copy"),
    (["--model", "BASE", "--flops-reduction", "0.2", "--repo", "someone/v"], "--model BASE is not a Hub id"),
    (["--model", "BASE", "--flops-reduction", "0.2", "--output", "OUT", "--eval-results", "missing.json"],
     "--eval-results"),
    (["--model", "BASE", "--flops-reduction", "0.9", "--anchors", "4", "--output", "OUT"], "not reachable"),
])
def test_push_usage_errors_exit_2_and_name_the_flag(argv, flag, mamba_base, tmp_path, monkeypatch, capsys):
    base = mamba_base
    argv = [str(base) if a == "BASE" else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    flag = flag.replace("BASE", str(base))
    assert run_cli(["push", *argv], monkeypatch) == 2
    assert flag in capsys.readouterr().err
