"""Guards sampler.global_batch (ds_adaptive/planning/global_batch.py, budget.py): samples per optimizer step stay at
the set value whatever the world size and shape mix, an int gradient_accumulation_steps keeps its meaning, a
global batch too small for the data-parallel ranks is one line, loss weights stay unbiased, and a resume on
another world size keeps the global batch."""
from __future__ import annotations

import json
from pathlib import Path
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from pydantic import ValidationError

from ds_adaptive.core.config import AdaptiveLoadConfig, SamplerConfig
from ds_adaptive.core.layout import Layout
from ds_adaptive.core.shapes import load_shape_distribution
from ds_adaptive.models.registry import get_model
from ds_adaptive.planning.global_batch import _aim_budget, counts, fit_gas, step_stats
from ds_adaptive.planning.plan_types import PlanError
from ds_adaptive.planning.sampler import build_batch_sampler
from ds_adaptive.planning.validate import RunFacts, run_problems
from ds_adaptive.simulation.simulate import draw_shapes

H200 = "h200-wan2.1-1.3b"
GIB = 139.8
MODEL = get_model("wan2.1-1.3b")
MIX = load_shape_distribution(MODEL.shapes, grid=MODEL.grid)


def _mix(weights=None):
    if weights is None:
        return MIX
    return [type(d)(shape=d.shape, weight=w) for d, w in zip(MIX, weights)]


def _sampler(shapes, dp, gb, gas="auto", rank=0, **cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_batch_sampler(SamplerConfig(profile=H200, global_batch=gb, **cfg), shapes,
                                   Layout.explicit(dp_size=dp, dp_rank=rank), micro_steps_per_step=gas,
                                   gpu_mem_gib=GIB, model_name="wan2.1-1.3b", zero_stage=3)


def _mean_samples(sampler) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return step_stats(sampler.plan)["samples"]["mean"]


def test_global_batch_config_sets_exactly_one_count():
    assert SamplerConfig(global_batch={"samples": 64}).global_batch.by == "samples"
    assert SamplerConfig(global_batch={"tokens": 10**6}).global_batch.value == 10**6
    for bad in ({}, {"samples": 64, "tokens": 10}, {"samples": 0}, {"samples": 64, "typo": 1}):
        with pytest.raises(ValidationError):
            SamplerConfig(global_batch=bad)


@settings(max_examples=3, deadline=None, derandomize=True, phases=(Phase.generate,),
          suppress_health_check=list(HealthCheck))
@given(world=st.sampled_from([1, 8, 64, 256]), seed=st.integers(0, 2**16),
       weights=st.one_of(st.none(), st.lists(st.floats(0.05, 1.0), min_size=len(MIX), max_size=len(MIX))))
def test_samples_per_step_stay_at_the_global_batch_over_world_sizes_and_mixes(world, seed, weights):
    gb = {"samples": 2048}
    shapes = draw_shapes(_mix(weights), 16 * 2048, seed)   # an epoch of ~16 steps: its last steps round
    s = _sampler(shapes, world, gb)
    assert abs(_mean_samples(s) / 2048 - 1) <= 0.10
    assert s.global_batch_fit["ok"] and s.plan.num_steps >= 4


# a mix whose 16-step epoch ends in a short step: its steady steps hold 2,048 within 5% on 256 ranks, the epoch's mean
# with its leftover step does not; the check fits the steady steps
SHORT_MIX = [0.333, 0.163, 0.315, 0.445, 0.605, 0.300, 0.461, 0.477, 0.405, 0.129, 0.2, 0.252, 0.247, 0.763]


def test_the_check_fits_the_steady_steps_not_the_epochs_leftover_step():
    s = _sampler(draw_shapes(_mix(SHORT_MIX), 16 * 2048, 377), 256, {"samples": 2048})
    assert s.global_batch_fit["ok"], s.global_batch_fit
    assert abs(_mean_samples(s) / 2048 - 1) <= 0.10


def test_a_fit_outside_the_tolerance_re_aims_the_auto_budget():
    # 1% on 64 ranks: no whole number of the search's micro-steps holds 1,500; the check moves m_comp: auto (here the
    # c0-linear aim alone lands 4.8% off; the aim between two planned budgets that bracket G / k holds it)
    # (no micro_step_share: with it, a rank's batch holds at most 11 samples and no budget lands within 1%)
    s = _sampler(draw_shapes(MIX, 12 * 1500, 3), 64, {"samples": 1500, "tolerance": 0.01, "micro_step_share": None})
    fit = s.global_batch_fit
    assert fit["ok"] and fit["error"] <= 0.01, fit
    assert fit["m_comp_aimed"]["from"] != fit["m_comp_aimed"]["to"] == s.params.m_comp
    assert s.budget_choice.m_comp == fit["m_comp_aimed"]["from"]   # the search's own choice stays on record


def test_the_aim_interpolates_between_bracketing_budgets_else_scales_above_c0():
    seen = [(1000.0, 100.0), (1100.0, 140.0), (900.0, 60.0)]
    assert _aim_budget(seen, 120.0, 50.0) == (1050.0, True)
    m, bracketed = _aim_budget([(1000.0, 100.0)], 150.0, 100.0)
    assert not bracketed and m == 100.0 + 900.0 * 1.5


@pytest.mark.parametrize("weights", [None, SHORT_MIX])
def test_every_step_on_one_gpu_holds_about_the_global_batch_not_only_the_epochs_mean(weights):
    # images come in micro-steps of ~38 samples, long videos of 1: the steps are dealt so that each holds about the
    # same samples (before, runs of steps swung 56-69 for 64)
    s = _sampler(draw_shapes(_mix(weights), 10_000, 0), 1, {"samples": 64})
    g = s.plan.micro_steps_per_step
    per_step = np.diff(s.plan.batch_offsets[np.arange(s.plan.num_steps + 1) * g])[:-1]   # without the leftover step
    assert per_step.size > 50
    assert np.abs(per_step / per_step.mean() - 1).max() <= 0.08, (per_step.min(), per_step.max(), per_step.mean())


def _steps(sampler) -> np.ndarray:
    """Samples of each optimizer step of the sampler's plan, without the epoch's leftover step."""
    return counts(sampler.plan)[:-1]


@pytest.mark.parametrize("model,profile,world,gb", [("wan2.1-1.3b", H200, 8, 64),
                                                    ("wan2.2-ti2v-5b", "h200-wan2.2-ti2v-5b", 1, 32)])
def test_single_steps_stay_near_the_global_batch_with_few_micro_steps_per_step(model, profile, world, gb):
    # a few micro-steps per step, one of images holding dozens per rank: without micro_step_share a step that gets
    # it holds several times the global batch and the others a fraction (1.3B on 8 GPUs at 64: 16 .. 484)
    m = get_model(model)
    shapes = draw_shapes(load_shape_distribution(m.shapes, grid=m.grid), 10_000, 0)

    def build(share):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build_batch_sampler(SamplerConfig(profile=profile, global_batch={"samples": gb,
                                                                                    "micro_step_share": share}),
                                       shapes, Layout.explicit(dp_size=world, dp_rank=0), micro_steps_per_step="auto",
                                       gpu_mem_gib=GIB, model_name=model, zero_stage=3)
    loose, even = _steps(build(None)), _steps(build(0.5))
    assert loose.max() > 2.5 * gb, (loose.min(), loose.max())   # what the share fixes
    assert even.min() >= 0.7 * gb and even.max() <= 1.3 * gb, (even.min(), even.max())
    limit = 0.5 * gb / world
    s = build(0.5)
    assert s.params.batch_limit == limit and int(s.plan.batch_sizes().max()) <= limit


def test_micro_step_share_is_a_share():
    assert SamplerConfig(global_batch={"samples": 64}).global_batch.micro_step_share == 0.5
    assert SamplerConfig(global_batch={"samples": 64, "micro_step_share": None}).global_batch.micro_step_share is None
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValidationError, match="micro_step_share"):
            SamplerConfig(global_batch={"samples": 64, "micro_step_share": bad})


