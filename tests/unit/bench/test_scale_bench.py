"""bench/training/scale.py, run as a program on the CPU (no training): the at-scale plan is fair (same samples, same gas,
>= 50 steps, no drops) and the per-arm run arguments reproduce the plan's dataset. The summary's loss-curve gap is
ds_adaptive.simulation.curves.loss_curve_gap (tests/unit/simulation/test_curves.py)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = ROOT / "bench" / "training" / "scale.py"


def _scale(*args, check=True):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def plan_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale")
    _scale("plan", "--num-gpus", "8", "--configs", "wan1.3b", "--out", str(out))
    return json.loads((out / "scale_plan.json").read_text())


def test_plan_arms_are_fair_and_long_enough(plan_report):
    rows = plan_report["rows"]
    assert {r["arm"] for r in rows} == {"baseline", "adaptive", "adaptive_sparse"}
    assert {r["seed"] for r in rows} == {0, 1, 2} and plan_report["min_steps"] == 50
    for seed in (0, 1, 2):
        mine = [r for r in rows if r["seed"] == seed]
        assert len({r["samples"] for r in mine}) == 1, mine          # the same samples in every arm
        assert all(r["dropped"] == 0 for r in mine)
        assert all(r["gas"] == 1 for r in mine)                       # the same gradient accumulation
        assert all(r["steps"] >= plan_report["min_steps"] + 1 for r in mine)   # >= 50 after the warm-up step
        # the dual budget brings the steps within 15% of the baseline's (memory-bound remainder)
        base = next(r for r in mine if r["arm"] == "baseline")
        assert all(abs(r["steps"] - base["steps"]) <= 0.15 * base["steps"] for r in mine)
    # the simulator predicts a gain at 8 and 16 GPUs; the balance is what carries it
    sims = plan_report["simulated"]["wan1.3b"]
    assert [s["world"] for s in sims] == [8, 16]
    assert all(s["ratio_dual_over_tokens"] > 1.0 and s["cv"]["dual"] < s["cv"]["tokens"] for s in sims)


def test_run_args_fix_the_dataset_of_the_whole_configuration(plan_report, tmp_path):
    row = next(r for r in plan_report["rows"] if r["seed"] == 1 and r["arm"] == "adaptive")
    args = _scale("args", "wan1.3b", "--arm", "adaptive", "--seed", "1", "--num-gpus", "8", "--out",
                  str(tmp_path)).stdout.split()
    assert args[args.index("--num-samples") + 1] == str(row["num_samples"])
    assert "--min-steps" not in args and args[args.index("--arms") + 1] == "adaptive"
    bad = _scale("args", "wan14b", "--arm", "baseline", "--seed", "0", "--num-gpus", "6", "--out", str(tmp_path),
                 check=False)
    assert bad.returncode != 0 and "needs a multiple of sp=4" in bad.stderr
