"""Guards the Ulysses head placement on 2 gloo ranks: SP = 2 with a non-trivial per-layer placement equals SP = 1
(outputs and all gradients). The single-process checks are in tests/unit/parallel/test_head_placement.py."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import launch_script

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
