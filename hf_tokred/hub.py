"""Reduced variants on the Hugging Face Hub: settings-only variants, full copies, model cards, ``hf-tokred push``.

Two kinds of published variant:

* **settings-only** (default): no weights.  ``config.json`` has ``"model_type": "hf_tokred_variant"``,
  ``base_model`` (Hub id or path of the base), optional ``base_revision``, the ``token_reduction`` dict,
  ``architectures`` of the base, and an ``auto_map`` pointing at a tiny ``hf_tokred_variant.py`` uploaded with it.
  The folder also holds the base's tokenizer and a model card.  With ``import hf_tokred``, the variant's config
  type is registered (:func:`register`) and ``AutoModelForCausalLM.from_pretrained("user/name")`` loads the
  *base* model with the saved settings applied and returns it: a stock ``MambaForCausalLM`` /
  ``Mamba2ForCausalLM`` (``token_reduction=...`` passed by the caller wins over the saved block;
  ``token_reduction=None`` gives the dense base).  ``pipeline("text-generation", model="user/name")`` works too.
* **full copy** (``full_copy=True`` / ``--full-copy``): ``save_pretrained`` of the reduced model, the tokenizer and
  the card.  ``model_type`` stays ``mamba`` / ``mamba2``, so stock transformers loads it as the ordinary dense model
  (it ignores the ``token_reduction`` block) and hf_tokred loads it reduced.

What stock transformers (hf_tokred not imported) does with a **settings-only** variant:

* ``AutoModelForCausalLM.from_pretrained("user/name")`` (no ``trust_remote_code``): transformers' own refusal.
  Non-interactively it raises ``ValueError: The repository user/name contains custom code which must be executed
  to correctly load the model. ... Please pass the argument `trust_remote_code=True` to allow custom code to be
  run.``; in an interactive session it first asks ``Do you wish to run the custom code? [y/N]`` (with a timeout).
* with ``trust_remote_code=True``: transformers imports ``hf_tokred_variant.py``, which does
  ``import hf_tokred``.  If the plugin is not installed that raises ``ImportError: user/name is a settings-only
  hf_tokred variant of <base>; install the plugin: pip install hf-tokred, then `import hf_tokred` before
  from_pretrained``.  If it is installed, the import installs the plugin and the load succeeds (reduced), as with
  ``import hf_tokred``.  (Once registered, our loader is local code, so transformers never runs the stub again.)

Python API: :func:`save_variant` writes the folder; :func:`push_variant` writes it to a temporary folder and
:func:`upload_variant` creates the repo and uploads it with ``huggingface_hub.HfApi().create_repo`` +
``upload_folder`` (``api`` is injectable).  Command line: ``hf-tokred push --model M --flops-reduction 0.2
--repo user/name [--full-copy] [--private] [--eval-results results.json] [--output DIR]`` (``--output`` only
writes the folder).  Exit codes: 2 for usage errors (the message names the flag), 1 when the upload fails.
A settings-only variant whose base is a local folder can be written (``--output``) but the command refuses to
upload it (``push_variant`` warns): it would not load anywhere else.

The model card (template ``hf_tokred/model_cards/reduced_variant.md``, rendered with ``huggingface_hub.ModelCard``)
states the base model, the method and its settings, the resolved anchors / keep ratio, the *analytic* FLOPs
reduction at a stated sequence length (``hf_tokred.flops.flops_reduction`` on the schedule's per-block token
counts), how to load the variant, the base model's licence (from its card or config; otherwise "see the base
model"), and an evaluation table only when a results JSON written by ``hf-tokred eval`` for these exact settings
is given (its ``row``); nothing is ever invented.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import warnings
from importlib import resources
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from .config import METHODS, TokenReductionConfig, setting_text

__all__ = [
    "DEFAULT_FLOPS_LENGTH",
    "VARIANT_FILE",
    "VARIANT_MODEL_TYPE",
    "TokenReductionVariant",
    "TokenReductionVariantConfig",
    "add_parser",
    "analytic_flops",
    "make_model_card",
    "push_variant",
    "register",
    "upload_variant",
    "save_variant",
]

VARIANT_MODEL_TYPE = "hf_tokred_variant"
VARIANT_MODULE = "hf_tokred_variant"
VARIANT_FILE = f"{VARIANT_MODULE}.py"
AUTO_MAP = {
    "AutoConfig": f"{VARIANT_MODULE}.TokenReductionVariantConfig",
    "AutoModelForCausalLM": f"{VARIANT_MODULE}.TokenReductionVariant",
}
#: sequence length at which the model card states the analytic FLOPs reduction
DEFAULT_FLOPS_LENGTH = 2048
EVAL_SCHEMA_PREFIX = "hf_tokred.eval/"
_FAMILY_NAMES = {"mamba": "Mamba", "mamba2": "Mamba-2"}
_LM_CLASSES = {"mamba": "MambaForCausalLM", "mamba2": "Mamba2ForCausalLM"}
# hub kwargs that concern the variant repository itself, never the base model
_VARIANT_ONLY_KWARGS = ("revision", "subfolder", "code_revision", "_from_auto", "adapter_kwargs", "trust_remote_code")


# ----------------------------------------------------------------------------- config + loader classes


class TokenReductionVariantConfig(PreTrainedConfig):
    """``config.json`` of a settings-only variant: which base model to load, and the token-reduction settings."""

    model_type = VARIANT_MODEL_TYPE

    base_model: str | None = None
    base_revision: str | None = None
    token_reduction: dict | None = None

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """No-op: the variant's ``auto_map`` is written explicitly, never by copying this module."""


