"""Where a training step's time goes: the trainer on the shipped job, its step split into segments.

    python bench/training/train_step_profile.py --out DIR [--config CFG] [--model wan2.1-1.3b] [--gas auto]
                                       [--warm 2] [--timed 2] [--profiled 1] [--set KEY=JSON ...]

Builds the run the way users run it (``build_run`` + ``Trainer`` on the shipped ``zero3_adaptive.json``,
profile / m_comp / gas ``auto`` unless set), trains ``--warm`` steps, then:

* ``--timed`` steps with every segment bracketed by ``torch.cuda.synchronize()``: the DataLoader fetch,
  the engine's forward, its backward, its non-boundary ``step()`` (inside the accumulation window) and
  its boundary ``step()`` (the optimizer), the metrics' end of step, and what is left (host work
  between them). Each segment's time then includes its GPU work;
* ``--profiled`` steps under ``torch.profiler`` (CPU + CUDA) with the same segments as ranges: the GPU's
  busy time (union of kernel intervals) over the steps' wall, each segment's kernel time, the top
  kernels and host operators by self time, and the elementwise operators (copies, adds, casts) by input
  shape, which tell the activations they move from the parameters.

``--kernels-only``: the profiled steps record CUDA kernels alone (no host operators, no shapes, no segment
ranges), so the profiler adds little host time and the GPU's idle share is the host's: it prints the busy share of
the steps' wall and the kernel time by kind (attention, GEMM, other). The warm steps run untouched (no sync, no
profiler): an A/B of a host-side setting compares their walls on the same samples (``--set``, or
``--reduce-events N`` for ZeRO-3's cap on outstanding gradient reductions, which its JSON does not expose).

Per segment it prints ms per step and its share of the step, and writes DIR/train_step_profile.json and
DIR/profile_tables.txt. Compares nothing: it explains a figure (the summary's MFU); the A/B of a lever is
``bench/training/mfu_levers.py``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "launch" / "configs" / "zero3_adaptive.json"


#: the memory-bound operators outside attention and GEMMs (a fifth of the default job's GPU time with block fusion
#: off, docs/RESULTS.md); grouped by input shape they say whether they move activations ([B, S, D], [B, S, F]) or
#: parameters
ELEMENTWISE_OPS = ("aten::copy_", "aten::add_", "aten::add", "aten::mul", "aten::mul_", "aten::cat", "aten::sum",
                   "aten::_to_copy", "aten::fill_", "aten::zero_", "aten::div", "aten::div_", "aten::sub")


def elementwise_by_shape(prof, steps: int, top: int = 30) -> list:
    """The ``top`` elementwise operators (``ELEMENTWISE_OPS``) of a ``record_shapes`` profile, grouped by input
    shapes, by self GPU time: ``[{op, shapes, calls, gpu_ms}]`` per step."""
    rows = [{"op": e.key, "shapes": str(e.input_shapes), "calls": e.count / steps,
             "gpu_ms": e.self_device_time_total / 1e3 / steps}
            for e in prof.key_averages(group_by_input_shape=True) if e.key in ELEMENTWISE_OPS]
    return sorted(rows, key=lambda r: -r["gpu_ms"])[:top]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Segments:
    """Wraps the trainer's calls; ``mode``: ``off``, ``timed`` (synchronize around each call, wall time) or
    ``ranges`` (a ``record_function`` range per call, for the profiler)."""

    def __init__(self, trainer) -> None:
        self.mode = "off"
        self.ms = defaultdict(float)
        self.calls = defaultdict(int)
        eng = trainer.engine
        self._wrap(trainer.batches, "next", "data")
        self._wrap(eng, "forward", "forward")
        self._wrap(eng, "backward", "backward")
        step = eng.step

        def step_wrapped(*a, **k):
            name = "step_boundary" if eng.is_gradient_accumulation_boundary() else "step_inner"
            return self._call(name, step, a, k)

        eng.step = step_wrapped
        self._wrap(trainer.metrics, "end_step", "end_step")

    def _wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        setattr(obj, attr, lambda *a, **k: self._call(name, fn, a, k))

    def _call(self, name, fn, a, k):
        if self.mode == "off":
            return fn(*a, **k)
        if self.mode == "ranges":
            with torch.profiler.record_function(f"seg/{name}"):
                return fn(*a, **k)
        sync()
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            sync()
            self.ms[name] += (time.perf_counter() - t0) * 1e3
            self.calls[name] += 1


def busy_ms(prof) -> float:
    """Union of the CUDA kernels' intervals (ms)."""
    iv = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in iv:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1e3  # us -> ms


#: kernel name fragments by kind (``--kernels-only``'s table)
KERNEL_KINDS = (("attention", ("sdpa", "flash", "fmha", "attention")),
                ("gemm", ("nvjet", "gemm", "cutlass", "sm90_xmma", "wgmma")))