def test_a_fit_the_plan_cannot_hold_within_the_tolerance_is_a_warning_not_silent():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # without micro_step_share (its smaller image batches let this plan hold 100 within 3%)
        s = build_batch_sampler(SamplerConfig(profile=H200, global_batch={"samples": 100, "tolerance": 0.03,
                                                                          "micro_step_share": None}),
                                draw_shapes(MIX, 1200, 1), Layout.explicit(dp_size=8, dp_rank=0),
                                micro_steps_per_step="auto", gpu_mem_gib=GIB, model_name="wan2.1-1.3b", zero_stage=3)
    assert not s.global_batch_fit["ok"]
    assert [w for w in caught if "global_batch.samples 100 (" in str(w.message) and "tolerance 3%" in str(w.message)]


@pytest.mark.parametrize("world,gb,n", [(1, 2048, 16 * 2048), (8, 2048, 16 * 2048), (64, 2048, 16 * 2048),
                                        (256, 2048, 16 * 2048), (1024, 8192, 12 * 8192)])
def test_the_done_when_sizes(world, gb, n):
    s = _sampler(draw_shapes(MIX, n, 1), world, {"samples": gb})
    assert abs(_mean_samples(s) / gb - 1) <= 0.10


def test_token_global_batch_and_another_mix():
    ti2v = get_model("wan2.2-ti2v-5b")
    mix = load_shape_distribution(ti2v.shapes, grid=MODEL.grid) if ti2v.grid == MODEL.grid else MIX
    shapes = draw_shapes(_mix([1.0 / (i + 1) for i in range(len(MIX))]) if mix is MIX else mix, 8000, 3)
    target = 20_000_000
    s = _sampler(shapes, 8, {"tokens": target})
    p, g = s.plan, s.plan.micro_steps_per_step * s.plan.dp_size
    per_step = np.add.reduceat(p.batch_tokens[:p.num_steps * g], np.arange(p.num_steps) * g)
    # a 5-step epoch: its last step holds the leftover samples (a third of a step here); the others hold the target
    assert p.num_steps >= 4 and abs(per_step[:-1].mean() / target - 1) <= 0.10, per_step
    assert per_step[-1] <= 1.1 * target and p.num_samples + len(p.oversize) == len(shapes)


