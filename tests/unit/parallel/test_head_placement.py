"""Guards the Ulysses head placement (issue 15): the wrapper equals plain attention (values and
gradients), passes the rank's original head ids, and SP = 2 with a non-trivial per-layer placement
equals SP = 1 (outputs and all gradients) on 2 gloo ranks."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from conftest import launch_script
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


SCRIPT = textwrap.dedent("""
    import copy, warnings
    import torch, torch.distributed as dist, deepspeed
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    from ds_adaptive.parallel.placement import plan_head_placement, rank_sums
    from ds_adaptive.models.testing import random_init_
    from ds_adaptive.models.wan import WanModel, get_wan_config, sdpa_attention
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.models.objective import per_sample_mse
    from ds_adaptive.parallel import apply_ulysses, make_ulysses_attention, valid_len_attention
    from ds_adaptive.parallel.head_placement import apply_head_placement

    rank = dist.get_rank()
    sp = Layout.detect(2).validate(num_heads=4)
    cfg = get_wan_config("tiny", num_heads=4)
    ref = random_init_(WanModel(cfg), seed=3)
    model = copy.deepcopy(ref)
    apply_ulysses(model, sp)
    # densities whose balanced placement is not the identity in either layer
    dens = [[0.5, 0.4, 0.05, 0.02], [0.6, 0.5, 0.03, 0.04]]
    placement = plan_head_placement(dens, 2)
    assert all(p is not None for p in placement.perms), placement
    for row, p in zip(dens, placement.perms):
        assert max(rank_sums(row, p, 2)) < max(rank_sums(row, range(4), 2))
    apply_head_placement(model, placement, sp)
    g = torch.Generator().manual_seed(11)

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    def check(m, r, tag):
        for B, T, H, W, ckpt in [(2, 3, 6, 10, False), (1, 1, 6, 10, True), (1, 1, 2, 2, False)]:
            m.gradient_checkpointing = r.gradient_checkpointing = ckpt
            lat = torch.randn(B, 16, T, H, W, generator=g)
            t = torch.rand(B, generator=g) * 1000
            ctx = torch.randn(B, 7, 4096, generator=g)
            tgt = torch.randn(B, 16, T, H, W, generator=g)
            r.zero_grad(); m.zero_grad()
            out_ref = r(lat, t, ctx)
            (out_ref.float() - tgt).square().flatten(1).mean(1).sum().backward()
            g_ref = {n: p.grad.clone() for n, p in r.named_parameters()}
            with torch.no_grad():
                out = m(lat, t, ctx)
            assert torch.allclose(out, out_ref, atol=2e-6), (tag, B, T, H, W, rel(out, out_ref))
            per_sample_mse(m(lat, t, ctx, local=True), tgt).sum().backward()
            worst = 0.0
            for n, p in m.named_parameters():
                gs = p.grad.clone(); dist.all_reduce(gs, group=sp.sp_group)
                worst = max(worst, rel(gs, g_ref[n]))
            assert worst < 2e-5, (tag, B, T, H, W, worst)
            if rank == 0:
                print(tag, (B, T, H, W, ckpt), "ok", flush=True)

    check(model, ref, "placed")

    # per-head state: a local attention with a per-head temperature indexed by the ORIGINAL head id
    temp = torch.tensor([0.5, 1.0, 1.5, 2.0])
    def tempered_local(q, k, v, valid_len=None, head_ids=None):
        s = temp[list(head_ids)].view(1, 1, -1, 1)
        return valid_len_attention(q * s, k, v, valid_len=valid_len)
    def tempered_ref(q, k, v, valid_len=None):
        return sdpa_attention(q * temp.view(1, 1, -1, 1), k, v, valid_len=valid_len)
    ref.set_attention(tempered_ref)
    model.set_attention(make_ulysses_attention(sp, tempered_local))
    apply_head_placement(model, placement, sp, head_ids_kwarg="head_ids")
    check(model, ref, "head_ids")

    # negative control: a rank that reads the wrong head ids (identity instead of the placement) differs
    model.set_attention(make_ulysses_attention(sp, lambda q, k, v, valid_len=None, head_ids=None:
                        tempered_local(q, k, v, valid_len, tuple(range(2 * rank, 2 * rank + 2)))))
    apply_head_placement(model, placement, sp, head_ids_kwarg="head_ids")
    lat, t, ctx = torch.randn(1, 16, 3, 6, 10, generator=g), torch.tensor([500.0]), torch.randn(1, 7, 4096, generator=g)
    with torch.no_grad():
        assert (model(lat, t, ctx) - ref(lat, t, ctx)).abs().max() > 1e-3, "wrong head ids must change the output"
    if rank == 0:
        print("HEAD_PLACEMENT_SP2_OK", flush=True)
""")


@pytest.mark.slow
def test_sp2_with_head_placement_equals_sp1(tmp_path: Path) -> None:
    out = launch_script(SCRIPT, 2, tmp_path, name="head_placement_sp2.py")
    assert "HEAD_PLACEMENT_SP2_OK" in out and out.count(" ok") == 6, out[-4000:]
