"""Where a Wan block's non-attention time goes, and what block fusion buys (one GPU, one run, ~3 min).

    python bench/kernels/block_profile.py [--out bench/out/block_profile.json] [--model wan2.1-1.3b] [--quick]
                                  [--modes off,rope,regions,block] [--no-trace]

One Wan block (bf16, the fused LayerNorm-modulate op, SDPA self-attention, 512 text tokens), forward +
backward, at three micro-batches the planner forms: 11 x 1,560 tokens (images), 1 x 32,760, 1 x 75,600.

(a) torch.profiler trace of the eager block (``--no-trace`` skips it): GPU time of the forward and
    backward by kernel kind (attention, GEMM, the LN-modulate op, norms, compiled, elementwise /
    copies / reductions, other), the forward by module (q/k/v/o projections, q/k RMSNorm, the rest of the
    self-attention = RoPE and reshapes, cross-attention, FFN, the block's own ops = LN-modulate op,
    gated residuals and the modulation table), and the top kernels. Chrome traces go next to --out.
(b) A/B of the block's fwd+bwd time (median of CUDA-event timings) with ``adaptive_load.block_fusion``
    ``off`` / ``rope`` / ``regions`` (ds_adaptive/models/fusion.py) and ``block`` = torch.compile of the
    whole block with the self-attention an opaque call (a ceiling: under ZeRO-3 the Linear layers' hooks
    keep it out of reach of the trainer): ms, speed-up over ``off``, TFLOP/s and MFU of the block (model
    FLOPs, ds_adaptive/models/flops.py, over the dense bf16 peak of the device).

Needs: a CUDA GPU, torch with triton (torch.compile), the op's sources (JIT-built by DeepSpeed's builder
when deepspeed is installed, else by torch.utils.cpp_extension: ds_adaptive.ops.ln_modulate.load_op).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ds_adaptive.planning.devices import peak_tflops  # noqa: E402
from ds_adaptive.models.flops import wan_block_flops  # noqa: E402
from ds_adaptive.models.fusion import apply_block_fusion  # noqa: E402
from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.wan_blocks import sdpa_attention
from ds_adaptive.models.wan_config import get_wan_config  # noqa: E402
from ds_adaptive.ops.apply import apply_ln_modulate  # noqa: E402

CASES = ((11, 1560, (1, 30, 52)), (1, 32760, (21, 30, 52)), (1, 75600, (21, 45, 80)))   # B, S, token grid
# --device cpu plumbing runs (tests/unit/bench/test_block_profile_bench.py)
SMALL = ((3, 64, (1, 8, 8)), (1, 240, (3, 8, 10)))
DEVICE = torch.device("cuda")
TEXT = 512
KINDS = (("attention", ("flash", "fmha", "cudnn", "sdpa", "attention", "attn")),
         ("GEMM", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90", "sm100", "Kernel2")),
         ("LN-modulate op", ("ln_mod",)),
         ("norms", ("layer_norm", "rms_norm", "RowwiseMoments", "LayerNorm", "ComputeInternalGradients")),
         ("compiled (triton)", ("triton",)),
         ("elementwise / copy / reduce", ("elementwise", "copy", "reduce", "Cat", "fill", "index", "gelu", "silu",
                                          "mul", "add", "cast")))
MODULES = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "self_attn.norm_q", "self_attn.norm_k",
           "self_attn", "norm3", "cross_attn", "ffn")


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k.lower() in low for k in keys):
            return kind
    return "other"


def build(model_name: str, mode: str):
    cfg = get_wan_config(model_name, num_layers=1)
    model = WanModel(cfg).to_dtype(torch.bfloat16).to(DEVICE)
    apply_ln_modulate(model, DEVICE.type == "cuda")
    if mode == "block":   # the whole block compiled, the self-attention an opaque call
        model.set_attention(torch.compiler.disable(sdpa_attention))
        block = torch.compile(model.blocks[0], dynamic=False)
    else:
        apply_block_fusion(model, mode)
        block = model.blocks[0]
    return cfg, model, block


def inputs(cfg, B: int, S: int, grid):
    from ds_adaptive.models.rope import rope_table

    g = torch.Generator(device=DEVICE).manual_seed(S)
    x = torch.randn(B, S, cfg.dim, device=DEVICE, generator=g).to(torch.bfloat16).requires_grad_()
    tm = torch.randn(B, 6, cfg.dim, device=DEVICE, generator=g) * 0.1
    ctx = torch.randn(B, TEXT, cfg.dim, device=DEVICE, generator=g).to(torch.bfloat16)
    freqs = rope_table(grid, cfg.rope_split, cfg.rope_theta, DEVICE)
    dy = torch.randn(B, S, cfg.dim, device=DEVICE, generator=g).to(torch.bfloat16)
    return x, tm, ctx, freqs, dy


def fwd_bwd(block, x, tm, ctx, freqs, dy) -> None:
    x.grad = None
    block(x, tm, ctx, freqs).backward(dy)


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, iters: int, warmup: int) -> float:
    """Median ms of ``fn`` (CUDA events: calibrate_sparse.time_ms; wall clock on the CPU)."""
    if DEVICE.type == "cuda":
        from ds_adaptive.core.timing import time_ms as cuda_ms

        return cuda_ms(fn, warmup=warmup, iters=iters)
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def _module_ranges(model):
    """Forward hooks that open a record_function range per module of MODULES (profiler attribution)."""
    handles, block = [], model.blocks[0]
    for name in MODULES:
        mod = block.get_submodule(name)
        rf = {}

        def pre(m, a, name=name, rf=rf):
            rf["r"] = torch.autograd.profiler.record_function(f"fwd:{name}")
            rf["r"].__enter__()

        def post(m, a, o, rf=rf):
            rf["r"].__exit__(None, None, None)

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return handles


def _dev_us(evt) -> float:
    for attr in ("device_time_total", "cuda_time_total"):
        if hasattr(evt, attr):
            return float(getattr(evt, attr))
    return 0.0


def trace(model_name: str, B: int, S: int, grid, out_dir: Path) -> dict:
    """Profile the eager block's fwd+bwd at (B, S): GPU time by kernel kind and forward time by module."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cfg, model, block = build(model_name, "off")
    args = inputs(cfg, B, S, grid)
    for _ in range(3):
        fwd_bwd(block, *args)
    _sync()
    handles = _module_ranges(model)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
    with profile(activities=acts) as prof:
        with record_function("fwd:block"):
            y = block(*args[:4])
        _sync()
        y.backward(args[4])   # on the autograd engine's threads: attributed by kernel kind only
        _sync()
    for h in handles:
        h.remove()
    prof.export_chrome_trace(str(out_dir / f"block_trace_{B}x{S}.json"))
    kinds: dict = {}
    kernels: dict = {}
    for e in prof.events():
        if (str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.elapsed_us() > 0
                and not e.name.startswith("fwd:")):   # our ranges also appear as GPU-side annotations
            us = e.time_range.elapsed_us()
            kinds[kind_of(e.name)] = kinds.get(kind_of(e.name), 0.0) + us
            kernels[e.name] = kernels.get(e.name, 0.0) + us
    ranges = {a.key: _dev_us(a) for a in prof.key_averages() if a.key.startswith("fwd:")}
    sa = ranges.get("fwd:self_attn", 0.0)
    sa_children = sum(ranges.get(f"fwd:self_attn.{k}", 0.0) for k in ("q", "k", "v", "o", "norm_q", "norm_k"))
    fwd_modules = {k[4:]: v for k, v in ranges.items() if k.startswith("fwd:") and k != "fwd:block"}
    fwd_modules["self_attn (attention + RoPE + reshapes)"] = sa - sa_children
    fwd_modules.pop("self_attn", None)
    fwd_modules["block's own (LN-modulate op, gated residuals, modulation)"] = (
        ranges.get("fwd:block", 0.0) - sa - sum(ranges.get(f"fwd:{k}", 0.0) for k in ("norm3", "cross_attn", "ffn")))
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    total = sum(kinds.values())
    return {"B": B, "S": S, "total_us": total, "kinds_us": kinds, "fwd_modules_us": fwd_modules,
            "fwd_us": ranges.get("fwd:block", 0.0), "bwd_us": total - ranges.get("fwd:block", 0.0),
            "top_kernels_us": top}


