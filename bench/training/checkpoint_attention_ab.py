"""The trainer with checkpointed blocks recomputing vs keeping their self-attention (``recompute.attention``).

``keep`` changes the plan (a checkpointed block is cheaper to recompute and holds 3 KiB more per token), so
the two arms cannot train the same micro-batches. They train the same SAMPLES: one whole epoch each, the
shipped ``zero3_adaptive.json`` with the H200 1.3B profile, metrics every step, and the compute budget and
micro-steps per step pinned (``--m-comp``, ``--gas``; the search's ``auto`` picks ~25-40 s micro-batches at
gas 1 under ``keep``, too long for a device call). Each arm runs exactly its own plan's epoch (``--steps``
= the plan's steps per epoch), so both see every sample once and the ratio of tokens/s is what a user gets.

    python bench/training/checkpoint_attention_ab.py plan [--world 1] [--out JSON]
        CPU: both arms' plans (meta model): epoch steps, tokens, checkpointed blocks, the planner's predicted
        compute and tokens/s (loop time counted), predicted peak activations: what the GPU arms should show
    python bench/training/checkpoint_attention_ab.py prepare --dir D [--num-samples 120]
        D/config_<arm>.json and the two train commands (log dirs D/runs/<arm>)
    python bench/training/checkpoint_attention_ab.py report --runs D/runs [--out JSON]
        tokens trained by each arm (one epoch: the same samples but each plan's tail left for the next epoch),
        then tokens/s over all steps (warm-up counted)
        and over steps >= 2, summed compute, MFU / HFU, peak memory, predicted / measured micro-step compute,
        and keep / recompute ratios

``bash bench/gpu/gpu_check.sh`` with ``STEPS=keepattn`` runs prepare, both arms and report in one call.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ln_modulate_e2e import _auto_or  # noqa: E402  ("auto" or a number, as the other pinned-plan benches)

CONFIG = ROOT / "launch" / "configs" / "zero3_adaptive.json"
PROFILE = "h200-wan2.1-1.3b"
ARMS = ("recompute", "keep")
TRAIN = ("{py} -m ds_adaptive.cli.train --deepspeed_config {cfg} --model {model} --steps {steps} --num-samples {n} "
         "--log-dir {runs}/{arm}")


def arm_config(arm: str, args, log_dir: str = "runs/ckpt_attention") -> dict:
    cfg = json.loads(Path(args.config).read_text())
    cfg["gradient_accumulation_steps"] = _auto_or(args.gas)
    cfg.get("adaptive_load", {}).get("sampler", {}).pop("global_batch", None)  # a pinned A/B: its own gas, not the shipped global batch
    s = cfg["adaptive_load"]["sampler"]
    s["profile"], s["m_comp"] = args.profile, _auto_or(args.m_comp)
    cfg["adaptive_load"].setdefault("recompute", {})["attention"] = arm
    if args.shapes:
        s["shapes"] = args.shapes
    cfg["adaptive_load"]["metrics"].update(interval=1, log_dir=log_dir)
    return cfg


def resolve_shapes(args, where: Path) -> None:
    """``--shapes long`` -> the long-video mix of bench/training/sparse_train_ab.py written to ``where``; a path -> absolute."""
    if args.shapes == "long":
        from sparse_train_ab import LONG_MIX

        where.mkdir(parents=True, exist_ok=True)
        path = where / "shapes_long.json"
        path.write_text(json.dumps({"description": "long-video mix (bench/training/sparse_train_ab.py)", "shapes": LONG_MIX}))
        args.shapes = str(path)
    elif args.shapes:
        args.shapes = str(Path(args.shapes).resolve())


def plan_arm(cfg: dict, model: str, num_samples: int, world: int, gpu_mem_gib: float) -> dict:
    """One arm's epoch as the trainer would plan it (meta model, no GPU): steps, tokens, checkpointed
    blocks, the planner's predicted compute and tokens/s, the largest predicted activation memory."""
    import numpy as np

    from ds_adaptive.planning.budget import predicted_times
    from ds_adaptive.simulation.simulate import loop_overhead_ms
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig

    rc = RunConfig.load(cfg, trainer={"model": model, "num_samples": num_samples, "steps": 1})
    run = build_run(rc, layout=Layout.for_world(world, 1), meta=True, gpu_mem_gib=gpu_mem_gib)
    plan, cost = run.sampler.plan, run.sampler.cost
    steps = run.sampler.steps_per_epoch
    times = predicted_times(plan, cost)                       # [micro_steps, dp] ms
    compute_ms = float(times.max(axis=1).sum())
    loop_ms = loop_overhead_ms(cost, times.shape[0], steps)
    sizes = plan.batch_sizes()
    tokens = int(sum(plan.shapes[int(u)].tokens * int(b) for u, b in zip(plan.batch_shape, sizes)))
    ckpt = plan.batch_ckpt if plan.batch_ckpt is not None else np.full(len(sizes), cost.profile_ckpt_blocks())
    mem = [float(cost.ckpt_memory(plan.shapes[int(u)], int(b), int(n)))
           for u, b, n in zip(plan.batch_shape, sizes, ckpt)]
    return {"gas": run.gas, "m_comp": run.sampler.params.m_comp, "steps_per_epoch": steps, "micro_batches": len(sizes),
            "tokens_per_rank_group": tokens, "predicted_compute_s": compute_ms / 1e3, "predicted_loop_s": loop_ms / 1e3,
            "predicted_tokens_per_s": tokens / ((compute_ms + loop_ms) / 1e3),
            "mean_checkpointed_blocks": float(np.mean(ckpt)), "max_activation_gib": max(mem)}


