"""Guards hybrid context parallelism in the CPU trainer (gloo, the tiny model's 2 heads): sequence-wise sparse
attention at SP = 2 and at SP = 4 (beyond the head count: the dense layer on a 2 x 2 mesh) trains like Ulysses
at SP = 2 (the same losses within 1e-5 over 10 steps), `auto` too, and a resumed run continues exactly."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import launch_ranks

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "launch" / "configs"
STEPS = 10


def _config(tmp: Path, mode: str) -> Path:
    cfg = json.loads((CONFIGS / "cpu_tiny.json").read_text())
    cfg["adaptive_load"]["fused_ln_modulate"] = False
    shapes = json.loads((CONFIGS / "shapes_cpu.json").read_text())["shapes"]
    cfg["adaptive_load"]["sampler"].update(   # a fixed plan: every run trains the same micro-batches
        shapes=str(CONFIGS / "shapes_cpu.json"), mode="fixed", m_mem=2.0,
        fixed_batch_sizes={f"{s['frames']}x{s['height']}x{s['width']}": 2 for s in shapes})
    cfg["adaptive_load"]["sparse_attention"] = {"enabled": True, "block_size": 32, "cube": [1, 4, 8],
                                                "backend": "reference", "forced_density": 0.5, "dense_layers": [0],
                                                "context_parallel": mode}
    path = tmp / f"{mode}.json"
    path.write_text(json.dumps(cfg))
    return path


def _train(tmp: Path, mode: str, sp: int, log: str, *extra: str) -> dict:
    argv = ["-m", "ds_adaptive.cli.train", "--deepspeed_config", str(_config(tmp, mode)), "--num-samples", "40",
            "--seed", "1", "--grad-ckpt", "--sp", str(sp), "--log-dir", log, *extra]
    launch_ranks(argv, sp, cwd=tmp, timeout=300)
    return json.loads((tmp / log / "summary.json").read_text())


@pytest.fixture(scope="module")
def ulysses(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("cp_ulysses")
    return _train(tmp, "heads", 2, "ulysses", "--steps", str(STEPS))


def _same_run(got: dict, ref: dict, steps: int = STEPS) -> None:
    assert got["samples"] == ref["samples"] or steps < STEPS
    assert len(got["losses"]) == steps
    assert got["losses"] == pytest.approx(ref["losses"][:steps], rel=1e-5)


@pytest.mark.slow
def test_sequence_wise_sp4_beyond_the_heads_trains_like_ulysses(tmp_path, ulysses) -> None:
    run = _train(tmp_path, "sequence", 4, "seq4", "--steps", str(STEPS))
    _same_run(run, ulysses)
    cp = run["sparse_attention"]["context_parallel"]
    assert cp["mode"] == "sequence"
    dense, sparse = cp["last_step_bytes"]["0"], cp["last_step_bytes"]["1"]
    assert "heads" in dense and "kv" in dense      # the dense layer: 2 x 2 (the heads allow h = 2), all KV fetched
    assert "heads" not in sparse and "scores" in sparse and "kv_grad" in sparse   # the sparse layer: 1 x 4


@pytest.mark.slow
def test_sequence_wise_sp2_trains_like_ulysses(tmp_path, ulysses) -> None:
    run = _train(tmp_path, "sequence", 2, "seq2", "--steps", str(STEPS))
    _same_run(run, ulysses)
    assert "heads" not in run["sparse_attention"]["context_parallel"]["last_step_bytes"]["1"]


@pytest.mark.slow
def test_auto_sp4_trains_like_ulysses_and_resumes_exactly(tmp_path, ulysses) -> None:
    straight = _train(tmp_path, "auto", 4, "straight", "--steps", "4", "--save", "ckpt", "--save-interval", "2")
    _same_run(straight, ulysses, steps=4)
    resumed = _train(tmp_path, "auto", 4, "resumed", "--steps", "4", "--resume", "ckpt/global_step2")
    assert resumed["first_step"] == 3 and resumed["losses"] == straight["losses"][2:]
