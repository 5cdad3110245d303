"""Shared fixtures: tiny seeded Mamba / Mamba-2 models and a word-level tokenizer (all offline).

Also, before anything imports ``hf_tokred``:

* ``STOCK`` keeps transformers' own Mamba / Mamba-2 kernels and forwards (the independent oracles; ``import
  hf_tokred`` rebinds some of them), and :func:`stock_transformers` puts them back for a block;
* hypothesis profiles: ``ci`` (the default: ``derandomize=True``, the same examples on every run) and ``explore``
  (fresh random examples, 10x as many): ``pytest tests/test_properties.py --hypothesis-profile=explore
  --hypothesis-show-statistics``;
* the no-silent-skip policy: a missing test dependency is an error, and under ``HF_TOKRED_CI=1`` (``.ci/run``) a
  skipped test fails the run; the number of skipped tests is always printed.
"""

import contextlib
import importlib.util
import os
import sys
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from transformers.models.mamba import modeling_mamba as _modeling_mamba  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2 as _modeling_mamba2  # noqa: E402

if "hf_tokred" in sys.modules:  # pragma: no cover - would make every "against transformers" test circular
    raise RuntimeError("hf_tokred was imported before tests/conftest.py could keep transformers' own Mamba kernels")


def _module_functions(module) -> dict:
    return {k: v for k, v in vars(module).items() if callable(v) and not isinstance(v, type)}


#: transformers' own Mamba code as it was before ``import hf_tokred``: module-level functions (the Mamba-1 scan
#: and convolution, the Mamba-2 chunked scan, ...) and the forwards / generate of the model classes.
STOCK = types.SimpleNamespace(
    mamba_selective_scan=_modeling_mamba.mamba_selective_scan,
    causal_conv1d_fn=_modeling_mamba.causal_conv1d_fn,
    mamba2_chunk_scan=_modeling_mamba2.mamba2_chunk_scan,
    modules={_modeling_mamba: _module_functions(_modeling_mamba), _modeling_mamba2: _module_functions(_modeling_mamba2)},
    methods={cls: {k: cls.__dict__.get(k) for k in ("forward", "generate")}  # None: inherited
             for cls in (_modeling_mamba.MambaModel, _modeling_mamba.MambaForCausalLM, _modeling_mamba2.Mamba2Model,
                         _modeling_mamba2.Mamba2ForCausalLM)},
)

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    Mamba2Config,
    Mamba2ForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import hf_tokred  # noqa: E402,F401  (installs the hooks)

assert STOCK.mamba_selective_scan.__module__ == "transformers.models.mamba.modeling_mamba"
assert _modeling_mamba.mamba_selective_scan is not STOCK.mamba_selective_scan, "hf_tokred no longer patches the scan?"

logging.set_verbosity_error()
torch.set_num_threads(1)

VOCAB = 96


def tiny_config(family: str, layers: int = 6):
    common = dict(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=layers, pad_token_id=0,
                  eos_token_id=1, bos_token_id=1)
    if family == "mamba":
        return MambaConfig(**common, expand=2)
    return Mamba2Config(**common, expand=2, num_heads=4, head_dim=16, n_groups=1, chunk_size=8)


def tiny_model(family: str, layers: int = 6, seed: int = 0):
    torch.manual_seed(seed)
    cls = MambaForCausalLM if family == "mamba" else Mamba2ForCausalLM
    model = cls(tiny_config(family, layers)).eval()
    # Random init leaves A_log/D at their structured values; perturb so every channel differs.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


@pytest.fixture(params=["mamba", "mamba2"])
def family(request):
    return request.param


@pytest.fixture
def model(family):
    return tiny_model(family)


@contextlib.contextmanager
def stock_transformers():
    """Within the block, transformers' Mamba modules and classes are exactly as before ``import hf_tokred``."""
    saved = []
    for module, functions in STOCK.modules.items():
        for name, fn in functions.items():
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, fn)
    for cls, methods in STOCK.methods.items():
        for name, fn in methods.items():
            saved.append((cls, name, cls.__dict__.get(name)))
            if fn is not None:
                setattr(cls, name, fn)
            elif name in cls.__dict__:
                delattr(cls, name)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is not None:
                setattr(owner, name, value)
            elif isinstance(owner, type) and name in owner.__dict__:
                delattr(owner, name)


def stock_forward(model, *args, **kwargs):
    """Call stock transformers' forward of ``model`` (its own kernels, reduction off): the independent reference."""
    settings = model.config.__dict__.pop("token_reduction", None)
    try:
        with stock_transformers():
            return model(*args, **kwargs)
    finally:
        if settings is not None:
            model.config.__dict__["token_reduction"] = settings


def word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary: ``<pad>``=0, ``<eos>``=1, words ``w2`` .. ``w95``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left")


# ----------------------------------------------------------------------------- hypothesis profiles

_HYPOTHESIS = dict(deadline=None, database=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", derandomize=True, max_examples=100, **_HYPOTHESIS)
settings.register_profile("explore", derandomize=False, max_examples=1000, **_HYPOTHESIS)
settings.load_profile(os.environ.get("HF_TOKRED_HYPOTHESIS_PROFILE", "ci"))


def examples(n: int) -> settings:
    """``settings(max_examples=n)`` in the ``ci`` profile, scaled by the loaded profile (``explore``: 10 n) and
    otherwise inheriting it (``derandomize`` etc.), so one flag switches every property test to fresh seeds."""
    return settings(max_examples=max(1, n * settings.default.max_examples // 100))


# ----------------------------------------------------------------------------- no silent skips

#: Packages the test suite needs (the ``test`` extra); without one, whole groups of tests would not run.
REQUIRED_TEST_MODULES = ("hypothesis", "triton", "optimum.quanto")
#: Skip reasons allowed under HF_TOKRED_CI=1: only tests that need hardware this machine does not have.
CI_ALLOWED_SKIP = ("needs a CUDA device",)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


def pytest_configure(config):
    missing = [m for m in REQUIRED_TEST_MODULES if not _importable(m)]
    if missing and os.environ.get("HF_TOKRED_ALLOW_MISSING_TEST_DEPS") != "1":
        raise pytest.UsageError(
            f"missing test dependencies: {', '.join(missing)} (install the test extra: pip install -e '.[test]'); "
            "their tests would be skipped, not run. Set HF_TOKRED_ALLOW_MISSING_TEST_DEPS=1 to run without them."
        )
    config.addinivalue_line("filterwarnings", "error::pytest.PytestUnknownMarkWarning")  # like --strict-markers
    if os.environ.get("HF_TOKRED_CI") == "1":
        config.option.hypothesis_show_statistics = True


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = terminalreporter.stats.get("skipped", [])
    terminalreporter.write_line(f"hf_tokred: {len(skipped)} test(s) skipped")
    for report in skipped:
        terminalreporter.write_line(f"  skipped {report.nodeid}: {_skip_reason(report)}")


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("HF_TOKRED_CI") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    bad = [r for r in skipped if not any(ok in _skip_reason(r) for ok in CI_ALLOWED_SKIP)]
    if bad and session.exitstatus == 0:
        session.exitstatus = 1
        if reporter is not None:
            reporter.write_line(f"hf_tokred CI: {len(bad)} test(s) skipped without a hardware reason; failing the run")
