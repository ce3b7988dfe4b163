"""The sparse selection's cost: its form, the fit to timings, the profile round trip, the pay decision,
the sparse recompute in the checkpoint cost, the runtime's predicted selection telemetry, and the A/B
bench's prediction check (ds_adaptive.simulation.sparse_ab, CPU, no timings)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import PROFILES_DIR, load_profile
from ds_adaptive.planning.selection_cost import DEFAULT_SELECTION, SelectionCost
from ds_adaptive.calibration.selection_timing import fit_selection
from ds_adaptive.planning.sparse_cost import SparseAttentionCost
from ds_adaptive.core.contracts import DensityMap, KernelEfficiency

H200 = "h200-wan2.1-1.3b"
GRID = [(32, 1560), (1, 8190), (8, 8190), (1, 16380), (4, 16380), (1, 32760), (4, 32760), (1, 75600), (2, 75600)]


def _map(rho: float, layers: int = 30, heads: int = 12, dense=(0, 29)) -> DensityMap:
    return DensityMap(tuple((rho,) * heads for _ in range(layers)), dense_layers=dense)


def test_the_form_counts_pooling_logits_top_k_and_one_fixed_part_per_call():
    sel = SelectionCost(ms_per_call=0.4, ms_per_token=1e-5, ms_per_logit=2e-8, ms_per_block_pair=3e-6)
    b, s, h = 3, 1000, 6
    nb = math.ceil(s / 128)                                           # 8 blocks, the last one partial
    want = 0.4 + b * h * (1e-5 * s + 2e-8 * nb * s + 3e-6 * nb * nb)
    assert sel.call_ms(b, s, h) == pytest.approx(want, rel=1e-12)
    assert sel.per_sample_ms(s, h) == pytest.approx((want - 0.4) / b, rel=1e-12)
    assert sel.call_ms(b, s, h, block_size=64) > sel.call_ms(b, s, h)  # more blocks: more pooled queries
    np.testing.assert_allclose(sel.call_ms(np.array([1, 2]), s, h), [sel.call_ms(1, s, h), sel.call_ms(2, s, h)])
    with pytest.raises(ValueError, match="ms_per_logit must be a finite number >= 0"):
        SelectionCost(ms_per_logit=-1.0)


@pytest.mark.parametrize("split", [True, False])
def test_the_fit_recovers_known_coefficients_from_synthetic_timings(split):
    true = SelectionCost(ms_per_call=0.35, ms_per_token=4e-6, ms_per_logit=9e-9, ms_per_block_pair=2e-6 if split else 0.0)
    rows = []
    for b, s in GRID:
        nb = math.ceil(s / 128)
        score = 0.2 + b * 12 * (4e-6 * s + 9e-9 * nb * s)
        rows.append({"B": b, "S": s, "heads": 12, "select_ms": float(true.call_ms(b, s, 12)),
                     "score_ms": score if split else None})
    got, fit = fit_selection(rows, block_size=128, source="synthetic")
    np.testing.assert_allclose(got.coefficients, true.coefficients, rtol=1e-6, atol=1e-12)
    assert fit["split"] is split and fit["max_rel_err"] < 1e-9 and len(fit["points"]) == len(GRID)
    # noisy timings (+-3%): the fit stays within the noise
    rng = np.random.default_rng(0)
    noisy = [{**r, "select_ms": r["select_ms"] * (1 + rng.uniform(-0.03, 0.03))} for r in rows]
    _, fit = fit_selection(noisy, block_size=128)
    assert fit["max_rel_err"] < 0.06
    with pytest.raises(ValueError, match=">= 3 timed"):
        fit_selection(rows[:2], block_size=128)


def test_the_default_is_the_shipped_h200_calibration_and_stated_as_such():
    d = SelectionCost.default()
    assert d.ms_per_logit == DEFAULT_SELECTION["ms_per_logit"] and d.source.startswith("default:")
    # the same coefficients as the H200 profile's calibration of the fused selection (a re-calibration that
    # ships must move the default with it)
    shipped = json.loads((PROFILES_DIR / f"{H200}.json").read_text())["sparse_attention"]["selection"]
    assert shipped["block_size"] == d.block_size and shipped["block_score"] == "pooled_lse"
    np.testing.assert_array_equal(d.coefficients, [shipped[k] for k in
                                                   ("ms_per_call", "ms_per_token", "ms_per_logit", "ms_per_block_pair")])


def test_profile_section_round_trip_and_what_the_cost_takes(tmp_path):
    sel = SelectionCost(0.25, 3e-6, 7e-9, 1e-6, source="measured")
    data = json.loads((PROFILES_DIR / f"{H200}.json").read_text())
    data["sparse_attention"] = {"format": "ds_adaptive.sparse_attention/1",
                                "selection": {**sel.as_dict(), "block_score": "pooled_lse", "fit": {}}}
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(data))
    prof = load_profile(str(path))
    cm = CostModel(prof, sparse=SparseAttentionCost(_map(0.1)))
    assert cm.sparse.selection_cost == sel                         # taken from the profile by for_profile
    # after the depth rescale and the LayerNorm-modulate variant too (what a --layers run plans with)
    p8 = prof.for_ln_modulate("reference")[0].with_num_layers(8)
    assert CostModel(p8, sparse=SparseAttentionCost(_map(0.1, layers=8, dense=(0, 7)))).sparse.selection_cost == sel
    # measured for another scoring or block size: the default; an explicit selection is kept
    other = CostModel(prof, sparse=SparseAttentionCost(_map(0.1), block_score="lse")).sparse
    assert other.selection_cost == SelectionCost.default()
    mine = SelectionCost(1.0, 0.0, 0.0, 0.0)
    assert CostModel(prof, sparse=SparseAttentionCost(_map(0.1), selection=mine)).sparse.selection_cost == mine
    # a shipped profile without the section (H100) -> default; the H200 one carries its GPU calibration
    assert CostModel("h100-wan2.1-1.3b", sparse=SparseAttentionCost(_map(0.1))).sparse.selection_cost == \
        SelectionCost.default()
    shipped = json.loads((PROFILES_DIR / f"{H200}.json").read_text())["sparse_attention"]["selection"]
    measured = CostModel(H200, sparse=SparseAttentionCost(_map(0.1))).sparse.selection_cost
    assert measured.source.startswith("measured on NVIDIA H200") and measured.ms_per_call == pytest.approx(shipped["ms_per_call"])
    # the sampler-state description round trip, and a state written with the old per-head form
    desc = cm.sparse.describe()
    back = SparseAttentionCost.from_description(json.loads(json.dumps(desc)))
    assert back == cm.sparse
    old = {k: v for k, v in desc.items() if k not in ("selection", "block_score")}
    old.update(selection_ms_per_token_per_head=2e-6, selection_ms_per_token2_per_head=3e-11, selection_ms_per_layer_call=1.0)
    conv = SparseAttentionCost.from_description(old).selection_cost
    assert (conv.ms_per_call, conv.ms_per_token, conv.ms_per_logit) == (1.0, 2e-6, pytest.approx(3e-11 * 128))


def test_an_expensive_selection_makes_the_layer_run_dense():
    cheap = CostModel(H200, sparse=SparseAttentionCost(_map(0.1), selection=SelectionCost(0.0, 0.0, 0.0, 0.0))).sparse
    assert cheap.layer_decisions(32760, 1)[0].sum() == 28
    att = cheap.attention_ms_per_token2_per_layer * 32760 ** 2        # one layer's dense attention, one sample
    g = cheap.efficiency(float(cheap.busiest_densities(32760, 1)[1]))
    just_pays = SelectionCost(ms_per_call=0.9 * (1 - g) * att, ms_per_token=0.0, ms_per_logit=0.0, ms_per_block_pair=0.0)
    too_dear = SelectionCost(ms_per_call=1.1 * (1 - g) * att, ms_per_token=0.0, ms_per_logit=0.0, ms_per_block_pair=0.0)
    assert CostModel(H200, sparse=SparseAttentionCost(_map(0.1), selection=just_pays)).sparse.layer_decisions(32760, 1)[0].sum() == 28
    dear = CostModel(H200, sparse=SparseAttentionCost(_map(0.1), selection=too_dear))
    assert dear.sparse.layer_decisions(32760, 1)[0].sum() == 0
    assert dear.per_gpu_cost(32760) == CostModel(H200).per_gpu_cost(32760)    # dense: no selection, no scaling
    # the fixed part is paid once per micro-batch (batch_overhead), the rest per sample
    sel = SelectionCost(0.5, 1e-6, 5e-9, 0.0)
    cm = CostModel(H200, sparse=SparseAttentionCost(_map(0.1), selection=sel))
    assert cm.batch_overhead(32760) == pytest.approx(cm.c0 + 28 * 0.5)
    assert cm.batch_cost(32760, 4) == pytest.approx(cm.batch_overhead(32760) + 4 * cm.per_gpu_cost(32760))
    assert cm.batch_overhead(1560) == pytest.approx(cm.c0 + 28 * 0.5 * cm.sparse.layer_decisions(1560, 1)[0].any())


def test_a_sparse_layer_recompute_runs_sparse_in_the_checkpoint_cost():
    prof = load_profile(H200).for_ln_modulate("reference")[0].with_num_layers(8)
    sc = SparseAttentionCost(_map(0.1, layers=8, dense=(0, 7)), efficiency=KernelEfficiency((0.1,), (0.165,)),
                             selection=SelectionCost(0.0, 0.0, 0.0, 0.0))
    dense, sparse = CostModel(prof, checkpointing="auto"), CostModel(prof, checkpointing="auto", sparse=sc)
    s, b = 32760, 4
    r = sparse.sparse.layer_ratios(s, 1)
    quad = prof.recompute_ms[2] * s * s                                  # one block's dense recompute, quadratic part
    for n in (0, 2, 5, 8):
        # the dense recompute delta, with the quadratic part of every sparse non-checkpointed block at its ratio
        want = sparse.batch_cost(s, b) - (8 - n) * dense.recompute_ms(s, b) + b * quad * sum(1 - r[l] for l in range(n, 8))
        assert float(sparse.ckpt_cost(s, b, n)) == pytest.approx(want, rel=1e-12), n
    assert float(sparse.ckpt_cost(s, b, 8)) == pytest.approx(sparse.batch_cost(s, b))   # the profile's own count
    np.testing.assert_allclose(sparse.ckpt_cost(s, np.array([1, 4]), np.array([0, 8])),
                               [float(sparse.ckpt_cost(s, 1, 0)), float(sparse.ckpt_cost(s, 4, 8))])
    # every layer dense: exactly the dense model at every count
    all_dense = CostModel(prof, checkpointing="auto", sparse=SparseAttentionCost(_map(1.0, layers=8, dense=(0, 7))))
    for n in (0, 3, 8):
        assert float(all_dense.ckpt_cost(s, b, n)) == float(dense.ckpt_cost(s, b, n))


def _runtime_after_one_sparse_step():
    """A 2-layer runtime (forced density 0.25, a selection cost) and its q, k, v, after one step that selected."""
    import torch

    from ds_adaptive.core.config import SparseAttentionConfig
    from ds_adaptive.attention.runtime import SparseAttentionRuntime

    sel = SelectionCost(0.3, 2e-6, 4e-9, 1e-6)
    decision = SparseAttentionCost(_map(1.0, layers=2, heads=4, dense=()), selection=sel, pay_check=False)
    cfg = SparseAttentionConfig(enabled=True, forced_density=0.25, backend="reference", dense_layers=[])
    rt = SparseAttentionRuntime(cfg, num_layers=2, num_heads=4, head_dim=16, decision=decision)
    q, k, v = (torch.randn(3, 640, 4, 16) for _ in range(3))
    with torch.no_grad():
        rt.attention(1, q, k, v)
    rt.step()
    return rt, (q, k, v)


def test_runtime_reports_predicted_selection_beside_the_measured_one():
    rt, _ = _runtime_after_one_sparse_step()
    m = rt.metrics()
    assert m["sparse/select_ms"] > 0                                     # measured (host clock on the CPU)
    want = rt.decision.layer_selection_ms(640, 1, 4, batch=3) if rt.decision is not None else None
    assert want is not None and m["sparse/select_ms_predicted"] == pytest.approx(want)
    assert m["sparse/layers"]["select_ms_predicted"][1] == pytest.approx(want)
    # a state saved before the key existed still loads
    state = rt.state_dict()
    del state["last"]["select_ms_predicted"]
    rt.load_state_dict(state)
    assert "sparse/select_ms_predicted" in rt.metrics()


def test_a_step_that_selects_nothing_reports_no_selection_time():
    """A step whose micro-batches all run dense (too short to pay sparse) reports 0 ms of selection, not the time of
    the step before it."""
    import torch

    rt, (q, k, v) = _runtime_after_one_sparse_step()
    assert rt.metrics()["sparse/select_ms"] > 0 and rt.metrics()["sparse/select_ms_predicted"] > 0
    rt.decider.runs_sparse = lambda layer, seq_len: False   # the next step's micro-batches all run dense
    with torch.no_grad():
        rt.attention(1, q, k, v)
    rt.step()
    m = rt.metrics()
    assert m["sparse/select_ms"] == 0 and m["sparse/select_ms_predicted"] == 0, m
    assert all(x != x for x in m["sparse/layers"]["select_ms"] + m["sparse/layers"]["select_ms_predicted"])


def test_ab_bench_reports_predicted_over_measured_per_shape_and_over_dense():
    from ds_adaptive.simulation import sparse_ab as ab

    def arm(name, pairs):
        micro = [{"step": i + 2, "shape": sh, "B": 1, "compute_ms": m, "predicted_ms": p,
                  **({"select_ms": 10.0, "predicted_select_ms": 9.0} if name == "sparse" else {})}
                 for i, (sh, m, p) in enumerate(pairs)]
        return {"arm": name, "micro": micro}

    dense = arm("dense", [("a", 100.0, 88.0), ("a", 100.0, 90.0), ("b", 200.0, 180.0)])
    sparse = arm("sparse", [("a", 50.0, 44.0), ("a", 50.0, 46.0), ("b", 100.0, 95.0)])
    for a in (dense, sparse):
        a["prediction"] = ab.prediction_error(a)
    p = sparse["prediction"]
    assert p["per_shape"]["a"]["pred_over_measured"] == pytest.approx(0.9)
    assert p["per_shape"]["b"]["pred_over_measured"] == pytest.approx(0.95)
    assert p["shapes_within_target"] == 2 and p["select_pred_over_measured"] == pytest.approx(0.9)
    assert dense["prediction"]["per_shape"]["a"]["within_target"] is False      # 0.89: outside 10%
    rel = ab.prediction_vs_dense(dense, sparse)
    assert rel["a"] == pytest.approx(0.9 / 0.89) and rel["b"] == pytest.approx(0.95 / 0.9)


def test_calibrate_selection_needs_a_gpu(capsys):
    import torch

    from ds_adaptive.cli.calibrate_sparse import main

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: tests/gpu/test_selection_cost_gpu.py runs the calibration")
    assert main(["--selection", "--out", "/nonexistent/x.json"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_ab_bench_merge_compares_arms_run_in_separate_calls_and_counts_the_loop():
    from ds_adaptive.simulation import sparse_ab as ab

    def arm(name, comp_ms, pred_ms, wall_s, fusion_s):
        steps = [{"step": k, "tokens": 1000, "wall_s": wall_s, "compute_ms": comp_ms, "micro_compute_ms": [comp_ms],
                  "profiled": False} for k in (1, 2, 3)]
        micro = [{"step": k, "micro": 0, "shape": "a", "B": 1, "compute_ms": comp_ms, "predicted_ms": pred_ms}
                 for k in (1, 2, 3)]
        return {"mix": "m", "arm": name, "steps": steps, "micro": micro, "warmup_s": 0.0, "train_s": 3 * wall_s,
                "fusion_warmup_s": fusion_s, "backend": None,
                "loop_overheads_ms": {"micro_step": 100.0, "optimizer_step": 300.0}}

    docs = []
    # block fusion compiled in the first arm (3 s); the second found its graphs (0.1 s)
    for name, comp, pred, wall, fz in (("dense", 1000.0, 800.0, 1.2, 3.0), ("sparse", 500.0, 400.0, 0.6, 0.1)):
        docs.append({"args": {}, "device": "GPU X", "torch": "t", "arms": [arm(name, comp, pred, wall, fz)]})
    doc = json.loads(json.dumps(ab.merge_results(docs, ["dense.json", "sparse.json"]), default=str))
    c = doc["compare"]["m"]["sparse"]
    assert c["tokens_per_s_2toN"] == pytest.approx(2.0) and c["tokens_per_s_with_warmup"] == pytest.approx(2.0)
    # the compile both arms pay once, charged to each: 3000 tokens in 3 + 3.6 s vs 3 + 1.8 s
    assert c["fusion_warmup_s_charged"] == 3.0 and c["tokens_per_s_with_every_warmup"] == pytest.approx(6.6 / 4.8)
    p = doc["arms"][1]["prediction"]
    assert p["sum_pred_over_measured"] == pytest.approx(0.8)
    assert p["micro_step_pred_over_measured"] == pytest.approx(500.0 / 500.0)            # + 100 ms per micro-step
    assert p["step_pred_over_measured"] == pytest.approx((400.0 + 100.0 + 300.0) / 600.0)  # + the optimizer step
    assert "| m | sparse | 1,667 | 2.000 | 2.000 | 1.375 |" in ab.table(doc)   # 2 x 1000 tokens in 2 x 0.6 s
    other = {"args": {}, "device": "GPU Y", "torch": "t", "arms": []}
    with pytest.raises(ValueError, match="different devices"):
        ab.merge_results([docs[0], other])


def test_ab_bench_says_whether_a_plan_is_the_one_a_recorded_run_ran():
    from ds_adaptive.core.shapes import SampleShape
    from ds_adaptive.simulation.sparse_ab import same_plan_status

    a, b = SampleShape(81, 480, 832), SampleShape(1, 480, 832)
    ran = {"micro": [{"shape": str(a), "B": 2, "ckpt": 1}, {"shape": str(b), "B": 38, "ckpt": 0}]}
    assert same_plan_status(ran, [(a, 2, 1), (b, 38, 0)]) == "same"
    assert same_plan_status(ran, [(a, 2, 1), (b, 37, 0)]) == "differs from micro-step 1"
    assert same_plan_status(ran, [(a, 2, 1)]) == "differs from micro-step 1"   # shorter
    assert same_plan_status(None, [(a, 2, 1)]) == "not recorded"
