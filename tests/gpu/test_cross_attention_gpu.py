"""Cross-attention with the queries in chunks on the GPU (``ds_adaptive.models.cross_attention``): bf16 forward and
backward as close to an fp64 reference as one SDPA call is, on awkward sizes (chunks of odd length, text
lengths off the kernels' 128-key blocks), and the policy splitting one long sample on this GPU."""
from __future__ import annotations

import pytest
import torch

from ds_adaptive.models import cross_attention as ca


def _err(got, want):
    return (got.double() - want).abs().max().item()


@pytest.mark.parametrize("b,s,l,n", [(1, 8190, 512, 3), (2, 4098, 77, 2), (1, 6147, 300, 3)])
def test_chunked_bf16_is_as_close_to_fp64_as_one_call(monkeypatch, b, s, l, n):
    monkeypatch.delenv(ca.ENV, raising=False)
    g = torch.Generator(device="cuda").manual_seed(s)
    q, k, v, dout = (torch.randn(b, m, 12, 128, device="cuda", generator=g) for m in (s, l, l, s))
    ref_in = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = ca.cross_attention(*ref_in, chunks=1)
    gref = torch.autograd.grad(ref, ref_in, dout.double())
    results = {}
    for chunks in (1, n):
        x = [t.bfloat16().requires_grad_(True) for t in (q, k, v)]
        out = ca.cross_attention(*x, chunks=chunks)
        assert torch.isfinite(out).all()
        grads = torch.autograd.grad(out, x, dout.bfloat16())
        results[chunks] = [_err(out, ref)] + [_err(a, w) for a, w in zip(grads, gref)]
    scale = [ref.abs().max().item()] + [w.abs().max().item() for w in gref]
    for one, split, mag in zip(results[1], results[n], scale):
        assert split <= 3 * one + 1e-3 * mag, (results, scale)


def test_the_policy_splits_one_long_sample_on_this_gpu(monkeypatch):
    monkeypatch.delenv(ca.ENV, raising=False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = ca.query_chunks(1, 32760, 12, 512, torch.device("cuda", 0))
    assert (n > 1) == (sms > 48), (sms, n)
    assert ca.query_chunks(11, 1560, 12, 512, torch.device("cuda", 0)) == 1
