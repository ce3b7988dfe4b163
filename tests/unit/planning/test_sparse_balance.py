"""Sparsity-aware balancing (issue 15): head placement is an equal-count permutation that balances
density; the sparse cost equals the dense model at rho = 1; sampler re-planning on new densities
keeps exactly-once, determinism and resume; density loaders and errors."""
from __future__ import annotations

import itertools
import json
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_adaptive.planning.cost import CostModel
from ds_adaptive.parallel.placement import (PlacementError, balance_heads, check_placement, inverse_permutation,
                                       placement_lower_bound, plan_head_placement, rank_heads, rank_sums)
from ds_adaptive.planning.sampler import build_batch_sampler
from ds_adaptive.core.layout import Layout
from ds_adaptive.planning.sparse_cost import SparseAttentionCost
from ds_adaptive.core.contracts import DensityError, DensityMap, KernelEfficiency, load_densities, synthetic_densities
from ds_adaptive.planning.selection_cost import SelectionCost
from ds_adaptive.core.config import SamplerConfig
from ds_adaptive.core.shapes import load_shape_distribution

PROFILE = "h100-wan2.1-1.3b"   # 30 layers x 12 heads


# ------------------------------------------------------------------------------ head placement
@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(12, 1), (12, 2), (12, 3), (12, 4), (40, 4), (40, 8), (6, 6), (8, 2)]),
       st.integers(0, 10_000))
