"""`ds-adaptive simulate`: JSON schema, the plot, and the balance targets at 16 GPUs."""
from __future__ import annotations

import json

import pytest

from ds_adaptive.cli import simulate as simulate_cli
from ds_adaptive.simulation import simulate

KEYS = {"compute_cv_mean", "balance_efficiency", "predicted_tokens_per_s", "samples", "micro_steps", "oversize",
        "cv_p50", "cv_p90", "idle_fraction", "tail_dropped", "steps", "tokens", "memory_utilization"}


def test_json_schema(capsys):
    assert simulate_cli.main(["--world", "8", "--sp", "2", "--steps", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world"] == 8 and out["sp"] == 2 and out["dp"] == 4
    assert {"tokens", "fixed", "dual"} <= set(out["samplers"])
    for name, r in out["samplers"].items():
        assert KEYS <= set(r), name
        assert 0 <= r["compute_cv_mean"] < 2 and 0 < r["balance_efficiency"] <= 1
        assert r["idle_fraction"] == pytest.approx(1 - r["balance_efficiency"])
        assert r["micro_steps"] == 4 and r["samples"] > 0 and r["predicted_tokens_per_s"] > 0
        assert r["memory_utilization"]["max"] <= 1 + 1e-9      # same memory budget for all


def test_targets_at_16_gpus_and_plot(tmp_path):
    png = tmp_path / "sim.png"
    res = simulate.simulate(world=16, sp=1, steps=30, keep_plans=True)
    simulate.plot(res, str(png))
    assert png.stat().st_size > 10_000
    d, t = res["samplers"]["dual"], res["samplers"]["tokens"]
    assert d["compute_cv_mean"] <= 0.05 and t["compute_cv_mean"] >= 0.15
    assert d["predicted_tokens_per_s"] >= 1.25 * t["predicted_tokens_per_s"]


def test_cli_rejects_bad_world(capsys):
    assert simulate_cli.main(["--world", "6", "--sp", "4"]) == 2  # one message, no traceback
    assert "--world 6 is not divisible by --sp 4" in capsys.readouterr().err


def test_layers_plans_with_the_rescaled_profile(capsys):
    assert simulate_cli.main(["--world", "8", "--steps", "3", "--layers", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["profile"] == "h100-wan2.1-1.3b-4blocks" and out["layers"] == 4
    full = simulate.simulate(world=8, steps=3, samplers=("dual",))
    assert full["layers"] == 30 and full["profile"] == "h100-wan2.1-1.3b"
    # the compute budget (costliest sample at B=1) shrinks with depth; the 4-block model's smaller static
    # and activation memory leave a larger auto memory budget
    assert out["budgets"]["m_comp"] < 0.2 * full["budgets"]["m_comp"]
    assert out["budgets"]["m_mem_gib"] > full["budgets"]["m_mem_gib"]
