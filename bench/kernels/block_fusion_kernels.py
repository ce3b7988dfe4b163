"""How close the block's memory-bound pieces run to the memory bandwidth, each way they can run (one GPU, ~2 min).

    python bench/kernels/block_fusion_kernels.py [--out bench/out/block_fusion_kernels.json] [--model wan2.1-1.3b]
                                         [--cases 11x1560,1x32760] [--pieces qk_norm_rope,...] [--no-code]

The pieces of a Wan block outside attention and the Linear layers' GEMMs, at the micro-batches the planner forms
(B x S tokens, bf16, the model's D), forward and forward + backward:

* ``qk_norm_rope``: q / k RMSNorm + RoPE (``wan_blocks.qk_norm_rope``) eager; compiled as ``block_fusion: regions``
  compiles it (``dynamic=True``); compiled for the shape (``dynamic=False``); the Triton kernel
  (``ds_adaptive.ops.qk_norm_rope``);
* ``gated_residual``, ``layer_norm``: eager; compiled dynamic;
* ``linear_bias``: a Linear's bias the way ZeRO-3 runs it (DeepSpeed's ``LinearFunctionForZeroStage3``): on a
  3-D input (``matmul`` then a broadcast ``add_``) and on the same input flattened to 2-D (``addmm``: the bias in
  the GEMM's epilogue; what ``wan_blocks.FlatLinear`` does), D -> D and D -> FFN.

Per row: ms, the bytes the piece must move (inputs read, outputs written; backward: gradients in, saved inputs
read, gradients out) and ``x floor`` = ms over the time a device-to-device copy takes to move those bytes (measured
in the same run). ``--no-code`` skips writing Inductor's generated code for ``qk_norm_rope`` (dynamic) next to
--out, which tells why a compiled piece is slow. Explains the trainer's profile (``bench/training/train_step_profile.py``);
the trainer's A/B of a lever is ``bench/training/mfu_levers.py``. ``--sweep`` times the Triton ``qk_norm_rope``'s launch
shapes instead (``DS_ADAPTIVE_QK_ROPE_TILES``; kernel time from torch.profiler, not wall time) and prints the fastest.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ds_adaptive.models import wan_blocks  # noqa: E402
from ds_adaptive.models.rope import rope_table
from ds_adaptive.models.wan_config import get_wan_config  # noqa: E402

CASES = ((11, 1560), (1, 32760))
PIECES = ("qk_norm_rope", "gated_residual", "layer_norm", "linear_bias")


def time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median ms of ``fn`` (CUDA events)."""
    from ds_adaptive.core.timing import time_ms as cuda_ms

    return cuda_ms(fn, warmup=warmup, iters=iters)


def copy_gbps(device) -> float:
    """Device-to-device copy bandwidth (GB/s, bytes read + written) of a 1 GiB bf16 tensor."""
    x = torch.empty(2 ** 29, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), iters=10)
    return 2 * x.numel() * 2 / ms / 1e6


def _act(b, s, d, device, grad=True):
    return torch.randn(b, s, d, device=device, dtype=torch.bfloat16).requires_grad_(grad)


def _param(d, device, dtype=torch.bfloat16):
    return torch.nn.Parameter(1 + 0.1 * torch.randn(d, device=device).to(dtype))


def _compiled(fn, dynamic: bool):
    return torch.compile(fn, dynamic=dynamic, fullgraph=True)