class TokenReductionVariant:
    """Loader registered for :class:`TokenReductionVariantConfig` with ``AutoModelForCausalLM``.

    Not a model: :meth:`from_pretrained` loads the *base* model named in the variant's config with the variant's
    settings applied and returns that model (a stock ``MambaForCausalLM`` / ``Mamba2ForCausalLM``).
    """

    config_class = TokenReductionVariantConfig

    def __init__(self, *args, **kwargs):
        raise TypeError("TokenReductionVariant is a loader, not a model: use TokenReductionVariant.from_pretrained "
                        "(or AutoModelForCausalLM.from_pretrained) on a settings-only variant")

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM"):
        """No-op (see :meth:`TokenReductionVariantConfig.register_for_auto_class`)."""

    @classmethod
    def _from_config(cls, config, **kwargs):
        raise TypeError(
            f"a settings-only hf_tokred variant has no architecture of its own; load it with from_pretrained, or "
            f"build the base model ({getattr(config, 'base_model', None)!r}) from its own config"
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        from .patch import _PENDING, _UNSET

        token_reduction = kwargs.pop("token_reduction", _UNSET)
        if token_reduction is _UNSET:  # AutoModel*.from_pretrained(..., token_reduction=...) hands it over here
            token_reduction = _PENDING.get()
        if not isinstance(config, TokenReductionVariantConfig):
            hub = {k: kwargs[k] for k in ("cache_dir", "force_download", "local_files_only", "proxies", "revision",
                                          "subfolder", "token") if k in kwargs}
            config = TokenReductionVariantConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        source = str(pretrained_model_name_or_path)
        base = config.base_model
        if not base:
            raise ValueError(f"{source!r} is not a settings-only hf_tokred variant: its config.json has no base_model")
        if str(base) == source:
            raise ValueError(f"the hf_tokred variant {source!r} names itself as its base_model")
        if token_reduction is _UNSET:
            token_reduction = config.token_reduction
            if token_reduction is None:
                raise ValueError(f"the hf_tokred variant {source!r} has no token_reduction block in its config.json")
            try:
                TokenReductionConfig.coerce(token_reduction)
            except (TypeError, ValueError) as err:
                raise ValueError(
                    f"the token_reduction block in the config of {source!r} is invalid: {err}. Fix that block in "
                    "config.json, or pass token_reduction=... (or None) to from_pretrained."
                ) from err
        for key in _VARIANT_ONLY_KWARGS:
            kwargs.pop(key, None)
        if config.base_revision:
            kwargs["revision"] = config.base_revision
        return AutoModelForCausalLM.from_pretrained(base, *model_args, token_reduction=token_reduction, **kwargs)


_REGISTERED = False


def register() -> None:
    """Register the settings-only variant with ``AutoConfig`` and ``AutoModelForCausalLM`` (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    AutoConfig.register(VARIANT_MODEL_TYPE, TokenReductionVariantConfig, exist_ok=True)
    AutoModelForCausalLM.register(TokenReductionVariantConfig, TokenReductionVariant, exist_ok=True)
    _REGISTERED = True


register()  # importing this module is enough to load variants; hf_tokred.patch.install() calls it as well


# ----------------------------------------------------------------------------- the loader stub uploaded with a variant

_STUB = '''"""Loader stub of {repo!s}: a settings-only hf_tokred variant of {base!s}.

This repository holds no weights: config.json names the base model and the token-reduction settings.
Loading it needs the hf_tokred plugin (pip install hf-tokred), which registers the loader on import.
"""

_MESSAGE = {message!r}

try:
    import hf_tokred  # noqa: F401  (installs the hooks and registers the variant loader)
    from hf_tokred.hub import TokenReductionVariant, TokenReductionVariantConfig
except ImportError as err:
    if getattr(err, "name", None) not in ("hf_tokred", "hf_tokred.hub"):
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


# ----------------------------------------------------------------------------- resolving the base


def _special_spec(spec: str) -> str | None:
    """``"random"`` / ``"bundled"`` for hf_tokred's own model specs, else ``None`` (a Hub id or a path)."""
    from .models import BUNDLED

    if spec.startswith("random:"):
        return "random"
    if spec.removeprefix("bundled:") in BUNDLED and not os.path.isdir(spec):
        return "bundled"
    return None


def is_hub_id(name: str) -> bool:
    """Whether ``name`` looks like a Hub repo id (``owner/name`` or ``name``) rather than a local path."""
    if os.path.exists(name) or _special_spec(name):
        return False
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name) is not None and ".." not in name


