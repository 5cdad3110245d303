"""Shared fixtures: tiny seeded Mamba / Mamba-2 models and a word-level tokenizer (all offline)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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

import hf_tokred  # noqa: E402,F401  (installs the hooks)
from hf_tokred import fastpath  # noqa: E402

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


def stock_forward(model, *args, **kwargs):
    """Call the unpatched transformers forward of ``model`` with reduction off (the independent reference)."""
    settings = model.config.__dict__.pop("token_reduction", None)
    try:
        with fastpath.stock_kernels():
            return type(model).forward._hf_tokred_original(model, *args, **kwargs)
    finally:
        if settings is not None:
            model.config.token_reduction = settings


def word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary: ``<pad>``=0, ``<eos>``=1, words ``w2`` .. ``w95``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left")
