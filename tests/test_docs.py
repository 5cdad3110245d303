"""The README and ``docs/`` still say what runs: every command they show is checked as far as a cheap check can.

* each ``hf-tokred`` command (also under ``accelerate launch`` / ``torchrun -m hf_tokred.cli``) is parsed by the
  CLI's own parser, its reduction flags are turned into settings, and its ``bundled:`` / ``random:`` models exist;
* each ``python examples/*.py`` / ``dev/*.py`` call is parsed by the script's own argparse parser (in one
  subprocess; the script stops right after parsing), each ``bash`` script exists and passes ``bash -n``;
* the install command asks for the torch ``.ci/run`` installs and extras ``pyproject.toml`` declares; the README
  keeps the two set-up commands ``.ci/run`` relies on, verbatim;
* pytest paths and node ids, repository paths named in backticks, links and ``#anchors``, ``HF_TOKRED_*``
  variables, and the names the Python snippets take from ``hf_tokred`` and ``transformers`` exist.

Commands are taken from ```` ```bash ```` blocks and from inline code that starts with a command. A command of a
kind this file does not know fails the test: add a check for it here.  Nothing is run for real.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import transformers

import hf_tokred
from hf_tokred.cli import build_parser
from hf_tokred.cli.common import reduction_from_args
from hf_tokred.models import check_model_spec

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: The two set-up commands: CI (``.ci/run``) runs them, users copy them from the README.
MAIN_JOB = ('python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install -e ".[test,eval]" '
            '&& HF_HUB_OFFLINE=1 .venv/bin/hf-tokred generate --model bundled:mamba --flops-reduction 0.2')
TEST_COMMAND = "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/python -m pytest -q tests/"

#: Placeholders the prose uses inside commands, and a value of the right kind for each.
PLACEHOLDERS = {"L": "2048", "<variants as JSON>": '{"front3_prune": {"method": "front3_prune"}}'}

FENCE = re.compile(r"^[ \t]*```([\w-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)  # list items indent them
INLINE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"^(?:hf_tokred|tests|examples|dev|results|model_cards|docs|\.ci)/[\w.*/-]*(?:::\w+)?$")
PYTHONS = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}
CLIS = {"hf-tokred", ".venv/bin/hf-tokred"}
PIPS = {"pip", ".venv/bin/pip"}
COMMAND_WORDS = PYTHONS | CLIS | PIPS | {"bash", "accelerate", "torchrun"}
SEPARATORS = {"&&", "||", ";", "|"}


# ------------------------------------------------------------------------------------------- reading the pages


def fenced(text: str, languages=("bash", "sh", "shell")) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in languages]


def prose(text: str) -> str:
    return FENCE.sub("", text)


def shell_lines(block: str) -> list[str]:
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def simple_commands(line: str) -> list[list[str]]:
    """``line`` as the simple commands it runs (split on ``&&``, ``;``, ``|``), comments and placeholders resolved."""
    for placeholder, value in PLACEHOLDERS.items():
        if placeholder.startswith("<"):
            line = line.replace(placeholder, value)
    words = [PLACEHOLDERS.get(w, w) for w in shlex.split(line, comments=True)]
    commands, current = [], []
    for w in words:
        if w in SEPARATORS:
            commands.append(current)
            current = []
        else:
            current.append(w)
    return [c for c in [*commands, current] if c]


def strip_prefix(argv: list[str]) -> tuple[dict, list[str]]:
    """Environment assignments and ``nice`` / ``env`` wrappers off the front: ``(env, the command itself)``."""
    env = {}
    while argv:
        if re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
            key, _, value = argv[0].partition("=")
            env[key] = value
            argv = argv[1:]
        elif argv[0] == "env":
            argv = argv[1:]
        elif argv[0] == "nice" and len(argv) > 2 and argv[1] == "-n":
            argv = argv[3:]
        else:
            break
    return env, argv


def is_command(argv: list[str]) -> bool:
    return bool(argv) and (argv[0] in COMMAND_WORDS or bool(re.fullmatch(r"(examples|dev)/\w+\.py", argv[0])))


def shown_commands() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` for every command a page shows: each line of a bash block, and inline code that starts
    with a command word (``hf-tokred ...``, ``python examples/...``, ``dev/mutate.py ...``)."""
    found = []
    for page in PAGES:
        text = page.read_text()
        name = page.relative_to(ROOT).as_posix()
        for block in fenced(text):
            for line in shell_lines(block):
                for argv in simple_commands(line):
                    found.append((f"{name}: {line.strip()}", strip_prefix(argv)[1]))
        for span in INLINE.findall(prose(text)):
            span = " ".join(span.split())
            try:
                commands = simple_commands(span)
            except ValueError:  # unbalanced quotes: prose, not a command
                continue
            for argv in commands:
                argv = strip_prefix(argv)[1]
                if argv and argv[-1] in ("...", "…"):  # "and more flags"
                    argv = argv[:-1]
                if is_command(argv) and len(argv) > 1:  # a bare `hf-tokred` / `.venv/bin/python` is a name
                    found.append((f"{name}: `{span}`", argv))
    return found


