"""Guards hybrid sparsity-aware context parallelism on 2 / 4 gloo ranks in fp64: the sequence-wise and hybrid (2 x 2)
sparse attention == the one-process block-sparse reference, forward and backward (ragged last block, uneven
per-head densities, a head with no remote block, a rank of padding only), the bytes each rank moves == the cost
model's prediction, and the model with hybrid meshes == one process. The solver's checks are in
tests/unit/planning/test_context_parallel.py."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import launch_script

# ------------------------------------------------------------------------------ the op on 2 / 4 ranks
OP = textwrap.dedent("""
    import math, torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from ds_adaptive.attention.selection import select_blocks, pooled_queries
    from ds_adaptive.attention.scores import pooled_lse_scores, lse_columns
    from ds_adaptive.attention.attention import dense_attention
    from ds_adaptive.attention.backends.reference import masked_attention_reference, ReferenceBackend
    from ds_adaptive.attention.sequence_parallel import (ShardGeometry, sequence_attention, shard_block_scores,
                                                         select_shard_blocks)
    from ds_adaptive.parallel.kv_gather import CommCounter
    from ds_adaptive.parallel.mesh import HeadAllToAll
    from ds_adaptive.planning.context_parallel import selection_bytes, sequence_bytes, head_bytes
    grp = dist.group.WORLD

    def run(B, S, H, D, bs, kph, seed, local_window=False):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64) for _ in range(3))
        nk = math.ceil(S / bs)
        scores = pooled_lse_scores(q, k, bs)
        if local_window:   # a locality prior: neighbours score high (small unions of the rank's selections)
            i = torch.arange(nk)
            scores = scores - 1e3 * (i[:, None] - i[None, :]).abs().double()
        full = select_blocks(scores.clone(), kph, seq_len=S, block_size=bs)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref = masked_attention_reference(qr, kr, vr, full)
        w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        (ref * w).sum().backward()
        chunk = math.ceil(nk / world) * bs
        pad = chunk * world - S
        geo = ShardGeometry(S, bs, chunk, rank, world)
        local = lambda t: torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad))[:, rank * chunk:(rank + 1) * chunk].clone()
        ql, kl, vl = (local(t).requires_grad_() for t in (q, k, v))
        cnt = CommCounter()
        if local_window:
            r0 = geo.first_block
            sc = scores[:, :, r0:r0 + geo.real_query_blocks].float().clone()
        else:
            sc = shard_block_scores(ql, kl, geo, grp, summary=lambda x: pooled_queries(x, bs, kl.dtype),
                                    columns=lambda qs, kk: lse_columns(qs, kk, bs), counter=cnt, layer=0)
            r0, r1 = geo.first_block, geo.first_block + geo.real_query_blocks
            assert torch.equal(sc, scores[:, :, r0:r1]), "distributed scores differ from the one-process scores"
        sel = select_shard_blocks(sc, kph, geo)
        r0, r1 = geo.first_block, geo.first_block + geo.real_query_blocks
        assert torch.equal(sel.kv_num, full.kv_num[:, :, r0:r1]) and torch.equal(sel.kv_idx, full.kv_idx[:, :, r0:r1])
        out = sequence_attention(ql, kl, vl, sel, geo, grp, kernel=ReferenceBackend(), counter=cnt, layer=0)
        err = float((out - local(ref.detach())).abs().max())
        (out * local(w)).sum().backward()
        gerr = max(float((a.grad - local(b.grad)).abs().max()) for a, b in ((ql, qr), (kl, kr), (vl, vr)))
        assert err < 1e-12 and gerr < 1e-12, (S, err, gerr)
        # bytes: this rank's fetched (sample, head, block) units, counted here from the full selection
        dense = full.dense_block_mask()[:, :, r0:r1].any(2)           # [B, H, nk] blocks my query blocks need
        mine = (torch.arange(nk) // geo.chunk_blocks) == rank
        units = int((dense & ~mine).sum())
        remote_blocks = world * geo.chunk_blocks - geo.chunk_blocks
        share = units / (B * H * remote_blocks)
        fwd, bwd = sequence_bytes(world * chunk, H * D, 1, world, share, 8)
        row = cnt.bytes[0]
        assert row["kv_grad"] == round(B * bwd) == units * 2 * bs * D * 8, (row, units, share)
        assert row["ids"] == 8 * units and row["counts"] == 8 * (world - 1), row
        if not local_window:
            assert row["scores"] == B * selection_bytes(world * chunk, H, 1, world, bs, D, 8), row
        sent = torch.tensor([row["kv"], row["kv_grad"]], dtype=torch.float64)
        dist.all_reduce(sent)
        assert sent[0] == sent[1], sent   # what the owners sent == what came back as gradients
        # dense: every block, SDPA of the local queries against all keys
        outd = sequence_attention(ql, kl, vl, None, geo, grp, counter=cnt, layer=1)
        assert torch.allclose(outd, local(dense_attention(q, k, v)), atol=1e-12)
        return row, share, chunk

    # ragged last block (197 tokens, 13 blocks of 16), per-head k 1 (no remote block) / 3 / 6
    run(2, 197, 3, 8, 16, torch.tensor([1, 3, 6]), seed=3)
    # a short sequence: on 4 ranks the last holds padding only
    run(1, 40, 2, 8, 16, torch.tensor([1, 2]), seed=4)
    # bytes against Ulysses at a density below the crossover: local windows of 3 blocks of 64 (density 0.05)
    B, S, H, D, bs = 1, 64 * 16, 4, 8, 16
    row, share, chunk = run(B, S, H, D, bs, torch.tensor([3, 3, 3, 3]), seed=5, local_window=True)
    cnt = CommCounter()
    x = torch.randn(B, S // world, 3, H, D, dtype=torch.float64, requires_grad=True)
    y = HeadAllToAll.apply(x, grp, world, True, cnt, 0)   # Ulysses' q, k, v (stacked) ...
    out = HeadAllToAll.apply(y[:, :, 0], grp, world, False, cnt, 0)   # ... and the output: 4 tensors
    ul_fwd = head_bytes(S, H * D, world, world, 8)[0]
    assert cnt.bytes[0]["heads"] == ul_fwd == 4 * S // world * H * D * (world - 1) // world * 8, cnt.bytes
    seq_fwd = row["kv"] + row["ids"] + row["counts"]
    seq_recv = row["kv_grad"] + row["ids"] + row["counts"]
    if rank == 0:
        print("BYTES", {"ulysses_fwd": ul_fwd, "sequence_fwd_recv": seq_recv, "share": share}, flush=True)
    assert seq_recv < ul_fwd and share <= 2 / world, (seq_recv, ul_fwd, share)
    if rank == 0:
        print("CP_OP_OK", flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_wise_attention_equals_the_one_process_reference(tmp_path: Path, world: int) -> None:
    out = launch_script(OP, world, tmp_path, name=f"cp_op_{world}.py", timeout=120)
    assert "CP_OP_OK" in out, out[-4000:]


# ------------------------------------------------------------------------------ in the model: meshes per layer
MODEL = textwrap.dedent("""
    import copy, dataclasses, warnings
    import torch, torch.distributed as dist, deepspeed
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    from ds_adaptive.core.config import SparseAttentionConfig
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.models.testing import random_init_
    from ds_adaptive.models.wan import WanModel, get_wan_config
    from ds_adaptive.parallel import apply_ulysses
    from ds_adaptive.attention.runtime import SparseAttentionRuntime, attach_sparse_attention
    rank, world = dist.get_rank(), dist.get_world_size()
    solo = [dist.new_group([r]) for r in range(world)][rank]
    lay = dataclasses.replace(Layout.detect(world), context_parallel="sequence")
    cfg = get_wan_config("tiny")   # 2 heads: on 4 ranks the SP degree is beyond the head count
    scfg = dict(enabled=True, forced_density=0.4, dense_layers=[0], block_size=16, cube=[1, 4, 4], backend="reference",
                context_parallel="sequence", min_density=0.0)
    ref = random_init_(WanModel(cfg), seed=3).double()
    model = copy.deepcopy(ref)
    rt_ref = SparseAttentionRuntime(scfg, num_layers=2, num_heads=2, head_dim=cfg.head_dim, group=solo)
    rt_ref.install(ref)
    apply_ulysses(model, lay)
    rt = attach_sparse_attention(model, SparseAttentionConfig(**scfg), layout=lay)
    cp = rt.context_parallel
    rule = cp.layer_meshes
    g = torch.Generator().manual_seed(11)

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    def shard_loss(m, lat, t, ctx, tgt):   # fp64: this rank's part of the per-sample mean squared error
        local = m(lat, t, ctx, local=True)
        d = local.valid_tokens - local.shard_target(tgt)
        return d.square().flatten(1).sum(1).sum() / tgt[0].numel()

    meshes = [None] + ([((2, 2), (2, 2))] if world == 4 else [((2, 1), (2, 1))])
    for force in meshes:
        cp.layer_meshes = rule if force is None else (lambda n, f=force: f)
        # (B, T, H, W): 72 tokens (4.5 blocks of 16: a ragged last block; on 4 ranks the last holds padding only),
        # 64 tokens (whole blocks) with activation checkpointing
        for B, T, H, W, ckpt in [(2, 3, 8, 12, False), (1, 2, 8, 16, True)]:
            model.gradient_checkpointing = ref.gradient_checkpointing = ckpt
            lat = torch.randn(B, 16, T, H, W, generator=g, dtype=torch.float64)
            t = torch.rand(B, generator=g, dtype=torch.float64) * 1000
            ctx = torch.randn(B, 7, 4096, generator=g, dtype=torch.float64)
            tgt = torch.randn(B, 16, T, H, W, generator=g, dtype=torch.float64)
            with torch.no_grad():
                out, out_ref = model(lat, t, ctx), ref(lat, t, ctx)
            ref.zero_grad(); model.zero_grad()
            ((ref(lat, t, ctx) - tgt).square().flatten(1).mean(1)).sum().backward()
            shard_loss(model, lat, t, ctx, tgt).backward()
            gerr = 0.0
            for (n, p), (_, pr) in zip(model.named_parameters(), ref.named_parameters()):
                gs = p.grad.clone()
                dist.all_reduce(gs, group=lay.sp_group)
                gerr = max(gerr, rel(gs, pr.grad))
            used = cp.layer_meshes(T * H * W // 4)
            assert rt.cached_selection(1) is not None or rt.schedule.is_sparse(1) is False
            rt.step(); rt_ref.step()
            if rank == 0:
                print("case", (B, T, H, W, ckpt), used, "out", rel(out, out_ref), "grad", gerr, flush=True)
            # outputs bit for bit; gradients within 1e-6: DeepSpeed's Ulysses on the same model and inputs is
            # 3e-7 from one process too (a part of the model's backward that runs in fp32), the op itself 1e-12
            assert rel(out, out_ref) < 1e-12 and gerr < 1e-6, (used, rel(out, out_ref), gerr)
            for layer, (h, s) in enumerate(used):   # what moved is what the mesh says
                kinds = set(cp.last_bytes[layer])
                assert ("heads" in kinds) == (h > 1) and ("counts" in kinds) == (s > 1), (layer, (h, s), kinds)
    # the sequence rule: the dense layer keeps the largest head-wise group (Ulysses on 2 ranks), the sparse one (1, sp)
    assert rule(72) == (((2, 1), (1, 2)) if world == 2 else ((2, 2), (1, 4))), rule(72)
    # negative control: the sparse layer really runs sparse (dense attention everywhere changes the output)
    cp.layer_meshes = rule
    with torch.no_grad():
        lat = torch.randn(1, 16, 3, 8, 12, generator=g, dtype=torch.float64)
        t, ctx = torch.tensor([300.0], dtype=torch.float64), torch.randn(1, 7, 4096, generator=g, dtype=torch.float64)
        sparse_out = model(lat, t, ctx)
        with rt.dense_only():
            dense_out = model(lat, t, ctx)
    assert rel(sparse_out, dense_out) > 1e-6
    if rank == 0:
        print("CP_MODEL_OK", flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_hybrid_meshes_in_the_model_equal_one_process(tmp_path: Path, world: int) -> None:
    out = launch_script(MODEL, world, tmp_path, name=f"cp_model_{world}.py", timeout=180)
    assert "CP_MODEL_OK" in out and out.count("case") == 4, out[-4000:]
