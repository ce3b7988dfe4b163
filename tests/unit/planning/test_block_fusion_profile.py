"""A profile records the block-fusion mode it was calibrated with (``block_fusion``); a run with another mode plans with
the profile's matching entries (``block_fusion_variants``, added by ``autocalibrate ship``) or says its plan is
conservative (fusion on, profile without) or warns (profile fused, run not); the planner plans for fusion only where
it can run, and a run whose fusion falls back to eager after planning for it stops with one line."""
from __future__ import annotations

import copy
import json
import types

import pytest

from ds_adaptive.calibration import autocalibrate as ac
from ds_adaptive.cli import autocalibrate as ac_cli
from ds_adaptive.calibration import calibrate
from ds_adaptive.cli import calibrate as calibrate_cli
from ds_adaptive.calibration import profile_json
from ds_adaptive.planning.profile import BLOCK_FUSION_MODES, ProfileError, load_profile
from ds_adaptive.planning.sampler import build_batch_sampler
from ds_adaptive.core.config import ConfigError, SamplerConfig
from ds_adaptive.core.layout import Layout
from ds_adaptive.core.shapes import SampleShape

H200 = "h200-wan2.1-1.3b"
LONG = SampleShape(81, 720, 1280)


def _raw(name=H200):
    """The shipped profile's json without its block-fusion variants (the tests ship their own)."""
    raw = copy.deepcopy(dict(load_profile(name).raw))
    raw.pop("block_fusion_variants", None)
    return raw


def _fused_calibration(scale_mem=0.9, scale_a=0.95, name=H200) -> dict:
    """Stands in for ``ds-adaptive calibrate --block-fusion regions`` on the profile's GPU and path."""
    cal = _raw(name)
    cal.pop("ln_modulate_variants", None)
    cal["block_fusion"] = "regions"
    cal["memory"]["m1_gib_per_token"] *= scale_mem
    cal["memory"]["checkpointing"]["block_full"]["m1_gib_per_token"] *= scale_mem
    cal["compute"]["a_ms_per_token"] *= scale_a
    cal["train_overheads"]["micro_step_ms"] = 123.0
    return cal


def test_modes_are_the_configs_and_a_bad_value_is_refused():
    from ds_adaptive.models.fusion import BLOCK_FUSION_MODES as model_modes

    assert BLOCK_FUSION_MODES == model_modes
    raw = _raw()
    assert load_profile(raw).block_fusion == "off"   # shipped profiles: no key
    raw["block_fusion"] = "all"
    with pytest.raises(ProfileError, match=r"block_fusion.*'all'"):
        load_profile(raw)


def test_without_a_variant_a_fused_run_gets_a_note_and_a_fused_profile_warns_an_eager_run():
    prof = load_profile(_raw())
    assert prof.for_block_fusion("off") == (prof, None) and prof.for_block_fusion(None) == (prof, None)
    out, msg = prof.for_block_fusion("regions")
    assert out is prof and msg.startswith("note:") and "conservative" in msg
    assert "ds-adaptive calibrate --model wan2.1-1.3b --ln-modulate fused --block-fusion regions" in msg
    assert "autocalibrate ship" in msg
    assert "--ln-modulate reference --block-fusion rope" in prof.for_block_fusion("rope", "reference")[1]  # the run's
    raw = _raw()
    raw["block_fusion"] = "regions"
    fused = load_profile(raw)
    out, msg = fused.for_block_fusion("off")
    assert out is fused and msg.startswith("warning:") and "too low" in msg and "--block-fusion" not in msg
    with pytest.raises(ValueError, match="block_fusion"):
        prof.for_block_fusion("everything")


