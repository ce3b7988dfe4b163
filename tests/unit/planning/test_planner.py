"""Planner invariants (hypothesis): both budgets, one shape per batch, exactly-once accounting,
equal micro-step counts, determinism; oversize error/skip; balance on the shipped mix."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.planner import (OversizeSampleError, PlanError, PlannerParams, StepTotals, plan_epoch,
                                          unique_shapes)
from ds_adaptive.planning.budget import resolve_budgets
from ds_adaptive.planning.planner import _fill_steps, _runs_cv
from ds_adaptive.planning.shape_table import ShapeTable
from ds_adaptive.core.shapes import SampleShape, load_shape_distribution

POOL = [SampleShape(1, 480, 832), SampleShape(1, 1024, 1024), SampleShape(17, 480, 832),
        SampleShape(33, 480, 832), SampleShape(81, 480, 832), SampleShape(49, 720, 1280),
        SampleShape(81, 720, 1280)]
COST = {sp: CostModel("h100-wan2.1-1.3b", sp=sp) for sp in (1, 2, 4)}


def _plan(shapes, mode, dp, ga, sp=1, m_mem=30.0, m_comp="auto", oversize="error", window=16, seed=0, max_tokens=None):
    cost = COST[sp]
    uniq, sid = unique_shapes(shapes)
    b = resolve_budgets(mode=mode, cost=cost, shapes=shapes, m_mem=m_mem, m_comp=m_comp, max_tokens=max_tokens,
                        gpu_mem_gib=None, mem_utilization=0.85, zero_stage=3, dp_size=dp)
    params = PlannerParams(mode=mode, dp_size=dp, micro_steps_per_step=ga, m_mem=b["m_mem"],
                           m_comp=b["m_comp"] if mode == "dual" else None,
                           max_tokens=b["max_tokens"] if mode == "tokens" else None, window=window, oversize=oversize)
    order = np.random.default_rng(seed).permutation(len(shapes))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_epoch(sid, uniq, order, cost, params, seed=seed)
    return plan, params, cost


def _check_invariants(plan, params, cost, shapes):
    dp, ga = params.dp_size, params.micro_steps_per_step
    n_batches = len(plan.batch_shape)
    assert n_batches % dp == 0
    assert plan.num_micro_steps % ga == 0            # whole optimizer steps only
    sizes = plan.batch_sizes()
    assert (sizes >= 1).all()                          # every rank works in every micro-step
    for j in range(n_batches):
        ids = plan.sample_ids[plan.batch_offsets[j]:plan.batch_offsets[j + 1]]
        shape = plan.shapes[plan.batch_shape[j]]
        assert all(shapes[i] == shape for i in ids)    # one shape per micro-batch
        b = len(ids)
        assert cost.batch_memory(shape, b) <= params.m_mem * (1 + 1e-9)
        if params.mode == "dual":
            assert cost.batch_cost(shape, b) <= params.m_comp * (1 + 1e-9)
        if params.mode == "tokens":
            assert b * cost.padded_tokens(shape) <= params.max_tokens
    planned = plan.sample_ids.tolist()
    assert len(planned) == len(set(planned))
    accounted = planned + plan.oversize + plan.tail_dropped
    assert sorted(accounted) == list(range(len(shapes)))   # exactly once, nothing silently lost


shape_lists = st.lists(st.sampled_from(POOL), min_size=1, max_size=260)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=shape_lists, mode=st.sampled_from(["dual", "tokens", "fixed"]), dp=st.integers(1, 6),
       ga=st.integers(1, 3), sp=st.sampled_from([1, 2, 4]), m_mem=st.floats(16.0, 60.0),
       window=st.integers(1, 40), seed=st.integers(0, 3))
def test_plan_invariants(shapes, mode, dp, ga, sp, m_mem, window, seed):
    plan, params, cost = _plan(shapes, mode, dp, ga, sp=sp, m_mem=m_mem, window=window, seed=seed)
    _check_invariants(plan, params, cost, shapes)
    if len(shapes) >= 4 * dp * ga * 4 and mode == "dual":
        assert plan.num_steps >= 1


@settings(max_examples=25, deadline=None)
@given(shapes=shape_lists, dp=st.integers(1, 5), ga=st.integers(1, 3), m_comp=st.floats(2000.0, 60000.0))
def test_explicit_compute_budget_with_skip(shapes, dp, ga, m_comp):
    plan, params, cost = _plan(shapes, "dual", dp, ga, m_comp=m_comp, oversize="skip")
    _check_invariants(plan, params, cost, shapes)
    for i in plan.oversize:
        assert cost.batch_cost(shapes[i], 1) > m_comp or cost.batch_memory(shapes[i], 1) > params.m_mem


@settings(max_examples=20, deadline=None)
@given(shapes=shape_lists, mode=st.sampled_from(["dual", "tokens"]), dp=st.integers(1, 4), seed=st.integers(0, 5))
def test_plan_is_deterministic(shapes, mode, dp, seed):
    a, _, _ = _plan(shapes, mode, dp, 2, seed=seed)
    b, _, _ = _plan(shapes, mode, dp, 2, seed=seed)
    assert a.sample_ids.tolist() == b.sample_ids.tolist()
    assert a.batch_offsets.tolist() == b.batch_offsets.tolist()


def test_oversize_error_names_sample_shape_and_budget():
    shapes = [POOL[0]] * 30 + [POOL[-1]] + [POOL[0]] * 5
    with pytest.raises(OversizeSampleError, match=r"sample 30 \(shape 81x720x1280, 75600 tokens\).*m_comp"):
        _plan(shapes, "dual", 2, 1, m_comp=5000.0)
    with pytest.raises(OversizeSampleError, match=r"sample 30 .*activation memory .* > m_mem 5"):
        _plan(shapes, "tokens", 2, 1, m_mem=5.0)
    with pytest.warns(UserWarning, match="skipping 1 oversize"):
        cost = COST[1]
        uniq, sid = unique_shapes(shapes)
        plan_epoch(sid, uniq, np.arange(len(shapes)), cost,
                   PlannerParams(mode="dual", dp_size=2, micro_steps_per_step=1, m_mem=30.0, m_comp=5000.0,
                                 oversize="skip"))
    plan, params, cost = _plan(shapes, "dual", 2, 1, m_comp=5000.0, oversize="skip")
    assert plan.oversize == [30]
    _check_invariants(plan, params, cost, shapes)


def test_tail_smaller_than_a_step_is_dropped_and_counted():
    shapes = [POOL[4]] * 3                                 # 3 videos, 4 DP ranks
    with pytest.warns(UserWarning, match="3 sample.*not trained this epoch"):
        cost = COST[1]
        uniq, sid = unique_shapes(shapes)
        plan = plan_epoch(sid, uniq, np.arange(3), cost,
                          PlannerParams(mode="dual", dp_size=4, micro_steps_per_step=1, m_mem=30.0, m_comp=1e5))
    assert plan.num_micro_steps == 0 and plan.tail_dropped == [0, 1, 2]


def test_tail_is_split_to_fill_a_whole_step():
    shapes = [POOL[0]] * 50                                 # one shape, fits in one batch of B=50
    plan, params, cost = _plan(shapes, "tokens", 4, 2)
    assert plan.num_micro_steps == 2 and plan.tail_dropped == []
    assert sorted(plan.sample_ids.tolist()) == list(range(50))


def test_bad_params_are_errors():
    with pytest.raises(PlanError, match="m_comp"):
        PlannerParams(mode="dual", dp_size=2, micro_steps_per_step=1, m_mem=10.0)
    with pytest.raises(PlanError, match="fixed_batch_sizes\\['81x720x1280'\\] = 9"):
        _planf = PlannerParams(mode="fixed", dp_size=1, micro_steps_per_step=1, m_mem=20.0,
                               fixed_batch_sizes={"81x720x1280": 9})
        uniq, sid = unique_shapes([POOL[-1]])
        plan_epoch(sid, uniq, np.arange(1), COST[1], _planf)


def test_step_totals_loss_weight_and_lr_scale():
    t = StepTotals(samples=40, tokens=1000, micro_steps=2)
    # 4 ranks x 2 micro-steps; weights x (1/dp) x (1/ga) average back to the global mean
    assert t.loss_weight(10, 250, dp_size=4) == pytest.approx(10 / 40 * 4 * 2)
    assert t.loss_weight(10, 100, dp_size=4, by="tokens") == pytest.approx(100 / 1000 * 8)
    assert t.lr_scale("none", None) == 1.0
    assert t.lr_scale("linear", 20) == 2.0 and t.lr_scale("sqrt", 10) == 2.0
    with pytest.raises(PlanError, match="reference_batch"):
        t.lr_scale("linear", None)


@pytest.mark.parametrize("dp", [8, 16])
def test_dual_balances_the_shipped_mix(dp):
    dist = load_shape_distribution()
    w = np.array([d.weight for d in dist])
    rng = np.random.default_rng(0)
    shapes = [dist[i].shape for i in rng.choice(len(dist), 6000, p=w / w.sum())]
    plan, params, cost = _plan(shapes, "dual", dp, 1, m_mem="auto", window=256)
    tok, _, _ = _plan(shapes, "tokens", dp, 1, m_mem="auto", window=256)
    _check_invariants(plan, params, cost, shapes)
    c = plan.micro_step_costs()[:-1]                       # the epoch's last step is the tail
    cv = c.std(1) / c.mean(1)
    ct = tok.micro_step_costs()[:-1]
    assert cv.mean() <= 0.05 < 0.15 <= (ct.std(1) / ct.mean(1)).mean()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(runs=st.lists(st.tuples(st.integers(0, len(POOL) - 1), st.integers(1, 8), st.integers(1, 64)),
                     min_size=1, max_size=6))
def test_a_micro_steps_cv_from_its_runs_is_the_cv_of_its_batches(runs):
    """The anchor-and-fill step scores a micro-step from its runs (shape, B, ranks); the CV is that of the
    per-rank costs it stands for."""
    cost = COST[1]
    table = ShapeTable(POOL, cost, PlannerParams(mode="dual", dp_size=1, micro_steps_per_step=1, m_mem=60.0,
                                                 m_comp=1e9))
    costs = np.array([table.batch_cost(u, b) for u, b, n in runs for _ in range(n)])
    dp = len(costs)
    want = costs.std() / costs.mean()
    assert _runs_cv(table, runs, dp) == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert _runs_cv(table, runs[:1], runs[0][2]) == 0.0


def _fill_steps_reference(count: np.ndarray, steps: int, ga: int) -> np.ndarray:
    """The dealing of ``_fill_steps`` written out on numpy for every block at once (the planner's before its heap)."""
    blocks = count.shape[0]
    order = np.argsort(-count, axis=1, kind="stable")
    rows = np.arange(blocks)
    totals, filled = np.zeros((blocks, steps)), np.zeros((blocks, steps), np.int64)
    members = np.empty((blocks, steps, ga), np.int64)
    for r in range(steps * ga):
        j = order[:, r]
        i = np.argmin(np.where(filled < ga, totals, np.inf), axis=1)
        members[rows, i, filled[rows, i]] = j
        totals[rows, i] += count[rows, j]
        filled[rows, i] += 1
    members.sort(axis=2)
    return members[:, np.random.default_rng([steps, ga, 0x57E9]).permutation(steps)]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(steps=st.integers(1, 9), ga=st.integers(1, 7), blocks=st.integers(1, 3), hi=st.integers(1, 40),
       tokens=st.booleans(), seed=st.integers(0, 2**16))
def test_steps_dealt_by_the_one_row_heap_are_the_reference_dealing(steps, ga, blocks, hi, tokens, seed):
    """Ties included (small counts repeat): one row and several rows deal as the numpy reference does."""
    rng = np.random.default_rng(seed)
    count = rng.integers(1, hi + 1, (blocks, steps * ga))
    count = count * 1_000_003 if tokens else count
    assert np.array_equal(_fill_steps(count, steps, ga), _fill_steps_reference(count, steps, ga))
    assert np.array_equal(_fill_steps(count[:1], steps, ga), _fill_steps_reference(count[:1], steps, ga))


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dp=st.integers(1, 5), ga=st.integers(1, 4), steps=st.integers(1, 150), chunk=st.integers(1, 9),
       by=st.sampled_from(["samples", "tokens"]), seed=st.integers(0, 2**16))
