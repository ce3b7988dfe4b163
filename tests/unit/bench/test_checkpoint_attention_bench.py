"""bench/training/checkpoint_attention_ab.py plan and prepare, run as a program on the CPU: the planner predicts both
arms' epochs (keep never predicted slower where blocks are checkpointed), and prepare writes configs that differ only
in checkpoint_attention (its report is ds_adaptive.calibration.trainer_runs.epoch_figures,
tests/unit/calibration/test_trainer_runs.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT
from ds_adaptive.training.run_config import RunConfig

SCRIPT = ROOT / "bench" / "training" / "checkpoint_attention_ab.py"


def _run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(SCRIPT), *args, "--shapes", "long", "--num-samples", "30"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_plan_predicts_keep_faster_on_the_long_mix(tmp_path):
    _run("plan", "--out", str(tmp_path / "plan.json"))
    out = json.loads((tmp_path / "plan.json").read_text())
    r, k = out["recompute"], out["keep"]
    assert r["mean_checkpointed_blocks"] > 1                        # the long mix checkpoints blocks
    assert k["predicted_compute_s"] < r["predicted_compute_s"]
    assert out["keep_over_recompute_predicted_tokens_per_s"] > 1.0
    assert k["steps_per_epoch"] >= 1


def test_prepare_writes_configs_that_differ_only_in_checkpoint_attention(tmp_path):
    stdout = _run("prepare", "--dir", str(tmp_path))
    cmds = [x for x in stdout.splitlines() if "ds_adaptive.cli.train" in x]
    assert [c.rsplit("/", 1)[-1] for c in cmds] == ["recompute", "keep"]
    cfgs = {a: RunConfig.load(str(tmp_path / f"config_{a}.json"), trainer={"model": "wan2.1-1.3b"})
            for a in ("recompute", "keep")}
    assert cfgs["keep"].adaptive_load.recompute.attention == "keep"
    assert cfgs["recompute"].adaptive_load.recompute.attention == "recompute"
    same = lambda c: c.adaptive_load.model_dump(include={"sampler", "recompute", "optimization"},  # noqa: E731
                                                exclude={"recompute": {"attention"}})
    assert same(cfgs["keep"]) == same(cfgs["recompute"])
