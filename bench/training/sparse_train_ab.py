"""Sparse attention in the real training loop: dense vs sparse on the SAME pinned plan, through the trainer.

For each shape mix, arms built the way users run them (``build_run`` + ``Trainer``; one process, one arm
after the other, each freed before the next) from one config that differs only in
``adaptive_load.sparse_attention``:

* ``dense``: no sparse attention;
* ``sparse``: ``forced_density`` (default 0.1), first and last layer dense, ``rebalance: off``: the
  sampler keeps the dense plan, so this arm trains exactly the dense arm's micro-batches (checked);
* ``replan``: the same with ``rebalance: step``: the sampler re-plans with the sparse cost (the chosen
  backend's curve and the pay decision) from step 2 on (other micro-batches: compared by tokens/s);
* ``profiled`` (not by default): the pinned sparse arm with stage 1 for one step and profiling (exact
  logits of sampled rows, density all-reduce) every ``--profile-interval`` steps in stage 2: the
  profiling steps' extra time, amortised over the default interval (50), is the stage-2 overhead.

Mixes: ``default`` (the shipped synthetic distribution, ``ds_adaptive/data/default_shapes.json``) and
``long`` (81x480x832, 49x720x1280 and 81x720x1280 videos, equal weights: 32,760 / 46,800 / 75,600 tokens).

Counted honestly: every arm runs ``--steps`` optimizer steps; tokens/s over steps 2..N, and "with
warm-up": all tokens of steps 1..N over their time plus the sparse backend's warm-up (its compile for
the plan's (B, S) pairs, before step 1; the engine build is the same work in every arm and is left
out), and "+ block fusion's compile": that plus block fusion's warm-up (``adaptive_load.block_fusion``, on
in the shipped config), charged to every arm of a mix at the largest any arm paid (the arms share one
process, so only the first compiles; a user pays it once per run, dense or sparse). Per arm: compile /
warm-up seconds, compiled graphs, per-shape summed compute of the same micro-batches (sparse / dense),
the first micro-step of each new (shape, B) pair (no such step may be slower sparse than dense), time
per step outside compute, the selection time the runtime measured
and the cost's, and predicted vs measured micro-step compute (the plan's cost model; for the sparse arms
with the sparse cost at the densities that ran): per shape, its ratio, whether it is within 10%, and the
ratio over the dense arm's on the same micro-batches (the sparse cost's own error).
The comparison and the prediction check are ``ds_adaptive.simulation.sparse_ab``.

GPU budget (one H200, ~8 min: both mixes, three arms): Wan 1.3B at ``--layers 8`` (of its 30 blocks:
the attention share of a block, and so the sparse/dense ratio of the blocks, is the full model's; the
embed/head and the optimizer step are a larger share than at full depth, so the tokens/s ratios are
conservative), ``--gas 1`` micro-step per optimizer step (a step is one micro-batch: 0.6-2 s),
``--steps 41`` (40 counted after step 1), bf16, ZeRO-3, activation checkpointing as the shipped config
plans it (auto), budgets from the calibrated H200 profile rescaled to 8 blocks (``--plan-only``
predicts ~270 s of compute for the six arms; it prints every arm's predicted time on the meta
device, no GPU, to choose these). Full depth: ``--layers 30 --gas 6`` (~4x the time).

    python bench/training/sparse_train_ab.py --out $OUT/sparse_train_ab.json              # H200, ~8 min
    python bench/training/sparse_train_ab.py --plan-only --out /tmp/ab_plan.json           # CPU: predicted times
    python bench/training/sparse_train_ab.py --plan-only --same-plan RESULT.json ...        # CPU: is it the plan that ran?
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from ds_adaptive.simulation.sparse_ab import (compare, merge_results, prediction_error, same_plan_status,  # noqa: E402
                                              table)

CONFIG = ROOT / "launch" / "configs" / "zero3_adaptive.json"
LONG_MIX = [{"frames": 81, "height": 480, "width": 832, "weight": 1.0},
            {"frames": 49, "height": 720, "width": 1280, "weight": 1.0},
            {"frames": 81, "height": 720, "width": 1280, "weight": 1.0}]
ARMS = ("dense", "sparse", "replan", "profiled")
DEFAULT_ARMS = ("dense", "sparse", "replan")


def arm_config(args, mix: str, arm: str, out_dir: Path) -> dict:
    cfg = json.loads(Path(args.config).read_text())
    cfg["gradient_accumulation_steps"] = args.gas
    cfg.get("adaptive_load", {}).get("sampler", {}).pop("global_batch", None)  # a pinned A/B: its own gas, not the shipped global batch
    al = cfg["adaptive_load"]
    al["fused_ln_modulate"] = args.fused_ln
    al["sampler"]["profile"] = args.profile
    if args.m_comp is not None:  # a smaller budget: shorter micro-steps, so --steps fits a device call at full depth
        al["sampler"]["m_comp"] = args.m_comp
    if mix == "long":
        path = out_dir / "shapes_long.json"
        path.write_text(json.dumps({"description": "sparse_train_ab.py long-video mix", "shapes": LONG_MIX}))
        al["sampler"]["shapes"] = str(path)
    elif mix == "cpu":  # the CPU smoke test's small shapes
        al["sampler"]["shapes"] = str(ROOT / "launch" / "configs" / "shapes_cpu.json")
    al["metrics"] = {"interval": 1, "log_dir": str(out_dir / f"{mix}_{arm}"), "tensorboard": False, "jsonl": True}
    if arm != "dense":
        al["sparse_attention"] = {"enabled": True, "forced_density": args.density, "backend": args.backend,
                                  "rebalance": "step" if arm == "replan" else "off", **args.sparse_extra}
    if arm == "profiled":  # stage 1 for one step, then forced sparse with profiling every --profile-interval
        al["sparse_attention"].update(forced_after_warmup=True, warmup_steps=1, loss_threshold=0.0,
                                      profile_interval=args.profile_interval)
    return cfg


def run_config(args, mix: str, arm: str, out_dir: Path):
    from ds_adaptive.training.run_config import RunConfig

    return RunConfig.load(arm_config(args, mix, arm, out_dir),
                          trainer={"model": args.model, "layers": args.layers, "steps": args.steps, "seed": args.seed,
                                   "num_samples": args.num_samples, "compute_timing": True})


def micro_log(run, cfg, steps: list[dict], arm: str) -> list[dict]:
    """Per micro-step: step, micro, shape, tokens, B, checkpointed blocks, measured compute ms. From the
    trainer's ``memory.jsonl`` (written on a GPU); else from the plan (pinned arms only)."""
    mem = Path(cfg.adaptive_load.metrics.log_dir) / "memory.jsonl"
    info = {}
    if mem.exists():
        for line in mem.read_text().splitlines():
            m = json.loads(line)
            info[(m["step"], m["micro"])] = (m["shape"], m["tokens"], m["B"], m["ckpt_blocks"])
    elif arm != "replan":
        for j, (shape, b, ck) in enumerate(plan_micro(run, run.gas * len(steps))):
            info[(j // run.gas + 1, j % run.gas)] = (str(shape), shape.tokens, b, ck)
    rows = []
    for st in steps:
        for i, ms in enumerate(st["micro_compute_ms"]):
            shape, tokens, b, ck = info.get((st["step"], i), (None, None, None, None))
            rows.append({"step": st["step"], "micro": i, "shape": shape, "tokens": tokens, "B": b, "ckpt": ck,
                         "compute_ms": ms})
    return rows


def plan_micro(run, n_micro: int) -> list[tuple]:
    """(shape, B, checkpointed blocks) of the first ``n_micro`` micro-steps of the sampler's plan (dp = 1)."""
    plan = run.sampler.plan
    ckpt = plan.batch_ckpt
    out = []
    for j in range(min(n_micro, len(plan.batch_shape))):
        b = int(plan.batch_offsets[j + 1] - plan.batch_offsets[j])
        out.append((plan.shapes[int(plan.batch_shape[j])], b, int(ckpt[j]) if ckpt is not None else None))
    return out


def predicted_ms(run, micro: list[tuple], sparse) -> list[float]:
    """The cost model's compute per micro-step ``(shape or tokens, B, checkpointed blocks)``: dense, or
    with ``sparse`` (a SparseAttentionCost: the runtime's decision at the densities that ran)."""
    from ds_adaptive.planning.cost import CostModel

    cost = run.cost
    if cost.mode != "calibrated":  # predictions in ms need the calibrated model (the plan's may be another)
        cost = CostModel(cost.profile, sp=cost.sp, num_heads=cost.num_heads, checkpointing=cost.checkpointing)
    cost = cost if sparse is None else cost.with_sparse(sparse)
    layers = cost.num_layers
    return [float(cost.ckpt_cost(shape, b, layers if ck is None else ck)) for shape, b, ck in micro]


def predicted_select_ms(run, decision, tokens: int, batch: int) -> float:
    """The sparse cost's selection time of one micro-batch (every layer that runs sparse): its fixed part per
    call plus ``B`` x the per-sample part."""
    n = run.cost.padded_tokens(tokens)
    return float(batch * decision.selection_ms(n, run.cost.sp, run.cost.num_heads) + decision.selection_call_ms(n, run.cost.sp))


def run_arm(args, mix: str, arm: str, out_dir: Path, device) -> dict:
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.trainer import Trainer

    cfg = run_config(args, mix, arm, out_dir)
    import shutil
    shutil.rmtree(cfg.adaptive_load.metrics.log_dir, ignore_errors=True)  # memory.jsonl appends
    # what earlier arms left allocated (0 with Trainer.close; the memory model does not count it)
    left_gib = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    if left_gib > 0.25:
        print(f"  {mix}/{arm}: warning: {left_gib:.2f} GiB still allocated from earlier arms", flush=True)
    t0 = time.perf_counter()
    run = build_run(cfg, layout=Layout.detect(1, ds_config=cfg.ds_config), device=device)
    trainer = Trainer(run)  # engine, and the sparse backend's warm-up (compile) for the plan's (B, S) pairs
    t_ready = time.perf_counter()
    rt = run.sparse
    plan_before = plan_micro(run, run.gas)  # step 1's micro-batches (a re-plan changes the later ones)
    steps = []
    for step in range(1, args.steps + 1):
        profiling = rt is not None and rt.schedule.profile_now()
        rec = trainer.train_step()
        steps.append({"step": step, "profiled": profiling, "tokens": rec.tokens, "samples": rec.samples, "wall_s": rec.wall_s,
                      "compute_ms": rec.compute_ms[0], "micro_compute_ms": [c[0] for c in rec.micro_compute_ms],
                      "select_ms_per_micro": None if rt is None else rt.metrics()["sparse/select_ms"],
                      "select_ms_predicted_per_micro": None if rt is None else rt.metrics()["sparse/select_ms_predicted"]})
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(f"  {mix}/{arm} step {step}/{args.steps}: {rec.tokens / rec.wall_s:,.0f} tokens/s, "
                  f"{rec.wall_s:.2f} s", flush=True)
    t_end = time.perf_counter()
    micro_rows = micro_log(run, cfg, steps, arm)
    # predicted compute per micro-step: the plan's dense cost, or the sparse cost at the densities that ran
    known = [r for r in micro_rows if r["tokens"] is not None]
    for r, p in zip(known, predicted_ms(run, [(r["tokens"], r["B"], r["ckpt"]) for r in known],
                                        None if rt is None else rt.decision)):
        r["predicted_ms"] = p
    if rt is not None and rt.decision is not None:  # the selection: the runtime's CUDA-event time (per micro-batch, summed over layers)
        sel = {st["step"]: st["select_ms_per_micro"] for st in steps}
        for r in known:
            r["select_ms"] = sel.get(r["step"])
            r["predicted_select_ms"] = predicted_select_ms(run, rt.decision, r["tokens"], r["B"])
    sa = None
    if trainer.sparse is not None:
        summary: dict = {}
        trainer.sparse.finish(summary)
        sa = summary["sparse_attention"]
    # block fusion's compile (in the engine build, before step 1, and for later plans' new pairs); an arm after the
    # first finds the first arm's graphs in this process, so compare() charges every arm the largest of a mix
    fz = None if trainer.fusion is None else trainer.fusion.summary()
    fusion_s = None if fz is None else fz["warmup_s"] + fz["later_warmup_s"]
    trainer.close()   # frees the engine: ZeRO-3 keeps every engine of a process alive otherwise
    out = {"mix": mix, "arm": arm, "allocated_gib_at_start": left_gib, "build_s": t_ready - t0, "train_s": t_end - t_ready,
           "fusion_warmup_s": fusion_s, "gas": run.gas,
           "layers": run.model_config.num_layers, "plan_step1": [(str(s), b, c) for s, b, c in plan_before],
           "steps": steps, "micro": micro_rows,
           "loop_overheads_ms": {"micro_step": run.cost.profile.micro_step_overhead_ms,
                                 "optimizer_step": run.cost.profile.optimizer_step_overhead_ms},
           "warmup_s": None if rt is None else rt.warmup_s,
           "backend": None if sa is None else sa.get("backend"), "layer_calls": None if sa is None else sa.get("layer_calls"),
           "sparse_layers": None if rt is None else rt.schedule.sparse_layers(),
           "decision": None if rt is None or rt.decision is None else rt.decision.describe()}
    del trainer, run, rt
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def plan_only(args) -> int:
    """Predicted step times of every arm's plan (meta device, no GPU): to choose layers / gas / steps."""
    from ds_adaptive.simulation.simulate import loop_overhead_ms
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run

    out = {}
    total = 0.0
    recorded = {(a["mix"], a["arm"]): a for p in args.same_plan or [] for a in json.loads(Path(p).read_text())["arms"]}
    for mix in args.mixes:
        for arm in args.arms:
            cfg = run_config(args, mix, arm, Path(args.out).parent)
            run = build_run(cfg, layout=Layout.for_world(1, 1), meta=True, gpu_mem_gib=args.gpu_mem_gib)
            if arm == "replan":  # what the trainer hands the sampler after step 1: the densities that run
                run.sampler.update_densities(run.sparse.decision.densities, at_step=1)
            micro = plan_micro(run, run.gas * args.steps)
            same = same_plan_status(recorded.get((mix, arm)), micro) if args.same_plan else None
            sparse = None if run.sparse is None else run.sparse.decision
            ms = predicted_ms(run, micro, sparse)
            pairs = sorted({(str(s), b) for s, b, _ in micro})
            step_s = sum(ms) / 1e3 / args.steps
            total += sum(ms) / 1e3
            tokens = sum(s.tokens * b for s, b, _ in micro)
            # with the training loop's per-micro-step and per-optimizer-step time, as the planner predicts a run
            loop_s = loop_overhead_ms(run.cost, len(micro), len(micro) // run.gas) / 1e3
            tps = tokens / (sum(ms) / 1e3 + loop_s)
            out[f"{mix}/{arm}"] = {"gas": run.gas, "predicted_compute_s": sum(ms) / 1e3, "step_s": step_s,
                                   "predicted_loop_s": loop_s, "predicted_tokens_per_s": tps,
                                   "predicted_compute_tokens_per_s": tokens / (sum(ms) / 1e3),
                                   "distinct_shape_B_pairs": len(pairs), "tokens": tokens,
                                   "density_updates": list(getattr(run.sampler, "density_updates", []))}
            if same is not None:
                out[f"{mix}/{arm}"]["same_plan_as_recorded"] = same
            print(f"{mix:>7}/{arm:<6}: gas {run.gas}, predicted compute {sum(ms) / 1e3:7.1f} s over {args.steps} steps "
                  f"({step_s:.2f} s/step), {len(pairs)} distinct (shape, B) pairs, {tokens / 1e6:.2f}M tokens: "
                  f"{tokens / (sum(ms) / 1e3) / 1e3:.1f}k tokens/s compute, {tps / 1e3:.1f}k with the loop's "
                  f"{loop_s:.1f} s" + ("" if same is None else f"; the recorded run's plan: {same}"), flush=True)
    print(f"predicted compute of all arms: {total:.0f} s (plus per arm ~15-30 s engine build and step overheads)")
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mixes", nargs="+", default=["default", "long"], choices=["default", "long", "cpu"])
    ap.add_argument("--config", default=str(CONFIG), help="the base ds_config (CPU smoke: launch/configs/cpu_tiny.json)")
    ap.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS))
    ap.add_argument("--profile-interval", type=int, default=10, help="the profiled arm's profile_interval")
    ap.add_argument("--model", default="wan2.1-1.3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--gas", type=int, default=1)
    ap.add_argument("--m-comp", type=float, default=None,
                    help="the sampler's compute budget per micro-batch, ms (default: the config's, auto); samples "
                         "costlier than it run alone (B = 1)")
    ap.add_argument("--steps", type=int, default=41)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--profile", default="auto")
    ap.add_argument("--fused-ln", action="store_true", help="the fused LN-modulate op in every arm (JIT build)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-samples", type=int, default=20000)
    ap.add_argument("--gpu-mem-gib", type=float, default=139.8, help="--plan-only: the GPU to plan for")
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--same-plan", nargs="+", default=None, metavar="JSON",
                    help="--plan-only: say whether each arm's plan is, micro-step by micro-step (shape, B, "
                         "checkpointed blocks), the plan a recorded run of it ran (result files of earlier runs)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="combine result files of arms run in separate calls (one device, the same args but "
                         "--arms) into --out, with the comparisons and the table; runs nothing")
    ap.add_argument("--sparse-json", default="{}", help="more sparse_attention keys for the sparse arms (JSON)")
    args = ap.parse_args(argv)
    args.sparse_extra = json.loads(args.sparse_json)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.plan_only:
        return plan_only(args)
    if args.merge:
        return merge(args.merge, out)
    from ds_adaptive.planning.memory import configure_allocator
    from ds_adaptive.training.engine import init_distributed

    print(configure_allocator())  # as the trainer's main does, before the first CUDA allocation (the shipped
    # plan runs at ~95% of memory: without expandable segments the dense arm OOMed at step 6 with 24 GiB reserved)
    _, _, device = init_distributed(0)
    runs_dir = out.parent / (out.stem + "_runs")
    runs_dir.mkdir(parents=True, exist_ok=True)
    doc = {"args": vars(args), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "arms": [], "compare": {}}
    t_all = time.perf_counter()
    for mix in args.mixes:
        arms = {}
        for arm in args.arms:
            arms[arm] = run_arm(args, mix, arm, runs_dir, device)
            arms[arm]["prediction"] = prediction_error(arms[arm])
            doc["arms"].append(arms[arm])
            out.write_text(json.dumps(doc, indent=1, default=str))
        if "dense" in arms:
            doc["compare"][mix] = {a: compare(arms["dense"], arms[a]) for a in arms if a != "dense"}
        out.write_text(json.dumps(doc, indent=1, default=str))
    doc["total_s"] = time.perf_counter() - t_all
    out.write_text(json.dumps(doc, indent=1, default=str))
    print_table(doc)
    print(f"wrote {out} ({doc['total_s']:.0f} s)")
    return 0


def merge(paths: list, out: Path) -> int:
    """One document from the arms of several result files (one device: the merged files must name it)."""
    try:
        doc = merge_results([json.loads(Path(p).read_text()) for p in paths], paths)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    out.write_text(json.dumps(doc, indent=1, default=str))
    print_table(doc)
    print(f"wrote {out} (merged {len(paths)} files)")
    return 0


def print_table(doc: dict) -> None:
    print(table(doc))


if __name__ == "__main__":
    sys.exit(main())
