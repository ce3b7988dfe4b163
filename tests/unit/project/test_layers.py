"""Guards the package's map (docs/ARCHITECTURE.md): layers import one way, no import circle of two or more modules
(imports inside functions counted), a function-local import only where it keeps an optional dependency optional,
few modules at the root, no module over 600 lines and no class over 300."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "ds_adaptive"

LAYERS = ("core", "ops", "models", "parallel", "attention", "data", "media", "preprocess", "planning", "calibration",
          "simulation", "training", "inference", "integrations", "launch", "cli")
"""Each layer imports only from itself and the layers before it."""

OPTIONAL = ("triton", "peft", "diffusers", "transformers", "av", "PIL", "matplotlib", "tensorboard", "megatron",
            "apex", "wandb", "ftfy", "xxhash", "pyarrow")
"""Third-party packages the package runs without (extras): a module that imports one at its top level may be
imported inside a function, so that the rest works without it."""

MAX_FUNCTION_LOCAL = 40
MAX_ROOT_MODULES = 8
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def _resolve(name: str, modules: dict) -> str | None:
    """The package module that ``import name`` loads (the longest known prefix)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _function_local(tree: ast.AST) -> set[int]:
    local = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return local


def import_edges(package: Path = PACKAGE) -> list[tuple[str, str, bool, int]]:
    """(importer, imported, inside a function, line) for every import of a package module by a package module."""
    modules = _modules(package)
    root = package.name
    edges = []
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        local = _function_local(tree)
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
            for t in targets:
                if t == root or t.startswith(root + "."):
                    target = _resolve(t, modules)
                    if target and target != mod:
                        edges.append((mod, target, id(node) in local, node.lineno))
    return edges


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def upward_imports(edges) -> list[str]:
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for a, b, _, line in edges:
        la, lb = layer_of(a), layer_of(b)
        if la in rank and lb in rank and rank[lb] > rank[la]:
            bad.append(f"{a}:{line} imports {b} ({la} may not import {lb}: it is a later layer)")
    return bad


def import_circles(edges) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan)."""
    graph: dict[str, set] = {}
    for a, b, _, _ in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def needs_optional(path: Path) -> str | None:
    """The optional dependency ``path`` imports at its top level, if any."""
    for node in ast.parse(path.read_text()).body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        for n in names:
            if n.split(".")[0] in OPTIONAL:
                return n
    return None


def test_layers_import_one_way():
    bad = upward_imports(import_edges())
    assert not bad, "imports that go up a layer (docs/ARCHITECTURE.md): " + "; ".join(bad)


def test_no_import_circle():
    circles = import_circles(import_edges())
    assert not circles, "import circles (function-local imports included): " + "; ".join(" <-> ".join(c) for c in circles)


def test_function_local_imports_only_keep_optional_dependencies_optional():
    modules = _modules()
    local = [(a, b, line) for a, b, inside, line in import_edges() if inside]
    unjustified = [f"{a}:{line} imports {b} inside a function" for a, b, line in local if needs_optional(modules[b]) is None]
    assert not unjustified, "function-local imports of package modules that need no optional dependency (import them " \
                            "at the top of the module): " + "; ".join(unjustified)
    assert len(local) <= MAX_FUNCTION_LOCAL


def test_the_package_root_is_small_and_modules_and_classes_are_bounded():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"modules directly in ds_adaptive/: {root}"
    long_modules = [f"{p.relative_to(ROOT)} ({n} lines)" for p in sorted(PACKAGE.rglob("*.py"))
                    if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines (split them by job): " + "; ".join(long_modules)
    long_classes = [f"{p.relative_to(ROOT)}:{c.lineno} {c.name} ({c.end_lineno - c.lineno + 1} lines)"
                    for p in sorted(PACKAGE.rglob("*.py")) for c in ast.walk(ast.parse(p.read_text()))
                    if isinstance(c, ast.ClassDef) and c.end_lineno - c.lineno + 1 > MAX_CLASS_LINES]
    assert not long_classes, f"classes over {MAX_CLASS_LINES} lines: " + "; ".join(long_classes)


def test_every_package_directory_is_a_known_layer():
    dirs = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert set(dirs) <= set(LAYERS), f"sub-packages that are not in LAYERS: {sorted(set(dirs) - set(LAYERS))}"


@pytest.fixture()
def toy(tmp_path):
    pkg = tmp_path / "ds_adaptive"
    for sub in ("core", "planning"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    return pkg


def test_the_checks_see_an_upward_import_a_circle_and_a_local_import(toy):
    (toy / "core" / "a.py").write_text("from ds_adaptive.planning import b\n")
    (toy / "planning" / "b.py").write_text("def f():\n    from ds_adaptive.core import a\n")
    edges = import_edges(toy)
    assert ("ds_adaptive.core.a", "ds_adaptive.planning.b", False, 1) in edges
    assert ("ds_adaptive.planning.b", "ds_adaptive.core.a", True, 2) in edges
    assert upward_imports(edges) and import_circles(edges) == [["ds_adaptive.core.a", "ds_adaptive.planning.b"]]
    (toy / "core" / "c.py").write_text("from . import a\n")
    assert ("ds_adaptive.core.c", "ds_adaptive.core.a", False, 1) in import_edges(toy)
