"""Guards the trainer: the flow-matching objective (noise range, first-frame conditioning), unbiased loss weighting
under ZeRO-3 with unequal batches, 2-rank ZeRO-3 runs (adaptive and baseline, synthetic and on-disk data), resume
and SP equivalence for each model family's tiny model, and clear CLI errors."""
from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import TINY_MODELS
from ds_adaptive.data import SyntheticLatentDataset, collate_latents
from ds_adaptive.core.shapes import SampleShape, ShapeWeight
from ds_adaptive.cli.train import build_parser, main
from ds_adaptive.models.objective import flow_matching_losses, sample_seed

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "launch" / "configs"


def train_argv(*args: str) -> list[str]:
    """argv of the trainer module (what launch/train_wan.py runs)."""
    return ["-m", "ds_adaptive.cli.train", *args]

SHAPES = [ShapeWeight(SampleShape(1, 64, 64), 1.0), ShapeWeight(SampleShape(5, 64, 96), 1.0),
          ShapeWeight(SampleShape(9, 32, 64), 1.0)]


class _Recorder(torch.nn.Module):
    """Stands in for the model: records its inputs, predicts zeros."""

    def forward(self, x_t, timestep, context):
        self.seen = (x_t.clone(), timestep.clone(), context)
        return torch.zeros_like(x_t)


@pytest.mark.parametrize("shift", [1.0, 5.0])
def test_flow_matching_inputs_and_target(shift):
    ds = SyntheticLatentDataset(8, SHAPES[:1], seed=0, text_len=(4, 8))
    batch = collate_latents([ds[3], ds[5]])
    model = _Recorder()
    losses = flow_matching_losses(model, batch["latents"], batch["context"], batch["index"], epoch=2, seed=9,
                                  shift=shift, dtype=torch.float32)
    x_t, timestep, _ = model.seen
    for row, idx in enumerate([3, 5]):
        g = torch.Generator().manual_seed(sample_seed(9, 2, idx))
        u = torch.rand((), generator=g)
        eps = torch.randn(batch["latents"].shape[1:], generator=g)
        sigma = shift * u / (1 + (shift - 1) * u)
        x0 = batch["latents"][row]
        assert timestep[row] == pytest.approx(1000 * float(sigma), rel=1e-6)
        torch.testing.assert_close(x_t[row], (1 - sigma) * x0 + sigma * eps)
        # a zero prediction leaves the whole target eps - x0 as the error
        assert float(losses[row]) == pytest.approx(float((eps - x0).pow(2).mean()), rel=1e-5)
    assert sample_seed(9, 2, 3) != sample_seed(9, 3, 3) != sample_seed(10, 2, 3)


def test_a_sample_loss_does_not_depend_on_its_batch():
    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.models.wan_config import get_wan_config

    torch.manual_seed(0)
    model = WanModel(get_wan_config("tiny", num_layers=1))
    with torch.no_grad():  # a non-zero head, so that the prediction depends on the inputs
        for p in model.head.parameters():
            p.normal_(0, 0.02)
    ds = SyntheticLatentDataset(20, SHAPES[:1], seed=0, text_len=(4, 30))
    batch = collate_latents([ds[i] for i in (1, 2, 3)])
    together = flow_matching_losses(model, batch["latents"], batch["context"], batch["index"], epoch=0, seed=0,
                                    shift=5.0, dtype=torch.float32)
    for row, i in enumerate((1, 2, 3)):
        alone = collate_latents([ds[i]])
        single = flow_matching_losses(model, alone["latents"], alone["context"], alone["index"], epoch=0, seed=0,
                                      shift=5.0, dtype=torch.float32)
        assert float(single[0].detach()) == pytest.approx(float(together[row].detach()), rel=1e-5)


