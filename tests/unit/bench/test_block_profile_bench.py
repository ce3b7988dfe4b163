"""Guards the plumbing of bench/kernels/block_profile.py (a GPU benchmark) on the CPU: it runs end to end with the tiny
model on small cases (trace, A/B of the fusion modes) and writes its JSON; the GPU figures are not tested."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT


# the compile caches CI keeps between runs (.ci/run): the 'rope' mode's compile is most of this test's time
CACHES = {k: os.environ[k] for k in ("TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR") if k in os.environ}


@pytest.mark.slow   # ~1 min on a shared 2-core machine (one compile of the 'rope' mode)
def test_runs_on_the_cpu_and_writes_json(tmp_path):
    out = tmp_path / "bp.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels" / "block_profile.py"), "--device", "cpu", "--model", "tiny",
                        "--quick", "--modes", "off,rope", "--out", str(out)], capture_output=True, text=True,
                       timeout=600, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                         **CACHES})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [t["S"] for t in data["traces"]] == [64, 240]
    assert {m for t in data["traces"] for m in t["fwd_modules_us"]} >= {"self_attn.q", "ffn", "cross_attn"}
    assert [(r["mode"], r["S"]) for r in data["ab"]] == [("off", 64), ("off", 240), ("rope", 64), ("rope", 240)]
    assert all(r["ms"] > 0 and r["speedup_vs_off"] > 0 for r in data["ab"])
    assert (tmp_path / "block_trace_3x64.json").is_file()