def piece_cases(piece: str, cfg, b: int, s: int, device):
    """``(variant, fwd callable, the tensors the backward differentiates, fwd bytes, bwd bytes)`` per variant."""
    d, n, e = cfg.dim, b * s, 2
    if piece == "qk_norm_rope":
        from ds_adaptive.ops.qk_norm_rope import triton_qk_norm_rope

        q, k, wq, wk = _act(b, s, d, device), _act(b, s, d, device), _param(d, device), _param(d, device)
        freqs = rope_table((1, 1, s), cfg.rope_split, cfg.rope_theta, device)
        args = (q, k, wq, wk, freqs, cfg.eps, cfg.num_heads)
        fwd_bytes = 4 * n * d * e + freqs.numel() * 4
        bwd_bytes = 6 * n * d * e + freqs.numel() * 4
        variants = {"eager": wan_blocks.qk_norm_rope, "compiled dynamic": _compiled(wan_blocks.qk_norm_rope, True),
                    "compiled static": _compiled(wan_blocks.qk_norm_rope, False), "triton kernel": triton_qk_norm_rope}
        return [(name, (lambda f=f: f(*args)), (q, k, wq, wk), fwd_bytes, bwd_bytes) for name, f in variants.items()]
    if piece == "gated_residual":
        x, y = _act(b, s, d, device), _act(b, s, d, device)
        gate = (0.1 * torch.randn(b, 1, d, device=device)).requires_grad_()
        variants = {"eager": wan_blocks.gated_residual, "compiled dynamic": _compiled(wan_blocks.gated_residual, True)}
        return [(name, (lambda f=f: f(x, y, gate)), (x, y, gate), 3 * n * d * e, 4 * n * d * e)
                for name, f in variants.items()]
    if piece == "layer_norm":
        x, w, bias = _act(b, s, d, device), _param(d, device, torch.float32), _param(d, device, torch.float32)
        variants = {"eager": wan_blocks.fp32_layer_norm, "compiled dynamic": _compiled(wan_blocks.fp32_layer_norm, True)}
        return [(name, (lambda f=f: f(x, w, bias, cfg.eps)), (x, w, bias), 2 * n * d * e, 3 * n * d * e)
                for name, f in variants.items()]
    if piece == "linear_bias":
        from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3 as Zero3Linear

        out = []
        for o in (d, cfg.ffn_dim):
            x = _act(b, s, d, device)
            w = torch.nn.Parameter(0.02 * torch.randn(o, d, device=device).to(torch.bfloat16))
            bias = _param(o, device)
            # the GEMMs' bytes are not a floor of anything: x floor is only the bias add's share (out written + read)
            out.append((f"zero3 3-D, D->{o}", lambda x=x, w=w, bias=bias: Zero3Linear.apply(x, w, bias), (x, w, bias),
                        2 * n * o * e, 0))
            out.append((f"zero3 2-D, D->{o}", lambda x=x, w=w, bias=bias, o=o: Zero3Linear.apply(
                x.reshape(-1, d), w, bias).unflatten(0, (b, s)), (x, w, bias), 2 * n * o * e, 0))
        return out
    raise ValueError(f"unknown piece {piece!r}; pieces: {list(PIECES)}")


def measure(fn, params, iters: int):
    """(fwd ms, fwd+bwd ms) of ``fn`` (its outputs' backward with fixed gradients)."""
    outs = fn()
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) for o in outs]

    def fwd_bwd():
        for p in params:
            p.grad = None
        torch.autograd.backward(fn() if len(outs) > 1 else (fn(),), grads)

    fwd_bwd()   # compiles the backward
    with torch.no_grad():
        fwd = time_ms(fn, iters=iters)
    return fwd, time_ms(fwd_bwd, iters=iters)


def dump_code(cfg, device, path: Path) -> None:
    """Inductor's generated code for ``qk_norm_rope`` compiled as block fusion compiles it, forward + backward."""
    from torch._inductor.utils import run_and_get_code

    b, s, d = 1, 32760, cfg.dim
    q, k, wq, wk = _act(b, s, d, device), _act(b, s, d, device), _param(d, device), _param(d, device)
    freqs = rope_table((1, 1, s), cfg.rope_split, cfg.rope_theta, device)
    fn = _compiled(wan_blocks.qk_norm_rope, True)

    def run():
        outs = fn(q, k, wq, wk, freqs, cfg.eps, cfg.num_heads)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    _, code = run_and_get_code(run)
    path.write_text("\n\n# ----- next graph -----\n\n".join(code))
    torch._dynamo.reset()


SWEEP = [(ppsm, warps) for ppsm in (4, 8, 16, 32) for warps in (2, 4, 8)]


def kernel_ms(fn, params, iters: int) -> float:
    """GPU ms per fwd+bwd call of ``fn``, summed over the kernels only (torch.profiler's device time of every
    kernel the calls launch): unlike CUDA-event wall time, not inflated by the host's launch and autograd work,
    which at these sizes is longer than the kernels (a CUDA-event sweep at 2981c53 showed no pattern)."""
    from torch.profiler import ProfilerActivity, profile

    outs = fn()
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(fn(), grads)   # compiles
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            for p in params:
                p.grad = None
            torch.autograd.backward(fn(), grads)
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / iters


