"""ds_adaptive.simulation.curves: the sparse arm's lead in steps, the repeat spread of quality runs
(bench/training/sparse_quality_curves.py), and the loss-curve gap of two runs (bench/training/scale.py summary)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ds_adaptive.simulation import curves as qc


def _curve(n: int, shift: int = 0, noise: float = 0.0, seed: int = 0) -> list:
    """A falling loss curve; ``shift`` steps ahead (the same curve, reached ``shift`` steps earlier)."""
    t = np.arange(1, n + 1) + shift
    rng = np.random.default_rng(seed)
    return list(0.4 + 1.6 * np.exp(-t / 150.0) + noise * rng.standard_normal(n))


@pytest.mark.parametrize("shift", [0, 17, 40])
def test_a_curve_shifted_by_k_steps_leads_by_k(shift):
    res = qc.steps_to_loss(_curve(600), _curve(600, shift), window=1)
    assert res["lead_median"] == shift and res["lead_range"] == [shift, shift]
    assert res["dense_drop_per_100_steps"] > 0
    if shift:
        assert res["gap_in_steps_of_dense_slope"] == pytest.approx(shift, rel=0.35)


def test_noise_is_averaged_out_and_a_lagging_arm_leads_negatively():
    res = qc.steps_to_loss(_curve(600, 30, noise=0.02, seed=1), _curve(600, 0, noise=0.02, seed=2), window=25)
    assert -40 <= res["lead_median"] <= -20


def test_smoothing_keeps_length_and_the_mean_of_a_constant():
    x = qc.smoothed([1.0] * 10, 25)
    assert len(x) == 10 and np.allclose(x, 1.0)


def _doc(dense, sparse, seed=0, commit="abc", **args):
    evals = lambda xs: [[k, float(xs[k - 1])] for k in range(30, len(xs) + 1, 30)]  # noqa: E731
    return {"meta": {"commit": commit, "args": {"seed": seed, "lr": 2e-4, "out": "x", **args}},
            "history": {"dense": {"loss": dense, "eval": evals(dense)}, "sparse": {"loss": sparse, "eval": evals(sparse)}}}


def test_analyze_reports_the_repeat_spread_only_for_repeats(tmp_path):
    a = _doc(_curve(300), _curve(300, 20))
    b = _doc(list(np.asarray(_curve(300)) * 1.05), _curve(300, 20), commit="def", out="y", rebalance="off")
    c = _doc(_curve(300), _curve(300), lr=1e-4)
    paths = []
    for name, d in (("a", a), ("b", b), ("c", c)):
        paths.append(str(tmp_path / f"{name}.json"))
        Path(paths[-1]).write_text(json.dumps(d))
    res = qc.analyze(paths[:2])
    spread = res["repeat_spread"]
    assert spread["commits"] == ["abc", "def"]
    assert spread["dense"]["train_rel_spread"] == pytest.approx(0.05) and spread["sparse"]["train_rel_spread"] == 0
    assert [r["lead_median"] for r in res["runs"]][0] == 20
    assert "repeat_spread" not in qc.analyze([paths[0], paths[2]])   # another lr: not a repeat


def test_loss_curve_gap():
    a = {"loss_curve": {"samples_seen": [10, 20, 30, 40, 50, 60], "loss": [2.0, 1.8, 1.6, 1.5, 1.4, 1.3]}}
    b = {"loss_curve": {"samples_seen": [12, 24, 36, 48, 60], "loss": [2.0, 1.8, 1.6, 1.5, 1.4]}}
    assert qc.loss_curve_gap(a, a, smooth=1) == 0.0
    same_shifted = {"loss_curve": {"samples_seen": a["loss_curve"]["samples_seen"],
                                   "loss": [x * 1.02 for x in a["loss_curve"]["loss"]]}}
    assert qc.loss_curve_gap(same_shifted, a, smooth=1) == pytest.approx(0.02)
    assert qc.loss_curve_gap(a, b, smooth=2) > 0.0