def test_balance_steps_moves_each_micro_step_whole_with_its_samples(dp, ga, steps, chunk, by, seed, monkeypatch):
    """Gathered a few batches at a time (chunks smaller than a micro-step and across blocks): every batch of the result
    is a batch of the input, a micro-step's batches stay together in their rank order, and a step holds ``ga`` of the
    input's micro-steps of its own block (``STEP_BALANCE_BLOCK`` steps)."""
    from ds_adaptive.planning import planner
    monkeypatch.setattr(planner, "_GATHER_CHUNK", chunk)
    rng = np.random.default_rng(seed)
    n_batches = steps * ga * dp
    sizes = rng.integers(1, 6, n_batches)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    ids = rng.permutation(int(offsets[-1])).astype(np.int64)
    bs = rng.integers(0, 3, n_batches).astype(np.int64)
    tokens = np.array([5, 70, 900])
    new_ids, new_off, new_bs = planner.balance_steps(ids, offsets, bs, tokens, dp, ga, by)
    batches = [tuple(ids[offsets[j]:offsets[j + 1]]) for j in range(n_batches)]
    where = {b: j for j, b in enumerate(batches)}   # ids are distinct: a batch names its input index
    got = [where[tuple(new_ids[new_off[j]:new_off[j + 1]])] for j in range(n_batches)]
    assert np.array_equal(new_bs, bs[got]) and new_off[-1] == offsets[-1]
    micro = np.array(got).reshape(-1, dp)
    assert np.array_equal(micro % dp, np.broadcast_to(np.arange(dp), micro.shape))   # ranks in order
    src = micro[:, 0] // dp
    assert sorted(src.tolist()) == list(range(steps * ga))   # every micro-step once
    block = planner.STEP_BALANCE_BLOCK * ga
    assert np.array_equal(src // block, np.arange(steps * ga) // block)   # within its block
