"""Every block-sparse attention backend vs dense cuDNN SDPA on one table (fwd+bwd), and the Triton kernels' tile sweep.

One run, one GPU, B = 1, bf16, head dim --head-dim, --block-token blocks (random block top-k selections, the
query block's own block kept), for every (S, H) of --seq x --heads (cheapest first) and density of --densities:

* ``cudnn``: dense SDPA fwd+bwd under the cuDNN backend (flash where cuDNN refuses) -- the yardstick;
* every registered backend of ``ds_adaptive.attention.backends`` that runs here and does not materialise S x S
  (``flex``: compiled FlexAttention with dynamic shapes; ``triton``: ours, with the tile table of the sweep);
* ``flex_static``: FlexAttention compiled per shape (dynamic=False, the pre-backend path), a baseline;
* ``triton_atomic``: ours with dQ by TMA bulk reductions where the sweep found that backward >= 3% faster
  (not deterministic; the written table keeps the split backward unless --allow-atomic).

Columns: fwd+bwd ms (CUDA events, median), effective TFLOP/s (dense FLOPs x selected block share / time, dense
FLOPs = 3.5 x 4 B H S^2 Dh), efficiency vs cuDNN (= effective / cuDNN TFLOP/s), speed-up vs cuDNN. Per backend and
shape also: its warm-up / first-call seconds, the first call of a NEW S (S - 37, density 0.1) as wall ms and as
overhead over its steady time (and for triton the kernels compiled by it: must be 0), and at density 0.1 the max
|out - out_triton| relative to max |out| (a cross-check at large S).

Sweep (on unless --no-sweep; at the first (S, H)): each Triton kernel alone -- forward, dQ, dK/dV (split) and dK/dV
with atomic dQ -- over a few tile configs (``*_TILES`` below) at every density; per density the fastest of each
kernel make the config (split dQ unless --allow-atomic and atomic is >= 3% faster); adjacent densities with the
same config merge into one bucket. --table-out writes the table in ``ds_adaptive/attention/kernels/triton_configs.json``
format (with the measured curve g(rho) = triton ms / cuDNN ms, the max over the shapes run) for the triton rows and
for shipping; without a sweep the shipped table (or the defaults) is used.

Budget: the default table (4 shapes x 4 densities x cudnn/flex/flex_static/triton + sweep) took 79 s on one H200
(6eceb6a); --budget-s (default 170) skips the remaining (shape, backend) groups once spent and lists them (ours
first in each shape). Subsets: --seq/--heads/--densities/--backends (``--backends triton``: the sweep, ours and
cuDNN only, ~50 s), --quick (S 32,760, H 12, densities 0.05 0.1 0.4).

    python bench/kernels/sparse_backends.py --out $OUT/sparse_backends.json --table-out $OUT/triton_configs.json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sparse_common import run_meta, write_results  # noqa: E402
from ds_adaptive.attention.kernels.triton_configs import merge_tables, table_from_sweep, worst_curves  # noqa: E402

COMMAND = "python bench/kernels/sparse_backends.py " + " ".join(sys.argv[1:])

# (block_m, block_n, num_warps, num_stages) candidates per kernel and block size; the first of each list is
# default_config's. All compile without register spills on sm90 (triton 3.6, offline ptxas check) except
# dkdv 64x128w8s2 (8 bytes; it tied the best dK/dV tile on the H200).
TILES = {
    128: {"fwd": [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
          "dq": [(128, 128, 8, 2), (128, 64, 8, 2), (64, 128, 8, 2), (64, 64, 4, 2)],
          "dkdv": [(32, 64, 4, 3), (64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 4)],
          "atomic": [(16, 128, 8, 4), (32, 128, 8, 2), (64, 64, 8, 2)]},
    64: {"fwd": [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (64, 64, 8, 3)],
         "dq": [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (64, 64, 8, 3)],
         "dkdv": [(32, 64, 4, 3), (64, 64, 8, 3), (64, 64, 4, 2), (16, 64, 4, 3)],
         "atomic": [(64, 64, 8, 3), (16, 64, 4, 3)]},
}
"""15 kernels to compile per block size (0.5-1 s each: 7.8 s of CPU for 14 on the dev machine, cold cache). Block 128:
the H200 winners of 6eceb6a first (bench/results/sparse/sparse_backends_h200_6eceb6a), then a deeper pipeline, a narrower
tile and a two-programs-per-SM tile per kernel; atomic dQ now by TMA bulk reductions."""
TARGET_MS = 400.0
"""Timed calls per measurement: about this many ms of GPU time (at least 1, at most --reps)."""
ATOMIC_GAIN = 0.97


DEVICE = torch.device("cuda")
"""Where the bench runs (``--device cpu`` under TRITON_INTERPRET=1: a plumbing check of the whole run on CPU)."""


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _timed_ms(fn) -> float:
    if DEVICE.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def measure(fn, reps_max: int) -> dict:
    """``{"first_ms": wall ms of the first call (compiles included), "ms": median event time}``."""
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    first = (time.perf_counter() - t0) * 1e3
    times = []
    n = reps_max
    i = 0
    while i < n:
        times.append(_timed_ms(fn))
        if i == 0:  # adapt the count to the call's length
            n = max(1, min(reps_max, int(TARGET_MS / max(times[0], 1e-3))))
        i += 1
    return {"first_ms": first, "ms": statistics.median(times)}


def _tiles(block: int, kind: str) -> list:
    from ds_adaptive.attention.kernels import TileConfig

    return [TileConfig(*t) for t in TILES[block][kind]]


# ------------------------------------------------------------------------------------------ sweep
def sweep(q, k, v, dout, sels: dict, block: int, reps: int) -> tuple[list, dict, dict]:
    """Each Triton kernel alone over its tile candidates at every density; returns (rows, split winners,
    winners with atomic dQ where that backward is >= 3% faster), the winners as ``{density: (config, record)}``."""
    from ds_adaptive.attention.kernels import KernelConfig, default_config
    from ds_adaptive.attention.kernels.triton_block_sparse import BackwardLaunch, block_sparse_forward

    d = q.shape[-1]
    base = default_config(d, block)
    s = q.shape[1]
    rows, chosen, chosen_atomic = [], {}, {}
    for dens, sel in sels.items():
        out, lse = block_sparse_forward(q, k, v, sel.kv_num, sel.kv_idx, block=block, seq=s, config=base)
        bl = BackwardLaunch(q, k, v, out, lse, dout, sel.kv_num, sel.kv_idx, block=block, seq=s)
        bl.run_delta()  # delta for the dQ and dK/dV timings
        jobs = [("fwd", t, lambda t=t: block_sparse_forward(q, k, v, sel.kv_num, sel.kv_idx, block=block, seq=s,
                                                           config=KernelConfig(t, base.dq, base.dkdv)))
                for t in _tiles(block, "fwd")]
        jobs += [("dq", t, lambda t=t: bl.run_dq(t)) for t in _tiles(block, "dq")]
        jobs += [("dkdv", t, lambda t=t: bl.run_dkdv(t, False)) for t in _tiles(block, "dkdv")]
        jobs += [("atomic", t, lambda t=t: bl.run_dkdv(t, True)) for t in _tiles(block, "atomic")]
        jobs += [("delta", None, bl.run_delta)]
        best = {}
        for kind, t, fn in jobs:
            try:
                m = measure(fn, reps)
            except Exception as exc:  # a tile that does not fit (shared memory, registers): report, go on
                rows.append({"density": dens, "kernel": kind, "tile": t and t.short(), "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                print(f"  sweep {kind} {t and t.short()} at {dens}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            rows.append({"density": dens, "kernel": kind, "tile": t and t.short(), "ms": m["ms"], "first_ms": m["first_ms"]})
            if kind not in best or m["ms"] < best[kind][1]:
                best[kind] = (t, m["ms"])
        split_ms = best["delta"][1] + best["dq"][1] + best["dkdv"][1]
        atomic_ms = best["delta"][1] + best["atomic"][1] if "atomic" in best else math.inf
        cfg = KernelConfig(best["fwd"][0], best["dq"][0], best["dkdv"][0])
        rec = {"density": dens, "seq": s, "heads": q.shape[2], "fwd_ms": best["fwd"][1], "dq_ms": best["dq"][1],
               "dkdv_ms": best["dkdv"][1], "split_bwd_ms": split_ms,
               "atomic_bwd_ms": atomic_ms if math.isfinite(atomic_ms) else None}
        chosen[dens] = (cfg, rec)
        chosen_atomic[dens] = (KernelConfig(cfg.fwd, cfg.dq, best["atomic"][0], atomic_dq=True)
                               if atomic_ms < ATOMIC_GAIN * split_ms else cfg, rec)
        print(f"  sweep {dens}: fwd {best['fwd'][0].short()} {best['fwd'][1]:.3f} ms, dq {best['dq'][0].short()} "
              f"{best['dq'][1]:.3f}, dkdv {best['dkdv'][0].short()} {best['dkdv'][1]:.3f}, split bwd {split_ms:.3f}, "
              f"atomic bwd {atomic_ms:.3f} -> {cfg.short()} (atomic dQ: {chosen_atomic[dens][0].short()})", flush=True)
    return rows, chosen, chosen_atomic


# ------------------------------------------------------------------------------------------ rows
class _FlexStatic:
    """FlexAttention compiled per shape (dynamic=False): the pre-backend path, a baseline only."""

    name = "flex_static"

    def __init__(self):
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 256)
        self.fn = torch.compile(flex_attention, dynamic=False, fullgraph=True)

    def attention(self, q, k, v, sel, *, valid_len=None, density=None):
        import torch.nn.functional as F

        from ds_adaptive.attention.backends.flex import block_mask_from_selection

        s, bs = q.shape[1], sel.block_size
        tail = (-s) % bs
        qp, kp, vp = (F.pad(t, (0, 0, 0, 0, 0, tail)) if tail else t for t in (q, k, v))
        bm = block_mask_from_selection(sel)
        return self.fn(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), block_mask=bm).transpose(1, 2)[:, :s]


class _Triton:
    """The triton backend with the bench's table (the sweep's, else the shipped one); ``triton_atomic``: with the
    sweep's atomic-dQ winners where those were >= 3% faster (a row of its own, not the shipped default)."""

    def __init__(self, table, block, name="triton"):
        self.table, self.block, self.name = table, block, name

    def attention(self, q, k, v, sel, *, valid_len=None, density=None):
        from ds_adaptive.attention.kernels import config_for, triton_block_sparse_attention

        cfg = config_for(q.shape[-1], self.block, density, q.device, table=self.table)
        return triton_block_sparse_attention(q, k, v, sel, valid_len=valid_len, config=cfg)