def test_ship_adds_a_block_fusion_variant_that_replaces_compute_memory_and_overheads(tmp_path):
    base, cal = _raw(), _fused_calibration()
    out = ac.ship_variant(base, cal)
    assert sorted(out["block_fusion_variants"]) == ["regions"] and "block_fusion_variants" not in base
    var = out["block_fusion_variants"]["regions"]
    assert var["ln_modulate"] == "fused" and sorted(k for k in var if k != "source") == [
        "compute", "ln_modulate", "memory", "train_overheads"]
    prof = load_profile(out)
    fused, msg = prof.for_block_fusion("regions")
    assert fused.block_fusion == "regions" and "block_fusion_variants.regions" in msg and msg.startswith("profile")
    assert fused.block_full_gib[1] == pytest.approx(prof.block_full_gib[1] * 0.9)
    assert fused.a_ms_per_token == pytest.approx(prof.a_ms_per_token * 0.95)
    assert fused.micro_step_overhead_ms == 123.0 != prof.micro_step_overhead_ms
    assert fused.ln_modulate == prof.ln_modulate and "block_fusion_variants" not in fused.raw
    # the reference path's entries do not carry the fused path's block-fusion variant
    ref, _ = prof.for_ln_modulate("reference")
    same, note = ref.for_block_fusion("regions")
    assert same is ref and note.startswith("note:")
    with pytest.raises(ValueError, match="already has 'regions'.*--replace"):
        ac.ship_variant(out, cal)
    again = ac.ship_variant(out, _fused_calibration(scale_mem=0.8), replace=True)   # a new calibration of it
    assert load_profile(again).for_block_fusion("regions")[0].block_full_gib[1] == pytest.approx(
        prof.block_full_gib[1] * 0.8)
    with pytest.raises(ValueError, match="differs from its profile in one of them"):
        ac.ship_variant(base, {**cal, "ln_modulate": "reference"})
    p, c = tmp_path / "p.json", tmp_path / "c.json"
    p.write_text(json.dumps(base))
    c.write_text(json.dumps(cal))
    assert ac_cli.main(["ship", str(c), str(p)]) == 0 and "regions" in json.loads(p.read_text())["block_fusion_variants"]
    assert ac_cli.main(["ship", str(c), str(p)]) == 2
    assert ac_cli.main(["ship", str(c), str(p), "--replace"]) == 0


def test_a_variant_without_its_own_overheads_gives_its_memory_but_not_its_compute():
    """``ds-adaptive calibrate`` writes no train_overheads: the profile's were fitted on the profile's compute, so the
    calibration's compute with them over-predicts the trainer (H200 default job: 7.8%); its memory is used."""
    cal = _fused_calibration(scale_mem=0.9, scale_a=0.6)
    del cal["train_overheads"]
    prof = load_profile(ac.ship_variant(_raw(), cal))
    fused, msg = prof.for_block_fusion("regions")
    assert fused.block_fusion == "regions" and fused.block_full_gib[1] == pytest.approx(prof.block_full_gib[1] * 0.9)
    assert (fused.c0_ms, fused.a_ms_per_token, fused.b_ms_per_token2) == (
        prof.c0_ms, prof.a_ms_per_token, prof.b_ms_per_token2)
    assert fused.micro_step_overhead_ms == prof.micro_step_overhead_ms
    assert "(block_fusion_variants.regions: memory)" in msg and "compute: the profile's own" in msg
    assert "train_overheads" in msg


def test_the_shipped_h200_profile_plans_regions_runs_with_its_measured_memory_and_refitted_compute():
    """The shipped H200 1.3B profile's ``regions`` variant: memory measured by ``ds-adaptive calibrate`` with block
    fusion, compute refitted to the default job's trainer windows with the loop terms fitted on the same runs
    (``ds-adaptive refit``): both used together."""
    prof = load_profile(H200)
    fused, msg = prof.for_block_fusion("regions")
    assert "(block_fusion_variants.regions: compute, memory, train_overheads)" in msg
    assert fused.block_full_gib[1] < 0.8 * prof.block_full_gib[1]   # measured: 59.7 vs 95.1 KiB per token
    fit = fused.raw["compute"]["fit"]
    assert fit["source"].startswith("trainer compute windows") and fit["runs"] >= 4
    assert fit["calibrated"] == {k: prof.raw["compute"][k] for k in ("c0_ms", "a_ms_per_token", "b_ms_per_token2")}
    assert "ds-adaptive refit" in fused.raw["train_overheads"]["note"]
    assert (fused.micro_step_overhead_ms, fused.optimizer_step_overhead_ms) != (
        prof.micro_step_overhead_ms, prof.optimizer_step_overhead_ms)


