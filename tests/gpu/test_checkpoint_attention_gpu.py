"""Guards `recompute.attention: keep` on a GPU, bf16, with each fused SDPA backend torch picks there (cuDNN,
flash, memory-efficient): the self-attention core runs once per checkpointed block in backward, the gradients equal
the recompute's, and the extra memory a checkpointed block holds is what the cost model counts."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ds_adaptive.models.testing import AttentionCalls
from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.wan_config import get_wan_config
from ds_adaptive.models.recompute import kept_attention_bytes_per_token

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _model(layers: int = 4) -> WanModel:
    torch.manual_seed(0)
    cfg = get_wan_config("tiny", num_layers=layers, dim=256, num_heads=2, ffn_dim=512)   # head dim 128, as Wan's
    return WanModel(cfg).to("cuda", torch.bfloat16)


def _inputs(frames=5, h=30, w=52):   # 5 x 15 x 26 = 1,950 tokens (not a multiple of any tile)
    g = torch.Generator(device="cuda").manual_seed(1)
    lat = torch.randn(1, 16, frames, h, w, generator=g, device="cuda", dtype=torch.bfloat16)
    t = torch.tensor([420.0], device="cuda")
    ctx = torch.randn(1, 11, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
    return lat, t, ctx


def _step(model, mode, n, backend, count=False):
    m = copy.deepcopy(model)
    m.set_checkpoint_attention(mode)
    m.set_checkpoint_blocks(n)
    lat, t, ctx = _inputs()
    with sdpa_kernel([BACKENDS[backend], SDPBackend.MATH]):
        loss = m(lat, t, ctx).float().square().mean()
        counter = AttentionCalls()
        if count:
            with counter:
                loss.backward()
        else:
            loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), [p.grad.float() for p in m.parameters()], counter.calls


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_keep_runs_the_self_attention_once_with_the_recompute_gradients(backend):
    model = _model()
    ref_loss, ref_grads, rec_calls = _step(model, "recompute", 4, backend, count=True)
    loss, grads, keep_calls = _step(model, "keep", 4, backend, count=True)
    assert rec_calls == 8 and keep_calls == 4, (rec_calls, keep_calls)   # only the cross-attention runs again
    assert torch.equal(loss, ref_loss)
    for a, b in zip(grads, ref_grads):   # the same kernels on the same inputs: equal up to atomics in bf16 backward
        assert (a - b).norm() <= 1e-2 * b.norm() + 1e-6


def test_keep_holds_the_counted_bytes_per_checkpointed_block():
    """Peak memory of a step with every block checkpointed: keep - recompute is at most the kept bytes of the
    blocks (output + log-sum-exp per token) plus allocator rounding, and the step still fits."""
    model = _model(layers=6)
    dim, heads = model.config.dim, model.config.num_heads
    tokens = 5 * 15 * 26
    peaks = {}
    for mode in ("recompute", "keep"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(model, mode, 6, "cudnn")
        peaks[mode] = torch.cuda.max_memory_allocated() - base
    kept = 6 * kept_attention_bytes_per_token(dim, heads) * tokens
    assert peaks["keep"] - peaks["recompute"] <= kept + 6 * 2 * 2**20, (peaks, kept)


@pytest.mark.parametrize("backend", ["triton", "flex"])
def test_keep_in_a_sparse_run_equals_recompute(backend):
    """Sparse attention (layer 0 dense, SDPA: kept; layers 1-2 block-sparse: recomputed) with every block
    checkpointed: keep gives the recompute's loss and gradients on each block-sparse kernel backend."""
    from ds_adaptive.models.testing import random_init_
    from ds_adaptive.attention.runtime import SparseAttentionRuntime

    def step(mode):
        model = random_init_(WanModel(get_wan_config("tiny", num_layers=3, dim=256, num_heads=2, ffn_dim=512)),
                             seed=0).to("cuda").to_dtype(torch.bfloat16)
        model.gradient_checkpointing = True
        model.set_checkpoint_attention(mode)
        rt = SparseAttentionRuntime({"forced_density": 0.25, "dense_layers": [0], "backend": backend}, num_layers=3,
                                    num_heads=2, head_dim=128, device=torch.device("cuda"))
        rt.install(model)
        g = torch.Generator(device="cuda").manual_seed(0)
        lat = torch.randn(2, 16, 5, 32, 48, device="cuda", generator=g)  # 5 x 16 x 24 = 1,920 tokens
        out = model(lat, torch.tensor([100.0, 700.0], device="cuda"), torch.randn(2, 8, 4096, device="cuda", generator=g))
        loss = out.float().square().mean()
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), [p.grad.float() for p in model.parameters() if p.grad is not None]

    ref_loss, ref_grads = step("recompute")
    loss, grads = step("keep")
    assert torch.equal(loss, ref_loss) and len(grads) == len(ref_grads)
    for a, b in zip(grads, ref_grads):
        assert (a - b).norm() <= 1e-2 * b.norm() + 1e-6
