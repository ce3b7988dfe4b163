"""``ds-adaptive simulate``: plan many ranks on paper with every sampler and score them (CV, balance, predicted
tokens/s); ``--sparse`` with per-layer x head densities (:mod:`ds_adaptive.simulation.simulate`,
:mod:`ds_adaptive.simulation.sparse`); ``--config DS_CONFIG``: a whole epoch planned as the trainer plans it with that
ds_config (global batch, micro-steps, budget search; :mod:`ds_adaptive.simulation.epoch`).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from ds_adaptive.core.config import SamplerConfig
from ds_adaptive.planning.devices import default_profile_name, resolve_auto_profile
from ds_adaptive.planning.profile import load_profile
from ds_adaptive.simulation.epoch import simulate_epoch
from ds_adaptive.simulation.simulate import plot, profile_distribution, simulate
from ds_adaptive.simulation import sparse as ss
from ds_adaptive.simulation.context_parallel import simulate_context_parallel
from ds_adaptive.core.contracts import load_densities


def _table(result: dict) -> str:
    rows = [f"{result['world']} GPUs, sp={result['sp']} (dp={result['dp']}), {result['steps']} steps, "
            f"profile {result['profile']}, m_mem {result['budgets']['m_mem_gib']:.1f} GiB, "
            f"m_comp {result['budgets']['m_comp']:.0f} {result['cost_unit']}",
            f"{'sampler':>8} {'CV mean':>8} {'CV p90':>8} {'balance':>8} {'tok/s':>12} {'samples':>8} "
            f"{'micro':>6} {'oversize':>8}"]
    for mode, r in result["samplers"].items():
        rows.append(f"{mode:>8} {r['compute_cv_mean']:>8.2%} {r['cv_p90']:>8.2%} {r['balance_efficiency']:>8.2%} "
                    f"{r['predicted_tokens_per_s']:>12.0f} {r['samples']:>8} {r['micro_steps']:>6} {r['oversize']:>8}")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="ds-adaptive simulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None, help="shape-distribution json (default: the profiled model's shipped mix)")
    ap.add_argument("--config", default=None, metavar="DS_CONFIG",
                    help="plan one whole epoch as the trainer would with this ds_config's adaptive_load block, "
                         "gradient_accumulation_steps and ZeRO stage (the global batch kept); prints samples and "
                         "tokens per optimizer step, plan time, peak memory, predicted CV and tokens/s")
    ap.add_argument("--num-samples", type=int, default=100_000,
                    help="--config: samples of the epoch, drawn from the shape mix (default: %(default)s)")
    ap.add_argument("--data", default=None, metavar="DIR",
                    help="--config: plan the shapes of this dataset directory's index instead of drawn ones")
    ap.add_argument("--model", default=None, help="--config: the trained model (default: the default model)")
    ap.add_argument("--profile", default=None, help=f"profile name or json path (default: {default_profile_name()}; "
                    "with --config: the config's sampler.profile)")
    ap.add_argument("--layers", type=int, default=None,
                    help="transformer blocks of the trained model (as the trainer's --layers; default: the "
                         "profile's): the profile is rescaled to that depth")
    ap.add_argument("--world", type=int, required=True, help="number of GPUs")
    ap.add_argument("--no-baseline", action="store_true", help="--config: do not plan the equal-token baseline")
    ap.add_argument("--sp", type=int, default=1, help="Ulysses degree (default 1)")
    ap.add_argument("--steps", type=int, default=50, help="optimizer steps to plan (default 50)")
    ap.add_argument("--micro-steps-per-step", type=int, default=1, help="gradient accumulation steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cost-model", choices=["calibrated", "power", "tokens"], default="calibrated")
    ap.add_argument("--p", type=float, default=1.5, help="exponent of --cost-model power")
    ap.add_argument("--m-mem", default="auto", help="memory budget GiB or auto")
    ap.add_argument("--m-comp", default="auto", help="compute budget (cost unit) or auto")
    ap.add_argument("--gpu-mem-gib", type=float, default=None, help="GPU capacity (default: the profile's)")
    ap.add_argument("--window", type=int, default=None, help="samples per DP rank per planning window")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--plot", default=None, help="write a PNG of CV per micro-step and per-rank load")
    ap.add_argument("--sparse", default=None, metavar="DENSITIES",
                    help="sparse attention: per layer x head densities ('synthetic' = drawn from 0.02-0.5, a density "
                         "json, or a run's metrics.jsonl); compares the dense-cost and the sparse-aware dual planner "
                         "timed with the sparse cost (ds_adaptive.simulation.sparse)")
    ap.add_argument("--efficiency", default=None,
                    help="with --sparse: the kernel's efficiency table (a `calibrate --sparse` json; default DSV's anchors)")
    ap.add_argument("--context-parallel", choices=["auto", "sequence"], default=None,
                    help="with --sparse (a density json, 'synthetic' or one density such as 0.1): per layer the hybrid "
                         "context-parallel mesh on --world GPUs and its predicted attention + comm time against Ulysses "
                         "only, at the lengths of --cp-tokens (ds_adaptive.simulation.context_parallel)")
    ap.add_argument("--cp-tokens", default="32760,75600,151200,302400", help="with --context-parallel: tokens per sample")
    ap.add_argument("--density-step", type=int, default=None,
                    help="with --sparse METRICS.jsonl: use the densities logged at or before this step")
    args = ap.parse_args(argv)
    if args.config:
        try:
            return _run_epoch(args)
        except (ValueError, FileNotFoundError) as exc:  # config, global batch, budgets: one message
            print(f"ds-adaptive simulate: error: {exc}", file=sys.stderr)
            return 2
    args.profile = args.profile or default_profile_name()
    budgets = {}
    for key in ("m_mem", "m_comp"):
        value = getattr(args, key)
        try:
            budgets[key] = value if value == "auto" else float(value)
        except ValueError:
            ap.error(f"--{key.replace('_', '-')} must be a number or 'auto', got {value!r}")
    try:
        return _run(args, budgets)
    except (ValueError, FileNotFoundError) as exc:  # shapes, profile, topology, budgets: one message
        print(f"ds-adaptive simulate: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, budgets: dict) -> int:
    upd = {"profile": args.profile, "cost_model": args.cost_model, "p": args.p,
           **budgets}
    if args.window:
        upd["window"] = args.window
    cfg = SamplerConfig(**upd)
    dist = profile_distribution(resolve_auto_profile(None)[0] if args.profile == "auto" else load_profile(args.profile),
                                args.shapes)
    if args.sparse and args.context_parallel:
        print(simulate_context_parallel(profile=args.profile, gpus=args.world, densities=args.sparse,
                                        tokens=[int(x) for x in args.cp_tokens.split(",")], mode=args.context_parallel,
                                        efficiency=args.efficiency, as_json=args.json))
        return 0
    if args.sparse:
        return _main_sparse(args, cfg, dist)
    res = simulate(world=args.world, sp=args.sp, steps=args.steps, seed=args.seed, dist=dist,
                   profile=args.profile, sampler_cfg=cfg, micro_steps_per_step=args.micro_steps_per_step,
                   gpu_mem_gib=args.gpu_mem_gib, keep_plans=bool(args.plot), num_layers=args.layers)
    if args.plot:
        plot(res, args.plot)
    res.pop("_plans", None)
    res.pop("_truth", None)
    if args.json:
        print(json.dumps(res))
    else:
        print(_table(res))
        if args.plot:
            print(f"wrote {args.plot}")
    return 0


def _epoch_table(r: dict) -> str:
    sps, tps = r["samples_per_step"], r["tokens_per_step"]
    gb = r["global_batch"]
    rows = [f"{r['world']} GPUs (dp {r['dp']}, sp {r['sp']}), {r['num_samples']:,} samples, profile {r['profile']}, "
            f"global batch {gb if gb else 'not set'}: {r['optimizer_steps']} optimizer steps of "
            f"{r['micro_steps_per_step']} micro-steps, m_comp {r['m_comp']}, planned in {r['plan_s']:.2f} s, "
            f"peak RSS {r['peak_rss_mb']:.0f} MB",
            f"  samples per step mean {sps['mean']:,.1f} (min {sps['min']:,}, median {sps['median']:,.0f}, max "
            f"{sps['max']:,}); tokens per step "
            f"mean {tps['mean']:,.0f} (min {tps['min']:,}, max {tps['max']:,})"]
    for name in ("dual", "tokens"):
        if name in r and r[name].get("error"):
            rows.append(f"  {name:>6}: {r[name]['error']}")
        elif name in r:
            rows.append(f"  {name:>6}: predicted CV {r[name]['predicted_cv']:.2%}, "
                        f"{r[name]['predicted_tokens_per_s']:,.0f} tokens/s")
    return "\n".join(rows)


def _run_epoch(args: argparse.Namespace) -> int:
    res = simulate_epoch(args.config, world=args.world, num_samples=args.num_samples, sp=args.sp, model=args.model,
                         shapes=args.shapes, seed=args.seed, gpu_mem_gib=args.gpu_mem_gib, profile=args.profile,
                         baseline=not args.no_baseline, data=args.data)
    print(json.dumps(res) if args.json else _epoch_table(res))
    return 0


def _main_sparse(args, cfg: SamplerConfig, dist) -> int:

    if args.layers is not None:
        raise SystemExit("--sparse with --layers: give densities of the reduced model and a profile of its depth")
    dens = args.sparse if args.sparse == "synthetic" else load_densities(args.sparse, step=args.density_step)
    res = ss.simulate_sparse(world=args.world, sp=args.sp, steps=args.steps, seed=args.seed, densities=dens,
                             efficiency=args.efficiency, dist=dist, profile=args.profile, sampler_cfg=cfg,
                             micro_steps_per_step=args.micro_steps_per_step, gpu_mem_gib=args.gpu_mem_gib,
                             keep_plans=bool(args.plot))
    if args.plot:
        ss.plot(res, args.plot)
    res.pop("_plans", None)
    res.pop("_truths", None)
    print(json.dumps(res) if args.json else ss.table(res) + (f"\nwrote {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
