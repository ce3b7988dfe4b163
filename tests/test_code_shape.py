"""Guards the shape of the package: no function in ds_adaptive/ longer than 80 lines, and the core
never imports the runtime integrations in patches/ (issue 13)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ds_adaptive"
MAX_LINES = 80


def _functions(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_no_function_in_the_package_is_longer_than_80_lines():
    long = [f"{p.relative_to(ROOT)}:{line} {name} ({n} lines)"
            for p in sorted(PACKAGE.rglob("*.py")) for name, line, n in _functions(p) if n > MAX_LINES]
    assert not long, f"functions over {MAX_LINES} lines (split them): " + "; ".join(long)


def test_the_checker_sees_long_functions(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    f = tmp_path / "m.py"
    f.write_text(f"def long():\n{body}\n")
    assert [n for _, _, n in _functions(f)] == [MAX_LINES + 1]


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_the_core_never_imports_patches():
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in sorted(PACKAGE.rglob("*.py")) for m in _imports(p)
           if m == "patches" or m.startswith(("patches.", "ds_adaptive.patches"))]
    assert not bad, "ds_adaptive/ must not import patches/ (patches build on the core, not the reverse): " + \
        "; ".join(bad)
