"""ds_adaptive.calibration.trainer_runs on recorded H200 trainer runs (tests/data/trainer_runs) and planted ones: MFU
per micro-batch, the loop's time beyond the calibrated cost (re-costed runs and their fits), and the A/B reports of
bench/training/mfu_levers.py and checkpoint_attention_ab.py."""
from __future__ import annotations

import json

import pytest

from conftest import ROOT
from ds_adaptive.calibration import trainer_runs as tr
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import load_profile

RUNS = ROOT / "tests" / "data" / "trainer_runs"
PROFILE = "h200-wan2.1-1.3b"


def _cost() -> CostModel:
    return CostModel(load_profile(PROFILE).for_ln_modulate("fused")[0], checkpointing="auto")


AB_ARMS = [RUNS / "sparse_train_ab_h200_f5432ae" / f"{mix}_dense.json" for mix in ("default", "long")]
TRAINER_RUNS = [(RUNS / "mem16c" / "metrics_adaptive_auto.jsonl", RUNS / "mem16c" / "mem_adaptive_auto.jsonl")]


def _with(*dirs):
    return TRAINER_RUNS + [(d / "metrics.jsonl", d / "memory.jsonl") for d in dirs]


def test_rows_are_model_flops_over_the_compute_windows():
    from ds_adaptive.models import get_model

    run = RUNS / "default_job_h200_2f0fcdc"
    t = json.loads(json.dumps(tr.micro_batch_mfu(run)))
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    n_micro = sum(len(s["micro_compute_ms"]) for s in steps if s["step"] > 1)
    assert sum(r["micro_steps"] for r in t["rows"]) == n_micro
    row = next(r for r in t["rows"] if r["shape"] == "49x720x1280")
    model = get_model("wan2.1-1.3b")
    flops = model.flops(model.config(), 46800, 1, 0)
    flops = flops[0] if isinstance(flops, tuple) else flops
    assert row["mfu"] == pytest.approx(flops / (row["compute_ms"] * 1e-3) / 989e12)
    # the summary's MFU holds the time outside the compute windows as well
    assert t["summary_mfu"] < max(r["mfu"] for r in t["rows"])


def test_recorded_runs_are_recosted_and_fitted():
    res = json.loads(json.dumps(tr.loop_report(AB_ARMS, TRAINER_RUNS, _cost())))
    assert set(res["runs"]) == {"default_dense.json", "long_dense.json", "mem16c/metrics_adaptive_auto.jsonl"}
    for t in res["runs"].values():   # the wall holds the compute window, which holds more than the calibrated cost
        assert t["wall_over_cost"] > t["compute_over_cost"] > 1.0 and t["outside_compute_ms_per_step"] > 0
    assert res["fit"]["steps"] == sum(t["steps"] for t in res["runs"].values())
    assert res["shipped"]["optimizer_step_ms"] > 0


def test_the_fit_recovers_a_planted_loop():
    rows = [{"cost_ms": c, "micro": n, "wall_ms": 1.1 * c + 150.0 * n + 300.0}
            for c, n in ((5000.0, 1), (9000.0, 1), (12000.0, 6), (15000.0, 6), (7000.0, 3))]
    fit = tr.fit_overheads(rows)["with_scale"]
    assert fit["cost_scale"] == pytest.approx(1.1) and fit["micro_step_ms"] == pytest.approx(150.0)
    assert fit["optimizer_step_ms"] == pytest.approx(300.0)
    assert "note" in tr.fit_overheads(rows[:2])   # one micro-steps count: not identifiable


def test_more_trainer_runs_join_the_fit():
    res = tr.loop_report(AB_ARMS, _with(RUNS / "mfu_levers_h200_47e6632" / "ref"), _cost())
    t = res["runs"]["ref/metrics.jsonl"]
    assert t["steps"] == 12 and t["micro_steps_per_step"] == [1] and t["wall_over_cost"] > t["compute_over_cost"] > 1.0
    assert res["fit"]["steps"] == sum(t["steps"] for t in res["runs"].values())


