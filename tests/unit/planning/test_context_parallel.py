"""Guards hybrid sparsity-aware context parallelism: the mesh solver (pure), and on 2 / 4 gloo ranks in fp64 the
sequence-wise and hybrid (2 x 2) sparse attention == the one-process block-sparse reference, forward and backward
(ragged last block, uneven per-head densities, a head with no remote block, a rank of padding only), the bytes
each rank moves == the cost model's prediction, and below Ulysses' below the solver's crossover density."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from conftest import launch_script
from ds_adaptive.planning.context_parallel import (CPLinks, choose_mesh, crossover_density, fetch_share, mesh_cost,
                                                   mesh_shapes)

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[3]


def _kw(**over):
    kw = dict(seq_len=75_776, densities=[0.1] * 40, head_dim=128, block=128, attention_ms_per_token2=8e-6,
              efficiency=lambda r: min(1.0, 1.45 * r), links=CPLinks())
    kw.update(over)
    return kw


# ------------------------------------------------------------------------------ the solver (pure)
def test_mesh_shapes_divide_the_group_and_the_heads() -> None:
    assert mesh_shapes(8, 40) == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert mesh_shapes(16, 40) == [(8, 2), (4, 4), (2, 8), (1, 16)]   # no Ulysses: 16 does not divide 40
    assert mesh_shapes(4, 2) == [(2, 2), (1, 4)]
    for sp in (2, 4, 8, 16, 64):
        for heads in (2, 12, 40):
            c = choose_mesh(sp=sp, **_kw(densities=[0.05] * heads))
            assert c.heads * c.seq == sp and heads % c.heads == 0, (sp, heads, c.shape)


def test_solver_picks_ulysses_at_density_one_and_sequence_wise_at_low_density_on_slow_links() -> None:
    for sp in (2, 4, 8):
        assert choose_mesh(sp=sp, **_kw(densities=[1.0] * 40)).shape == (sp, 1)
        assert choose_mesh(sp=sp, sparse=False, **_kw()).shape == (sp, 1)   # a dense layer keeps Ulysses
    slow = CPLinks(intra_node_gbps=5.0, inter_node_gbps=5.0, query_block_overlap=0.98)
    assert choose_mesh(sp=8, **_kw(densities=[0.01] * 40, links=slow)).shape == (1, 8)
    # ... and not at a high density on the same links (the fetch would move more than the all-to-alls)
    assert choose_mesh(sp=8, **_kw(densities=[0.6] * 40, links=slow)).seq < 8
    # fixed modes
    assert choose_mesh(sp=8, mode="sequence", **_kw()).shape == (1, 8)
    assert choose_mesh(sp=16, mode="sequence", sparse=False, **_kw()).shape == (8, 2)
    assert choose_mesh(sp=8, mode="heads", **_kw()).shape == (8, 1)
    with pytest.raises(ValueError, match="needs sp \\(16\\) to divide the 40 heads"):
        choose_mesh(sp=16, mode="heads", **_kw())
    with pytest.raises(ValueError, match="must be one of"):
        choose_mesh(sp=8, mode="ring", **_kw())


def test_cost_terms_and_crossover() -> None:
    links = CPLinks()
    assert fetch_share(0.1, 1, 0.9) == pytest.approx(0.1)
    assert fetch_share(0.1, 10, 1.0) == pytest.approx(0.1) and fetch_share(0.1, 10, 0.0) == pytest.approx(1 - 0.9 ** 10)
    assert fetch_share(1.0, 50, 0.5) == 1.0
    ul, seq = mesh_cost(8, 1, **_kw()), mesh_cost(1, 8, **_kw())
    assert ul.fetch_share == 0.0 and 0 < seq.fetch_share <= 1 and seq.extra_kv_bytes > 0 == ul.extra_kv_bytes
    # the attention term is the busiest head-wise rank's: one dense head slows Ulysses, not the sequence-wise mesh
    skew = [0.9] + [0.05] * 39
    assert mesh_cost(8, 1, **_kw(densities=skew)).attention_ms > mesh_cost(1, 8, **_kw(densities=skew)).attention_ms
    x = crossover_density(sp=8, seq_len=75_776, dim=5120, block=128, links=links)
    n = 75_776 // 8 // 128
    assert 0 < x < 1 and fetch_share(x, n, links.query_block_overlap) == pytest.approx(2 / 8, rel=1e-6)
    assert crossover_density(sp=2, seq_len=4096, dim=512, block=128, links=links) == 1.0   # s=2: always fewer bytes


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


# ------------------------------------------------------------------------------ on paper: simulate, config --check
def test_simulation_reports_meshes_and_gains_against_ulysses() -> None:
    from ds_adaptive.simulation.context_parallel import context_parallel_report, context_parallel_table

    dense = context_parallel_report(profile="h200-wan2.1-14b", gpus=8, seq_len=75_600, densities=1.0)
    assert dense["meshes"] == [(8, 1)] and dense["predicted_gain"] == pytest.approx(1.0, rel=1e-12)
    assert dense["padded_tokens"] == 75_600   # Ulysses everywhere: no block alignment
    sparse = context_parallel_report(profile="h200-wan2.1-14b", gpus=8, seq_len=75_600, densities=0.02)
    assert (1, 8) in sparse["meshes"] and sparse["predicted_gain"] > 1.0   # the solver picks it only where it pays
    assert sparse["padded_tokens"] % (8 * 128) == 0
    wide = context_parallel_report(profile="h200-wan2.1-14b", gpus=16, seq_len=302_400, densities=0.1)
    assert wide["ulysses_degree"] == 8 and all(h * s == 16 and 40 % h == 0 for h, s in wide["meshes"])
    assert len(wide["layers"]) == 40 and wide["predicted_only"] and "ulysses_attention_ms" not in wide["layers"][0]
    text = context_parallel_table([dense, sparse, wide], per_layer=True)
    assert "h200-wan2.1-14b" in text and "layer  39" in text and "Predicted, not measured" in text


def test_cli_simulate_and_config_check_show_the_meshes(tmp_path, capsys) -> None:
    import json

    from ds_adaptive.cli import config as config_cli
    from ds_adaptive.cli import simulate as simulate_cli

    assert simulate_cli.main(["--world", "16", "--sparse", "0.1", "--context-parallel", "auto", "--profile",
                              "h200-wan2.1-14b", "--cp-tokens", "75600", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["context_parallel"][0]
    assert rep["gpus"] == 16 and rep["tokens"] == 75_600 and rep["meshes"]
    cfg = json.loads((ROOT / "launch" / "configs" / "cpu_tiny.json").read_text())
    cfg["adaptive_load"]["sparse_attention"] = {"enabled": True, "context_parallel": "sequence", "forced_density": 0.1,
                                                "dense_layers": [0]}
    path = tmp_path / "cp.json"
    path.write_text(json.dumps(cfg))
    assert config_cli.main(["--check", str(path), "--model", "tiny", "--sp", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "note: context_parallel sequence, sp 4, 75,600 tokens: layers 0 2x2, layers 1 1x4" in out, out[-500:]
    cfg["adaptive_load"]["sparse_attention"]["context_parallel"] = "heads"
    path.write_text(json.dumps(cfg))
    assert config_cli.main(["--check", str(path), "--model", "tiny", "--sp", "4", "--device", "cpu"]) == 2
    assert "set adaptive_load.sparse_attention.context_parallel to 'sequence' or 'auto'" in capsys.readouterr().out


def test_the_planner_costs_hybrid_meshes_beyond_the_heads() -> None:
    from dataclasses import replace

    from ds_adaptive.core.contracts import DensityMap
    from ds_adaptive.core.layout import SequenceParallelError
    from ds_adaptive.planning.context_parallel import ContextParallelCost
    from ds_adaptive.planning.cost import CostModel
    from ds_adaptive.planning.sparse_cost import SparseAttentionCost

    dm = DensityMap(tuple((0.1,) * 40 for _ in range(40)), dense_layers=(0, 39))
    base = SparseAttentionCost(densities=dm, head_placement="identity")
    with pytest.raises(SequenceParallelError, match="Ulysses sp=16 does not divide the 40 attention heads"):
        CostModel("h200-wan2.1-14b", sp=16, sparse=base)
    hybrid = replace(base, context_parallel=ContextParallelCost("auto", CPLinks(), 128))
    cost = CostModel("h200-wan2.1-14b", sp=16, sparse=hybrid)
    s = cost.padded_tokens(75_600)
    meshes = cost.sparse.layer_meshes(s, 16)
    assert all(m.heads * m.seq == 16 for m in meshes)
    assert cost.comm_cost(75_600) == pytest.approx(sum(m.comm_ms for m in meshes))
    dense_mem = CostModel("h200-wan2.1-14b", sp=16, context_parallel="auto").per_gpu_memory(75_600)
    assert cost.per_gpu_memory(75_600) == pytest.approx(dense_mem + max(m.extra_kv_bytes for m in meshes) / 2 ** 30)
    assert "layers 0-39 8x2" in cost.sparse.mesh_summary(s, 16)