def _backends(args, table, dev, atomic_table=None) -> tuple[list, list]:
    from ds_adaptive.attention.backends import backend_names, get_backend
    from ds_adaptive.attention.kernels import triton_status
    from ds_adaptive.attention.kernels.triton_block_sparse import interpreted

    runs, skipped = [], []
    for name in backend_names():
        if args.backends and name not in args.backends:
            continue
        be = get_backend(name)
        if be.support.materialises_scores:
            continue
        why = be.unsupported(dev, dtype=args.dtype, head_dim=args.head_dim, block_size=args.block, backward=True)
        if name == "triton" and dev.type == "cpu" and triton_status()[0] and interpreted():
            why = None  # the plumbing check: the kernels under the Triton interpreter
        if why:
            skipped.append({"backend": name, "why": why})
            continue
        runs.append(_Triton(table, args.block) if name == "triton" else be)
        if name == "triton" and atomic_table is not None:
            runs.append(_Triton(atomic_table, args.block, "triton_atomic"))
    if (not args.backends or "flex_static" in args.backends) and "flex_static" not in [b.name for b in runs] \
            and args.block == 128:
        runs.append(_FlexStatic())
    # ours first: when the budget runs out, the baselines of the largest shapes are what is skipped
    runs.sort(key=lambda b: not b.name.startswith("triton"))
    return runs, skipped