def _settings_base(spec: str) -> str:
    """The ``base_model`` string a settings-only variant of ``spec`` stores."""
    kind = _special_spec(spec)
    if kind == "random":
        raise ValueError(
            f"{spec} has random weights that exist nowhere else, so a settings-only variant cannot point at them; "
            "publish a full copy instead (full_copy=True / --full-copy)"
        )
    if kind == "bundled":
        from .models import bundled_path

        return str(bundled_path(spec.removeprefix("bundled:")))
    if os.path.isdir(spec):
        return str(Path(spec).resolve())
    return spec


def _base_license(base: str, revision: str | None, config: Any = None) -> tuple[str | None, str | None, str | None]:
    """``(license, license_name, license_link)`` from the base model's card (or config), if known."""
    from huggingface_hub import ModelCard

    card = None
    try:
        if os.path.isdir(base):
            readme = Path(base) / "README.md"
            card = ModelCard.load(readme) if readme.is_file() else None
        elif is_hub_id(base):
            card = ModelCard.load(base, **({"revision": revision} if revision else {}))
    except Exception:  # noqa: BLE001 -- offline, no card, unreadable card: the licence is simply unknown
        card = None
    data = getattr(card, "data", None)
    lic = getattr(data, "license", None) if data is not None else None
    if lic:
        return str(lic), getattr(data, "license_name", None), getattr(data, "license_link", None)
    lic = getattr(config, "license", None)
    return (str(lic), None, None) if lic else (None, None, None)


