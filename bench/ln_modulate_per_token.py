"""Per-token LayerNorm-modulate, fwd+bwd vs its floor, the ways a training step can call it (one GPU, ~1 min).

    python bench/ln_modulate_per_token.py [--out bench/out/ln_modulate_per_token.json] [--B 1 --S 32760 --D 1536]

Wan 2.2-style per-token modulation: x bf16 [B, S, D], shift / scale fp32 [B, S, D] strided views of a
[B, S, 6, D] table. bench/ln_modulate.py times the op with the views as autograd leaves (the op alone:
1.06x its floor on an H200 at d70f524); a training step differentiates the TABLE, and the block's
``table.chunk(6, dim=2)`` backward writes a whole [B, S, 6, D] fp32 gradient (four sixths of it zeros
for the two LayerNorm-modulate chunks; the gates' chunks in a real block). Rows, each timed with CUDA
graphs (GPU time) and as an eager call (host included):

  leaves           grads w.r.t. x and the shift / scale views (bench/ln_modulate.py's row)
  table            grads w.r.t. x and the [B, S, 6, D] table through chunk() (a training step)
  reference        the torch reference (ln_modulate_reference) in the same two ways

The floors: ``leaves`` = bench/ln_modulate.py's floor_bytes; ``table`` adds the table gradient's write
(B S 6 D x 4 bytes) minus the two [B, S, D] gradients it replaces. A profiler table of the ``table`` row's
kernels says where the time beyond the op's own kernels goes. Prints ratios from one run; writes JSON.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location("bench_ln_modulate", ROOT / "bench" / "ln_modulate.py")
lb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lb)   # timing helpers (CUDA graphs, L2 flush, floor bytes) of bench/ln_modulate.py

from ds_adaptive.ops.ln_modulate import ln_modulate, ln_modulate_reference, load_op  # noqa: E402

EPS = 1e-6


def make(B: int, S: int, D: int, how: str):
    """x, dy, the gradient leaves and a function giving (shift, scale) for ``how`` in leaves / table."""
    g = torch.Generator(device="cuda").manual_seed(S + D)
    x = (torch.randn(B, S, D, device="cuda", generator=g) * 1.5 + 0.3).to(torch.bfloat16).requires_grad_()
    table = (torch.randn(B, S, 6, D, device="cuda", generator=g) * 0.5)
    dy = torch.randn(B, S, D, device="cuda", generator=g).to(torch.bfloat16)
    if how == "leaves":
        shift, scale = table[:, :, 0].requires_grad_(), table[:, :, 1].requires_grad_()
        leaves = [x, shift, scale]

        def parts():
            return shift, scale
    else:
        table.requires_grad_()
        leaves = [x, table]

        def parts():
            chunks = table.chunk(6, dim=2)   # [B, S, 1, D] each, as a Wan 2.2 block slices its table
            return chunks[0].squeeze(2), chunks[1].squeeze(2)
    return x, dy, leaves, parts


def step_fn(fn, B, S, D, how):
    x, dy, leaves, parts = make(B, S, D, how)

    def run():
        shift, scale = parts()
        y = fn(x, shift, scale, EPS)
        return torch.autograd.grad(y, leaves, dy)

    return run


def floors(B: int, S: int, D: int, bw: float) -> dict:
    fb = lb.floor_bytes(B, S, D, True)["fwd+bwd"]
    table = fb + B * S * 6 * D * 4 - 2 * B * S * D * 4   # the table's grad replaces dshift, dscale
    return {"leaves": fb / bw * 1e3, "table": table / bw * 1e3}


def kernel_table(run) -> list:
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    out: dict = {}
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            out[e.name] = out.get(e.name, 0.0) + e.time_range.elapsed_us()
    return sorted(out.items(), key=lambda kv: -kv[1])[:12]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/out/ln_modulate_per_token.json")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--S", type=int, default=32760)
    ap.add_argument("--D", type=int, default=1536)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ln_modulate_per_token: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    load_op(strict=True)
    bw = lb.copy_bandwidth()
    fl = floors(args.B, args.S, args.D, bw)
    rows = []
    for name, fn in (("ours", ln_modulate), ("reference", ln_modulate_reference)):
        for how in ("leaves", "table"):
            run = step_fn(fn, args.B, args.S, args.D, how)
            gpu = lb.bench_ms(lb.graphed([run]))
            call = lb.bench_ms(run)
            rows.append({"fn": name, "how": how, "gpu_ms": gpu, "call_ms": call, "floor_ms": fl[how],
                         "gpu_over_floor": gpu / fl[how], "call_over_floor": call / fl[how]})
    kernels = kernel_table(step_fn(ln_modulate, args.B, args.S, args.D, "table"))
    print(f"per-token LayerNorm-modulate {args.B}x{args.S}x{args.D} (bf16 x, fp32 [B,S,6,D] table), "
          f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'fn':<10} {'grads of':<8} {'GPU ms':>8} {'call ms':>8} {'floor':>7} {'GPU/floor':>9} {'call/floor':>10}")
    for r in rows:
        print(f"{r['fn']:<10} {r['how']:<8} {r['gpu_ms']:>8.4f} {r['call_ms']:>8.4f} {r['floor_ms']:>7.4f} "
              f"{r['gpu_over_floor']:>8.3f}x {r['call_over_floor']:>9.3f}x")
    print("kernels of ours / table (one fwd+bwd):")
    for name, us in kernels:
        print(f"  {us:9.1f} us  {name[:110]}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": [args.B, args.S, args.D],
                               "copy_bandwidth": bw, "rows": rows, "kernels_table_us": kernels,
                               "wall_s": time.perf_counter() - t0}, indent=1))
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
