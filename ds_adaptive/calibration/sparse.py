"""``ds-adaptive calibrate --sparse``: the block-sparse attention kernel's cost vs density on this GPU.

Times fwd+bwd of FlexAttention block-sparse attention (``BlockMask.from_kv_blocks``, 128x128 blocks,
the selected key blocks passed as *full* blocks so that no mask_mod runs; per head and query block
``round(rho * blocks)`` random key blocks, at least one) against dense SDPA (the default backend,
cuDNN on Hopper) at the same shape, and writes the efficiency table ``g(rho) = sparse / dense``
into a profile json (``sparse_attention`` section), which :class:`ds_adaptive.core.contracts.KernelEfficiency`
reads. It times FlexAttention, the first sparse backend; ``bench/kernels/sparse_backends.py`` measures every
backend of ``ds_adaptive.attention.backends``.

    ds-adaptive calibrate --sparse --profile h100-wan2.1-1.3b --out h200-wan2.1-1.3b-sparse.json

``--selection`` instead times the runtime's block selection (scoring + top-k) over a grid of micro-batch
shapes and writes its fitted cost (:mod:`ds_adaptive.planning.selection_cost`) as the profile's
``sparse_attention.selection`` (the rest of the profile, an efficiency table included, is kept); the
planner's sparse cost and its "sparse only where it pays" decision then use it::

    ds-adaptive calibrate --sparse --selection --profile h200-wan2.1-1.3b --out h200-wan2.1-1.3b.json

Layout: q, k, v ``[B, H, S, Dh]`` bf16 (flex/SDPA layout). ``make_block_mask`` and
``block_mask_dense`` (the boolean ``[H, S, S]`` mask the block mask stands for) are shared with
``bench/kernels/sparse_heads_gpu.py`` and tested on CPU against masked dense attention.
"""
from __future__ import annotations

from typing import Any, Sequence

from ds_adaptive.core.timing import time_ms


__all__ = ["select_kv_blocks", "make_block_mask", "block_mask_dense", "measure_efficiency"]


DEFAULT_DENSITIES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.85)


def select_kv_blocks(densities: Sequence[float], seq_len: int, *, block: int = 128, seed: int = 0,
                     device: Any = "cpu"):
    """Per head ``h`` and query block: ``max(1, round(densities[h] * nb))`` distinct random key blocks
    (ascending), ``nb = ceil(seq_len / block)``. Returns ``(num [1, H, nb] int32, idx [1, H, nb, nb]
    int32)`` in ``BlockMask.from_kv_blocks`` layout (the first ``num`` entries of a row are used)."""
    import torch

    nb = -(-int(seq_len) // block)
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    nums, idxs = [], []
    for rho in densities:
        n = max(1, min(nb, int(round(float(rho) * nb))))
        order = torch.rand(nb, nb, generator=g).argsort(dim=-1)
        chosen, _ = order[:, :n].sort(dim=-1)
        idx = torch.zeros(nb, nb, dtype=torch.int32)
        idx[:, :n] = chosen.to(torch.int32)
        nums.append(torch.full((nb,), n, dtype=torch.int32))
        idxs.append(idx)
    return torch.stack(nums)[None].to(device), torch.stack(idxs)[None].to(device)


def make_block_mask(densities: Sequence[float], seq_len: int, *, block: int = 128, seed: int = 0, device: Any = "cpu"):
    """A FlexAttention ``BlockMask`` with the :func:`select_kv_blocks` blocks as full blocks."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    num, idx = select_kv_blocks(densities, seq_len, block=block, seed=seed, device=device)
    return BlockMask.from_kv_blocks(torch.zeros_like(num), torch.zeros_like(idx), num, idx, BLOCK_SIZE=block,
                                    seq_lengths=(int(seq_len), int(seq_len)))


def block_mask_dense(densities: Sequence[float], seq_len: int, *, block: int = 128, seed: int = 0):
    """The boolean ``[H, S, S]`` mask (True = attend) that :func:`make_block_mask` encodes (reference)."""
    import torch

    num, idx = select_kv_blocks(densities, seq_len, block=block, seed=seed)
    h, nb = num.shape[1], num.shape[2]
    blocks = torch.zeros(h, nb, nb, dtype=torch.bool)
    for head in range(h):
        for qb in range(nb):
            blocks[head, qb, idx[0, head, qb, :num[0, head, qb]].long()] = True
    full = blocks.repeat_interleave(block, 1).repeat_interleave(block, 2)
    return full[:, :seq_len, :seq_len]


def fwd_bwd_fns(heads: int, seq_len: int, head_dim: int, *, device: str = "cuda", seed: int = 0):
    """``(dense(), sparse(block_mask))``: closures that run fwd+bwd of SDPA / compiled flex attention
    on fixed random bf16 ``[1, heads, seq_len, head_dim]`` inputs."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(1, heads, seq_len, head_dim, device=device, dtype=torch.bfloat16, generator=g)
               .requires_grad_(True) for _ in range(3))
    dout = torch.randn(1, heads, seq_len, head_dim, device=device, dtype=torch.bfloat16, generator=g)
    flex = torch.compile(flex_attention, dynamic=False)

    def dense():
        out = F.scaled_dot_product_attention(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    def sparse(mask):
        out = flex(q, k, v, block_mask=mask)
        torch.autograd.grad(out, (q, k, v), dout)

    return dense, sparse


def measure_efficiency(seq_lens: Sequence[int], densities: Sequence[float], *, heads: int, head_dim: int,
                       iters: int = 10, log=print) -> dict:
    """Time dense SDPA and block-sparse flex at every (S, rho); the table is the median over S of
    sparse / dense per density."""
    import torch

    rows = []
    for s in seq_lens:
        dense, sparse = fwd_bwd_fns(heads, s, head_dim)
        t_dense = time_ms(dense, iters=iters)
        flops = 4 * 2 * heads * s * s * head_dim * 1.0   # fwd 2 matmuls; bwd ~2.5x; counted as 3.5 x fwd below
        for rho in densities:
            mask = make_block_mask([rho] * heads, s, device="cuda", seed=int(rho * 1000))
            t = time_ms(lambda mask=mask, sparse=sparse: sparse(mask), iters=iters)
            real = float(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()) / (heads * mask.full_kv_num_blocks.shape[-1] ** 2)
            rows.append({"S": s, "density": rho, "block_density": real, "dense_ms": t_dense, "sparse_ms": t,
                         "ratio": t / t_dense, "dense_tflops": 3.5 * flops / 2 / t_dense / 1e9,
                         "sparse_eff_tflops": 3.5 * flops / 2 * real / t / 1e9})
            log(f"S={s:>6} rho={rho:<5} block density {real:.4f}  dense {t_dense:8.2f} ms  sparse {t:8.2f} ms  "
                f"ratio {t / t_dense:.3f}")
        del dense, sparse
        torch.cuda.empty_cache()
    table_d, table_r = [], []
    for rho in densities:
        rs = sorted(r["ratio"] / r["block_density"] * rho for r in rows if r["density"] == rho)
        table_d.append(float(rho))
        table_r.append(float(rs[len(rs) // 2]))
    # keep the curve monotone (timing noise): a denser mask never costs less
    for i in range(1, len(table_r)):
        table_r[i] = max(table_r[i], table_r[i - 1])
    return {"efficiency": {"density": table_d, "ratio": table_r}, "measurements": rows}
