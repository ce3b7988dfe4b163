"""Block-sparse attention kernel vs dense cuDNN SDPA, Wan 1.3B heads (12 x 128), bf16, fwd+bwd.

For each S (default 32,760 and 75,600 tokens: 81x480x832 and 81x720x1280 videos), in one run:

* dense: ``dense_attention`` (SDPA on [B, S, H, Dh] views) under the cuDNN backend (flash: --flash);
* sparse: ``flex_block_sparse_attention`` with a block top-k selection (128-token blocks, diagonal
  kept, random block scores) at each density of --densities, for each flex ``kernel_options``
  config of the sweep (all of --configs at the first S; torch's default and the per-density winners
  at the others): time, speed-up vs cuDNN and effective TFLOP/s (dense FLOPs x selected share /
  time) as a share of cuDNN's; the BlockMask is prebuilt (the kernel alone). The winners per density
  bucket are written as a kernel-options table (--table-out, the format of
  ``ds_adaptive/attention/kernel_options.json``) and timed again as the op's routing (``density=``)
  picks them, the op building its mask itself: the "table" rows (kernel + one mask build);
* selection per sparse layer and training step (``bench/kernels/sparse_select.py``): eager host-inclusive
  time, host (launch) time and GPU time of scores + top-k, the BlockMask builds and the host-parked
  selection cache, vs the old ``from_kv_blocks`` path, as a share of the sparse fwd+bwd at 0.1;
  a torch.profiler trace of one layer's selection + masks + flex fwd (no grad) + recompute fwd+bwd
  at the first S (--trace), with the host-sync calls it contains counted.

Timing: CUDA events, --warmup untimed then --reps timed calls, median. FLOPs: 4 B H S^2 Dh for the
forward, x3.5 for fwd+bwd (backward = 2.5 forward). Prints tables, writes JSON (--out).

    python bench/kernels/sparse_kernel.py --out bench/out/sparse_kernel.json --table-out kernel_options.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sparse_common import cuda_time as _time, run_meta, write_results  # noqa: E402
from sparse_select import selection_overhead  # noqa: E402

_DEF_BWD = {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64}
CONFIGS = {
    # name: flex kernel_options (torch 2.11 fwd_/bwd_ keys); "default" = torch's sm90 choice
    # (fwd 128x64, 8 warps, 3 stages; bwd 64x128 / 128x64, 8 warps, 3 stages)
    "default": {},
    "f64x64w4": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3,
                 "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                 "bwd_num_warps": 4, "bwd_num_stages": 3},
    "f128x128s2": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2,
                   **_DEF_BWD, "bwd_num_warps": 8, "bwd_num_stages": 2},
    "f64x128w4_b32": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_warps": 4, "fwd_num_stages": 3,
                      "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                      "bwd_num_warps": 4, "bwd_num_stages": 3},
    "f128x64s4_b64w4": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 4,
                        **_DEF_BWD, "bwd_num_warps": 4, "bwd_num_stages": 3},
}


MIN_GAIN = 0.98
"""A config replaces torch's default in a bucket only when its mean time ratio is below this."""


def _buckets(densities):
    """Bucket upper bounds: midpoints between the measured densities, the last 1.0."""
    ds = sorted(densities)
    return [round((a + b) / 2, 4) for a, b in zip(ds, ds[1:])] + [1.0]


def build_table(rows, densities, meta) -> dict:
    """Per measured density the config with the lowest mean ms / default ms over the S where it ran
    everywhere (default unless that is below MIN_GAIN); adjacent buckets with the same winner merged."""
    seqs = [r["seq"] for r in rows]
    buckets = []
    for d, top in zip(sorted(densities), _buckets(densities)):
        ratios = {}
        for name in CONFIGS:
            rs = []
            for r in rows:
                ms = {x["config"]: x["ms"] for x in r["sparse"] if abs(x["density"] - d) < 1e-9}
                if name in ms and "default" in ms:
                    rs.append((r["seq"], ms[name], ms["default"]))
            if len(rs) == len(seqs):
                ratios[name] = (sum(a / b for _, a, b in rs) / len(rs), rs)
        best = min(ratios, key=lambda n: ratios[n][0])
        if ratios[best][0] > MIN_GAIN:  # within noise of torch's default: keep the default
            best = "default"
        measured = [{"seq": s, "density": d, "ms": round(a, 4), "default_ms": round(b, 4), "config": best}
                    for s, a, b in ratios[best][1]]
        if buckets and buckets[-1]["config"] == best:
            buckets[-1]["max_density"] = top
            buckets[-1]["measured"] += measured
        else:
            buckets.append({"max_density": top, "config": best, "options": dict(CONFIGS[best]), "measured": measured})
    return {"device": meta["device"], "capability": list(torch.cuda.get_device_capability()), "head_dim": meta["head_dim"],
            "dtype": "bfloat16", "torch": meta["torch"], "commit": meta["commit"], "date": meta["date"],
            "command": "python bench/kernels/sparse_kernel.py " + " ".join(sys.argv[1:]), "buckets": buckets}


