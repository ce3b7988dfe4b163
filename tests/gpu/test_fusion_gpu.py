"""Block fusion on a GPU (``adaptive_load.block_fusion``, on in the shipped Wan 1.3B config):
- Inductor's triton kernels for the fused pieces match an fp64 reference, forward and backward, on awkward sizes
  and at Wan 1.3B's width: within twice torch's own low-precision error, plus a few fp32 ulps for another
  summation order;
- after ``warm_up`` for a plan's (B, tokens) pairs, training steps of those sizes compile no new graph with the
  real Inductor (its element-count guards are what the CPU test's aot_eager counter cannot see)."""
from __future__ import annotations

import pytest
import torch

from ds_adaptive.models import fusion
from ds_adaptive.models.testing import block_fusion_errors
from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.wan_config import get_wan_config

DEVICE = "cuda"


@pytest.mark.parametrize("size", [(2, 37, 3, 12), (1, 1561, 12, 128), (3, 255, 5, 24)],
                         ids=["odd-tiny", "wan1.3b-width", "odd-heads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_matches_fp64_within_torchs_own_error(dtype, size):
    for name, i, err, eager_err, ref_max in block_fusion_errors(dtype, size, DEVICE):
        # every piece accumulates in fp32: a different summation order (Inductor's reductions over B x S tokens for
        # the weight and gate gradients) may cost up to 64 fp32 ulps of the largest value beyond that
        bound = 2 * eager_err + 64 * torch.finfo(torch.float32).eps * ref_max + 1e-12
        assert err <= bound, (name, dtype, size, i, err, bound)


def _model(dtype):
    torch.manual_seed(0)
    m = WanModel(get_wan_config("tiny", num_layers=2))
    with torch.no_grad():   # the zero-initialised head would hide every difference upstream
        m.head.head.weight.normal_(std=0.05)
    return m.to_dtype(dtype).to(DEVICE)


STEPS = [(1, 3, 6, 10), (3, 1, 4, 6), (2, 5, 8, 4), (1, 1, 6, 6), (3, 5, 8, 4)]   # B, frames, h, w (h, w: pixels / 8)


def _train_steps(m, dtype, steps=STEPS):
    for B, frames, h, w in steps:
        g = torch.Generator().manual_seed(B * 100 + frames)
        lat = torch.randn(B, 16, frames, h, w, generator=g).to(device=DEVICE, dtype=dtype)
        t = (torch.rand(B, generator=g) * 1000).to(DEVICE)
        ctx = torch.randn(B, 7, 4096, generator=g).to(device=DEVICE, dtype=dtype)
        m.zero_grad(set_to_none=True)
        loss = m(lat, t, ctx).float().square().mean()
        loss.backward()
        assert torch.isfinite(loss)


def test_warm_up_then_training_compiles_no_graph_with_inductor():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]   # a process-wide count: earlier tests add to it
    try:
        m = _model(torch.bfloat16)
        fusion.apply_block_fusion(m, "regions")
        pairs = [(B, f * (h // 2) * (w // 2)) for B, f, h, w in STEPS]
        spent = m.warm_up_block_fusion(pairs, dtype=torch.bfloat16, device=torch.device(DEVICE))
        assert spent > 0
        warmed = counters["stats"]["unique_graphs"]
        # on CUDA the q/k norm + RoPE is the Triton kernel: the gated residual x (B = 1, B >= 2) are compiled
        assert warmed - before >= 2
        _train_steps(m, torch.bfloat16)
        assert counters["stats"]["unique_graphs"] == warmed, \
            f"a training step compiled {counters['stats']['unique_graphs'] - warmed} more graph(s)"
    finally:
        torch._dynamo.reset()
