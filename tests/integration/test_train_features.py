"""Guards what a run keeps besides its weights, in the tiny 2-rank ZeRO-3 CPU job with all three on (EMA, caption
dropout, validation): a resume is bit-identical to the straight run (losses, EMA slices, validation losses, dropped
captions), the memory model's EMA term is what the ranks allocate, ``export --ema`` loads in diffusers and equals the
EMA, ``sample --ema`` reads it, and the run's PNG is written."""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import CONFIGS

pytest.importorskip("deepspeed")

FEATURES = {"ema": {"decay": 0.9}, "caption_dropout": {"rate": 0.3},
            "validation": {"samples": 12, "every": 2, "timesteps": 2}}


def _argv(*args: str) -> list[str]:
    return ["-m", "ds_adaptive.cli.train", "--deepspeed_config", "feat.json", "--num-samples", "200", "--seed", "3",
            *args]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A: steps 1-2 (saved); B: resumed from A to step 4; C: steps 1-4 straight. Two ranks each."""
    from conftest import launch_ranks

    tmp = tmp_path_factory.mktemp("features")
    cfg = json.loads((CONFIGS / "cpu_tiny.json").read_text())
    cfg["adaptive_load"]["sampler"]["shapes"] = str(CONFIGS / "shapes_cpu.json")
    cfg["adaptive_load"].update(FEATURES)
    (tmp / "feat.json").write_text(json.dumps(cfg))
    launch_ranks(_argv("--steps", "2", "--log-dir", "a", "--save", "ckpt_a"), 2, cwd=tmp)
    launch_ranks(_argv("--steps", "4", "--log-dir", "b", "--resume", "ckpt_a", "--save", "ckpt_b"), 2, cwd=tmp)
    launch_ranks(_argv("--steps", "4", "--log-dir", "c", "--save", "ckpt_c"), 2, cwd=tmp)
    return tmp, {k: json.loads((tmp / k / "summary.json").read_text()) for k in "abc"}


@pytest.mark.slow
def test_resume_with_all_three_is_bit_identical(runs):
    tmp, s = runs
    a, b, c = s["a"], s["b"], s["c"]
    assert b["first_step"] == 3 and b["losses"] == c["losses"][2:]          # exact, not approximately
    for rank in (0, 1):
        straight = torch.load(tmp / "ckpt_c" / "global_step4" / f"ema_rank{rank:05d}.pt", weights_only=True)
        resumed = torch.load(tmp / "ckpt_b" / "global_step4" / f"ema_rank{rank:05d}.pt", weights_only=True)
        assert straight["part"] == rank and straight["parts"] == 2 and straight["updates"] == resumed["updates"] == 4
        assert straight["tensors"].keys() == resumed["tensors"].keys()
        assert all(torch.equal(straight["tensors"][k], resumed["tensors"][k]) for k in straight["tensors"])
    assert b["validation_loss"] == c["validation_loss"] and b["validation_loss_ema"] == c["validation_loss_ema"]
    assert [r["step"] for r in c["validation"]["rounds"]] == [2, 4]
    assert a["validation"]["rounds"][-1] == c["validation"]["rounds"][0]    # step 2 scored alike in A and C
    cd = {k: s[k]["caption_dropout"] for k in "abc"}
    assert cd["a"]["samples"] + cd["b"]["samples"] == cd["c"]["samples"] == c["samples"]
    assert cd["a"]["dropped"] + cd["b"]["dropped"] == cd["c"]["dropped"]   # the same captions dropped
    n, p = cd["c"]["samples"], 0.3
    assert abs(cd["c"]["dropped"] - n * p) <= 4 * math.sqrt(n * p * (1 - p)) + 1


@pytest.mark.slow
def test_the_memory_model_counts_what_the_ranks_allocate_for_the_ema(runs):
    _, s = runs
    e = s["c"]["ema"]
    assert e["zero3"] and e["parts"] == 2 and e["device"] == "cpu"
    assert e["predicted_bytes_per_rank"] == pytest.approx(e["bytes_per_rank"], rel=0.05)
    assert e["bytes_per_rank"] == pytest.approx(4 * e["numel"] / 2, rel=0.01)


@pytest.mark.slow
def test_the_run_logs_every_step_and_draws_its_png(runs):
    from PIL import Image

    tmp, s = runs
    lines = [json.loads(x) for x in (tmp / "c" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]                         # metrics.jsonl_interval 1
    val = [json.loads(x) for x in (tmp / "c" / "validation.jsonl").read_text().splitlines()]
    assert [r["step"] for r in val] == [2, 4] and all(r["samples"] == 12 and r["rows"] == 24 for r in val)
    with Image.open(tmp / "c" / "run.png") as im:
        assert im.format == "PNG" and im.size[0] > 800


@pytest.mark.slow
def test_export_and_sample_with_ema(runs, capsys):
    from diffusers import WanTransformer3DModel

    from ds_adaptive.cli.export import main as export_main
    from ds_adaptive.inference.sample import load_model
    from ds_adaptive.models.registry import get_model
    from ds_adaptive.training.ema import consolidate

    spec = get_model("tiny")

    def read(path):   # the family's weight adapter reads the diffusers directory
        return spec.weights.load(str(path), config=spec.weights.read_config(str(path)), dtype=torch.float32)

    tmp, _ = runs
    ema = consolidate(tmp / "ckpt_c" / "global_step4")
    assert export_main([str(tmp / "ckpt_c"), "--to", str(tmp / "ema_export"), "--ema"]) == 0
    assert "the EMA weights" in capsys.readouterr().out
    assert export_main([str(tmp / "ckpt_c"), "--to", str(tmp / "trained_export")]) == 0
    ours = read(tmp / "ema_export")
    params = dict(ours.named_parameters())
    assert set(params) == set(ema) and all(torch.equal(params[k].detach(), ema[k]) for k in ema)
    trained = dict(read(tmp / "trained_export").named_parameters())
    assert max(float((trained[k].detach() - ema[k]).abs().max()) for k in ema) > 1e-4   # the EMA, not the last weights
    loaded = WanTransformer3DModel.from_pretrained(str(tmp / "ema_export"))
    cfg = spec.config()
    g = torch.Generator().manual_seed(1)
    x, t, c = torch.randn(1, cfg.in_channels, 2, 8, 8, generator=g), torch.tensor([600.0]), \
        torch.randn(1, 7, cfg.text_dim, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, t, c, return_dict=False)[0], ours(x, t, c), rtol=1e-5, atol=1e-5)
    model, what = load_model(str(tmp / "ckpt_c"), ema=True)
    assert "EMA weights" in what
    assert all(torch.equal(p.detach(), ema[k]) for k, p in model.named_parameters())
