"""The package's import structure: layers that import only downwards, no cycle, no import inside a function.

Layers (lowest first): pure (settings values, model families, FLOPs) < math and kernels < integration with
transformers < services (models, evaluation, Hub publishing, bench) < command line.  Optional third-party
packages (lm-eval, triton, matplotlib, ...) may load lazily; the package's own modules never do.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_tokred"

LAYERS = {
    "hf_tokred.version": 0, "hf_tokred.config": 0, "hf_tokred.families": 0, "hf_tokred.flops": 0,
    "hf_tokred.mamba_ssm_format": 0, "hf_tokred.blocks": 0, "hf_tokred.hybrid_layers": 0, "hf_tokred.schedule": 0,
    "hf_tokred.bundled_models": 0,
    "hf_tokred.ops": 1, "hf_tokred.reduce": 1, "hf_tokred.select": 1,
    "hf_tokred.compat": 2, "hf_tokred.settings": 2, "hf_tokred.outputs": 2, "hf_tokred.loop": 2, "hf_tokred.hybrid": 2,
    "hf_tokred.forwards": 2, "hf_tokred.variant": 2, "hf_tokred.loading": 2, "hf_tokred.fastpath": 2,
    "hf_tokred.install": 2, "hf_tokred.question": 2, "hf_tokred.mamba_ssm_loading": 2, "hf_tokred.tokens": 2,
    "hf_tokred.models": 3, "hf_tokred.bench": 3, "hf_tokred.convert": 3, "hf_tokred.evaluation": 3, "hf_tokred.hub": 3,
    "hf_tokred.cli": 4,
    "hf_tokred": 5,
}
PURE_MAY_NOT_IMPORT = ("transformers", "torch")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(name: str) -> int:
    best = max((k for k in LAYERS if name == k or name.startswith(k + ".")), key=len)
    return LAYERS[best]


def imports(path: Path):
    """``(target module, inside a function?)`` for every import of the package's own modules."""
    name = module_name(path)
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    inner = {id(n) for f in functions for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                targets = [mod] if node.module else [f"{mod}.{a.name}" for a in node.names]
            elif node.module and node.module.split(".")[0] == "hf_tokred":
                targets = [node.module]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.split(".")[0] == "hf_tokred"]
        for t in targets:
            yield t, id(node) in inner


def known_module(target: str) -> str:
    """``target`` itself if it is a module of the package, else its parent (``from .x import name``)."""
    parts = target.split(".")
    while parts:
        cand = PACKAGE.parent.joinpath(*parts)
        if cand.with_suffix(".py").is_file() or (cand / "__init__.py").is_file():
            return ".".join(parts)
        parts = parts[:-1]
    raise AssertionError(f"unresolvable import {target}")


FILES = sorted(PACKAGE.rglob("*.py"))
GRAPH = {module_name(f): {known_module(t) for t, _ in imports(f)} - {module_name(f)} for f in FILES}


@pytest.mark.parametrize("path", FILES, ids=lambda p: module_name(p))
def test_no_import_of_the_package_inside_a_function(path):
    inner = [t for t, in_function in imports(path) if in_function]
    assert not inner, f"{module_name(path)} imports {inner} inside a function"


@pytest.mark.parametrize("path", FILES, ids=lambda p: module_name(p))
def test_imports_go_downwards(path):
    name = module_name(path)
    if path.name == "__main__.py":
        return
    up = [t for t in GRAPH[name] if layer(t) > layer(name)
          and not (name.startswith(t + ".") and t != "hf_tokred")]  # a package's own __init__ is fine
    assert not up, f"{name} (layer {layer(name)}) imports {[(t, layer(t)) for t in up]}"


def test_no_import_cycle():
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(GRAPH.get(node, ())):
            if nxt.startswith(node + "."):
                continue  # a package importing its own submodules
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack + [node, nxt]))
            if state.get(nxt) is None:
                visit(nxt, stack + [node])
        state[node] = 2

    for node in sorted(GRAPH):
        if state.get(node) is None:
            visit(node, [])


def test_kernels_never_import_the_method():
    for name, targets in GRAPH.items():
        if name.startswith("hf_tokred.ops"):
            assert "hf_tokred.reduce" not in targets, name


@pytest.mark.parametrize("name", ["hf_tokred.version", "hf_tokred.config", "hf_tokred.families", "hf_tokred.flops",
                                  "hf_tokred.mamba_ssm_format", "hf_tokred.blocks", "hf_tokred.hybrid_layers",
                                  "hf_tokred.schedule",
                                  "hf_tokred.bundled_models"])
def test_pure_layer_imports_no_model_code(name):
    path = PACKAGE.parent.joinpath(*name.split(".")).with_suffix(".py")
    tree = ast.parse(path.read_text())
    mods = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    mods += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level]
    bad = [m for m in mods if m.split(".")[0] in PURE_MAY_NOT_IMPORT]
    assert not bad, f"{name} imports {bad}"


def test_module_and_function_sizes():
    """No module over about 400 lines, no function over about 80."""
    for path in FILES:
        if path.name.startswith("_") and path.name != "__init__.py":  # Triton kernel sources
            continue
        text = path.read_text()
        assert len(text.splitlines()) <= 420, f"{module_name(path)} has {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 85, f"{module_name(path)}.{node.name} has {length} lines"
