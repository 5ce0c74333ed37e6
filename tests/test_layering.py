"""The package's plan: imports only run down the layers, no two modules import each other,
the package root stays small.

Layers, bottom first (a module may import its own layer and the ones below):

    0  errors, metadata, env
    1  config, platform, quant
    2  contract, weights, activations
    3  kernels
    4  experts, dispatch
    5  modular, testing.problems
    6  oracle
    7  api, layer, routing
    8  integrations, checkpoints
    9  tools, testing.ep_check
    10 cli, the package root (``fusedmoe/__init__``)

Every import counts, including those inside functions (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import fusedmoe

ROOT = pathlib.Path(fusedmoe.__file__).parent
LAYERS = [
    ("errors", "metadata", "env"),
    ("config", "platform", "quant"),
    ("contract", "weights", "activations"),
    ("kernels",),
    ("experts", "dispatch"),
    ("modular", "testing.problems"),
    ("oracle",),
    ("api", "layer", "routing"),
    ("integrations", "checkpoints"),
    ("tools", "testing.ep_check"),
    ("cli", ""),
]


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> int:
    """The layer of ``module`` (relative to the package): its longest matching prefix."""
    best, level = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if module == name or (name and module.startswith(name + ".")) or (name == "" and module == ""):
                if len(name) > best:
                    best, level = len(name), i
    if module == "testing":  # the package's face re-exports problems
        return 5
    assert level is not None, f"fusedmoe.{module} is in no layer: add it to LAYERS"
    return level


def _imports(path: pathlib.Path, module: str) -> set[str]:
    """Package-relative names of the fusedmoe modules ``path`` imports."""
    is_pkg = path.name == "__init__.py"
    here = module.split(".") if module else []
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_pkg else here[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "fusedmoe":
                target = node.module.removeprefix("fusedmoe").lstrip(".")
            else:
                continue
            for alias in node.names:  # ``from . import env`` imports a module
                sub = f"{target}.{alias.name}" if target else alias.name
                sub_path = ROOT.joinpath(*sub.split("."))
                out.add(sub if sub_path.with_suffix(".py").exists() or sub_path.is_dir() else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fusedmoe":
                    out.add(alias.name.removeprefix("fusedmoe").lstrip("."))
    out.discard(module)
    return out


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


@pytest.mark.parametrize("module", sorted(MODULES), ids=lambda m: m or "fusedmoe")
def test_imports_run_down(module):
    mine = _layer(module)
    up = sorted(f"{m} (layer {_layer(m)})" for m in _imports(MODULES[module], module) if _layer(m) > mine)
    assert not up, f"fusedmoe.{module} (layer {mine}) imports from a layer above: {up}"


def test_no_two_modules_import_each_other():
    deps = {m: _imports(p, m) for m, p in MODULES.items()}
    pairs = sorted({tuple(sorted((a, b))) for a, ds in deps.items() for b in ds if a in deps.get(b, ())})
    # a package's __init__ re-exporting its own submodules is not a cycle of two modules
    pairs = [(a, b) for a, b in pairs if not (b.startswith(a + ".") or a.startswith(b + "."))]
    assert not pairs, f"modules importing each other: {pairs}"


def test_package_root_is_small():
    root_modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(root_modules) <= 14, root_modules


def test_public_face():
    from fusedmoe import (  # noqa: F401
        ExpertWeights,
        FusedMoE,
        FusedMoEError,
        MoEConfig,
        ParallelConfig,
        QuantScheme,
        RouterConfig,
        TensorQuant,
        TopK,
        UnsupportedError,
        fused_moe,
        select_experts,
    )


LONG_FUNCTION = 80  # lines; a longer one says why in a "# N lines: ..." comment at its top


def test_long_functions_say_why():
    unexplained = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = node.end_lineno - node.lineno + 1
                head = lines[node.lineno - 1 : node.body[0].end_lineno + 2]
                if size > LONG_FUNCTION and not any(" lines: " in line.strip()[:14] for line in head):
                    unexplained.append(f"fusedmoe.{module}.{node.name} ({size} lines)")
    assert not unexplained, f"functions over {LONG_FUNCTION} lines without a reason comment: {unexplained}"


def test_files_are_small():
    big = [f"fusedmoe.{m} ({n} lines)" for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 800]
    assert not big, big