def test_placement_is_an_equal_count_permutation_never_worse_than_identity(hs, seed):
    h, sp = hs
    d = np.random.default_rng(seed).uniform(0.02, 0.5, h).tolist()
    perm = balance_heads(d, sp)
    check_placement(perm, h, sp)                                  # a permutation of range(h)
    assert sorted(perm) == list(range(h))
    assert all(len(rank_heads(perm, sp, r)) == h // sp for r in range(sp))
    inv = inverse_permutation(perm)
    assert [perm[inv[i]] for i in range(h)] == list(range(h))
    best = max(rank_sums(d, perm, sp))
    assert best <= max(rank_sums(d, list(range(h)), sp)) + 1e-12
    assert best >= placement_lower_bound(d, sp) - 1e-12


def _brute_force_best(d, sp):
    h, k = len(d), len(d) // sp

    def rec(rest, worst):
        if not rest:
            return worst
        first, best = rest[0], float("inf")
        for c in itertools.combinations(rest[1:], k - 1):
            s = d[first] + sum(d[x] for x in c)
            if max(s, worst) < best:
                best = min(best, rec([x for x in rest[1:] if x not in c], max(s, worst)))
        return best
    return rec(list(range(h)), 0.0)


@pytest.mark.parametrize("seed", range(6))
def test_placement_is_optimal_for_12_heads_over_4_ranks(seed):
    d = np.random.default_rng(seed).uniform(0.02, 0.5, 12).tolist()
    assert max(rank_sums(d, balance_heads(d, 4), 4)) == pytest.approx(_brute_force_best(d, 4), abs=1e-12)


def test_placement_examples_and_errors():
    # one dense head per rank pair: identity puts both dense heads on rank 0
    d = [0.5, 0.5, 0.05, 0.05]
    perm = balance_heads(d, 2)
    assert rank_sums(d, perm, 2) == [0.55, 0.55] and sorted(perm) == [0, 1, 2, 3]
    assert balance_heads([0.2] * 8, 4) == list(range(8))            # nothing to gain: identity
    assert balance_heads(d, 1) == [0, 1, 2, 3]
    with pytest.raises(PlacementError, match="Ulysses sp=3 does not divide the 4 attention heads of the head placement"):
        balance_heads(d, 3)
    with pytest.raises(PlacementError, match="not a permutation"):
        check_placement([0, 0, 1, 2], 4, 2)
    pl = plan_head_placement([d, d, [0.1] * 4], 2, dense_layers=[1])
    assert pl.perms[1] is None and pl.perms[2] is None and pl.perms[0] is not None and not pl.is_identity()
    assert plan_head_placement([d], 2, enabled=False).is_identity()


# ------------------------------------------------------------------------------ sparse cost
def _dense_map(value=1.0, layers=30, heads=12, dense_layers=()):
    return DensityMap(tuple(tuple([value] * heads) for _ in range(layers)), tuple(dense_layers))


@pytest.mark.parametrize("sp", [1, 2, 4])
@pytest.mark.parametrize("placement", ["balanced", "identity"])
def test_rho_one_equals_the_dense_model_exactly(sp, placement):
    dense = CostModel(PROFILE, sp=sp)
    for dm in (_dense_map(1.0), _dense_map(0.3, dense_layers=range(30))):   # density 1, or every layer dense
        sparse = CostModel(PROFILE, sp=sp, sparse=SparseAttentionCost(dm, head_placement=placement,
                                                                      attention_share=0.8))
        for s in (1, 97, 1560, 7800, 32760, 75600, 75601):
            assert sparse.per_gpu_cost(s) == dense.per_gpu_cost(s)
            assert sparse.batch_cost(s, 3) == dense.batch_cost(s, 3)
            assert sparse.per_gpu_memory(s) == dense.per_gpu_memory(s)


def test_sparse_cost_scales_only_the_attention_quadratic_term():
    prof_dense = CostModel(PROFILE)
    eff = KernelEfficiency((0.1, 0.5), (0.2, 1.0))                         # g = 2 rho below 0.5
    sc = SparseAttentionCost(_dense_map(0.25), efficiency=eff, attention_share=0.6, min_blocks=0,
                             selection=SelectionCost(0.0, 0.0, 0.0, 0.0))
    cm = CostModel(PROFILE, sparse=sc)
    s = 32760.0
    a, b = prof_dense._a1, prof_dense._b1
    assert cm.per_gpu_cost(32760) == pytest.approx(a * s + b * s * s * (1 - 0.6 * (1 - 0.5)), rel=1e-12)
    # block floor: at 128 tokens there is one key block: density 1 -> dense
    floored = SparseAttentionCost(_dense_map(0.25), efficiency=eff, min_blocks=1)
    assert floored.rho_eff(128, 1) == 1.0 and floored.rho_eff(32768, 1) == pytest.approx(0.5)
    assert floored.rho_eff(3 * 128, 1) == pytest.approx(eff(1 / 3)) and sc.rho_eff(128, 1) == pytest.approx(0.5)
    # efficiency curve: proportional below the table, interpolated inside, capped at 1 (dense fallback)
    assert eff(0.05) == pytest.approx(0.1) and eff(0.3) == pytest.approx(0.6) and eff(0.9) == 1.0
    d = KernelEfficiency.default()
    assert d(0.1) == pytest.approx(0.145) and d(0.69) == pytest.approx(1.0, abs=1e-3) and d(0.8) == 1.0


def test_busiest_rank_counts_and_placement_lowers_it():
    # per layer two dense heads (0.5) and ten sparse (0.02); identity puts both dense heads on rank 0
    row = [0.5, 0.5] + [0.02] * 10
    dm = DensityMap(tuple(tuple(row) for _ in range(30)))
    eff = KernelEfficiency((0.01, 1.0), (0.01, 1.0))                         # g(rho) = rho
    kw = dict(efficiency=eff, min_blocks=0)
    ident = SparseAttentionCost(dm, head_placement="identity", **kw)
    bal = SparseAttentionCost(dm, head_placement="balanced", **kw)
    assert ident.rho_eff(75600, 1) == pytest.approx(np.mean(row))          # sp=1: one rank holds all heads
    assert ident.rho_eff(75600, 4) == pytest.approx((0.5 + 0.5 + 0.02) / 3)
    assert bal.rho_eff(75600, 4) == pytest.approx((0.5 + 0.02 + 0.02) / 3)
    assert CostModel(PROFILE, sp=4, sparse=bal).per_gpu_cost(75600) < CostModel(PROFILE, sp=4, sparse=ident).per_gpu_cost(75600)


def test_selection_term_only_for_sparse_layers():
    dm = DensityMap(tuple(tuple([0.1] * 12) for _ in range(30)), dense_layers=(0, 29))
    sel = SelectionCost(ms_per_call=0.5, ms_per_token=1e-5, ms_per_logit=2e-8, ms_per_block_pair=3e-6)
    sc = SparseAttentionCost(dm, selection=sel)
    nb = 61                                                                  # ceil(7800 / 128)
    per_head = 1e-5 * 7800 + 2e-8 * nb * 7800 + 3e-6 * nb * nb
    assert sc.selection_ms(7800, 2, 12) == pytest.approx(28 * per_head * 6)  # per sample: 6 local heads
    assert sc.selection_call_ms(7800, 2) == pytest.approx(28 * 0.5)          # per micro-batch
    assert sc.layer_selection_ms(7800, 2, 12, batch=3) == pytest.approx(0.5 + 3 * 6 * per_head)
    dense = SparseAttentionCost(_dense_map(1.0), selection=sel)
    assert dense.selection_ms(7800, 2, 12) == 0.0 and dense.selection_call_ms(7800, 2) == 0.0


def test_density_loaders_and_errors(tmp_path):
    dm = synthetic_densities(30, 12, seed=3)
    assert dm.num_layers == 30 and dm.num_heads == 12
    assert all(0.02 <= x <= 0.5 for row in dm.density for x in row)
    assert synthetic_densities(30, 12, seed=3) == dm and synthetic_densities(30, 12, seed=4) != dm
    p = tmp_path / "d.json"
    dm.save(p)
    assert load_densities(p).density == dm.density
    log = tmp_path / "metrics.jsonl"
    recs = [{"step": 10, "loss": 1.0}, {"step": 100, "head_density": [[0.2] * 12] * 30},
            {"step": 200, "head_density": [[0.1] * 12] * 30, "dense_layers": [0]}]
    log.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert load_densities(log).dense_layers == (0,) and load_densities(log).density[0][0] == 0.1
    assert load_densities(log, step=150).density[0][0] == 0.2
    with pytest.raises(DensityError, match="no record with 'head_density' at or before step 50"):
        load_densities(log, step=50)
    with pytest.raises(DensityError, match=r"density\[1\]\[2\] = 1.5"):
        DensityMap.from_dict({"density": [[0.1, 0.1, 0.1], [0.1, 0.1, 1.5]]})
    with pytest.raises(DensityError, match="'num_heads' is 4 but 'density' has 3"):
        DensityMap.from_dict({"num_heads": 4, "density": [[0.1, 0.1, 0.1]]})
    with pytest.raises(ValueError, match="density table has 2 layers x 3 heads but the model"):
        CostModel(PROFILE, sparse=SparseAttentionCost(DensityMap(((0.1,) * 3,) * 2)))
    with pytest.raises(ValueError, match="needs cost mode 'calibrated'"):
        CostModel(PROFILE, "power", sparse=SparseAttentionCost(dm))
    assert dm.with_num_layers(4).num_layers == 4


# ------------------------------------------------------------------------------ sampler re-planning
DIST = load_shape_distribution()
CFG = SamplerConfig(window=32, seed=7)


def _mix(n, seed=0):
    w = np.array([d.weight for d in DIST])
    idx = np.random.default_rng(seed).choice(len(DIST), n, p=w / w.sum())
    return [DIST[i].shape for i in idx]


def _samplers(shapes, dp, sparse, ga=2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [build_batch_sampler(CFG, shapes, Layout.explicit(dp_size=dp, dp_rank=r), micro_steps_per_step=ga, sparse=sparse)
                for r in range(dp)]


def _consume(samplers, steps=None):
    ga = samplers[0].micro_steps_per_step
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in samplers:
            it = list(s)
            out.extend(i for b in (it if steps is None else it[:steps * ga]) for i in b)
    return out


def test_update_densities_at_step_keeps_exactly_once_and_is_deterministic():
    shapes = _mix(1500)
    d0, d1 = synthetic_densities(30, 12, seed=0), synthetic_densities(30, 12, seed=1, lo=0.2, hi=0.9)
    ss = _samplers(shapes, 3, SparseAttentionCost(d0))
    first = _consume(ss, steps=4)
    for s in ss:
        s.update_densities(d1, at_step=4, measured_at=4)
    rest = _consume(ss)
    planned = first + rest
    stats = ss[0].epoch_stats()                                 # the current (re-planned) segment
    assert len(planned) == len(set(planned))                    # exactly once over both segments
    assert len(planned) + stats["oversize"] + stats["tail_dropped"] == len(shapes)
    assert ss[0].steps_per_epoch == 4 + ss[0].plan.num_steps
    assert ss[0].cost.sparse.densities == d1 and ss[0].density_updates[-1]["at_step"] == 4
    # the re-planned part differs from the original plan (new cost), and is identical on re-running
    ref = _consume(_samplers(shapes, 3, SparseAttentionCost(d0)))
    assert ref != first + rest
    again = _samplers(shapes, 3, SparseAttentionCost(d0))
    _consume(again, steps=4)
    for s in again:
        s.update_densities(d1.as_dict(), at_step=4)
    assert _consume(again) == rest
    # resume 2 steps into the re-planned segment, on the same and on another topology
    consumed = set(first) | set(ss[0].plan.samples_of_steps(2).tolist())
    state = json.loads(json.dumps(ss[0].state_dict(6)))
    for dp_to in (3, 2):
        fresh = _samplers(shapes, dp_to, SparseAttentionCost(d0))      # built with the OLD densities
        for s in fresh:
            s.load_state_dict(state)
        assert fresh[0].cost.sparse.densities == d1                      # densities are run state
        after = _consume(fresh)
        assert not consumed & set(after) and len(after) == len(set(after))
        tail = fresh[0].epoch_stats()
        assert len(consumed) + len(after) + tail["oversize"] + tail["tail_dropped"] == len(shapes)
        if dp_to == 3:                                                   # same topology: the same plan
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert [list(f) for f in fresh] == [list(s)[2 * 2:] for s in ss]
            assert fresh[0].steps_per_epoch == ss[0].steps_per_epoch
    with pytest.raises(ValueError, match="re-plan point must be a step of epoch 0"):
        ss[0].update_densities(d1, at_step=10_000)


def test_update_densities_at_the_epoch_boundary_and_resume_keeps_pending():
    shapes = _mix(800)
    d0, d1 = synthetic_densities(30, 12, seed=0), synthetic_densities(30, 12, seed=2, lo=0.3, hi=1.0)
    ss = _samplers(shapes, 2, SparseAttentionCost(d0))
    before = _consume(ss)
    for s in ss:
        s.update_densities(d1)
    assert _consume(ss) == before and ss[0].cost.sparse.densities == d0      # this epoch unchanged
    state = ss[0].state_dict(1)
    for s in ss:
        s.set_epoch(1)
    assert ss[0].cost.sparse.densities == d1
    e1 = _consume(ss)
    assert len(e1) == len(set(e1))
    fresh = _samplers(shapes, 2, SparseAttentionCost(d0))
    for s in fresh:
        s.load_state_dict(state)
    assert fresh[0].cost.sparse.densities == d0 and fresh[0]._pending is not None
    for s in fresh:
        s.set_epoch(1)
    assert _consume(fresh) == e1                                               # pending survived the resume
    dense = _samplers(shapes, 2, None)
    with pytest.raises(ValueError, match="needs a sampler planned with a sparse-attention cost"):
        dense[0].update_densities(d1)
    assert "sparse" not in dense[0].state_dict(0)                               # dense state format unchanged


# ------------------------------------------------------------------------------ calibrate --sparse masks
@pytest.mark.parametrize("seq_len", [300, 384, 1000])
def test_block_mask_selects_the_requested_key_blocks(seq_len):
    from ds_adaptive.calibration.sparse import block_mask_dense, make_block_mask, select_kv_blocks

    dens = [0.02, 0.34, 0.67, 1.0]
    nb = -(-seq_len // 128)
    num, idx = select_kv_blocks(dens, seq_len, seed=3)
    assert num[0, :, 0].tolist() == [max(1, min(nb, round(r * nb))) for r in dens]
    for h in range(len(dens)):                            # distinct, ascending, in range
        for qb in range(nb):
            row = idx[0, h, qb, :num[0, h, qb]].tolist()
            assert row == sorted(set(row)) and all(0 <= x < nb for x in row)
    mask = make_block_mask(dens, seq_len, seed=3)
    assert int(mask.kv_num_blocks.sum()) == 0              # every selected block is a full block
    ref = block_mask_dense(dens, seq_len, seed=3)
    assert ref.shape == (len(dens), seq_len, seq_len)
    assert torch_equal_blocks(mask.to_dense()[0], ref[:, ::128, ::128])
    assert not torch_equal_blocks(make_block_mask(dens, seq_len, seed=4).to_dense()[0], ref[:, ::128, ::128]) \
        or nb <= 3


def torch_equal_blocks(a, b):
    return bool((a.bool() == b.bool()).all())


# ------------------------------------------------------------------------------ simulate --sparse
def test_simulate_sparse_cli_and_arms(tmp_path, capsys):
    from ds_adaptive.cli.simulate import main as simulate_main
    from ds_adaptive.simulation.sparse import simulate_sparse

    r = simulate_sparse(world=8, sp=2, steps=8, seed=1)
    s = r["samplers"]
    assert set(s) == {"dense_cost", "sparse", "sparse_identity", "tokens", "dense_attention"}
    # the sparse cost balances the sparse micro-steps within 1%, and better than the dense cost where that one's plan
    # is not balanced by construction (micro-steps of one shape and batch size on every rank time alike)
    assert s["sparse"]["compute_cv_mean"] <= max(s["dense_cost"]["compute_cv_mean"], 0.01)
    assert r["rho_eff"]["balanced"]["75600"] <= r["rho_eff"]["identity"]["75600"]
    assert s["dense_attention"]["timed_with"] == "dense" and s["sparse_identity"]["timed_with"] == "identity"
    dm = synthetic_densities(30, 12, seed=9)
    dm.save(tmp_path / "d.json")
    assert simulate_main(["--world", "4", "--sp", "1", "--steps", "3", "--sparse", str(tmp_path / "d.json"),
                          "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "sparse_identity" not in out["samplers"] and out["densities"]["source"].startswith("synthetic(")