def _selection(b, h, s, block, dens, seed):
    from ds_adaptive.attention.backends.measure import random_selection

    return random_selection(b, h, s, block, dens, device=DEVICE, seed=seed)


def table_rows(args, table, t_start, atomic_table=None) -> tuple[list, list]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ds_adaptive.attention.attention import dense_attention
    from ds_adaptive.attention.kernels import compiled_kernels

    dev = DEVICE
    runs, skipped = _backends(args, table, dev, atomic_table)
    rows = []
    shapes = sorted(((s, h) for s in args.seq for h in args.heads), key=lambda x: x[0] ** 2 * x[1])
    for s, h in shapes:
        d = args.head_dim
        if time.perf_counter() - t_start > args.budget_s:
            skipped.append({"seq": s, "heads": h, "why": f"budget {args.budget_s} s spent"})
            continue
        g = torch.Generator(device=dev).manual_seed(s + h)
        q, k, v = (torch.randn(1, s, h, d, device=dev, dtype=args.dtype, generator=g).requires_grad_(True)
                   for _ in range(3))
        dout = torch.randn(1, s, h, d, device=dev, dtype=args.dtype, generator=g)
        flops = 3.5 * 4 * h * s * s * d

        def fb(attn, q=q, k=k, v=v, dout=dout):
            return lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), dout)

        res = {"seq": s, "heads": h, "head_dim": d, "block": args.block, "backends": {}}
        dense = fb(lambda a, b_, c: dense_attention(a, b_, c))
        if dev.type != "cuda":
            m, res["dense_kernel"] = measure(dense, args.reps), "cpu"
        else:
            try:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    m = measure(dense, args.reps)
                res["dense_kernel"] = "cudnn"
            except RuntimeError:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    m = measure(dense, args.reps)
                res["dense_kernel"] = "flash"
        res["dense_ms"], res["dense_tflops"] = m["ms"], flops / m["ms"] / 1e9
        print(f"S={s} H={h}: dense ({res['dense_kernel']}) {m['ms']:.2f} ms, {res['dense_tflops']:.0f} TFLOP/s", flush=True)
        sels = {dens: _selection(1, h, s, args.block, dens, seed=int(dens * 1000)) for dens in args.densities}
        outs = {}
        for be in runs:
            if time.perf_counter() - t_start > args.budget_s:
                skipped.append({"seq": s, "heads": h, "backend": be.name, "why": f"budget {args.budget_s} s spent"})
                continue
            rec = {"rows": []}
            t0 = time.perf_counter()
            try:
                if hasattr(be, "warmup"):
                    rec["warmup_s"] = be.warmup([(1, s)], num_heads=h, head_dim=d, dtype=args.dtype, device=dev,
                                                block_size=args.block)
                for dens, sel in sels.items():
                    share = float(sel.density().mean())
                    m = measure(fb(lambda a, b_, c, sel=sel, share=share: be.attention(a, b_, c, sel, density=share)),
                                args.reps)
                    eff = flops * share / m["ms"] / 1e9
                    rec["rows"].append({"density": dens, "share": share, "ms": m["ms"], "first_ms": m["first_ms"],
                                        "eff_tflops": eff, "eff_vs_dense": eff / res["dense_tflops"],
                                        "speedup_vs_dense": res["dense_ms"] / m["ms"]})
                # with autograd on, as timed (a no-grad call would compile another flex graph); never backward
                outs[be.name] = be.attention(q, k, v, sels[min(sels, key=lambda x: abs(x - 0.1))],
                                             density=0.1).detach().float()
                counter = compiled_kernels if be.name.startswith("triton") else None
                rec["new_seq"] = _new_seq(be, q, k, v, dout, s, h, args, counter)
            except Exception as exc:  # one backend failing must not lose the table: report it
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"  {be.name}: {rec['error']}", flush=True)
            rec["group_s"] = time.perf_counter() - t0
            res["backends"][be.name] = rec
            print(f"  {be.name:12s} " + " ".join(f"{r['density']}: {r['ms']:.2f} ms eff {r['eff_vs_dense']:.2f}"
                                                  for r in rec["rows"]) + f"  ({rec['group_s']:.1f} s)", flush=True)
        if "triton" in outs:
            ref = outs["triton"]
            for name, o in outs.items():
                res["backends"][name]["rel_diff_vs_triton_at_0.1"] = float((o - ref).abs().max() / ref.abs().max())
        rows.append(res)
        del q, k, v, dout, outs, sels
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows, skipped


