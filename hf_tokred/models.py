"""Finding a model by name: the bundled defaults, random-weight models of the real sizes, or any HF path / Hub id.

Model specs understood everywhere a command takes ``--model``:

* ``bundled:mamba`` / ``bundled:mamba2`` (or just ``mamba`` / ``mamba2``): the small trained language models, and
  ``bundled:recall-mamba2``: the multi-query associative recall model, shipped with the package (offline);
* ``random:<family>-<size>``: random weights in the shape of a real checkpoint, e.g. ``random:mamba-130m``,
  ``random:mamba2-2.7b``, ``random:falcon_mamba-7b``, ``random:mamba-tiny`` (for speed/memory work and tests; the
  text they produce is noise);
* anything else: a local folder or Hub id passed to ``AutoModelForCausalLM.from_pretrained`` (transformers
  checkpoints, and original mamba_ssm ones, converted on load).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from .bundled_models import BUNDLED, bundled_path
from .convert import NEOX_REPO, checkpoint_tokenizer
from .families import FAMILIES
from .mamba_ssm_loading import original_config
from .settings import UNSET, apply_token_reduction

__all__ = ["BUNDLED", "KEEP", "bundled_path", "check_model_spec", "load_bundled", "load_model", "looks_like_a_folder",
           "random_config", "weights_fingerprint"]

#: ``load_model(..., token_reduction=KEEP)``: keep the settings saved in the checkpoint (if any).
KEEP: Any = UNSET

def _reduction_kwargs(token_reduction: Any) -> dict:
    return {} if token_reduction is KEEP else {"token_reduction": token_reduction}


def load_bundled(family: str = "mamba", token_reduction: Any = None, **kwargs):
    """``(model, tokenizer)`` for a bundled model; ``token_reduction`` as in ``from_pretrained``.

    The weights are stored in fp16 and loaded as fp32 unless ``dtype=`` says otherwise (CPU-friendly).
    """
    path = bundled_path(family)
    kwargs.setdefault("dtype", torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, **_reduction_kwargs(token_reduction), **kwargs).eval()
    return model, AutoTokenizer.from_pretrained(path)


def _random_names() -> str:
    return ", ".join(f"random:{f}-{s}" for f, fam in FAMILIES.items() for s in fam.sizes)


def random_config(name: str):
    """Config for ``<family>-<size>``, e.g. ``mamba-130m`` or ``mamba2-2.7b`` (shapes from the families table)."""
    model_type, _, size = name.partition("-")
    family = FAMILIES.get(model_type)
    if family is None or size not in family.sizes:
        raise ValueError(f"unknown random model {name!r}; known: {_random_names()}")
    hidden, layers = family.sizes[size]
    tiny = size == "tiny"
    kwargs = {"vocab_size": 512 if tiny else 50280, **family.random_kwargs(hidden, tiny),
              **family.random_layers(layers, tiny)}
    return AutoConfig.for_model(model_type, hidden_size=hidden, num_hidden_layers=layers, pad_token_id=1,
                                eos_token_id=0, bos_token_id=0, **kwargs)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer without merges (ids < 260), for random-weight models."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, "<|padding|>": 1, **{ch: i + 2 for i, ch in enumerate(sorted(alphabet))}}
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|padding|>", padding_side="left")


def weights_fingerprint(model: torch.nn.Module, samples: int = 1024) -> str:
    """A short identifier of a model's weights: sha256 over every parameter's name, shape and ``samples`` evenly
    spaced values rounded to fp16 (so one checkpoint loaded in fp16 or fp32 gives the same fingerprint)."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // samples)
            digest.update(f"{name}:{tuple(p.shape)}".encode())
            digest.update(flat[::step][:samples].to("cpu", torch.float16).numpy().tobytes())
    return digest.hexdigest()[:16]


def looks_like_a_folder(spec: str) -> bool:
    """Whether ``spec`` can only be a local path, never a Hub id (``name`` or ``owner/name``): absolute, ``~``,
    ``.`` / ``..`` first, a backslash, a trailing ``/`` or more than one ``/``."""
    return (os.path.isabs(spec) or spec.startswith(("~", "./", "../")) or spec in (".", "..") or "\\" in spec
            or spec.endswith("/") or spec.count("/") > 1)


def check_model_spec(spec: str) -> None:
    """Raise ``ValueError`` naming the known specs when ``spec`` is a ``bundled:`` / ``random:`` name we do not have,
    or "no such folder" for a local path that does not exist (a Hub id is checked when it is loaded)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a model spec must be a non-empty string, got {spec!r}")
    if looks_like_a_folder(spec) and not os.path.exists(spec):
        raise ValueError(f"no such folder {spec!r} (a local model folder must exist; a Hub id looks like owner/name)")
    if spec.startswith("bundled:") and spec.removeprefix("bundled:") not in BUNDLED:
        raise ValueError(f"unknown bundled model {spec!r}; bundled models: "
                         f"{', '.join('bundled:' + b for b in BUNDLED)}")
    if spec.startswith("random:"):
        random_config(spec.removeprefix("random:"))


def load_model(spec: str, token_reduction: Any = KEEP, dtype: torch.dtype | None = None, seed: int = 0, **kwargs):
    """``(model, tokenizer)`` for a model spec (see the module docstring); the model is in eval mode.

    ``token_reduction``: a config or dict to apply, ``None`` for the dense model, or (default) ``KEEP``
    to keep whatever the checkpoint's ``config.json`` says.
    """
    name = spec.removeprefix("bundled:")
    if name in BUNDLED:
        return load_bundled(name, **_reduction_kwargs(token_reduction), **({"dtype": dtype} if dtype else {}), **kwargs)
    if spec.startswith("random:"):
        if kwargs:
            raise ValueError(f"random: models are built in memory and take no loading options; got {sorted(kwargs)}")
        config = random_config(spec.removeprefix("random:"))
        torch.manual_seed(seed)
        model = getattr(transformers, FAMILIES[config.model_type].lm_class)(config).eval()
        if dtype is not None:
            model = model.to(dtype)
        if token_reduction is not KEEP:
            apply_token_reduction(model, token_reduction)
        return model, byte_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(
        spec, **_reduction_kwargs(token_reduction), **({"dtype": dtype} if dtype else {}), **kwargs
    ).eval()
    return model, _tokenizer(spec)


def _tokenizer(spec: str):
    """The checkpoint's tokenizer; for an original mamba_ssm checkpoint without one, GPT-NeoX-20B's (offline copy,
    else the Hub's), which those checkpoints were trained with."""
    if original_config(spec, {}) is None:
        return AutoTokenizer.from_pretrained(spec)
    tokenizer, origin = checkpoint_tokenizer(spec)
    if tokenizer is not None:
        return tokenizer
    try:
        return AutoTokenizer.from_pretrained(NEOX_REPO)
    except OSError:
        raise OSError(origin) from None
