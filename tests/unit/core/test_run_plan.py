"""Guards the run plan (ds_adaptive/core/run_plan.py): ``build_run`` resolves the start-up choices once into a frozen
``Run.plan`` equal to what the batch sampler resolved, and ``Run.budgets`` / ``Run.gas`` read it."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import json
from pathlib import Path

import pytest

from ds_adaptive.core.config import SparseAttentionConfig
from ds_adaptive.core.layout import Layout
from ds_adaptive.core.run_plan import RunPlan
from ds_adaptive.training.assemble import build_run
from ds_adaptive.training.metrics_setup import run_info
from ds_adaptive.training.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[3]
H200 = "h200-wan2.1-1.3b"


def _run(**sparse):

    cfg = RunConfig.load(str(ROOT / "launch" / "configs" / "zero3_adaptive.json"),
                         trainer={"model": "wan2.1-1.3b", "num_samples": 300})
    cfg.adaptive_load.sampler.profile = H200
    if sparse:
        cfg.adaptive_load.sparse_attention = SparseAttentionConfig(enabled=True, **sparse)
    return build_run(cfg, layout=Layout.for_world(1, 1), meta=True, gpu_mem_gib=139.8)


@pytest.fixture(scope="module")
def run():
    return _run()


def test_the_plan_is_what_the_sampler_resolved(run):
    plan, p, cost, s = run.plan, run.sampler.params, run.sampler.cost, run.sampler
    assert isinstance(plan, RunPlan)
    assert plan.gas == s.micro_steps_per_step == run.ds_config["gradient_accumulation_steps"] == run.gas
    assert (plan.m_mem, plan.m_comp, plan.max_tokens) == (p.m_mem, p.m_comp, p.max_tokens)
    assert (plan.solo_over_budget, plan.efficient_batches, plan.oversize) == (p.solo_over_budget,
                                                                              p.efficient_batches, p.oversize)
    assert (plan.unit, plan.checkpointing, plan.checkpoint_attention) == (cost.unit, cost.checkpointing,
                                                                          cost.checkpoint_attention)
    assert plan.checkpoint_attention in ("keep", "recompute")
    assert (plan.mode, plan.sampler_mode) == (p.mode, s.mode)
    gb = s.global_batch   # the shipped config sets sampler.global_batch
    assert plan.global_batch == {"by": gb.by, "value": gb.value, "tolerance": gb.tolerance,
                                 "micro_step_share": gb.micro_step_share, "batch_limit": s.params.batch_limit}
    assert plan.global_batch_fit == s.global_batch_fit and plan.global_batch_fit is not None
    assert plan.budget_note is not None and plan.budget_note in run.notes   # gradient_accumulation_steps auto
    # the count and budget the run uses (after the global-batch check's re-fit / re-aim), not the search's
    assert plan.budget_note.startswith(f"gradient_accumulation_steps auto -> {plan.gas}")
    assert f"m_comp auto -> {plan.m_comp:.0f} ms" in plan.budget_note
    assert plan.sparse_layers is None   # sparse attention off
    assert plan == RunPlan.from_sampler(s, budget_note=plan.budget_note)


def test_budgets_and_gas_read_the_plan(run):
    assert run.budgets == run.plan.budgets == {
        "m_mem": run.plan.m_mem, "m_comp": run.plan.m_comp, "max_tokens": run.plan.max_tokens,
        "unit": run.plan.unit, "solo_over_budget": run.plan.solo_over_budget,
        "efficient_batches": run.plan.efficient_batches}
    other = dataclasses.replace(run, plan=dataclasses.replace(run.plan, gas=7, m_mem=1.5))
    assert other.gas == 7 and other.budgets["m_mem"] == 1.5   # not read back from the sampler


def test_the_plan_is_frozen_and_describes_itself(run):
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.plan.m_mem = 1.0
    d = run.plan.describe()
    assert set(d) == {f.name for f in dataclasses.fields(RunPlan)}
    assert d["gas"] == run.gas and d["global_batch"] == dict(run.plan.global_batch) and d["sparse_layers"] is None
    body = ast.parse(inspect.getsource(RunPlan)).body[0].body   # every field has its one-line docstring
    documented = {a.target.id for a, doc in zip(body, body[1:]) if isinstance(a, ast.AnnAssign)
                  and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)}
    assert documented == {f.name for f in dataclasses.fields(RunPlan)}


def test_sparse_layers_are_those_outside_dense_layers():
    run = _run(forced_density=0.1, dense_layers=[0, 5, 29])
    want = tuple(i for i in range(run.model_config.num_layers) if i not in (0, 5, 29))
    assert run.plan.sparse_layers == want
    assert set(run.plan.sparse_layers) == set(range(run.model_config.num_layers)) - run.sparse.schedule.dense_layers
    assert run.plan.describe()["sparse_layers"] == list(want)


def test_the_summary_records_the_run_plan(run):
    from_info = run_info(run)["run_plan"]
    assert from_info == run.plan.describe() and json.loads(json.dumps(from_info)) == from_info