def _new_seq(be, q, k, v, dout, s, h, args, counter) -> dict:
    """The first fwd+bwd call at a sequence length this backend has not seen (S - 37), then its steady time."""
    if be.name == "flex_static" and not args.static_new_seq and s != min(args.seq):
        return {"skipped": "flex_static recompiles per S (measured at the first S only; --static-new-seq for all)"}
    s2 = s - 37
    q2, k2, v2 = (t.detach()[:, :s2].clone().requires_grad_(True) for t in (q, k, v))
    d2 = dout[:, :s2].clone()
    sel = _selection(1, h, s2, args.block, 0.1, seed=7)
    share = float(sel.density().mean())
    before = counter() if counter else None
    m = measure(lambda: torch.autograd.grad(be.attention(q2, k2, v2, sel, density=share), (q2, k2, v2), d2), 3)
    out = {"seq": s2, "first_ms": m["first_ms"], "steady_ms": m["ms"], "overhead_ms": m["first_ms"] - m["ms"]}
    if counter:
        out["kernels_compiled"] = counter() - before
    return out


# ------------------------------------------------------------------------------------------ report
def print_report(rows, skipped, curve, meta, args) -> None:
    print(f"\n# sparse backends vs dense, {meta['device']}, torch {meta['torch']}, commit {meta['commit']}, B=1, "
          f"Dh={args.head_dim}, block {args.block}, {meta['dtype']} fwd+bwd")
    print(f"{'S':>6} {'H':>3} {'dense ms':>9} {'TF/s':>5} | {'backend':>12} {'dens':>5} {'ms':>8} {'eff TF/s':>8} "
          f"{'eff/dense':>9} {'x dense':>7}")
    for r in rows:
        head = f"{r['seq']:>6} {r['heads']:>3} {r['dense_ms']:9.2f} {r['dense_tflops']:5.0f}"
        for name, rec in r["backends"].items():
            for x in rec.get("rows", []):
                print(f"{head} | {name:>12} {x['density']:5.2f} {x['ms']:8.2f} {x['eff_tflops']:8.0f} "
                      f"{x['eff_vs_dense']:9.2f} {x['speedup_vs_dense']:7.2f}")
                head = " " * len(head)
    print("# first call of a new S (S - 37, density 0.1): wall ms / steady ms / overhead ms [kernels compiled]")
    for r in rows:
        for name, rec in r["backends"].items():
            n = rec.get("new_seq", {})
            if "first_ms" in n:
                extra = f" [{n['kernels_compiled']} compiled]" if "kernels_compiled" in n else ""
                print(f"{r['seq']:>6} {r['heads']:>3} {name:>12}: {n['first_ms']:.1f} / {n['steady_ms']:.1f} / "
                      f"{n['overhead_ms']:.1f}{extra}; warm-up {rec.get('warmup_s', 0):.2f} s; "
                      f"max rel diff vs triton at 0.1: {rec.get('rel_diff_vs_triton_at_0.1', float('nan')):.2e}")
    print("# efficiency curve for the cost model (worst over the shapes): density: g = ms/dense ms, eff = share/g")
    for name, c in curve.items():
        print(f"{name:>12}: " + ", ".join(f"{dv}: g {v['g']:.4f} eff {v['eff']:.2f} x{v['speedup']:.2f}"
                                         for dv, v in sorted(c.items())))
    for sk in skipped:
        print(f"skipped: {sk}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[32760, 75600])
    p.add_argument("--heads", type=int, nargs="+", default=[12, 40])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--densities", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.4])
    p.add_argument("--block", type=int, default=128, choices=[64, 128])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--device", default="cuda", help="cpu: a plumbing check under TRITON_INTERPRET=1 (tiny shapes)")
    p.add_argument("--backends", nargs="*", default=None, help="subset (names; 'flex_static' the per-shape baseline)")
    p.add_argument("--reps", type=int, default=5, help="most timed calls per measurement (fewer for long calls)")
    p.add_argument("--no-sweep", dest="sweep", action="store_false")
    p.add_argument("--allow-atomic", action="store_true",
                   help="the written table may pick atomic dQ (not deterministic); without it atomic dQ gets its own "
                        "'triton_atomic' rows where the sweep found it >= 3%% faster")
    p.add_argument("--static-new-seq", action="store_true", help="flex_static's new-S compile at every S")
    p.add_argument("--quick", action="store_true", help="S 32,760, H 12, densities 0.05 0.1 0.4")
    p.add_argument("--budget-s", type=float, default=170.0)
    p.add_argument("--table-out", default=None, help="write the swept tile table (triton_configs.json format; "
                                                       "entries of an existing file for other GPU/head dim/block kept)")
    p.add_argument("--out", default="bench/out/sparse_backends.json")
    args = p.parse_args(argv)
    if args.quick:
        args.seq, args.heads, args.densities = [32760], [12], [0.05, 0.1, 0.4]
    t_start = time.perf_counter()
    global DEVICE
    DEVICE = torch.device(args.device)
    dtype_name, args.dtype = args.dtype, getattr(torch, args.dtype)
    extra = dict(head_dim=args.head_dim, block=args.block, batch=1, dtype=dtype_name)
    meta = run_meta(**extra) if DEVICE.type == "cuda" else {"device": "cpu (interpreter)", "torch": torch.__version__,
                                                              "commit": "-", "date": "-", **extra}
    from ds_adaptive.attention.kernels import triton_status

    table, atomic_table, sweep_rows = None, None, []
    if args.sweep and triton_status()[0] and (not args.backends or "triton" in args.backends):
        s, h = min(args.seq), min(args.heads)
        g = torch.Generator(device=DEVICE).manual_seed(1)
        q, k, v, dout = (torch.randn(1, s, h, args.head_dim, device=DEVICE, dtype=args.dtype, generator=g)
                         for _ in range(4))
        sels = {dens: _selection(1, h, s, args.block, dens, seed=int(dens * 1000)) for dens in args.densities}
        print(f"sweep at S={s} H={h} block {args.block}", flush=True)
        sweep_rows, chosen, chosen_atomic = sweep(q, k, v, dout, sels, args.block, args.reps)
        import triton

        cap = list(torch.cuda.get_device_capability()) if DEVICE.type == "cuda" else [0, 0]
        table = table_from_sweep(chosen, meta, args.head_dim, args.block, cap, triton.__version__, COMMAND)
        if any(c.atomic_dq for c, _ in chosen_atomic.values()):
            atomic_table = table_from_sweep(chosen_atomic, meta, args.head_dim, args.block, cap, triton.__version__,
                                            COMMAND)
            if args.allow_atomic:  # the shipped table (--table-out) may then pick atomic dQ
                table, atomic_table = atomic_table, None
        print(f"sweep: {time.perf_counter() - t_start:.1f} s", flush=True)
        del q, k, v, dout, sels
    rows, skipped = table_rows(args, table, t_start, atomic_table)
    curve = worst_curves(rows)
    if table is not None and "triton" in curve:
        c = curve["triton"]
        dens = sorted(c)
        # a curve must rise with density (KernelEfficiency interpolates it)
        ratio = [max(c[x]["g"] for x in dens[: i + 1]) for i in range(len(dens))]
        table["entries"][0]["curve"] = {"density": dens, "ratio": ratio, "source": "bench/kernels/sparse_backends.py: max "
                                        f"over S {args.seq} x H {args.heads} of triton ms / {rows[0]['dense_kernel']} ms"}
    if args.table_out and table is not None:
        from ds_adaptive.attention.kernels.triton_configs import validate_table

        merged = merge_tables(json.loads(Path(args.table_out).read_text()) if Path(args.table_out).exists() else None,
                              table)
        Path(args.table_out).write_text(json.dumps(validate_table(merged), indent=1))
        print(f"wrote {args.table_out} ({len(merged['entries'])} entries)")
    meta["wall_s"] = time.perf_counter() - t_start
    print_report(rows, skipped, curve, meta, args)
    write_results(args.out, {**meta, "table": table, "atomic_table": atomic_table, "sweep": sweep_rows, "curves": curve,
                             "skipped": skipped}, rows)
    print(f"wall {meta['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
