"""Guards the collection of tests/gpu/test_ln_modulate_gpu.py on the CPU (its tests skip here, so a slip in
their parametrization only shows on a GPU, in the lead's few minutes of device time):

* every test that takes the indirect ``kernels`` fixture is parametrized over it (a test without the
  parameter errors at set-up: ``request.param`` is missing; this happened when a decorator moved to a
  neighbouring test);
* ``-k per_token`` selects exactly the per-token cases (bench/gpu/gpu_check.sh's ``pertoken`` step runs them):
  a test parametrized over ``per_token`` names the layout in its id.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
GPU_FILE = "tests/gpu/test_ln_modulate_gpu.py"

PLUGIN = '''
def pytest_collection_finish(session):  # the items after -k deselection
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "kernels" in item.fixturenames and "kernels" not in params:
            print("NOPARAM", item.nodeid)
        if "per_token" in params and ("per_token" in item.name) != bool(params["per_token"]):
            print("BADID", item.nodeid)
        print("ITEM", item.nodeid)
'''


def _collect(tmp_path: Path, *args: str) -> list:
    (tmp_path / "gpu_collect_guard.py").write_text(PLUGIN)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "gpu_collect_guard",
                        "-p", "no:cacheprovider", GPU_FILE, *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [line.split(" ", 1) for line in r.stdout.splitlines() if line.split(" ", 1)[0] in
            ("NOPARAM", "BADID", "ITEM")]


def test_gpu_tests_parametrize_their_indirect_fixtures_and_name_the_layout(tmp_path):
    lines = _collect(tmp_path)
    assert not [n for k, n in lines if k == "NOPARAM"], "tests taking `kernels` without its parametrize"
    assert not [n for k, n in lines if k == "BADID"], "per_token-parametrized ids that do not name the layout"
    items = [n for k, n in lines if k == "ITEM"]
    assert len(items) > 500, len(items)


def test_the_pertoken_selection_holds_the_per_token_cases(tmp_path):
    """What `-k per_token` runs: the bench's shape, the table gradient, poisoned outputs, determinism, edges."""
    items = [n for k, n in _collect(tmp_path, "-k", "per_token") if k == "ITEM"]
    for want in ("test_wan_shapes[per_token-1x32760x1536-v1]", "test_wan_shapes[per_token-1x32760x1536-v2]",
                 "test_per_token_gradient_of_the_table[1-32760-1536-v2]", "test_poisoned_outputs_fully_written[",
                 "test_deterministic[per_token-D1536-v1]", "test_edge_sizes[per_token-", "test_long_sequences",
                 "test_no_host_synchronisation[per_token]", "test_matches_fp64[", "test_v1_and_v2_agree["):
        assert any(want in n for n in items), want
    assert not any("per_sample" in n for n in items)
