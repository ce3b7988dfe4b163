"""CostModel: units, Ulysses padding/division/comm, heads % sp, profiles, the calibrated fit."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ds_adaptive.calibrate import fit_compute, fit_memory, nnls
from ds_adaptive.cost import (PROFILES_DIR, CostModel, ProfileError, SequenceParallelError, load_profile,
                              shipped_profiles)
from ds_adaptive.shapes import SampleShape

VID = SampleShape(81, 480, 832)      # 32760 tokens
IMG = SampleShape(1, 480, 832)       # 1560 tokens


def test_shipped_profiles_load_and_unknown_name_lists_them():
    assert {"h100-wan2.1-1.3b", "h100-wan2.1-14b"} <= set(shipped_profiles())
    p = load_profile("h100-wan2.1-14b")
    assert p.num_heads == 40 and p.num_layers == 40 and p.params > 14e9
    # shipped profiles are real calibrations (ds-adaptive calibrate on an H100), not estimates
    assert p.raw["source"].startswith("ds-adaptive calibrate --model wan2.1-14b") and "H100" in p.raw["device"]
    with pytest.raises(ProfileError, match="h100-wan2.1-1.3b.*h100-wan2.1-14b|h100-wan2.1-14b"):
        load_profile("a100-nonexistent")


def test_profile_validation_names_the_key(tmp_path):
    d = json.loads((PROFILES_DIR / "h100-wan2.1-1.3b.json").read_text())
    del d["compute"]["b_ms_per_token2"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="b_ms_per_token2"):
        load_profile(str(path))


def test_calibrated_batch_cost_is_c0_plus_b_times_per_sample():
    cm = CostModel("h100-wan2.1-1.3b")
    p = cm.profile
    s = VID.tokens
    per = p.a_ms_per_token * s + p.b_ms_per_token2 * s * s
    assert cm.per_gpu_cost(VID) == pytest.approx(per)
    assert cm.batch_cost(VID, 3) == pytest.approx(p.c0_ms + 3 * per)
    assert cm.batch_memory(IMG, 10) == pytest.approx(10 * (p.m0_gib + p.m1_gib_per_token * IMG.tokens))
    assert cm.unit == "ms"


def test_power_and_tokens_modes():
    pw = CostModel("h100-wan2.1-1.3b", "power", p=1.3)
    assert pw.per_gpu_cost(VID) == pytest.approx(VID.tokens ** 1.3)
    assert pw.c0 == 0 and pw.batch_cost(VID, 2) == pytest.approx(2 * VID.tokens ** 1.3)
    tk = CostModel("h100-wan2.1-1.3b", "tokens")
    assert tk.batch_cost(IMG, 4) == 4 * IMG.tokens and tk.unit == "tokens"


def test_ulysses_pads_divides_and_adds_all_to_all():
    cm1 = CostModel("h100-wan2.1-1.3b", sp=1)
    cm4 = CostModel("h100-wan2.1-1.3b", sp=4)
    odd = 1001                           # not a multiple of 4 -> padded to 1004
    assert cm4.padded_tokens(odd) == 1004
    p = cm1.profile
    compute4 = (p.a_ms_per_token * 1004 + p.b_ms_per_token2 * 1004 ** 2) / 4
    comm = p.num_layers * p.comm_bytes_per_token_per_layer / (p.link_gbps * 1e9) * 1e3 * (1004 / 4) * 3 / 4
    assert cm4.comm_cost(odd) == pytest.approx(comm) and comm > 0
    assert cm4.per_gpu_cost(odd) == pytest.approx(compute4 + comm)
    assert cm1.comm_cost(odd) == 0
    assert cm4.per_gpu_memory(odd) == pytest.approx(p.m0_gib + p.m1_gib_per_token * 1004 / 4)
    # the long video is ~4x cheaper per GPU at sp=4, a bit more because of the all-to-all
    r = cm1.per_gpu_cost(VID) / cm4.per_gpu_cost(VID)
    assert 3.5 < r < 4.0


def test_heads_not_divisible_by_sp_is_a_clear_error():
    with pytest.raises(SequenceParallelError, match=r"sp=8 .*12 attention heads.*\[1, 2, 3, 4, 6, 12\]"):
        CostModel("h100-wan2.1-1.3b", sp=8)
    CostModel("h100-wan2.1-14b", sp=8)   # 40 heads
    with pytest.raises(SequenceParallelError):
        CostModel("h100-wan2.1-1.3b", sp=0)


def test_profile_at_sp2_is_rescaled_to_other_sp():
    d = dict(load_profile("h100-wan2.1-1.3b").raw)
    d2 = json.loads(json.dumps(d))
    d2["sp"] = 2
    d2["compute"]["a_ms_per_token"] /= 2
    d2["compute"]["b_ms_per_token2"] /= 2
    for sp in (1, 2, 4):
        assert CostModel(d2, sp=sp).per_gpu_cost(VID) == pytest.approx(CostModel(d, sp=sp).per_gpu_cost(VID))


def test_static_memory_shrinks_with_zero_stage_and_ranks():
    p = load_profile("h100-wan2.1-14b")
    s = [p.static_memory_gib(z, 16) for z in range(4)]
    assert s[0] > s[1] > s[2] > s[3]
    assert s[0] == pytest.approx(p.params * 16 / 2 ** 30 + p.workspace_gib)
    assert p.static_memory_gib(3, 64) < p.static_memory_gib(3, 8)
    cm = CostModel(p)
    with pytest.raises(ValueError, match="does not cover the static memory"):
        cm.auto_memory_budget(80.0, 0.85, zero_stage=0, dp_size=1)


def test_max_batch_size_respects_both_budgets():
    cm = CostModel("h100-wan2.1-1.3b")
    b = cm.max_batch_size(IMG, m_mem=10.0, m_comp=1000.0)
    assert b >= 1
    assert cm.batch_memory(IMG, b) <= 10.0 and cm.batch_cost(IMG, b) <= 1000.0
    assert cm.batch_memory(IMG, b + 1) > 10.0 or cm.batch_cost(IMG, b + 1) > 1000.0
    assert cm.max_batch_size(VID, m_mem=1e-3) == 0


def test_nnls_and_fit_recover_known_coefficients():
    rng = np.random.default_rng(1)
    c0, a, b = 12.0, 3e-3, 5e-8
    pts = []
    for s in (1560, 4096, 7800, 14040, 20280, 32760, 46800, 75600):
        for bs in (1, 4):
            t = c0 + bs * (a * s + b * s * s)
            pts.append({"S": s, "B": bs, "ms": t * (1 + rng.normal(0, 1e-4))})
    fit = fit_compute(pts)
    assert fit["c0_ms"] == pytest.approx(c0, rel=2e-2)
    assert fit["a_ms_per_token"] == pytest.approx(a, rel=1e-2)
    assert fit["b_ms_per_token2"] == pytest.approx(b, rel=1e-2)
    assert fit["fit"]["max_rel_err"] < 1e-3
    # non-negativity: data that wants a negative intercept gets c0 = 0, not < 0
    neg = [{"S": s, "B": 1, "ms": -5 + 1e-3 * s} for s in (8000, 16000, 32000, 64000)]
    f2 = fit_compute(neg)
    assert f2["c0_ms"] >= 0 and f2["a_ms_per_token"] > 0 and f2["b_ms_per_token2"] >= 0
    mem = fit_memory([{"S": s, "B": bs, "gib": bs * (0.01 + 2e-4 * s)} for s in (1560, 7800, 32760) for bs in (1, 3)])
    assert mem["m0_gib"] == pytest.approx(0.01, rel=1e-6) and mem["m1_gib_per_token"] == pytest.approx(2e-4, rel=1e-6)
    x = nnls(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([2.0, -1.0]))
    assert x.tolist() == [2.0, 0.0]


def test_latency_bound_points_are_reported_not_fitted():
    pts = [{"S": 1560, "B": 1, "ms": 100.0}] + [{"S": s, "B": 1, "ms": 1e-3 * s} for s in (8000, 16000, 32000)]
    fit = fit_compute(pts, min_fit_tokens=7800)
    used = [p["fit"] for p in fit["fit"]["points"]]
    assert used == [False, True, True, True]
    assert fit["fit"]["max_rel_err"] < 1e-6
