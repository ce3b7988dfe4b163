"""Guards bench/training/ulysses_gpu.py (the GPU check the lead runs) on 2 CPU ranks: perf table, fp32-referenced SP check, JSON."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import ROOT, launch_ranks

pytest.importorskip("deepspeed", reason="DeepSpeed's DistributedAttention is needed")


@pytest.mark.slow
def test_bench_runs_on_cpu_and_checks_sp(tmp_path: Path) -> None:
    out = tmp_path / "ulysses.json"
    env = {"PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": os.environ.get(
        "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))}
    # perf shape 9x64x112 -> 3x4x7 = 84 tokens; check shape 9x48x80 -> 3x3x5 = 45 tokens (padded to 46)
    results = launch_ranks([str(ROOT / "bench" / "training" / "ulysses_gpu.py"), "--device", "cpu", "--model", "tiny",
                            "--frames", "9", "--height", "64", "--width", "112", "--check-shape", "9x48x80",
                            "--out", str(out)], 2, cwd=tmp_path, timeout=180, env=env)
    text = results[0].stdout
    assert "correctness: PASS" in text, text[-3000:]
    r = json.loads(out.read_text())
    assert r["world"] == 2 and r["sp_degrees"] == [1, 2] and r["tokens"] == 84
    assert [p["sp"] for p in r["perf"]] == [1, 2]
    assert [p["tokens_per_rank"] for p in r["perf"]] == [84, 42]
    assert all(p["step_s"] > 0 for p in r["perf"]) and r["perf"][0]["step_ratio_vs_sp1"] == 1.0
    assert r["perf"][0]["peak_gib"] is None  # no CUDA memory statistics on CPU
    sp2 = r["check"]["per_sp"][1]
    assert r["check"]["tokens"] == 45 and sp2["sp"] == 2 and sp2["padded"] == 46 and sp2["ok"]
    assert sp2["grad_rel_err_vs_fp32"] < 0.05 and r["check_big"]["per_sp"][0]["ok"]
    assert r["check_ok"] is True and r["nccl_nvls_enable"] == "0"
