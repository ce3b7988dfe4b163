"""CostModel: units, Ulysses padding/division/comm, heads % sp, profiles, the calibrated fit."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ds_adaptive.calibration.fit import fit_compute, fit_memory, nnls
from ds_adaptive.core.layout import SequenceParallelError
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import PROFILES_DIR, ProfileError, load_profile, shipped_profiles
from ds_adaptive.core.shapes import SampleShape

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


# ----------------------------------------------------------------------------------- depth rescaling
def _legacy_scale_profile_depth(raw: dict, num_layers: int) -> dict:
    """bench/training/e2e.py's scale_profile_depth as of commit a89da5d, verbatim (constants inlined): the e2e GPU
    results were planned with it, so Profile.with_num_layers must reproduce it exactly."""
    import copy

    L0 = int(raw["model"]["num_layers"])
    if num_layers == L0:
        return copy.deepcopy(raw)
    f = num_layers / L0
    dim = int(raw["model"]["dim"])
    e_tok = 12 * 64 * dim / 400e12 * 1e3
    d = copy.deepcopy(raw)
    c, c_raw = d["compute"], raw["compute"]
    c["c0_ms"] = f * max(c_raw["c0_ms"] - 2.0, 0.0) + min(2.0, c_raw["c0_ms"])
    c["a_ms_per_token"] = f * max(c_raw["a_ms_per_token"] - e_tok, 0.0) + min(e_tok, c_raw["a_ms_per_token"])
    c["b_ms_per_token2"] = f * c_raw["b_ms_per_token2"]
    c.pop("fit", None)
    dbytes = 2 * dim / 2**30
    d["memory"]["m1_gib_per_token"] = raw["memory"]["m1_gib_per_token"] - (L0 - num_layers) * dbytes
    d["memory"].pop("fit", None)
    params = int(raw["model"]["params"]) - (L0 - num_layers) * int(raw["model"]["block_params"])
    d["model"]["num_layers"] = num_layers
    d["model"]["params"] = params
    d["static_memory"]["params"] = params
    d["static_memory"]["stage3_live_params"] = min(int(raw["static_memory"]["stage3_live_params"]), params)
    d.pop("measurements", None)
    d["name"] = f"{raw.get('name', 'profile')}-{num_layers}blocks"
    return d


def test_with_num_layers_reproduces_the_e2e_rescaling_exactly():
    """bench/training/e2e.py's GPU results were planned with its former scale_profile_depth: same json (key order,
    every bit of every number) for both shipped profiles at many depths; only the provenance text moved."""
    for name in ("h100-wan2.1-1.3b", "h100-wan2.1-14b"):
        base = load_profile(name)
        for n in (1, 2, 4, 6, 15, 29, base.num_layers):
            new = dict(base.with_num_layers(n).raw)
            old = _legacy_scale_profile_depth(dict(base.raw), n)
            if n != base.num_layers:
                assert new.pop("source").startswith(f"{name} rescaled from {base.num_layers} to {n} blocks")
                old.pop("source")
            assert json.dumps(new) == json.dumps(old), (name, n)
    # the numbers the e2e GPU run (1.3B at 4 blocks) planned with, pinned
    p4 = load_profile("h100-wan2.1-1.3b").with_num_layers(4)
    assert (p4.name, p4.num_layers, p4.rescaled_from_layers) == ("h100-wan2.1-1.3b-4blocks", 4, 30)
    assert (p4.c0_ms, p4.a_ms_per_token, p4.b_ms_per_token2) == (6.615536123510192, 0.0045288799936088,
                                                                  1.8480783498305953e-07)
    assert (p4.m0_gib, p4.m1_gib_per_token) == (0.04703417826343273, 0.00013515333858340757)
    assert (p4.params, p4.stage3_live_params) == (211538496, 142881408)


def test_with_num_layers_scales_block_terms_and_keeps_embed_head():
    base = load_profile("h100-wan2.1-1.3b")
    assert base.with_num_layers(base.num_layers) is base and base.rescaled_from_layers is None
    half = base.with_num_layers(15)
    full_cost, half_cost = CostModel(base), CostModel(half)
    for tokens in (7800, 32760, 75600):       # block-dominated: half the blocks, ~half the time
        assert half_cost.batch_cost(tokens, 1) == pytest.approx(full_cost.batch_cost(tokens, 1) / 2, rel=0.02)
    assert half.b_ms_per_token2 == pytest.approx(base.b_ms_per_token2 / 2)
    assert half.c0_ms == pytest.approx((base.c0_ms - 2.0) / 2 + 2.0)          # 2 ms embed/head kept
    e_tok = 12 * 64 * base.dim / 400e12 * 1e3
    assert half.a_ms_per_token == pytest.approx((base.a_ms_per_token - e_tok) / 2 + e_tok)
    assert half.m0_gib == base.m0_gib
    assert half.m1_gib_per_token == pytest.approx(base.m1_gib_per_token - 15 * 2 * base.dim / 2**30)
    assert half.params == base.params - 15 * base.raw["model"]["block_params"]
    assert (half.num_layers, half.rescaled_from_layers, half.sp, half.gpu_mem_gib) == (15, 30, 1, base.gpu_mem_gib)
    assert (half.bytes_per_param, half.workspace_gib) == (base.bytes_per_param, base.workspace_gib)
    # Ulysses comm is per layer in the json; the cost model multiplies by the (new) depth
    assert half.comm_bytes_per_token_per_layer == base.comm_bytes_per_token_per_layer
    assert CostModel(half, sp=2).comm_cost(32760) == pytest.approx(CostModel(base, sp=2).comm_cost(32760) / 2)
    # less static memory -> a larger auto activation budget for the shallower model
    assert half.static_memory_gib(3, 4) < base.static_memory_gib(3, 4)
    assert CostModel(half).auto_memory_budget(dp_size=4) > CostModel(base).auto_memory_budget(dp_size=4)
    # chained rescaling agrees with one step; the fit data of the full depth is dropped
    assert half.with_num_layers(4).c0_ms == pytest.approx(base.with_num_layers(4).c0_ms)
    assert "measurements" not in half.raw and "fit" not in half.raw["compute"]
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError):
            base.with_num_layers(bad)
    d = dict(base.raw)
    d["model"] = {k: v for k, v in d["model"].items() if k != "block_params"}
    with pytest.raises(ProfileError, match="block_params"):
        load_profile(d).with_num_layers(4)


@pytest.mark.parametrize("name", ["h100-wan2.1-1.3b", "h100-wan2.1-14b"])
def test_rescaled_profile_predicts_the_calibrations_reduced_depth_measurements(name):
    """The shipped calibrations timed the model at two small depths (1.3B: 2 and 4 blocks, 14B: 1 and 2);
    the full-depth profile rescaled to those depths must predict them about as well as the full-depth
    fit predicts its own points (time within 10%, activation memory within 16%), at the points the fit
    uses (B x S >= 8192 tokens; one short sample is latency-bound at any depth)."""
    base = load_profile(name)
    rows = [r for r in base.raw["measurements"]["raw"] if r["B"] * r["S"] >= 8192]
    assert {r["layers"] for r in rows} == set(base.raw["measurements"]["layers"]) and len(rows) >= 16
    for r in rows:
        cm = CostModel(base.with_num_layers(r["layers"]))
        assert cm.batch_cost(r["S"], r["B"]) == pytest.approx(r["ms"], rel=0.10), r
        assert cm.batch_memory(r["S"], r["B"]) == pytest.approx(r["act_gib"], rel=0.16), r