# ----------------------------------------------------------------------------- FLOPs and evaluation results


def layer_lengths(cfg: TokenReductionConfig, num_hidden_layers: int, length: int) -> list[int]:
    """Tokens each block processes for one sequence of ``length`` tokens under ``cfg``'s schedule."""
    import torch

    from .reduce import num_to_remove

    schedule = cfg.resolve(num_hidden_layers)
    lengths, n = [], length
    for layer in range(num_hidden_layers):
        lengths.append(n)
        if layer in schedule.anchors:
            n -= int(num_to_remove(torch.tensor([n]), schedule.keep_ratio, cfg.spec.pairs))
    return lengths


def analytic_flops(config: Any, token_reduction: Any, length: int = DEFAULT_FLOPS_LENGTH) -> dict[str, Any]:
    """Analytic FLOPs figures of a schedule on one ``length``-token sequence (from the config alone, no model run)."""
    from .flops import flops_reduction, proxy_flops_reduction

    cfg = TokenReductionConfig.coerce(token_reduction)
    schedule = cfg.resolve(config.num_hidden_layers)
    lengths = layer_lengths(cfg, config.num_hidden_layers, length)
    return {
        "length": length,
        "layer_lengths": lengths,
        "anchors": list(schedule.anchors),
        "keep_ratio": schedule.keep_ratio,
        "exact": flops_reduction(config, lengths, length),
        "proxy_at_length": proxy_flops_reduction(lengths, length),
        "proxy": schedule.flops_reduction,
    }


def load_eval_results(eval_results: Any) -> dict[str, Any]:
    """A result dict written by ``hf-tokred eval`` (path or dict), checked to be one."""
    if isinstance(eval_results, (str, os.PathLike)):
        path = Path(eval_results)
        if not path.is_file():
            raise FileNotFoundError(f"eval results file {str(path)!r} does not exist")
        try:
            eval_results = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{str(path)!r} is not JSON: {err}") from None
    if not isinstance(eval_results, dict) or not str(eval_results.get("schema", "")).startswith(EVAL_SCHEMA_PREFIX) \
            or not isinstance(eval_results.get("row"), dict):
        raise ValueError("eval results must be a result JSON written by `hf-tokred eval` (schema "
                         f"{EVAL_SCHEMA_PREFIX}1, with a 'row' dict)")
    return eval_results


def _check_eval_matches(result: dict, cfg: TokenReductionConfig, config: Any, name: str, model: Any = None) -> None:
    """Refuse eval results measured on another model (weights fingerprint when the model is loaded, else the
    model name) or with other settings."""
    from .models import weights_fingerprint

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


def _eval_sections(result: dict) -> tuple[str, str, str]:
    from .evaluation.harness import format_row

    row = result["row"]
    table = format_row(row)
    tasks = result.get("tasks") or {}
    ran = [f"{name} ({t.get('documents')} docs)" if t.get("documents") is not None else name
           for name, t in tasks.items() if t.get("status") == "ok"]
    settings = result.get("settings") or {}
    versions = settings.get("versions") or {}
    bits = [f"model `{result.get('model')}`"]
    if ran:
        bits.append("tasks " + ", ".join(ran))
    if settings.get("limit") is not None:
        bits.append(f"limit {settings['limit']} documents per task")
    if versions.get("lm_eval"):
        bits.append(f"lm-eval {versions['lm_eval']}")
    if result.get("created"):
        bits.append(f"run {result['created']}")
    notes = []
    missing = [name for name, t in tasks.items() if t.get("status") != "ok"]
    if missing:
        notes.append(f"Not measured: {', '.join(missing)} (shown as -).")
    flops = result.get("flops") or {}
    if isinstance(flops.get("exact"), (int, float)):
        proxy = flops.get("proxy")
        proxy_text = f", proxy {100 * proxy:.1f} %" if isinstance(proxy, (int, float)) else ""
        notes.append(f"The FLOPs columns of this table were measured on the evaluated sequences (exact "
                     f"{100 * flops['exact']:.1f} %{proxy_text}), unlike the analytic figure above.")
    notes.append("Accuracies are percentages; - marks a column that was not measured.")
    return table, "; ".join(bits), " ".join(notes)


