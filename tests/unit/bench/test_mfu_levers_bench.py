"""bench/training/mfu_levers.py prepare, run as a program on the CPU: the arms' configs differ only in their lever and
pin the same plan (its report is ds_adaptive.calibration.trainer_runs.pinned_ab,
tests/unit/calibration/test_trainer_runs.py)."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT
from ds_adaptive.training.run_config import RunConfig

SCRIPT = ROOT / "bench" / "training" / "mfu_levers.py"


def test_prepare_writes_arms_that_differ_only_in_their_lever(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(SCRIPT), "prepare", "--dir", str(tmp_path), "--gas", "2", "--steps", "21",
                        "--num-samples", "2000"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    cfgs = {n: RunConfig.load(str(tmp_path / f"{n}.json"), trainer={"model": "wan2.1-1.3b"})
            for n in ("config", "config_fusion", "config_zero")}
    assert cfgs["config"].adaptive_load.block_fusion == "off" and cfgs["config_fusion"].adaptive_load.block_fusion == "regions"
    assert cfgs["config_zero"].ds_config["zero_optimization"]["reduce_bucket_size"] == 200_000_000
    assert cfgs["config"].adaptive_load.sampler == cfgs["config_zero"].adaptive_load.sampler   # one pinned plan
    assert "--log-dir " + str(tmp_path / "runs" / "fusion") in r.stdout
