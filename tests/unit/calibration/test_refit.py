"""ds_adaptive.balance.refit: a profile's compute terms refitted to trainer compute windows."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import ROOT
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import load_profile
from ds_adaptive.calibration.refit import (RefitError, Window, fit_train_overheads, refit_compute, trainer_steps,
                                           trainer_windows)
from ds_adaptive.cli.refit import main
from ds_adaptive.core.shapes import SampleShape

PROFILE = "h200-wan2.1-1.3b"
#: (shape, B, checkpointed blocks) spanning images to long clips, as a default job's plans do
CONFIGS = [((1, 480, 832), 51, 11), ((1, 720, 1280), 21, 9), ((33, 480, 832), 4, 1), ((33, 720, 1280), 1, 0),
           ((49, 720, 1280), 1, 0), ((81, 480, 832), 2, 1), ((81, 720, 1280), 1, 6), ((49, 480, 832), 3, 0)]


def _truth_windows(prof, c0, a, b, r, noise=0.0, seed=0):
    """Windows a trainer whose cost is ``c0 + B (a S + b S^2) + r x recompute`` would log."""
    cost = CostModel(prof, "calibrated", checkpointing="auto", checkpoint_attention="recompute")
    rng = np.random.default_rng(seed)
    out = []
    for shp, bsz, ck in CONFIGS:
        sh = SampleShape(*shp)
        s = float(cost.padded_tokens(sh))
        rec = float(cost.ckpt_cost(sh, bsz, ck) - cost.ckpt_cost(sh, bsz, 0))
        ms = (c0 + bsz * (a * s + b * s * s) + r * rec) * (1 + noise * rng.standard_normal())
        out.append(Window("synthetic", 2, sh, bsz, ck, ms))
    return out


def test_refit_recovers_the_terms_and_the_profile_predicts_the_windows():
    prof = load_profile(PROFILE)
    terms = (12.0, 0.017, 1.2e-6, 0.85)
    fit = refit_compute(prof, _truth_windows(prof, *terms))
    got = fit.terms
    assert [got[k] for k in ("c0_ms", "a_ms_per_token", "b_ms_per_token2", "recompute_scale")] == \
        pytest.approx(terms, rel=1e-6)
    cost = CostModel(fit.profile, "calibrated", checkpointing="auto", checkpoint_attention="recompute")
    for w in _truth_windows(prof, *terms):   # the refitted profile through the planner's own cost model
        assert float(cost.ckpt_cost(w.shape, w.batch, w.ckpt_blocks)) == pytest.approx(w.ms, rel=1e-6)
    assert fit.errors()["after"]["max"] < 1e-6 < fit.errors()["before"]["max"]
    assert fit.profile.recompute_ms == pytest.approx(tuple(0.85 * v for v in prof.recompute_ms))
    rec = fit.profile.raw["compute"]["fit"]
    assert rec["windows"] == len(CONFIGS) and rec["calibrated"]["c0_ms"] == prof.raw["compute"]["c0_ms"]


def test_noisy_windows_fit_within_the_noise_and_c0_is_never_negative():
    prof = load_profile(PROFILE)
    fit = refit_compute(prof, _truth_windows(prof, 0.0, 0.017, 1.2e-6, 0.85, noise=0.01, seed=3))
    assert fit.terms["c0_ms"] >= 0 and fit.errors()["after"]["max"] < 0.04
    assert fit.terms["a_ms_per_token"] == pytest.approx(0.017, rel=0.1)


def test_too_few_configs_are_refused():
    prof = load_profile(PROFILE)
    w = _truth_windows(prof, 12.0, 0.017, 1.2e-6, 0.85)[:3]
    with pytest.raises(RefitError, match="3 distinct .* need at least 5"):
        refit_compute(prof, w)


def _run_dir(tmp_path, windows, **summary):
    d = tmp_path / "run"
    d.mkdir(exist_ok=True)
    (d / "summary.json").write_text(json.dumps({"model": "wan2.1-1.3b", "layers": 30, "sp": 1, "dp_size": 1,
                                                **summary}))
    mem, met = [], []
    for i, w in enumerate(windows):   # one micro-step a step; step 1 is the warm-up and left out
        for step in (1, i + 2) if i == 0 else (i + 2,):
            mem.append({"step": step, "micro": 0, "shape": str(w.shape), "B": w.batch, "ckpt_blocks": w.ckpt_blocks})
            ms = w.ms * (3 if step == 1 else 1)
            met.append({"step": step, "micro_compute_ms": [[ms]], "wall_s": (ms + LOOP_MS[0] + LOOP_MS[1]) / 1e3})
    (d / "memory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mem))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in met))
    return d


#: ms per micro-step and per optimizer step outside the compute windows, in the made-up runs
LOOP_MS = (37.5, 45.0)


def _compute_log_run(tmp_path, name, windows, gas):
    """A run dir whose trainer wrote compute.jsonl: ``gas`` windows a step, each step's wall the windows plus
    LOOP_MS; step 1 (the warm-up) 2 s slower."""
    d = tmp_path / name
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"model": "wan2.1-1.3b", "layers": 30, "sp": 1, "dp_size": 1}))
    lines = []
    for i in range(0, len(windows) - gas + 1, gas):
        step, group = i // gas + 1, windows[i:i + gas]
        wall = sum(w.ms for w in group) + gas * LOOP_MS[0] + LOOP_MS[1] + (2000 if step == 1 else 0)
        lines += [{"step": step, "micro": m, "shape": str(w.shape), "B": w.batch, "ckpt_blocks": w.ckpt_blocks,
                   "compute_ms": w.ms, "step_wall_ms": wall} for m, w in enumerate(group)]
    (d / "compute.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return d


def test_the_loop_terms_are_fitted_outside_the_compute_windows(tmp_path, capsys):
    prof = load_profile(PROFILE)
    truth = _truth_windows(prof, 12.0, 0.017, 1.2e-6, 0.85)
    runs = [_compute_log_run(tmp_path, "gas3", truth * 3, 3), _compute_log_run(tmp_path, "gas5", truth * 5, 5)]
    steps = [s for r in runs for s in trainer_steps(r)]
    assert {s["micro"] for s in steps} == {3, 5} and min(s["step"] for s in steps) == 2
    fit = fit_train_overheads(steps)
    assert (fit["micro_step_ms"], fit["optimizer_step_ms"]) == pytest.approx(LOOP_MS)
    with pytest.raises(RefitError, match=r"all have \[3\] micro-steps: .* at least two gradient accumulation"):
        fit_train_overheads(trainer_steps(runs[0]))
    out = tmp_path / "refit.json"
    assert main([str(r) for r in runs] + ["--profile", PROFILE, "--out", str(out)]) == 0
    assert "training loop (outside the compute windows, " in capsys.readouterr().out
    shipped = load_profile(str(out))
    assert (shipped.micro_step_overhead_ms, shipped.optimizer_step_overhead_ms) == pytest.approx(LOOP_MS)
    assert "gas3" in shipped.raw["train_overheads"]["note"] and shipped.overhead_source == "measured"
    assert main([str(runs[0]), "--profile", PROFILE]) == 0   # one gas: the compute refit, the profile's loop terms
    kept = "training loop: the profile's terms kept (the runs' steps all have [3] micro-steps"
    assert kept in capsys.readouterr().out


def test_trainer_windows_read_a_log_dir_after_its_warm_up(tmp_path):
    prof = load_profile(PROFILE)
    truth = _truth_windows(prof, 12.0, 0.017, 1.2e-6, 0.85)
    got = trainer_windows(_run_dir(tmp_path, truth))
    assert [(w.shape, w.batch, w.ckpt_blocks, w.ms) for w in got] == \
        [(w.shape, w.batch, w.ckpt_blocks, w.ms) for w in truth]
    with pytest.raises(RefitError, match="sp 2 x dp 1: the refit reads one GPU's windows"):
        trainer_windows(_run_dir(tmp_path, truth, sp=2))


def test_trainer_windows_prefer_the_compute_log_and_name_a_bad_line(tmp_path):
    """A run with ``compute.jsonl`` is read from it (every step); ``metrics.jsonl`` logs only every interval-th."""
    prof = load_profile(PROFILE)
    truth = _truth_windows(prof, 12.0, 0.017, 1.2e-6, 0.85)
    d = _run_dir(tmp_path, truth[:2])   # metrics / memory: two of them
    comp = [{"step": i + 1, "micro": 0, "shape": str(w.shape), "B": w.batch, "ckpt_blocks": w.ckpt_blocks,
             "compute_ms": w.ms} for i, w in enumerate(truth)]
    (d / "compute.jsonl").write_text("".join(json.dumps(r) + "\n" for r in comp))
    got = trainer_windows(d)
    assert [(w.step, w.shape, w.batch, w.ms) for w in got] == [(i + 1, w.shape, w.batch, w.ms)
                                                               for i, w in enumerate(truth)][1:]
    del comp[3]["compute_ms"]
    (d / "compute.jsonl").write_text("".join(json.dumps(r) + "\n" for r in comp))
    with pytest.raises(RefitError, match="compute.jsonl: a line without compute_ms"):
        trainer_windows(d)


def test_cli_writes_a_profile_the_sampler_takes_and_names_bad_input(tmp_path, capsys):
    prof = load_profile(PROFILE)
    run = _run_dir(tmp_path, _truth_windows(prof, 12.0, 0.017, 1.2e-6, 0.85))
    out, png = tmp_path / "refit.json", tmp_path / "refit.png"
    assert main([str(run), "--profile", PROFILE, "--out", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "recompute x0.850" in text and f"wrote {out}" in text and f"wrote {png}" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert load_profile(str(out)).raw["compute"]["fit"]["recompute_scale"] == pytest.approx(0.85)
    assert main([str(tmp_path / "missing"), "--profile", PROFILE]) == 2
    assert "missing: no summary.json" in capsys.readouterr().err
    other = _run_dir(tmp_path, _truth_windows(prof, 12.0, 0.017, 1.2e-6, 0.85), model="wan2.1-14b")
    assert main([str(other), "--profile", PROFILE]) == 2
    assert "the run trained 'wan2.1-14b'" in capsys.readouterr().err


def test_the_shipped_default_job_runs_hold_out_each_other():
    """The three recorded H200 default-job runs: fitted on two, the third's windows are predicted within 4% each
    (the calibrated profile: up to 17%)."""
    runs = [ROOT / "tests" / "data" / "trainer_runs" / d for d in ("lean_backward_h200_273bf38/default_job",
                                                     "lean_norm_h200_9180477/default_job_gas3",
                                                     "default_job_h200_2f0fcdc")]
    prof, _ = load_profile(PROFILE).for_ln_modulate("fused")
    prof, _ = prof.for_block_fusion("regions", "fused")
    windows = {str(r): trainer_windows(r) for r in runs}
    for held in windows:
        fit = refit_compute(prof, [w for k, ws in windows.items() if k != held for w in ws])
        cost = CostModel(fit.profile, "calibrated", checkpointing="auto", checkpoint_attention="recompute")
        err = [abs(float(cost.ckpt_cost(w.shape, w.batch, w.ckpt_blocks)) / w.ms - 1) for w in windows[held]]
        assert max(err) < 0.04, (held, max(err))


def test_the_trainer_summary_holds_the_plan_s_compute_against_its_windows(tmp_path):
    """The memory log records each micro-step's predicted compute; the summary compares it with the step records'
    windows after the warm-up and, on one GPU off by more than 5%, gives the refit command."""
    from types import SimpleNamespace

    from ds_adaptive.training.summary import format_summary
    from ds_adaptive.training.memory_log import MemoryLog

    cost = CostModel(load_profile(PROFILE), "calibrated", checkpointing="auto", checkpoint_attention="recompute")
    log = MemoryLog(SimpleNamespace(cost=cost), 3, 1, str(tmp_path), True)
    sh = [SampleShape(81, 480, 832), SampleShape(1, 480, 832)]
    history = []
    for step in (1, 2, 3):
        for micro, (s, b) in enumerate(zip(sh, (1, 20))):
            log.record(step, micro, s, b, 0, 10.0)
        pred = [log.predicted_ms[step, m] for m in (0, 1)]
        # the video as predicted, the image batch 20% faster; the warm-up step 3x slower (left out)
        history.append(SimpleNamespace(step=step, wall_s=0.5 * step,
                                       micro_compute_ms=[[pred[0] * (3 if step == 1 else 1)],
                                                         [pred[1] * (3 if step == 1 else 0.8)]]))
        log.end_step(history[-1])
    with pytest.raises(RuntimeError, match="step 4: 2 compute windows for 1 recorded micro-steps"):
        log.record(4, 0, sh[0], 1, 0, 10.0)
        log.end_step(SimpleNamespace(step=4, wall_s=1.0, micro_compute_ms=[[1.0], [1.0]]))
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "memory.jsonl").read_text().splitlines()]
    assert len(lines) == 7 and lines[0]["predicted_ms"] == pytest.approx(float(cost.ckpt_cost(sh[0], 1, 0)))
    # compute.jsonl: every step's windows (not every metrics.interval-th), which the refit reads after the warm-up
    comp = [json.loads(x) for x in (tmp_path / "compute.jsonl").read_text().splitlines()]
    assert [(r["step"], r["micro"], r["B"]) for r in comp] == [(s, m, (1, 20)[m]) for s in (1, 2, 3) for m in (0, 1)]
    assert [r["compute_ms"] for r in comp] == [ms[0] for h in history for ms in h.micro_compute_ms]
    assert [r["step_wall_ms"] for r in comp] == [1e3 * h.wall_s for h in history for _ in h.micro_compute_ms]
    assert all(r["predicted_ms"] == log.predicted_ms[r["step"], r["micro"]] for r in comp)
    (tmp_path / "summary.json").write_text(json.dumps({"sp": 1, "dp_size": 1, "checkpoint_attention": "keep"}))
    got = trainer_windows(tmp_path)
    assert [(w.step, w.shape, w.batch, w.ms, w.checkpoint_attention) for w in got] == \
        [(r["step"], sh[r["micro"]], r["B"], r["compute_ms"], "keep") for r in comp[2:]]
    cp = log.compute_summary(history, 1)
    assert cp["micro_steps"] == 4 and cp["max_abs_rel_err"] == pytest.approx(0.25)
    assert cp["refit"] == (f"ds-adaptive refit {tmp_path} --profile {PROFILE} --ln-modulate "
                           f"{cost.profile.ln_modulate} --block-fusion {cost.profile.block_fusion}")
    s = {"steps": 3, "samples": 3, "tokens": 30, "wall_s": 1.0, "tokens_per_s": 30.0, "samples_per_s": 3.0,
         "step_s_mean": 0.3, "warmup_steps": 1, "peak_mem_gib": 1.0, "mem_capacity_gib": 2.0, "peak_mem_frac": 0.5,
         "mem_efficiency": 0.5, "cv_step": 0.0, "compute_cv": 0.0, "idle_frac": 0.0, "loss_window": 1,
         "loss_first": 1.0, "loss_last": 0.9, "loss_fell": True, "compute_prediction": cp}
    text = format_summary(s)
    assert f"per micro-step max |err| 25.0%); to plan with this run's costs: {cp['refit']} --out PROFILE.json" in text
    two = MemoryLog(SimpleNamespace(cost=cost), 3, 2, str(tmp_path), False)   # not the writer: no predictions
    assert two.compute_summary(history, 1) is None


def test_the_shipped_regions_variant_is_the_refit_of_the_recorded_runs():
    """The H200 1.3B profile's block-fusion 'regions' compute and loop terms are what ``ds-adaptive refit`` gives on
    the four recorded default-job runs (tests/data/trainer_runs), from the calibrated compute they were refitted from."""
    runs = [str(ROOT / "tests" / "data" / "trainer_runs" / d) for d in ("lean_backward_h200_273bf38/default_job",
                                                          "lean_norm_h200_9180477/default_job_gas3",
                                                          "default_job_h200_2f0fcdc", "default_job_h200_ff7d565")]
    shipped, _ = load_profile(PROFILE).for_ln_modulate("fused")
    shipped, _ = shipped.for_block_fusion("regions", "fused")
    base = load_profile({**shipped.raw, "compute": {**shipped.raw["compute"], **shipped.raw["compute"]["fit"]
                                                    ["calibrated"]}})
    base = base.with_train_overheads(0.0, 0.0)
    raw = json.loads(json.dumps(base.raw))   # the recompute before the refit's scale
    raw["compute"]["recompute"].update({k: v / shipped.raw["compute"]["fit"]["recompute_scale"]
                                        for k, v in shipped.raw["compute"]["recompute"].items()
                                        if k in ("c0_ms", "a_ms_per_token", "b_ms_per_token2")})
    fit = refit_compute(load_profile(raw), [w for r in runs for w in trainer_windows(r)])
    for k in ("c0_ms", "a_ms_per_token", "b_ms_per_token2"):
        assert fit.profile.raw["compute"][k] == pytest.approx(shipped.raw["compute"][k], rel=1e-9), k
    loop = fit_train_overheads([s for r in runs for s in trainer_steps(r)])
    assert (loop["micro_step_ms"], loop["optimizer_step_ms"]) == pytest.approx(
        (shipped.micro_step_overhead_ms, shipped.optimizer_step_overhead_ms), rel=1e-9)
    assert fit.errors()["after"]["max"] < 0.025 < 0.15 < fit.errors()["before"]["max"]
