"""Guards Ulysses SP: shard/pad math, valid-length attention, config/group resolution, and SP=2 == SP=1 (outputs, losses, all gradients; per-sample and per-token timesteps) on 2 gloo ranks, for each model family's tiny model."""
from __future__ import annotations

import copy
import os
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY_MODELS, launch_ranks
from ds_adaptive.models.testing import random_init_
from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.wan_blocks import sdpa_attention
from ds_adaptive.core.layout import Layout, SequenceParallelError, resolve_sp_size, strip_mesh_keys
from ds_adaptive.models.objective import per_sample_mse
from ds_adaptive.parallel import (apply_ulysses, remove_ulysses, shard_plan, shard_sequence,
                                  valid_len_attention)


def _single(sp_size: int = 1, sp_rank: int = 0) -> Layout:
    return Layout.explicit(sp_size=sp_size, sp_rank=sp_rank)


# ------------------------------------------------------------------------------ shard math
@pytest.mark.parametrize("seq_len", [1, 2, 7, 15, 16, 97, 1025])
@pytest.mark.parametrize("sp", [1, 2, 3, 4, 8])
def test_shards_tile_the_padded_sequence(seq_len: int, sp: int) -> None:
    shards = [shard_plan(seq_len, _single(sp, r)) for r in range(sp)]
    assert shards[0].padded_len % sp == 0 and 0 <= shards[0].pad < sp
    assert [s.start for s in shards] == [r * shards[0].local_len for r in range(sp)]
    assert sum(s.valid for s in shards) == seq_len
    # real tokens are a prefix of each shard, and only the tail ranks hold padding
    valid = [s.valid for s in shards]
    assert valid == sorted(valid, reverse=True)
    assert all(s.attn_kwargs == ({"valid_len": seq_len} if s.pad else {}) for s in shards)


def test_shard_sequence_pads_with_zeros_and_copies() -> None:
    x = torch.randn(2, 15, 3)
    parts = [shard_sequence(x, shard_plan(15, _single(2, r))) for r in range(2)]
    assert [p.shape[1] for p in parts] == [8, 8]
    assert torch.equal(torch.cat(parts, 1)[:, :15], x)
    assert torch.equal(parts[1][:, 7:], torch.zeros(2, 1, 3))
    assert parts[0].data_ptr() != x.data_ptr()  # a copy: the full tensor can be freed
    rope = torch.randn(15, 4, 2)  # dim 0, like the rotary table
    r1 = shard_sequence(rope, shard_plan(15, _single(2, 1)), dim=0)
    assert torch.equal(r1[:7], rope[8:]) and torch.equal(r1[7:], torch.zeros(1, 4, 2))
    # a rank with only padding (S=1, sp=4)
    assert torch.equal(shard_sequence(torch.ones(1, 1, 2), shard_plan(1, _single(4, 3))), torch.zeros(1, 1, 2))
    # gradient: scattered into zeros
    x.requires_grad_(True)
    shard_sequence(x, shard_plan(15, _single(2, 1))).sum().backward()
    assert torch.equal(x.grad[:, 8:], torch.ones(2, 7, 3)) and torch.equal(x.grad[:, :8], torch.zeros(2, 8, 3))
    with pytest.raises(ValueError, match="14 positions"):
        shard_sequence(torch.zeros(1, 14, 3), shard_plan(15, _single(2, 0)))