def test_first_frame_conditioning_inputs_timesteps_and_loss():
    """first_frame_ratio 1: video samples keep latent frame 0 clean, get timestep 0 on its tokens (one timestep per
    token) and leave it out of the loss; images are never conditioned; ratio 0 draws what no option draws."""
    from ds_adaptive.models.family import ObjectiveOptions

    ds = SyntheticLatentDataset(8, SHAPES[1:2], seed=0, text_len=(4, 8))   # 5x64x96: latent 2x8x12, 2x4x6 tokens
    batch = collate_latents([ds[3], ds[5]])
    x0 = batch["latents"]
    model = _Recorder()
    args = (batch["latents"], batch["context"], batch["index"])
    kw = dict(epoch=1, seed=4, shift=5.0, dtype=torch.float32)
    plain = flow_matching_losses(model, *args, **kw)
    x_plain, t_plain, _ = model.seen
    assert torch.equal(flow_matching_losses(model, *args, objective=ObjectiveOptions(), **kw), plain)
    losses = flow_matching_losses(model, *args, objective=ObjectiveOptions(first_frame_ratio=1.0), **kw)
    x_t, timestep, _ = model.seen
    assert timestep.shape == (2, 2 * 4 * 6) and bool((timestep[:, :24] == 0).all())
    assert torch.equal(timestep[:, 24:], t_plain[:, None].expand(2, 24))
    assert torch.equal(x_t[:, :, 0], x0[:, :, 0]) and torch.equal(x_t[:, :, 1:], x_plain[:, :, 1:])
    for row, idx in enumerate([3, 5]):   # zero prediction: the loss is the target's mean square over frames >= 1
        g = torch.Generator().manual_seed(sample_seed(4, 1, idx))
        torch.rand((), generator=g)
        eps = torch.randn(x0.shape[1:], generator=g)
        assert float(losses[row]) == pytest.approx(float((eps - x0[row])[:, 1:].pow(2).mean()), rel=1e-5)
    half = ObjectiveOptions(first_frame_ratio=0.5)   # per-sample draws: some conditioned, some not, reproducibly
    ids = torch.arange(40)
    from ds_adaptive.models.objective import first_frame_draws
    cond = first_frame_draws(ids, seed=4, epoch=1, ratio=half.first_frame_ratio)
    assert 5 < int(cond.sum()) < 35 and torch.equal(cond, first_frame_draws(ids, seed=4, epoch=1, ratio=0.5))
    images = collate_latents([SyntheticLatentDataset(4, SHAPES[:1], seed=0, text_len=(4, 8))[i] for i in (0, 1)])
    flow_matching_losses(model, images["latents"], images["context"], images["index"],
                         objective=ObjectiveOptions(first_frame_ratio=1.0), **kw)
    assert model.seen[1].shape == (2,)   # images: one timestep per sample


def test_masked_loss_on_sequence_shards_sums_to_the_full_masked_loss():
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.models.objective import per_sample_mse
    from ds_adaptive.parallel import LocalOutput, shard_plan, shard_sequence
    from einops import rearrange

    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(2, 4, 3, 6, 10, generator=g), torch.randn(2, 4, 3, 6, 10, generator=g)
    mask = torch.ones(2, 1, 3, 6, 10)
    mask[0, :, 0] = 0.0
    full = per_sample_mse(pred, target, mask)
    assert float(full[0]) == pytest.approx(float((pred - target)[0, :, 1:].pow(2).mean()), rel=1e-6)
    assert float(full[1]) == pytest.approx(float((pred - target)[1].pow(2).mean()), rel=1e-6)
    tokens = rearrange(pred, "b c (f pt) (h ph) (w pw) -> b (f h w) (pt ph pw c)", pt=1, ph=2, pw=2)
    parts = []
    for r in range(2):
        shard = shard_plan(tokens.shape[1], Layout.explicit(sp_size=2, sp_rank=r))
        local = LocalOutput(tokens=shard_sequence(tokens, shard, dim=1), shard=shard, grid=(3, 3, 5))
        parts.append(per_sample_mse(local, target, mask))
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-7)