def kernel_kinds(prof, steps: int) -> dict:
    """Self kernel ms per step by kind (``KERNEL_KINDS``, the rest "other") of a CUDA-only profile."""
    out = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
    for e in prof.key_averages():
        if e.self_device_time_total <= 0:
            continue
        name = e.key.lower()
        kind = next((k for k, frags in KERNEL_KINDS if any(f in name for f in frags)), "other")
        out[kind] += e.self_device_time_total / 1e3 / steps
    return out


#: idle gaps between kernels by length (ms): where the host held the GPU up
GAP_BUCKETS = (0.01, 0.1, 1.0, 10.0, 1e9)


def idle_gaps(prof, steps: int, top: int = 12) -> dict:
    """The GPU's idle gaps in a CUDA-only profile: per bucket (``GAP_BUCKETS``, upper bound in ms) the count and
    ms per step, and the ``top`` longest gaps with the kernels either side (a host wait shows as a long gap after
    the last kernel queued before it)."""
    ev = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    buckets = {b: [0, 0.0] for b in GAP_BUCKETS}
    gaps = []
    cur_end, cur_name = None, None
    for s, e, name in ev:
        if cur_end is not None and s > cur_end:
            ms = (s - cur_end) / 1e3
            b = next(x for x in GAP_BUCKETS if ms <= x)
            buckets[b][0] += 1
            buckets[b][1] += ms
            gaps.append((ms, cur_name, name))
        if cur_end is None or e > cur_end:
            cur_end, cur_name = e, name
    gaps.sort(key=lambda g: -g[0])
    return {"buckets": [{"le_ms": b, "count_per_step": c / steps, "ms_per_step": t / steps}
                        for b, (c, t) in buckets.items()],
            "top": [{"ms": g[0], "after": g[1][:90], "before": g[2][:90]} for g in gaps[:top]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="a directory")
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--model", default="wan2.1-1.3b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--gas", default=None, help="gradient_accumulation_steps (default: the config's)")
    ap.add_argument("--num-samples", type=int, default=2000)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--timed", type=int, default=2)
    ap.add_argument("--profiled", type=int, default=1)
    ap.add_argument("--kernels-only", action="store_true",
                    help="profile CUDA kernels alone (busy share of the wall, kernel time by kind)")
    ap.add_argument("--reduce-events", type=int, default=None,
                    help="ZeRO-3's cap on outstanding gradient-reduction events before the backward thread waits "
                         "(DeepSpeed's max_param_reduce_events, 2 in 0.19.8; not in its JSON)")
    ap.add_argument("--set", action="append", default=[],
                    help="a config key, dotted, = JSON value, e.g. adaptive_load.block_fusion=\"regions\"")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from ds_adaptive.planning.memory import configure_allocator
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run, leaf_block_count
    from ds_adaptive.training.run_config import RunConfig
    from ds_adaptive.training.trainer import Trainer
    from ds_adaptive.training.engine import init_distributed

    print(configure_allocator())
    _, _, device = init_distributed(0)
    cfg = json.loads(Path(args.config).read_text())
    if args.gas is not None:
        cfg["gradient_accumulation_steps"] = args.gas if args.gas == "auto" else int(args.gas)
    cfg["adaptive_load"]["metrics"] = {"interval": 1, "log_dir": str(out / "run"), "tensorboard": False, "jsonl": True}
    for kv in args.set:
        key, val = kv.split("=", 1)
        node = cfg
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = json.loads(val)
    total = args.warm + args.timed + args.profiled
    rc = RunConfig.load(cfg, trainer={"model": args.model, "layers": args.layers, "steps": total,
                                      "num_samples": args.num_samples, "compute_timing": True})
    run = build_run(rc, layout=Layout.detect(1, ds_config=rc.ds_config), device=device)
    trainer = Trainer(run)
    if args.reduce_events is not None:
        trainer.engine.optimizer.max_param_reduce_events = args.reduce_events
    leaves = leaf_block_count(run.model)
    print(f"ZeRO-3 leaf modules: {leaves}")
    seg = Segments(trainer)
    recs = []
    for _ in range(args.warm):
        recs.append(("warm", trainer.train_step()))
    seg.mode = "timed"
    t_timed = 0.0
    for _ in range(args.timed):
        t0 = time.perf_counter()
        recs.append(("timed", trainer.train_step()))
        t_timed += (time.perf_counter() - t0) * 1e3
    timed = {k: v / max(1, args.timed) for k, v in seg.ms.items()}
    timed_calls = {k: v / max(1, args.timed) for k, v in seg.calls.items()}
    step_ms = t_timed / max(1, args.timed)
    timed["other (host between segments)"] = step_ms - sum(timed.values())

    seg.mode = "off" if args.kernels_only else "ranges"
    prof_doc = {}
    if args.profiled and args.kernels_only:
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.profiled):
                recs.append(("profiled", trainer.train_step()))
            sync()
        wall = (time.perf_counter() - t0) * 1e3
        busy = busy_ms(prof)
        prof_doc = {"kernels_only": True, "wall_ms_per_step": wall / args.profiled,
                    "gpu_busy_ms_per_step": busy / args.profiled, "gpu_busy_frac": busy / wall,
                    "kernel_ms_per_step": kernel_kinds(prof, args.profiled),
                    "idle_gaps": idle_gaps(prof, args.profiled), "segments": {}}
    elif args.profiled:
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
            for _ in range(args.profiled):
                recs.append(("profiled", trainer.train_step()))
            sync()
        wall = (time.perf_counter() - t0) * 1e3
        ka = prof.key_averages()
        seg_rows = {e.key[4:]: {"cpu_ms": e.cpu_time_total / 1e3 / args.profiled,
                                "gpu_ms": e.device_time_total / 1e3 / args.profiled}
                    for e in ka if e.key.startswith("seg/")}
        busy = busy_ms(prof)
        by_shape = elementwise_by_shape(prof, args.profiled)
        prof_doc = {"wall_ms_per_step": wall / args.profiled, "gpu_busy_ms_per_step": busy / args.profiled,
                    "gpu_busy_frac": busy / wall, "segments": seg_rows, "elementwise_by_shape": by_shape}
        with open(out / "profile_tables.txt", "w") as f:
            f.write(ka.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70))
            f.write("\n\n")
            f.write(ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
            f.write("\n\nelementwise operators by input shape (self GPU ms per step): which tensors the copies, adds and "
                    "casts move\n")
            for r in by_shape:
                f.write(f"{r['gpu_ms']:10.1f} ms {r['calls']:7.1f} calls  {r['op']:<22} {r['shapes']}\n")
    trainer.close()

    doc = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "args": vars(args), "gas": run.gas,
           "z3_leaf_modules": leaves,
           "m_comp": getattr(run.sampler, "m_comp", None),
           "timed": {"step_ms": step_ms, "segments_ms": timed, "calls_per_step": timed_calls},
           "profiled": prof_doc,
           "steps": [{"kind": k, "step": r.step, "wall_s": r.wall_s, "tokens": r.tokens,
                      "compute_ms": r.compute_ms, "micro_compute_ms": r.micro_compute_ms,
                      "mfu": (r.model_flops / r.wall_s / r.peak_tflops / 1e12) if r.peak_tflops else None}
                     for k, r in recs]}
    (out / "train_step_profile.json").write_text(json.dumps(doc, indent=1, default=str))
    if args.timed:
        print(f"\n{args.model} gas {run.gas}: timed steps (synchronised segments), {step_ms:.0f} ms per step")
        print("| segment | ms / step | calls / step | share |\n|---|---:|---:|---:|")
        for k, v in sorted(timed.items(), key=lambda kv: -kv[1]):
            print(f"| {k} | {v:.0f} | {timed_calls.get(k, 0):.0f} | {v / step_ms:.1%} |")
    if prof_doc:
        print(f"\nprofiled: {prof_doc['wall_ms_per_step']:.0f} ms per step, GPU busy {prof_doc['gpu_busy_ms_per_step']:.0f} ms "
              f"({prof_doc['gpu_busy_frac']:.1%})")
        for k, v in prof_doc.get("kernel_ms_per_step", {}).items():
            print(f"  kernels {k}: {v:.0f} ms per step")
        if "idle_gaps" in prof_doc:
            print("| idle gap <= ms | gaps / step | ms / step |\n|---|---:|---:|")
            for b in prof_doc["idle_gaps"]["buckets"]:
                print(f"| {b['le_ms']:g} | {b['count_per_step']:.0f} | {b['ms_per_step']:.0f} |")
            for g in prof_doc["idle_gaps"]["top"]:
                print(f"  gap {g['ms']:.1f} ms after {g['after']} before {g['before']}")
        if prof_doc["segments"]:
            print("| segment | host ms | kernel ms |\n|---|---:|---:|")
        for k, v in prof_doc["segments"].items():
            print(f"| {k} | {v['cpu_ms']:.0f} | {v['gpu_ms']:.0f} |")
    for kind, r in recs:
        m = (r.model_flops / r.wall_s / r.peak_tflops / 1e12) if r.peak_tflops else float("nan")
        print(f"{kind:8} step {r.step}: {r.wall_s:.2f} s, compute {sum(r.compute_ms) / 1e3:.2f} s, "
              f"{r.tokens / r.wall_s:,.0f} tokens/s, MFU {m:.1%}")
    print(f"wrote {out / 'train_step_profile.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
