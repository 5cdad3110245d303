"""Writing and uploading variants: :func:`save_variant`, :func:`push_variant`, :func:`upload_variant`.

Two kinds of variant:

* **settings-only** (default): no weights.  ``config.json`` names the base model and the settings, with an
  ``auto_map`` pointing at a tiny ``hf_tokred_variant.py`` uploaded with it; the folder also holds the base's
  tokenizer and a model card.  With ``import hf_tokred``, ``AutoModelForCausalLM.from_pretrained("user/name")``
  loads the *base* model with the saved settings applied (``token_reduction=...`` passed by the caller wins;
  ``token_reduction=None`` gives the dense base); ``pipeline("text-generation", model="user/name")`` works too.
* **full copy** (``full_copy=True``): ``save_pretrained`` of the reduced model, the tokenizer and the card.
  ``model_type`` stays ``mamba`` / ``mamba2``, so stock transformers loads it as the ordinary dense model.

What stock transformers (hf_tokred not imported) does with a settings-only variant:
``AutoModelForCausalLM.from_pretrained("user/name")`` without ``trust_remote_code`` gives transformers' own
refusal (custom code); with ``trust_remote_code=True`` transformers imports ``hf_tokred_variant.py``, which does
``import hf_tokred``: if the plugin is not installed that raises ``ImportError: user/name is a settings-only
hf_tokred variant of <base>; install the plugin ...``; if it is, the load succeeds (reduced).

A settings-only variant whose base is a local folder can be written but :func:`push_variant` warns: it would
not load anywhere else.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import transformers
from huggingface_hub import HfApi
from huggingface_hub.utils import validate_repo_id
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from ..config import TokenReductionConfig
from ..evaluation.results import load_eval_results
from ..families import FAMILIES
from ..bundled_models import bundled_name, bundled_path
from ..models import load_model, weights_fingerprint
from ..settings import apply_token_reduction, get_token_reduction, resolve_schedule
from ..variant import AUTO_MAP, VARIANT_FILE, VARIANT_MODEL_TYPE
from ..version import __version__
from .base import base_license, is_hub_id, settings_base, special_spec
from .card import DEFAULT_FLOPS_LENGTH, make_model_card

__all__ = ["check_eval_matches", "missing_plugin_message", "push_variant", "save_variant", "summary",
           "upload_variant", "variant_stub"]


_STUB = '''"""Loader stub of {repo!s}: a settings-only hf_tokred variant of {base!s}.

