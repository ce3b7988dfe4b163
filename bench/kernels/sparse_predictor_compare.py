"""Which predictor input: the head's own q/k after RoPE (ours) or DSV's projection of the hidden states?

Planted data shaped like a Wan self-attention layer: hidden states ``x = c + noise`` (a shared
content direction plus per-token content), ``q = RoPE(x Wq)``, ``k = RoPE(x Wk)`` with Wan's 3D
RoPE in cube order, so the logits carry 3D locality through RoPE (the relative-position term of
the shared direction) plus content noise. Both predictors (rank r per head) are trained with the
same loss (``LowRankPredictor.loss``'s cosine + normalised MSE), rows, optimizer and steps; then
each selects the top-k blocks at the measured per-head density (mass 0.99) and we report recall
(exact softmax mass inside the selection) on fresh inputs. CPU, seconds.

    python bench/kernels/sparse_predictor_compare.py --out bench/out/sparse_predictor_compare.json
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from ds_adaptive.models.rope import rope_table
from ds_adaptive.models.rope import apply_rope
from ds_adaptive.models.wan_config import get_wan_config
from ds_adaptive.attention.selection import blocks_for_density, select_blocks
from ds_adaptive.attention.predictor import LowRankPredictor
from ds_adaptive.attention.cube_order import CubeOrder
from ds_adaptive.attention.profiler import exact_logits, profile_rows, sample_rows
from ds_adaptive.attention.selection import pool_blocks


class HiddenStatePredictor(torch.nn.Module):
    """DSV's variant: rank-r per head projections of the layer's hidden states x [B, S, D]."""

    def __init__(self, dim: int, heads: int, rank: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.wq = torch.nn.Parameter(torch.randn(heads, dim, rank, generator=g) * dim ** -0.5)
        self.wk = torch.nn.Parameter(torch.randn(heads, dim, rank, generator=g) * dim ** -0.5)

    def proj(self, x, w):
        return torch.einsum("bsd,hdr->bshr", x.float(), w)

    def loss(self, x, rows, logits, cos_weight=0.9):
        qp = self.proj(x[:, rows], self.wq).transpose(1, 2)
        kp = self.proj(x, self.wk).transpose(1, 2)
        pred = qp @ kp.transpose(-1, -2)
        cos = torch.nn.functional.cosine_similarity(pred, logits, dim=-1)
        std = logits.std(-1, keepdim=True).clamp_min(1e-6)
        return (cos_weight * (1 - cos) + (1 - cos_weight) * ((pred - logits) / std).square().mean(-1)).mean()

    @torch.no_grad()
    def block_scores(self, x, block):
        return pool_blocks(self.proj(x, self.wq), block) @ pool_blocks(self.proj(x, self.wk), block).transpose(-1, -2)


def make_layer(grid, heads, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    dim = heads * head_dim
    wq = torch.randn(dim, dim, generator=g) / math.sqrt(dim)
    wk = torch.randn(dim, dim, generator=g) / math.sqrt(dim)
    c = torch.randn(dim, generator=g)
    cfg = get_wan_config({"dim": dim, "ffn_dim": dim, "num_heads": heads, "num_layers": 1})
    order = CubeOrder((2, 4, 8))
    freqs = order.to_cube(rope_table(grid, cfg.rope_split), grid, dim=0)
    return wq, wk, c, freqs, order


def sample(layer, grid, heads, head_dim, seed, content, scale):
    wq, wk, c, freqs, order = layer
    g = torch.Generator().manual_seed(1000 + seed)
    s = math.prod(grid)
    x = (c + content * torch.randn(1, s, c.numel(), generator=g)) * scale
    q = apply_rope((x @ wq).unflatten(-1, (heads, head_dim)), freqs)
    k = apply_rope((x @ wk).unflatten(-1, (heads, head_dim)), freqs)
    return x, q, k


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", type=int, nargs=3, default=[4, 16, 32])
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--content", type=float, default=0.5, help="per-token content noise relative to the shared part")
    p.add_argument("--scale", type=float, default=1.5, help="hidden-state scale (sets the logit temperature)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--out", default="bench/out/sparse_predictor_compare.json")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    grid, h, d = tuple(args.grid), args.heads, args.head_dim
    layer = make_layer(grid, h, d, 0)
    ours = LowRankPredictor(1, h, d, args.rank, seed=1)
    dsv = HiddenStatePredictor(h * d, h, args.rank, seed=1)
    opts = [torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.0) for m in (ours, dsv)]
    gen = torch.Generator().manual_seed(5)
    hist = []
    for step in range(args.steps):
        x, q, k = sample(layer, grid, h, d, step % 16, args.content, args.scale)
        rows = sample_rows(q.shape[1], args.rows, generator=gen)
        lg = exact_logits(q, k, rows)
        l1 = ours.loss(0, q[:, rows], k, lg)
        l2 = dsv.loss(x, rows, lg)
        for opt, loss in zip(opts, (l1, l2)):
            opt.zero_grad()
            loss.backward()
            opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            hist.append({"step": step, "loss_qk": float(l1.detach()), "loss_hidden": float(l2.detach())})
    res = {"args": vars(args), "history": hist, "eval": []}
    for seed in (100, 101, 102):
        x, q, k = sample(layer, grid, h, d, seed, args.content, args.scale)
        rows = sample_rows(q.shape[1], 256, generator=gen)
        lg = exact_logits(q, k, rows)
        dens = profile_rows(lg, rows, args.block, 0.99).density
        nk = math.ceil(q.shape[1] / args.block)
        kph = blocks_for_density(dens, nk)
        rec = {}
        for name, scores in (("qk", ours.block_scores(0, q, k, args.block)),
                             ("qk_lse", ours.block_scores(0, q, k, args.block, mode="lse")),
                             ("hidden", dsv.block_scores(x, args.block)),
                             ("random", torch.randn(1, h, nk, nk, generator=gen))):
            sel = select_blocks(scores, kph, seq_len=q.shape[1], block_size=args.block)
            rec[name] = float(profile_rows(lg, rows, args.block, 0.99, sel).recall.mean())
        res["eval"].append({"density": dens.tolist(), "recall": rec})
    print(f"# predictor input comparison, grid {grid}, {h} heads x {d}, rank {args.rank}, block {args.block}, "
          f"{args.steps} steps")
    print(f"final loss: q/k {hist[-1]['loss_qk']:.3f}, hidden {hist[-1]['loss_hidden']:.3f}")
    print(f"{'density (per head)':>24} {'recall q/k':>11} {'q/k lse':>8} {'recall hidden':>14} {'recall random':>14}")
    for e in res["eval"]:
        print(f"{str([round(x, 3) for x in e['density']]):>24} {e['recall']['qk']:11.3f} {e['recall']['qk_lse']:8.3f} {e['recall']['hidden']:14.3f} "
              f"{e['recall']['random']:14.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
