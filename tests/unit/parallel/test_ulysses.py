"""Guards Ulysses SP in one process: shard/pad math, valid-length attention, config/group resolution, and SP=1 being
the plain model. SP=2 == SP=1 on 2 gloo ranks is in tests/integration/test_ulysses_launch.py."""
from __future__ import annotations

import copy
import os

import pytest
import torch

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
