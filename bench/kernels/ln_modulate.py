"""Benchmark of the fused LayerNorm-Modulate op at Wan shapes (one GPU, one run).

For each case (x bf16, fp32 shift/scale sliced out of a [B, 6, D] / [B, S, 6, D] fp32 table):
  ours     ds_adaptive.ops.ln_modulate (fused CUDA op)
  eager    ln_modulate_reference (torch eager, fp32 math)
  compile  torch.compile(ln_modulate_reference)
  floor    bytes that must move / measured device-to-device copy bandwidth (read + write)
forward and forward+backward (torch.autograd.grad w.r.t. x and the shift/scale views).

Times are medians of many runs with the L2 flushed before each run, taken on CUDA-graph replays
so that Python launch overhead is not counted for any method (``ours launch`` is also timed
without a graph); inputs rotate over enough copies to exceed L2 when a case is small. Prints a
table of ratios, writes JSON (--out) and a PNG bar chart next to it.

L2 flush (--flush): ``read`` (default) reads a 256 MiB buffer before each run, leaving L2 full of
clean, useless lines; ``zero`` writes it (what triton.testing.do_bench does), leaving ~50 MB of
dirty lines whose write-back the timed kernel pays: measured on H100 (a copy-kernel probe at commit c0c9b33, bench/ln_modulate_probe.cu),
a device-to-device copy of the 16x1560x1536 forward's bytes takes 1.15x the floor after a zero
flush and 1.03x after a read flush. ``both`` times every method under each (the zero-flush times
under keys ``... @zero``); the floor's copy bandwidth is measured with the first.

The compile baseline computes the same thing as ours: LayerNorm + modulate with the same dtypes,
gradients w.r.t. x and the modulation. Per-sample, the [B, 6, D] table is sliced *inside* the
compiled function (torch 2.11's compiled backward returned a [D] gradient for a [1, 1, D] graph
input); per-token, it takes the same strided [B, S, D] views of the [B, S, 6, D] table as ours
(slicing that table inside would add a [B, S, 6, D] gradient, four fifths zeros). Its outputs and
gradients are checked against eager before it is timed (``compile check``); if that fails, it is
retried with contiguous copies of shift / scale, and the variant used is recorded.

--variants (implied by --tune) times ours with every kernel generation (policy v1 and v2, see
DS_ADAPTIVE_LN_MODULATE_KERNELS) per case, prints the winner per direction and layout and the
policy string that picks them.

  python bench/kernels/ln_modulate.py [--out bench/out/ln_modulate.json] [--quick] [--tune] [--variants]
                              [--no-block] [--cases 0,3] [--flush read|zero|both]
"""
from __future__ import annotations

import argparse
import datetime
import importlib
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

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# the module (``ds_adaptive.ops.ln_modulate`` as an attribute is the function of that name)
lnm_mod = importlib.import_module("ds_adaptive.ops.ln_modulate")

from ds_adaptive.ops.ln_modulate import ln_modulate, ln_modulate_reference, load_op, op_status  # noqa: E402

CASES = [
    # name, B, S, D, per_token (cases after the first four: no torch.compile baseline, see --compile-cases)
    ("1.3B 1x32760x1536", 1, 32760, 1536, False),
    ("14B 1x75600x5120", 1, 75600, 5120, False),
    ("1.3B 16x1560x1536", 16, 1560, 1536, False),
    ("1.3B per-token 1x32760x1536", 1, 32760, 1536, True),
    ("DiT 8x4096x1152", 8, 4096, 1152, False),
    ("DiT 4x1024x2304 (small)", 4, 1024, 2304, False),
    ("DiT 2x1536x3072 (small)", 2, 1536, 3072, False),
    ("DiT 4x4096x4096", 4, 4096, 4096, False),
    ("1.3B 2x1560x1536 (small)", 2, 1560, 1536, False),
]
COMPILE_CASES = 4  # the first cases get the torch.compile baseline (each costs ~30 s of compilation)


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------
FLUSHES = ["read"]  # --flush: the first is the primary timing; "zero" adds keys "... @zero"
_FLUSH_BUF: Dict[str, torch.Tensor] = {}


def _flush_l2(mode: str) -> None:
    if "buf" not in _FLUSH_BUF:
        _FLUSH_BUF["buf"] = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
        _FLUSH_BUF["sink"] = torch.empty((), dtype=torch.int64, device="cuda")
    buf = _FLUSH_BUF["buf"]
    if mode == "zero":
        buf.zero_()
    else:
        _FLUSH_BUF["sink"].copy_(buf.sum(dtype=torch.int64))