WEIGHTING = textwrap.dedent("""
    import json, sys
    import torch, deepspeed
    from deepspeed.utils import safe_get_full_grad
    from ds_adaptive.data import SyntheticLatentDataset, collate_latents
    from ds_adaptive.models.wan import WanModel, get_wan_config
    from ds_adaptive.planning.planner import StepTotals
    from ds_adaptive.core.shapes import SampleShape, ShapeWeight
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.cli.train import backward_micro_batch, flow_matching_losses, init_distributed

    by = sys.argv[1]
    rank, world, device = init_distributed(0)
    torch.set_num_threads(1)
    shapes = [ShapeWeight(SampleShape(1, 64, 64), 1), ShapeWeight(SampleShape(5, 64, 96), 1),
              ShapeWeight(SampleShape(9, 32, 64), 1)]
    ds = SyntheticLatentDataset(60, shapes, seed=1, text_len=(4, 24))
    ids = {}
    for i, s in enumerate(ds.sample_shapes()):
        ids.setdefault(s, []).append(i)
    a, b, c = (ids[w.shape] for w in shapes)
    # rank -> micro-step -> samples: 4 vs 3 samples per rank, 3/1 and 1/2 per micro-step, three token counts
    plan = [[a[0:3], b[0:1]], [c[0:1], a[3:5]]]
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "bf16": {"enabled": False},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    wcfg = get_wan_config("tiny", num_layers=1)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = WanModel(wcfg)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
        if rank == 0:  # a non-zero head (Wan zero-inits it) so that every parameter gets a gradient
            with torch.no_grad():
              for p in engine.module.head.parameters():
                  p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    every = [i for r in plan for m in r for i in m]
    totals = StepTotals(samples=len(every), tokens=sum(ds.shape_of(i).tokens for i in every), micro_steps=2)
    kw = dict(epoch=0, seed=0, shift=5.0, dtype=torch.float32)
    for micro in plan[rank]:
        batch = collate_latents([ds[i] for i in micro])
        backward_micro_batch(engine, batch["latents"], batch["context"], batch["index"], totals,
                             tokens_per_sample=ds.shape_of(micro[0]).tokens,
                             layout=Layout.explicit(dp_size=world, dp_rank=rank), by=by, **kw)
    got = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}

    ref = WanModel(wcfg)  # one process, every sample of the step
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(weights[n])
    params = [p for _, p in ref.named_parameters()]
    total, naive = 0.0, 0.0
    for r in plan:
        for micro in r:
            batch = collate_latents([ds[i] for i in micro])
            per = flow_matching_losses(ref, batch["latents"], batch["context"], batch["index"], **kw)
            w = ds.shape_of(micro[0]).tokens if by == "tokens" else 1
            total = total + (per * w).sum()
            naive = naive + per.mean() / 4  # what plain DeepSpeed gives: mean of per-rank, per-micro-step means
    want = torch.autograd.grad(total / (totals.tokens if by == "tokens" else totals.samples), params, retain_graph=True)
    plain = torch.autograd.grad(naive, params)
    names = [n for n, _ in ref.named_parameters()]
    norm = lambda ts: torch.sqrt(sum(t.double().pow(2).sum() for t in ts))
    err = float(norm([got[n] - g for n, g in zip(names, want)]) / norm(want))
    err_naive = float(norm([p - g for p, g in zip(plain, want)]) / norm(want))
    worst = max(names, key=lambda n: float((got[n] - want[names.index(n)]).abs().max()))
    print("RESULT " + json.dumps({"rank": rank, "err": err, "err_naive": err_naive, "worst": worst,
                                  "zero_grads": sum(int(g.abs().max() == 0) for g in want)}), flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("by", ["samples", "tokens"])
def test_loss_weighting_gives_the_single_process_gradient(by, tmp_path, run_ranks):
    """Two ZeRO-3 ranks with unequal batches (4 vs 3 samples, 3/1 and 1/2 per micro-step, gas 2) must produce the
    gradient one process computes over the same 7 samples; unweighted per-rank means must not."""
    results = run_ranks(["-c", WEIGHTING, by], 2, cwd=tmp_path, timeout=300)
    for r in results:
        res = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
        assert res["zero_grads"] == 0
        assert res["err"] < 1e-4, res
        assert res["err_naive"] > 1e-2, res  # the check has teeth: plain means give a visibly different gradient


def _summary(log_dir) -> dict:
    return json.loads((log_dir / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("model", TINY_MODELS)
def test_two_rank_zero3_run_and_resume_equivalence(tmp_path, cpu_config, run_ranks, model):
    """4 steps straight (saving at step 2) == resume from step 2 and run 2 more: same losses, same samples (for
    each family's tiny model: tiny-ti2v trains half of its videos image-to-video, with per-token timesteps)."""
    common = ["--deepspeed_config", str(cpu_config), "--num-samples", "400", "--seed", "3", "--model", model]
    run_ranks(train_argv(*common, "--steps", "4", "--log-dir", "straight", "--save", "ckpt",
                            "--save-interval", "2"), 2, cwd=tmp_path)
    straight = _summary(tmp_path / "straight")
    assert straight["steps"] == 4 and straight["world_size"] == 2 and straight["final_step"] == 4
    assert straight["sampler"] == "AdaptiveBatchSampler" and straight["adaptive_load"] is True
    assert straight["checkpoint_attention"] == "recompute"   # auto without the budget search (cost_model power)
    assert straight["samples"] > 8 and straight["tokens"] > 0 and straight["tokens_per_s"] > 0
    logged = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert all(len(r["compute_ms"]) == 2 and len(r["samples_per_rank"]) == 2 for r in logged)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.is_dir()) == ["global_step2", "global_step4"]

    run_ranks(train_argv(*common, "--steps", "4", "--log-dir", "resumed", "--resume", "ckpt/global_step2"),
                 2, cwd=tmp_path)
    resumed = _summary(tmp_path / "resumed")
    assert resumed["first_step"] == 3 and resumed["last_step"] == 4
    assert resumed["losses"] == pytest.approx(straight["losses"][2:], rel=1e-5, abs=1e-6)
    straight_rows = {r["step"]: r for r in logged}
    resumed_rows = {json.loads(x)["step"]: json.loads(x)
                    for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()}
    assert resumed_rows[4]["samples_per_rank"] == straight_rows[4]["samples_per_rank"]
    assert resumed_rows[4]["tokens_per_rank"] == straight_rows[4]["tokens_per_rank"]


@pytest.mark.slow
def test_training_goes_on_across_an_epoch_boundary(tmp_path, cpu_config, run_ranks):
    """The first step of a new epoch takes its loss weights from the new epoch's plan (it took the old epoch's,
    and the samples check then stopped every run at the first step of its second epoch)."""
    run_ranks(train_argv("--deepspeed_config", str(cpu_config), "--num-samples", "40", "--layers", "1",
                         "--steps", "12", "--log-dir", "logs"), 1, cwd=tmp_path)
    s = _summary(tmp_path / "logs")
    assert s["steps"] == 12 and s["plan"]["steps"] < 12, s["plan"]


@pytest.mark.slow
def test_two_rank_baseline_on_disk_data(tmp_path, run_ranks):
    """The equal-token baseline (adaptive_load.enabled=false) on a dataset written by `ds-adaptive synth`."""
    from ds_adaptive.cli.synth import main as synth_main

    assert synth_main(["--out", str(tmp_path / "data"), "--num-samples", "120", "--shapes",
                       str(CONFIGS / "shapes_cpu.json"), "--text-len", "8", "32"]) == 0
    cfg = json.loads((CONFIGS / "cpu_tiny.json").read_text())
    cfg["adaptive_load"]["enabled"] = False
    cfg["adaptive_load"]["fused_ln_modulate"] = False
    cfg["adaptive_load"]["sampler"]["shapes"] = None
    cfg["adaptive_load"]["optimization"] = {"loss_weighting": "tokens", "lr_scaling": "linear", "reference_batch": 4}
    del cfg["scheduler"]  # so that the logged LR is exactly base LR x samples / reference_batch
    (tmp_path / "base.json").write_text(json.dumps(cfg))
    results = run_ranks(train_argv("--deepspeed_config", "base.json", "--data", "data", "--steps", "3",
                                      "--log-dir", "logs"), 2, cwd=tmp_path)
    s = _summary(tmp_path / "logs")
    assert s["adaptive_load"] is False and s["sampler"] == "TokenBucketSampler" and s["sampler_mode"] == "tokens"
    assert s["data"] == "data" and "latent dataset" in s["dataset"] and s["loss_weighting"] == "tokens"
    assert s["steps"] == 3 and all(x == x for x in s["losses"])  # finite, not NaN
    assert "run summary" in results[0].stdout and "run summary" not in results[1].stdout
    base_lr = cfg["optimizer"]["params"]["lr"]
    logged = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3]   # metrics.jsonl: every step (metrics.jsonl_interval 1)
    for r in logged:
        assert r["lr"] == pytest.approx(base_lr * r["samples"] / 4)
    # compute.jsonl (rank 0's): every step's micro-steps, not only the logged ones, as ds-adaptive refit reads them
    comp = [json.loads(x) for x in (tmp_path / "logs" / "compute.jsonl").read_text().splitlines()]
    gas = s["gradient_accumulation_steps"]
    assert [(r["step"], r["micro"]) for r in comp] == [(t, m) for t in (1, 2, 3) for m in range(gas)]
    assert all(0 < r["compute_ms"] <= r["step_wall_ms"] for r in comp)
    for r in logged:
        assert sum(c["B"] for c in comp if c["step"] == r["step"]) == r["samples_per_rank"][0]
        assert [c["compute_ms"] for c in comp if c["step"] == r["step"]] == [m[0] for m in r["micro_compute_ms"]]