def _sampler(profile, block_fusion, notes):
    cfg = SamplerConfig(profile=profile, m_mem="auto", m_comp=12000.0)
    return build_batch_sampler(cfg, [LONG] * 8 + [SampleShape(1, 480, 832)] * 16, Layout.for_world(1, 1),
                               micro_steps_per_step=1, gpu_mem_gib=139.8, model_name="wan2.1-1.3b", zero_stage=3,
                               profile_log=notes.append, ln_modulate="fused", block_fusion=block_fusion)


def test_the_sampler_plans_with_the_variant_and_checkpoints_fewer_blocks(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(ac.ship_variant(_raw(), _fused_calibration(scale_mem=0.85))))
    notes_off, notes_on = [], []
    off = _sampler(str(path), "off", notes_off)
    on = _sampler(str(path), "regions", notes_on)
    assert off.cost.profile.block_fusion == "off" and on.cost.profile.block_fusion == "regions"
    assert not any("block fusion" in n for n in notes_off)
    assert sum("block_fusion_variants.regions" in n for n in notes_on) == 1
    m_mem = off.params.m_mem
    assert on.params.m_mem == pytest.approx(m_mem)
    from ds_adaptive.planning.memory import checkpoint_blocks

    n_off = int(checkpoint_blocks(off.cost, LONG, 1, m_mem))
    n_on = int(checkpoint_blocks(on.cost, LONG, 1, m_mem))
    assert 0 < n_on < n_off
    # the sampler state carries the profile it planned with (a resume re-plans with the same entries)
    assert on.state_dict(0)["segments"][-1]["profile"]["block_fusion"] == "regions"
    assert "block_fusion" not in off.state_dict(0)["segments"][-1]["profile"]


def test_the_planner_plans_for_fusion_only_where_it_can_run(monkeypatch):
    import importlib.util

    from ds_adaptive.training.assemble import planned_block_fusion

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert planned_block_fusion("regions", "cuda") == "off" and planned_block_fusion("rope", "meta") == "off"
    assert planned_block_fusion("regions", "cpu") == "regions" and planned_block_fusion("off", "cuda") == "off"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else real(name, *a))
    assert planned_block_fusion("regions", "cuda") == "regions"


def test_a_fusion_fallback_after_a_fused_plan_stops_with_one_line():
    from ds_adaptive.training.warmups import warm_block_fusion

    def warm(planned, fallback):
        fusion = types.SimpleNamespace(mode="regions", fallback=fallback, before_step=lambda *a: None)
        profile = types.SimpleNamespace(block_fusion=planned, name="p")
        sampler = types.SimpleNamespace(plan=None, cost=types.SimpleNamespace(profile=profile))
        warm_block_fusion(fusion, sampler, sp=1, epoch=0, pin_memory=False)

    warm("regions", None)       # compiled: fine
    warm("off", "no triton")    # eager, planned eager: fine (the warm-up warned)
    with pytest.raises(ConfigError, match=r"could not compile here, but the plan counts its smaller activations.*"
                                          r"set adaptive_load.block_fusion to 'off'"):
        warm("regions", "no triton")