def bench_ms(fn: Callable[[], object], rep_ms: int = 300, flush: str = "read") -> float:
    """Median ms of fn over about rep_ms of runs (at least 20), the L2 flushed before each run
    ('read' or 'zero', see the module doc); CUDA events around fn only."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(5):
        fn()
    e.record()
    torch.cuda.synchronize()
    est = max(s.elapsed_time(e) / 5, 1e-3)
    reps = int(min(1000, max(20, rep_ms / est)))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        _flush_l2(flush)
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in ev)
    return float(times[len(times) // 2])


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
    ms = bench_ms(lambda: dst.copy_(src), rep_ms=500, flush=FLUSHES[0])
    del src, dst
    return 2 * n / (ms * 1e-3)


# ------------------------------------------------------------------------------------------------
# cases
# ------------------------------------------------------------------------------------------------
_SEED = [0]
DEVICE = "cuda"  # the CPU tests (bench/kernels/test_ln_modulate_bench.py) run the plumbing on "cpu"


def _randn(*shape):
    # A private generator: stays usable even if a failed CUDA-graph capture left the default one
    # in capture state.
    _SEED[0] += 1
    g = torch.Generator(device=DEVICE)
    g.manual_seed(_SEED[0])
    return torch.randn(*shape, device=DEVICE, generator=g)


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


COMPILE_BACKEND = "inductor"


def _compiled_fns(backend: str = "inductor"):
    """torch.compile of the reference expression, per modulation layout (see the module doc):
    'table' slices a [B, 6, D] table inside the compiled function (shift = slot 0, scale = slot 1);
    'views' / 'copies' take shift and scale (strided views, or contiguous copies)."""
    def per_sample(x, table):
        return ln_modulate_reference(x, table[:, 0:1], table[:, 1:2])

    def per_token(x, shift, scale):
        return ln_modulate_reference(x, shift, scale)

    return {"table": torch.compile(per_sample, dynamic=False, backend=backend),
            "views": torch.compile(per_token, dynamic=False, backend=backend),
            "copies": torch.compile(per_token, dynamic=False, backend=backend)}


def _compile_inputs(st: Dict, variant: str):
    """(call, inputs): the compiled baseline's call and the tensors it differentiates w.r.t."""
    if variant == "table":
        return (lambda fn: fn(st["x"], st["table_c"])), (st["x"], st["table_c"])
    if variant == "views":
        return (lambda fn: fn(st["x"], st["shift"], st["scale"])), (st["x"], st["shift"], st["scale"])
    return (lambda fn: fn(st["x"], st["shift_c"], st["scale_c"])), (st["x"], st["shift_c"], st["scale_c"])


def check_compile(st: Dict, fn, variant: str) -> str:
    """'' when the compiled baseline reproduces eager's y and gradients (shapes and values), else why."""
    call, inputs = _compile_inputs(st, variant)
    try:
        y = call(fn)
        grads = torch.autograd.grad(y, inputs, st["dy"])
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"[:300]
    y_ref = ln_modulate_reference(st["x"], st["shift"], st["scale"])
    g_ref = torch.autograd.grad(y_ref, (st["x"], st["shift"], st["scale"]), st["dy"])
    if variant == "table":  # gradient of the table: shift, scale at slots 0, 1, zeros elsewhere
        gt = grads[1]
        if tuple(gt.shape) != tuple(st["table_c"].shape):
            return f"table gradient shape {tuple(gt.shape)}"
        grads = (grads[0], gt[:, 0:1], gt[:, 1:2])
        if gt.shape[1] > 2 and gt[:, 2:].abs().max().item() != 0.0:
            return "nonzero gradient for unused table slots"
    for name, g, r in zip(("dx", "dshift", "dscale"), grads, g_ref):
        if tuple(g.shape) != tuple(r.shape) or g.dtype != r.dtype:
            return f"{name}: {tuple(g.shape)} {g.dtype} vs eager {tuple(r.shape)} {r.dtype}"
        tol = 1e-2 * (r.float().abs().max().item() + 1e-3)
        err = (g.float() - r.float()).abs().max().item()
        if not err <= tol:
            return f"{name}: max |compile - eager| {err:.3g} > {tol:.3g}"
    if not (y.float() - y_ref.float()).abs().max().item() <= 0.05:
        return "y differs from eager"
    return ""