@pytest.mark.slow
def test_layers_plans_with_the_depth_rescaled_profile(tmp_path, cpu_config, run_ranks):
    """--layers N below the profile's depth: the trainer plans with Profile.with_num_layers(N) and says so
    in one line; without --layers (or with the profile's own depth) nothing is rescaled."""
    from ds_adaptive.core.ds_config import load_adaptive_config
    from ds_adaptive.planning.profile import load_profile
    from ds_adaptive.data import build_dataset
    from ds_adaptive.planning.sampler import build_batch_sampler
    from ds_adaptive.core.layout import Layout

    raw = json.loads(cpu_config.read_text())
    raw["adaptive_load"]["sampler"].update(m_mem=0.5, shapes=str(CONFIGS / "shapes_cpu.json"))  # 30 blocks fit
    (tmp_path / "ds.json").write_text(json.dumps(raw))
    common = ["--deepspeed_config", "ds.json", "--num-samples", "40", "--steps", "1", "--eval-samples", "0"]
    out = run_ranks(train_argv(*common, "--layers", "1", "--log-dir", "l1"), 1, cwd=tmp_path)[0].stdout
    lines = [x for x in out.splitlines() if "rescaled to --layers" in x]
    assert lines == ["ds_adaptive.train: profile 'h100-wan2.1-1.3b' describes 30 blocks; rescaled to --layers 1 for "
                     "planning (Profile.with_num_layers: block compute and activation terms x 1/30, embed/head kept, "
                     f"static memory of {load_profile('h100-wan2.1-1.3b').with_num_layers(1).params / 1e9:.3f}B "
                     "params)"], out[-3000:]
    s = _summary(tmp_path / "l1")
    assert s["layers"] == 1
    # the plan the trainer logged is the one a sampler built on the rescaled profile makes
    cfg = load_adaptive_config(tmp_path / "ds.json").sampler
    shapes = build_dataset("synthetic", num_samples=40, shapes=str(CONFIGS / "shapes_cpu.json"), seed=0).sample_shapes()
    smp = build_batch_sampler(cfg, shapes, Layout.explicit(), micro_steps_per_step=2, zero_stage=3, num_layers=1)
    assert smp.cost.profile.rescaled_from_layers == 30 and s["plan"] == smp.epoch_stats()
    # at the profile's own depth nothing is rescaled: the same assembly (build_run, whose notes the trainer prints)
    # without training a 30-block model
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig

    # (the profile-for-another-model warning is for GPU runs, where calibrating is the fix: none on this CPU run)
    run = build_run(RunConfig.load(raw, trainer={"model": "tiny", "layers": 30, "num_samples": 40}),
                    layout=Layout.explicit(), meta=True)
    assert run.sampler.cost.profile.rescaled_from_layers is None and not any("rescaled" in n for n in run.notes)