COMMANDS = shown_commands()


# -------------------------------------------------------------------------------------------------- the checks


def check_cli(argv: list[str]) -> None:
    """Parse as ``hf-tokred`` does (unknown flags are an error there too), then build the settings and check the
    named models. A bare ``hf-tokred eval`` in prose names the subcommand: it must exist."""
    parser = build_parser()
    if len(argv) == 1 and not argv[0].startswith("-"):
        assert argv[0] in parser._subparsers._group_actions[0].choices, f"no subcommand {argv[0]!r}"
        return
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit as err:
        raise AssertionError(f"hf-tokred {' '.join(argv)}: the parser refuses it (exit {err.code})") from None
    assert not unknown, f"unrecognized arguments: {unknown}"
    if hasattr(args, "flops_reduction"):
        reduction_from_args(args)
    model = getattr(args, "model", None)
    if isinstance(model, str) and model.startswith(("bundled:", "random:", "hf_tokred/")):
        check_model_spec(model)


def check_pip(argv: list[str]) -> None:
    assert argv[0] == "install", argv
    ci = (ROOT / ".ci" / "run").read_text()
    cpu_torch = re.search(r"^CPU_TORCH=(\S+)$", ci, re.M).group(1)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for word in argv[1:]:
        if word == "-e":
            continue
        if word.startswith("torch"):
            assert word == f"torch=={cpu_torch}", f"{word}: .ci/run installs torch=={cpu_torch}"
        elif word.startswith(".["):
            missing = set(word[2:-1].split(",")) - set(extras)
            assert word.endswith("]") and not missing, f"{word}: no such extra {missing} in pyproject.toml"
        else:
            raise AssertionError(f"pip install {word}: no check for it in tests/test_docs.py")


def check_pytest(argv: list[str]) -> None:
    for word in argv:
        if word.startswith("-"):
            continue
        path, _, test = word.partition("::")
        assert (ROOT / path).exists(), f"pytest {word}: no such path"
        if test:
            assert re.search(rf"^def {re.escape(test)}\(", (ROOT / path).read_text(), re.M), f"no test {word}"


def check_launcher(argv: list[str]) -> None:
    """``accelerate launch ... -m hf_tokred.cli ...`` / ``torchrun ... -m hf_tokred.cli ...``: the launcher's own
    parser, then the CLI's."""
    if argv[0] == "accelerate":
        from accelerate.commands.launch import launch_command_parser
        assert argv[1] == "launch", argv
        parser, rest = launch_command_parser(), argv[2:]
    else:
        from torch.distributed.run import get_args_parser
        parser, rest = get_args_parser(), argv[1:]
    try:
        args = parser.parse_args(rest)
    except SystemExit as err:
        raise AssertionError(f"{argv[0]}: its parser refuses the flags (exit {err.code})") from None
    assert args.module and args.training_script == "hf_tokred.cli", "a launcher runs -m hf_tokred.cli here"
    check_cli(args.training_script_args)


def script_calls() -> list[tuple[str, list[str]]]:
    """``(where, [script, *args])`` for the Python scripts the pages call."""
    calls = []
    for where, argv in COMMANDS:
        if argv[0] in PYTHONS and len(argv) > 1 and argv[1].endswith(".py"):
            calls.append((where, argv[1:]))
        elif argv[0].endswith(".py"):
            calls.append((where, argv))
    return calls


def _ids(commands) -> list[str]:
    counts: dict[str, int] = {}
    ids = []
    for where, _ in commands:
        page = where.split(":")[0]
        counts[page] = counts.get(page, 0) + 1
        ids.append(f"{page}-{counts[page]}")
    return ids


@pytest.mark.parametrize("where,argv", COMMANDS, ids=_ids(COMMANDS))
def test_command(where, argv):
    """One command a page shows (the id counts the page's commands in order; the failure names the line)."""
    head = argv[0]
    if "--model" in argv[:-1]:  # any command: a bundled / random model or a folder of this repository exists
        model = argv[argv.index("--model") + 1]
        if model.startswith(("bundled:", "random:", "hf_tokred/")):
            check_model_spec(model)
    if head in CLIS:
        check_cli(argv[1:])
    elif head in PIPS:
        check_pip(argv[1:])
    elif head in ("accelerate", "torchrun"):
        check_launcher(argv)
    elif head == "bash":
        script = ROOT / argv[1]
        assert script.is_file(), f"no script {argv[1]}"
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=60)
    elif head in PYTHONS and argv[1:3] == ["-m", "venv"]:
        assert len(argv) == 4
    elif head in PYTHONS and argv[1:3] == ["-m", "pytest"]:
        check_pytest(argv[3:])
    elif head in PYTHONS and argv[1:3] == ["-m", "hf_tokred.cli"]:
        check_cli(argv[3:])
    elif (head in PYTHONS and len(argv) > 1 and argv[1].endswith(".py")) or head.endswith(".py"):
        script = argv[1] if head in PYTHONS else head
        assert (ROOT / script).is_file(), f"no script {script}"  # its flags: test_script_flags_parse
    else:
        raise AssertionError(f"{where}: no check for this kind of command in tests/test_docs.py")


