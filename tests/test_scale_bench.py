"""bench/scale.py (issue 19): the at-scale plan is fair (same samples, same gas, >= 50 steps, no drops),
its per-arm run arguments reproduce the plan's dataset, and the summary's loss-curve gap. CPU, no training."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import scale  # noqa: E402


@pytest.fixture(scope="module")
def plan_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale")
    assert scale.main(["plan", "--num-gpus", "8", "--configs", "wan1.3b", "--out", str(out)]) == 0
    return json.loads((out / "scale_plan.json").read_text())


def test_plan_arms_are_fair_and_long_enough(plan_report):
    rows = plan_report["rows"]
    assert {r["arm"] for r in rows} == set(scale.CONFIGS["wan1.3b"]["arms"])
    for seed in scale.SEEDS:
        mine = [r for r in rows if r["seed"] == seed]
        assert len({r["samples"] for r in mine}) == 1, mine          # the same samples in every arm
        assert all(r["dropped"] == 0 for r in mine)
        assert all(r["gas"] == 1 for r in mine)                       # the same gradient accumulation
        assert all(r["steps"] >= scale.MIN_STEPS + 1 for r in mine)   # >= 50 after the warm-up step
        # the dual budget brings the steps within 15% of the baseline's (memory-bound remainder)
        base = next(r for r in mine if r["arm"] == "baseline")
        assert all(abs(r["steps"] - base["steps"]) <= 0.15 * base["steps"] for r in mine)
    # the simulator predicts a gain at 8 and 16 GPUs; the balance is what carries it
    sims = plan_report["simulated"]["wan1.3b"]
    assert [s["world"] for s in sims] == [8, 16]
    assert all(s["ratio_dual_over_tokens"] > 1.0 and s["cv"]["dual"] < s["cv"]["tokens"] for s in sims)


def test_run_args_fix_the_dataset_of_the_whole_configuration(plan_report, tmp_path):
    row = next(r for r in plan_report["rows"] if r["seed"] == 1 and r["arm"] == "adaptive")
    args = scale.run_args("wan1.3b", num_gpus=8, seed=1, arm="adaptive", out=str(tmp_path))
    assert args[args.index("--num-samples") + 1] == str(row["num_samples"])
    assert "--min-steps" not in args and args[args.index("--arms") + 1] == "adaptive"
    with pytest.raises(SystemExit):
        scale.e2e_args("wan14b", num_gpus=6, seed=0, arms=["baseline"], out=str(tmp_path))


def test_loss_curve_gap():
    a = {"loss_curve": {"samples_seen": [10, 20, 30, 40, 50, 60], "loss": [2.0, 1.8, 1.6, 1.5, 1.4, 1.3]}}
    b = {"loss_curve": {"samples_seen": [12, 24, 36, 48, 60], "loss": [2.0, 1.8, 1.6, 1.5, 1.4]}}
    assert scale.loss_curve_gap(a, a, smooth=1) == 0.0
    same_shifted = {"loss_curve": {"samples_seen": a["loss_curve"]["samples_seen"],
                                   "loss": [x * 1.02 for x in a["loss_curve"]["loss"]]}}
    assert scale.loss_curve_gap(same_shifted, a, smooth=1) == pytest.approx(0.02)
    assert scale.loss_curve_gap(a, b, smooth=2) > 0.0
