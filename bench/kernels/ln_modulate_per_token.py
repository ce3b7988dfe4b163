"""Per-token LayerNorm-modulate, fwd+bwd vs its floor, the ways a training step can call it (one GPU, ~1 min).

    python bench/kernels/ln_modulate_per_token.py [--out bench/out/ln_modulate_per_token.json] [--B 1 --S 32760 --D 1536]

Wan 2.2-style per-token modulation: x bf16 [B, S, D], shift / scale fp32 [B, S, D] strided views of a
[B, S, 6, D] table. bench/kernels/ln_modulate.py times the op with the views as autograd leaves (the op alone:
1.06x its floor on an H200 at d70f524); a training step differentiates the TABLE, and the block's
``table.chunk(6, dim=2)`` backward writes a whole [B, S, 6, D] fp32 gradient (four sixths of it zeros
for the two LayerNorm-modulate chunks; the gates' chunks in a real block). Rows, each timed with CUDA
graphs (GPU time) and as an eager call (host included):

  leaves           grads w.r.t. x and the shift / scale views: the op's row (bench/kernels/ln_modulate.py's; the
                   target "per-token fwd+bwd <= 1.5x floor" is this row)
  table            grads w.r.t. x and the [B, S, 6, D] table through chunk() (a training step)
  split            torch's chunk() backward alone: the two fp32 [B, S, D] gradients the op returns into the
                   table's gradient (autograd's zeros for the 4 unused chunks + one cat); no op involved
  reference        the torch reference (ln_modulate_reference) as leaves and table

The floors: ``leaves`` = bench/kernels/ln_modulate.py's floor_bytes (30 bytes per element at bf16 x / fp32 modulation:
x, y, shift, scale forward; dy, x, dx, scale, dshift, dscale backward; plus the row statistics); ``table``
adds the table gradient's write (B S 6 D x 4 bytes) minus the two [B, S, D] gradients it replaces;
``split`` reads the two gradients and writes the table's (32 bytes per element). table ~= leaves + split: the
time beyond the op's floor in a training step is autograd's chunk() backward, which no op can write into
(autograd hands each chunk's gradient over separately and concatenates). A profiler table of the ``table``
row's kernels shows it. Prints ratios from one run; writes JSON.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location("bench_ln_modulate", ROOT / "bench" / "kernels" / "ln_modulate.py")
lb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lb)   # timing helpers (CUDA graphs, L2 flush, floor bytes) of bench/kernels/ln_modulate.py

from ds_adaptive.ops.ln_modulate import ln_modulate, ln_modulate_reference, load_op  # noqa: E402

EPS = 1e-6
TARGET = 1.5   # per-token fwd+bwd of the op vs its floor (the leaves row)
DEVICE = "cuda"  # bench/kernels/test_ln_modulate_per_token_bench.py runs the plumbing on "cpu"


def make(B: int, S: int, D: int, how: str):
    """x, dy, the gradient leaves and a function giving (shift, scale) for ``how`` in leaves / table."""
    g = torch.Generator(device=DEVICE).manual_seed(S + D)
    x = (torch.randn(B, S, D, device=DEVICE, generator=g) * 1.5 + 0.3).to(torch.bfloat16).requires_grad_()
    table = (torch.randn(B, S, 6, D, device=DEVICE, generator=g) * 0.5)
    dy = torch.randn(B, S, D, device=DEVICE, generator=g).to(torch.bfloat16)
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


def split_fn(B, S, D):
    """torch's chunk() backward alone: fp32 gradients of chunks 0 and 1 (contiguous, as the op returns dshift /
    dscale) into the [B, S, 6, D] table."""
    g = torch.Generator(device=DEVICE).manual_seed(S + D + 1)
    table = torch.randn(B, S, 6, D, device=DEVICE, generator=g).requires_grad_()
    grads = [torch.randn(B, S, D, device=DEVICE, generator=g) for _ in range(2)]

    def run():
        chunks = table.chunk(6, dim=2)
        return torch.autograd.grad([chunks[0].squeeze(2), chunks[1].squeeze(2)], [table], grads)

    return run


def floor_bytes(B: int, S: int, D: int) -> dict:
    """Bytes that must move per row kind (see the module doc)."""
    fb = lb.floor_bytes(B, S, D, True)["fwd+bwd"]
    table_grad, two = B * S * 6 * D * 4, 2 * B * S * D * 4
    return {"leaves": fb, "table": fb + table_grad - two, "split": table_grad + two}


def floors(B: int, S: int, D: int, bw: float) -> dict:
    """Floor ms per row kind at copy bandwidth bw (bytes/s, read + write)."""
    return {k: v / bw * 1e3 for k, v in floor_bytes(B, S, D).items()}


def measure(B: int, S: int, D: int, bw: float) -> list:
    """The rows (see the module doc): GPU-only time (CUDA-graph replays) and the eager call, vs the floors."""
    fl = floors(B, S, D, bw)
    cases = [("ours", ln_modulate, "leaves"), ("ours", ln_modulate, "table"), ("torch", None, "split"),
             ("reference", ln_modulate_reference, "leaves"), ("reference", ln_modulate_reference, "table")]
    rows = []
    for name, fn, how in cases:   # one case's tensors at a time
        run = split_fn(B, S, D) if fn is None else step_fn(fn, B, S, D, how)
        gpu = lb.bench_ms(lb.graphed([run]))
        call = lb.bench_ms(run)
        rows.append({"fn": name, "how": how, "gpu_ms": gpu, "call_ms": call, "floor_ms": fl[how],
                     "gpu_over_floor": gpu / fl[how], "call_over_floor": call / fl[how]})
    return rows


def verdict(rows: list) -> list:
    """Lines: the op's target (leaves row, GPU and call) and the decomposition table ~= leaves + split."""
    r = {(x["fn"], x["how"]): x for x in rows}
    op, table, split = r[("ours", "leaves")], r[("ours", "table")], r[("torch", "split")]
    worst = max(op["gpu_over_floor"], op["call_over_floor"])
    lines = [f"target: per-token fwd+bwd of the op <= {TARGET}x floor: GPU {op['gpu_over_floor']:.3f}x, call "
             f"{op['call_over_floor']:.3f}x ({'met' if worst <= TARGET else 'MISSED'})"]
    for kind in ("gpu_ms", "call_ms"):
        lines.append(f"{kind[:-3]:>4}: table {table[kind]:.4f} ms = op {op[kind]:.4f} + {table[kind] - op[kind]:.4f} "
                     f"beyond the op; torch's chunk() backward alone {split[kind]:.4f} ms")
    return lines


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
    rows = measure(args.B, args.S, args.D, bw)
    kernels = kernel_table(step_fn(ln_modulate, args.B, args.S, args.D, "table"))
    print(f"per-token LayerNorm-modulate {args.B}x{args.S}x{args.D} (bf16 x, fp32 [B,S,6,D] table), "
          f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'fn':<10} {'grads of':<8} {'GPU ms':>8} {'call ms':>8} {'floor':>7} {'GPU/floor':>9} {'call/floor':>10}")
    for r in rows:
        print(f"{r['fn']:<10} {r['how']:<8} {r['gpu_ms']:>8.4f} {r['call_ms']:>8.4f} {r['floor_ms']:>7.4f} "
              f"{r['gpu_over_floor']:>8.3f}x {r['call_over_floor']:>9.3f}x")
    lines = verdict(rows)
    for line in lines:
        print(line)
    print("kernels of ours / table (one fwd+bwd):")
    for name, us in kernels:
        print(f"  {us:9.1f} us  {name[:110]}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": [args.B, args.S, args.D],
                               "commit": os.environ.get("GIT_COMMIT") or lb._git_commit(),
                               "copy_bandwidth": bw, "floor_bytes": floor_bytes(args.B, args.S, args.D), "rows": rows,
                               "verdict": lines, "kernels_table_us": kernels, "wall_s": time.perf_counter() - t0},
                              indent=1))
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