This repository holds no weights: config.json names the base model and the token-reduction settings.
Loading it needs the hf_tokred plugin (pip install hf-tokred), which registers the loader on import.
"""

_MESSAGE = {message!r}

try:
    import hf_tokred  # noqa: F401  (installs the hooks and registers the variant loader)
    from hf_tokred.variant import TokenReductionVariant, TokenReductionVariantConfig
except ImportError as err:
    if getattr(err, "name", None) not in ("hf_tokred", "hf_tokred.variant"):
        raise  # the plugin is installed but failed to import: show its own error
    raise ImportError(_MESSAGE) from err

__all__ = ["TokenReductionVariant", "TokenReductionVariantConfig"]
'''


def missing_plugin_message(repo: str, base: str) -> str:
    return (f"{repo} is a settings-only hf_tokred variant of {base}; install the plugin: pip install hf-tokred, "
            "then `import hf_tokred` before from_pretrained")


def variant_stub(repo: str, base: str) -> str:
    """Text of the ``hf_tokred_variant.py`` uploaded with a settings-only variant."""
    return _STUB.format(repo=repo, base=base, message=missing_plugin_message(repo, base))


def check_eval_matches(result: dict, cfg: TokenReductionConfig, config: Any, name: str, model: Any = None) -> None:
    """Refuse eval results measured on another model (weights fingerprint when the model is loaded, else the
    model name) or with other settings."""
    measured = result.get("model")
    saved_fp = result.get("model_fingerprint")
    if model is not None and saved_fp is not None:
        fp = weights_fingerprint(model)
        if fp != saved_fp:
            raise ValueError(f"the eval results were measured on another model ({measured!r}, weights fingerprint "
                             f"{saved_fp}) than {name!r} (weights fingerprint {fp}); evaluate this model "
                             f"(hf-tokred eval --model {name} ...) and pass those results")
    elif measured is not None and str(measured) != str(name):
        raise ValueError(f"the eval results were measured on {measured!r}, not on {name!r}; evaluate this model "
                         f"(hf-tokred eval --model {name} ...) and pass those results")
    saved = result.get("token_reduction")
    if saved is None or TokenReductionConfig.coerce(saved) != cfg:
        raise ValueError(
            f"the eval results were measured with token_reduction={saved!r}, not with this variant's settings "
            f"{cfg.to_dict()!r}; evaluate the variant itself (hf-tokred eval --model <variant folder>) or pass the "
            "same settings"
        )
    for key in ("model_type", "num_hidden_layers"):
        if key in result and result[key] != getattr(config, key, None):
            raise ValueError(f"the eval results are for a model with {key}={result[key]!r}, but the base model has "
                             f"{key}={getattr(config, key, None)!r}")


def _tokenizer_for(base: str, revision: str | None):
    try:
        return AutoTokenizer.from_pretrained(base, **({"revision": revision} if revision else {}))
    except Exception as err:  # noqa: BLE001
        warnings.warn(f"could not load the tokenizer of {base!r} ({type(err).__name__}: {err}); the variant is saved "
                      "without tokenizer files, so pipeline(...) on it needs tokenizer=...", stacklevel=3)
        return None


def _coerce_settings(token_reduction: Any, fallback: Any) -> TokenReductionConfig:
    if token_reduction is None:
        token_reduction = fallback
    if token_reduction is None:
        raise ValueError("no token-reduction settings: pass token_reduction (e.g. {'flops_reduction': 0.2}); a variant "
                         "without them would just be the base model")
    return TokenReductionConfig.coerce(token_reduction)


def _write_full_copy(out: Path, model, spec: str, token_reduction, tokenizer, result, base_revision):
    """``save_pretrained`` of the reduced model; returns ``(base, config, settings, tokenizer)``."""
    if model is None:
        model, loaded_tok = load_full(spec, base_revision)
        tokenizer = tokenizer if tokenizer is not None else loaded_tok
    elif tokenizer is None and spec:
        tokenizer = _tokenizer_for(spec, base_revision)
    cfg = _coerce_settings(token_reduction, get_token_reduction(model))
    if result is not None:
        check_eval_matches(result, cfg, model.config, spec or type(model).__name__, model)
    previous = get_token_reduction(model)
    apply_token_reduction(model, cfg)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if (out / VARIANT_FILE).exists():  # left over from a settings-only variant in the same folder
            (out / VARIANT_FILE).unlink()
        model.save_pretrained(out)
    finally:
        apply_token_reduction(model, previous)
    return spec or type(model).__name__, model.config, cfg, tokenizer


def _write_settings_only(out: Path, model, spec: str, token_reduction, tokenizer, result, base_revision, repo_id):
    """config.json naming the base + the loader stub; returns ``(base, config, settings, tokenizer)``."""
    if not spec:
        raise ValueError("this model has no config._name_or_path to point a settings-only variant at; pass the "
                         "base's Hub id or folder, or publish a full copy (full_copy=True)")
    base = settings_base(spec)
    source = bundled_path(bundled_name(base)) if bundled_name(base) else base  # where it loads from here
    if model is not None:
        config = model.config
    else:
        config = AutoConfig.from_pretrained(source, **({"revision": base_revision} if base_revision else {}))
    if getattr(config, "model_type", None) not in FAMILIES:
        raise ValueError(f"the base model {base!r} has model_type={getattr(config, 'model_type', None)!r}; "
                         "token-reduced variants need a Mamba or Mamba-2 model")
    cfg = _coerce_settings(token_reduction, get_token_reduction(config))
    resolve_schedule(cfg, config)  # raises if the schedule does not fit the base
    if result is not None:
        check_eval_matches(result, cfg, config, spec, model)
    if tokenizer is None:
        tokenizer = _tokenizer_for(source, base_revision)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "generation_config.json"):
        if (out / stale).exists():  # left over from a full copy in the same folder
            (out / stale).unlink()
    variant = {
        "model_type": VARIANT_MODEL_TYPE,
        "architectures": list(getattr(config, "architectures", None) or [FAMILIES[config.model_type].lm_class]),
        "base_model": base,
        "base_revision": base_revision,
        "base_model_type": config.model_type,
        "token_reduction": cfg.to_dict(),
        "auto_map": dict(AUTO_MAP),
        "hf_tokred_version": __version__,
        "transformers_version": transformers.__version__,
    }
    (out / "config.json").write_text(json.dumps(variant, indent=2) + "\n")
    (out / VARIANT_FILE).write_text(variant_stub(repo_id, base))
    return base, config, cfg, tokenizer


def save_variant(
    model_or_base_id: Any,
    token_reduction: Any,
    out_dir: str | os.PathLike,
    tokenizer: Any = None,
    full_copy: bool = False,
    eval_results: Any = None,
    *,
    base_revision: str | None = None,
    repo_id: str | None = None,
    flops_length: int = DEFAULT_FLOPS_LENGTH,
    base_name: str | None = None,
) -> Path:
    """Write a variant folder (config, tokenizer, model card; weights only for a full copy). Returns ``out_dir``.

    Args:
        model_or_base_id: a Hub id or local folder of the base model, an hf_tokred spec (``bundled:mamba``; and
            ``random:mamba-tiny`` for full copies), or a loaded ``MambaForCausalLM`` / ``Mamba2ForCausalLM``
            (a settings-only variant then points at ``model.config._name_or_path``).
        token_reduction: ``TokenReductionConfig`` or dict; ``None`` takes the settings the model already has.
        out_dir: the folder to write (created; existing files with the same names are overwritten).
        tokenizer: saved with the variant; default: the base's own (``AutoTokenizer.from_pretrained(base)``).
        full_copy: ``save_pretrained`` of the reduced model instead of a settings-only variant.
        eval_results: a result JSON path or dict from ``hf-tokred eval`` measured with these settings; adds the
            evaluation table to the card (the settings must match, else ``ValueError``).
        base_revision: revision of the base model to load (stored in a settings-only variant).
        repo_id: the Hub id the card and the loader stub name (default: ``out_dir``'s name).
        flops_length: sequence length of the card's analytic FLOPs figure.
        base_name: what the base is called when a loaded model is given (default: ``config._name_or_path``), e.g.
            the spec it was loaded from.
    """
    out = Path(out_dir)
    repo_id = repo_id or out.resolve().name
    model = model_or_base_id if isinstance(model_or_base_id, PreTrainedModel) else None
    if model is None and not isinstance(model_or_base_id, (str, os.PathLike)):
        raise TypeError(f"model_or_base_id must be a Hub id, a path, an hf_tokred spec or a loaded model, got "
                        f"{type(model_or_base_id).__name__}")
    spec = str(model_or_base_id) if model is None else str(base_name or model.config._name_or_path or "")
    result = load_eval_results(eval_results) if eval_results is not None else None

    if full_copy:
        base, config, cfg, tokenizer = _write_full_copy(out, model, spec, token_reduction, tokenizer, result,
                                                        base_revision)
    else:
        base, config, cfg, tokenizer = _write_settings_only(out, model, spec, token_reduction, tokenizer, result,
                                                            base_revision, repo_id)
    lic = base_license(base, base_revision, config)
    kind = "full" if full_copy else "settings"
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    card = make_model_card(base=base, config=config, token_reduction=cfg, kind=kind, repo_id=repo_id,
                           base_revision=base_revision, eval_results=result, license=lic,
                           flops_length=flops_length)
    card.save(out / "README.md")
    return out


def load_full(spec: str, revision: str | None):
    """The model and tokenizer of ``spec`` (an hf_tokred spec, a folder or a Hub id at ``revision``)."""
    if special_spec(spec):
        return load_model(spec)
    rev = {"revision": revision} if revision else {}
    model = AutoModelForCausalLM.from_pretrained(spec, **rev).eval()
    return model, AutoTokenizer.from_pretrained(spec, **rev)


def push_variant(
    model_or_base_id: Any,
    token_reduction: Any,
    repo_id: str,
    *,
    tokenizer: Any = None,
    full_copy: bool = False,
    eval_results: Any = None,
    base_revision: str | None = None,
    api: Any = None,
    private: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
    flops_length: int = DEFAULT_FLOPS_LENGTH,
):
    """Write the variant (see :func:`save_variant`) to a temporary folder, create ``repo_id`` and upload it.

    ``api`` defaults to ``huggingface_hub.HfApi(token=token)``; anything with ``create_repo(repo_id, **kw)`` and
    ``upload_folder(repo_id=..., folder_path=..., **kw)`` works.  Returns what ``upload_folder`` returns.
    """
    validate_repo_id(repo_id)
    if api is None:
        api = HfApi(token=token)
    if not full_copy and isinstance(model_or_base_id, (str, os.PathLike)) and not is_hub_id(str(model_or_base_id)):
        warnings.warn(f"the settings-only variant {repo_id} points at {str(model_or_base_id)!r}, which is not a Hub "
                      "id: "
                      "it will only load where that path exists. Upload the base model first, or use full_copy=True.",
                      stacklevel=2)
    with tempfile.TemporaryDirectory(prefix="hf_tokred_variant_") as tmp:
        folder = save_variant(model_or_base_id, token_reduction, Path(tmp) / repo_id.split("/")[-1], tokenizer,
                              full_copy, eval_results, base_revision=base_revision, repo_id=repo_id,
                              flops_length=flops_length)
        return upload_variant(folder, repo_id, api=api, private=private, commit_message=commit_message)


def upload_variant(folder: str | os.PathLike, repo_id: str, *, api: Any = None, private: bool = False,
                   token: str | None = None, commit_message: str | None = None):
    """Create ``repo_id`` (if needed) and upload a folder written by :func:`save_variant`."""
    if api is None:
        api = HfApi(token=token)
    repo = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    target = getattr(repo, "repo_id", None) or repo_id
    config = json.loads((Path(folder) / "config.json").read_text())
    what = "settings-only variant" if config.get("model_type") == VARIANT_MODEL_TYPE else "full copy"
    return api.upload_folder(repo_id=target, folder_path=str(folder), repo_type="model",
                             commit_message=commit_message or f"Upload hf_tokred {what}")


def summary(folder: Path) -> dict[str, Any]:
    config = json.loads((folder / "config.json").read_text())
    return {
        "kind": "settings-only" if config.get("model_type") == VARIANT_MODEL_TYPE else "full copy",
        "files": sorted(p.name for p in folder.iterdir() if p.is_file()),
        "base_model": config.get("base_model"),
        "token_reduction": config.get("token_reduction"),
    }
