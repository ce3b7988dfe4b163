"""Guards the Ulysses head placement in one process: the wrapper equals plain attention (values and gradients),
passes the rank's original head ids, and the sparse balance feeds the sampler and the model. SP = 2 == SP = 1 on 2
gloo ranks is in tests/integration/test_head_placement_launch.py."""
from __future__ import annotations

import pytest
import torch

from ds_adaptive.parallel.placement import HeadPlacement, PlacementError
from ds_adaptive.models.testing import random_init_
from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.wan_blocks import sdpa_attention
from ds_adaptive.models.wan_config import get_wan_config
from ds_adaptive.core.layout import Layout
from ds_adaptive.parallel.head_placement import (apply_head_placement, current_placement, permute_heads, place_heads,
                                                 remove_head_placement)


@pytest.mark.parametrize("perm", [[2, 0, 3, 1, 5, 4], [5, 4, 3, 2, 1, 0]])
def test_placed_attention_equals_plain_attention_and_gradients(perm):
    g = torch.Generator().manual_seed(len(perm) + perm[0])
    q, k, v = (torch.randn(2, 37, 6, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    seen = []

    def core(q, k, v, head_ids=None):
        seen.append(head_ids)
        return sdpa_attention(q, k, v)

    placed = place_heads(core, perm, sp_size=3, sp_rank=1, head_ids_kwarg="head_ids")
    out = placed(q, k, v)
    ref = sdpa_attention(q, k, v)
    assert torch.allclose(out, ref, atol=1e-13)
    assert seen == [tuple(perm[2:4])]                               # rank 1 of 3 holds positions 2..3
    ga = torch.autograd.grad(out.square().sum(), (q, k, v))
    gb = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(ga, gb))
    # what the core sees is the permuted head axis
    x = torch.arange(6.0).view(1, 1, 6, 1)
    assert permute_heads(x, perm).flatten().tolist() == [float(h) for h in perm]
    # negative control: permuting without restoring is not attention of the original heads
    assert not torch.allclose(core(*(permute_heads(t, perm) for t in (q, k, v))), ref)
    assert place_heads(core, None) is core and place_heads(core, list(range(6)), sp_size=2) is core
    with pytest.raises(PlacementError, match="not a permutation"):
        place_heads(core, [0, 0, 1, 2, 3, 4], sp_size=2)


def test_apply_and_remove_on_the_model():
    cfg = get_wan_config("tiny", num_heads=4)
    model = random_init_(WanModel(cfg), seed=2)
    sp = Layout.explicit(sp_size=2, sp_rank=0)
    pl = HeadPlacement(sp=2, perms=((1, 3, 0, 2), None))
    g = torch.Generator().manual_seed(0)
    lat, t, ctx = torch.randn(1, 16, 2, 4, 6, generator=g), torch.tensor([300.0]), torch.randn(1, 5, 4096, generator=g)
    with torch.no_grad():
        ref = model(lat, t, ctx)
        apply_head_placement(model, pl, sp)
        assert current_placement(model) is pl
        assert model.blocks[0].attn_fn.perm == (1, 3, 0, 2) and model.blocks[1].attn_fn is model.attention_fn
        assert torch.allclose(model(lat, t, ctx), ref, atol=1e-6)   # one process: placement changes nothing
        apply_head_placement(model, None, sp)
        assert all(b.attn_fn is model.attention_fn for b in model.blocks)
        apply_head_placement(model, pl, sp)
        remove_head_placement(model)
        assert all(b.attn_fn is model.attention_fn for b in model.blocks) and current_placement(model) is None
    with pytest.raises(ValueError, match="planned for sp=4, the SP group has sp=2"):
        apply_head_placement(model, HeadPlacement(sp=4, perms=(None, None)), sp)
    with pytest.raises(ValueError, match="3 layers, the model 2 blocks"):
        apply_head_placement(model, HeadPlacement(sp=2, perms=(None,) * 3), sp)


def test_update_sparse_balance_feeds_sampler_and_model():
    import warnings

    from ds_adaptive.planning.sampler import build_batch_sampler
    from ds_adaptive.planning.sparse_cost import SparseAttentionCost
    from ds_adaptive.core.contracts import DensityMap, synthetic_densities
    from ds_adaptive.core.config import SamplerConfig
    from ds_adaptive.core.shapes import load_shape_distribution
    from ds_adaptive.parallel.head_placement import update_sparse_balance

    model = random_init_(WanModel(get_wan_config("tiny", num_heads=4)), seed=1)
    sp = Layout.explicit(sp_size=2, sp_rank=1)
    dm = DensityMap(((0.5, 0.4, 0.05, 0.02), (0.6, 0.5, 0.03, 0.04)))
    pl = update_sparse_balance(dm, model=model, sp=sp)
    assert pl is not None and current_placement(model) is pl and model.blocks[0].attn_fn.perm == pl.perms[0]
    assert update_sparse_balance(dm, model=model, sp=sp, enabled=False) is None
    assert all(b.attn_fn is model.attention_fn for b in model.blocks)
    with pytest.raises(ValueError, match="needs sp"):
        update_sparse_balance(dm, model=model)
    shapes = [d.shape for d in load_shape_distribution()] * 20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampler = build_batch_sampler(SamplerConfig(window=16), shapes, Layout.explicit(dp_size=2), micro_steps_per_step=1,
                                      sparse=SparseAttentionCost(synthetic_densities(30, 12, seed=0)))
    old, new = synthetic_densities(30, 12, seed=0), synthetic_densities(30, 12, seed=1)
    assert update_sparse_balance(new, sampler=sampler, measured_at=100) is None
    sampler.set_epoch(1)
    upd = sampler.density_updates[-1]
    assert upd["measured_at"] == 100 and upd["fingerprint"] == new.fingerprint()
    # the sampler re-plans with the new densities unless its running plan is predicted faster under them, with the
    # loop terms or on compute alone
    tps, ctps = upd["predicted_tokens_per_s"], upd["predicted_compute_tokens_per_s"]
    assert upd["kept"] == (tps["kept"] > tps["replan"] or ctps["kept"] > ctps["replan"])
    assert sampler.cost.sparse.densities == (old if upd["kept"] else new)


