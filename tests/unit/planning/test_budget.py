"""Guards the throughput-optimal compute budget (ds_adaptive/planning/budget.py): deterministic, the same on
every rank, reproduced on resume, never over the memory budget, samples over it run alone with balanced
partners, gradient accumulation chosen with it and checked against DeepSpeed's."""
from __future__ import annotations

import math
import types
import warnings

import numpy as np
import pytest

from ds_adaptive.planning.budget import candidate_budgets, predicted_time_ms, uses_budget_search
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.memory import model_checkpoint_blocks
from ds_adaptive.planning import search_cache
from ds_adaptive.planning.planner import OversizeSampleError, PlannerParams, plan_epoch, unique_shapes
from ds_adaptive.planning.sampler import build_batch_sampler
from ds_adaptive.core.config import ConfigError, SamplerConfig
from ds_adaptive.core.ds_config import prepare_ds_config
from ds_adaptive.data import build_dataset
from ds_adaptive.core.layout import Layout

H200 = "h200-wan2.1-1.3b"
GIB = 139.8


def _shapes(n=300, seed=0):
    return build_dataset("synthetic", num_samples=n, shapes=None, seed=seed).sample_shapes()


def _sampler(shapes, dp=1, rank=0, gas="auto", checkpointing=None, **cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_batch_sampler(SamplerConfig(profile=H200, **cfg), shapes, Layout.explicit(dp_size=dp, dp_rank=rank),
                                   micro_steps_per_step=gas, gpu_mem_gib=GIB, model_name="wan2.1-1.3b", zero_stage=3,
                                   checkpointing=checkpointing)


def test_budget_is_deterministic_identical_on_every_rank_and_beats_the_reference():
    shapes = _shapes()
    a, b, c = [(search_cache.clear(), _sampler(shapes, dp=2, rank=r))[1] for r in (0, 1, 0)]   # 3 fresh searches
    ch = a.budget_choice
    assert ch is not None and a.params.solo_over_budget
    assert (a.params, a.micro_steps_per_step) == (b.params, b.micro_steps_per_step) == (c.params, c.micro_steps_per_step)
    assert np.array_equal(a.plan.sample_ids, b.plan.sample_ids) and np.array_equal(a.plan.batch_ckpt, c.plan.batch_ckpt)
    # the chosen budget is the best candidate, at or below the longest sample's B=1 cost, and no worse than it
    best = max(r["tokens_per_s"] for r in ch.candidates)
    assert ch.predicted_tokens_per_s == best >= ch.reference_tokens_per_s > 0
    ms = [r["m_comp"] for r in ch.candidates]
    assert ms == sorted(ms) and ch.reference_m_comp in ms and ms[-1] > ch.reference_m_comp   # a grid above it too
    assert ch.m_comp <= ch.reference_m_comp and ch.equal_token_tokens_per_s < ch.predicted_tokens_per_s
    assert ch.micro_steps_per_step == math.ceil(ch.reference_m_comp / ch.m_comp - 1e-9)
    # on the default mix the memory-aware budget is well below the longest video's (H200: ~1 s vs ~9 s)
    assert ch.m_comp < 0.5 * ch.reference_m_comp and a.micro_steps_per_step > 1


def test_every_candidate_plan_fits_memory_and_solo_samples_are_balanced():
    shapes = _shapes(400)
    cost = CostModel(H200, checkpointing="auto")
    m_mem = cost.auto_memory_budget(GIB, zero_stage=3, dp_size=3)
    uniq, sid = unique_shapes(shapes)
    longest = max(uniq, key=lambda s: s.tokens)
    ref = max(float(cost.ckpt_cost(s, 1, 0)) for s in uniq)
    cands = candidate_budgets(cost, uniq, m_mem, ref)
    assert cands == sorted(cands) and cands[-1] == ref and len(cands) >= 5
    for m in cands[::3]:
        params = PlannerParams(mode="dual", dp_size=3, micro_steps_per_step=2, m_mem=m_mem, m_comp=m, window=64,
                               solo_over_budget=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_epoch(sid, uniq, np.arange(len(shapes)), cost, params, seed=1)
        assert plan.batch_memory.max() <= m_mem * (1 + 1e-9) and not plan.oversize     # memory is never traded
        sizes = plan.batch_sizes()
        solo = np.array([uniq[u] == longest for u in plan.batch_shape])
        if float(cost.ckpt_cost(longest, 1, 0)) > m:   # the longest videos run alone ...
            assert solo.any() and np.all(sizes[solo] == 1)
        c = plan.micro_step_costs()
        cv = c.std(axis=1) / c.mean(axis=1)
        assert np.median(cv) < 0.05   # ... and their micro-steps' other batches are grown to their cost
        assert predicted_time_ms(plan, cost) > c.max(axis=1).sum()
    # without solo_over_budget an explicit budget below the longest sample is still an oversize error
    with pytest.raises(OversizeSampleError, match="m_comp"):
        plan_epoch(sid, uniq, np.arange(len(shapes)), cost,
                   PlannerParams(mode="dual", dp_size=1, micro_steps_per_step=1, m_mem=m_mem, m_comp=cands[0]))


def test_resume_reproduces_the_chosen_budget_and_plan():
    shapes = _shapes()
    s = _sampler(shapes, dp=2)
    s.set_epoch(0)
    state = s.state_dict(3)
    r = _sampler(shapes, dp=2)
    r.load_state_dict(state)
    assert r.params == s.params and r.micro_steps_per_step == s.micro_steps_per_step
    gas = s.micro_steps_per_step
    assert list(r) == list(s.plan.rank_batches(0, 3 * gas))
    assert [r.checkpoint_blocks(k, m) for k in range(3, 6) for m in range(gas)] == \
        [s.checkpoint_blocks(k, m) for k in range(3, 6) for m in range(gas)]


def test_gradient_accumulation_auto_and_fixed():
    shapes = _shapes()
    fixed = _sampler(shapes, gas=2)
    assert fixed.micro_steps_per_step == 2 and fixed.budget_choice.micro_steps_per_step == 2
    assert all(r["micro_steps_per_step"] == 2 for r in fixed.budget_choice.candidates)
    # no search without the memory-aware policy: the longest sample's budget, one micro-step per step
    every = _sampler(shapes, checkpointing="all")
    assert every.budget_choice is None and every.micro_steps_per_step == 1 and not every.params.solo_over_budget
    assert not uses_budget_search(CostModel(H200, "power", checkpointing="auto"), "dual")
    assert not uses_budget_search(CostModel(H200, checkpointing="auto"), "tokens")
    base = _sampler(shapes, mode="tokens")
    assert base.micro_steps_per_step == 1 and base.budget_choice is None
    # the ds_config: "auto" is kept for the sampler; with train_batch_size it is an error
    assert prepare_ds_config({"gradient_accumulation_steps": "auto"}, dp_size=2, on_gpu=False)[
        "gradient_accumulation_steps"] == "auto"
    with pytest.raises(ConfigError, match="drop train_batch_size"):
        prepare_ds_config({"gradient_accumulation_steps": "auto", "train_batch_size": 8}, dp_size=2, on_gpu=False)


def test_build_run_gives_deepspeed_the_sampler_count_and_the_trainer_checks_it():
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig, UsageError
    from ds_adaptive.training.engine import check_accumulation
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "launch" / "configs" / "zero3_adaptive.json"
    cfg = RunConfig.load(str(path), trainer={"model": "wan2.1-1.3b", "num_samples": 300})
    cfg.adaptive_load.sampler.profile = H200
    run = build_run(cfg, layout=Layout.for_world(1, 1), meta=True, gpu_mem_gib=GIB)
    assert run.ds_config["gradient_accumulation_steps"] == run.gas == run.sampler.micro_steps_per_step > 1
    assert any("gradient_accumulation_steps auto ->" in n for n in run.notes)
    check_accumulation(types.SimpleNamespace(gradient_accumulation_steps=lambda: run.gas), run.plan)
    with pytest.raises(UsageError, match=rf"DeepSpeed runs gradient_accumulation_steps 1 but the batch sampler planned "
                                         rf"{run.gas}"):
        check_accumulation(types.SimpleNamespace(gradient_accumulation_steps=lambda: 1), run.plan)


def test_plan_counts_map_to_the_model_depth():
    assert [model_checkpoint_blocks(n, 30, 30) for n in (0, 7, 30)] == [0, 7, 30]
    assert [model_checkpoint_blocks(n, 30, 2) for n in (0, 1, 15, 16, 29, 30)] == [0, 1, 1, 2, 2, 2]


def test_density_updates_keep_the_policy_and_re_search_at_the_same_gas():
    from ds_adaptive.planning.sparse_cost import SparseAttentionCost
    from ds_adaptive.core.contracts import synthetic_densities

    shapes = _shapes(200)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = build_batch_sampler(SamplerConfig(profile=H200), shapes, Layout.explicit(), micro_steps_per_step="auto",
                                gpu_mem_gib=GIB, model_name="wan2.1-1.3b", zero_stage=3,
                                sparse=SparseAttentionCost(synthetic_densities(30, 12, seed=0)))
        gas = s.micro_steps_per_step
        s.update_densities(synthetic_densities(30, 12, seed=1, lo=0.05, hi=0.2), at_step=1)
    # with_sparse kept the policy (the re-search may pick the equal-token plan where it predicts as fast:
    # "never slower than the baseline"; a dual plan keeps solo_over_budget)
    assert s.cost.checkpointing == "auto" and (s.params.mode == "tokens" or s.params.solo_over_budget)
    assert s.micro_steps_per_step == gas and s.budget_choice.micro_steps_per_step == gas   # DeepSpeed's gas is fixed


def test_with_train_overheads_replaces_the_loop_terms_and_survives_a_rescale():
    from ds_adaptive.planning.profile import load_profile

    base = load_profile("h200-wan2.1-1.3b")
    p = base.with_train_overheads(220.0, 910.0)
    assert (p.micro_step_overhead_ms, p.optimizer_step_overhead_ms) == (220.0, 910.0)
    assert (base.micro_step_overhead_ms, base.optimizer_step_overhead_ms) == (35.4, 66.4)   # unchanged
    assert p.c0_ms == base.c0_ms and p.block_full_gib == base.block_full_gib
    half = p.with_num_layers(15)   # rescales the new terms by the parameter ratio, as the shipped ones
    ratio = half.params / p.params
    assert half.micro_step_overhead_ms == pytest.approx(220.0 * ratio)
    # the block-fusion variant the shipped job resolves has its own terms: replaced too, not silently back
    regions, _ = p.for_ln_modulate("fused")[0].for_block_fusion("regions", "fused")
    own, _ = base.for_ln_modulate("fused")[0].for_block_fusion("regions", "fused")
    assert (regions.micro_step_overhead_ms, regions.optimizer_step_overhead_ms) == (220.0, 910.0)
    assert own.micro_step_overhead_ms != 220.0 and regions.c0_ms == own.c0_ms   # its compute kept


def test_efficient_batch_is_the_lowest_time_per_sample_ties_to_the_larger():
    from ds_adaptive.planning.planner import efficient_batch

    # per sample with 10 ms of loop: B1 110, B2 60, B3 ~43.3, B4 40 (a recompute step), B5 40 (tie), B6 ~43.3
    cost = np.array([0.0, 100.0, 110.0, 120.0, 150.0, 190.0, 250.0])
    assert efficient_batch(cost, 10.0) == 5
    assert efficient_batch(cost[:5], 10.0) == 4            # within a lower cap
    assert efficient_batch(cost[:2], 10.0) == 1
    assert efficient_batch(np.array([0.0, 10.0, 20.0, 30.0]), 0.0) == 3   # linear without loop time: the largest


def _capped_pair(shapes, dp, m_comp):
    cost = CostModel(H200, checkpointing="auto")
    m_mem = cost.auto_memory_budget(GIB, zero_stage=3, dp_size=dp)
    uniq, sid = unique_shapes(shapes)
    plans = {}
    for capped in (False, True):
        params = PlannerParams(mode="dual", dp_size=dp, micro_steps_per_step=2, m_mem=m_mem, m_comp=m_comp,
                               window=64, solo_over_budget=True, efficient_batches=capped)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plans[capped] = plan_epoch(sid, uniq, np.arange(len(shapes)), cost, params, seed=1)
    return cost, m_mem, uniq, plans


def test_efficient_batches_cap_every_shape_at_its_lowest_time_per_sample():
    from ds_adaptive.planning.memory import micro_batch_table, sample_memory
    from ds_adaptive.planning.planner import efficient_batch, loop_ms_per_micro_step

    shapes = _shapes(600)
    m_comp = 4000.0   # on the H200 profile, image batches under it checkpoint blocks
    cost, m_mem, uniq, plans = _capped_pair(shapes, 1, m_comp)
    loop = loop_ms_per_micro_step(cost.profile, 2)
    capped_any = False
    for u, s in enumerate(uniq):
        b_mem = int(m_mem / sample_memory(cost, s))
        t = micro_batch_table(cost, s, b_mem, m_mem)
        b_comp = min(b_mem, int(np.searchsorted(t.cost, m_comp * (1 + 1e-12), "right")) - 1)
        cap = efficient_batch(t.cost[:max(b_comp, 1) + 1], loop)
        for capped, plan in plans.items():
            # not the batches grown to a solo sample's cost (micro-steps over m_comp), nor the re-planned last step
            planned = np.repeat(plan.micro_step_costs().max(axis=1) <= m_comp * (1 + 1e-9), plan.dp_size)
            planned[-plan.micro_steps_per_step * plan.dp_size:] = False
            sizes = plan.batch_sizes()[(plan.batch_shape == u) & planned]
            if sizes.size:
                assert sizes.max() <= (cap if capped else max(b_comp, 1))
        capped_any |= cap < b_comp
    assert capped_any
    # fewer recomputed blocks per sample, and (one rank: no balance to lose) less predicted time per token
    per_token = {c: predicted_time_ms(p, cost) / p.batch_tokens.sum() for c, p in plans.items()}
    ckpt = {c: (p.batch_ckpt * p.batch_sizes()).sum() / p.batch_sizes().sum() for c, p in plans.items()}
    assert per_token[True] < per_token[False] and ckpt[True] < ckpt[False]
    for plan in plans.values():
        assert plan.batch_memory.max() <= m_mem * (1 + 1e-9) and not plan.oversize


def test_the_search_scores_capped_plans_and_the_sampler_runs_the_one_chosen():
    shapes = _shapes(3000, seed=3)
    s = _sampler(shapes, dp=1)
    ch = s.budget_choice
    rows = list(ch.candidates)
    capped = [r for r in rows if r["efficient_batches"]]
    assert capped and len(capped) < len(rows)             # only budgets where the cap changes a batch
    for r in capped:   # each capped row follows its budget's uncapped row
        assert rows[rows.index(r) - 1]["m_comp"] == r["m_comp"] and not rows[rows.index(r) - 1]["efficient_batches"]
    best = max(r["tokens_per_s"] for r in rows)
    ties = [(r["m_comp"], r["efficient_batches"]) for r in rows if r["tokens_per_s"] == best]
    assert ch.predicted_tokens_per_s == best and (ch.m_comp, ch.efficient_batches) == max(ties, key=lambda t: t[0])
    assert s.params.efficient_batches == ch.efficient_batches and s.epoch_stats()["budgets"]["efficient_batches"] \
        == ch.efficient_batches
    assert ch.describe()["efficient_batches"] == ch.efficient_batches
    from ds_adaptive.training.assemble import _gas_note

    assert ("each shape capped at its lowest time per sample" in _gas_note(s)) == ch.efficient_batches


def test_a_capped_plan_resumes_exactly_and_old_states_keep_their_key_set():
    shapes = _shapes(3000, seed=3)
    s = _sampler(shapes, dp=1)
    if not s.params.efficient_batches:
        pytest.skip("the search did not choose a capped plan for this mix")
    s.set_epoch(0)
    state = s.state_dict(2)
    assert state["segments"][-1]["params"]["efficient_batches"] is True
    r = _sampler(shapes, dp=1)
    r.load_state_dict(state)
    gas = s.micro_steps_per_step
    assert r.params == s.params and list(r) == list(s.plan.rank_batches(0, 2 * gas))
    # an uncapped plan's state has no such key: states saved before it resume exactly
    assert "efficient_batches" not in PlannerParams(mode="dual", dp_size=1, micro_steps_per_step=1, m_mem=1.0,
                                                    m_comp=1.0).as_dict()


def test_batch_cap_off_scores_and_plans_no_capped_batches():
    shapes = _shapes(3000, seed=3)
    on, off = _sampler(shapes, dp=1), _sampler(shapes, dp=1, batch_cap="off")
    assert on.params.efficient_batches and on.batch_cap
    assert not off.params.efficient_batches and not off.batch_cap
    assert not any(r["efficient_batches"] for r in off.budget_choice.candidates)
    assert [r for r in on.budget_choice.candidates if not r["efficient_batches"]] == list(off.budget_choice.candidates)
    with pytest.raises(Exception, match="batch_cap"):
        SamplerConfig(batch_cap="yes")
