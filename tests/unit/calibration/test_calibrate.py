"""`ds-adaptive calibrate`: end to end on CPU with the tiny Wan model; the shipped profiles are
what --from-block-scaling rebuilds from the measured block data."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_adaptive.calibration import calibrate
from ds_adaptive.cli import calibrate as calibrate_cli
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import load_profile

# Per-block H100 timings of Wan 1.3B/14B (copied from the project's shared/data, so CI has it).
BLOCK_DATA = Path(__file__).resolve().parents[2] / "data" / "h100_block_scaling.json"


def test_cpu_tiny_end_to_end(tmp_path, capsys):
    pytest.importorskip("torch")
    import ds_adaptive.models.wan  # noqa: F401  -- our own module: an ImportError is a failure, not a skip
    out = tmp_path / "tiny.json"
    rc = calibrate_cli.main(["--model", "tiny", "--device", "cpu", "--layers", "1,2", "--lengths",
                         "1x64x64,1x128x128,5x64x64,9x64x64", "--batch-sizes", "16:1,2;64:1,2",
                         "--warmup", "1", "--iters", "1", "--min-fit-tokens", "0", "--accept-poor-fit",
                         "--no-checkpoint-memory", "--out", str(out)])
    assert rc == 0
    prof = json.loads(out.read_text())
    assert prof["device"] == "cpu" and prof["model"]["name"] == "tiny" and prof["sp"] == 1
    assert {"torch", "date", "compute", "memory", "static_memory", "measurements", "comm"} <= set(prof)
    raw = prof["measurements"]["raw"]
    assert {r["layers"] for r in raw} == {1, 2} and len(raw) == 2 * 6
    assert len(prof["measurements"]["full_model"]) == 6
    c = prof["compute"]
    assert min(c["c0_ms"], c["a_ms_per_token"], c["b_ms_per_token2"]) >= 0
    assert "max_rel_err" in c["fit"] and len(c["fit"]["points"]) == 6
    cm = CostModel(str(out))                      # the written profile is usable
    assert cm.batch_cost(64, 2) > 0
    assert "full-model fit" in capsys.readouterr().out


def test_cpu_tiny_ulysses_emulation(tmp_path):
    pytest.importorskip("torch")
    import ds_adaptive.models.wan  # noqa: F401  -- our own module: an ImportError is a failure, not a skip
    out = tmp_path / "tiny_sp2.json"
    assert calibrate_cli.main(["--model", "tiny", "--device", "cpu", "--sp", "2", "--layers", "1,2", "--lengths",
                           "1x64x64,1x128x128,5x64x64", "--batch-sizes", "64:1", "--warmup", "0", "--iters", "1",
                           "--min-fit-tokens", "0", "--accept-poor-fit", "--no-checkpoint-memory",
                           "--out", str(out)]) == 0
    assert json.loads(out.read_text())["sp"] == 2


def test_ulysses_emulation_shapes():
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 6, 4, 8)
    out = calibrate.UlyssesEmulation(2)(q, q, q)
    assert out.shape == q.shape


def test_block_scaling_profiles_agree_with_the_shipped_calibrations(tmp_path):
    """--from-block-scaling rebuilds profiles from per-block H100 timings (shared/data); the shipped
    profiles are full `ds-adaptive calibrate` runs on an H100. Two independent measurements of the
    same model on the same GPU kind must predict long-sequence batches alike."""
    assert calibrate_cli.main(["--from-block-scaling", str(BLOCK_DATA), "--out", str(tmp_path)]) == 0
    for name in ("h100-wan2.1-1.3b", "h100-wan2.1-14b"):
        new = json.loads((tmp_path / f"{name}.json").read_text())
        assert new["source"].startswith("shared/data/h100_block_scaling.json (per-block, scaled by depth)")
        assert new["compute"]["fit"]["max_rel_err"] < 0.06  # saturated points are fitted within 6%
        rebuilt, shipped = load_profile(new), load_profile(name)
        assert shipped.raw["source"].startswith("ds-adaptive calibrate")
        for s in (14040, 32760, 75600):
            t_rebuilt = rebuilt.c0_ms + rebuilt.a_ms_per_token * s + rebuilt.b_ms_per_token2 * s * s
            t_shipped = shipped.c0_ms + shipped.a_ms_per_token * s + shipped.b_ms_per_token2 * s * s
            assert t_rebuilt == pytest.approx(t_shipped, rel=0.15), (name, s, t_rebuilt, t_shipped)
    p = load_profile("h100-wan2.1-1.3b")
    assert p.static_memory_gib(3, 16) < 5


def test_cuda_requested_without_gpu_is_a_clear_error(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert calibrate_cli.main(["--model", "tiny", "--out", str(tmp_path / "x.json")]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_cost_fit_bench_runs_on_cpu_with_tiny(tmp_path):
    """bench/planner/cost_fit.py, run as a program on the CPU with the tiny model: timed batches, Pearson r, JSON + PNG."""
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    import ds_adaptive.models.wan  # noqa: F401  -- our own module: an ImportError is a failure, not a skip
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"shapes": [{"frames": 1, "height": 64, "width": 64, "weight": 4},
                                             {"frames": 5, "height": 64, "width": 64, "weight": 2},
                                             {"frames": 1, "height": 128, "width": 128, "weight": 1}]}))
    out = tmp_path / "cf"
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, str(root / "bench" / "planner" / "cost_fit.py"), "--device", "cpu", "--model",
                        "tiny", "--layers", "1", "--shapes", str(shapes), "--m-mem", "0.1", "--batches", "4",
                        "--samples", "120", "--warmup", "0", "--iters", "1", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.with_suffix(".json").read_text())
    assert len(res["batches"]) >= 3 and -1 <= res["pearson_r_calibrated"] <= 1
    assert {"pearson_r_tokens", "pearson_r_power", "median_abs_rel_err_after_scale"} <= set(res)
    assert out.with_suffix(".png").stat().st_size > 5000
