"""Guards previews and the sampler: the Euler sampler is the exact inverse of the training objective (and
diffusers' FlowMatchEulerDiscreteScheduler); the preview memory plan drops what does not fit the run's budget and
batches guidance only when everything fits; prompts come from an embeddings file or the dataset; media files are
readable; a preview runs in the tiny CPU trainer job (VAE-decoded mp4 and latent PNG, TensorBoard, a stand-in
wandb module) and writes its files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_adaptive.core.config import ConfigError, PreviewConfig
from ds_adaptive.models.flow_sampler import euler_sample, initial_noise, sigma_schedule
from ds_adaptive.media.write import frame_strip, latent_strip, write_media
from ds_adaptive.models.objective import noisy_inputs
from ds_adaptive.training.preview import PreviewPrompt, load_prompts, plan_previews, preview_memory_gib, save_embeddings
from ds_adaptive.core.shapes import SampleShape

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("steps,shift", [(1, 5.0), (7, 5.0), (4, 3.0), (10, 1.0)])
def test_euler_inverts_the_training_objective(steps, shift):
    """A velocity that is exactly the training target eps - x0 (read off x_t and 1000 * sigma) is integrated
    back to x0 by any number of steps; and the objective's x_t at sigma lies on the sampler's path."""
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(2, 16, 2, 4, 6, generator=g), torch.randn(2, 16, 2, 4, 6, generator=g)

    def oracle(x, t, ctx):
        s = (t / 1000.0).view(-1, 1, 1, 1, 1)
        return (x - x0) / s   # = eps - x0 on the straight path

    out = euler_sample(oracle, eps, torch.zeros(2, 3, 8), steps=steps, shift=shift)
    torch.testing.assert_close(out, x0, rtol=1e-5, atol=1e-5)
    sig = sigma_schedule(steps, shift)
    assert float(sig[0]) == 1.0 and float(sig[-1]) == 0.0 and bool((sig[1:] < sig[:-1]).all())
    u = torch.full((2,), 1 - 1 / steps) if steps > 1 else torch.full((2,), 0.5)
    x_t, timestep, target = noisy_inputs(x0, u, eps, shift=shift)
    torch.testing.assert_close(oracle(x_t, timestep, None), target, rtol=1e-4, atol=1e-4)


def test_euler_matches_diffusers_flow_match_scheduler():
    diffusers = pytest.importorskip("diffusers")
    steps, shift = 6, 5.0
    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(sigmas=(1 - torch.arange(steps, dtype=torch.float64) / steps).tolist())
    torch.testing.assert_close(sched.sigmas.double(), sigma_schedule(steps, shift), rtol=1e-6, atol=1e-6)

    def vel(x, t, ctx):
        return torch.sin(3 * x + t.view(-1, 1, 1, 1, 1) / 300.0) + ctx.mean()

    noise, ctx = initial_noise((16, 2, 4, 4), 3), torch.full((1, 5, 8), 0.1)
    ours = euler_sample(vel, noise, ctx, steps=steps, shift=shift)
    x = noise.clone()
    for t in sched.timesteps:
        x = sched.step(vel(x, t.expand(1), ctx), t, x).prev_sample
    torch.testing.assert_close(ours, x, rtol=1e-5, atol=1e-5)


def test_guidance_batched_equals_two_forwards():
    calls = []

    def vel(x, t, ctx):
        calls.append(x.shape[0])
        return x * ctx.mean(dim=(1, 2)).view(-1, 1, 1, 1, 1) + t.view(-1, 1, 1, 1, 1) / 1000

    noise, ctx, neg = initial_noise((16, 1, 2, 2), 1), torch.full((1, 4, 8), 0.5), torch.full((1, 4, 8), -0.25)
    a = euler_sample(vel, noise, ctx, steps=3, shift=5, guidance_scale=4.0, negative=neg, batch_cfg=True)
    assert calls == [2, 2, 2]
    b = euler_sample(vel, noise, ctx, steps=3, shift=5, guidance_scale=4.0, negative=neg, batch_cfg=False)
    assert calls[3:] == [1] * 6
    torch.testing.assert_close(a, b)
    plain = euler_sample(vel, noise, ctx, steps=3, shift=5)
    assert float((plain - a).abs().max()) > 1e-3


def test_preview_plan_fits_the_budget():
    from ds_adaptive.planning.cost import CostModel
    from ds_adaptive.planning.profile import load_profile

    cost = CostModel(load_profile("h200-wan2.1-1.3b"), checkpointing="auto")
    small, big = SampleShape(17, 256, 256), SampleShape(81, 720, 1280)
    ctx = torch.zeros(4, 4096)
    prompts = [PreviewPrompt("a", ctx, small, 1), PreviewPrompt("b", ctx, big, 2)]
    need_small1, need_big1 = preview_memory_gib(cost, small, 1), preview_memory_gib(cost, big, 1)
    need_small2 = preview_memory_gib(cost, small, 2)
    assert need_small1 < need_small2 < need_big1
    plan = plan_previews(prompts, cost, need_small2 * 1.01, guidance=True)
    assert [p.name for p in plan.prompts] == ["a"] and plan.batch_cfg
    assert len(plan.dropped) == 1 and "preview 'b' (81x720x1280) dropped" in plan.dropped[0] \
        and "adaptive_load.preview.size" in plan.dropped[0]
    plan = plan_previews(prompts, cost, need_small1 * 1.01, guidance=True)
    assert [p.name for p in plan.prompts] == ["a"] and not plan.batch_cfg
    assert plan.predicted_gib["a"] == pytest.approx(need_small1)
    plan = plan_previews(prompts, cost, need_big1 * 1.01, guidance=False)
    assert len(plan.prompts) == 2 and not plan.batch_cfg and not plan.dropped


def test_prompts_from_a_file_and_from_the_dataset(tmp_path):
    from safetensors.torch import save_file

    from ds_adaptive.data import build_dataset

    ds = build_dataset("synthetic", num_samples=5, shapes=str(ROOT / "launch" / "configs" / "shapes_cpu.json"), seed=1)
    prompts, neg = load_prompts(PreviewConfig(enabled=True, num_prompts=3), ds)
    assert [p.name for p in prompts] == ["sample0", "sample1", "sample2"] and neg is None
    assert prompts[1].shape == ds.sample_shapes()[1] and torch.equal(prompts[1].context, ds[1]["context"])
    assert len({p.seed for p in prompts}) == 3
    f = tmp_path / "p.safetensors"
    save_embeddings({"fox": torch.randn(7, 4096), "neg": torch.randn(3, 4096), "cat": torch.randn(9, 4096)}, f)
    cfg = PreviewConfig(enabled=True, prompts=str(f), negative="neg", size="5x32x64", num_prompts=4)
    prompts, neg = load_prompts(cfg, ds)
    assert [p.name for p in prompts] == ["fox", "cat"] and neg.shape == (3, 4096)
    assert all(p.shape == SampleShape(5, 32, 64) for p in prompts)
    with pytest.raises(ConfigError, match="'nope' is not in"):
        load_prompts(PreviewConfig(enabled=True, prompts=str(f), negative="nope", size="5x32x64"), ds)
    save_file({"bad": torch.randn(7, 100)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ConfigError, match=r"must hold text embeddings \[L <= 512, 4096\].*bad \[7, 100\]"):
        load_prompts(PreviewConfig(enabled=True, prompts=str(tmp_path / "bad.safetensors"), size="1x32x32"), ds)
    with pytest.raises(ValueError, match="set preview.size"):
        PreviewConfig(enabled=True, prompts=str(f))


def test_preview_prompts_and_size_follow_the_model(tmp_path, capsys):
    """tiny-ti2v (Wan 2.2's 48-channel 4x16x16 grid): the dataset's prompts carry its grid; a size of the 16-pixel
    grid only is one message naming the key and the model, from the trainer's CLI before any process group."""
    from ds_adaptive.data import build_dataset
    from ds_adaptive.models.registry import get_model
    from ds_adaptive.cli.train import main as train_main

    spec = get_model("tiny-ti2v")
    (tmp_path / "shapes.json").write_text(json.dumps([{"frames": 5, "height": 32, "width": 64, "weight": 1}]))
    ds = build_dataset("synthetic", num_samples=3, shapes=str(tmp_path / "shapes.json"), seed=1, spec=spec.input_spec)
    prompts, _ = load_prompts(PreviewConfig(enabled=True, num_prompts=2), ds)
    assert [p.shape.latent_shape for p in prompts] == [(48, 2, 2, 4)] * 2 and prompts[0].shape.grid == spec.grid
    with pytest.raises(ConfigError, match=r"adaptive_load.preview.size.*\(model tiny-ti2v\)"):
        load_prompts(PreviewConfig(enabled=True, num_prompts=2, size="5x32x48"), ds)
    raw = json.loads((ROOT / "launch" / "configs" / "cpu_tiny.json").read_text())
    raw["adaptive_load"]["preview"] = {"enabled": True, "size": "5x32x48"}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    assert train_main(["--deepspeed_config", str(tmp_path / "c.json"), "--model", "tiny-ti2v", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "width must be a multiple of 32" in err and "(model tiny-ti2v)" in err and "Traceback" not in err


def test_media_files_are_readable(tmp_path):
    av = pytest.importorskip("av")
    from PIL import Image

    lat = torch.randn(16, 3, 4, 6)
    strip = latent_strip(lat)
    assert strip.shape == (32, 3 * 48, 3) and strip.dtype == np.uint8
    frames = (np.random.default_rng(0).random((9, 32, 48, 3)) * 255).astype(np.uint8)
    assert frame_strip(frames, 4).shape == (32, 4 * 48, 3)
    write_media(frames, tmp_path / "a.mp4", fps=8)
    with av.open(str(tmp_path / "a.mp4")) as c:
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(decoded) == 9 and decoded[0].shape == (32, 48, 3)
    write_media(frames, tmp_path / "a.gif", fps=8)
    assert Image.open(tmp_path / "a.gif").n_frames == 9
    write_media(frames, tmp_path / "a.png")
    assert np.asarray(Image.open(tmp_path / "a.png")).shape == (32, 8 * 48, 3)
    with pytest.raises(ValueError, match="suffix"):
        write_media(frames, tmp_path / "a.webm")


FAKE_WANDB = textwrap.dedent("""
    import json, os
    LOG = os.environ["FAKE_WANDB_LOG"]
    class Image:
        def __init__(self, data, caption=None):
            self.shape, self.caption = list(data.shape), caption
    class _Run:
        def log(self, values, step=None):
            with open(LOG, "a") as f:
                f.write(json.dumps({"step": step, "keys": sorted(values),
                                    "images": {k: v.shape for k, v in values.items() if isinstance(v, Image)}}) + "\\n")
        def finish(self):
            with open(LOG, "a") as f:
                f.write(json.dumps({"finished": True}) + "\\n")
    def init(project=None, name=None, dir=None, config=None):
        with open(LOG, "a") as f:
            f.write(json.dumps({"init": project, "name": name, "model": config.get("model")}) + "\\n")
        return _Run()
""")


@pytest.mark.slow
def test_preview_runs_in_the_tiny_cpu_job_and_writes_its_files(tmp_path):
    """One process, 2 steps, a preview after each (guidance batched), decoded by a tiny VAE to mp4; TensorBoard and a
stand-in wandb get the scalars and images."""
    pytest.importorskip("diffusers")
    pytest.importorskip("av")
    from test_preprocess import tiny_models

    vae = tiny_models(tmp_path / "models")["--vae"]
    (tmp_path / "fake" / "wandb").mkdir(parents=True)
    (tmp_path / "fake" / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    raw = json.loads((ROOT / "launch" / "configs" / "cpu_tiny.json").read_text())
    raw["adaptive_load"]["sampler"]["shapes"] = str(ROOT / "launch" / "configs" / "shapes_cpu.json")
    raw["adaptive_load"]["metrics"].update(wandb=True, wandb_project="tests")
    runs = {"video": {"vae": str(vae), "size": "5x32x48", "format": "mp4", "guidance_scale": 3.0}}
    for name, extra in runs.items():   # (the latent PNG previews: tests/integration/test_lora_launch.py's 2-rank runs)
        raw["adaptive_load"]["preview"] = {"enabled": True, "interval": 1, "steps": 2, "num_prompts": 2, **extra}
        (tmp_path / f"{name}.json").write_text(json.dumps(raw))
        env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'fake'}:{ROOT}", "FAKE_WANDB_LOG": str(tmp_path / f"{name}.wandb"),
               "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        r = subprocess.run([sys.executable, "-m", "ds_adaptive.cli.train", "--deepspeed_config", f"{name}.json",
                            "--num-samples", "60", "--steps", "2", "--log-dir", name], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=400)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "ds_adaptive.preview: step 2: 2 preview(s), 2 Euler steps" in r.stdout
    av = __import__("av")
    recs = [json.loads(x) for x in (tmp_path / "video" / "previews.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2] and recs[0]["batch_cfg"] and recs[0]["generate_s"] > 0
    for f in recs[1]["files"]:
        assert f.endswith(".mp4")
        with av.open(str(tmp_path / f)) as c:
            frames = [x.to_ndarray(format="rgb24") for x in c.decode(video=0)]
        assert len(frames) == 5 and frames[0].shape == (32, 48, 3)
    summary = json.loads((tmp_path / "video" / "summary.json").read_text())
    assert summary["preview"]["rounds"] == 2 and summary["preview"]["prompts"] == ["sample0", "sample1"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(tmp_path / "video" / "tensorboard"), size_guidance={"images": 0}).Reload()
    assert "preview/sample0" in ev.Tags()["images"] and "preview/seconds" in ev.Tags()["scalars"]
    log = [json.loads(x) for x in (tmp_path / "video.wandb").read_text().splitlines()]
    assert log[0] == {"init": "tests", "name": "video", "model": "tiny"} and log[-1] == {"finished": True}
    assert any("train/loss" in x.get("keys", []) for x in log)
    assert any(x.get("images", {}).get("preview/sample0") for x in log)


def test_wandb_missing_is_one_message(tmp_path, monkeypatch, capsys):
    from ds_adaptive.core.config import MetricsConfig
    from ds_adaptive.training.metrics import StepMetrics

    monkeypatch.setitem(sys.modules, "wandb", None)   # import wandb -> ImportError
    m = StepMetrics(MetricsConfig(wandb=True, tensorboard=False, log_dir=str(tmp_path)), micro_steps_per_step=1,
                    device=torch.device("cpu"))
    assert m._wandb is None
    assert "'wandb' package is not installed" in capsys.readouterr().out
    m.log_image("preview/x", np.zeros((4, 4, 3), np.uint8), 1)
    m.close()