def ab(model_name: str, modes, iters: int, warmup: int, cases=CASES) -> list[dict]:
    rows = []
    peak = peak_tflops(torch.cuda.get_device_name()) if DEVICE.type == "cuda" else None
    for mode in modes:
        t0 = time.perf_counter()
        cfg, _, block = build(model_name, mode)
        for B, S, grid in cases:
            args = inputs(cfg, B, S, grid)
            ms = time_ms(lambda: fwd_bwd(block, *args), iters, warmup)
            flops = 3 * B * wan_block_flops(cfg.dim, cfg.ffn_dim, S, TEXT)
            tf = flops / (ms * 1e-3) / 1e12
            rows.append({"mode": mode, "B": B, "S": S, "ms": ms, "tflops": tf,
                         "mfu": tf / peak if peak else None})
            del args
        rows[-1]["mode_wall_s"] = time.perf_counter() - t0
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    base = {(r["B"], r["S"]): r["ms"] for r in rows if r["mode"] == "off"}
    for r in rows:
        r["speedup_vs_off"] = base.get((r["B"], r["S"]), float("nan")) / r["ms"]
    return rows


def print_trace(t: dict) -> None:
    tot = t["total_us"]
    print(f"\n{t['B']} x {t['S']} tokens: block fwd {t['fwd_us'] / 1e3:.2f} ms + bwd {t['bwd_us'] / 1e3:.2f} ms of GPU "
          f"time ({tot / 1e3:.2f} ms of kernels)")
    for k, us in sorted(t["kinds_us"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:<30} {us / 1e3:8.3f} ms {us / tot:7.1%}")
    print("  forward by module:")
    for k, us in sorted(t["fwd_modules_us"].items(), key=lambda kv: -kv[1]):
        print(f"    {k:<58} {us / 1e3:8.3f} ms")
    print("  top kernels (fwd+bwd):")
    for name, us in t["top_kernels_us"][:10]:
        print(f"    {us / 1e3:8.3f} ms  {name[:100]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/out/block_profile.json")
    ap.add_argument("--model", default="wan2.1-1.3b")
    ap.add_argument("--modes", default="off,rope,regions,block")
    ap.add_argument("--quick", action="store_true", help="fewer timed iterations (5 instead of 15)")
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to test the script (tiny model, small cases)")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("block_profile: needs a CUDA GPU (or --device cpu --model tiny to test the script)", file=sys.stderr)
        return 2
    cases = CASES if DEVICE.type == "cuda" else SMALL
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    dev = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    print(f"{args.model} block on {dev}, torch {torch.__version__}")
    traces = [] if args.no_trace else [trace(args.model, B, S, grid, out.parent) for B, S, grid in cases]
    for t in traces:
        print_trace(t)
    rows = ab(args.model, args.modes.split(","), iters=5 if args.quick else 15, warmup=3, cases=cases)
    print(f"\n{'mode':<8} {'tokens':>10} {'ms':>9} {'vs off':>7} {'TFLOP/s':>8} {'MFU':>6}")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(f"{r['mode']:<8} {r['B']:>3}x{r['S']:<6} {r['ms']:>9.3f} {r['speedup_vs_off']:>6.3f}x {r['tflops']:>8.1f} "
              f"{mfu:>6}")
    out.write_text(json.dumps({"device": dev, "torch": torch.__version__,
                               "model": args.model, "traces": traces, "ab": rows,
                               "wall_s": time.perf_counter() - t0}, indent=1))
    print(f"\nwrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
