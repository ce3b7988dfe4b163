"""The suite starts only where the processes its tests start run this checkout (tests/conftest.py
``installed_package_problem``): an editable install of another checkout made every console-script and fresh-rank
test fail with ``No module named 'ds_adaptive'`` (or run the other checkout's code) instead of one line up front."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT, installed_package_problem


def _shadow(tmp_path):
    """An empty ``ds_adaptive`` package of another checkout; returns the directory to put on PYTHONPATH."""
    other = tmp_path / "other" / "ds_adaptive"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    return other.parent


def test_this_checkout_passes():
    assert installed_package_problem() is None


def test_another_checkout_on_the_path_is_named_with_the_fix(tmp_path):
    other = _shadow(tmp_path)
    problem = installed_package_problem({**os.environ, "PYTHONPATH": str(other)})
    assert problem is not None and "\n" not in problem
    assert f"finds it at {other / 'ds_adaptive' / '__init__.py'}" in problem and str(ROOT / "ds_adaptive" / "__init__.py") in problem
    assert 'pip install -e ".[dev]"' in problem


def test_a_python_that_cannot_start_is_named(tmp_path):
    problem = installed_package_problem({**os.environ, "PYTHONHOME": str(tmp_path / "nowhere")})
    assert problem is not None and "fails:" in problem and "\n" not in problem


def test_pytest_stops_with_that_line(tmp_path):
    """A whole pytest session against a shadowing checkout: exit 4 (usage error), the line on stderr, no test run."""
    r = subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests" / "unit" / "project" / "test_install_check.py"),
                        "-p", "no:randomly", "-p", "no:cacheprovider", "-q", "-k", "this_checkout"],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(_shadow(tmp_path))}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    assert "finds it at" in r.stderr and "passed" not in r.stdout