#: Runs each script as __main__ with argparse stopped right after a successful parse (nothing else runs).
_DRIVER = r"""
import argparse, contextlib, io, json, runpy, sys
class Parsed(Exception):
    pass
original = argparse.ArgumentParser.parse_args
def parse_args(self, *args, **kwargs):
    original(self, *args, **kwargs)
    raise Parsed
argparse.ArgumentParser.parse_args = parse_args
results = []
for script, *args in json.load(sys.stdin):
    sys.argv = [script, *args]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(script, run_name="__main__")
        results.append("the script never called parse_args")
    except Parsed:
        results.append(None)
    except SystemExit as exit:
        results.append(f"exit {exit.code}: {err.getvalue().strip()[-500:]}")
    except Exception as exc:
        results.append(f"{type(exc).__name__}: {exc}"[:500])
print(json.dumps(results))
"""


def test_script_flags_parse():
    """Every ``examples/`` and ``dev/`` call the pages show: its flags are accepted by the script's own parser."""
    calls = script_calls()
    assert calls, "the pages show no script call: the extraction is broken"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps([argv for _, argv in calls]), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    failures = [f"{where}: {result}" for (where, _), result in zip(calls, results) if result is not None]
    assert not failures, "\n".join(failures)


def test_readme_keeps_the_setup_commands():
    """The main job and the test command, verbatim, each a line of a bash block; the test command is what .ci/run
    runs last (with the variables it exports)."""
    lines = [line.strip() for block in fenced((ROOT / "README.md").read_text()) for line in shell_lines(block)]
    assert MAIN_JOB in lines and TEST_COMMAND in lines
    ci = (ROOT / ".ci" / "run").read_text()
    env, command = strip_prefix(TEST_COMMAND.split())
    assert ci.rstrip().endswith(" ".join(command))
    for key, value in env.items():
        assert re.search(rf"^export .*\b{key}={value}\b", ci, re.M), key


def test_the_extraction_finds_the_commands():
    """The checks above see what the pages show (a broken extraction would make them pass vacuously)."""
    wheres = [w for w, _ in COMMANDS]
    assert any(MAIN_JOB in w for w in wheres) and any(TEST_COMMAND in w for w in wheres)
    kinds = {argv[0] if argv[0] in COMMAND_WORDS else "script" for _, argv in COMMANDS}
    assert {"hf-tokred", ".venv/bin/hf-tokred", ".venv/bin/pip", "python", "python3", "accelerate", "torchrun",
            "bash", "script"} <= kinds, kinds
    assert len(script_calls()) >= 10 and sum(argv[0] in CLIS for _, argv in COMMANDS) >= 20


# ---------------------------------------------------------------------------------------- paths, links, names


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", prose(page.read_text()), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_paths_exist(page):
    text = page.read_text()
    missing = []
    for target in LINK.findall(prose(text)):
        if re.match(r"https?://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            missing.append(f"link {target}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            missing.append(f"anchor {target}")
    for span in INLINE.findall(prose(text)):
        span = span.strip()
        if REPO_PATH.match(span):
            path, _, test = span.partition("::")
            hits = list(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
            if not hits:
                missing.append(f"path {span}")
            elif test and not re.search(rf"^def {test}\(", hits[0].read_text(), re.M):
                missing.append(f"test {span}")
    assert not missing, f"{page.relative_to(ROOT)}: {missing}"


def test_environment_variables_exist():
    """Every ``HF_TOKRED_*`` variable the pages name is read somewhere in the code, the tests or .ci/run."""
    named = {v for page in PAGES for v in re.findall(r"\bHF_TOKRED_[A-Z_]+\b", page.read_text())}
    code = "\n".join(p.read_text() for d in ("hf_tokred", "tests") for p in (ROOT / d).rglob("*.py")
                     if p.name != "test_docs.py")
    code += (ROOT / ".ci" / "run").read_text()
    assert named and not {v for v in named if v not in code}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_snippets_compile_and_their_names_exist(page):
    modules = {"hf_tokred": hf_tokred, "transformers": transformers}
    for block in fenced(page.read_text(), languages=("python",)):
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                for alias in node.names:
                    assert hasattr(modules[node.module], alias.name), f"from {node.module} import {alias.name}"
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in modules):
                assert hasattr(modules[node.value.id], node.attr), f"{node.value.id}.{node.attr}"
