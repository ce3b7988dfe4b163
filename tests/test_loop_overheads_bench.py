"""Guards bench/loop_overheads.py: the recorded trainer runs are re-costed and fitted (wall = k cost + per-micro-step
+ per-step terms), and the fit reproduces a planted loop."""
from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("loop_overheads", ROOT / "bench" / "loop_overheads.py")
lo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lo)


def test_recorded_runs_are_recosted_and_fitted(tmp_path):
    assert lo.main(["--out", str(tmp_path / "o.json")]) == 0
    res = json.loads((tmp_path / "o.json").read_text())
    assert set(res["runs"]) == {"default_dense.json", "long_dense.json", "mem16c/metrics_adaptive_auto.jsonl"}
    for t in res["runs"].values():   # the wall holds the compute window, which holds more than the calibrated cost
        assert t["wall_over_cost"] > t["compute_over_cost"] > 1.0 and t["outside_compute_ms_per_step"] > 0
    assert res["fit"]["steps"] == sum(t["steps"] for t in res["runs"].values())
    assert res["shipped"]["optimizer_step_ms"] > 0


def test_the_fit_recovers_a_planted_loop():
    from memory_report import fit_overheads  # bench/ is on sys.path once loop_overheads is loaded

    rows = [{"cost_ms": c, "micro": n, "wall_ms": 1.1 * c + 150.0 * n + 300.0}
            for c, n in ((5000.0, 1), (9000.0, 1), (12000.0, 6), (15000.0, 6), (7000.0, 3))]
    fit = fit_overheads(rows)["with_scale"]
    assert fit["cost_scale"] == pytest.approx(1.1) and fit["micro_step_ms"] == pytest.approx(150.0)
    assert fit["optimizer_step_ms"] == pytest.approx(300.0)


def test_more_trainer_runs_join_the_fit(tmp_path):
    run = ROOT / "bench" / "results" / "mfu_levers_h200_47e6632" / "ref"
    assert lo.main(["--runs", str(run), "--out", str(tmp_path / "o.json")]) == 0
    res = json.loads((tmp_path / "o.json").read_text())
    t = res["runs"]["ref/metrics.jsonl"]
    assert t["steps"] == 12 and t["micro_steps_per_step"] == [1] and t["wall_over_cost"] > t["compute_over_cost"] > 1.0
    assert res["fit"]["steps"] == sum(t["steps"] for t in res["runs"].values())


def test_the_outside_fit_recovers_a_planted_loop_and_ignores_the_cost_model():
    """wall - compute = 35 ms per micro-step + 66 ms per step, whatever the compute windows are against the cost."""
    rows = [{"run": "r", "cost_ms": c, "compute_ms": k * c, "micro": n, "wall_ms": k * c + 35.0 * n + 66.0}
            for c, n, k in ((5000.0, 1, 1.2), (9000.0, 3, 0.9), (12000.0, 5, 1.05), (7000.0, 3, 1.0))]
    fit = lo.fit_outside(rows + [{**rows[0], "run": "other", "wall_ms": 1e6}], runs=["r"])
    assert fit["steps"] == 4 and fit["runs"] == ["r"]
    assert fit["micro_step_ms"] == pytest.approx(35.0) and fit["optimizer_step_ms"] == pytest.approx(66.0)
    assert "note" in lo.fit_outside(rows[:1])   # one micro-steps count: not identifiable


def test_the_shipped_h200_loop_terms_are_the_recorded_runs_outside_fit(tmp_path):
    runs = [ROOT / "bench" / "results" / "lean_backward_h200_273bf38" / "default_job",
            ROOT / "bench" / "results" / "lean_norm_h200_9180477" / "default_job_gas3"]
    assert lo.main(["--runs", *map(str, runs), "--out", str(tmp_path / "o.json")]) == 0
    res = json.loads((tmp_path / "o.json").read_text())
    fit = res["outside_fit"]
    assert fit["steps"] == 6 and fit["micro_step_ms"] == pytest.approx(res["shipped"]["micro_step_ms"], abs=0.1)
    assert fit["optimizer_step_ms"] == pytest.approx(res["shipped"]["optimizer_step_ms"], abs=0.1)