def test_cli_errors_are_clear(tmp_path, capsys, monkeypatch):
    cfg = CONFIGS / "cpu_tiny.json"
    assert main(["--deepspeed_config", str(tmp_path / "missing.json")]) == 2
    assert "missing.json does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"adaptive_load": {"sampler": {"mdoe": "dual"}}}))
    assert main(["--deepspeed_config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "adaptive_load.sampler.mdoe" in err and "mode" in err
    assert main(["--deepspeed_config", str(cfg), "--sp", "3"]) == 2
    assert "sp=3 does not divide the 2 attention heads of tiny" in capsys.readouterr().err
    assert main(["--deepspeed_config", str(cfg), "--sp", "2"]) == 2
    assert "world size 1 (ranks) is not divisible by the Ulysses degree sp=2" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--deepspeed_config", str(cfg), "--sp", "2"]) == 2
    assert "not divisible by the Ulysses degree sp=2" in capsys.readouterr().err
    assert main(["--deepspeed_config", str(cfg), "--data", str(tmp_path), "--num-samples", "5"]) == 2
    assert "--num-samples describe the synthetic dataset" in capsys.readouterr().err
    assert main(["--deepspeed_config", str(cfg), "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err


def test_parser_accepts_the_deepspeed_launcher_flags():
    args = build_parser().parse_args(["--local_rank=3", "--deepspeed_config", "x.json", "--deepspeed",
                                      "--no-fused-ln-modulate", "--grad-ckpt", "--layers", "1"])
    assert args.local_rank == 3 and args.deepspeed_config == "x.json" and args.fused_ln_modulate is False
    assert args.grad_ckpt and args.layers == 1 and args.sp is None and args.model == "tiny"
    assert build_parser().parse_args(["--deepspeed_config", "x"]).fused_ln_modulate is None
    assert os.path.isfile(ROOT / "launch" / "train_wan.py")


@pytest.mark.slow
@pytest.mark.parametrize("model", TINY_MODELS)
def test_ulysses_sp2_trains_like_sp1(tmp_path, cpu_config, run_ranks, model):
    """dp=2: 4 ranks with --sp 2 and 2 ranks with --sp 1 get the same plan (fixed batch sizes), so the
    logged per-step losses (summed over each SP group) and the held-out loss must agree; checkpoints hold
    one shard per rank."""
    cfg = json.loads(cpu_config.read_text())
    shapes = json.loads((CONFIGS / "shapes_cpu.json").read_text())["shapes"]
    cfg["adaptive_load"]["sampler"].update(
        mode="fixed", m_mem=2.0, shapes=str(CONFIGS / "shapes_cpu.json"),
        fixed_batch_sizes={f"{s['frames']}x{s['height']}x{s['width']}": 2 for s in shapes})
    (tmp_path / "fixed.json").write_text(json.dumps(cfg))
    common = ["--deepspeed_config", "fixed.json", "--num-samples", "200", "--seed", "1", "--steps", "3", "--grad-ckpt",
              "--eval-samples", "3", "--model", model]
    run_ranks(train_argv(*common, "--sp", "1", "--log-dir", "sp1"), 2, cwd=tmp_path)
    run_ranks(train_argv(*common, "--sp", "2", "--log-dir", "sp2", "--save", "ckpt"), 4, cwd=tmp_path)
    sp1, sp2 = _summary(tmp_path / "sp1"), _summary(tmp_path / "sp2")
    assert sp2["world_size"] == 4 and sp2["samples"] == sp1["samples"] and sp2["tokens"] == sp1["tokens"]
    assert sp2["losses"] == pytest.approx(sp1["losses"], rel=1e-4)
    assert sp2["eval_loss"] == pytest.approx(sp1["eval_loss"], rel=1e-4)  # gathered outputs under SP
    assert len(list((tmp_path / "ckpt" / "global_step3").glob("*optim_states.pt"))) == 4
