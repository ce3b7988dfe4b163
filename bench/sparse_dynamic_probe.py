"""Probe (one GPU, <= ~90 s): does the dynamic-shape flex backend compile once, start new shapes fast,
and run as fast as a kernel compiled for one static shape?

Through the backend interface (``get_backend("flex")``), bf16, H = 12, Dh = 128, 128-token blocks:

1. warm-up: ``warmup([(1, S0), (2, S0)])`` (fwd+bwd; the two graphs dynamo specialises: B == 1, B >= 2);
2. compile count: fwd+bwd at many new (B, S) pairs, ragged and whole-block, incl. Ulysses-style
   ``valid_len`` padding; expected: no graph beyond the warm-up's (the ``graphs`` column);
3. first call of a new S after the warm-up: wall ms of the first fwd+bwd at that S (host-synchronised)
   minus the steady fwd+bwd at the same S (target: first-call overhead < 50 ms);
4. speed at S = 32,760 and 75,600, density 0.1: dynamic (ours) vs flex compiled with
   ``dynamic=False`` for that one shape (the old way) vs cuDNN SDPA dense; ratio dynamic / static
   ~1.0 says the ``torch._check`` kept Inductor's divisible path;
5. optionally (--measure) the backend's efficiency curve on this GPU, written to the measurement
   cache ``auto`` reads (adds ~10 s).

    python bench/sparse_dynamic_probe.py --out $OUT/sparse_dynamic_probe.json [--measure]

Needs only torch (+ triton) on the GPU node: ``ds_adaptive.attention.backends`` imports without pydantic /
DeepSpeed.

Prints a table; writes JSON (--out) after every phase, so a timeout still leaves the phases done.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

H, D, BS = 12, 128, 128
DTYPE = torch.bfloat16


def _qkv(b, s, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(b, s, H, D, generator=g).to(dev, DTYPE).requires_grad_() for _ in range(3)]


def _fwd_bwd(fn, q, k, v):
    out = fn(q, k, v)
    out.backward(torch.ones_like(out))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--measure", action="store_true", help="also measure and cache the backend's efficiency curve")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sparse_dynamic_probe: needs a CUDA GPU")
        return 2
    from ds_adaptive.attention.backends import get_backend
    from ds_adaptive.attention.backends.flex import block_mask_from_selection, compiled_graphs
    from ds_adaptive.attention.backends.measure import cuda_time_ms, random_selection

    dev = torch.device("cuda")
    fb = get_backend("flex")
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "H": H, "Dh": D, "block": BS}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out_path.write_text(json.dumps(res, indent=1))

    t_all = time.perf_counter()
    # 1. warm-up: the two graphs
    s0 = 1000
    res["warmup_s"] = fb.warmup([(1, s0), (2, s0)], num_heads=H, head_dim=D, dtype=DTYPE, device=dev, block_size=BS)
    res["graphs_after_warmup"] = compiled_graphs()
    print(f"warm-up (B=1 and B=2, fwd+bwd): {res['warmup_s']:.1f} s, {res['graphs_after_warmup']} graphs", flush=True)
    save()

    # 2 + 3. new shapes: graphs and first-call overhead
    rows = []
    pairs = [(1, 1560, None), (3, 1560, None), (2, 7800, None), (1, 14040, None), (1, 32760, None), (2, 16384, None),
             (1, 32768, 32760), (4, 4096, 4001), (1, 75600, None), (5, 2999, None)]
    for b, s, vl in pairs:
        q, k, v = _qkv(b, s, dev, seed=s)
        sel = random_selection(b, H, s, BS, 0.1, device=dev, seed=s)
        fn = lambda q_, k_, v_: fb.attention(q_, k_, v_, sel, valid_len=vl, density=0.1)  # noqa: E731
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _fwd_bwd(fn, q, k, v)
        torch.cuda.synchronize()
        first = (time.perf_counter() - t0) * 1e3
        steady = []
        for _ in range(3):
            t0 = time.perf_counter()
            _fwd_bwd(fn, q, k, v)
            torch.cuda.synchronize()
            steady.append((time.perf_counter() - t0) * 1e3)
        st = sorted(steady)[1]
        rows.append({"B": b, "S": s, "valid_len": vl, "first_ms": first, "steady_ms": st, "first_overhead_ms": first - st,
                     "graphs": compiled_graphs()})
        print(f"B={b} S={s:>6} valid={vl}: first {first:8.1f} ms, steady {st:8.1f} ms, overhead {first - st:7.1f} ms, "
              f"graphs {compiled_graphs()}", flush=True)
        del q, k, v, sel
    res["new_shapes"] = rows
    res["graphs_total"] = compiled_graphs()
    res["max_first_overhead_ms"] = max(r["first_overhead_ms"] for r in rows)
    save()

    # 4. dynamic vs static vs cuDNN at density 0.1
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    speed = []
    for s in (32760, 75600):
        q, k, v = _qkv(1, s, dev, seed=1)
        sel = random_selection(1, H, s, BS, 0.1, device=dev, seed=2)
        dyn = cuda_time_ms(lambda: _fwd_bwd(lambda a, b_, c: fb.attention(a, b_, c, sel, density=0.1), q, k, v), args.reps)
        static = torch.compile(flex_attention, dynamic=False, fullgraph=True)
        n = math.ceil(s / BS)
        tail = n * BS - s

        def static_fn(a, b_, c):
            bm = block_mask_from_selection(sel, with_q=True)
            a, b_, c = (F.pad(t, (0, 0, 0, 0, 0, tail)).transpose(1, 2) for t in (a, b_, c))
            return static(a, b_, c, block_mask=bm).transpose(1, 2)[:, :s]

        t0 = time.perf_counter()
        _fwd_bwd(static_fn, q, k, v)
        torch.cuda.synchronize()
        static_compile = time.perf_counter() - t0
        stat = cuda_time_ms(lambda: _fwd_bwd(static_fn, q, k, v), args.reps)

        def dense_fn(a, b_, c):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(a.transpose(1, 2), b_.transpose(1, 2),
                                                      c.transpose(1, 2)).transpose(1, 2)

        dense = cuda_time_ms(lambda: _fwd_bwd(dense_fn, q, k, v), args.reps)
        row = {"S": s, "density": 0.1, "dynamic_ms": dyn, "static_ms": stat, "dense_ms": dense,
               "dynamic_over_static": dyn / stat, "speedup_vs_dense": dense / dyn, "efficiency_vs_dense": 0.1 * dense / dyn,
               "static_compile_s": static_compile}
        speed.append(row)
        print(f"S={s}: dynamic {dyn:.2f} ms, static {stat:.2f} ms (dyn/static {dyn / stat:.3f}), cuDNN dense {dense:.2f} "
              f"ms -> {dense / dyn:.2f}x, efficiency {0.1 * dense / dyn:.3f}", flush=True)
        res["speed"] = speed
        save()
        del q, k, v, sel
    res["graphs_total"] = compiled_graphs()

    if args.measure:
        from ds_adaptive.attention.backends.measure import measure_backend

        m = measure_backend(fb, dev, dtype=DTYPE, head_dim=D, block_size=BS, num_heads=H)
        res["measured_curve"] = {"density": list(m.curve.density), "ratio": list(m.curve.ratio), "rows": m.rows,
                                 "seconds": m.seconds}
        print("measured curve g(rho):", {d: round(r, 4) for d, r in zip(m.curve.density, m.curve.ratio)}, flush=True)
    res["total_s"] = time.perf_counter() - t_all
    save()
    ok = res["graphs_total"] == res["graphs_after_warmup"] and res["max_first_overhead_ms"] < 50
    print(f"graphs after warm-up {res['graphs_after_warmup']}, total {res['graphs_total']}; worst first-call overhead "
          f"{res['max_first_overhead_ms']:.1f} ms; {'OK' if ok else 'NOT OK'}; {res['total_s']:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
