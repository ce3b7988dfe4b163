"""Block-sparse attention kernel vs dense cuDNN SDPA, Wan 1.3B heads (12 x 128), bf16, fwd+bwd.

For each S (default 32,760 and 75,600 tokens: 81x480x832 and 81x720x1280 videos), in one run:

* dense: ``dense_attention`` (SDPA on [B, S, H, Dh] views) under the cuDNN backend, and flash;
* sparse: ``flex_block_sparse_attention`` with a block top-k selection (128-token blocks, diagonal
  kept, random block scores) at each density of --densities: time, speed-up vs cuDNN and effective
  TFLOP/s (dense-equivalent FLOPs x selected share / time) as a share of cuDNN's;
* overhead per layer and forward: predictor block scores + top-k + BlockMask build (what every
  sparse layer pays), as a share of the sparse fwd+bwd at density 0.1; and a profiling pass
  (exact logits of 128 rows, density, predictor loss + backward: every profile_interval steps).

Timing: CUDA events, --warmup untimed then --reps timed calls, median. FLOPs: 4 B H S^2 Dh for the
forward, x3.5 for fwd+bwd (backward = 2.5 forward). Prints a table, writes JSON (--out).

    python bench/sparse_kernel.py --out bench/results/sparse_kernel_h200.json
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sparse_common import cuda_time as _time, run_meta, write_results  # noqa: E402


VARIANTS = {
    # name: (pad_to_block, kernel_options); "pad" is the op's default
    "pad": (True, None),
    "nopad": (False, None),
    "pad_m128n128w8s2": (True, {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}),
    "pad_tma": (True, {"USE_TMA": True}),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[32760, 75600])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--densities", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.4])
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--variants", nargs="+", default=["pad"], choices=sorted(VARIANTS),
                   help="kernel variants to time (the first is the one the summary ratios use)")
    p.add_argument("--out", default="bench/results/sparse_kernel.json")
    args = p.parse_args(argv)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ds_adaptive.sparse.attention import block_mask_from_selection, dense_attention, flex_block_sparse_attention
    from ds_adaptive.sparse.predictor import LowRankPredictor
    from ds_adaptive.sparse.profiler import exact_logits, profile_rows, sample_rows
    from ds_adaptive.sparse.selection import blocks_for_density, select_blocks

    dev = torch.device("cuda")
    b, h, d = args.batch, args.heads, args.head_dim
    rows = []
    for s in args.seq:
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
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            res["flash_ms"] = _time(run(lambda: dense_attention(q, k, v)), args.warmup, args.reps)
        res["cudnn_tflops"] = flops / res["cudnn_ms"] / 1e9
        nk = math.ceil(s / args.block)
        res["sparse"] = []
        sels = {}
        for dens in args.densities:
            kph = blocks_for_density(torch.full((h,), dens), nk)
            sels[dens] = select_blocks(torch.randn(b, h, nk, nk, device=dev, generator=g), kph, seq_len=s,
                                       block_size=args.block)
        for vname in args.variants:
            pad, opts = VARIANTS[vname]
            for dens, sel in sels.items():
                share = float(sel.density().mean())
                try:
                    bm = block_mask_from_selection(sel, pad_to_block=pad)
                    ms = _time(run(lambda: flex_block_sparse_attention(q, k, v, sel, block_mask=bm, pad_to_block=pad,
                                                                       kernel_options=opts)), args.warmup, args.reps)
                except Exception as exc:  # a tile config that does not compile: report, keep going
                    print(f"variant {vname} at S={s} density {dens}: {type(exc).__name__}: {str(exc)[:300]}")
                    break
                eff = flops * share / ms / 1e9
                res["sparse"].append({"variant": vname, "density": dens, "selected_share": share, "ms": ms,
                                      "speedup_vs_cudnn": res["cudnn_ms"] / ms, "eff_tflops": eff,
                                      "eff_vs_cudnn": eff / res["cudnn_tflops"]})
        # overhead of one sparse layer per training step: predictor block scores + top-k (forward), and the
        # BlockMask build (forward, and again in the activation-checkpointing recompute)
        pred = LowRankPredictor(1, h, d, 16).to(dev)
        kph = blocks_for_density(torch.full((h,), 0.1), nk)
        qd, kd = q.detach(), k.detach()
        sel01 = select_blocks(pred.block_scores(0, qd, kd, args.block), kph, seq_len=s, block_size=args.block)
        res["score_topk_ms"] = _time(lambda: select_blocks(pred.block_scores(0, qd, kd, args.block), kph, seq_len=s,
                                                           block_size=args.block), args.warmup, args.reps)
        res["mask_ms"] = _time(lambda: block_mask_from_selection(sel01), args.warmup, args.reps)
        res["score_topk_lse_ms"] = _time(lambda: select_blocks(pred.block_scores(0, qd, kd, args.block, mode="lse"), kph,
                                                               seq_len=s, block_size=args.block), args.warmup, args.reps)
        res["select_ms"] = res["score_topk_ms"] + 2 * res["mask_ms"]
        gen = torch.Generator().manual_seed(0)

        def profile():
            r = sample_rows(s, 128, generator=gen, device=dev)
            lg = exact_logits(qd, kd, r)
            profile_rows(lg, r, args.block, 0.99)
            pred.loss(0, qd[:, r], kd, lg).backward()
        res["profile_ms"] = _time(profile, args.warmup, args.reps)
        sp01 = next((x["ms"] for x in res["sparse"] if abs(x["density"] - 0.1) < 1e-9
                     and x["variant"] == args.variants[0]), None)
        res["select_share_at_0.1"] = res["select_ms"] / sp01 if sp01 else None
        rows.append(res)
        del q, k, v, dout
        torch.cuda.empty_cache()

    meta = run_meta(batch=b, heads=h, head_dim=d, block=args.block, warmup=args.warmup, reps=args.reps)
    commit = meta["commit"]
    print(f"# sparse kernel, {meta['device']}, torch {meta['torch']}, commit {commit}, B={b} H={h} Dh={d} bf16 fwd+bwd")
    print(f"{'S':>7} {'cuDNN ms':>9} {'flash ms':>9} {'cuDNN TF/s':>10} | {'variant':>16} {'dens':>5} {'ms':>8} "
          f"{'x cuDNN':>8} {'eff TF/s':>8} {'eff/cuDNN':>9}")
    for r in rows:
        for i, x in enumerate(r["sparse"]):
            head = (f"{r['seq']:>7} {r['cudnn_ms']:9.2f} {r['flash_ms']:9.2f} {r['cudnn_tflops']:10.0f}" if i == 0
                    else " " * 38)
            print(f"{head} | {x['variant']:>16} {x['density']:5.2f} {x['ms']:8.2f} {x['speedup_vs_cudnn']:8.2f} {x['eff_tflops']:8.0f} "
                  f"{x['eff_vs_cudnn']:9.2f}")
        print(f"{'':>7} per layer and step: scores+top-k {r['score_topk_ms']:.2f} ms + 2 x BlockMask {r['mask_ms']:.2f} ms "
              f"= {r['select_ms']:.2f} ms = {100 * (r['select_share_at_0.1'] or 0):.1f}% of sparse fwd+bwd at 0.1; "
              f"profiling pass {r['profile_ms']:.2f} ms; scores+top-k with block_score=lse {r['score_topk_lse_ms']:.2f} ms")
    write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
