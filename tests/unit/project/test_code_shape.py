"""Guards the shape of the package: no function in ds_adaptive/ longer than 80 lines, and the core
never imports its runtime integrations (ds_adaptive/integrations/)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
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


def test_the_core_never_imports_the_integrations():
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in sorted(PACKAGE.rglob("*.py")) for m in _imports(p)
           if p.relative_to(PACKAGE).parts[0] not in ("integrations", "cli")
           and m.startswith(("patches", "ds_adaptive.integrations"))]
    assert not bad, "ds_adaptive/ must not import its integrations (they build on the core, not the reverse): " + \
        "; ".join(bad)


# The model seam (docs/ARCHITECTURE.md): outside ds_adaptive/models/ nothing names a model family. Docstrings and
# comments may cite one as an example; identifiers, imports and string constants may not. The one exception is
# the launcher scripts' file names.
FAMILY_WORD = re.compile(r"wan(?!t|db)", re.IGNORECASE)   # not "want", not "wandb"
SEAM_MODULES = {"ds_adaptive.models", "ds_adaptive.models.registry", "ds_adaptive.models.family",
                "ds_adaptive.models.rope", "ds_adaptive.models.objective", "ds_adaptive.models.flow_sampler",
                "ds_adaptive.models.recompute"}
SEAM_PARTS = {"models", "registry", "family", "rope", "objective", "flow_sampler", "recompute"}
"""The seam and the pieces every family shares (rope, the flow-matching objective and its sampler, the recompute
policy)."""
LAUNCHER_FILES = re.compile(r"train_wan\.(py|sh|sbatch)")
"""The launcher scripts' file names (launch/train_wan.py, .sh, slurm/train_wan.sbatch) may be named in strings."""


def _docstring_ids(tree) -> set:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            ids.add(id(node.value))  # module / class / function / attribute docstrings
    return ids


def _family_mentions(path: Path):
    """(line, text) of every identifier, import or non-docstring string of ``path`` that names a family, and
    every import of a ``ds_adaptive.models`` module other than the seam (registry, family)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = _docstring_ids(tree)
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.keyword) and node.arg:
            names = [node.arg]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names] + [a.asname or "" for a in node.names]
            for a in node.names:
                if a.name.startswith("ds_adaptive.models.") and a.name not in SEAM_MODULES:
                    yield node.lineno, f"import {a.name}"
        elif isinstance(node, ast.ImportFrom):
            mod = ("." * node.level) + (node.module or "")
            parts = mod.lstrip(".").split(".")
            if "models" in parts and parts[-1] not in SEAM_PARTS:  # ds_adaptive.models.<not the seam>
                yield node.lineno, f"from {mod} import ..."
            names = [mod] + [a.name for a in node.names] + [a.asname or "" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            names = [LAUNCHER_FILES.sub("", node.value)]
        for n in names:
            if n and FAMILY_WORD.search(n):
                yield getattr(node, "lineno", 0), n[:80]


def test_nothing_outside_models_names_a_model_family():
    # integrations/ patches other projects' models (diffusers' Wan) and so names them
    roots = [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] not in ("models", "integrations")]
    found = [f"{p.relative_to(ROOT)}:{line} {text!r}" for p in roots for line, text in _family_mentions(p)]
    assert not found, ("outside ds_adaptive/models/ the package asks the registry (ds_adaptive.models.registry."
                       "get_model) and never names a model family: " + "; ".join(found))


def test_the_family_check_sees_names_imports_and_strings(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""Docstrings may say Wan."""\nfrom ds_adaptive.models.wan import WanModel\n'
                 'from .models.weights import x\nfrom .models.registry import get_model\n'
                 'DEFAULT = "wan2.1-1.3b"\nwanted = "train_wan.py"\n# a Wan comment\n')
    found = [text for _, text in _family_mentions(f)]
    assert "from ds_adaptive.models.wan import ..." in found and "WanModel" in found
    assert "from .models.weights import ..." in found and "wan2.1-1.3b" in found
    assert not any("registry" in t or "Docstrings" in t or t == "wanted" or "train_wan" in t for t in found)
