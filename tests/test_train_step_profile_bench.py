"""Guards bench/train_step_profile.py on the CPU: the trainer's step is split into its segments (fetch, forward,
backward, the engine's inner and boundary steps, the metrics), every micro-step's call is counted, the segments and
the host time between them add up to the timed step, and the profiled step lists the same segments as ranges and its
elementwise operators by input shape."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_segments_add_up_to_the_step(tmp_path):
    out = tmp_path / "p"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}  # its own world of one, as users run it
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "train_step_profile.py"), "--out", str(out), "--config",
                          str(ROOT / "launch" / "configs" / "cpu_tiny.json"), "--model", "tiny", "--gas", "2",
                          "--num-samples", "64", "--warm", "1", "--timed", "1", "--profiled", "1", "--set",
                          f'adaptive_load.sampler.shapes="{ROOT / "launch" / "configs" / "shapes_cpu.json"}"'],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((out / "train_step_profile.json").read_text())
    assert doc["gas"] == 2
    calls = doc["timed"]["calls_per_step"]
    assert calls["data"] == calls["forward"] == calls["backward"] == 2
    assert calls["step_inner"] == 1 and calls["step_boundary"] == 1 and calls["end_step"] == 1
    seg = doc["timed"]["segments_ms"]
    assert sum(seg.values()) == pytest.approx(doc["timed"]["step_ms"])
    assert all(v > 0 for k, v in seg.items() if k in ("forward", "backward"))
    assert {"data", "forward", "backward", "step_boundary"} <= set(doc["profiled"]["segments"])
    assert [s["kind"] for s in doc["steps"]] == ["warm", "timed", "profiled"]
    tables = (out / "profile_tables.txt").read_text()
    assert tables.count("Self CPU") >= 2 and "elementwise operators by input shape" in tables
    rows = doc["profiled"]["elementwise_by_shape"]   # copies / adds / casts, told apart by the tensors they move
    assert rows and all(r["op"].startswith("aten::") and r["shapes"].startswith("[") and r["calls"] > 0 for r in rows)
    assert "| backward |" in res.stdout