def _sparse_row(flops, cudnn_ms, config, dens, share, ms, table_opts=None):
    eff = flops * share / ms / 1e9
    return {"config": config, "density": dens, "selected_share": share, "ms": ms, "speedup_vs_cudnn": cudnn_ms / ms,
            "eff_tflops": eff, "eff_vs_cudnn": eff / (flops / cudnn_ms / 1e9), "options": table_opts}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[32760, 75600])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--densities", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.4])
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--configs", nargs="+", default=[c for c in CONFIGS if c != "f128x128s2"], choices=sorted(CONFIGS),
                   help="kernel_options configs swept at the first S ('default' is always included)")
    p.add_argument("--winners", type=int, default=1, help="configs besides default timed at the later S")
    p.add_argument("--flash", action="store_true", help="also time dense flash SDPA")
    p.add_argument("--trace", default=None, help="chrome trace of one layer's selection + attention (first S)")
    p.add_argument("--table-out", default=None, help="write the measured kernel-options table here")
    p.add_argument("--out", default="bench/out/sparse_kernel.json")
    args = p.parse_args(argv)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ds_adaptive.attention import kernel_options as ko
    from ds_adaptive.attention.attention import dense_attention
    from ds_adaptive.attention.backends.flex import block_mask_from_selection, flex_block_sparse_attention
    from ds_adaptive.attention.selection import blocks_for_density, select_blocks

    dev = torch.device("cuda")
    b, h, d = args.batch, args.heads, args.head_dim
    configs = ["default"] + [c for c in args.configs if c != "default"]
    rows = []
    for si, s in enumerate(args.seq):
        g = torch.Generator(device=dev).manual_seed(s)
        q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
                   for _ in range(3))
        dout = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16, generator=g)
        flops = 3.5 * 4 * b * h * s * s * d

        def run(attn):
            def f():
                q.grad = k.grad = v.grad = None
                attn().backward(dout)
            return f

        res = {"seq": s}
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            res["cudnn_ms"] = _time(run(lambda: dense_attention(q, k, v)), args.warmup, args.reps)
        if args.flash:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                res["flash_ms"] = _time(run(lambda: dense_attention(q, k, v)), args.warmup, args.reps)
        res["cudnn_tflops"] = flops / res["cudnn_ms"] / 1e9
        nk = math.ceil(s / args.block)
        sels = {dens: select_blocks(torch.randn(b, h, nk, nk, device=dev, generator=g),
                                    blocks_for_density(torch.full((h,), dens), nk), seq_len=s, block_size=args.block)
                for dens in args.densities}
        res["sparse"] = []
        names = configs if si == 0 else ["default"] + winners
        for name in names:
            opts = CONFIGS[name] or None
            for dens, sel in sels.items():
                share = float(sel.density().mean())
                try:  # the kernel alone: the mask prebuilt (its cost is in the selection figures)
                    bm = block_mask_from_selection(sel)
                    ms = _time(run(lambda: flex_block_sparse_attention(q, k, v, sel, kernel_options=opts, block_mask=bm,
                                                                     max_graphs=64)),
                               args.warmup, args.reps)
                except Exception as exc:  # a tile config that does not compile: report, keep going
                    print(f"config {name} at S={s} density {dens}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    break
                res["sparse"].append(_sparse_row(flops, res["cudnn_ms"], name, dens, share, ms))
            print(f"S={s} {name}: " + " ".join(f"{x['density']}:{x['ms']:.2f}" for x in res["sparse"]
                                                 if x["config"] == name), flush=True)
        if si == 0:  # the later S time default + the configs that won most often here
            best = {}
            for dens in args.densities:
                cand = [x for x in res["sparse"] if abs(x["density"] - dens) < 1e-9]
                best[dens] = min(cand, key=lambda x: x["ms"])["config"]
            ranked = sorted({c for c in best.values() if c != "default"},
                            key=lambda c: -list(best.values()).count(c))
            winners = ranked[:args.winners]
        rows.append(res)
        del q, k, v, dout
        torch.cuda.empty_cache()

    meta = run_meta(batch=b, heads=h, head_dim=d, block=args.block, warmup=args.warmup, reps=args.reps)
    table = build_table(rows, args.densities, meta)
    if args.table_out:
        Path(args.table_out).write_text(json.dumps(table, indent=1))
        print(f"wrote {args.table_out}")
    ko.use_table(table)
    for si, s in enumerate(args.seq):  # the op's own routing with the table: the shipped default
        _table_rows(rows[si], s, args)
        rows[si]["selection"] = selection_overhead(s, args, trace=args.trace if si == 0 else None,
                                                   sparse_ms_at_01=_ms_at(rows[si], 0.1, "default"))
        torch.cuda.empty_cache()
    _print(rows, meta, args)
    write_results(args.out, {**meta, "table": table}, rows)
    return 0


def _ms_at(res, dens, config):
    return next((x["ms"] for x in res["sparse"] if abs(x["density"] - dens) < 1e-9 and x["config"] == config), None)


def _table_rows(res, s, args) -> None:
    """Time the sparse op with ``density=`` (the table's routing) at every density of --densities."""
    from ds_adaptive.attention.backends.flex import flex_block_sparse_attention
    from ds_adaptive.attention.kernel_options import options_for
    from ds_adaptive.attention.selection import blocks_for_density, select_blocks
    dev = torch.device("cuda")
    b, h, d = args.batch, args.heads, args.head_dim
    g = torch.Generator(device=dev).manual_seed(s)
    q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
               for _ in range(3))
    dout = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16, generator=g)
    flops = 3.5 * 4 * b * h * s * s * d
    nk = math.ceil(s / args.block)
    for dens in args.densities:
        sel = select_blocks(torch.randn(b, h, nk, nk, device=dev, generator=g),
                            blocks_for_density(torch.full((h,), dens), nk), seq_len=s, block_size=args.block)
        share = float(sel.density().mean())
        opts = options_for(share, head_dim=d, dtype=torch.bfloat16, device=dev)

        def f():
            q.grad = k.grad = v.grad = None
            flex_block_sparse_attention(q, k, v, sel, density=share).backward(dout)
        ms = _time(f, args.warmup, args.reps)
        res["sparse"].append(_sparse_row(flops, res["cudnn_ms"], "table", dens, share, ms, opts))


