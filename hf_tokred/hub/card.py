"""The model card of a variant (template ``hf_tokred/model_cards/reduced_variant.md``, rendered with
``huggingface_hub.ModelCard``): base model, method and settings, resolved anchors / keep ratio, the *analytic* FLOPs
reduction at a stated length, how to load it, the base model's licence, and an evaluation table only when a
result file of ``hf-tokred eval`` for these exact settings is given (nothing is ever invented).
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

import transformers
from huggingface_hub import ModelCard, ModelCardData

from ..config import METHODS, TokenReductionConfig, setting_text
from ..evaluation.results import format_row
from ..families import FAMILIES
from ..flops import flops_reduction, measured_proxy_reduction
from ..settings import resolve_schedule
from ..version import __version__
from .base import is_hub_id, special_spec

__all__ = ["DEFAULT_FLOPS_LENGTH", "analytic_flops", "make_model_card"]

#: sequence length at which the model card states the analytic FLOPs reduction
DEFAULT_FLOPS_LENGTH = 2048


def analytic_flops(config: Any, token_reduction: Any, length: int = DEFAULT_FLOPS_LENGTH) -> dict[str, Any]:
    """Analytic FLOPs figures of a schedule on one ``length``-token sequence (from the config alone, no model run)."""
    cfg = TokenReductionConfig.coerce(token_reduction)
    schedule = resolve_schedule(cfg, config)  # a hybrid's anchors sit on its SSM layers
    lengths = schedule.layer_lengths(length)
    return {
        "length": length,
        "layer_lengths": lengths,
        "anchors": list(schedule.anchors),
        "keep_ratio": schedule.keep_ratio,
        "exact": flops_reduction(config, lengths, length),
        "proxy_at_length": measured_proxy_reduction(lengths, length),
        "proxy": schedule.flops_reduction,
    }


def _eval_sections(result: dict) -> tuple[str, str, str]:
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


def _cli_flags(cfg: TokenReductionConfig) -> str:
    flags = [f"--method {cfg.method}"]
    if cfg.flops_reduction is not None:
        flags.append(f"--flops-reduction {cfg.flops_reduction:g}")
    flags += [f"--{k.replace('_', '-')} {setting_text(v)}" for k, v in cfg.non_default_settings().items()]
    return " ".join(flags)


def _license_text(base: str, lic, lic_name, lic_link) -> str:
    if not lic:
        return f"See the base model ([{base}]({_link(base)})): this variant is under the base model's licence."
    return (f"`{lic}`" + (f" ({lic_name})" if lic_name else "") + f", inherited from the base model [{base}]"
            f"({_link(base)})." + (f" Licence text: {lic_link}." if lic_link else ""))


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
    cfg = TokenReductionConfig.coerce(token_reduction)
    model_type = config.model_type
    family = FAMILIES[model_type]
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
    license_text = _license_text(base, lic, lic_name, lic_link)
    eval_table = eval_source = eval_notes = ""
    if eval_results is not None:
        eval_table, eval_source, eval_notes = _eval_sections(eval_results)
    lengths = flops["layer_lengths"]
    shown = ", ".join(f"{n}" for n in lengths) if len(lengths) <= 24 else \
        ", ".join(map(str, lengths[:6])) + ", …, " + ", ".join(map(str, lengths[-3:]))
    base_display = {"random": f"random weights ({base}, for testing only)",
                    "bundled": f"{base}, a small model shipped with hf-tokred (for trying it out)"}.get(
        special_spec(base), base)
    settings = cfg.to_dict()
    template = resources.files("hf_tokred") / "model_cards" / "reduced_variant.md"
    return ModelCard.from_template(
        data,
        template_str=template.read_text(encoding="utf-8"),
        title=f"{repo_id}: {family.name} + {cfg.method} token reduction",
        kind=kind,
        base_model=base,
        base_display=base_display,
        base_link=_link(base),
        base_revision=base_revision,
        base_family=family.name,
        base_class=family.lm_class,
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
    if special_spec(base) in ("random", "bundled"):
        return "https://pypi.org/project/hf-tokred/"
    return Path(base).resolve().as_uri() if os.path.exists(base) else base
