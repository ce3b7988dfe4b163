"""Multi-process LoRA runs (ds_adaptive.training.lora): a 2-rank ZeRO-3 LoRA run from --init-from resumes exactly from
an adapter-only checkpoint, its adapters export to diffusers and merge, LoRA trains under Ulysses SP with its
preview, and with sparse attention. The single-process LoRA checks are in tests/unit/training/test_lora.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("peft", reason="LoRA needs peft (pip install 'ds_adaptive[lora]')")

from conftest import ROOT, launch_ranks  # noqa: E402
from ds_adaptive.models.testing import random_init_  # noqa: E402
from ds_adaptive.models.wan import WanModel  # noqa: E402
from ds_adaptive.models.wan_config import get_wan_config  # noqa: E402
from ds_adaptive.training.lora import LORA_FILE, load_adapters, read_lora_file  # noqa: E402
from test_lora import CFG, _inputs  # noqa: E402


def _config(tmp_path, **preview) -> Path:
    raw = json.loads((ROOT / "launch" / "configs" / "cpu_tiny.json").read_text())
    raw["adaptive_load"]["sampler"]["shapes"] = str(ROOT / "launch" / "configs" / "shapes_cpu.json")
    raw["adaptive_load"]["lora"] = {"enabled": True, "rank": 4, "alpha": 8, "dropout": 0.1}
    raw["adaptive_load"]["preview"] = {"enabled": True, "interval": 2, "steps": 2, "num_prompts": 2,
                                       "guidance_scale": 2.0, **preview}
    p = tmp_path / "lora.json"
    p.write_text(json.dumps(raw))
    return p


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """A diffusers-saved random tiny Wan (non-zero head) as --init-from; 4 LoRA steps on 2 ZeRO-3 ranks with
    previews, saving at step 2; then a resume from step 2."""
    tmp = tmp_path_factory.mktemp("lora")
    base = random_init_(WanModel(get_wan_config("tiny")), seed=9)
    from ds_adaptive.models.weights import save_wan_weights

    save_wan_weights(base, tmp / "base", layout="diffusers")
    cfg = _config(tmp)
    common = ["-m", "ds_adaptive.cli.train", "--deepspeed_config", str(cfg), "--num-samples", "200", "--seed", "4",
              "--steps", "4", "--init-from", "base"]
    env = {"PYTHONPATH": str(ROOT)}
    launch_ranks(common + ["--log-dir", "straight", "--save", "ckpt", "--save-interval", "2"], 2, cwd=tmp, env=env)
    launch_ranks(common + ["--log-dir", "resumed", "--resume", "ckpt/global_step2"], 2, cwd=tmp, env=env)
    return tmp


@pytest.mark.slow
def test_lora_zero3_resume_is_exact_and_checkpoints_hold_adapters_only(lora_runs):
    tmp = lora_runs
    straight = json.loads((tmp / "straight" / "summary.json").read_text())
    resumed = json.loads((tmp / "resumed" / "summary.json").read_text())
    assert straight["lora"]["rank"] == 4 and straight["lora"]["adapter_params"] > 0
    assert resumed["losses"] == pytest.approx(straight["losses"][2:], rel=1e-6, abs=1e-7)
    # the previews of step 4 (same adapters, same seeds) are the same bytes
    assert sorted(p.name for p in (tmp / "straight" / "previews").iterdir()) == [
        "step0000002_sample0.png", "step0000002_sample1.png", "step0000004_sample0.png", "step0000004_sample1.png"]
    a, b = (tmp / d / "previews" / "step0000004_sample1.png" for d in ("straight", "resumed"))
    assert a.read_bytes() == b.read_bytes()
    rec = [json.loads(x) for x in (tmp / "straight" / "previews.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rec] == [2, 4] and rec[0]["batch_cfg"] in (True, False)
    ck = tmp / "ckpt" / "global_step4"
    states = torch.load(next(ck.glob("*rank_0_*model_states.pt")), map_location="cpu", weights_only=False)
    assert states["module"] and all(".lora_" in k for k in states["module"])
    assert states.get("frozen_param_fragments") is None
    assert states["ds_adaptive"]["lora"]["base"]["init_from"] == "base"
    total = sum(f.stat().st_size for f in ck.iterdir())
    assert total < 1_000_000   # adapters + Adam state; the frozen 1.1M-parameter base would be 4.4 MB alone


@pytest.mark.slow
def test_trained_adapters_export_to_diffusers_and_merge(lora_runs, capsys, monkeypatch):
    diffusers = pytest.importorskip("diffusers")
    from ds_adaptive.cli.export import main as export_main
    from ds_adaptive.models.weights import load_pretrained

    tmp = lora_runs
    monkeypatch.chdir(tmp)   # the checkpoint records --init-from base (relative to the run's directory)
    assert export_main(["ckpt", "--lora", "--to", "exp_lora"]) == 0
    assert export_main(["ckpt", "--to", "exp_merged"]) == 0
    out = capsys.readouterr().out
    assert "LoRA adapters" in out and "WanTransformer3DModel" in out
    pairs, scale = read_lora_file(tmp / "exp_lora" / LORA_FILE, spec="tiny")
    assert scale == 1.0 and any(float(b.abs().max()) > 0 for _, b in pairs.values())  # trained: lora_B moved
    meta = json.loads(__import__("safetensors").safe_open(str(tmp / "exp_lora" / LORA_FILE), "pt").metadata()
                      ["ds_adaptive"])
    assert meta["rank"] == 4 and meta["alpha"] == 8 and meta["step"] == 4 and meta["scale_folded"]

    ours = load_pretrained(tmp / "base")
    load_adapters(ours, pairs, scale=scale)
    twin = diffusers.WanTransformer3DModel.from_pretrained(str(tmp / "base")).eval()
    twin.load_lora_adapter(str(tmp / "exp_lora" / LORA_FILE), prefix="transformer")
    merged = diffusers.WanTransformer3DModel.from_pretrained(str(tmp / "exp_merged")).eval()
    x, t, c = _inputs()
    with torch.no_grad():
        a = ours.eval()(x, t, c)
        torch.testing.assert_close(twin(x, t, c, return_dict=False)[0], a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(x, t, c, return_dict=False)[0], a, rtol=1e-5, atol=1e-5)

    # `ds-adaptive sample` from the checkpoint (ZeRO shards + base + adapters) draws what the merged export draws
    from ds_adaptive.training.preview import save_embeddings
    from ds_adaptive.cli.sample import main as sample_main

    save_embeddings({"p": torch.randn(6, CFG.text_dim)}, tmp / "p.safetensors")
    common = ["--embeddings", "p.safetensors", "--frames", "5", "--height", "32", "--width", "32", "--steps", "2",
              "--device", "cpu"]
    assert sample_main(["ckpt", *common, "--out", "from_ckpt.png"]) == 0
    assert sample_main(["exp_merged", *common, "--out", "from_export.png"]) == 0
    assert (tmp / "from_ckpt.png").read_bytes() == (tmp / "from_export.png").read_bytes()

    # without the base there is nothing to merge into: one message
    (tmp / "base").rename(tmp / "base_moved")
    try:
        assert export_main(["ckpt", "--to", "exp2"]) == 2
        assert "--init-from base, which does not exist here; pass --base" in capsys.readouterr().err
        assert export_main(["ckpt", "--to", "exp2", "--base", "base_moved"]) == 0
    finally:
        (tmp / "base_moved").rename(tmp / "base")


@pytest.mark.slow
def test_lora_under_ulysses_sp_and_its_preview(tmp_path):
    """sp=2 (both ranks one Ulysses group) + ZeRO-3 + LoRA: the adapters train, and the preview the SP group
    generates after step 3 is what the checkpoint of step 3 draws in one process (the warm-up schedule of
    cpu_tiny.json gives steps 1 and 2 learning rate 0)."""
    from PIL import Image

    from ds_adaptive.data import build_dataset
    from ds_adaptive.models.flow_sampler import euler_sample, initial_noise
    from ds_adaptive.media.write import latent_strip
    from ds_adaptive.models.weights import save_wan_weights
    from ds_adaptive.models.objective import sample_seed
    from ds_adaptive.cli.export import main as export_main
    from ds_adaptive.inference.sample import load_model

    save_wan_weights(random_init_(WanModel(get_wan_config("tiny")), seed=9), tmp_path / "base", layout="diffusers")
    cfg = _config(tmp_path, interval=3, num_prompts=1, guidance_scale=1.0, steps=3)
    launch_ranks(["-m", "ds_adaptive.cli.train", "--deepspeed_config", str(cfg), "--num-samples", "60", "--seed", "2",
                  "--steps", "3", "--sp", "2", "--init-from", "base", "--log-dir", "sp2", "--save", "ckpt"], 2,
                 cwd=tmp_path, env={"PYTHONPATH": str(ROOT)})
    summary = json.loads((tmp_path / "sp2" / "summary.json").read_text())
    assert summary["sp"] == 2 and summary["lora"]["rank"] == 4
    assert export_main([str(tmp_path / "ckpt"), "--lora", "--to", str(tmp_path / "exp")]) == 0
    pairs, _ = read_lora_file(tmp_path / "exp" / LORA_FILE, spec="tiny")
    assert any(float(b.abs().max()) > 0 for _, b in pairs.values())   # the step moved lora_B under SP

    ds = build_dataset("synthetic", num_samples=60, shapes=str(ROOT / "launch" / "configs" / "shapes_cpu.json"), seed=2)
    shape, ctx = ds.sample_shapes()[0], ds[0]["context"]
    model, _ = load_model(str(tmp_path / "ckpt"), base=str(tmp_path / "base"))
    x0 = euler_sample(model, initial_noise(shape.latent_shape, sample_seed(0, 0, 0)),
                      torch.nn.functional.pad(ctx, (0, 0, 0, 512 - ctx.shape[0]))[None], steps=3, shift=5.0)
    got = np.asarray(Image.open(tmp_path / "sp2" / "previews" / "step0000003_sample0.png")).astype(int)
    diff = np.abs(got - latent_strip(x0[0]).astype(int))
    assert diff.max() <= 2 and diff.mean() < 0.05


@pytest.mark.slow
def test_lora_with_sparse_attention_and_previews(tmp_path):
    """LoRA + DSV sparse attention (reference backend) + previews in one process: stage 2 runs sparse layers, the
    previews of a sparse model are written, the losses stay finite."""
    from ds_adaptive.models.weights import save_wan_weights

    save_wan_weights(random_init_(WanModel(get_wan_config("tiny")), seed=9), tmp_path / "base", layout="diffusers")
    cfg = json.loads(_config(tmp_path, interval=2, num_prompts=1).read_text())
    cfg["adaptive_load"]["fused_ln_modulate"] = False
    cfg["adaptive_load"]["sparse_attention"] = {
        "enabled": True, "block_size": 32, "cube": [1, 4, 8], "backend": "reference", "warmup_steps": 2,
        "dense_layers": [], "layer_density_threshold": 1.0, "dense_above": 1.0, "profile_interval": 1, "sample_rows": 32}
    (tmp_path / "sparse.json").write_text(json.dumps(cfg))
    launch_ranks(["-m", "ds_adaptive.cli.train", "--deepspeed_config", "sparse.json", "--num-samples", "60", "--seed", "2",
                  "--steps", "4", "--init-from", "base", "--log-dir", "run"], 1, cwd=tmp_path, env={"PYTHONPATH": str(ROOT)})
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["sparse_attention"]["sparse_layers"] >= 1 and s["preview"]["rounds"] == 2
    assert all(np.isfinite(s["losses"])) and s["lora"]["rank"] == 4
    assert (tmp_path / "run" / "previews" / "step0000004_sample0.png").is_file()