def test_calibrate_measures_with_block_fusion_compiled_for_every_point_and_records_it(monkeypatch):
    from ds_adaptive.models.family import BlockFusionUnavailable
    from ds_adaptive.models.wan import WanModel

    calls = []
    monkeypatch.setattr(WanModel, "apply_block_fusion", lambda self, mode: calls.append(("apply", mode)))
    monkeypatch.setattr(WanModel, "warm_up_block_fusion",
                        lambda self, pairs, **kw: calls.append(("warm", list(pairs), kw["per_token"])) or 0.0)
    shapes = [SampleShape(1, 64, 64), SampleShape(5, 64, 96)]
    sizes = {shapes[0].tokens: [1, 3], shapes[1].tokens: [2]}
    rows, _ = calibrate.measure("tiny", layers=[1], shapes=shapes, batch_sizes=sizes, sp=1, device_name="cpu",
                                dtype_name="fp32", warmup=0, iters=1, gradient_checkpointing=False, overrides={},
                                log=lambda *a: None, block_fusion="regions")
    assert len(rows) == 3
    want = sorted({(1, shapes[0].tokens), (3, shapes[0].tokens), (2, shapes[1].tokens)})
    assert calls[0] == ("apply", "regions") and calls[1][:2] == ("warm", want)
    prof = profile_json.profile_from_rows(rows * 2, model_name="tiny", overrides={}, layers=[1], sp=1, device_name="cpu",
                                       gpu_mem_gib=16.0, dtype="fp32", ln_modulate="reference", name="t", source="",
                                       wall_s=0.0, block_fusion="regions")
    assert prof["block_fusion"] == "regions"

    def unavailable(self, pairs, **kw):
        raise BlockFusionUnavailable("no C++ compiler")

    monkeypatch.setattr(WanModel, "warm_up_block_fusion", unavailable)
    with pytest.raises(SystemExit, match=r"--block-fusion regions could not compile on this machine \(no C\+\+ "):
        calibrate.measure("tiny", layers=[1], shapes=shapes[:1], batch_sizes=sizes, sp=1, device_name="cpu",
                          dtype_name="fp32", warmup=0, iters=1, gradient_checkpointing=False, overrides={},
                          log=lambda *a: None, block_fusion="regions")
    assert calibrate_cli.build_parser().parse_args(["--model", "tiny", "--out", "x.json", "--block-fusion", "rope"]
                                               ).block_fusion == "rope"


def test_the_start_up_calibration_measures_with_the_runs_block_fusion(tmp_path, monkeypatch):
    import torch

    key = ac.cache_key("cpu", "tiny", "reference")
    assert "block_fusion" not in key and ac.cache_key("cpu", "tiny", "reference", "off") == key   # old entries stay valid
    fused_key = ac.cache_key("cpu", "tiny", "reference", "regions")
    assert fused_key["block_fusion"] == "regions"
    assert "-regions-" in ac.cache_path(tmp_path, fused_key).name and ac.cache_path(tmp_path, key) != ac.cache_path(
        tmp_path, fused_key)
    seen = {}

    def fake(model_name, **kw):
        seen.update(kw)
        prof = _raw()
        prof.update(block_fusion=kw["block_fusion"], cache_key=ac.cache_key("cpu", model_name, kw["ln_modulate"],
                                                                              kw["block_fusion"]), wall_s=1.0)
        return prof

    monkeypatch.setattr(ac, "quick_calibrate", fake)
    notes: list = []
    prof = ac.startup_profile("calibrate", model_name="tiny", ln_modulate="reference", device=torch.device("cpu"),
                              cache=str(tmp_path), notes=notes, block_fusion="regions")
    assert seen["block_fusion"] == "regions" and prof.block_fusion == "regions"
    assert "block fusion regions" in notes[0]
    files = list((tmp_path / "profiles").glob("*-regions-*.json"))
    assert len(files) == 1


def test_a_start_up_calibration_whose_fusion_cannot_compile_fails_cleanly(monkeypatch):
    import torch

    def no_compile(*a, **kw):
        raise SystemExit("calibrate: --block-fusion regions could not compile on this machine (no triton)")

    monkeypatch.setattr(calibrate, "measure", no_compile)
    with pytest.raises(ac.CalibrationFailed, match="could not compile"):
        ac.quick_calibrate("tiny", device=torch.device("cpu"), ln_modulate="reference", block_fusion="regions",
                           progress=False)
