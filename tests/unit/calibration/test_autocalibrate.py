"""Guards self-calibration on first use (ds_adaptive/calibration/autocalibrate.py): when it calibrates and why,
the cache (location, key, stale entries), the fallback when a calibration fails, the dry run's report, and shipping a
calibration as a profile's other path. The 2-rank check (rank 0 calibrates once, every rank plans with the same
profile, the second run reads the cache) is in tests/integration/test_autocalibrate_launch.py."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import CONFIGS
from ds_adaptive.calibration import autocalibrate as ac
from ds_adaptive.cli import autocalibrate as ac_cli
from ds_adaptive.planning.profile import PROFILES_DIR, Profile

H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"


def test_when_it_calibrates():
    reason = ac.calibration_reason
    assert reason("calibrate", "tiny", "cpu", "reference") == "sampler.profile is 'calibrate'"
    assert reason("auto", "wan2.1-1.3b", None, "fused") is None                  # no GPU: the H100 profile, as before
    assert reason("h100-wan2.1-1.3b", "wan2.1-1.3b", H100, "fused") is None      # a named profile is used as given
    assert reason("auto", "wan2.1-1.3b", H100, "reference") is None              # shipped, measured on that path
    assert "calibrated with the reference LayerNorm-modulate path" in reason("auto", "wan2.1-1.3b", H100, "fused")
    assert reason("auto", "wan2.1-1.3b", H200, "fused") is None                  # shipped on the fused path ...
    assert reason("auto", "wan2.1-1.3b", H200, "reference") is None              # ... with a reference variant
    assert "no shipped profile for GPU 'NVIDIA L40S'" in reason("auto", "wan2.1-1.3b", "NVIDIA L40S", "fused")
    assert "model 'tiny'" in reason("auto", "tiny", H200, "fused")


def test_cache_location_and_key(tmp_path):
    env = {ac.CACHE_ENV: str(tmp_path / "env"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert ac.cache_dir(str(tmp_path / "cfg"), env) == tmp_path / "cfg" / "profiles"     # the config first
    assert ac.cache_dir(None, env) == tmp_path / "env" / "profiles"
    assert ac.cache_dir(None, {"XDG_CACHE_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg" / "ds_adaptive" / "profiles"
    key = ac.cache_key(H100, "wan2.1-1.3b", "fused")
    assert key["torch"] == torch.__version__ and key["protocol"] == ac.PROTOCOL_VERSION
    path = ac.cache_path(tmp_path, key)
    assert path == ac.cache_path(tmp_path, dict(key)) and path.name.startswith("NVIDIA_H100_80GB_HBM3-wan2.1-1.3b-fused-")
    assert ac.cache_path(tmp_path, {**key, "torch": "0.0"}) != path        # another torch: another entry
    assert ac.cache_path(tmp_path, {**key, "ln_modulate": "reference"}) != path


def test_quick_protocol_is_bounded():
    gpu = ac.quick_protocol("wan2.1-1.3b", "cuda")
    assert gpu.layers == (2, 4) and gpu.budget_s <= 90 and gpu.warmup + gpu.iters <= 4
    assert max(s.tokens for s in gpu.shapes) == 75600 and min(s.tokens for s in gpu.shapes) == 1560
    fitted = [s.tokens * b for s in gpu.shapes for b in gpu.batch_sizes.get(s.tokens, (1,)) if s.tokens * b >= 8192]
    assert len(fitted) >= 5   # enough saturated points for c0 + a S + b S^2
    assert ac.quick_protocol("wan2.1-14b", "cuda").layers == (1, 2)
    assert ac.quick_protocol("tiny", "cpu").dtype == "fp32"


def _calibrate(tmp_path, **kw):
    notes: list = []
    prof = ac.startup_profile("calibrate", model_name="tiny", ln_modulate="reference", device=torch.device("cpu"),
                              cache=str(tmp_path), notes=notes, **kw)
    return prof, notes


def test_first_use_calibrates_and_caches_then_reads_the_cache(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    prof, notes = _calibrate(tmp_path)
    assert isinstance(prof, Profile) and prof.raw["model"]["name"] == "tiny" and prof.c0_ms > 0
    assert len(notes) == 1 and notes[0].startswith("profile: calibrated at start-up in ")
    files = list((tmp_path / "profiles").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["cache_key"]["device"] == "cpu"

    def never(*a, **k):
        raise AssertionError("calibrated although the cache holds the entry")

    monkeypatch.setattr(ac, "quick_calibrate", never)
    again, notes2 = _calibrate(tmp_path)
    assert again == prof and "start-up calibration cached" in notes2[0] and str(files[0]) in notes2[0]
    # a stale entry (another protocol) is not used: the run calibrates again
    data = json.loads(files[0].read_text())
    data["cache_key"]["protocol"] = -1
    files[0].write_text(json.dumps(data))
    stale, notes3 = _calibrate(tmp_path)
    assert stale is None and "calibrated although" in notes3[0]   # it tried (and rank 0's error became a warning)


def test_a_failed_calibration_falls_back_with_a_warning(tmp_path, monkeypatch):
    def fails(*a, **k):
        raise ac.CalibrationFailed("the fit's max |rel err| 35.3% is over the quality bar 10%")

    monkeypatch.setattr(ac, "quick_calibrate", fails)
    prof, notes = _calibrate(tmp_path)
    assert prof is None and notes[0].startswith("warning: start-up calibration of tiny on cpu failed (the fit's")
    assert not (tmp_path / "profiles").exists() or not list((tmp_path / "profiles").glob("*.json"))


def test_the_dry_run_says_what_would_happen(tmp_path):
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig

    cfg = RunConfig.load(str(CONFIGS / "zero3_adaptive.json"), trainer={"model": "wan2.1-1.3b", "num_samples": 200})
    cfg.adaptive_load.sampler.profile = "calibrate"
    cfg.adaptive_load.sampler.profile_cache = str(tmp_path)
    run = build_run(cfg, layout=Layout.for_world(8, 1), meta=True, gpu_mem_gib=79.2)
    if torch.cuda.is_available():   # pragma: no cover - a GPU machine reports its own decision
        pytest.skip("this check is for a machine without a GPU")
    assert any(n.startswith("profile: sampler.profile is 'calibrate': rank 0 of the GPU job calibrates at start-up")
               and str(tmp_path) in n for n in run.notes), run.notes
    assert run.profile.name == "h100-wan2.1-1.3b"   # the fallback plans the check
    assert not (tmp_path / "profiles").exists()       # a dry run never calibrates


def test_ship_a_calibration_as_the_profiles_other_path(tmp_path):
    base = json.loads((PROFILES_DIR / "h100-wan2.1-1.3b.json").read_text())
    cal = json.loads((PROFILES_DIR / "h200-wan2.1-1.3b.json").read_text())
    cal.pop("ln_modulate_variants")   # stands in for a fused start-up calibration of the same model
    out = ac.ship_variant(base, cal)
    prof, note = Profile.from_dict(out).for_ln_modulate("fused")
    assert prof.ln_modulate == "fused" and prof.c0_ms == cal["compute"]["c0_ms"] and "ln_modulate_variants.fused" in note
    assert ac.calibration_reason("auto", "wan2.1-1.3b", H100, "fused") is not None   # the shipped json is unchanged
    with pytest.raises(ValueError, match="already has 'fused'"):
        ac.ship_variant(out, cal)
    with pytest.raises(ValueError, match="model 'tiny'"):
        ac.ship_variant(base, {**cal, "model": {**cal["model"], "name": "tiny"}})
    p, c = tmp_path / "p.json", tmp_path / "c.json"
    p.write_text(json.dumps(base))
    c.write_text(json.dumps(cal))
    assert ac_cli.main(["ship", str(c), str(p)]) == 0 and "fused" in json.loads(p.read_text())["ln_modulate_variants"]
    assert ac_cli.main(["ship", str(c), str(p)]) == 2
