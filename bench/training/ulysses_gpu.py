"""Ulysses sequence parallelism on GPUs: step time and memory per GPU vs SP degree, and SP=k == SP=1.

One process per GPU (torchrun or the deepspeed launcher), e.g. on 4 H200s:

    torchrun --standalone --nproc_per_node 4 bench/training/ulysses_gpu.py --out bench/out/ulysses_h200.json

Default case: Wan 2.1 1.3B (30 blocks, bf16 parameters, gradient checkpointing), one 81x720x1280
video (latent 21x90x160, 75,600 tokens), B=1, loss on the shards (what the trainer runs).

perf   for each sp in --sp (default: every valid degree <= world: 1, 2, 4): all ranks run the case
       in SP groups of sp consecutive ranks (sp=1: every GPU alone); fwd+bwd of
       ``per_sample_mse(model(x, t, ctx, local=True), v)``, --warmup untimed then --steps timed steps. Per GPU:
       step time (median; the slowest rank is reported), peak memory, static memory (parameters +
       gradients, measured after the warm-up step) and activation memory = peak - static.
       Ratios against sp=1: activation memory (target for sp=2: <= 0.6) and step time.
check  (1) one bf16 input of --check-shape (odd token count: the padding path) through sp=1 and
       every sp=k: the gathered output and the summed parameter gradients of sp=k must be as
       close to an fp32 reference as sp=1's are (error <= 3x sp=1's + a small floor);
       (2) the default case, forward only: the sp=k output vs the sp=1 output (bf16, relative).
Writes a table to stdout and JSON to --out. ``--device cpu --model tiny`` runs the same code on
CPU processes (gloo), e.g. ``torchrun --nproc_per_node 2 bench/training/ulysses_gpu.py --device cpu
--model tiny --frames 9 --height 64 --width 112``.

NCCL_NVLS_ENABLE=0 is set (NVLink SHARP multicast is off on shared hosts). An out-of-memory error
names the case and aborts the job (other ranks would wait in a collective).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GIB = float(1 << 30)
ACT_RATIO_TARGET = 0.6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    p.add_argument("--model", default="wan2.1-1.3b", help="Wan preset (tiny, wan2.1-1.3b, wan2.1-14b)")
    p.add_argument("--layers", type=int, default=None, help="number of blocks (default: the preset's)")
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--height", type=int, default=720)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--text-len", type=int, default=512, help="text tokens (T5 context zero-padded to 512 as Wan)")
    p.add_argument("--grad-ckpt", action=argparse.BooleanOptionalAction, default=True,
                   help="checkpoint every block (default on; off needs ~8 GiB per block at 75k tokens)")
    p.add_argument("--sp", default=None, help="comma-separated SP degrees (default: all valid <= world)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--mode", choices=("all", "perf", "check"), default="all")
    p.add_argument("--check-shape", default="9x464x848",
                   help="FxHxW of the fp32-referenced check (default 9x464x848: 3x29x53 = 4611 tokens, odd)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON result here")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# setup
# ------------------------------------------------------------------------------------------------
def setup(args):
    import torch

    prev = os.environ.get("NCCL_NVLS_ENABLE")
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", args.local_rank or 0))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("ulysses_gpu: no CUDA device; use --device cpu --model tiny for a CPU run")
        if local >= torch.cuda.device_count():
            raise SystemExit(f"ulysses_gpu: LOCAL_RANK {local} but only {torch.cuda.device_count()} GPU(s) visible")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        device = torch.device("cpu")
    if world > 1 or "RANK" in os.environ:
        import deepspeed

        if "MASTER_ADDR" not in os.environ:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
        deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo", verbose=False,
                                   timeout=datetime.timedelta(minutes=5))
    if rank == 0 and prev not in (None, "0"):
        print(f"ulysses_gpu: NCCL_NVLS_ENABLE was {prev!r}; set to 0 (NVLink SHARP off on shared hosts)", flush=True)
    return rank, world, device


def build_model(args, device, dtype):
    import torch

    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.models.wan_config import get_wan_config

    overrides = {"num_layers": args.layers} if args.layers else {}
    cfg = get_wan_config(args.model, **overrides)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = WanModel(cfg)
        # Wan's init zeroes the output head: give it weights so that outputs and gradients are non-trivial.
        torch.nn.init.normal_(model.head.head.weight, std=cfg.dim ** -0.5)
    model.to(dtype)  # every parameter in dtype, as a DeepSpeed bf16 engine holds them
    _broadcast(model)
    model.gradient_checkpointing = bool(args.grad_ckpt)
    return model, cfg


def _broadcast(model) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        for p in model.parameters():
            dist.broadcast(p.data, 0)


def make_inputs(cfg, shape, batch: int, text_len: int, device, dtype, seed: int):
    """Latents, timestep, context (random tokens + zero padding to text_len), target; same on every rank."""
    import torch

    from ds_adaptive.core.shapes import SampleShape

    s = SampleShape(*shape)
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(batch, *s.latent_shape, generator=g)
    t = torch.rand(batch, generator=g) * 1000
    ctx = torch.zeros(batch, text_len, cfg.text_dim)
    ctx[:, : min(text_len, 77)] = torch.randn(batch, min(text_len, 77), cfg.text_dim, generator=g)
    tgt = torch.randn(batch, *s.latent_shape, generator=g)
    return (lat.to(device, dtype), t.to(device), ctx.to(device, dtype), tgt.to(device), s)


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        f, h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"ulysses_gpu: shape {text!r} must be FRAMESxHEIGHTxWIDTH, e.g. 81x720x1280") from None
    return f, h, w


def sp_degrees(args, world: int, heads: int) -> list[int]:
    from ds_adaptive.core.layout import heads_sp_problem

    if args.sp:
        want = [int(v) for v in args.sp.split(",")]
        bad = [k for k in want if k < 1 or world % k]
        if bad:
            raise SystemExit(f"ulysses_gpu: --sp {args.sp}: {bad} must divide the world size ({world})")
        for k in want:
            problem = heads_sp_problem(heads, k, "the model")
            if problem:
                raise SystemExit(f"ulysses_gpu: {problem}")
        return want
    return [k for k in (1, 2, 4, 8) if k <= world and world % k == 0 and heads % k == 0]


# ------------------------------------------------------------------------------------------------
# measurements
# ------------------------------------------------------------------------------------------------
def _sync(device, group=None) -> None:
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def _allreduce_max(values: list[float], device) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _oom_abort(what: str, exc: BaseException) -> None:
    print(f"ulysses_gpu: OUT OF MEMORY on rank {os.environ.get('RANK', '0')} during {what}: {exc}\n"
          "  lower the load: --grad-ckpt (on by default), fewer --layers, a smaller --frames/--height/--width, "
          "or leave out the small --sp degrees", file=sys.stderr, flush=True)
    os._exit(3)  # the other ranks wait in a collective: end the job instead of hanging


def perf_case(model, sp, inputs, args, device) -> dict:
    """Step time and memory of fwd+bwd with the loss on shards at one SP degree."""
    import torch

    from ds_adaptive.models.objective import per_sample_mse
    from ds_adaptive.parallel import apply_ulysses, shard_plan

    lat, t, ctx, tgt, shape = inputs
    apply_ulysses(model, sp)
    plan = shard_plan(shape.tokens, sp)
    times = []
    cuda = device.type == "cuda"
    for i in range(args.warmup + args.steps):
        if i == args.warmup:  # gradients exist now: static memory = parameters + gradients (+ leftovers)
            _sync(device)
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                static = torch.cuda.memory_allocated(device)
        _sync(device, sp.sp_group)
        t0 = time.perf_counter()
        try:
            loss = per_sample_mse(model(lat, t, ctx, local=True), tgt).sum()
            loss.backward()
            if cuda:
                torch.cuda.synchronize(device)
        except torch.cuda.OutOfMemoryError as exc:  # type: ignore[attr-defined]
            _oom_abort(f"sp={sp.sp_size} fwd+bwd of {shape} ({shape.tokens} tokens)", exc)
        times.append(time.perf_counter() - t0)
        for p in model.parameters():  # keep the gradient buffers (static memory), drop the values
            if p.grad is not None:
                p.grad.zero_()
    step = statistics.median(times[args.warmup:])
    peak = torch.cuda.max_memory_allocated(device) if cuda else float("nan")
    static = static if cuda else float("nan")
    step_max, peak_max, static_max, act_max = _allreduce_max([step, peak, static, peak - static], device)
    return {"sp": sp.sp_size, "tokens": shape.tokens, "tokens_per_rank": plan.local_len, "padded": plan.padded_len,
            "step_s": step_max, "step_s_this_rank": times[args.warmup:], "peak_gib": peak_max / GIB,
            "static_gib": static_max / GIB, "act_gib": act_max / GIB}


def _grads(model, sp):
    import torch
    import torch.distributed as dist

    out = []
    for p in model.parameters():
        g = p.grad.detach().float().clone() if p.grad is not None else torch.zeros(p.shape, device=p.device)
        if sp.sp_enabled:
            dist.all_reduce(g, group=sp.sp_group)
        out.append(g.flatten())
    return torch.cat(out)


def check_case(model, ref32, degrees, args, device, cfg, dtype) -> dict:
    """SP=k vs SP=1 vs an fp32 reference on the (odd) check shape: outputs and summed gradients."""
    import torch

    from ds_adaptive.core.layout import Layout
    from ds_adaptive.models.objective import per_sample_mse
    from ds_adaptive.parallel import apply_ulysses, shard_plan

    lat, t, ctx, tgt, shape = make_inputs(cfg, parse_shape(args.check_shape), args.batch, args.text_len, device,
                                          dtype, args.seed + 1)
    ref32.zero_grad(set_to_none=True)
    out32 = ref32(lat.float(), t, ctx.float())
    (out32.float() - tgt).square().mean().backward()
    out32 = out32.detach()
    g32 = torch.cat([p.grad.flatten() for p in ref32.parameters()])
    res = {"shape": str(shape), "tokens": shape.tokens, "per_sp": []}
    base = None
    for k in degrees:
        sp = Layout.detect(k)
        apply_ulysses(model, sp)
        with torch.no_grad():
            out = model(lat, t, ctx)                   # gathered
        model.zero_grad(set_to_none=True)
        part = per_sample_mse(model(lat, t, ctx, local=True), tgt)          # loss on shards
        (part.sum() / args.batch).backward()
        g = _grads(model, sp)
        o_err = float((out.float() - out32.float()).abs().max())
        g_err = float((g - g32).norm() / g32.norm())
        row = {"sp": k, "out_max_abs_err_vs_fp32": o_err, "out_max_abs": float(out32.abs().max()),
               "grad_rel_err_vs_fp32": g_err, "padded": shard_plan(shape.tokens, sp).padded_len}
        if k == 1:
            base = row
        else:
            row["ok"] = (o_err <= 3 * base["out_max_abs_err_vs_fp32"] + 1e-3 * row["out_max_abs"]
                         and g_err <= 3 * base["grad_rel_err_vs_fp32"] + 1e-3)
        res["per_sp"].append(row)
    return res


def check_big(model, degrees, inputs) -> dict:
    """Forward only at the perf shape: sp=k output vs sp=1 output (both in the model dtype)."""
    import torch

    from ds_adaptive.core.layout import Layout
    from ds_adaptive.models.objective import per_sample_mse
    from ds_adaptive.parallel import apply_ulysses

    lat, t, ctx, _, shape = inputs
    outs = {}
    with torch.no_grad():
        for k in degrees:
            sp = Layout.detect(k)
            apply_ulysses(model, sp)
            try:
                outs[k] = model(lat, t, ctx).float()
            except torch.cuda.OutOfMemoryError as exc:  # type: ignore[attr-defined]
                _oom_abort(f"sp={k} forward of {shape}", exc)
            if k != 1:  # keep sp=1's output only
                d = outs.pop(k) - outs[1]
                outs[k] = {"max_abs_diff": float(d.abs().max()), "max_abs": float(outs[1].abs().max()),
                           "mean_abs_diff": float(d.abs().mean()), "mean_abs": float(outs[1].abs().mean())}
                outs[k]["ok"] = (outs[k]["max_abs_diff"] <= 0.05 * outs[k]["max_abs"]
                                 and outs[k]["mean_abs_diff"] <= 0.02 * outs[k]["mean_abs"])
    outs.pop(1, None)
    return {"shape": str(shape), "tokens": shape.tokens, "per_sp": [{"sp": k, **v} for k, v in outs.items()]}


# ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from ds_adaptive.core.layout import Layout

    rank, world, device = setup(args)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model, cfg = build_model(args, device, dtype)
    degrees = sp_degrees(args, world, cfg.num_heads)
    if 1 not in degrees:
        degrees = [1] + degrees  # the baseline of every ratio and check
    if args.warmup < 1 or args.steps < 1:
        raise SystemExit("ulysses_gpu: --warmup and --steps must be >= 1 (static memory is measured after the "
                         "warm-up step, when the gradients exist)")
    shape = parse_shape(f"{args.frames}x{args.height}x{args.width}")
    inputs = make_inputs(cfg, shape, args.batch, args.text_len, device, dtype, args.seed)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    result = {"bench": "ulysses", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "device": dev_name, "world": world, "torch": torch.__version__, "model": args.model,
              "layers": cfg.num_layers, "dtype": args.dtype, "grad_ckpt": bool(args.grad_ckpt),
              "shape": str(inputs[4]), "tokens": inputs[4].tokens, "batch": args.batch,
              "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"), "sp_degrees": degrees}
    if rank == 0:
        print(f"ulysses_gpu: {args.model} ({cfg.num_layers} blocks, {args.dtype}, grad ckpt {args.grad_ckpt}) "
              f"{inputs[4]} = {inputs[4].tokens} tokens x B={args.batch} on {world} x {dev_name}; sp {degrees}",
              flush=True)
    t_start = time.perf_counter()
    if args.mode in ("all", "perf"):
        rows = []
        for k in degrees:
            rows.append(perf_case(model, Layout.detect(k), inputs, args, device))
            if rank == 0:
                r = rows[-1]
                print(f"  sp={k}: {r['step_s']:.3f} s/step, peak {r['peak_gib']:.2f} GiB, activations "
                      f"{r['act_gib']:.2f} GiB", flush=True)
        base = next((r for r in rows if r["sp"] == 1), None)
        for r in rows:
            r["act_ratio_vs_sp1"] = r["act_gib"] / base["act_gib"] if base and base["act_gib"] > 0 else None
            r["step_ratio_vs_sp1"] = r["step_s"] / base["step_s"] if base else None
        result["perf"] = rows
        sp2 = next((r for r in rows if r["sp"] == 2), None)
        if sp2 is not None and sp2["act_ratio_vs_sp1"] is not None and not math.isnan(sp2["act_ratio_vs_sp1"]):
            result["act_ratio_sp2"] = sp2["act_ratio_vs_sp1"]
            result["act_ratio_target"] = ACT_RATIO_TARGET
            result["act_ratio_ok"] = sp2["act_ratio_vs_sp1"] <= ACT_RATIO_TARGET
    if args.mode in ("all", "check"):
        ref32 = None
        try:
            from ds_adaptive.models.wan import WanModel

            with torch.device(device):
                ref32 = WanModel(cfg)
            ref32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
            ref32.gradient_checkpointing = bool(args.grad_ckpt)
            result["check"] = check_case(model, ref32, degrees, args, device, cfg, dtype)
        except torch.cuda.OutOfMemoryError as exc:  # type: ignore[attr-defined]
            _oom_abort(f"the fp32-referenced check at {args.check_shape}", exc)
        del ref32
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["check_big"] = check_big(model, degrees, inputs)
        checks = [r.get("ok") for r in result["check"]["per_sp"] if "ok" in r]
        checks += [r["ok"] for r in result["check_big"]["per_sp"]]
        result["check_ok"] = all(checks)
    result["wall_s"] = time.perf_counter() - t_start
    if rank == 0:
        print(format_table(result), flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(_json_safe(result), indent=1))
            print(f"ulysses_gpu: wrote {args.out}", flush=True)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    failed = result.get("check_ok") is False
    return 1 if failed else 0


def _json_safe(x):
    """NaN (no CUDA memory stats on CPU) -> null, so that the file is strict JSON."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def format_table(r: dict) -> str:
    lines = [f"\nUlysses on {r['world']} x {r['device']}: {r['model']} ({r['layers']} blocks, {r['dtype']}, "
             f"grad ckpt {r['grad_ckpt']}), {r['shape']} = {r['tokens']} tokens, B={r['batch']}"]
    if "perf" in r:
        lines.append(f"{'sp':>3} {'tok/rank':>9} {'step s':>8} {'x sp1':>6} {'peak GiB':>9} {'static':>7} "
                     f"{'act GiB':>8} {'act/sp1':>8}")
        for p in r["perf"]:
            ratio = "-" if p["act_ratio_vs_sp1"] is None or math.isnan(p["act_ratio_vs_sp1"]) else \
                f"{p['act_ratio_vs_sp1']:.3f}"
            sratio = "-" if p["step_ratio_vs_sp1"] is None else f"{p['step_ratio_vs_sp1']:.3f}"
            lines.append(f"{p['sp']:>3} {p['tokens_per_rank']:>9} {p['step_s']:>8.3f} {sratio:>6} "
                         f"{p['peak_gib']:>9.2f} {p['static_gib']:>7.2f} {p['act_gib']:>8.2f} {ratio:>8}")
        if "act_ratio_sp2" in r:
            lines.append(f"activation memory sp=2 / sp=1 = {r['act_ratio_sp2']:.3f} (target <= "
                         f"{r['act_ratio_target']}): {'PASS' if r['act_ratio_ok'] else 'FAIL'}")
    if "check" in r:
        c = r["check"]
        lines.append(f"check {c['shape']} ({c['tokens']} tokens) vs fp32: "
                     + "; ".join(f"sp={x['sp']} out err {x['out_max_abs_err_vs_fp32']:.3g} grad rel err "
                                 f"{x['grad_rel_err_vs_fp32']:.3g}" + ("" if "ok" not in x else
                                                                      (" ok" if x["ok"] else " FAIL"))
                                 for x in c["per_sp"]))
        b = r["check_big"]
        lines.append(f"check {b['shape']} forward, sp=k vs sp=1: " + ("; ".join(
            f"sp={x['sp']} max|diff| {x['max_abs_diff']:.3g} (max|out| {x['max_abs']:.3g}), mean|diff| "
            f"{x['mean_abs_diff']:.3g} (mean|out| {x['mean_abs']:.3g})" + (" ok" if x["ok"] else " FAIL")
            for x in b["per_sp"]) or "no sp>1 degree"))
        lines.append(f"correctness: {'PASS' if r['check_ok'] else 'FAIL'}")
    lines.append(f"({r['wall_s']:.0f} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
