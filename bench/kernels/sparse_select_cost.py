"""Cost of the default block selection (``block_score: pooled_lse``) per sparse layer and micro-batch, against the
sparse attention it feeds. ONE run prints a table over the micro-batch shapes of the H200 A/B (Wan 1.3B heads: H 12,
Dh 128, 64-token blocks, density 0.1, bf16) and writes JSON.

Per shape (S tokens x B), on q, k with a smooth positional structure (local windows of per-head width, like a
trained DiT's; random q, k would make every block score alike and the top-k a coin toss):

* ``torch``: ``selection.pooled_lse_scores_torch`` (the reference path: logits materialised, fp32 log-sum-exp);
* ``triton``: the fused kernel (``kernels.triton_block_scores``; the torch pooling of q included), ``pool`` that
  pooling alone, ``x``: torch / triton;
* ``topk``: ``select_blocks`` on the scores (diagonal forced, top-k, ascending sort), as the runtime calls it;
* ``select``: the runtime's whole call (``pooled_lse_scores`` dispatch + ``select_blocks``);
* ``attn``: block-sparse fwd+bwd of our ``triton`` backend on that selection (density 0.1), ``share``: select / attn;
* ``x6 old / new``: selection per micro-batch summed over 6 sparse layers with the torch / the fused scores (what
  the A/B summed: ``A/B`` is its measured figure, docs/RESULTS.md), ``agree``: share of selected blocks the
  same from both score paths, ``|d|``: max |triton - torch| score.

``--sweep`` (default on): the kernel's tile candidates on the longest and the widest shape (the best one is what
``default_tiles`` should ship). Times: median of CUDA-event-timed calls after warm-up (host launch included).

    python bench/kernels/sparse_select_cost.py --out bench/out/sparse_select_cost.json   # ~40-70 s on an H200
    TRITON_INTERPRET=1 python bench/kernels/sparse_select_cost.py --device cpu --out /tmp/ssc.json   # plumbing check, tiny
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from sparse_common import run_meta, write_results

AB_SHAPES = ((14040, 13), (18000, 9), (20280, 8), (32400, 4), (32760, 4), (32760, 5), (46800, 2), (46800, 3),
             (75600, 1))
"""(tokens, batch) of the micro-batches of the H200 A/B (docs/RESULTS.md)."""
AB_SELECT_MS = {(14040, 13): 72.9, (18000, 9): 82.5, (20280, 8): 84.4, (32400, 4): 88.6, (32760, 4): 96.4,
                (32760, 5): 130.7, (46800, 2): 82.5, (46800, 3): 151.0, (75600, 1): 51.2}
"""Selection ms per micro-batch (6 sparse layers) the A/B measured in the trainer with the torch scores."""
CPU_SHAPES = ((200, 2), (130, 1))
SPARSE_LAYERS = 6
SWEEP = ((64, 4, 3), (64, 4, 2), (64, 8, 3), (32, 4, 3), (128, 8, 3), (128, 8, 2), (128, 4, 3))
"""ScoreTiles candidates (block_q, num_warps, num_stages)."""


def score_tiles() -> list:
    """The :data:`SWEEP` candidates as ``ScoreTiles`` (also compiled offline by bench/kernels/sparse_kernel_compile.py)."""
    from ds_adaptive.attention.kernels.triton_block_scores import ScoreTiles
    return [ScoreTiles(block_q=bq, num_warps=w, num_stages=st) for bq, w, st in SWEEP]

DEVICE = torch.device("cuda")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, reps: int, warmup: int = 1) -> float:
    """Median ms over ``reps`` calls after ``warmup`` (CUDA events on a GPU, wall time on CPU)."""
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(reps):
        if DEVICE.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def structured_qk(b: int, s: int, h: int, d: int, dtype, *, seed: int, temperature: float = 14.0,
                  noise: float = 0.3):
    """q, k ``[B, S, H, Dh]``: random Fourier features of the token position, ``q . k / sqrt(Dh) ~ temperature x
    mean cos((i - j) w)`` with per-head bandwidths from wide to narrow (local windows of ~20 to ~1000 tokens)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    half = d // 2
    pos = torch.arange(s, device=DEVICE, dtype=torch.float32)
    bw = torch.logspace(-3.0, -1.3, h, device=DEVICE)
    w = torch.randn(h, half, device=DEVICE, generator=g) * bw[:, None]
    ang = pos[:, None, None] * w[None]  # [S, H, half]
    phi = torch.cat([ang.cos(), ang.sin()], -1) / math.sqrt(half)
    del ang

    def noisy():
        return phi + noise * torch.randn(b, s, h, d, device=DEVICE, generator=g) / math.sqrt(half)
    q = (noisy() * (temperature * math.sqrt(d))).to(dtype)
    return q, noisy().to(dtype)