def sweep_tiles(cfg, cases, device, iters: int) -> tuple[int, int]:
    """Kernel-only fwd+bwd ms (:func:`kernel_ms`) of the Triton ``qk_norm_rope`` at each (programs per SM, warps)
    of ``SWEEP``; prints a table and the launch with the least summed time over ``cases``, which is returned."""
    import os

    from ds_adaptive.ops import qk_norm_rope as op

    totals = {}
    print("\n| programs / SM | warps | " + " | ".join(f"{b} x {s} fwd+bwd kernel ms" for b, s in cases) + " |")
    print("|---:|---:|" + "---:|" * len(cases))
    for ppsm, warps in SWEEP:
        os.environ[op.TILES_ENV] = f"{ppsm},{warps}"
        ms = []
        for b, s in cases:
            (_, fn, params, _, _), = [c for c in piece_cases("qk_norm_rope", cfg, b, s, device)
                                      if c[0] == "triton kernel"]
            ms.append(kernel_ms(fn, params, iters))
        totals[(ppsm, warps)] = sum(ms)
        print(f"| {ppsm} | {warps} | " + " | ".join(f"{m:.3f}" for m in ms) + " |")
    del os.environ[op.TILES_ENV]
    best = min(totals, key=totals.get)
    default = (op.PROGRAMS_PER_SM, op.default_warps(cfg.dim))
    print(f"best: {best[0]},{best[1]} ({totals[default] / totals[best]:.3f}x the default {default[0]},{default[1]}); "
          f"{op.TILES_ENV}={best[0]},{best[1]} runs it")
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "block_fusion_kernels.json"))
    ap.add_argument("--model", default="wan2.1-1.3b")
    ap.add_argument("--cases", default=",".join(f"{b}x{s}" for b, s in CASES), help="BxS,...")
    ap.add_argument("--pieces", default=",".join(PIECES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-code", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="only time the Triton qk_norm_rope's launch shapes "
                    "(programs per SM x warps) and print the best as best: PPSM,WARPS")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("block_fusion_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    cfg = get_wan_config(args.model)
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        best = sweep_tiles(cfg, cases, device, args.iters)
        out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "best_tiles": list(best)}))
        return 0
    if not args.no_code:
        dump_code(cfg, device, out.with_name(out.stem + "_inductor_qk_norm_rope.py.txt"))
    bw = copy_gbps(device)
    print(f"{torch.cuda.get_device_name(0)}: device-to-device copy {bw:,.0f} GB/s; {args.model} D {cfg.dim}")
    rows = []
    for piece in args.pieces.split(","):
        for b, s in cases:
            eager = None
            for name, fn, params, fwd_bytes, bwd_bytes in piece_cases(piece, cfg, b, s, device):
                torch._dynamo.reset()   # each compiled variant compiles afresh (no graph shared between them)
                fwd, both = measure(fn, params, args.iters)
                eager = both if name == "eager" else eager
                floor_fwd = fwd_bytes / bw / 1e6
                floor_both = (fwd_bytes + bwd_bytes) / bw / 1e6
                rows.append({"piece": piece, "B": b, "S": s, "variant": name, "fwd_ms": fwd, "fwd_bwd_ms": both,
                             "fwd_x_floor": fwd / floor_fwd,
                             "fwd_bwd_x_floor": both / floor_both if bwd_bytes else None,
                             "speedup_vs_eager": eager / both if eager else None})
            torch._dynamo.reset()
    print("\n| piece | B x S | variant | fwd ms | fwd x floor | fwd+bwd ms | fwd+bwd x floor | vs eager |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        fb = "" if r["fwd_bwd_x_floor"] is None else f"{r['fwd_bwd_x_floor']:.2f}"
        ve = "" if r["speedup_vs_eager"] is None else f"{r['speedup_vs_eager']:.2f}x"
        print(f"| {r['piece']} | {r['B']} x {r['S']} | {r['variant']} | {r['fwd_ms']:.3f} | {r['fwd_x_floor']:.2f} | "
              f"{r['fwd_bwd_ms']:.3f} | {fb} | {ve} |")
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "copy_gbps": bw, "model": args.model,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