def test_an_int_gradient_accumulation_keeps_its_meaning():
    shapes = draw_shapes(MIX, 8000, 2)
    s = _sampler(shapes, 8, {"samples": 1024}, gas=16)
    assert s.micro_steps_per_step == 16
    assert abs(_mean_samples(s) / 1024 - 1) <= 0.10
    with pytest.raises(PlanError, match=r"global_batch\.samples = 100000 cannot be kept .*gradient_accumulation_steps 2"):
        _sampler(shapes, 8, {"samples": 100_000}, gas=2)


def test_a_global_batch_too_small_for_the_ranks_is_one_line():
    shapes = draw_shapes(MIX, 2000, 0)
    with pytest.raises(PlanError) as exc:
        _sampler(shapes, 64, {"samples": 32})
    msg = str(exc.value)
    assert "\n" not in msg and "global_batch.samples is 32" in msg and "at least 64" in msg
    block = AdaptiveLoadConfig.model_validate({"sampler": {"global_batch": {"samples": 32}}})
    problems = run_problems({"gradient_accumulation_steps": "auto"}, block, RunFacts(world=64))
    assert [p.key for p in problems] == ["global_batch"] and problems[0].message == msg


def test_config_check_and_dry_run_exit_on_a_too_small_global_batch(tmp_path, capsys):
    from ds_adaptive import cli

    cfg = json.loads(open("launch/configs/zero3_adaptive.json").read())
    cfg["adaptive_load"]["sampler"]["global_batch"] = {"samples": 4}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert cli.main(["config", "--check", str(path), "--world", "8"]) != 0
    err = capsys.readouterr()
    assert "global_batch.samples is 4" in err.out + err.err


def test_loss_weights_are_unbiased_per_step():
    s = _sampler(draw_shapes(MIX, 4000, 4), 4, {"samples": 256})
    plan = s.plan
    for step in range(plan.num_steps):
        tot = plan.step_totals(step)
        w = [tot.loss_weight(len(plan.batch(step * plan.micro_steps_per_step + m, r)), 0, plan.dp_size)
             for m in range(plan.micro_steps_per_step) for r in range(plan.dp_size)]
        # DeepSpeed divides by dp x gas; a mean batch loss x weight sums to the step's per-sample mean
        assert np.isclose(sum(w) / (plan.dp_size * plan.micro_steps_per_step), 1.0)


def test_resume_mid_epoch_on_another_world_size_keeps_the_global_batch():
    shapes = draw_shapes(MIX, 24 * 512, 5)
    gb = {"samples": 512}
    a = _sampler(shapes, 4, gb)
    k = 3
    state = a.state_dict(k)
    b = _sampler(shapes, 16, gb)
    b.load_state_dict(json.loads(json.dumps(state)))
    plan = b.plan
    done = set(a.plan.samples_of_steps(k).tolist())
    rest = set(plan.sample_ids.tolist())
    assert not done & rest and len(done | rest) + len(plan.tail_dropped) + len(plan.oversize) == len(shapes)
    assert b.steps_per_epoch == k + plan.num_steps
    assert abs(_mean_samples(b) / 512 - 1) <= 0.10
    assert [b.step_totals(i).samples for i in range(k)] == [a.step_totals(i).samples for i in range(k)]


def test_fit_gas_rounds_and_bounds():
    f = fit_gas(100.0, 1000, 0.05)
    assert (f.gas, f.ok) == (10, True)
    assert not fit_gas(100.0, 1040, 0.01).ok and fit_gas(100.0, 1040, 0.05).ok
    assert fit_gas(100.0, 1000, 0.05, gas=3).gas == 3 and not fit_gas(100.0, 1000, 0.05, gas=3).ok


def test_simulate_config_reports_the_epoch(capsys):
    from ds_adaptive import cli

    assert cli.main(["simulate", "--config", "launch/configs/zero3_adaptive.json", "--world", "8",
                     "--num-samples", "3000", "--profile", H200, "--gpu-mem-gib", str(GIB), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("samples_per_step", "tokens_per_step"):
        assert set(r[key]) == {"mean", "min", "median", "max"} and r[key]["min"] <= r[key]["mean"] <= r[key]["max"]
        assert r[key]["min"] <= r[key]["median"] <= r[key]["max"]
    want = json.loads(Path("launch/configs/zero3_adaptive.json").read_text())["adaptive_load"]["sampler"]["global_batch"]
    assert r["global_batch"]["samples"] == want["samples"]
    assert abs(r["samples_per_step"]["mean"] / want["samples"] - 1) <= 0.10
    assert r["optimizer_steps"] > 0 and r["plan_s"] > 0 and r["peak_rss_mb"] > 0
    assert r["dual"]["predicted_tokens_per_s"] > 0 and r["dual"]["predicted_cv"] >= 0
    # the equal-token baseline at the same global batch, or the line saying why its batches cannot hold it
    assert (r["tokens"].get("predicted_tokens_per_s") or 0) > 0 or "global_batch" in r["tokens"]["error"]