def shape_row(s: int, b: int, args) -> dict:
    from ds_adaptive.attention.backends import get_backend
    from ds_adaptive.attention.kernels.triton_block_scores import triton_pooled_lse_scores
    from ds_adaptive.attention.selection import blocks_for_density, pooled_queries, select_blocks
    from ds_adaptive.attention.scores import pooled_lse_scores, pooled_lse_scores_torch

    h, d, bs, reps = args.heads, args.head_dim, args.block, args.reps
    q, k = structured_qk(b, s, h, d, args.dtype, seed=s + b)
    nk = math.ceil(s / bs)
    kph = blocks_for_density(torch.full((h,), args.density), nk)

    def select(scores):
        return select_blocks(scores, kph, seq_len=s, block_size=bs, inplace=True)
    t_torch = pooled_lse_scores_torch(q, k, bs)
    t_tri = triton_pooled_lse_scores(q, k, bs)  # (compiles on the first shape)
    sel_torch, sel = select(t_torch.clone()), select(t_tri.clone())
    m_torch, m_tri = sel_torch.dense_block_mask(), sel.dense_block_mask()
    agree = float((m_torch & m_tri).sum()) / float(m_tri.sum())
    diff = float((t_tri - t_torch).abs().max())
    del m_torch, m_tri, sel_torch
    row = {"seq": s, "batch": b, "heads": h, "head_dim": d, "block": bs, "density": args.density,
           "k_blocks": int(kph.max()), "nk": nk, "agree": agree, "max_abs_diff": diff,
           "torch_ms": time_ms(lambda: pooled_lse_scores_torch(q, k, bs), reps),
           "triton_ms": time_ms(lambda: triton_pooled_lse_scores(q, k, bs), reps),
           "pool_ms": time_ms(lambda: pooled_queries(q, bs, k.dtype), reps),
           "topk_ms": time_ms(lambda: select(t_tri), reps),
           "topk_torch_ms": time_ms(lambda: torch.topk(t_tri, int(kph.max()), dim=-1, sorted=False), reps),
           "select_ms": time_ms(lambda: select(pooled_lse_scores(q, k, bs)), reps)}
    row["old_select_ms"] = row["torch_ms"] + row["topk_ms"]
    be = get_backend("triton")
    v, dout = (torch.randn_like(q) for _ in range(2))
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    dens = float(sel.density().mean())

    def fwd_bwd():
        out = be.attention(qg, kg, vg, sel, density=dens)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    def fwd():
        with torch.no_grad():
            be.attention(q, k, v, sel, density=dens)
    row["attn_ms"] = time_ms(fwd_bwd, reps)
    row["attn_fwd_ms"] = time_ms(fwd, reps)
    row["share"] = row["select_ms"] / row["attn_ms"]
    row["old_share"] = row["old_select_ms"] / row["attn_ms"]
    row["x6_old_ms"] = SPARSE_LAYERS * row["old_select_ms"]
    row["x6_new_ms"] = SPARSE_LAYERS * row["select_ms"]
    row["ab_measured_x6_ms"] = AB_SELECT_MS.get((s, b))
    return row


def sweep(shapes, args) -> list:
    """Every tile candidate on each shape: [{"seq", "batch", "tiles", "ms"}] (best first per shape)."""
    from ds_adaptive.attention.kernels.triton_block_scores import default_tiles, triton_pooled_lse_scores

    out = []
    for s, b in shapes:
        q, k = structured_qk(b, s, args.heads, args.head_dim, args.dtype, seed=1)
        ref = triton_pooled_lse_scores(q, k, args.block)
        default = default_tiles(args.head_dim, args.block)
        rows = []
        for t in score_tiles():
            got = triton_pooled_lse_scores(q, k, args.block, tiles=t)
            rows.append({"seq": s, "batch": b, "tiles": t.short(), "default": t == default,
                         "max_abs_diff_vs_default": float((got - ref).abs().max()),
                         "ms": time_ms(lambda: triton_pooled_lse_scores(q, k, args.block, tiles=t), args.reps)})
        out += sorted(rows, key=lambda r: r["ms"])
    return out


