"""Benchmark of the fused LayerNorm-Modulate op at Wan shapes (one GPU, one run).

For each case (x bf16, fp32 shift/scale sliced out of a [B, 6, D] / [B, S, 6, D] fp32 table):
  ours     ds_adaptive.ops.ln_modulate (fused CUDA op)
  eager    ln_modulate_reference (torch eager, fp32 math)
  compile  torch.compile(ln_modulate_reference)
  floor    bytes that must move / measured device-to-device copy bandwidth (read + write)
forward and forward+backward (torch.autograd.grad w.r.t. x and the shift/scale views).

Times are medians of many runs (triton.testing.do_bench: L2 flushed before each run), taken on
CUDA-graph replays so that Python launch overhead is not counted for any method (``ours launch``
is also timed without a graph); inputs rotate over enough copies to exceed L2 when a case is
small. Prints a table of ratios, writes JSON (--out) and a PNG bar chart next to it.

  python bench/ln_modulate.py [--out bench/out/ln_modulate.json] [--quick] [--tune] [--no-block]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ds_adaptive.ops.ln_modulate import ln_modulate, ln_modulate_reference, load_op, op_status  # noqa: E402

CASES = [
    # name, B, S, D, per_token
    ("1.3B 1x32760x1536", 1, 32760, 1536, False),
    ("14B 1x75600x5120", 1, 75600, 5120, False),
    ("1.3B 16x1560x1536", 16, 1560, 1536, False),
    ("1.3B per-token 1x32760x1536", 1, 32760, 1536, True),
]


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------
def bench_ms(fn: Callable[[], object], rep_ms: int = 300) -> float:
    """Median ms of fn (L2 flushed before each run)."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=50, rep=rep_ms, return_mode="median"))
    except ImportError:
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
        for _ in range(5):
            fn()
        times = []
        for _ in range(50):
            flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        return float(sorted(times)[len(times) // 2])


def graphed(fns: List[Callable[[], object]]) -> Callable[[], None]:
    """Capture each fn in a CUDA graph; the result replays them in rotation."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            for _ in range(3):
                fn()
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for fn in fns:
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                fn()
        except Exception:
            torch.cuda.synchronize()
            raise
        graphs.append(g)
    state = {"i": 0}

    def replay():
        graphs[state["i"] % len(graphs)].replay()
        state["i"] += 1

    replay.graphs = graphs  # keep alive
    return replay


def rotating(fns: List[Callable[[], object]]) -> Callable[[], object]:
    state = {"i": 0}

    def call():
        fn = fns[state["i"] % len(fns)]
        state["i"] += 1
        return fn()

    return call


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), rep_ms=500)
    del src, dst
    return 2 * n / (ms * 1e-3)


# ------------------------------------------------------------------------------------------------
# cases
# ------------------------------------------------------------------------------------------------
_SEED = [0]


def _randn(*shape):
    # A private generator: stays usable even if a failed CUDA-graph capture left the default one
    # in capture state.
    _SEED[0] += 1
    g = torch.Generator(device="cuda")
    g.manual_seed(_SEED[0])
    return torch.randn(*shape, device="cuda", generator=g)


def make_inputs(B: int, S: int, D: int, per_token: bool, xdtype=torch.bfloat16):
    x = (_randn(B, S, D) * 1.5 + 0.3).to(xdtype).requires_grad_()
    # shift/scale: strided views of one fp32 table, made leaves (requires_grad on the view of a
    # table that does not require grad): the op reads them in place, and autograd.grad stops at
    # them. Views of a requires-grad table made outside a CUDA-graph capture would tie their
    # SliceBackward to the default stream, which a captured backward may not touch.
    if per_token:
        table = _randn(B, S, 6, D) * 0.5
        shift, scale = table[:, :, 0].requires_grad_(), table[:, :, 1].requires_grad_()
    else:
        table = _randn(B, 6, D) * 0.5
        shift, scale = table[:, 0:1].requires_grad_(), table[:, 1:2].requires_grad_()
    dy = _randn(B, S, D).to(xdtype)
    return {"x": x, "table": table, "shift": shift, "scale": scale, "dy": dy}


def floor_bytes(B: int, S: int, D: int, per_token: bool, xbytes: int = 2, mbytes: int = 4) -> Dict[str, int]:
    n = B * S
    mod_rows = n if per_token else B
    fwd = 2 * n * D * xbytes + 2 * mod_rows * D * mbytes + 8 * n  # x in, y out, shift+scale in, mean+rstd out
    bwd = 3 * n * D * xbytes + 8 * n + mod_rows * D * mbytes + 2 * mod_rows * D * mbytes  # dy,x in, dx out; stats; scale in; dshift,dscale out
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


def methods():
    compiled = torch.compile(lambda x, shift, scale: ln_modulate_reference(x, shift, scale), dynamic=False)
    return {"ours": ln_modulate, "eager": ln_modulate_reference, "compile": compiled}


def time_case(name: str, B: int, S: int, D: int, per_token: bool, l2_bytes: int, quick: bool) -> Dict:
    per_set = B * S * D * 2 * 3 + (B * S if per_token else B) * 6 * D * 4
    n_sets = max(1, min(4, math.ceil(2 * l2_bytes / per_set)))
    sets = [make_inputs(B, S, D, per_token) for _ in range(n_sets)]
    for st in sets:
        # torch.compile (2.11) returns a [D] gradient for a [1, 1, D] shift/scale graph input (seen
        # with B = 1, leaf views and contiguous leaves alike). The compile baseline therefore takes
        # the modulation as Wan does: per-sample, the [B, 6, D] table sliced inside the compiled
        # function; per-token (where the table would add a [B, S, 6, D] gradient), contiguous copies.
        st["shift_c"] = st["shift"].detach().clone().requires_grad_()
        st["scale_c"] = st["scale"].detach().clone().requires_grad_()
        if not per_token:
            st["table"] = torch.cat([st["shift_c"].detach(), st["scale_c"].detach()], dim=1).requires_grad_()
    out: Dict = {"case": name, "B": B, "S": S, "D": D, "per_token": per_token, "input_sets": n_sets}
    rep = 100 if quick else 300
    for mname, fn in methods().items():
        for kind in ("fwd", "fwd+bwd"):
            key = f"{mname} {kind}"
            if mname == "compile" and not per_token:
                def inputs(s):
                    return s["x"], s["table"]

                def call(s, fn=fn):
                    return fn(s["x"], s["table"][:, 0:1], s["table"][:, 1:2])
            else:
                ks, kc = ("shift_c", "scale_c") if mname == "compile" else ("shift", "scale")

                def inputs(s, ks=ks, kc=kc):
                    return s["x"], s[ks], s[kc]

                def call(s, fn=fn, ks=ks, kc=kc):
                    return fn(s["x"], s[ks], s[kc])
            if kind == "fwd":
                calls = [(lambda s=s, call=call: _nograd(lambda: call(s))) for s in sets]
            else:
                calls = [(lambda s=s, call=call, inputs=inputs: torch.autograd.grad(call(s), inputs(s), s["dy"]))
                         for s in sets]
            try:
                try:
                    replay = graphed(calls)
                    out[key] = bench_ms(replay, rep)
                    del replay
                except Exception as e:  # noqa: BLE001 - report, then time without a graph
                    out[f"{key} graph_error"] = f"{type(e).__name__}: {e}"[:300]
                    print(f"  {name} {key}: no CUDA graph ({out[f'{key} graph_error'][:120]})", flush=True)
                    out[key] = bench_ms(rotating(calls), rep)
                if mname == "ours":
                    out[f"ours launch {kind}"] = bench_ms(rotating(calls), rep)
            except Exception as e:  # noqa: BLE001
                out[key] = float("nan")
                out[f"{key} error"] = f"{type(e).__name__}: {e}"[:300]
                print(f"  {name} {key}: FAILED {out[f'{key} error']}", flush=True)
            torch.cuda.empty_cache()
    del sets
    torch.cuda.empty_cache()
    return out


def _nograd(c):
    with torch.no_grad():
        return c()


def check_case(B: int, S: int, D: int, per_token: bool) -> Dict[str, float]:
    """Max |ours - fp64| vs max |eager - fp64| (bf16 rounding) on the bench inputs, fwd and dx."""
    s = make_inputs(B, S, D, per_token)
    x64 = s["x"].detach().double().requires_grad_()
    sh64 = s["shift"].detach().double().requires_grad_()
    sc64 = s["scale"].detach().double().requires_grad_()
    mean = x64.mean(-1, keepdim=True)
    var = ((x64 - mean) ** 2).mean(-1, keepdim=True)
    ref = (x64 - mean) / torch.sqrt(var + 1e-6) * (1 + sc64) + sh64
    gref = torch.autograd.grad(ref, (x64, sh64, sc64), s["dy"].double())
    res = {}
    for mname, fn in (("ours", ln_modulate), ("eager", ln_modulate_reference)):
        y = fn(s["x"], s["shift"], s["scale"])
        g = torch.autograd.grad(y, (s["x"], s["shift"], s["scale"]), s["dy"])
        res[f"{mname} y err"] = float((y.double() - ref).abs().max())
        res[f"{mname} dx err"] = float((g[0].double() - gref[0]).abs().max())
        res[f"{mname} dscale rel"] = float((g[2].double() - gref[2]).norm() / gref[2].norm())
    del s
    torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------------------------------------
# tuning sweep (kernel-config variants compiled into the op for x bf16 / fp32 modulation)
# ------------------------------------------------------------------------------------------------
TUNE = {  # slot -> (D, direction, config names of variants 0..5; 0 = the shipped default)
    0: (1536, "fwd", ["96x2", "32x6 r4", "192x1", "64x3", "96x2 pf", "96x2 pf modc"]),
    1: (5120, "fwd", ["128x5", "160x4", "320x2", "640x1", "160x4 pf", "128x5 modc"]),
    2: (1536, "bwd", ["192x1", "96x2", "64x3", "32x6", "192x1 pf", "96x2 pf"]),
    3: (5120, "bwd", ["640x1", "320x2", "160x4", "128x5", "640x1 pf", "320x2 pf"]),
}
# Config "TPRxNV": threads per row x 16-byte accesses per thread per row; "r4": 4 rows per CTA;
# "pf": next row prefetched; "modc": per-sample modulation cached in registers.


def tune(ext, quick: bool) -> List[Dict]:
    rows = []
    for slot, (D, kind, names) in TUNE.items():
        S = 32760 if D == 1536 else 75600
        s = make_inputs(1, S, D, False)
        for variant, vname in enumerate(names):
            ext.set_tuning(slot, variant)
            if kind == "fwd":
                fn = lambda: _nograd(lambda: ln_modulate(s["x"], s["shift"], s["scale"]))  # noqa: E731
            else:  # fwd+bwd in one graph (backward runs on the forward's stream); fwd at its default
                fn = lambda: torch.autograd.grad(ln_modulate(s["x"], s["shift"], s["scale"]),  # noqa: E731
                                                 (s["x"], s["shift"], s["scale"]), s["dy"])
            try:
                res = fn()  # correctness of the variant: same results as variant 0 (up to summation order)
                res = [res] if isinstance(res, torch.Tensor) else list(res)
                if variant == 0:
                    base = [r.detach().float().clone() for r in res]
                diff = max(float((r.float() - b0).abs().max() / (b0.abs().max() + 1e-6)) for r, b0 in zip(res, base))
                del res
                ms = bench_ms(graphed([fn]), 100 if quick else 200)
            except Exception as e:  # noqa: BLE001
                ms, diff = float("nan"), float("nan")
                print(f"tune slot {slot} variant {variant}: {e}", file=sys.stderr)
            label = "fwd" if kind == "fwd" else "fwd+bwd"
            row = {"slot": slot, "D": D, "kind": label, "variant": variant, "config": vname, "ms": ms,
                   "max_rel_diff_vs_default": diff}
            fwd0 = next((r["ms"] for r in rows if r["D"] == D and r["kind"] == "fwd" and r["variant"] == 0), None)
            extra = ""
            if kind == "bwd" and fwd0 is not None:
                row["bwd_ms"] = ms - fwd0
                extra = f"  (bwd ~ {ms - fwd0:.4f} ms)"
            rows.append(row)
            print(f"  tune {label} D={D} {kind} config {vname:>13}: {ms:.4f} ms{extra}  "
                  f"[max rel diff vs default {diff:.1e}]", flush=True)
        ext.set_tuning(slot, 0)
        del s, base
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------
# Wan 1.3B block fwd+bwd with and without the op
# ------------------------------------------------------------------------------------------------
def wan_block(quick: bool) -> Optional[Dict]:
    try:
        from ds_adaptive.models.wan import WanBlock, get_wan_config, rope_table
    except ImportError as e:
        print(f"Wan block benchmark skipped: ds_adaptive.models.wan is not available ({e})")
        return None
    cfg = get_wan_config("wan2.1-1.3b")
    grid = (21, 30, 52)  # 81 frames at 480x832 -> S = 32760
    S = math.prod(grid)
    torch.default_generator.manual_seed(0)  # the block is initialised on the CPU
    block = WanBlock(cfg).cuda().to(torch.bfloat16)
    block.modulation.data = block.modulation.data.float()
    x = _randn(1, S, cfg.dim).to(torch.bfloat16).requires_grad_()
    time_mod = _randn(1, 6, cfg.dim) * 0.1
    context = _randn(1, 512, cfg.dim).to(torch.bfloat16)
    freqs = rope_table(grid, cfg.rope_split, device="cuda")
    dy = _randn(*x.shape).to(x.dtype)
    res = {"S": S, "model": "wan2.1-1.3b block"}
    for label, fn in (("reference", ln_modulate_reference), ("fused", ln_modulate)):
        object.__setattr__(block, "ln_modulate", fn)
        params = [p for p in block.parameters()]

        def step():
            y = block(x, time_mod, context, freqs)
            return torch.autograd.grad(y, [x] + params, dy, allow_unused=True)

        res[f"{label} ms"] = bench_ms(step, 300 if quick else 1500)
        torch.cuda.empty_cache()
    res["speedup"] = res["reference ms"] / res["fused ms"]
    res["saved ms"] = res["reference ms"] - res["fused ms"]
    return res


# ------------------------------------------------------------------------------------------------
def plot(results: List[Dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no chart")
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    meths = ["floor", "ours", "compile", "eager"]
    colors = {"floor": "#999999", "ours": "#2a7ab9", "compile": "#f28e2b", "eager": "#d62728"}
    for ax, kind in zip(axes, ("fwd", "fwd+bwd")):
        n = len(results)
        w = 0.2
        for j, m in enumerate(meths):
            vals = [r.get(f"{m} {kind}", float("nan")) for r in results]
            ax.bar([i + (j - 1.5) * w for i in range(n)], vals, w, label=m, color=colors[m])
        ax.set_xticks(range(n))
        ax.set_xticklabels([r["case"].replace(" ", "\n", 1) for r in results], fontsize=8)
        ax.set_ylabel("ms (median)")
        ax.set_title(f"LayerNorm-Modulate {kind} (bf16 x, fp32 mod)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"chart: {path}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "ln_modulate.json"))
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--tune", action="store_true", help="also time the compiled-in kernel-config variants")
    ap.add_argument("--no-block", action="store_true", help="skip the Wan block benchmark")
    ap.add_argument("--cases", default="", help="comma-separated case indices (default: all)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/ln_modulate.py needs a CUDA GPU")
        return 2
    os.environ.setdefault("DS_ADAPTIVE_LN_MODULATE", "fused")
    t0 = time.time()
    ext = load_op(strict=True)
    print(f"op loaded ({op_status()['source']}) in {time.time() - t0:.1f} s", flush=True)
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    bw = copy_bandwidth()
    print(f"device {props.name}, {props.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MiB, "
          f"copy bandwidth {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    meta = {"device": props.name, "sms": props.multi_processor_count, "l2_bytes": l2, "copy_bw_Bps": bw,
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": os.environ.get("GIT_COMMIT") or _git_commit(), "command": " ".join(sys.argv)}
    tuning = tune(ext, args.quick) if args.tune else []
    picked = [CASES[int(i)] for i in args.cases.split(",") if i.strip()] if args.cases else CASES
    results = []
    for name, B, S, D, per_token in picked:
        r = time_case(name, B, S, D, per_token, l2, args.quick)
        fb = floor_bytes(B, S, D, per_token)
        for kind in ("fwd", "fwd+bwd"):
            r[f"floor {kind}"] = fb[kind] / bw * 1e3
            r[f"bytes {kind}"] = fb[kind]
        try:
            r.update(check_case(B, S, D, per_token))
        except Exception as e:  # noqa: BLE001
            print(f"  accuracy check of {name} failed: {e}", flush=True)
        results.append(r)
        torch.cuda.empty_cache()
        print(f"  {name}: " + ", ".join(f"{k} {r[k]:.4f}" for k in r if isinstance(r[k], float) and "ms" not in k
                                          and "err" not in k and "rel" not in k and "bytes" not in k), flush=True)
    block = None
    if not args.no_block:
        try:
            block = wan_block(args.quick)
        except Exception as e:  # noqa: BLE001
            print(f"Wan block benchmark failed: {type(e).__name__}: {e}", flush=True)
            block = {"error": f"{type(e).__name__}: {e}"[:500]}

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results, "tuning": tuning, "wan_block": block}, indent=2))
    plot(results, out.with_suffix(".png"))

    print()
    print(f"LayerNorm-Modulate, {props.name}, bf16 x / fp32 shift+scale, median ms (CUDA-graph replays), "
          f"floor at {bw / 1e12:.2f} TB/s")
    hdr = (f"{'case':<29} {'dir':<8} {'ours':>7} {'launch':>7} {'eager':>7} {'compile':>8} {'floor':>7} "
           f"{'ours/eager':>10} {'ours/comp':>9} {'ours/floor':>10}")
    print(hdr)
    print("-" * len(hdr))
    nan = float("nan")
    for r in results:
        for kind in ("fwd", "fwd+bwd"):
            o, e, c, f = (r.get(f"{m} {kind}", nan) for m in ("ours", "eager", "compile", "floor"))
            print(f"{r['case']:<29} {kind:<8} {o:7.4f} {r.get(f'ours launch {kind}', nan):7.4f} {e:7.4f} {c:8.4f} "
                  f"{f:7.4f} {o / e:10.3f} {o / c:9.3f} {o / f:10.3f}")
    print()
    print("accuracy vs fp64 (max abs; eager = torch's own bf16 rounding):")
    for r in results:
        if "ours y err" not in r:
            continue
        print(f"  {r['case']:<29} y: ours {r['ours y err']:.3g} eager {r['eager y err']:.3g} | "
              f"dx: ours {r['ours dx err']:.3g} eager {r['eager dx err']:.3g} | "
              f"dscale rel: ours {r['ours dscale rel']:.2g} eager {r['eager dscale rel']:.2g}")
    if block and "error" not in block:
        print(f"Wan 1.3B block fwd+bwd at S={block['S']}: reference {block['reference ms']:.2f} ms, "
              f"fused {block['fused ms']:.2f} ms ({block['speedup']:.3f}x, {block['saved ms']:.2f} ms saved)")
    print(f"json: {out}")
    return 0


def _git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