def time_case(name: str, B: int, S: int, D: int, per_token: bool, l2_bytes: int, quick: bool,
              variants: bool = False, with_compile: bool = True) -> Dict:
    per_set = B * S * D * 2 * 3 + (B * S if per_token else B) * 6 * D * 4
    n_sets = max(1, min(4, math.ceil(2 * l2_bytes / per_set)))
    sets = [make_inputs(B, S, D, per_token) for _ in range(n_sets)]
    for st in sets:
        # compile-baseline inputs: a requires-grad copy of the [B, 6, D] table (sliced inside the
        # compiled function), and contiguous shift / scale copies (fallback)
        if not per_token:
            st["table_c"] = st["table"].detach().clone().requires_grad_()
        st["shift_c"] = st["shift"].detach().clone().requires_grad_()
        st["scale_c"] = st["scale"].detach().clone().requires_grad_()
    out: Dict = {"case": name, "B": B, "S": S, "D": D, "per_token": per_token, "input_sets": n_sets}
    rep = 100 if quick else 300
    compiled = _compiled_fns(COMPILE_BACKEND)
    order = (["views", "copies"] if per_token else ["table", "copies"]) if with_compile else []
    compile_variant = None
    for v in order:
        why = check_compile(sets[0], compiled[v], v)
        out[f"compile check {v}"] = why or "ok"
        if not why:
            compile_variant = v
            break
        print(f"  {name}: compile baseline '{v}' failed its check: {why[:160]}", flush=True)
    out["compile variant"] = compile_variant

    def timed(key: str, calls: List[Callable[[], object]], launch_key: Optional[str] = None) -> None:
        try:
            try:
                replay = graphed(calls)
                for i, fl in enumerate(FLUSHES):
                    out[key if i == 0 else f"{key} @{fl}"] = bench_ms(replay, rep, flush=fl)
                del replay
            except Exception as e:  # noqa: BLE001 - report, then time without a graph
                out[f"{key} graph_error"] = f"{type(e).__name__}: {e}"[:300]
                print(f"  {name} {key}: no CUDA graph ({out[f'{key} graph_error'][:120]})", flush=True)
                for i, fl in enumerate(FLUSHES):
                    out[key if i == 0 else f"{key} @{fl}"] = bench_ms(rotating(calls), rep, flush=fl)
            if launch_key:
                out[launch_key] = bench_ms(rotating(calls), rep, flush=FLUSHES[0])
        except Exception as e:  # noqa: BLE001
            out[key] = float("nan")
            out[f"{key} error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"  {name} {key}: FAILED {out[f'{key} error']}", flush=True)
        torch.cuda.empty_cache()

    def ours_calls(kind: str, fn=ln_modulate):
        if kind == "fwd":
            return [(lambda s=s: _nograd(lambda: fn(s["x"], s["shift"], s["scale"]))) for s in sets]
        return [(lambda s=s: torch.autograd.grad(fn(s["x"], s["shift"], s["scale"]), (s["x"], s["shift"], s["scale"]),
                                                 s["dy"])) for s in sets]

    for kind in ("fwd", "fwd+bwd"):
        # "ours": GPU-only (CUDA-graph replays); "ours launch": the eager call as a training loop
        # makes it (Python call + C++ dispatch + autograd, no graph), the L2 flushed before each
        timed(f"ours {kind}", ours_calls(kind), f"ours launch {kind}")
        timed(f"eager {kind}", ours_calls(kind, ln_modulate_reference))
        if compile_variant is None:
            out[f"compile {kind}"] = float("nan")
            out[f"compile {kind} error"] = "compiled baseline failed its check against eager"
            continue
        fn = compiled[compile_variant]
        if kind == "fwd":
            calls = [(lambda s=s: _nograd(lambda: _compile_inputs(s, compile_variant)[0](fn))) for s in sets]
        else:
            def step(s, fn=fn):
                call, inputs = _compile_inputs(s, compile_variant)
                return torch.autograd.grad(call(fn), inputs, s["dy"])

            calls = [(lambda s=s: step(s)) for s in sets]
        timed(f"compile {kind}", calls)

    if variants:  # ours with each kernel generation (graphs keep the kernels they were captured with)
        policy0 = lnm_mod.kernel_policy()
        try:
            for gen in ("v1", "v2"):
                lnm_mod.set_kernel_policy(gen)
                for kind in ("fwd", "fwd+bwd"):
                    timed(f"ours[{gen}] {kind}", ours_calls(kind))
        finally:
            lnm_mod.set_kernel_policy(policy0)
    del sets
    torch.cuda.empty_cache()
    return out


def _nograd(c):
    with torch.no_grad():
        return c()


def check_case(B: int, S: int, D: int, per_token: bool, variants: bool = False) -> Dict[str, float]:
    """Max |ours - fp64| vs max |eager - fp64| (bf16 rounding) on the bench inputs, fwd and dx
    (with --variants also for each kernel generation: ours[v1], ours[v2])."""
    s = make_inputs(B, S, D, per_token)
    x64 = s["x"].detach().double().requires_grad_()
    sh64 = s["shift"].detach().double().requires_grad_()
    sc64 = s["scale"].detach().double().requires_grad_()
    mean = x64.mean(-1, keepdim=True)
    var = ((x64 - mean) ** 2).mean(-1, keepdim=True)
    ref = (x64 - mean) / torch.sqrt(var + 1e-6) * (1 + sc64) + sh64
    gref = torch.autograd.grad(ref, (x64, sh64, sc64), s["dy"].double())
    res = {}
    runs = [("ours", ln_modulate, None), ("eager", ln_modulate_reference, None)]
    if variants:
        runs += [("ours[v1]", ln_modulate, "v1"), ("ours[v2]", ln_modulate, "v2")]
    policy0 = lnm_mod.kernel_policy()
    try:
        for mname, fn, gen in runs:
            if gen is not None:
                lnm_mod.set_kernel_policy(gen)
            y = fn(s["x"], s["shift"], s["scale"])
            g = torch.autograd.grad(y, (s["x"], s["shift"], s["scale"]), s["dy"])
            res[f"{mname} y err"] = float((y.double() - ref).abs().max())
            res[f"{mname} dx err"] = float((g[0].double() - gref[0]).abs().max())
            res[f"{mname} dshift rel"] = float((g[1].double() - gref[1]).norm() / gref[1].norm())
            res[f"{mname} dscale rel"] = float((g[2].double() - gref[2]).norm() / gref[2].norm())
    finally:
        if policy0 is not None:
            lnm_mod.set_kernel_policy(policy0)
    del s
    torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------------------------------------
# tuning sweep (kernel-config variants compiled into the op for x bf16 / fp32 modulation)
# ------------------------------------------------------------------------------------------------
TUNE = {  # slot -> (generation, D, direction, config names of variants 0..5; 0 = the shipped default)
    0: ("v1", 1536, "fwd", ["96x2", "32x6 r4", "192x1", "64x3", "96x2 pf", "96x2 pf modc"]),
    1: ("v1", 5120, "fwd", ["128x5", "160x4", "320x2", "640x1", "160x4 pf", "128x5 modc"]),
    2: ("v1", 1536, "bwd", ["192x1", "96x2", "64x3", "32x6", "192x1 pf", "96x2 pf"]),
    3: ("v1", 5120, "bwd", ["128x5", "320x2", "160x4", "640x1", "640x1 pf", "320x2 pf"]),
    4: ("v2", 1536, "fwd", ["32x6 s4/2 modc", "96x2 s3/3", "192x1 s4/2", "64x3 s4/2", "96x2 s2/3", "32x6 s4/2"]),
    5: ("v2", 5120, "fwd", ["128x5 s3/2", "160x4 s3/2", "128x5 s4/3", "320x2 s3/2", "128x5 s2/3", "640x1 s3/2"]),
    6: ("v2", 1536, "bwd", ["96x2 s3/3", "96x2 s4/3", "192x1 s3/2", "64x3 s4/3", "192x1 s6/4", "96x2 s3/2"]),
    7: ("v2", 5120, "bwd", ["320x2 s3/2", "640x1 s3/2", "128x5 s3/2", "640x1 s4/3", "160x4 s3/2", "320x2 s4/3"]),
}
# Config "TPRxNV": threads per row x 16-byte accesses per thread per row; "r4": 4 rows per CTA;
# "pf": next row prefetched into registers; "modc": per-sample modulation cached in registers;
# "sA/B": v2 shared-memory stages for per-sample / per-token modulation. v1 slot 3 variant 3 (640x1)
# is the D = 5120 backward default before this change; the affine backward keeps 640x1.


TUNE_S = {1536: (32760, 32760), 5120: (75600, 16384)}  # D -> S (per-sample, per-token), B = 1


def tune(ext, quick: bool) -> List[Dict]:
    """Every compiled-in configuration variant of x bf16 / fp32 modulation, per-sample and
    per-token, at the Wan sizes (1x32760x1536, 1x75600x5120; per-token 1x32760x1536 only for
    D = 1536 and 1x16384x5120 for D = 5120, which fits next to the [B, S, 6, D] table)."""
    rows = []
    policy0 = lnm_mod.kernel_policy()
    for slot, (gen, D, kind, names) in TUNE.items():
        lnm_mod.set_kernel_policy(gen)
        for per_token in (False, True):
            S = TUNE_S[D][per_token]
            layout = "per-token" if per_token else "per-sample"
            s = make_inputs(1, S, D, per_token)
            base = None
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
                    diff = max(float((r.float() - b0).abs().max() / (b0.abs().max() + 1e-6))
                               for r, b0 in zip(res, base))
                    del res
                    ms = bench_ms(graphed([fn]), 50 if quick else 100, flush=FLUSHES[0])
                except Exception as e:  # noqa: BLE001
                    ms, diff = float("nan"), float("nan")
                    print(f"tune slot {slot} variant {variant} {layout}: {e}", file=sys.stderr)
                label = "fwd" if kind == "fwd" else "fwd+bwd"
                row = {"slot": slot, "gen": gen, "D": D, "S": S, "layout": layout, "kind": label, "variant": variant,
                       "config": vname, "ms": ms, "max_rel_diff_vs_default": diff}
                extra = ""
                if kind == "bwd":
                    f0 = next((r["ms"] for r in rows if r["gen"] == gen and r["D"] == D and r["layout"] == layout
                               and r["kind"] == "fwd" and r["variant"] == 0), None)
                    if f0 is not None:
                        row["bwd_ms"] = ms - f0
                        extra = f"  (bwd ~ {ms - f0:.4f} ms)"
                rows.append(row)
                print(f"  tune {gen} {label:<7} D={D} {layout:<10} {vname:>13}: {ms:.4f} ms{extra}  "
                      f"[max rel diff vs default {diff:.1e}]", flush=True)
            ext.set_tuning(slot, 0)
            del s, base
            torch.cuda.empty_cache()
    lnm_mod.set_kernel_policy(policy0)
    return rows


def summarize_tuning(rows: List[Dict]) -> List[str]:
    """One line per (slot, layout): the fastest variant and the default's time."""
    lines = []
    keys = sorted({(r["slot"], r["layout"]) for r in rows})
    for slot, layout in keys:
        rs = [r for r in rows if r["slot"] == slot and r["layout"] == layout and r["ms"] == r["ms"]]
        if not rs:
            continue
        best = min(rs, key=lambda r: r["ms"])
        d0 = next((r for r in rs if r["variant"] == 0), None)
        ok = all(r["max_rel_diff_vs_default"] < 1e-2 for r in rs)
        lines.append(f"  slot {slot} {best['gen']} {best['kind']:<7} D={best['D']} {layout:<10}: best {best['config']:>12} "
                     f"{best['ms']:.4f} ms (variant {best['variant']}); default {d0['config'] if d0 else '?'} "
                     f"{d0['ms'] if d0 else float('nan'):.4f} ms{'' if ok else '  [results differ!]'}")
    return lines


def recommend_policy(results: List[Dict]) -> Optional[Dict]:
    """Per (direction, layout), the generation with the lower summed time over the cases that ran
    both (backward = fwd+bwd - fwd); None without --variants data."""
    score = {}
    for r in results:
        lay = "token" if r["per_token"] else "sample"
        for gen in ("v1", "v2"):
            f, fb = r.get(f"ours[{gen}] fwd"), r.get(f"ours[{gen}] fwd+bwd")
            if f is None or fb is None or f != f or fb != fb:
                continue
            score.setdefault(("fwd", lay, gen), 0.0)
            score[("fwd", lay, gen)] += f
            score.setdefault(("bwd", lay, gen), 0.0)
            score[("bwd", lay, gen)] += fb - f
    if not score:
        return None
    policy = {}
    for d in ("fwd", "bwd"):
        for lay in ("sample", "token"):
            a, b = score.get((d, lay, "v1")), score.get((d, lay, "v2"))
            if a is None or b is None:
                continue
            policy[f"{d}_{lay}"] = {"v1": a, "v2": b, "winner": "v2" if b < a else "v1"}
    return policy


# ------------------------------------------------------------------------------------------------
# host time per call (GPU work tiny: the CPU loop time is the host cost)
# ------------------------------------------------------------------------------------------------
def _loop_us(fn: Callable[[], object], n: int) -> float:
    """CPU wall time per call of fn over n calls (us), after 3 warm-up calls, the GPU drained before."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def host_us(fn: Callable[[], object], n: int = 300) -> float:
    """Median over 5 rounds of the CPU wall time per call of fn, n calls per round (us); the GPU
    work of fn must be small enough that the GPU keeps up (no launch-queue back-pressure)."""
    for _ in range(100):
        fn()
    return sorted(_loop_us(fn, n) for _ in range(5))[2]


def _old_fast_path(x, shift, scale, eps=1e-6, weight=None, bias=None):
    """ln_modulate's eager fast path before bc0ec78, for an A/B in one process: its conditions checked in
    Python, then the extension's `apply` (now one C++ call, `try_apply`)."""
    if (not torch.compiler.is_compiling() and type(x) is torch.Tensor and type(shift) is torch.Tensor
            and type(scale) is torch.Tensor and (weight is None or type(weight) is torch.Tensor)
            and (bias is None or type(bias) is torch.Tensor) and x.is_cuda and x.dtype in lnm_mod._KERNEL_DTYPES
            and x.dim() == 3 and x.shape[2] <= lnm_mod.MAX_D_ANY and lnm_mod._mode() != "reference"
            and not torch._C._is_torch_function_mode_enabled()):
        y = lnm_mod._STATE.fast_apply(x, shift, scale, float(eps), weight, bias)
        lnm_mod._STATE.calls["fused"] += 1
        return y
    return ln_modulate(x, shift, scale, eps, weight, bias)


def _chain_fns(s: Dict, n: int, kind: str) -> Callable[[], object]:
    """fwd+bwd of a chain of n ops with one backward (what a training step sees). kind: "ours" (its own
    (shift, scale) leaf pair per op, as every adaLN in a model has), "ours, modulation without grad" (the
    same op, gradients for x only: what the two extra leaf gradients cost), "F.layer_norm" (no affine) or
    "F.layer_norm affine" (its own weight / bias leaf pair per op: as many gradients per op as ours). A
    suffix ", backward()" runs the backward as a training step does (y.backward(dy): the gradients accumulate
    into the leaves' .grad, set to None again after each step as zero_grad(set_to_none=True) does) instead of
    torch.autograd.grad returning every leaf's gradient to Python."""
    into_grad = kind.endswith(", backward()")
    kind = kind.replace(", backward()", "")
    D = s["x"].shape[-1]
    grad_mod = kind != "ours, modulation without grad"
    op = _old_fast_path if kind == "ours via apply (Python checks)" else ln_modulate
    if kind.startswith("ours"):
        pairs = [(s["shift"].detach().clone().requires_grad_(grad_mod), s["scale"].detach().clone().requires_grad_(grad_mod))
                 for _ in range(n)]
    elif kind == "F.layer_norm affine":
        pairs = [(torch.ones(D, device=DEVICE, dtype=s["x"].dtype, requires_grad=True),
                  torch.zeros(D, device=DEVICE, dtype=s["x"].dtype, requires_grad=True)) for _ in range(n)]
    else:
        pairs = [(None, None)] * n
    inputs = [s["x"]] + [t for p in pairs for t in p if t is not None and t.requires_grad]
    F = torch.nn.functional

    def step():
        y = s["x"]
        for a, b in pairs:
            y = F.layer_norm(y, (D,), a, b) if kind.startswith("F.") else op(y, a, b)
        if not into_grad:
            return torch.autograd.grad(y, inputs, s["dy"])
        y.backward(s["dy"])
        for t in inputs:
            t.grad = None
        return None
    return step


def host_overhead(chain: int = 32) -> Dict:
    """Host time per call at a tiny shape (1x16x1536, bf16 x, fp32 [1, 6, D] table views), CPU timer:
    (a) one isolated fwd+bwd (torch.autograd.grad w.r.t. x, shift, scale: includes the autograd
    engine's start-up, which any op pays; F.layer_norm fwd+bwd and a plain x * 2 next to it), and
    (b) the marginal cost per op in a chain of `chain` ops with one backward ((T(chain) - T(1)) /
    (chain - 1): what each op adds to a training step), ours and F.layer_norm. Plus the parts: the
    Python wrapper's checks, the raw ops without autograd."""
    s = make_inputs(1, 16, 1536, False)
    F = torch.nn.functional
    ops = torch.ops.ds_adaptive
    res: Dict = {"shape": "1x16x1536", "chain": chain}
    with torch.no_grad():
        _, mean, rstd = ops.ln_modulate.default(s["x"], s["shift"], s["scale"], None, None, 1e-6)
    fns = {
        "ours fwd": lambda: _nograd(lambda: ln_modulate(s["x"], s["shift"], s["scale"])),
        "ours fwd (grad mode, no backward)": lambda: ln_modulate(s["x"], s["shift"], s["scale"]),
        "ours fwd+bwd": lambda: torch.autograd.grad(ln_modulate(s["x"], s["shift"], s["scale"]),
                                                    (s["x"], s["shift"], s["scale"]), s["dy"]),
        "reference fwd+bwd": lambda: torch.autograd.grad(ln_modulate_reference(s["x"], s["shift"], s["scale"]),
                                                         (s["x"], s["shift"], s["scale"]), s["dy"]),
        "F.layer_norm fwd+bwd": lambda: torch.autograd.grad(F.layer_norm(s["x"], (1536,)), (s["x"],), s["dy"]),
        "x*2 fwd+bwd (engine baseline)": lambda: torch.autograd.grad(s["x"] * 2, (s["x"],), s["dy"]),
        "python checks (_check_args + _use_fused)": lambda: (lnm_mod._check_args(s["x"], s["shift"], s["scale"],
                                                                                 None, None),
                                                            lnm_mod._use_fused(s["x"])),
        "op ln_modulate_apply (no grad)": lambda: _nograd(lambda: ops.ln_modulate_apply.default(
            s["x"], s["shift"], s["scale"], 1e-6, None, None)),
        "op ln_modulate_apply (grad mode)": lambda: ops.ln_modulate_apply.default(
            s["x"], s["shift"], s["scale"], 1e-6, None, None),
        "op ln_modulate (no grad)": lambda: _nograd(lambda: ops.ln_modulate.default(
            s["x"], s["shift"], s["scale"], None, None, 1e-6)),
        "op ln_modulate_backward (no grad)": lambda: _nograd(lambda: ops.ln_modulate_backward.default(
            s["dy"], s["x"], mean, rstd, s["scale"], None, None, False)),
        "torch.empty x 4": lambda: [torch.empty(16, 1536, device=DEVICE) for _ in range(4)],
    }
    if lnm_mod._STATE.fast_apply is not None:
        fns["extension apply (grad mode)"] = lambda: lnm_mod._STATE.fast_apply(
            s["x"], s["shift"], s["scale"], 1e-6, None, None)
    for k, fn in fns.items():
        res[f"{k} us"] = host_us(fn)
    res.update(_chain_marginals(s, chain))
    return res


def _chain_marginals(s: Dict, chain: int, rounds: int = 21) -> Dict:
    """Marginal host time per op in a chain of `chain` ops with one backward, (T(chain) - T(1)) / (chain - 1),
    for ours and torch's LayerNorm (plus: ours with x's gradient only, F.layer_norm with affine leaves, ours
    with one launch more per op: the v1 finalize launches dshift's and dscale's tile sums separately). The
    variants are timed in interleaved rounds (every round times each once) and reported as the median over
    rounds with the spread: the host's drift between consecutive timings (+-5 us seen at bc0ec78, where the
    first variant timed read 8 us high) then moves every variant alike."""
    policy0 = lnm_mod.kernel_policy()
    variants = {n: (n, policy0) for n in ("ours", "F.layer_norm", "ours, modulation without grad", "F.layer_norm affine",
                                          "ours via apply (Python checks)", "ours, backward()",
                                          "F.layer_norm affine, backward()")}
    variants["ours finalize=v1 (one launch more)"] = ("ours", {**policy0, "finalize": 1})
    fns = {n: (_chain_fns(s, 1, kind), _chain_fns(s, chain, kind)) for n, (kind, _) in variants.items()}
    per: Dict[str, List[float]] = {n: [] for n in variants}
    try:
        for _ in range(rounds):
            for n, (_, policy) in variants.items():
                lnm_mod.set_kernel_policy(policy)
                f1, fc = fns[n]
                t1, tn = _loop_us(f1, 100), _loop_us(fc, 25)
                per[n].append((tn - t1) / (chain - 1))
    finally:
        lnm_mod.set_kernel_policy(policy0)
    res: Dict = {"chain rounds": rounds}
    for n, v in per.items():
        v = sorted(v)
        res[f"{n} marginal per op in a chain us"] = v[len(v) // 2]
        res[f"{n} marginal per op in a chain us (min, max over rounds)"] = [v[0], v[-1]]
    return res


def host_profile(path: Path, n: int = 50) -> str:
    """torch.profiler (CPU and CUDA events) over n isolated fwd+bwd calls at 1x16x1536; writes the
    table (by self CPU time) to `path` and returns it."""
    s = make_inputs(1, 16, 1536, False)
    step = lambda: torch.autograd.grad(ln_modulate(s["x"], s["shift"], s["scale"]),  # noqa: E731
                                       (s["x"], s["shift"], s["scale"]), s["dy"])
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    path.write_text(f"torch.profiler, {n} x ours fwd+bwd (autograd.grad) at 1x16x1536\n{table}\n")
    return table


# ------------------------------------------------------------------------------------------------
# Wan 1.3B block fwd+bwd with and without the op
# ------------------------------------------------------------------------------------------------
BLOCK_CASES = [("1x32760", 1, (21, 30, 52)), ("16x1560", 16, (1, 30, 52))]  # 81x480x832 video; 480x832 images


def wan_block(quick: bool) -> Optional[Dict]:
    """Wan 2.1 1.3B block, forward + backward with recompute (torch.utils.checkpoint, as the
    trainer's activation checkpointing), eager, at 1x32760 and 16x1560 tokens: torch's LayerNorm
    path (ln_modulate_reference) vs the fused op."""
    try:
        from ds_adaptive.models.rope import rope_table
        from ds_adaptive.models.wan_blocks import WanBlock
        from ds_adaptive.models.wan_config import get_wan_config
    except ImportError as e:
        print(f"Wan block benchmark skipped: ds_adaptive.models.wan is not available ({e})")
        return None
    from torch.utils.checkpoint import checkpoint

    cfg = get_wan_config("wan2.1-1.3b")
    torch.default_generator.manual_seed(0)  # the block is initialised on the CPU
    block = WanBlock(cfg).cuda().to(torch.bfloat16)
    block.modulation.data = block.modulation.data.float()
    params = [p for p in block.parameters()]
    res = {"model": "wan2.1-1.3b block, recompute"}
    for case, B, grid in BLOCK_CASES:
        S = math.prod(grid)
        x = _randn(B, S, cfg.dim).to(torch.bfloat16).requires_grad_()
        time_mod = _randn(B, 6, cfg.dim) * 0.1
        context = _randn(B, 512, cfg.dim).to(torch.bfloat16)
        freqs = rope_table(grid, cfg.rope_split, device="cuda")
        dy = _randn(*x.shape).to(x.dtype)
        for label, fn in (("reference", ln_modulate_reference), ("fused", ln_modulate)):
            object.__setattr__(block, "ln_modulate", fn)

            def step():
                y = checkpoint(block, x, time_mod, context, freqs, use_reentrant=False)
                return torch.autograd.grad(y, [x] + params, dy, allow_unused=True)

            res[f"{case} {label} ms"] = bench_ms(step, 300 if quick else 1500)
            torch.cuda.empty_cache()
        res[f"{case} speedup"] = res[f"{case} reference ms"] / res[f"{case} fused ms"]
        del x, context, dy
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


def print_targets(results: List[Dict], host: Optional[Dict]) -> None:
    """The op's targets, from this run: eager fwd+bwd / floor, eager fwd / floor, host time."""
    nan = float("nan")
    print()
    print("targets (eager = the call as a training loop makes it, no CUDA graph):")
    lim = {"1.3B 1x32760x1536": 1.5, "1.3B 16x1560x1536": 1.5, "14B 1x75600x5120": 1.2}
    for r in results:
        f = r.get("ours launch fwd", nan) / r.get("floor fwd", nan)
        line = f"  {r['case']:<29} eager fwd/floor {f:.3f} ({'met' if f <= 1.2 else 'MISSED'} <= 1.2)"
        if r["case"] in lim:
            fb = r.get("ours launch fwd+bwd", nan) / r.get("floor fwd+bwd", nan)
            line += f"; eager fwd+bwd/floor {fb:.3f} ({'met' if fb <= lim[r['case']] else 'MISSED'} <= {lim[r['case']]})"
        print(line)
    if host:
        h = host.get("ours fwd+bwd us", nan)
        n = host.get("chain", 32)
        m = host.get("ours marginal per op in a chain us", nan)
        print(f"  host time per fwd+bwd op in a chain of {n} with one backward (what a training step sees) "
              f"{m:.1f} us ({'met' if m <= 60 else 'MISSED'} <= 60; F.layer_norm "
              f"{host.get('F.layer_norm marginal per op in a chain us', nan):.1f} us)")
        print(f"    same chain, ours with x's gradient only {host.get('ours, modulation without grad marginal per op in a chain us', nan):.1f} us; "
              f"F.layer_norm with a weight / bias leaf pair per op {host.get('F.layer_norm affine marginal per op in a chain us', nan):.1f} us; "
              f"ours with one launch more {host.get('ours finalize=v1 (one launch more) marginal per op in a chain us', nan):.1f} us; "
              f"ours through the old Python-checked path {host.get('ours via apply (Python checks) marginal per op in a chain us', nan):.1f} us")
        print(f"    the same chain with y.backward() into .grad (as a training step): ours "
              f"{host.get('ours, backward() marginal per op in a chain us', nan):.1f} us, F.layer_norm with a weight / bias "
              f"leaf pair {host.get('F.layer_norm affine, backward() marginal per op in a chain us', nan):.1f} us")
        print(f"  host time of one isolated fwd+bwd call (autograd.grad, engine start-up included) {h:.1f} us "
              f"({'met' if h <= 60 else 'MISSED'} <= 60; F.layer_norm {host.get('F.layer_norm fwd+bwd us', nan):.1f} "
              f"us, x*2 {host.get('x*2 fwd+bwd (engine baseline) us', nan):.1f} us)")


def print_report(results: List[Dict], tuning: List[Dict], block: Optional[Dict], policy_rec: Optional[Dict],
                 meta: Dict, bw: float, host: Optional[Dict] = None) -> None:
    """The summary tables (the last lines of the output: what the device tool's reply carries)."""
    print()
    print(f"LayerNorm-Modulate, {meta['device']}, bf16 x / fp32 shift+scale, median ms (CUDA-graph replays), "
          f"floor at {bw / 1e12:.2f} TB/s")
    print("(ours = GPU-only, CUDA-graph replays; call = the eager call of a training loop, no graph; "
          "eager = torch reference)")
    hdr = (f"{'case':<29} {'dir':<8} {'ours':>7} {'call':>7} {'eager':>7} {'compile':>8} {'floor':>7} "
           f"{'ours/eager':>10} {'ours/comp':>9} {'ours/floor':>10} {'call/floor':>10}")
    print(hdr)
    print("-" * len(hdr))
    nan = float("nan")
    for r in results:
        for kind in ("fwd", "fwd+bwd"):
            o, e, c, f = (r.get(f"{m} {kind}", nan) for m in ("ours", "eager", "compile", "floor"))
            call = r.get(f"ours launch {kind}", nan)
            print(f"{r['case']:<29} {kind:<8} {o:7.4f} {call:7.4f} {e:7.4f} {c:8.4f} "
                  f"{f:7.4f} {o / e:10.3f} {o / c:9.3f} {o / f:10.3f} {call / f:10.3f}")
    print(f"(ours: kernels {meta['kernels']}; L2 flush: {meta.get('flush', ['read'])[0]}; compile baseline: "
          + "; ".join(f"{r['case']} {r.get('compile variant')}" for r in results) + ")")
    if any("ours fwd @zero" in r for r in results):
        print()
        print("the same after a zero_() L2 flush (triton do_bench's; the write-back of ~50 MB of dirty lines is timed too):")
        print(f"{'case':<29} {'dir':<8} {'ours':>7} {'compile':>8} {'ours/comp':>9} {'ours/floor':>10}")
        for r in results:
            for kind in ("fwd", "fwd+bwd"):
                o, c = r.get(f"ours {kind} @zero", nan), r.get(f"compile {kind} @zero", nan)
                f = r.get(f"floor {kind}", nan)
                print(f"{r['case']:<29} {kind:<8} {o:7.4f} {c:8.4f} {o / c:9.3f} {o / f:10.3f}")
    if any("ours[v1] fwd" in r for r in results):
        print()
        print("kernel generations (ms; ratios of the faster one):")
        print(f"{'case':<29} {'dir':<8} {'v1':>7} {'v2':>7} {'v2/v1':>6} {'best':>4} {'best/comp':>9} {'best/floor':>10}")
        for r in results:
            for kind in ("fwd", "fwd+bwd"):
                a, b = r.get(f"ours[v1] {kind}", nan), r.get(f"ours[v2] {kind}", nan)
                c, f = r.get(f"compile {kind}", nan), r.get(f"floor {kind}", nan)
                best, bn = (b, "v2") if b < a else (a, "v1")
                print(f"{r['case']:<29} {kind:<8} {a:7.4f} {b:7.4f} {b / a:6.3f} {bn:>4} {best / c:9.3f} {best / f:10.3f}")
        if policy_rec:
            rec = {k: int(v["winner"][1]) for k, v in policy_rec.items()}
            rec["finalize"] = 2 if rec.get("bwd_sample", 2) == 2 else 1
            full = {**lnm_mod.parse_kernel_policy(meta["kernels_default"], dict.fromkeys(lnm_mod.POLICY_KEYS, 1)),
                    **rec}
            print("summed over cases (ms): " + ", ".join(f"{k} v1 {v['v1']:.4f} / v2 {v['v2']:.4f}"
                                                       for k, v in policy_rec.items()))
            print(f"recommended: DS_ADAPTIVE_LN_MODULATE_KERNELS={lnm_mod.format_kernel_policy(full)}  "
                  f"(compiled-in default: {meta['kernels_default']})")
    if tuning:
        print()
        print("tuning sweep (x bf16, fp32 modulation; fastest variant per slot and layout):")
        for line in summarize_tuning(tuning):
            print(line)
    print()
    print("accuracy vs fp64 (max abs; eager = torch's own bf16 rounding; rel = relative L2):")
    for r in results:
        for m in ("ours", "ours[v1]", "ours[v2]"):
            if f"{m} y err" not in r:
                continue
            print(f"  {r['case']:<29} {m:<8} y {r[f'{m} y err']:.3g} (eager {r['eager y err']:.3g}) | "
                  f"dx {r[f'{m} dx err']:.3g} (eager {r['eager dx err']:.3g}) | "
                  f"dshift rel {r[f'{m} dshift rel']:.2g} dscale rel {r[f'{m} dscale rel']:.2g} "
                  f"(eager {r['eager dscale rel']:.2g})")
    if host:
        print()
        print(f"host time per call ({host['shape']}, us; CPU timer, GPU work tiny): "
              + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in host.items() if k.endswith(" us")))
    if block and "error" not in block:
        for case, _, _ in BLOCK_CASES:
            print(f"Wan 1.3B block fwd+bwd with recompute at {case}: torch LayerNorm path "
                  f"{block[f'{case} reference ms']:.2f} ms, fused {block[f'{case} fused ms']:.2f} ms "
                  f"({block[f'{case} speedup']:.3f}x)")
    print_targets(results, host)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "ln_modulate.json"))
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--tune", action="store_true",
                    help="also time the compiled-in kernel-config variants (implies --variants)")
    ap.add_argument("--variants", action="store_true",
                    help="also time ours with each kernel generation (v1, v2) per case and recommend a policy")
    ap.add_argument("--no-block", action="store_true", help="skip the Wan block benchmark")
    ap.add_argument("--compile-cases", type=int, default=COMPILE_CASES,
                    help="torch.compile baseline for the first N cases of the case list (default: %(default)s; "
                         "each costs ~30 s of compilation)")
    ap.add_argument("--cases", default="", help="comma-separated case indices (default: all)")
    ap.add_argument("--flush", choices=["read", "zero", "both"], default="read",
                    help="L2 flush before each timed run (see the module doc); both: read first, zero as '@zero'")
    ap.add_argument("--no-host", action="store_true", help="skip the host-time measurements")
    ap.add_argument("--host-only", action="store_true",
                    help="only the host-time measurements (and a torch.profiler table next to --out)")
    args = ap.parse_args(argv)
    FLUSHES[:] = ["read", "zero"] if args.flush == "both" else [args.flush]
    if not torch.cuda.is_available():
        print("bench/kernels/ln_modulate.py needs a CUDA GPU")
        return 2
    os.environ.setdefault("DS_ADAPTIVE_LN_MODULATE", "fused")
    variants = args.variants or args.tune
    t0 = time.time()
    ext = load_op(strict=True)
    status = op_status()
    print(f"op loaded ({status['source']}) in {time.time() - t0:.1f} s; kernels {status['kernels']}", flush=True)
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    bw = copy_bandwidth()
    print(f"device {props.name}, {props.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MiB, "
          f"copy bandwidth {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    meta = {"device": props.name, "sms": props.multi_processor_count, "l2_bytes": l2, "copy_bw_Bps": bw,
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": os.environ.get("GIT_COMMIT") or _git_commit(), "command": " ".join(sys.argv),
            "kernels": status["kernels"], "flush": list(FLUSHES),
            "kernels_default": lnm_mod.format_kernel_policy(dict(zip(lnm_mod.POLICY_KEYS, ext.default_kernels())))}
    picked = [CASES[int(i)] for i in args.cases.split(",") if i.strip()] if args.cases else CASES
    results = []
    tuning: List[Dict] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(**extra):  # after every case too: a run cut off by a time limit keeps what it measured
        out.write_text(json.dumps({"meta": meta, "results": results, "tuning": tuning, **extra}, indent=2))

    host = None if args.no_host else host_overhead()
    if host:
        print("host time per call (us): " + ", ".join(f"{k} {v:.1f}" for k, v in host.items() if k.endswith("us")),
              flush=True)
    if args.host_only:
        print(host_profile(out.with_suffix(".profile.txt")))
        save(host=host)
        return 0
    for name, B, S, D, per_token in picked:
        with_compile = CASES.index((name, B, S, D, per_token)) < args.compile_cases
        r = time_case(name, B, S, D, per_token, l2, args.quick, variants, with_compile)
        fb = floor_bytes(B, S, D, per_token)
        for kind in ("fwd", "fwd+bwd"):
            r[f"floor {kind}"] = fb[kind] / bw * 1e3
            r[f"bytes {kind}"] = fb[kind]
        try:
            r.update(check_case(B, S, D, per_token, variants))
        except Exception as e:  # noqa: BLE001
            print(f"  accuracy check of {name} failed: {e}", flush=True)
        results.append(r)
        save()
        torch.cuda.empty_cache()
        print(f"  {name}: " + ", ".join(f"{k} {r[k]:.4f}" for k in r if isinstance(r[k], float) and "ms" not in k
                                          and "err" not in k and "rel" not in k and "bytes" not in k), flush=True)
    if args.tune:
        tuning = tune(ext, args.quick)
        save()
    block = None
    if not args.no_block:
        try:
            block = wan_block(args.quick)
        except Exception as e:  # noqa: BLE001
            print(f"Wan block benchmark failed: {type(e).__name__}: {e}", flush=True)
            block = {"error": f"{type(e).__name__}: {e}"[:500]}

    policy_rec = recommend_policy(results)
    save(wan_block=block, policy_recommendation=policy_rec, host=host)
    plot(results, out.with_suffix(".png"))

    print_report(results, tuning, block, policy_rec, meta, bw, host)
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