COLUMNS = (("S x B", lambda r: f"{r['seq']}x{r['batch']}"), ("torch", "torch_ms"), ("triton", "triton_ms"),
           ("x", lambda r: f"{r['torch_ms'] / r['triton_ms']:.1f}"), ("pool", "pool_ms"), ("topk", "topk_ms"),
           ("select", "select_ms"), ("attn", "attn_ms"), ("share", lambda r: f"{100 * r['share']:.1f}%"),
           ("old share", lambda r: f"{100 * r['old_share']:.1f}%"), ("x6 old", "x6_old_ms"), ("x6 new", "x6_new_ms"),
           ("A/B", lambda r: "-" if r["ab_measured_x6_ms"] is None else f"{r['ab_measured_x6_ms']:.1f}"),
           ("agree", lambda r: f"{r['agree']:.4f}"), ("|d|", lambda r: f"{r['max_abs_diff']:.3f}"))


def print_table(rows, sweep_rows, skipped) -> None:
    cells = [[c[0] for c in COLUMNS]]
    for r in rows:
        cells.append([f(r) if callable(f) else f"{r[f]:.2f}" for _, f in COLUMNS])
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    print("ms per sparse layer and micro-batch (x6: the 6 sparse layers of a micro-batch; A/B: measured in the trainer "
          "with the torch scores)")
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    if sweep_rows:
        print("tile sweep (block_q, warps, stages), fastest first per shape:")
        for r in sweep_rows:
            print(f"  {r['seq']}x{r['batch']}  {r['tiles']:>10}  {r['ms']:.3f} ms{'  (default)' if r['default'] else ''}"
                  f"  |d| {r['max_abs_diff_vs_default']:.2e}")
    for s in skipped:
        print(f"skipped: {s}")


def _shape(text: str) -> tuple[int, int]:
    s, _, b = text.partition("x")
    return int(s), int(b or 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=_shape, default=None,
                   help="SxB micro-batch shapes (default: the A/B's on cuda, tiny ones on cpu)")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    p.add_argument("--block", type=int, default=64, choices=[64, 128])
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-sweep", dest="sweep", action="store_false")
    p.add_argument("--device", default="cuda", help="cpu: a plumbing check under TRITON_INTERPRET=1 (tiny shapes)")
    p.add_argument("--budget-s", type=float, default=90.0, help="shapes after this many seconds are skipped")
    p.add_argument("--out", required=True, help="JSON results path")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    global DEVICE
    DEVICE = torch.device(args.device)
    shapes = args.shapes or (AB_SHAPES if DEVICE.type == "cuda" else CPU_SHAPES)
    dtype_name, args.dtype = args.dtype, getattr(torch, args.dtype)
    extra = dict(heads=args.heads, head_dim=args.head_dim, block=args.block, density=args.density, dtype=dtype_name)
    meta = run_meta(**extra) if DEVICE.type == "cuda" else {"device": "cpu (interpreter)", "torch": torch.__version__,
                                                              "commit": "-", "date": "-", **extra}
    rows, skipped = [], []
    for s, b in shapes:
        if time.perf_counter() - t0 > args.budget_s:
            skipped.append(f"{s}x{b} (budget {args.budget_s:.0f} s spent)")
            continue
        rows.append(shape_row(s, b, args))
        print(f"{s}x{b}: select {rows[-1]['select_ms']:.2f} ms, attn {rows[-1]['attn_ms']:.2f} ms "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    sweep_rows = []
    if args.sweep:
        if time.perf_counter() - t0 > args.budget_s:
            skipped.append("the tile sweep (budget spent)")
        else:
            longest = max(shapes, key=lambda x: x[0])
            widest = max(shapes, key=lambda x: x[1])
            sweep_rows = sweep(sorted({longest, widest}), args)
    meta.update(wall_s=time.perf_counter() - t0, sweep=sweep_rows, skipped=skipped)
    print_table(rows, sweep_rows, skipped)
    print(f"wall {meta['wall_s']:.1f} s")
    write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
