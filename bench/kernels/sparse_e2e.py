"""Wan 2.1 1.3B, full depth, one GPU: sparse attention at a forced density vs dense, same run.

Fixed batches (default B=1 of 81x480x832 -> 32,760 tokens and 81x720x1280 -> 75,600 tokens),
bf16 parameters, every block activation-checkpointed, flow-matching-like MSE loss on random latents
and T5-width context (512 tokens). Per shape: dense (SDPA, raster order) and sparse
(``forced_density``; the first and last layer dense; cube order 2x8x8; flex block-sparse) fwd+bwd
step time (median of --steps after --warmup; no optimizer step: it is the same for both) and peak
memory. Prints the table of ratios, writes JSON.

    python bench/kernels/sparse_e2e.py --out bench/out/sparse_e2e.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sparse_common import cuda_time, run_meta, write_results  # noqa: E402

SHAPES = {"81x480x832": (21, 60, 104), "81x720x1280": (21, 90, 160)}


def _measure(model, rt, batch, args, mode) -> dict:
    """Step time (median of --steps) and peak memory of a whole step, of the forward, of the backward,
    and the memory held at the end of the forward (checkpoint inputs, cached selections, ...)."""
    lat, ts, ctx, tgt = batch
    phases = {}

    def step():
        model.zero_grad(set_to_none=True)
        torch.cuda.reset_peak_memory_stats()
        loss = (model(lat, ts, ctx).float() - tgt).square().mean()
        phases["fwd_peak"] = torch.cuda.max_memory_allocated()
        phases["after_fwd"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        phases["bwd_peak"] = torch.cuda.max_memory_allocated()
        if rt is not None:
            rt.step()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    out = {f"{mode}_ms": cuda_time(step, 0, args.steps)}
    gib = 2 ** 30
    out[f"{mode}_fwd_peak_gib"] = phases["fwd_peak"] / gib
    out[f"{mode}_bwd_peak_gib"] = phases["bwd_peak"] / gib
    out[f"{mode}_after_fwd_gib"] = phases["after_fwd"] / gib
    out[f"{mode}_peak_gib"] = max(phases["fwd_peak"], phases["bwd_peak"]) / gib
    if rt is not None:
        m = rt.metrics()
        out.update({"sparse_layers": m["sparse/sparse_layers"], "selected_density": m["sparse/selected_density"],
                    f"{mode}_select_ms_per_step": m["sparse/select_ms"]})
    print(mode, out, flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="wan2.1-1.3b")
    p.add_argument("--layers", type=int, default=None, help="override the depth (smoke runs)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--kernel-table", default=None, help="kernel-options table to use (default: the shipped one)")
    p.add_argument("--caches", nargs="+", default=["host"], choices=["host", "device"],
                   help="selection_cache settings to time (one sparse run each; the first is the headline)")
    p.add_argument("--out", default="bench/out/sparse_e2e.json")
    args = p.parse_args(argv)

    from ds_adaptive.models.testing import random_init_
    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.models.wan_config import get_wan_config
    from ds_adaptive.attention.runtime import SparseAttentionRuntime

    dev = torch.device("cuda")
    over = {"num_layers": args.layers} if args.layers else {}
    cfg = get_wan_config(args.model, **over)
    model = random_init_(WanModel(cfg), seed=0).to(dev).to_dtype(torch.bfloat16)
    model.gradient_checkpointing = True
    if args.kernel_table:
        from ds_adaptive.attention.kernel_options import use_table
        use_table(args.kernel_table)
    rts = {c: SparseAttentionRuntime({"enabled": True, "forced_density": args.density, "selection_cache": c},
                                     num_layers=cfg.num_layers, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                                     device=dev) for c in args.caches}
    rows = []
    for name in args.shapes:
        t, hh, ww = SHAPES[name]
        g = torch.Generator(device=dev).manual_seed(0)
        lat = torch.randn(1, 16, t, hh, ww, device=dev, generator=g)
        tgt = torch.randn(1, 16, t, hh, ww, device=dev, generator=g)
        ctx = torch.randn(1, 512, 4096, device=dev, generator=g)
        ts = torch.tensor([500.0], device=dev)
        row = {"shape": name, "tokens": t * hh * ww // 4}
        for mode in ["dense"] + [f"sparse_{c}" for c in args.caches]:
            rt = rts.get(mode[len("sparse_"):])
            if rt is not None:
                rt.install(model)
            else:
                model.set_attention(None)
                model.set_token_order(None)
            row.update(_measure(model, rt, (lat, ts, ctx, tgt), args, mode))
        for c in args.caches[1:]:
            row[f"peak_ratio_{c}"] = row[f"sparse_{c}_peak_gib"] / row["dense_peak_gib"]
        for key in ("ms", "peak_gib", "fwd_peak_gib", "bwd_peak_gib", "after_fwd_gib"):
            row[f"sparse_{key}"] = row[f"sparse_{args.caches[0]}_{key}"]
        row["speedup"] = row["dense_ms"] / row["sparse_ms"]
        row["peak_ratio"] = row["sparse_peak_gib"] / row["dense_peak_gib"]
        rows.append(row)
        print(row, flush=True)
    meta = run_meta(model=args.model, layers=cfg.num_layers, density=args.density, warmup=args.warmup,
                    steps=args.steps, caches=args.caches, kernel_table=args.kernel_table or "shipped")
    commit = meta["commit"]
    print(f"# Wan {args.model} ({cfg.num_layers} layers), {meta['device']}, commit {commit}, bf16, checkpointed, "
          f"B=1, sparse density {args.density} (first/last dense)")
    print(f"{'shape':>12} {'tokens':>7} {'dense ms':>9} {'sparse ms':>9} {'speedup':>8} {'dense GiB':>9} "
          f"{'sparse GiB':>10} {'ratio':>7} {'sel ms':>7}   (peaks fwd / bwd, held after fwd, GiB)")
    for r in rows:
        c = args.caches[0]
        print(f"{r['shape']:>12} {r['tokens']:>7} {r['dense_ms']:9.0f} {r['sparse_ms']:9.0f} {r['speedup']:8.2f} "
              f"{r['dense_peak_gib']:9.3f} {r['sparse_peak_gib']:10.3f} {r['peak_ratio']:7.4f} "
              f"{r[f'sparse_{c}_select_ms_per_step']:7.1f}   dense {r['dense_fwd_peak_gib']:.3f} / "
              f"{r['dense_bwd_peak_gib']:.3f}, {r['dense_after_fwd_gib']:.3f}; sparse {r['sparse_fwd_peak_gib']:.3f} / "
              f"{r['sparse_bwd_peak_gib']:.3f}, {r['sparse_after_fwd_gib']:.3f}")
        for c2 in args.caches[1:]:
            print(f"{'':>12} selection_cache {c2}: {r[f'sparse_{c2}_ms']:.0f} ms, peak {r[f'sparse_{c2}_peak_gib']:.3f} GiB "
                  f"(x{r[f'peak_ratio_{c2}']:.4f} of dense), held after fwd {r[f'sparse_{c2}_after_fwd_gib']:.3f}")
    write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
