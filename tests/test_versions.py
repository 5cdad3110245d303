"""The supported transformers releases: the gate, each per-version adapter against what the installed release really
does, and the places that must agree on the range (pyproject, .ci/run).

The whole suite runs on the oldest and the newest supported release (``.ci/run``); the adapters' choices for the
releases not installed here are checked by their version arguments."""

import inspect
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import transformers
from packaging.requirements import Requirement
from packaging.version import Version
from transformers import Mamba2Config, MambaConfig, MambaForCausalLM
from transformers.models.mamba import modeling_mamba
from transformers.models.mamba2 import modeling_mamba2

from hf_tokred import compat
from hf_tokred.compat import (SUPPORTED_TRANSFORMERS, UnsupportedTransformersVersion, cache_argument,
                              check_transformers_version, mamba2_norm_is_grouped)

ROOT = Path(__file__).resolve().parents[1]


def test_transformers_version_gate():
    for good in ("5.22.0", "5.22.2", "5.23.0", "5.24.0", "5.24.3"):
        check_transformers_version(good)
    for bad in ("5.21.1", "5.25.0", "4.57.6", "6.0.0"):
        with pytest.raises(UnsupportedTransformersVersion, match=r"transformers>=5\.22\.0,<5\.25\.0") as info:
            check_transformers_version(bad)
        assert isinstance(info.value, ValueError) and isinstance(info.value, ImportError)
        assert f"found transformers=={bad}" in str(info.value) and "pip install" in str(info.value)


def test_import_refuses_an_unsupported_release():
    code = "import transformers; transformers.__version__ = '5.21.1'; import hf_tokred"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    assert proc.returncode != 0
    assert "UnsupportedTransformersVersion: hf_tokred supports transformers>=5.22.0,<5.25.0" in proc.stderr
    assert "found transformers==5.21.1" in proc.stderr


def test_the_range_is_the_same_in_pyproject_and_ci():
    lo, hi = SUPPORTED_TRANSFORMERS
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"transformers>={lo},<{hi.major}.{hi.minor}"' in pyproject
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^OLDEST_TRANSFORMERS={re.escape(str(lo))}$", ci, re.M)
    assert ci.rstrip().endswith(".venv/bin/python -m pytest -q tests/")  # the README's command, newest release
    assert '.venv-oldest/bin/python -m pytest -q tests/' in ci


def test_pyproject_admits_the_torch_releases_users_have():
    """No upper cap on torch (a GPU user's torch 2.14 / 2.15 stays in place): the range admits the releases .ci/run
    installs and the current ones; the triton extras admit the triton that torch's CUDA builds pin."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_spec = next(Requirement(r).specifier for r in project["dependencies"] if Requirement(r).name == "torch")
    ci = (ROOT / ".ci" / "run").read_text()
    tested = [re.search(rf"^{name}=(\S+)$", ci, re.M).group(1) for name in ("CPU_TORCH", "NEWER_TORCH")]
    assert tested == ["2.13.0", "2.14.1"]
    for version in (*tested, "2.15.0", "2.16.0", torch.__version__.split("+")[0]):
        assert torch_spec.contains(version), (version, torch_spec)
    for extra in ("triton", "gpu", "test"):
        triton = next(Requirement(r) for r in project["optional-dependencies"][extra] if r.startswith("triton"))
        for pinned in ("3.7.1", "3.8.0"):  # torch 2.13 / 2.14 CUDA builds
            assert triton.specifier.contains(pinned), (extra, triton)


# ----------------------------------------------------------------------------- each adapter: its choice by version ...


def test_adapters_choose_by_version():
    assert cache_argument(Version("5.22.0")) == cache_argument(Version("5.23.0")) == "cache_params"
    assert cache_argument(Version("5.24.0")) == cache_argument(Version("5.24.3")) == "cache"
    assert not mamba2_norm_is_grouped(Version("5.22.2"))
    assert mamba2_norm_is_grouped(Version("5.23.0")) and mamba2_norm_is_grouped(Version("5.24.0"))


# ----------------------------------------------------------------------------- ... and against the installed release


def test_cache_argument_is_what_the_installed_mamba_code_takes():
    for fn in (modeling_mamba.MambaMixer.forward, modeling_mamba.MambaBlock.forward,
               modeling_mamba2.Mamba2Mixer.forward):
        assert compat.CACHE_ARG in inspect.signature(inspect.unwrap(fn)).parameters, fn
    model = MambaForCausalLM(MambaConfig(vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=2)).eval()
    ids = torch.randint(0, 32, (1, 6))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = compat.cache_of(out)
        assert cache is not None and cache.has_previous_state()
        step = model(ids[:, -1:], **compat.cache_kwargs(cache), use_cache=True)
        fresh = model(torch.cat([ids, ids[:, -1:]], 1)).logits[:, -1]
    torch.testing.assert_close(step.logits[:, -1], fresh, atol=1e-5, rtol=0)  # the cache was really used


def test_reducing_outputs_carry_the_cache_where_generate_looks():
    import hf_tokred

    model = MambaForCausalLM(MambaConfig(vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=3)).eval()
    hf_tokred.apply_token_reduction(model, {"keep_ratio": 0.7, "anchors": [1]})
    with torch.no_grad():
        out = model(torch.randint(0, 32, (1, 12)), use_cache=True)
    assert out.cache is not None and compat.cache_of(out) is out.cache
    names = getattr(transformers.generation.utils, "ALL_CACHE_NAMES")
    assert next(name for name in names if name in out) == compat.CACHE_ARG


def test_recurrent_mask_adapter_on_the_installed_release():
    config = MambaConfig(vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=1)
    embeds = torch.zeros(2, 5, 16)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert torch.equal(compat.recurrent_mask(config, embeds, mask, None), mask)
    assert compat.recurrent_mask(config, embeds, torch.ones(2, 5, dtype=torch.long), None) is None
    assert compat.recurrent_mask(config, embeds[:, :1], mask, None) is None  # a decode step


def test_mamba2_norm_grouping_matches_the_installed_release():
    config = Mamba2Config(vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=1, num_heads=4, head_dim=8,
                          n_groups=2, chunk_size=8)
    mixer = modeling_mamba2.Mamba2Mixer(config, layer_idx=0)
    x, gate = torch.randn(3, 32), torch.randn(3, 32)
    y = (x * torch.nn.functional.silu(gate)).view(3, 2, 16)
    grouped = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + config.layer_norm_epsilon)).view(3, 32)
    with torch.no_grad():
        got = mixer.norm(x, gate)
    assert torch.allclose(got, grouped * mixer.norm.weight, atol=1e-6) == mamba2_norm_is_grouped()