def cmd_plan(args) -> dict:
    import tempfile

    resolve_shapes(args, Path(tempfile.mkdtemp(prefix="ckpt_attention_plan_")))
    out = {}
    for arm in ARMS:
        out[arm] = plan_arm(arm_config(arm, args), args.model, args.num_samples, args.world, args.gpu_mem_gib)
    r, k = out["recompute"], out["keep"]
    print(f"{args.model}, world {args.world}, {args.num_samples} samples, m_comp {args.m_comp}, gas {args.gas} "
          f"(profile {args.profile}, shapes {args.shapes or 'the config default'}; planner predictions)")
    print(f"{'arm':10} {'gas':>4} {'m_comp ms':>10} {'steps':>6} {'micro':>6} {'ckpt blocks':>12} {'compute s':>10} "
          f"{'tok/s':>9} {'max act GiB':>12}")
    for arm, a in out.items():
        print(f"{arm:10} {a['gas']:4d} {a['m_comp'] or 0:10.0f} {a['steps_per_epoch']:6d} {a['micro_batches']:6d} "
              f"{a['mean_checkpointed_blocks']:12.1f} {a['predicted_compute_s']:10.1f} {a['predicted_tokens_per_s']:9.0f} "
              f"{a['max_activation_gib']:12.2f}")
    out["keep_over_recompute_predicted_tokens_per_s"] = k["predicted_tokens_per_s"] / r["predicted_tokens_per_s"]
    print(f"keep / recompute predicted tokens/s: {out['keep_over_recompute_predicted_tokens_per_s']:.3f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), **out}, indent=1))
    return out


def cmd_prepare(args) -> None:
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    resolve_shapes(args, d)
    for arm in ARMS:
        cfg = arm_config(arm, args, str(d / "runs" / arm))
        (d / f"config_{arm}.json").write_text(json.dumps(cfg, indent=1))
        steps = plan_arm(cfg, args.model, args.num_samples, 1, args.gpu_mem_gib)["steps_per_epoch"]
        print(TRAIN.format(py=sys.executable, cfg=d / f"config_{arm}.json", model=args.model, steps=steps,
                           n=args.num_samples, runs=d / "runs", arm=arm))


def cmd_report(args) -> dict:
    from ds_adaptive.calibration.trainer_runs import epoch_figures, epoch_ratios
    from ds_adaptive.core.ds_config import load_adaptive_config
    from ds_adaptive.planning.cost import CostModel

    runs = Path(args.runs)
    rows = {}
    for arm in ARMS:
        block = load_adaptive_config(runs.parent / f"config_{arm}.json")   # older configs: the moved keys too
        cost = CostModel(block.sampler.profile, checkpointing=block.recompute.blocks, checkpoint_attention=arm)
        rows[arm] = epoch_figures(runs / arm, cost)
    r, k = rows["recompute"], rows["keep"]
    if r["tokens"] != k["tokens"]:   # an epoch's tail samples that fill no whole step wait for the next epoch
        print(f"note: the arms trained {r['tokens']:,} vs {k['tokens']:,} tokens of the same {args.runs} epoch (each "
              f"plan leaves its own tail samples for the next epoch): {k['tokens'] / r['tokens'] - 1:+.1%}")
    print(f"{'arm':10} {'steps':>6} {'micro':>6} {'ckpt':>5} {'tok/s all':>10} {'tok/s >=2':>10} {'compute s':>10} "
          f"{'pred/meas':>9} {'MFU':>6} {'HFU':>6} {'peak GiB':>9}")
    for arm, a in rows.items():
        pm = a["predicted_over_measured_micro_step"]
        print(f"{arm:10} {a['steps']:6d} {a['micro_batches']:6d} {a['mean_checkpointed_blocks'] or 0:5.1f} "
              f"{a['tokens_per_s']:10.0f} {a['tokens_per_s_from_step_2']:10.0f} {a['compute_s']:10.1f} "
              f"{pm if pm is not None else float('nan'):9.3f} {100 * (a['mfu'] or 0):5.1f}% "
              f"{100 * (a['hfu'] or 0):5.1f}% {a['peak_mem_gib'] or 0:9.2f}")
    ratios = epoch_ratios(rows, "recompute", "keep")
    print("keep / recompute: tokens/s {tokens_per_s:.3f}x (steps >= 2: {tokens_per_s_from_step_2:.3f}x), "
          "compute {compute:.3f}x faster".format(**ratios))
    res = {"rows": rows, "keep_over_recompute": ratios}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("plan", "prepare"):
        a = sub.add_parser(name)
        a.add_argument("--model", default="wan2.1-1.3b")
        a.add_argument("--config", default=str(CONFIG), help="the base ds_config (default: the shipped job's)")
        a.add_argument("--profile", default=PROFILE, help="sampler.profile of both arms (a shipped name or a json)")
        a.add_argument("--shapes", default=None, help="sampler.shapes: a shape-mix json, or 'long' (81x480x832, 49x720x1280, 81x720x1280); default: "
                            "the model's mix")
        a.add_argument("--num-samples", type=int, default=120, help="the epoch both arms train")
        a.add_argument("--m-comp", default="auto", help="compute budget per micro-batch, ms (above the costliest sample's B=1 cost: ~9,900 for the default mix), or auto (the shipped job)")
        a.add_argument("--gas", default="auto", help="micro-steps per optimizer step, or auto (the shipped job)")
        a.add_argument("--gpu-mem-gib", type=float, default=139.8, help="the GPU planned for (H200)")
        if name == "plan":
            a.add_argument("--world", type=int, default=1)
            a.add_argument("--out", default=None)
        else:
            a.add_argument("--dir", required=True)
    b = sub.add_parser("report")
    b.add_argument("--runs", required=True)
    b.add_argument("--out", default=None)
    args = p.parse_args(argv)
    {"plan": cmd_plan, "prepare": cmd_prepare, "report": cmd_report}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