def test_the_outside_fit_recovers_a_planted_loop_and_ignores_the_cost_model():
    """wall - compute = 35 ms per micro-step + 66 ms per step, whatever the compute windows are against the cost."""
    rows = [{"run": "r", "cost_ms": c, "compute_ms": k * c, "micro": n, "wall_ms": k * c + 35.0 * n + 66.0}
            for c, n, k in ((5000.0, 1, 1.2), (9000.0, 3, 0.9), (12000.0, 5, 1.05), (7000.0, 3, 1.0))]
    fit = tr.fit_outside(rows + [{**rows[0], "run": "other", "wall_ms": 1e6}], runs=["r"])
    assert fit["steps"] == 4 and fit["runs"] == ["r"]
    assert fit["micro_step_ms"] == pytest.approx(35.0) and fit["optimizer_step_ms"] == pytest.approx(66.0)
    assert "note" in tr.fit_outside(rows[:1])   # one micro-steps count: not identifiable


def test_the_shipped_h200_loop_terms_are_the_recorded_runs_outside_fit():
    runs = [RUNS / "lean_backward_h200_273bf38" / "default_job", RUNS / "lean_norm_h200_9180477" / "default_job_gas3"]
    res = tr.loop_report(AB_ARMS, _with(*runs), _cost(), [f"{d.name}/metrics.jsonl" for d in runs])
    fit = res["outside_fit"]
    assert fit["steps"] == 6 and fit["micro_step_ms"] == pytest.approx(res["shipped"]["micro_step_ms"], abs=0.1)
    assert fit["optimizer_step_ms"] == pytest.approx(res["shipped"]["optimizer_step_ms"], abs=0.1)


def _pinned_arm(d, wall, shapes=("1x480x832",)):
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"tokens_per_s": 1.0, "mfu": 0.4, "peak_mem_gib": 100.0}))
    (d / "metrics.jsonl").write_text("\n".join(json.dumps({"step": k, "tokens": 1000, "wall_s": wall,
                                                           "micro_compute_ms": [[400.0], [400.0]]})
                                               for k in (1, 2, 3)))
    (d / "memory.jsonl").write_text("\n".join(json.dumps({"step": k, "micro": m, "shape": shapes[0], "B": 4,
                                                          "ckpt_blocks": 3}) for k in (1, 2, 3) for m in (0, 1)))


def test_pinned_ab_compares_arms_that_ran_the_same_plan_and_refuses_others(tmp_path):
    """bench/training/mfu_levers.py report: arms on one pinned plan, steps after step 1, ratios to the first arm."""
    runs = tmp_path / "runs"
    _pinned_arm(runs / "ref", 2.0)
    _pinned_arm(runs / "fusion", 1.6)
    res = tr.pinned_ab(runs, ["ref", "fusion"])
    assert res["steps"] == [2, 3] and res["rows"][1]["ratio_tokens_per_s"] == pytest.approx(1.25)
    _pinned_arm(runs / "other", 1.0, shapes=("81x480x832",))
    with pytest.raises(tr.PlanMismatch, match="did not run the same plan"):
        tr.pinned_ab(runs, ["ref", "other"])
    with pytest.raises(FileNotFoundError, match="no summary.json"):
        tr.pinned_ab(runs, ["ref", "missing"])


def _epoch_arm(d, wall, tokens=1000, ckpt=3):
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"mfu": 0.4, "hfu": 0.45, "peak_mem_gib": 100.0}))
    (d / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "tokens": tokens, "wall_s": wall,
                                                           "micro_compute_ms": [[400.0], [400.0]]})
                                               for s in (1, 2, 3)))
    (d / "memory.jsonl").write_text("\n".join(json.dumps({"step": s, "micro": m, "shape": "81x480x832", "tokens": 32760,
                                                          "B": 1, "ckpt_blocks": ckpt}) for s in (1, 2, 3) for m in (0, 1)))


def test_epoch_figures_of_two_plans_and_their_ratio(tmp_path):
    """bench/training/checkpoint_attention_ab.py report: each arm's epoch, keep over recompute, and the planner's
    micro-step prediction with each arm's own cost model."""
    runs = tmp_path / "runs"
    _epoch_arm(runs / "recompute", 2.0)
    _epoch_arm(runs / "keep", 1.6, ckpt=4)
    prof = load_profile(PROFILE)
    rows = {arm: tr.epoch_figures(runs / arm, CostModel(prof, checkpointing="auto", checkpoint_attention=arm))
            for arm in ("recompute", "keep")}
    assert tr.epoch_ratios(rows, "recompute", "keep")["tokens_per_s"] == pytest.approx(1.25)
    assert rows["keep"]["mean_checkpointed_blocks"] == 4
    assert 0 < rows["keep"]["predicted_over_measured_micro_step"] < rows["recompute"][
        "predicted_over_measured_micro_step"]   # the same batch, predicted cheaper with its attention kept