# ------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("valid,total", [(15, 16), (59, 64), (97, 100), (1, 4), (16, 16)])
def test_valid_len_attention_equals_masked_and_unpadded(valid: int, total: int) -> None:
    g = torch.Generator().manual_seed(valid)
    q, k, v = (torch.randn(2, total, 3, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = valid_len_attention(q, k, v, valid_len=valid)
    masked = sdpa_attention(q, k, v, valid_len=valid)
    unpadded = sdpa_attention(q[:, :valid], k[:, :valid], v[:, :valid])
    assert torch.allclose(out[:, :valid], masked[:, :valid], atol=1e-12)
    assert torch.allclose(out[:, :valid], unpadded, atol=1e-12)
    assert torch.equal(out[:, valid:], torch.zeros_like(out[:, valid:]))
    if valid < total:  # negative control: attending to the padded keys changes the real rows
        assert not torch.allclose(sdpa_attention(q, k, v)[:, :valid], unpadded, atol=1e-6)
    # gradients of real rows equal the unpadded ones; padded keys/values get none
    gq = torch.autograd.grad(out[:, :valid].sum(), (q, k, v))
    gu = torch.autograd.grad(unpadded.sum(), (q, k, v))
    for a, b in zip(gq, gu):
        assert torch.allclose(a, b, atol=1e-12)
    with pytest.raises(ValueError, match="valid_len must be >= 1"):
        valid_len_attention(q, k, v, valid_len=0)


# ------------------------------------------------------------------------------ configuration
def test_resolve_sp_size_and_mesh_keys() -> None:
    assert resolve_sp_size(None, {}, 8) == 1
    assert resolve_sp_size(2, None, 8) == 2
    assert resolve_sp_size(None, {"sequence_parallel_size": 4}, 8) == 4
    assert resolve_sp_size(4, {"sequence_parallel_size": 4, "data_parallel_size": 2}, 8) == 4
    with pytest.raises(SequenceParallelError, match=r"--sp 2 but the ds_config has sequence_parallel_size=4"):
        resolve_sp_size(2, {"sequence_parallel_size": 4}, 8)
    with pytest.raises(SequenceParallelError, match=r"world size 6 .* not divisible by the Ulysses degree sp=4"):
        resolve_sp_size(4, {}, 6)
    with pytest.raises(SequenceParallelError, match=r"data_parallel_size=4 x sp=2 = 8 but the world has 4"):
        resolve_sp_size(2, {"data_parallel_size": 4}, 4)
    with pytest.raises(SequenceParallelError, match="sequence_parallel_size' must be an int >= 1"):
        resolve_sp_size(None, {"sequence_parallel_size": "2"}, 4)
    cfg = {"train_batch_size": 8, "data_parallel_size": 2, "sequence_parallel_size": 2}
    assert strip_mesh_keys(cfg) == {"train_batch_size": 8} and "data_parallel_size" in cfg


def test_layout_validate_names_the_valid_degrees() -> None:
    assert _single(4).validate(num_heads=12).sp_size == 4
    with pytest.raises(SequenceParallelError, match=r"sp=8 does not divide the 12 attention heads.*\[1, 2, 3, 4, 6, 12\]"):
        _single(8).validate(num_heads=12)
    with pytest.raises(SequenceParallelError, match="sp_size must be an int >= 1"):
        _single(0)
    with pytest.raises(SequenceParallelError, match="does not divide the 2 attention heads"):
        apply_ulysses(WanModel("tiny"), _single(4))
    assert Layout.for_world(8, 2, rank=5) == Layout.explicit(dp_size=4, sp_size=2, dp_rank=2, sp_rank=1)
    with pytest.raises(SequenceParallelError, match="world size 6 .* not divisible by the Ulysses degree sp=4"):
        Layout.for_world(6, 4)


_SINGLE_PROCESS_CHECK = """
import torch
from ds_adaptive.core.layout import Layout, SequenceParallelError
assert not torch.distributed.is_initialized()
sp = Layout.detect()
assert (sp.sp_size, sp.sp_rank, sp.dp_size, sp.dp_rank, sp.source) == (1, 0, 1, 0, "explicit"), sp
assert not sp.sp_enabled and sp.loss_scale == 1.0
t = sp
assert (t.dp_rank, t.dp_size, t.sp_rank, t.sp_size) == (0, 1, 0, 1), t
try:
    Layout.detect(2)
except SequenceParallelError as e:
    assert "sp=2 needs torch.distributed" in str(e), e
else:
    raise AssertionError("sp=2 without torch.distributed must raise")
print("ok")
"""


def test_single_process_layout() -> None:
    """Without torch.distributed: sp 1, dp 1; sp=2 is a clear error. Run in a fresh interpreter, since
    other tests of the session may have initialised a process group in this one."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-c", _SINGLE_PROCESS_CHECK], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_apply_ulysses_sp1_is_the_plain_model() -> None:
    torch.manual_seed(0)
    model = random_init_(WanModel("tiny"), seed=2)
    g = torch.Generator().manual_seed(0)
    lat, t = torch.randn(2, 16, 3, 6, 10, generator=g), torch.tensor([100.0, 700.0])
    ctx, target = torch.randn(2, 5, 4096, generator=g), torch.randn(2, 16, 3, 6, 10, generator=g)
    ref = model(lat, t, ctx)
    keys = list(model.state_dict())
    apply_ulysses(model, _single())
    apply_ulysses(model, _single())  # idempotent
    assert model.sequence_parallel is None  # sp=1: the plain model runs
    assert list(model.state_dict()) == keys  # parameter names unchanged
    assert torch.equal(model(lat, t, ctx), ref)
    loss = per_sample_mse(model(lat, t, ctx, local=True), target)
    assert loss.shape == (2,) and loss.dtype == torch.float32
    assert torch.allclose(loss, (ref - target).square().flatten(1).mean(1), rtol=1e-6)
    with pytest.raises(ValueError, match="differ in shape"):
        per_sample_mse(model(lat, t, ctx, local=True), target[:, :, :1])
    twin = copy.deepcopy(model)  # e.g. an EMA copy: it must run its own weights, not the original's
    with torch.no_grad():
        twin.head.head.bias.add_(1.0)
    assert torch.equal(model(lat, t, ctx), ref)
    assert torch.allclose(twin(lat, t, ctx), ref + 1.0, atol=1e-5)
    remove_ulysses(model)
    assert "forward" not in model.__dict__ and torch.equal(model(lat, t, ctx), ref)


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
