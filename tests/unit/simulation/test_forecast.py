"""ds_adaptive.simulation.forecast: the default job's budget search under several loop terms, and the predicted MFU
of its first steps under the search's plan (what bench/planner/budget_candidates.py and plan_mfu.py print)."""
from __future__ import annotations

import json

import pytest

from conftest import ROOT
from ds_adaptive.planning.profile import load_profile
from ds_adaptive.planning.profile import ProfileError
from ds_adaptive.simulation import forecast as fc

H200_GIB = 139.80072021484375
MODEL = "wan2.1-1.3b"


def _job_sampler_cfg() -> dict:
    """The default job's sampler block without its global batch: these guard the search where the loop terms choose
    the micro-steps per step with the budget (with a global batch the samples per step are fixed:
    tests/unit/planning/test_global_batch.py)."""
    cfg = json.loads((ROOT / "launch" / "configs" / "zero3_adaptive.json").read_text())["adaptive_load"]["sampler"]
    cfg.pop("global_batch", None)
    return cfg


@pytest.fixture(scope="module")
def samplers():
    prof = load_profile("h200-wan2.1-1.3b")
    return {cap: fc.default_job_sampler(_job_sampler_cfg(), prof, H200_GIB, 3000, model_name=MODEL,
                                        recompute={"attention": "recompute"}, batch_cap=cap)
            for cap in ("off", "auto")}


def test_loop_terms_move_the_default_jobs_budget():
    """Per-step loop terms several times the trainer's (those the H200 profile shipped before they were measured)
    favour fewer, larger micro-batches; the measured ones a smaller budget with more micro-steps per step."""
    choices = fc.budget_choices(_job_sampler_cfg(), load_profile("h200-wan2.1-1.3b"), H200_GIB, 3000, model_name=MODEL,
                                loops=[(220, 910), (35.4, 66.4)], checkpoint_attention="recompute")
    arms = json.loads(json.dumps(fc.describe_choices(choices)))
    old, new = arms["220 / 910 ms"], arms["35.4 / 66.4 ms"]
    assert old["m_comp"] > new["m_comp"] and old["micro_steps_per_step"] < new["micro_steps_per_step"]
    for arm in (old, new):   # the chosen candidate is the best one, never slower than the equal-token plan
        best = max(c["tokens_per_s"] for c in arm["candidates"])
        assert arm["predicted_tokens_per_s"] == best >= arm["equal_token_tokens_per_s"]
        assert arm["checkpoint_attention"] == "recompute"
    uncapped = [[c["m_comp"] for c in arm["candidates"] if not c["efficient_batches"]] for arm in (old, new)]
    assert uncapped[0] == uncapped[1]   # the same budgets; the capped rows where the cap changes a batch


def test_predicted_time_is_the_search_s_and_flops_are_the_trainer_s(samplers):
    from ds_adaptive.planning.budget import predicted_time_ms
    from ds_adaptive.models.registry import get_model

    s = samplers["off"]
    r = fc.plan_mfu(s, 0, 4, 989.0, model_name=MODEL)   # steps 0..4: the search's own prediction of the first 5 steps
    assert r["predicted_s"] == pytest.approx(predicted_time_ms(s.plan, s.cost, 5) / 1e3, rel=1e-12)
    n = 5 * s.plan.micro_steps_per_step
    preset = get_model(MODEL)
    cfg = preset.config(num_layers=30)
    flops = [preset.flops(cfg, int(t // b), int(b), int(c))
             for t, b, c in zip(s.plan.batch_tokens[:n], s.plan.batch_sizes()[:n], s.plan.batch_ckpt[:n])]
    assert r["mfu"] == pytest.approx(sum(f[0] for f in flops) / (r["predicted_s"] * 989e12), rel=1e-12)
    assert r["hfu"] == pytest.approx(sum(f[1] for f in flops) / (r["predicted_s"] * 989e12), rel=1e-12)
    assert r["tokens"] == int(s.plan.batch_tokens[:n].sum()) and 0 < r["mfu"] <= r["hfu"] < 1


def test_each_arm_reports_its_own_plan_s_cap_and_recompute(samplers):
    off, on = (fc.plan_mfu(samplers[c], 1, 21, 989.0, model_name=MODEL) for c in ("off", "auto"))
    # on this mix (3,000 samples, recompute) the search caps the batches
    assert (off["batch_cap"], on["batch_cap"]) == (False, True)
    for c, r in (("off", off), ("auto", on)):
        plan = samplers[c].plan
        lo, hi = plan.micro_steps_per_step, 22 * plan.micro_steps_per_step   # steps 1..21
        tokens, ckpt = plan.batch_tokens[lo:hi], plan.batch_ckpt[lo:hi]
        assert r["ckpt_blocks_per_token"] == pytest.approx(float((ckpt * tokens).sum() / tokens.sum()), rel=1e-12)
        assert (r["hfu"] > r["mfu"]) == bool(ckpt.any())   # recompute counts in HFU only
    assert on["mfu"] > off["mfu"]   # the search's capped plan is the one predicted faster


def test_a_run_is_matched_by_its_tokens_and_bad_input_is_reported(samplers, tmp_path):
    s = samplers["off"]
    steps = 22
    job_tokens = int(s.plan.batch_tokens[:steps * s.plan.micro_steps_per_step].sum())
    rows = {"off": {"job_tokens": job_tokens, **fc.plan_mfu(s, 1, steps - 1, 989.0, model_name=MODEL)}}
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"tokens": job_tokens, "mfu": 0.9 * rows["off"]["mfu"],
                                                  "tokens_per_s": 1.0}))
    (m,) = fc.match_runs(rows, [str(run)])
    assert m["arm"] == "off" and m["measured_over_predicted_mfu"] == pytest.approx(0.9)
    assert "measured / predicted 0.900" in fc.run_lines([m], rows)[0]
    with pytest.raises(FileNotFoundError, match="no summary.json there"):
        fc.match_runs(rows, [str(tmp_path / "nothing")])
    with pytest.raises(ValueError, match="expected key=value"):
        fc.parse_arm("x:recompute.attention")
    with pytest.raises(ValueError, match="not a sampler key or recompute.KEY"):
        fc.parse_arm("x:optimization.lr_scaling=sqrt")
    assert fc.parse_arm("off:recompute.attention=recompute,batch_cap=off") == (
        "off", {"recompute": {"attention": "recompute"}, "batch_cap": "off"})


def test_truth_times_the_same_plan_with_another_profile(samplers, tmp_path):
    s = samplers["off"]
    base = fc.plan_mfu(s, 1, 21, 989.0, model_name=MODEL)
    raw = json.loads(json.dumps(s.cost.profile.raw))
    raw["compute"]["a_ms_per_token"] *= 2   # every batch costs more: the same plan, lower MFU
    slow = fc.plan_mfu(s, 1, 21, 989.0, model_name=MODEL, truth=load_profile(raw))
    assert slow["tokens"] == base["tokens"] and slow["predicted_s"] > base["predicted_s"] and slow["mfu"] < base["mfu"]
    with pytest.raises(ProfileError):   # bench/planner/plan_mfu.py --truth reports it and exits 2
        load_profile(str(tmp_path / "none.json"))
