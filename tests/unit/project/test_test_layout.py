"""Guards where the tests live: a test module under tests/unit/ runs in one process (at most one rank of the trainer
through ``launch_ranks(..., 1, ...)``); a test that starts several ranks belongs in tests/integration/."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
UNIT = ROOT / "tests" / "unit"
# calls that start several processes of one job: our harness (with a world size other than 1) and torch's own
_SPAWNERS = {"start_processes", "spawn"}
_HARNESS = {"launch_ranks", "launch_script", "run_ranks"}   # tests/conftest.py: (argv or script, world, ...)


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def multi_process_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) of each call in ``source`` that starts several ranks: the harness's ``launch_ranks`` /
    ``launch_script`` / ``run_ranks`` with a world size that is not the literal 1, ``mp.start_processes`` /
    ``mp.spawn``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        if name in _HARNESS:
            world = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "world"),
                                                                  None)
            if not (isinstance(world, ast.Constant) and world.value == 1):
                found.append((node.lineno, ast.unparse(node)[:80]))
        elif name in _SPAWNERS and isinstance(node.func, ast.Attribute):
            found.append((node.lineno, ast.unparse(node)[:80]))
    return found


def test_unit_tests_start_no_second_rank():
    bad = [f"{p.relative_to(ROOT)}:{line}: {call}" for p in sorted(UNIT.rglob("test_*.py"))
           for line, call in multi_process_calls(p.read_text())]
    assert not bad, "multi-process tests belong in tests/integration/:\n" + "\n".join(bad)


def test_the_check_sees_a_second_rank():
    src = ("launch_ranks(argv, 2, cwd=p)\nlaunch_ranks(argv, world, cwd=p)\nlaunch_ranks(argv, 1, cwd=p)\n"
           "mp.start_processes(f, nprocs=2)\nlaunch_ranks(argv, world=1, cwd=p)\nlaunch_script(MODEL, 4, tmp)\n"
           "run_ranks(argv, 1, cwd=p)\n")
    assert [line for line, _ in multi_process_calls(src)] == [1, 2, 4, 6]