# ----------------------------------------------------------------------------- the model card


def _cli_flags(cfg: TokenReductionConfig) -> str:
    flags = [f"--method {cfg.method}"]
    if cfg.flops_reduction is not None:
        flags.append(f"--flops-reduction {cfg.flops_reduction:g}")
    flags += [f"--{k.replace('_', '-')} {setting_text(v)}" for k, v in cfg.non_default_settings().items()]
    return " ".join(flags)


def make_model_card(
    *,
    base: str,
    config: Any,
    token_reduction: Any,
    kind: str,
    repo_id: str,
    base_revision: str | None = None,
    eval_results: dict | None = None,
    license: tuple[str | None, str | None, str | None] = (None, None, None),
    flops_length: int = DEFAULT_FLOPS_LENGTH,
):
    """The ``huggingface_hub.ModelCard`` of a variant (``kind``: ``"settings"`` or ``"full"``)."""
    from huggingface_hub import ModelCard, ModelCardData

    from . import __version__

    cfg = TokenReductionConfig.coerce(token_reduction)
    model_type = config.model_type
    flops = analytic_flops(config, cfg, flops_length)
    hub_base = is_hub_id(base)
    lic, lic_name, lic_link = license
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        base_model=base if hub_base else None,
        license=lic,
        license_name=lic_name,
        license_link=lic_link,
        tags=["hf_tokred", "token-reduction", model_type, cfg.method],
        **({"base_model_relation": "adapter"} if kind == "settings" and hub_base else {}),
    )
    if lic:
        license_text = f"`{lic}`" + (f" ({lic_name})" if lic_name else "") + \
            f", inherited from the base model [{base}]({_link(base)})." + \
            (f" Licence text: {lic_link}." if lic_link else "")
    else:
        license_text = f"See the base model ([{base}]({_link(base)})): this variant is under the base model's licence."
    eval_table = eval_source = eval_notes = ""
    if eval_results is not None:
        eval_table, eval_source, eval_notes = _eval_sections(eval_results)
    lengths = flops["layer_lengths"]
    shown = ", ".join(f"{n}" for n in lengths) if len(lengths) <= 24 else \
        ", ".join(map(str, lengths[:6])) + ", …, " + ", ".join(map(str, lengths[-3:]))
    if _special_spec(base) == "random":
        base_display = f"random weights ({base}, for testing only)"
    else:
        base_display = base
    settings = cfg.to_dict()
    template = resources.files("hf_tokred") / "model_cards" / "reduced_variant.md"
    return ModelCard.from_template(
        data,
        template_str=template.read_text(encoding="utf-8"),
        title=f"{repo_id}: {_FAMILY_NAMES.get(model_type, model_type)} + {cfg.method} token reduction",
        kind=kind,
        base_model=base,
        base_display=base_display,
        base_link=_link(base),
        base_revision=base_revision,
        base_family=_FAMILY_NAMES.get(model_type, model_type),
        base_class=_LM_CLASSES.get(model_type, "model"),
        model_type=model_type,
        method=cfg.method,
        method_summary=METHODS[cfg.method].summary,
        settings=settings,
        settings_json=json.dumps(settings, indent=2),
        hidden_strategy=cfg.hidden,
        residual_strategy=cfg.residual,
        num_hidden_layers=config.num_hidden_layers,
        anchors=flops["anchors"],
        keep_ratio=flops["keep_ratio"],
        target_text=(f"at a **{100 * cfg.flops_reduction:g} %** FLOPs-reduction target" if cfg.flops_reduction is not None
                     else f"keeping **{cfg.keep_ratio:g}** of the tokens at each anchor (a {100 * flops['proxy']:.1f} % "
                          "FLOPs reduction by the paper's proxy)"),
        flops_length=flops_length,
        flops_exact=flops["exact"],
        flops_proxy=flops["proxy"],
        flops_proxy_at_length=flops["proxy_at_length"],
        layer_lengths_text=f"tokens per block: {shown}",
        eval_table=eval_table,
        eval_source=eval_source,
        eval_notes=eval_notes,
        load_id=repo_id,
        cli_flags=_cli_flags(cfg),
        license_text=license_text,
        hf_tokred_version=__version__,
        transformers_version=transformers.__version__,
    )


