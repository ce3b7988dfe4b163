"""Cross-attention with the queries split into chunks (``ds_adaptive.models.cross_attention``): the same attention
and gradients as one call (fp64, awkward sizes), the chunk policy, its environment override, and the model's
cross-attention going through it."""
from __future__ import annotations

import pytest
import torch

from ds_adaptive.models import cross_attention as ca


def _inputs(b, s, l, h=3, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.float64, generator=g).requires_grad_(True) for n in (s, l, l))
    return q, k, v, torch.randn(b, s, h, d, dtype=torch.float64, generator=g)


def _reference(q, k, v):
    """Softmax attention written out in fp64: [B, S, H, Dh] over all L keys."""
    w = torch.einsum("bshd,blhd->bhsl", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("bhsl,blhd->bshd", w.softmax(-1), v)


@pytest.mark.parametrize("b,s,l,n", [(1, 24, 5, 3), (2, 30, 7, 5), (3, 7, 1, 7), (1, 33, 9, 11), (2, 6, 4, 1)])
def test_chunks_give_the_attention_and_gradients_of_one_call(b, s, l, n):
    q, k, v, dout = _inputs(b, s, l)
    ref = _reference(q, k, v)
    gref = torch.autograd.grad(ref, (q, k, v), dout)
    out = ca.cross_attention(q, k, v, chunks=n)
    assert out.shape == q.shape
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout), gref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_count_that_does_not_divide_the_queries_is_refused():
    q, k, v, _ = _inputs(1, 10, 3)
    with pytest.raises(ValueError, match="3 chunks do not divide 10 queries"):
        ca.cross_attention(q, k, v, chunks=3)


@pytest.mark.parametrize("b,s,want", [
    (1, 32760, 6),    # one 81x480x832 video: 48 thread blocks on 132 SMs -> 6 chunks of 5,460
    (1, 75600, 6),
    (1, 14040, 3),    # 14,040 // 4,096 = 3 chunks at most
    (1, 18000, 4),
    (2, 7800, 1),     # 96 blocks want 3, but a chunk would hold 2,600 < 4,096 queries
    (4, 4096, 1),
    (11, 1560, 1),    # an image micro-batch fills the GPU already
    (1, 8209, 1),     # prime: nothing divides
])
def test_the_policy_splits_only_where_the_gpu_is_starved(monkeypatch, b, s, want):
    monkeypatch.delenv(ca.ENV, raising=False)
    monkeypatch.setattr(ca, "_sm_count", lambda index: 132)
    assert ca.query_chunks(b, s, 12, 512, torch.device("cuda", 0)) == want
    assert ca.query_chunks(b, s, 12, 512, torch.device("cpu")) == 1   # the math path has no such limit


def test_the_environment_caps_or_turns_off_the_split_and_a_bad_value_is_one_line(monkeypatch):
    monkeypatch.setattr(ca, "_sm_count", lambda index: 132)
    monkeypatch.setenv(ca.ENV, "1")
    assert ca.query_chunks(1, 32760, 12, 512, torch.device("cuda", 0)) == 1
    monkeypatch.setenv(ca.ENV, "4")
    assert ca.query_chunks(1, 30, 12, 512, torch.device("cpu")) == 3   # the largest divisor up to 4
    for bad in ("0", "two", "-3"):
        monkeypatch.setenv(ca.ENV, bad)
        with pytest.raises(ValueError, match=f"{ca.ENV}='{bad}': expected 'auto' or a positive integer"):
            ca.query_chunks(1, 30, 12, 512, torch.device("cpu"))


def test_the_models_cross_attention_goes_through_the_split(monkeypatch):
    from ds_adaptive.models.wan import WanModel

    torch.manual_seed(0)
    model = WanModel("tiny").double()
    blk = model.blocks[0].cross_attn
    x = torch.randn(2, 12, blk.q.in_features, dtype=torch.float64)
    ctx = torch.randn(2, 5, x.shape[-1], dtype=torch.float64)
    calls = []
    real = ca.F.scaled_dot_product_attention
    monkeypatch.setattr(ca.F, "scaled_dot_product_attention",
                        lambda q, *a, **kw: (calls.append(tuple(q.shape)), real(q, *a, **kw))[1])
    monkeypatch.setenv(ca.ENV, "1")
    one = blk(x, ctx)
    monkeypatch.setenv(ca.ENV, "4")
    four = blk(x, ctx)
    assert calls == [(2, blk.num_heads, 12, x.shape[-1] // blk.num_heads),
                     (8, blk.num_heads, 3, x.shape[-1] // blk.num_heads)]
    torch.testing.assert_close(four, one, rtol=1e-10, atol=1e-12)
