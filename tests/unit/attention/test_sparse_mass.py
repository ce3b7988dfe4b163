"""Guards that the default selection keeps the attention mass: on q/k with a video DiT's structure through
Wan's 3D RoPE (local windows, far regions, sinks, all mixed per head), the runtime's default block
scoring, at the density its own profiler chooses, holds >= 0.95 of the exact softmax mass of every head."""
from __future__ import annotations

import pytest
import torch

from ds_adaptive.attention.selection import BlockSelection, blocks_for_density, select_blocks
from ds_adaptive.attention.runtime import SparseAttentionRuntime
from ds_adaptive.attention.cube_order import CubeOrder
from ds_adaptive.attention.planted import PLANTED_KINDS, planted_rope_qk
from ds_adaptive.attention.profiler import block_mass, blocks_needed, exact_logits
from ds_adaptive.attention.scores import pooled_lse_scores

GRID, BLOCK, CUBE = (4, 16, 16), 32, (2, 4, 4)


def _mass_kept(q, k, sel: BlockSelection) -> torch.Tensor:
    """[H] exact softmax mass inside the selection, mean over every query row."""
    s = q.shape[1]
    bm = block_mass(exact_logits(q, k, torch.arange(s)), BLOCK)  # [B, H, S, nk]
    rows = sel.dense_block_mask().repeat_interleave(BLOCK, dim=2)[:, :, :s]
    return (bm * rows).sum(-1).mean(dim=(0, 2))


@pytest.fixture(scope="module")
def planted():
    order = CubeOrder(CUBE)
    return [planted_rope_qk(GRID, 4, 64, kinds=PLANTED_KINDS, order=order, seed=s, temperature=60.0)
            for s in range(3)]


def test_planted_heads_are_sparse_and_differ(planted) -> None:
    q, k = planted[0]
    s, nk = q.shape[1], q.shape[1] // BLOCK
    logits = exact_logits(q, k, torch.arange(0, s, 3))
    dens = (blocks_needed(block_mass(logits, BLOCK), 0.95).float() / nk).mean(dim=(0, 2))
    assert (dens < 0.2).all(), dens
    # where the mass goes: heads 0-3 are local, far, sink, mixed
    f, h, w = GRID
    pos = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 3)
    far = ((pos[:, 1] < h // 4) & (pos[:, 2] >= w - w // 4)) | ((pos[:, 1] >= h - h // 4) & (pos[:, 2] < w // 4))
    sink = torch.arange(s) < 8
    order = CubeOrder(CUBE)
    p = torch.softmax(logits, -1)[0]  # [H, rows, S]
    share = {name: (p * order.to_cube(m.float(), GRID, dim=0)).sum(-1).mean(-1) for name, m in (("far", far),
                                                                                              ("sink", sink))}
    # (the far regions are 1/8 of the tokens: a local head gives them about that, from their own queries)
    assert share["far"][1] > 0.5 and share["far"][3] > 0.5 and share["far"][0] < 0.2, share
    assert share["sink"][2] > 0.1 and share["sink"][3] > 0.03 and share["sink"][0] < 0.01, share


def test_default_selection_keeps_095_of_the_mass_at_its_own_density(planted) -> None:
    rt = SparseAttentionRuntime(dict(enabled=True, block_size=BLOCK, cube=list(CUBE), warmup_steps=1, profile_interval=1,
                                     dense_layers=[], layer_density_threshold=1.0, dense_above=1.0, sample_rows=256,
                                     backend="reference"), num_layers=1, num_heads=4, head_dim=64)
    assert rt.cfg.block_score == "pooled_lse" and not rt.uses_predictor
    q, k = planted[0]
    qg = q.clone().requires_grad_(True)
    rt.attention(0, qg, k, torch.randn(q.shape)).sum().backward()  # stage 1: profiles the densities
    rt.step()
    assert rt.schedule.stage == 2
    for q, k in planted[1:]:  # fresh inputs
        sel = rt.select(0, q, k)
        kept = _mass_kept(q, k, sel)
        density = sel.density()
        assert (kept >= 0.95).all(), (kept, density)
        assert (density < 0.35).all()
        # the test can fail: random blocks at the same density keep far less
        nk = q.shape[1] // BLOCK
        rand = select_blocks(torch.rand(1, 4, nk, nk), (density * nk).round().long().clamp(1, nk),
                             seq_len=q.shape[1], block_size=BLOCK)
        assert (_mass_kept(q, k, rand) < kept - 0.2).all()


def test_pooled_lse_scores_equal_an_fp64_reference_on_ragged_lengths() -> None:
    g = torch.Generator().manual_seed(0)
    for s in (100, 96, 33):
        q, k = torch.randn(2, s, 3, 8, generator=g), torch.randn(2, s, 3, 8, generator=g)
        got = pooled_lse_scores(q, k, 32, chunk_elems=2 * 3 * s)  # one query block per chunk
        nb = -(-s // 32)
        want = torch.empty(2, 3, nb, nb, dtype=torch.float64)
        for i in range(nb):
            qbar = q[:, i * 32:(i + 1) * 32].double().mean(1)  # [B, H, Dh]
            lg = torch.einsum("bhd,bshd->bhs", qbar, k.double()) / 8 ** 0.5
            for j in range(nb):
                want[:, :, i, j] = torch.logsumexp(lg[..., j * 32:(j + 1) * 32], -1)
        assert torch.allclose(got.double(), want, atol=1e-5), s
    # the top block of each query block is where its mean query's softmax mass is largest
    sel = select_blocks(got, blocks_for_density(torch.full((3,), 0.5), nb), seq_len=33, block_size=32)
    assert sel.kv_num.shape == (2, 3, nb)