def _link(base: str) -> str:
    if is_hub_id(base):
        return f"https://huggingface.co/{base}"
    if _special_spec(base) == "random":
        return "https://pypi.org/project/hf-tokred/"
    return Path(base).resolve().as_uri() if os.path.exists(base) else base


# ----------------------------------------------------------------------------- writing and uploading


def _tokenizer_for(base: str, revision: str | None):
    from transformers import AutoTokenizer

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
    from transformers import PreTrainedModel

    from .patch import apply_token_reduction, get_token_reduction

    out = Path(out_dir)
    repo_id = repo_id or out.resolve().name
    model = model_or_base_id if isinstance(model_or_base_id, PreTrainedModel) else None
    if model is None and not isinstance(model_or_base_id, (str, os.PathLike)):
        raise TypeError(f"model_or_base_id must be a Hub id, a path, an hf_tokred spec or a loaded model, got "
                        f"{type(model_or_base_id).__name__}")
    spec = str(model_or_base_id) if model is None else str(base_name or model.config._name_or_path or "")
    result = load_eval_results(eval_results) if eval_results is not None else None

    if full_copy:
        if model is None:
            model, loaded_tok = _load_full(spec, base_revision)
            tokenizer = tokenizer if tokenizer is not None else loaded_tok
        elif tokenizer is None and spec:
            tokenizer = _tokenizer_for(spec, base_revision)
        cfg = _coerce_settings(token_reduction, get_token_reduction(model))
        if result is not None:
            _check_eval_matches(result, cfg, model.config, spec or type(model).__name__, model)
        base = spec or type(model).__name__
        lic = _base_license(base, base_revision, model.config)
        previous = get_token_reduction(model)
        apply_token_reduction(model, cfg)
        try:
            out.mkdir(parents=True, exist_ok=True)
            if (out / VARIANT_FILE).exists():  # left over from a settings-only variant in the same folder
                (out / VARIANT_FILE).unlink()
            model.save_pretrained(out)
        finally:
            apply_token_reduction(model, previous)
        kind, config = "full", model.config
    else:
        if not spec:
            raise ValueError("this model has no config._name_or_path to point a settings-only variant at; pass the "
                             "base's Hub id or folder, or publish a full copy (full_copy=True)")
        base = _settings_base(spec)
        if model is not None:
            config = model.config
        else:
            config = AutoConfig.from_pretrained(base, **({"revision": base_revision} if base_revision else {}))
        if getattr(config, "model_type", None) not in _LM_CLASSES:
            raise ValueError(f"the base model {base!r} has model_type={getattr(config, 'model_type', None)!r}; "
                             "token-reduced variants need a Mamba or Mamba-2 model")
        cfg = _coerce_settings(token_reduction, get_token_reduction(config))
        cfg.resolve(config.num_hidden_layers)  # raises if the schedule does not fit the base
        if result is not None:
            _check_eval_matches(result, cfg, config, spec, model)
        if tokenizer is None:
            tokenizer = _tokenizer_for(base, base_revision)
        lic = _base_license(base, base_revision, config)
        out.mkdir(parents=True, exist_ok=True)
        stale_files = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                       "generation_config.json")
        for stale in stale_files:  # left over from a full copy in the same folder
            if (out / stale).exists():
                (out / stale).unlink()
        from . import __version__

        variant = {
            "model_type": VARIANT_MODEL_TYPE,
            "architectures": list(getattr(config, "architectures", None) or [_LM_CLASSES[config.model_type]]),
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
        kind = "settings"
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    card = make_model_card(base=base, config=config, token_reduction=cfg, kind=kind, repo_id=repo_id,
                           base_revision=base_revision, eval_results=result, license=lic,
                           flops_length=flops_length)
    card.save(out / "README.md")
    return out


def _load_full(spec: str, revision: str | None):
    from .models import load_model

    if _special_spec(spec):
        return load_model(spec)
    from transformers import AutoTokenizer

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
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id(repo_id)
    if api is None:
        from huggingface_hub import HfApi

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
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    repo = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    target = getattr(repo, "repo_id", None) or repo_id
    config = json.loads((Path(folder) / "config.json").read_text())
    what = "settings-only variant" if config.get("model_type") == VARIANT_MODEL_TYPE else "full copy"
    return api.upload_folder(repo_id=target, folder_path=str(folder), repo_type="model",
                             commit_message=commit_message or f"Upload hf_tokred {what}")


# ----------------------------------------------------------------------------- hf-tokred push


def _check_repo(repo: str) -> None:
    from .cli import UsageError

    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", repo or "") or ".." in repo or "--" in repo \
            or repo.endswith((".", "-")) or len(repo.split("/")[1]) > 96:
        raise UsageError(f"--repo must be a Hub repo id 'owner/name' (letters, digits, '-', '_', '.'), got {repo!r} "
                         "(e.g. --repo your-name/mamba-130m-utrc-20)")


def _push(args: argparse.Namespace) -> int:
    from .cli import UsageError, reduction_from_args

    if args.output is None and not args.repo:
        raise UsageError("--repo is required to upload (e.g. --repo your-name/mamba-130m-utrc-20); or pass "
                         "--output DIR "
                         "to only write the folder")
    if args.repo:
        _check_repo(args.repo)
    if args.flops_length < 1:
        raise UsageError(f"--flops-length must be a positive integer, got {args.flops_length}")
    cfg = reduction_from_args(args)
    if cfg is None and not args.full_copy:
        raise UsageError("a settings-only variant needs reduction settings: pass --flops-reduction (e.g. 0.2) or "
                         "--keep-ratio (and optionally --method, --anchors)")
    special = _special_spec(args.model)
    if not args.full_copy:
        if special == "random":
            raise UsageError(f"--model {args.model} has random weights that exist nowhere else; a settings-only "
                             "variant "
                             "cannot point at them: pass --full-copy")
        if args.output is None and not is_hub_id(args.model):
            raise UsageError(f"--model {args.model} is not a Hub id, so a settings-only variant on the Hub could not "
                             "load it elsewhere: pass a Hub id (e.g. --model state-spaces/mamba-130m-hf), --full-copy, "
                             "or --output DIR to write a local variant")
    result = None
    if args.eval_results is not None:
        try:
            result = load_eval_results(args.eval_results)
        except (FileNotFoundError, ValueError) as err:
            raise UsageError(f"--eval-results: {err}") from None

    model = args.model
    tokenizer = None
    if args.full_copy:
        try:
            model, tokenizer = _load_full(args.model, args.base_revision)
        except (ValueError, OSError) as err:
            raise UsageError(f"--model {args.model}: {err}") from None
        if cfg is None and getattr(model.config, "token_reduction", None) is None:
            raise UsageError(f"--model {args.model} has no token_reduction settings of its own: pass --flops-reduction "
                             "(e.g. 0.2) or --keep-ratio")
    with tempfile.TemporaryDirectory(prefix="hf_tokred_variant_") as tmp:
        target = Path(args.output) if args.output is not None else Path(tmp) / args.repo.split("/")[-1]
        try:
            out = save_variant(model, cfg, target, tokenizer=tokenizer, full_copy=args.full_copy, eval_results=result,
                               base_revision=args.base_revision, repo_id=args.repo or None,
                               flops_length=args.flops_length, base_name=args.model)
        except (ValueError, TypeError) as err:
            text = str(err)
            if "eval results" in text:
                flag = "--eval-results"
            elif "base model" in text or "model_type" in text:
                flag = "--model"
            else:
                flag = "--flops-reduction/--keep-ratio/--anchors"
            raise UsageError(f"{flag}: {text}") from None
        except OSError as err:
            raise UsageError(f"--model {args.model}: {err}") from None
        summary = _summary(out)
        if args.output is not None:
            print(json.dumps({"output": str(out), "uploaded": False, **summary}, indent=None if args.json else 2))
            return 0
        try:
            info = upload_variant(out, args.repo, private=args.private)
        except Exception as err:  # noqa: BLE001 -- network, authentication, permissions: not a usage error
            print(f"hf-tokred push: error: uploading to {args.repo} failed ({type(err).__name__}: {err}). Log in with "
                  "`hf auth login` (or set HF_TOKEN), or pass --output DIR to write the folder and upload it later.",
                  file=sys.stderr)
            return 1
    url = getattr(info, "commit_url", None) or f"https://huggingface.co/{args.repo}"
    print(json.dumps({"repo": args.repo, "uploaded": True, "url": str(url), **summary},
                     indent=None if args.json else 2))
    return 0


def _summary(folder: Path) -> dict[str, Any]:
    config = json.loads((folder / "config.json").read_text())
    return {
        "kind": "settings-only" if config.get("model_type") == VARIANT_MODEL_TYPE else "full copy",
        "files": sorted(p.name for p in folder.iterdir() if p.is_file()),
        "base_model": config.get("base_model"),
        "token_reduction": config.get("token_reduction"),
    }


def add_parser(sub) -> None:
    from .cli import add_model_argument, add_reduction_arguments

    p = sub.add_parser(
        "push", help="publish a token-reduced variant (settings-only or full copy) with a model card",
        description="Publish a token-reduced variant of a Mamba / Mamba-2 model on the Hugging Face Hub. By default a "
                    "settings-only variant (config + tokenizer + card, no weights; it loads the base model's weights "
                    "and needs `import hf_tokred`); with --full-copy the reduced model's weights are saved too (stock "
                    "transformers loads it as the dense model). The card states the method, settings, the analytic "
                    "FLOPs reduction, how to load it, the base model's licence, and an evaluation table only when "
                    "--eval-results is given.",
        epilog="Example: hf-tokred push --model state-spaces/mamba-130m-hf --flops-reduction 0.2 "
               "--repo your-name/mamba-130m-utrc-20 --eval-results eval_results/eval_...json",
    )
    add_model_argument(p)
    p.add_argument("--repo", default=None, help="Hub repo id owner/name to create and upload to")
    p.add_argument("--output", default=None, metavar="DIR",
                   help="only write the variant folder to DIR (nothing is uploaded)")
    p.add_argument("--full-copy", action="store_true", help="save the weights too (a standalone reduced checkpoint)")
    p.add_argument("--private", action="store_true", help="create the repo as private")
    p.add_argument("--eval-results", default=None, metavar="JSON",
                   help="result JSON written by `hf-tokred eval` for these exact settings: adds its table to the card")
    p.add_argument("--base-revision", default=None, metavar="REV",
                   help="revision (branch, tag, commit) of the base model to pin")
    p.add_argument("--flops-length", type=int, default=DEFAULT_FLOPS_LENGTH, metavar="N",
                   help=f"sequence length of the card's analytic FLOPs figure (default: {DEFAULT_FLOPS_LENGTH})")
    p.add_argument("--json", action="store_true", help="one-line JSON summary")
    add_reduction_arguments(p)
    p.set_defaults(func=_push)
