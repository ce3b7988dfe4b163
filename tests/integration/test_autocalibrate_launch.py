"""Self-calibration on first use through build_run on 2 gloo ranks with the tiny model on the CPU: the first run
calibrates on rank 0 and writes the cache, the second reads it, and every rank plans with the same profile. The
single-process checks are in tests/unit/calibration/test_autocalibrate.py."""
from __future__ import annotations

import re
import textwrap

import pytest

from conftest import CONFIGS, ROOT, launch_ranks


SCRIPT = textwrap.dedent("""
    import hashlib, json, sys, warnings
    import torch
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from ds_adaptive.training.trainer import init_distributed
    rank, world, device = init_distributed(0)
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig
    cfg = RunConfig.load(sys.argv[1], trainer={"model": "tiny", "num_samples": 48},
                         overrides={"sampler.shapes": sys.argv[2]})
    s = cfg.adaptive_load.sampler
    s.profile, s.cost_model, s.profile_cache = "calibrate", "calibrated", sys.argv[3]
    cfg.adaptive_load.fused_ln_modulate = False
    run = build_run(cfg, layout=Layout.detect(1))
    prof = hashlib.sha256(json.dumps({k: run.profile.raw[k] for k in ("compute", "memory", "device")},
                                     sort_keys=True).encode()).hexdigest()[:16]
    plan = hashlib.sha256(run.sampler.plan.sample_ids.tobytes()).hexdigest()[:16]
    notes = [n for n in run.notes if n.startswith(("profile:", "warning: start-up"))]   # a failed calibration says why
    print(f"RANK {rank} DP {run.layout.dp_size} PROFILE {prof} PLAN {plan} NOTE {notes[0] if notes else None}")
""")


@pytest.mark.slow
def test_two_ranks_calibrate_once_agree_and_reuse_the_cache(tmp_path):
    script = tmp_path / "calib_ranks.py"
    script.write_text(SCRIPT)
    cache = tmp_path / "cache"
    argv = [str(script), str(CONFIGS / "cpu_tiny.json"), str(CONFIGS / "shapes_cpu.json"), str(cache)]

    def job():
        outs = [r.stdout for r in launch_ranks(argv, 2, cwd=tmp_path, timeout=300, env={"PYTHONPATH": str(ROOT)})]
        lines = [re.search(r"RANK (\d) DP (\d) PROFILE (\w+) PLAN (\w+) NOTE (.*)", o) for o in outs]
        assert all(lines), outs
        return [m.groups() for m in lines], outs

    first, outs = job()
    assert [r[0] for r in first] == ["0", "1"] and {r[1] for r in first} == {"2"}
    assert first[0][2:] == first[1][2:]               # same profile, same plan, same note on both ranks
    assert first[0][4].startswith("profile: calibrated at start-up in "), outs[0][-3000:]
    assert "calibrating tiny on cpu" in outs[0] and "calibrating tiny on cpu" not in outs[1]   # rank 0 only
    files = list((cache / "profiles").glob("*.json"))
    assert len(files) == 1
    second, _ = job()
    assert second[0][2:4] == second[1][2:4] == first[0][2:4]   # the cached profile: the same plan as the first run
    assert "start-up calibration cached" in second[0][4] and second[0][4] == second[1][4]
