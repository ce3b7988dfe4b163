"""Guards Ulysses SP under DeepSpeed ZeRO-3 (4 gloo ranks, DP=2 x SP=2): identical batches per SP group, losses and weights equal a single-process reference."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT, launch_ranks

pytest.importorskip("deepspeed", reason="DeepSpeed is needed for the ZeRO-3 test")

# Every rank: the real sampler (cpu_tiny config, sp=2) plans the batches, DeepSpeed ZeRO-3 trains
# the tiny Wan with the loss on shards and the trainer's loss weighting x check_engine's scale.
# Rank 0 then replays all DP ranks' batches in ONE process without DeepSpeed (full sequences,
# torch AdamW, clip_grad_norm_) and compares the per-step losses and the final weights.
SCRIPT = textwrap.dedent("""
    import copy, json, sys, warnings
    import torch, torch.distributed as dist, deepspeed
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    from ds_adaptive.core.ds_config import load_adaptive_config
    from ds_adaptive.data import SyntheticLatentDataset, collate_latents
    from ds_adaptive.models.testing import random_init_
    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.core.layout import Layout, strip_mesh_keys
    from ds_adaptive.models.objective import per_sample_mse
    from ds_adaptive.parallel import apply_ulysses
    from ds_adaptive.planning.sampler import build_batch_sampler
    from deepspeed.utils import safe_get_full_grad

    MESH = sys.argv[1] == "mesh"
    STEPS, GAS, LR, CLIP = 3, 2, 2e-3, 0.05
    rank, world = dist.get_rank(), dist.get_world_size()
    ds_cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.99], "eps": 1e-8,
                                                        "weight_decay": 0.01, "torch_adam": True}},
              "steps_per_print": 10**9, "data_parallel_size": 2, "sequence_parallel_size": 2}
    if not MESH:
        ds_cfg = strip_mesh_keys(ds_cfg)

    def init_model():
        torch.manual_seed(0)
        return random_init_(WanModel("tiny"), seed=3)

    with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
        model = WanModel("tiny")
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            random_init_(model, seed=3)
    if not MESH:
        sp = Layout.detect(2).validate(num_heads=2)
        uw = apply_ulysses(model, sp)
    model.gradient_checkpointing = not MESH   # the attention all-to-alls run again in the recompute
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    if MESH:
        sp = Layout.detect(2).validate(num_heads=2)
        assert sp.source == "deepspeed-mesh", sp
        uw = apply_ulysses(model, sp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scale = sp.check_engine(engine)
    assert scale == 2.0, scale
    assert MESH == any("overwrite each other" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert (sp.dp_rank, sp.sp_rank) == (rank // 2, rank % 2), sp

    cfg = load_adaptive_config(str(ROOT_ / "launch/configs/cpu_tiny.json"))
    data = SyntheticLatentDataset(64, str(ROOT_ / "launch/configs/shapes_cpu.json"), seed=1)
    shapes = data.sample_shapes()
    sampler = build_batch_sampler(cfg.sampler, shapes, sp, micro_steps_per_step=GAS, model_name="tiny",
                                  zero_stage=3, gpu_mem_gib=80.0)
    sampler.set_epoch(0)
    assert sampler.steps_per_epoch >= STEPS, sampler.steps_per_epoch
    mine = list(sampler)[:STEPS * GAS]
    every = [None] * world
    dist.all_gather_object(every, mine)
    assert every[rank ^ 1] == mine, "the two ranks of an SP group must get identical batches"
    assert every[rank ^ 2] != mine, "the two DP groups must get different batches"

    def noise(index, step, shape):
        g = torch.Generator().manual_seed(1000 * index + step)
        return torch.rand((), generator=g), torch.randn(shape, generator=g)

    def flow_batch(ids, step):
        b = collate_latents([data[i] for i in ids])
        x0 = b["latents"]
        us, eps = zip(*(noise(i, step, x0.shape[1:]) for i in ids))
        u, eps = torch.stack(us), torch.stack(eps)
        s = u.view(-1, 1, 1, 1, 1)
        return (1 - s) * x0 + s * eps, u * 1000, b["context"], eps - x0

    losses, grads = [], []
    for step in range(STEPS):
        totals = sampler.step_totals(step)
        num = torch.zeros(())
        for micro in range(GAS):
            ids = mine[step * GAS + micro]
            x_t, t, ctx, target = flow_batch(ids, step)
            partial = per_sample_mse(engine(x_t, t, ctx, local=True), target)          # [B] this shard's part of each MSE
            weight = totals.loss_weight(len(ids), 0, sp.dp_size, "samples")
            engine.backward(partial.mean() * weight * scale)
            if micro == GAS - 1:   # the step's reduced gradient, before clipping (a collective)
                grads.append({n: safe_get_full_grad(p).clone() for n, p in model.named_parameters()})
            engine.step()
            num += partial.detach().sum()
        dist.all_reduce(num)   # sum over SP ranks (-> per-sample MSE) and DP groups
        losses.append(float(num) / totals.samples)

    if not MESH:  # sp=4 over the same 4 ranks (plain model, 4 heads): uneven padding, ranks holding only padding
        from ds_adaptive.models.wan import get_wan_config
        sp4 = Layout.detect(4)
        ref4 = random_init_(WanModel(get_wan_config("tiny", num_heads=4)), seed=5)
        m4 = copy.deepcopy(ref4)
        apply_ulysses(m4, sp4)
        g = torch.Generator().manual_seed(7)
        for grid in [(3, 6, 10), (1, 2, 4)]:      # 45 tokens -> 48 (12, 12, 12, 9 real); 2 tokens -> 4
            lat, tgt = torch.randn(2, 16, *grid, generator=g), torch.randn(2, 16, *grid, generator=g)
            t, ctx = torch.tensor([10.0, 900.0]), torch.randn(2, 6, 4096, generator=g)
            ref4.zero_grad(); m4.zero_grad()
            (ref4(lat, t, ctx) - tgt).square().flatten(1).mean(1).sum().backward()
            part = per_sample_mse(m4(lat, t, ctx, local=True), tgt)
            part.sum().backward()
            for (n, a), b in zip(m4.named_parameters(), ref4.parameters()):
                gsum = a.grad.clone()
                dist.all_reduce(gsum, group=sp4.sp_group)
                err = float((gsum - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-30))
                assert err < 2e-5, (grid, n, err)
            with torch.no_grad():
                assert torch.allclose(m4(lat, t, ctx), ref4(lat, t, ctx), atol=2e-6), grid

    params = {}
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            params[name] = p.detach().clone()
    if rank == 0:
        ref = init_model()
        opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
        ref_losses, grad_err = [], []
        for step in range(STEPS):
            opt.zero_grad()
            total, n = 0.0, 0
            for micro in range(GAS):
                for d in range(2):
                    ids = every[2 * d][step * GAS + micro]
                    x_t, t, ctx, target = flow_batch(ids, step)
                    per = (ref(x_t, t, ctx).float() - target).square().flatten(1).mean(1)
                    (per.sum() / sampler.step_totals(step).samples).backward()
                    total += float(per.detach().sum()); n += len(ids)
            grad_err.append(max((float((grads[step][k] - p.grad).abs().max() / p.grad.abs().max()), k)
                                for k, p in ref.named_parameters()))
            torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
            opt.step()
            ref_losses.append(total / n)
        rel = [abs(a - b) / b for a, b in zip(losses, ref_losses)]
        worst = max((float((params[k] - v.detach()).abs().max()), k) for k, v in ref.named_parameters())
        moved = max(float((v.detach() - w.detach()).abs().max()) for (_, v), (_, w) in
                    zip(ref.named_parameters(), init_model().named_parameters()))
        print("LOSSES", losses, ref_losses, "rel", rel, "GRAD rel err", grad_err, "worst param diff", worst,
              "largest update", moved, flush=True)
        assert max(rel) < 1e-5, (losses, ref_losses)
        assert ref_losses[-1] < ref_losses[0], ref_losses
        # gradients: the loss scale (x sp) and the weighting; Adam + clipping alone hide a constant factor
        assert max(e for e, _ in grad_err) < 1e-4, grad_err
        assert worst[0] < 0.02 * LR and moved > LR, (worst, moved)
        print("ULYSSES_ZERO3_OK", flush=True)
    dist.barrier()
""")


@pytest.mark.slow
@pytest.mark.parametrize("groups", ["created", "mesh"])
def test_dp2_sp2_zero3_matches_single_process_reference(tmp_path: Path, groups: str) -> None:
    """'created': ds_adaptive's own SP groups (no DeepSpeed mesh, the trainer's setup);
    'mesh': DeepSpeed builds the (dp, sp) mesh from the ds_config and we take its groups."""
    script = tmp_path / "ulysses_zero3.py"
    script.write_text(f"from pathlib import Path\nROOT_ = Path({str(ROOT)!r})\n" + SCRIPT)
    results = launch_ranks([str(script), groups], 4, cwd=tmp_path, timeout=240,
                           env={"PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": os.environ.get(
                               "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))})
    out = results[0].stdout
    print(*(line for line in out.splitlines() if line.startswith("LOSSES")))
    assert "ULYSSES_ZERO3_OK" in out, out[-4000:]
