"""Guards bench/plan_mfu.py: predicted MFU of the default job's first steps under the budget search's plan."""
from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("plan_mfu", ROOT / "bench" / "plan_mfu.py")
pm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pm)

H200_GIB = 139.80072021484375


@pytest.fixture(scope="module")
def samplers():
    from budget_candidates import default_job_sampler

    from ds_adaptive.planning.profile import load_profile

    prof = load_profile("h200-wan2.1-1.3b")
    return {cap: default_job_sampler(prof, H200_GIB, 3000, checkpoint_attention="recompute", batch_cap=cap)
            for cap in ("off", "auto")}


def test_predicted_time_is_the_search_s_and_flops_are_the_trainer_s(samplers):
    from ds_adaptive.planning.budget import predicted_time_ms
    from ds_adaptive.models.registry import get_model

    s = samplers["off"]
    r = pm.plan_mfu(s, 0, 4, 989.0)   # steps 0..4: the search's own prediction of the first 5 steps
    assert r["predicted_s"] == pytest.approx(predicted_time_ms(s.plan, s.cost, 5) / 1e3, rel=1e-12)
    n = 5 * s.plan.micro_steps_per_step
    preset = get_model("wan2.1-1.3b")
    cfg = preset.config(num_layers=30)
    flops = [preset.flops(cfg, int(t // b), int(b), int(c))
             for t, b, c in zip(s.plan.batch_tokens[:n], s.plan.batch_sizes()[:n], s.plan.batch_ckpt[:n])]
    assert r["mfu"] == pytest.approx(sum(f[0] for f in flops) / (r["predicted_s"] * 989e12), rel=1e-12)
    assert r["hfu"] == pytest.approx(sum(f[1] for f in flops) / (r["predicted_s"] * 989e12), rel=1e-12)
    assert r["tokens"] == int(s.plan.batch_tokens[:n].sum()) and 0 < r["mfu"] <= r["hfu"] < 1


def test_each_arm_reports_its_own_plan_s_cap_and_recompute(samplers):
    off, on = (pm.plan_mfu(samplers[c], 1, 21, 989.0) for c in ("off", "auto"))
    # on this mix (3,000 samples, recompute) the search caps the batches
    assert (off["batch_cap"], on["batch_cap"]) == (False, True)
    for c, r in (("off", off), ("auto", on)):
        plan = samplers[c].plan
        lo, hi = plan.micro_steps_per_step, 22 * plan.micro_steps_per_step   # steps 1..21
        tokens, ckpt = plan.batch_tokens[lo:hi], plan.batch_ckpt[lo:hi]
        assert r["ckpt_blocks_per_token"] == pytest.approx(float((ckpt * tokens).sum() / tokens.sum()), rel=1e-12)
        assert (r["hfu"] > r["mfu"]) == bool(ckpt.any())   # recompute counts in HFU only
    assert on["mfu"] > off["mfu"]   # the search's capped plan is the one predicted faster


def test_main_matches_a_run_by_its_tokens_and_reports_bad_input(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    out = tmp_path / "o.json"
    arm = "off:checkpoint_attention=recompute,batch_cap=off"
    assert pm.main(["--samples", "3000", "--arm", arm, "--out", str(out)]) == 0
    r = json.loads(out.read_text())["arms"]["off"]
    (run / "summary.json").write_text(json.dumps({"tokens": r["job_tokens"], "mfu": 0.9 * r["mfu"],
                                                  "tokens_per_s": 1.0}))
    assert pm.main(["--samples", "3000", "--arm", arm, "--run", str(run), "--out", str(out)]) == 0
    (m,) = json.loads(out.read_text())["runs"]
    assert m["arm"] == "off" and m["measured_over_predicted_mfu"] == pytest.approx(0.9)
    assert "measured / predicted 0.900" in capsys.readouterr().out
    assert pm.main(["--samples", "3000", "--arm", arm, "--run", str(tmp_path / "nothing")]) == 2
    assert "no summary.json there" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="expected key=value"):
        pm.parse_arm("x:checkpoint_attention")


def test_truth_times_the_same_plan_with_another_profile(samplers, tmp_path, capsys):
    from ds_adaptive.planning.profile import load_profile

    s = samplers["off"]
    base = pm.plan_mfu(s, 1, 21, 989.0)
    raw = json.loads(json.dumps(s.cost.profile.raw))
    raw["compute"]["a_ms_per_token"] *= 2   # every batch costs more: the same plan, lower MFU
    slow = pm.plan_mfu(s, 1, 21, 989.0, load_profile(raw))
    assert slow["tokens"] == base["tokens"] and slow["predicted_s"] > base["predicted_s"] and slow["mfu"] < base["mfu"]
    assert pm.main(["--samples", "3000", "--arm", "x:", "--truth", str(tmp_path / "none.json")]) == 2
    assert "--truth" in capsys.readouterr().err
