"""Issue 16b: a profile records the LayerNorm-modulate path it was calibrated with; a run on the other
path uses the profile's matching entries (ln_modulate_variants) or warns once."""
from __future__ import annotations

import copy
import json

import pytest

from ds_adaptive.calibration import calibrate
from ds_adaptive.cli import calibrate as calibrate_cli
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import ProfileError, load_profile
from ds_adaptive.planning.sampler import build_batch_sampler
from ds_adaptive.core.config import SamplerConfig
from ds_adaptive.core.layout import Layout
from ds_adaptive.training.assemble import run_ln_modulate_path
from ds_adaptive.core.shapes import SampleShape


def _raw(name="h100-wan2.1-1.3b"):
    return copy.deepcopy(dict(load_profile(name).raw))


def test_profile_without_the_key_is_reference_and_a_bad_value_is_refused():
    raw = _raw()
    raw.pop("ln_modulate", None)
    assert load_profile(raw).ln_modulate == "reference"
    raw["ln_modulate"] = "triton"
    with pytest.raises(ProfileError, match="ln_modulate.*triton"):
        load_profile(raw)


def test_matching_path_or_unknown_is_the_profile_itself():
    prof = load_profile(_raw())
    assert prof.for_ln_modulate("reference") == (prof, None)
    assert prof.for_ln_modulate(None) == (prof, None)
    with pytest.raises(ValueError, match="ln_modulate"):
        prof.for_ln_modulate("cuda")


def test_other_path_without_variant_warns_with_both_paths_and_the_command():
    prof = load_profile(_raw())
    out, msg = prof.for_ln_modulate("fused")
    assert out is prof
    assert msg.startswith("warning:") and f"'{prof.name}'" in msg
    assert "reference LayerNorm-modulate" in msg and "the fused path" in msg
    assert "ds-adaptive calibrate --model wan2.1-1.3b --ln-modulate fused" in msg


def test_variant_replaces_compute_and_memory():
    raw = _raw("h200-wan2.1-14b")   # its reference-path calibration (a variant since issue 16c), per-block memory
    raw.update(raw.pop("ln_modulate_variants")["reference"], ln_modulate="reference")
    var = {"compute": copy.deepcopy(raw["compute"]), "memory": copy.deepcopy(raw["memory"])}
    var["memory"]["m1_gib_per_token"] *= 0.5
    var["memory"]["checkpointing"]["block_full"]["m1_gib_per_token"] *= 0.5
    var["compute"]["a_ms_per_token"] *= 0.9
    raw["ln_modulate_variants"] = {"fused": var}
    prof = load_profile(raw)
    out, msg = prof.for_ln_modulate("fused")
    assert out.ln_modulate == "fused" and "ln_modulate_variants.fused" in msg and not msg.startswith("warning")
    assert out.m1_gib_per_token == pytest.approx(prof.m1_gib_per_token * 0.5)
    assert out.block_full_gib[1] == pytest.approx(prof.block_full_gib[1] * 0.5)
    assert out.a_ms_per_token == pytest.approx(prof.a_ms_per_token * 0.9)
    assert out.block_ckpt_gib == prof.block_ckpt_gib
    assert out.static_memory_gib(3, 2) == prof.static_memory_gib(3, 2)
    assert "ln_modulate_variants" not in out.raw


@pytest.mark.parametrize("name", ["h200-wan2.1-1.3b", "h200-wan2.1-14b"])
def test_shipped_h200_profile_carries_both_paths_and_the_fused_holds_less(name):
    prof = load_profile(name)
    assert prof.ln_modulate == "fused"
    ref, msg = prof.for_ln_modulate("reference")
    assert ref.ln_modulate == "reference" and "ln_modulate_variants.reference" in msg
    assert ref.block_full_gib[1] > 1.1 * prof.block_full_gib[1]
    s = SampleShape(81, 480, 832)
    fused_gib = CostModel(prof, "calibrated", checkpointing="auto").ckpt_memory(s, 1, 0)
    ref_gib = CostModel(ref, "calibrated", checkpointing="auto").ckpt_memory(s, 1, 0)
    assert ref_gib > 1.1 * fused_gib


def test_sampler_logs_the_mismatch_once_and_plans_with_the_matching_entries():
    shapes = [SampleShape(17, 480, 832)] * 40 + [SampleShape(1, 480, 832)] * 40
    # recompute: the log holds the LayerNorm-modulate path's lines only (auto adds its choice)
    cfg = SamplerConfig(window=16, seed=1, profile="h200-wan2.1-1.3b")
    logs = {}
    samplers = {}
    for path in ("fused", "reference"):
        logs[path] = []
        samplers[path] = build_batch_sampler(cfg, shapes, Layout.explicit(dp_size=1), micro_steps_per_step=1,
                                             gpu_mem_gib=141.0, profile_log=logs[path].append, ln_modulate=path,
                                             recompute={"attention": "recompute"})
    assert logs["fused"] == []
    assert len(logs["reference"]) == 1 and "reference" in logs["reference"][0]
    assert samplers["reference"].cost.profile.ln_modulate == "reference"
    assert samplers["fused"].cost.per_gpu_memory(14040) < samplers["reference"].cost.per_gpu_memory(14040)


def test_run_path_follows_the_config_and_the_env_override(monkeypatch):
    monkeypatch.delenv("DS_ADAPTIVE_LN_MODULATE", raising=False)
    assert run_ln_modulate_path(True) == "fused"
    assert run_ln_modulate_path(False) == "reference"
    assert run_ln_modulate_path(True, "cpu") == "reference"  # the op has no CPU path: the CPU run never says "fused"
    assert run_ln_modulate_path(True, "meta") == "fused"      # the dry run checks a GPU launch
    monkeypatch.setenv("DS_ADAPTIVE_LN_MODULATE", "reference")
    assert run_ln_modulate_path(True) == "reference"


def test_calibrate_resolves_the_path_and_records_it(tmp_path):
    assert calibrate.resolve_ln_modulate("auto", "cpu") == "reference"
    assert calibrate.resolve_ln_modulate("reference", "cuda") == "reference"
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        calibrate.resolve_ln_modulate("fused", "cpu")
    out = tmp_path / "p.json"
    rc = calibrate_cli.main(["--device", "cpu", "--model", "tiny", "--out", str(out), "--lengths", "1x64x64,1x128x128",
                         "--no-checkpoint-memory", "--accept-poor-fit", "--warmup", "0", "--iters", "1"])
    assert rc == 0
    prof = json.loads(out.read_text())
    assert prof["ln_modulate"] == "reference"
    assert load_profile(prof).ln_modulate == "reference"
