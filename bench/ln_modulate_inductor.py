"""What torch.compile does for the LayerNorm-Modulate expression (benchmark only).

Compiles the reference expression per-token (bf16 x [1, S, D], fp32 shift / scale as strided views
of a [1, S, 6, D] table) or per-sample (a [B, 6, D] table) as bench/ln_modulate.py does, writes
inductor's generated code (forward and backward) to --code, then runs one forward + backward
inside a CUDA-profiler range (torch.cuda.profiler.start/stop), so that

    ncu --profile-from-start off --metrics ... python bench/ln_modulate_inductor.py

counts only those kernels (see bench/gpu_probe.sh). With --time it also prints the median time of
the compiled forward and forward + backward (CUDA-graph replays) after each of two L2 flushes (a
256 MiB zero_(), as triton's do_bench, or a read of it), to compare with bench/ln_modulate_probe.cu.
No ds_adaptive imports: runs where only torch and triton are installed.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch


def reference(x, shift, scale, eps=1e-6):
    """ds_adaptive.ops.ln_modulate_reference (fp32 statistics and modulation, one rounding)."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    return (y * (1 + scale.float()) + shift.float()).to(x.dtype)


def time_graph(fn, flush: str, reps: int = 50) -> float:
    """Median ms of a CUDA-graph replay of fn, each replay after an L2 flush ('zero' or 'read')."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    sink = torch.empty((), dtype=torch.int64, device="cuda")
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i in range(reps + 3):
        if flush == "zero":
            buf.zero_()
        else:
            sink.copy_(buf.sum(dtype=torch.int64))
        if i >= 3:
            ev[i - 3][0].record()
        graph.replay()
        if i >= 3:
            ev[i - 3][1].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in ev)
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--S", type=int, default=32760)
    ap.add_argument("--D", type=int, default=1536)
    ap.add_argument("--per-sample", action="store_true")
    ap.add_argument("--code", type=Path, default=None, help="write inductor's generated code here")
    ap.add_argument("--time", action="store_true", help="time the compiled fwd and fwd+bwd under both flushes")
    args = ap.parse_args()
    B, S, D = args.B, args.S, args.D
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    x = (torch.randn(B, S, D, device="cuda", generator=g) * 1.5 + 0.3).to(torch.bfloat16).requires_grad_()
    if args.per_sample:
        table = (torch.randn(B, 6, D, device="cuda", generator=g) * 0.5).requires_grad_()

        def fn(x, table):
            return reference(x, table[:, 0:1], table[:, 1:2])

        inputs = (x, table)
    else:
        table = torch.randn(B, S, 6, D, device="cuda", generator=g) * 0.5
        shift, scale = table[:, :, 0].requires_grad_(), table[:, :, 1].requires_grad_()
        fn = reference
        inputs = (x, shift, scale)
    dy = torch.randn(B, S, D, device="cuda", generator=g).to(torch.bfloat16)
    cfn = torch.compile(fn, dynamic=False)

    def step():
        return torch.autograd.grad(cfn(*inputs), inputs, dy)

    from torch._inductor.utils import run_and_get_code

    _, codes = run_and_get_code(step)
    if args.code is not None:
        args.code.parent.mkdir(parents=True, exist_ok=True)
        args.code.write_text("\n\n# ======== next compiled module ========\n\n".join(codes))
        print(f"inductor code: {len(codes)} module(s) -> {args.code}")
    if args.time:
        def fwd():
            with torch.no_grad():
                return cfn(*inputs)

        layout = "per-sample" if args.per_sample else "per-token"
        for flush in ("zero", "read"):
            f, fb = time_graph(fwd, flush), time_graph(step, flush)
            print(f"compile {layout} {B}x{S}x{D} flush={flush}: fwd {f:.4f} ms, fwd+bwd {fb:.4f} ms, "
                  f"bwd ~ {fb - f:.4f} ms", flush=True)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
