"""Guards the trainer wiring of sparse attention: a CPU run goes stage 1 -> stage 2 and writes sparse.jsonl,
the summary entry and the density PNG; SP=2 trains like SP=1 with sparse layers (gloo)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "launch" / "configs"


def _config(tmp_path: Path, sparse: dict, fixed: bool = False, name: str = "sparse.json",
            recompute: Optional[dict] = None) -> Path:
    cfg = json.loads((CONFIGS / "cpu_tiny.json").read_text())
    if recompute:
        cfg["adaptive_load"]["recompute"] = recompute
    cfg["adaptive_load"]["fused_ln_modulate"] = False
    cfg["adaptive_load"]["sampler"]["shapes"] = str(CONFIGS / "shapes_cpu.json")
    if fixed:
        shapes = json.loads((CONFIGS / "shapes_cpu.json").read_text())["shapes"]
        cfg["adaptive_load"]["sampler"].update(
            mode="fixed", m_mem=2.0, fixed_batch_sizes={f"{s['frames']}x{s['height']}x{s['width']}": 2 for s in shapes})
    cfg["adaptive_load"]["sparse_attention"] = {"enabled": True, "block_size": 32, "cube": [1, 4, 8],
                                                "backend": "reference", **sparse}
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def _argv(*args: str) -> list[str]:
    return ["-m", "ds_adaptive.cli.train", *args]


@pytest.mark.slow
def test_trainer_runs_stage1_then_stage2_with_telemetry(tmp_path, run_ranks) -> None:
    cfg = _config(tmp_path, {"warmup_steps": 2, "dense_layers": [], "layer_density_threshold": 1.0,
                             "dense_above": 1.0, "profile_interval": 1, "sample_rows": 32,
                             "block_score": "lse"})  # the predictor path (the default selection trains none)
    run_ranks(_argv("--deepspeed_config", str(cfg), "--num-samples", "60", "--seed", "2", "--steps", "4",
                    "--log-dir", "run", "--save", "ckpt"), 1, cwd=tmp_path, timeout=240)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    sa = summary["sparse_attention"]
    assert sa["stage"] == 2 and sa["stage2_from_step"] == 2 and sa["sparse_layers"] == 2, sa
    assert 0 < sa["density"] <= 1 and 0 < sa["recall"] <= 1 and sa["predictor_loss"] > 0, sa
    rows = [json.loads(x) for x in (tmp_path / "run" / "sparse.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4] and rows[0]["sparse/stage"] == 2
    from ds_adaptive.core.contracts import load_densities  # issue 15's balancer reads the profiled densities
    dm = load_densities(tmp_path / "run" / "sparse.jsonl")
    assert (dm.num_layers, dm.num_heads, dm.step) == (2, 2, 4) and all(0 < x <= 1 for r in dm.density for x in r)
    assert (tmp_path / "run" / "sparse_density.png").stat().st_size > 1000
    import torch
    state = torch.load(next((tmp_path / "ckpt" / "global_step4").glob("*model_states.pt")), weights_only=False)
    assert state["sparse_attention"]["schedule"]["stage"] == 2


@pytest.mark.slow
def test_sparse_sp2_trains_like_sp1(tmp_path, run_ranks) -> None:
    cfg = _config(tmp_path, {"forced_density": 0.5, "dense_layers": [0]}, fixed=True)
    common = ["--deepspeed_config", str(cfg), "--num-samples", "40", "--seed", "1", "--steps", "2", "--grad-ckpt"]
    run_ranks(_argv(*common, "--sp", "1", "--log-dir", "sp1"), 1, cwd=tmp_path, timeout=240)
    run_ranks(_argv(*common, "--sp", "2", "--log-dir", "sp2"), 2, cwd=tmp_path, timeout=240)
    sp1, sp2 = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("sp1", "sp2"))
    assert sp2["samples"] == sp1["samples"] and sp2["losses"] == pytest.approx(sp1["losses"], rel=1e-4)
    assert sp1["sparse_attention"]["sparse_layers"] == 1 and sp2["sparse_attention"]["sparse_layers"] == 1
    # checkpointed blocks that keep their attention (the dense layer's SDPA; the sparse layer recomputes): same run
    keep = _config(tmp_path, {"forced_density": 0.5, "dense_layers": [0]}, fixed=True, name="keep.json",
                   recompute={"attention": "keep"})
    run_ranks(_argv("--deepspeed_config", str(keep), *common[2:], "--sp", "2", "--log-dir", "sp2keep"), 2,
              cwd=tmp_path, timeout=240)
    sp2keep = json.loads((tmp_path / "sp2keep" / "summary.json").read_text())
    assert sp2keep["samples"] == sp1["samples"] and sp2keep["losses"] == pytest.approx(sp1["losses"], rel=1e-4)
