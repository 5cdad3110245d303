"""What a variant's base model is: an hf_tokred spec, a local folder or a Hub id, and its licence."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard

from ..bundled_models import BUNDLED, BUNDLED_PREFIX

__all__ = ["base_license", "is_hub_id", "settings_base", "special_spec"]


def special_spec(spec: str) -> str | None:
    """``"random"`` / ``"bundled"`` for hf_tokred's own model specs, else ``None`` (a Hub id or a path)."""
    if spec.startswith("random:"):
        return "random"
    if spec.removeprefix("bundled:") in BUNDLED and not os.path.isdir(spec):
        return "bundled"
    return None


def is_hub_id(name: str) -> bool:
    """Whether ``name`` looks like a Hub repo id (``owner/name`` or ``name``) rather than a local path."""
    if os.path.exists(name) or special_spec(name):
        return False
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name) is not None and ".." not in name


def settings_base(spec: str) -> str:
    """The ``base_model`` string a settings-only variant of ``spec`` stores."""
    kind = special_spec(spec)
    if kind == "random":
        raise ValueError(
            f"{spec} has random weights that exist nowhere else, so a settings-only variant cannot point at them; "
            "publish a full copy instead (full_copy=True / --full-copy)"
        )
    if kind == "bundled":  # the same in every installation (a folder path would break once published)
        return BUNDLED_PREFIX + spec.removeprefix(BUNDLED_PREFIX)
    if os.path.isdir(spec):
        return str(Path(spec).resolve())
    return spec


def base_license(base: str, revision: str | None, config: Any = None) -> tuple[str | None, str | None, str | None]:
    """``(license, license_name, license_link)`` from the base model's card (or config), if known."""
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
