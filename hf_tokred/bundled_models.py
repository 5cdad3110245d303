"""The models shipped inside the package (``bundled:NAME`` everywhere a model is named), found by name.

A settings-only variant of a bundled model stores ``bundled:NAME`` as its base: every hf_tokred installation has
the same files, so the variant loads wherever hf_tokred is installed (a folder path would not, once published).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["BUNDLED", "BUNDLED_PREFIX", "bundled_name", "bundled_path"]

BUNDLED_PREFIX = "bundled:"

#: bundled models: the two small language models and the multi-query associative recall model (a Mamba-1 one,
#: ``recall-mamba``, joins it once its training passes 90 % recall; docs/quality.md), and the same recall model
#: fine-tuned with the key-value block at any depth of the filler, and the passkey (needle in a haystack) model
#: (docs/long-prompts.md)
BUNDLED = ("mamba", "mamba2", "recall-mamba2", "recall-mamba2-anydepth", "passkey-mamba2")


def bundled_path(family: str) -> Path:
    if family not in BUNDLED:
        raise ValueError(f"unknown bundled model {family!r}; choose one of {', '.join(BUNDLED)}")
    path = Path(str(resources.files("hf_tokred") / "bundled" / family))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the bundled {family} model is missing from this installation ({path}); reinstall hf-tokred, or use "
            "--model random:mamba-tiny / a local checkpoint"
        )
    return path


def bundled_name(spec: str) -> str | None:
    """``NAME`` for ``bundled:NAME`` of a bundled model, else ``None``."""
    name = spec.removeprefix(BUNDLED_PREFIX) if isinstance(spec, str) and spec.startswith(BUNDLED_PREFIX) else None
    return name if name in BUNDLED else None