def _print(rows, meta, args) -> None:
    print(f"# sparse kernel, {meta['device']}, torch {meta['torch']}, commit {meta['commit']}, "
          f"B={args.batch} H={args.heads} Dh={args.head_dim} bf16 fwd+bwd")
    print(f"{'S':>7} {'cuDNN ms':>9} {'cuDNN TF/s':>10} | {'config':>16} {'dens':>5} {'ms':>8} "
          f"{'x cuDNN':>8} {'eff TF/s':>8} {'eff/cuDNN':>9}")
    for r in rows:
        for i, x in enumerate(r["sparse"]):
            head = f"{r['seq']:>7} {r['cudnn_ms']:9.2f} {r['cudnn_tflops']:10.0f}" if i == 0 else " " * 28
            print(f"{head} | {x['config']:>16} {x['density']:5.2f} {x['ms']:8.2f} {x['speedup_vs_cudnn']:8.2f} "
                  f"{x['eff_tflops']:8.0f} {x['eff_vs_cudnn']:9.2f}")
    print("# selection per sparse layer and training step (checkpointed: forward + recompute)")
    for r in rows:
        sel = r["selection"]
        for name, t in sel["parts"].items():
            print(f"{r['seq']:>7} {name:>22}: eager {t['eager_ms']:.3f} ms, host {t['host_ms']:.3f} ms, "
                  f"GPU {t['gpu_ms']:.3f} ms")
        print(f"{r['seq']:>7} per step new: eager {sel['step_eager_ms']:.2f} ms ({100 * sel['share_eager']:.1f}% of "
              f"sparse fwd+bwd at 0.1), GPU {sel['step_gpu_ms']:.2f} ms ({100 * sel['share_gpu']:.1f}%); old path eager "
              f"{sel['old_step_eager_ms']:.2f} ms ({100 * sel['old_share_eager']:.1f}%); host syncs in the "
              f"selection: {sel['syncs']}")


if __name__ == "__main__":
    raise SystemExit(main())
