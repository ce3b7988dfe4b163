"""Guards Ulysses SP on 2 gloo ranks: SP=2 == SP=1 (outputs, losses, all gradients; per-sample and per-token
timesteps) for each model family's tiny model, and SP groups taken from Megatron's context-parallel groups. The
single-process checks are in tests/unit/parallel/test_ulysses.py."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT, TINY_MODELS, launch_ranks


# ------------------------------------------------------------------------------ SP=2 vs SP=1
SCRIPT = textwrap.dedent("""
    import copy, warnings
    import torch, torch.distributed as dist, deepspeed
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    from ds_adaptive.models.registry import get_model
    from ds_adaptive.models.testing import random_init_
    from ds_adaptive.models.wan import sdpa_attention
    from ds_adaptive.core.layout import Layout, SequenceParallelError
    from ds_adaptive.models.objective import per_sample_mse
    from ds_adaptive.parallel import apply_ulysses, make_ulysses_attention

    rank = dist.get_rank()
    sp = Layout.detect(2).validate(num_heads=2)
    assert (sp.sp_size, sp.sp_rank, sp.dp_size, sp.source) == (2, rank, 1, "created"), sp
    assert Layout.detect(2) is sp   # cached: no new groups
    ref = random_init_(get_model(MODEL).build(), seed=1)
    C, TD = ref.config.in_channels, ref.config.text_dim
    model = copy.deepcopy(ref)
    uw = apply_ulysses(model, sp)
    g = torch.Generator().manual_seed(5)

    def grads_summed_over_group(m):
        out = {}
        for n, p in m.named_parameters():
            t = p.grad.clone()
            dist.all_reduce(t, group=sp.sp_group)
            out[n] = t
        return out

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    # (B, T', H', W'): video with an odd token count (3x3x5 = 45 -> padded to 46), an image with 15
    # tokens, an even image (1x4x6), one token (rank 1 holds only padding); per-token timesteps (the
    # modulation is sharded with the tokens)
    # last field: checkpointed blocks keep their self-attention output (recompute.attention keep: the
    # local SDPA inside DistributedAttention is kept, the all-to-alls run again in the recompute)
    # and a last one with block fusion 'regions' (adaptive_load.block_fusion, on in the shipped config): the fused
    # pieces traced by dynamo on the SP shard's shapes and RoPE rows (aot_eager here: Inductor's numerics have
    # their own tests)
    from ds_adaptive.models import fusion, wan_blocks
    fusion.compiled = lambda name: torch.compile(getattr(wan_blocks, name), backend="aot_eager", dynamic=True, fullgraph=True)
    cases = [(2, 3, 6, 10, False, False, False, False), (1, 1, 6, 10, False, False, False, False),
             (3, 1, 8, 12, False, False, False, False), (1, 1, 2, 2, False, False, False, False),
             (2, 3, 6, 10, True, False, False, False), (2, 3, 6, 10, False, True, False, False),
             (2, 3, 6, 10, True, False, True, False), (2, 3, 6, 10, True, True, True, False)]
    if FUSED:  # one family: the fused pieces are the same functions for every WanModel config (half this test's time)
        cases.append((2, 3, 6, 10, True, True, False, True))
    for B, T, H, W, ckpt, per_token, keep, fused in cases:
        model.gradient_checkpointing = ref.gradient_checkpointing = ckpt
        model.set_checkpoint_attention("keep" if keep else "recompute")
        model.apply_block_fusion("regions" if fused else "off")
        lat = torch.randn(B, C, T, H, W, generator=g)
        t = torch.rand(B, T * (H // 2) * (W // 2) if per_token else 1, generator=g).squeeze(1) * 1000
        ctx = torch.randn(B, 7, TD, generator=g)
        tgt = torch.randn(B, C, T, H, W, generator=g)
        w = torch.rand(B, generator=g) + 0.5
        ref.zero_grad(); model.zero_grad()
        out_ref = ref(lat, t, ctx)
        loss_ref = (out_ref.float() - tgt).square().flatten(1).mean(1)
        (loss_ref * w).sum().backward()
        g_ref = {n: p.grad.clone() for n, p in ref.named_parameters()}

        # 1. gathered output == SP=1 output
        with torch.no_grad():
            out = model(lat, t, ctx)
        assert out.shape == out_ref.shape and torch.allclose(out, out_ref, atol=2e-6), (B, T, H, W)
        # 2. loss on shards: partial losses sum over the group to the full per-sample loss; all gradients
        part = per_sample_mse(model(lat, t, ctx, local=True), tgt)
        total = part.detach().clone(); dist.all_reduce(total, group=sp.sp_group)
        assert torch.allclose(total, loss_ref.detach(), rtol=1e-5, atol=1e-7), (total, loss_ref)
        (part * w).sum().backward()
        summed = grads_summed_over_group(model)
        worst = max((rel(summed[n], g_ref[n]), n) for n in g_ref)
        assert worst[0] < 2e-5, ((B, T, H, W), worst)
        if T * H * W > 4:   # negative control: one rank's gradient alone is not the full gradient
            assert rel(dict(model.named_parameters())["blocks.0.self_attn.q.weight"].grad,
                       g_ref["blocks.0.self_attn.q.weight"]) > 1e-2
        # 3. loss on the gathered output (identical on both ranks): slice-backward gives the same gradients
        model.zero_grad()
        ((model(lat, t, ctx).float() - tgt).square().flatten(1).mean(1) * w).sum().backward()
        summed = grads_summed_over_group(model)
        worst = max((rel(summed[n], g_ref[n]), n) for n in g_ref)
        assert worst[0] < 2e-5, ((B, T, H, W), "gathered", worst)
        if rank == 0:
            print("case", (B, T, H, W, ckpt, per_token, keep, fused), "ok", flush=True)
    model.apply_block_fusion("off")
    from torch._dynamo.utils import counters
    assert not FUSED or counters["stats"]["unique_graphs"] >= 3, dict(counters["stats"])   # the fused case compiled

    # negative control: padded keys NOT masked (local attention ignores valid_len) changes the output
    lat, t, ctx = torch.randn(1, C, 3, 6, 10, generator=g), torch.tensor([500.0]), torch.randn(1, 7, TD, generator=g)
    with torch.no_grad():
        good = model(lat, t, ctx)
        bad_model = copy.deepcopy(model)
        bad_model.set_attention(make_ulysses_attention(sp, lambda q, k, v, valid_len=None: sdpa_attention(q, k, v)))
        bad = bad_model(lat, t, ctx)
    assert (bad - good).abs().max() > 1e-3, "padding must be masked out of attention"
    # a deepcopy (EMA) of a model under Ulysses runs its own weights over the same groups
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(twin(lat, t, ctx), good)
        twin.head.head.bias.add_(1.0)
        assert torch.allclose(twin(lat, t, ctx), good + 1.0, atol=1e-5) and torch.equal(model(lat, t, ctx), good)

    # replicated inputs: identical passes, a per-rank difference is named
    sp.assert_replicated(lat, t, ctx)
    try:
        sp.assert_replicated(lat, t + rank, what="the timesteps")
        raise AssertionError("different timesteps on the SP ranks were not detected")
    except SequenceParallelError as exc:
        assert "the timesteps differs between SP ranks" in str(exc) and "tensor(s) [1] of 2" in str(exc), exc
    assert torch.equal(sp.group_sum(torch.full((2,), float(rank + 1))), torch.full((2,), 3.0))

    # check_engine: what DeepSpeed 0.19.8 does with SP (fake engines carrying the attributes it reads)
    class Engine:
        def __init__(self, stage, ds_sp=1, rs=True, seq_dp=2):
            self.stage, self.sequence_parallel_size, self.rs, self.seq_dp_world_size = stage, ds_sp, rs, seq_dp
            self.module = model
        def zero_optimization_stage(self):
            return self.stage
        def zero_reduce_scatter(self):
            return self.rs
    assert sp.check_engine(Engine(2)) == 2.0 and sp.check_engine(Engine(0)) == 2.0
    assert sp.check_engine(Engine(3)) == 2.0   # plain parameters: no ds_process_group, the world
    for engine, msg in [(Engine(2, ds_sp=2), "ZeRO stage 2 with DeepSpeed's (dp, sp) mesh"),
                        (Engine(3, ds_sp=2, rs=False), "reduce_scatter=false"),
                        (Engine(3, ds_sp=4), "sequence_parallel_size=4 but the SP groups have sp=2"),
                        (Engine(1, seq_dp=1), "reduces gradients over 1 ranks, not the world (2)")]:
        try:
            sp.check_engine(engine)
            raise AssertionError(f"check_engine accepted {vars(engine)}")
        except SequenceParallelError as exc:
            assert msg in str(exc), (msg, str(exc))
    if rank == 0:
        print("ULYSSES_SP2_OK", flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("model", TINY_MODELS)
def test_sp2_equals_sp1_outputs_losses_and_gradients(tmp_path: Path, model: str) -> None:
    script = tmp_path / "ulysses_sp2.py"
    fused = model == TINY_MODELS[0]
    script.write_text(f"MODEL = {model!r}\nFUSED = {fused}\n" + SCRIPT)
    env = {"PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": os.environ.get(
        "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))}
    results = launch_ranks([str(script)], 2, cwd=tmp_path, timeout=240, env=env)
    out = results[0].stdout
    assert "ULYSSES_SP2_OK" in out and out.count(" ok") == 8 + fused, out[-4000:]


MEGATRON = textwrap.dedent("""
    import copy, os, warnings
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")          # plain torch.distributed: deepspeed.comm gets attached by us
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(context_parallel_size=2, create_gloo_process_groups=True)
    from ds_adaptive.models.testing import random_init_
    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.core.layout import Layout, SequenceParallelError
    from ds_adaptive.parallel import apply_ulysses

    sp = Layout.detect()
    assert (sp.source, sp.sp_size, sp.sp_rank, sp.dp_size) == ("megatron", 2, dist.get_rank(), 1), sp
    try:
        Layout.detect(4)
        raise AssertionError("a degree different from megatron's context_parallel_size was accepted")
    except SequenceParallelError as exc:
        assert "context_parallel_size=2" in str(exc), exc
    ref = random_init_(WanModel("tiny"), seed=4)
    model = copy.deepcopy(ref)
    apply_ulysses(model, sp)
    g = torch.Generator().manual_seed(0)
    lat, t, ctx = torch.randn(1, 16, 3, 6, 10, generator=g), torch.tensor([250.0]), torch.randn(1, 5, 4096, generator=g)
    with torch.no_grad():
        assert torch.allclose(model(lat, t, ctx), ref(lat, t, ctx), atol=2e-6)
    if dist.get_rank() == 0:
        print("ULYSSES_MEGATRON_OK", flush=True)
""")


@pytest.mark.slow
def test_megatron_context_parallel_groups(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is optional")
    script = tmp_path / "ulysses_megatron.py"
    script.write_text(MEGATRON)
    env = {"PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": os.environ.get(
        "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))}
    results = launch_ranks([str(script)], 2, cwd=tmp_path, timeout=240, env=env)
    assert "ULYSSES_MEGATRON_OK" in results[0].stdout, results[0].stdout[-4000:]
