#!/usr/bin/env python
"""At scale: AdaptiveLoad vs the equal-token baseline on 8 (or 4) GPUs, full depth, 3 seeds,
and Wan 14B with Ulysses SP=4 x DP=2. A thin layer over ``bench/training/e2e.py`` (which runs one arm with the
real trainer and aggregates it): this file holds the two configurations, splits them into device
commands of one (arm, seed) each, predicts their wall time and gain, and summarises the runs.

    python bench/training/scale.py plan --num-gpus 8            # commands, predicted wall time and gain; runs nothing
    python bench/training/scale.py args wan1.3b --arm adaptive --seed 0 --num-gpus 8   # bench/training/e2e.py arguments of one run
    python bench/training/scale.py summary --out bench/out/scale   # table over seeds from <out>/<config>/seed<S>/<arm>/e2e.json

Fairness (docs/E2E.md "At scale"): every arm of a configuration trains one epoch of the SAME samples
(``--min-steps`` grows the dataset until every arm plans >= 50 optimizer steps after the warm-up and
none drops a tail sample), with the SAME gradient accumulation (1) in every arm, and the dual arms'
compute budget chosen to bring their optimizer steps as close to the baseline's as the memory budget
allows (``--dual-m-comp match``); the remaining step difference is printed, never hidden.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e  # noqa: E402  (bench/training/e2e.py)
from ds_adaptive.simulation.curves import loss_curve_gap  # noqa: E402
from ds_adaptive.simulation.e2e import fmt, plan_tokens_per_s  # noqa: E402

# Per configuration: bench/training/e2e.py arguments shared by every arm and seed. Memory budget "1x" (one longest
# video per micro-batch) keeps a full-depth step near the costliest sample's time (~10 s at 1.3B, ~13 s at
# 14B SP=4 on the H100 profile), so that >= 50 steps of one arm fit one 10-minute device command.
CONFIGS = {
    "wan1.3b": {"model": "wan2.1-1.3b", "layers": 30, "sp": 1, "profile": "{gpu}-wan2.1-1.3b",
                "arms": ["baseline", "adaptive", "adaptive_sparse"], "m_mem": "1x", "num_samples": 400,
                "startup_s": 60.0},
    "wan14b": {"model": "wan2.1-14b", "layers": 40, "sp": 4, "profile": "{gpu}-wan2.1-14b",
               "arms": ["baseline", "adaptive"], "m_mem": "1x", "num_samples": 400, "startup_s": 120.0},
}
SEEDS = (0, 1, 2)
MIN_STEPS = 50
COMMAND_LIMIT_S = 600.0
SETUP_S = 60.0           # per command: wheelhouse install + loading the cached fused op (cold: +~90 s build)
SIM_WORLDS = (8, 16)


def e2e_args(config: str, *, num_gpus: int, seed: int, arms: list[str], out: str, profile: str | None = None,
             gpu: str = "h100") -> list[str]:
    """``profile``: a profile (name or json) for every arm; else the config's shipped profile of ``gpu``
    (h100 | h200)."""
    c = CONFIGS[config]
    if c["sp"] > 1 and num_gpus % c["sp"]:
        raise SystemExit(f"bench/training/scale.py: {config} needs a multiple of sp={c['sp']} GPUs, got {num_gpus}")
    return ["--device", "cuda", "--num-gpus", str(num_gpus), "--model", c["model"], "--layers", str(c["layers"]),
            "--sp", str(c["sp"]), "--profile", profile or c["profile"].format(gpu=gpu), "--m-mem", c["m_mem"],
            "--num-samples", str(c["num_samples"]), "--min-steps", str(MIN_STEPS), "--gas", "1", "--dual-gas", "1",
            "--dual-m-comp", "match", "--seed", str(seed), "--arms", ",".join(arms),
            "--startup-s", str(c["startup_s"]), "--sim-worlds=", "--budget-s", str(COMMAND_LIMIT_S - SETUP_S),
            "--out", out]


def run_args(config: str, *, num_gpus: int, seed: int, arm: str, out: str, profile: str | None = None,
             gpu: str = "h100") -> list[str]:
    """bench/training/e2e.py arguments of ONE arm's run. The dataset size is resolved here with ALL the config's arms
    (``--min-steps`` over every arm), then fixed (``--num-samples N``, no ``--min-steps``): an arm run alone
    trains exactly the samples the other arms of its seed train."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        with _quiet(False):
            e2e.main(e2e_args(config, num_gpus=num_gpus, seed=seed, arms=CONFIGS[config]["arms"], out=tmp,
                              profile=profile, gpu=gpu) + ["--plan-only", "--work-dir", tmp])
        n = json.loads((Path(tmp) / "e2e_plan.json").read_text())["settings"]["num_samples"]
    args = e2e_args(config, num_gpus=num_gpus, seed=seed, arms=[arm], out=out, profile=profile, gpu=gpu)
    i = args.index("--num-samples")
    args[i + 1] = str(n)
    j = args.index("--min-steps")
    return args[:j] + args[j + 2:]


def simulate_at(plan_report: dict, world: int, sp: int, steps: int = 50) -> dict:
    """``ds_adaptive.simulation.simulate`` at ``world`` GPUs with the run's profile, shape mix, memory budget and
    the dual arm's compute budget (gas 1, as the runs)."""
    from ds_adaptive.simulation.simulate import simulate
    from ds_adaptive.core.config import SamplerConfig
    from ds_adaptive.core.shapes import load_shape_distribution

    dual = next((p for p in plan_report["plans"].values() if p["mode"] == "dual"), None)
    m_comp = dual["m_comp"] if dual else "auto"
    cfg = SamplerConfig(profile=plan_report["profile"]["path"], m_mem=plan_report["budgets"]["m_mem_gib"],
                        m_comp=m_comp, seed=plan_report["settings"]["seed"])
    r = simulate(world=world, sp=sp, steps=steps, seed=plan_report["settings"]["seed"],
                 dist=load_shape_distribution(plan_report["settings"]["shapes"]), profile=cfg.profile, sampler_cfg=cfg,
                 micro_steps_per_step=1, samplers=("tokens", "dual"))
    t, d = r["samplers"]["tokens"], r["samplers"]["dual"]
    return {"world": world, "sp": sp, "ratio_dual_over_tokens": d["predicted_tokens_per_s"] / t["predicted_tokens_per_s"],
            "cv": {"tokens": t["compute_cv_mean"], "dual": d["compute_cv_mean"]}}


def plan(a: argparse.Namespace) -> int:
    out = Path(a.out)
    rows, sims, commands = [], {}, []
    for config in a.configs.split(","):
        c = CONFIGS[config]
        for seed in SEEDS:
            d = out / "plan" / config / f"seed{seed}"
            args = e2e_args(config, num_gpus=a.num_gpus, seed=seed, arms=c["arms"], out=str(d),
                            profile=a.profile, gpu=a.gpu) + ["--plan-only", "--work-dir", str(d / "runs")]
            with _quiet(a.verbose):
                e2e.main(args)
            rep = json.loads((d / "e2e_plan.json").read_text())
            base = rep["plans"]["baseline"]
            for arm in c["arms"]:
                p, t = rep["plans"][arm], rep["predicted_time"][arm]
                wall = SETUP_S + t["total_s"]
                w = rep["settings"]["warmup_steps"]
                rows.append({"config": config, "seed": seed, "arm": arm, "gas": p["gas"], "steps": p["steps"],
                             "steps_vs_base": p["steps"] - base["steps"], "samples": p["samples"],
                             "dropped": p["tail_dropped"] + p["oversize"], "m_comp_ms": p["m_comp"],
                             "num_samples": rep["settings"]["num_samples"],
                             "predicted_ratio": plan_tokens_per_s(p, w) / plan_tokens_per_s(base, w),
                             "predicted_cv": float(np.mean(p["predicted_cv"][w * p["gas"]:])),
                             "predicted_command_s": wall, "fits": wall <= COMMAND_LIMIT_S})
                commands.append({"config": config, "seed": seed, "arm": arm, "predicted_s": wall,
                                 "command": f"GPU_PROFILES={a.gpu} bash bench/gpu/scale.sh {config} {arm} {seed}"})
            if seed == SEEDS[0]:
                sims[config] = [simulate_at(rep, w_, c["sp"]) for w_ in SIM_WORLDS]
    report = {"num_gpus": a.num_gpus, "gpu_profiles": a.profile or a.gpu, "min_steps": MIN_STEPS, "command_limit_s": COMMAND_LIMIT_S, "setup_s": SETUP_S,
              "rows": rows, "simulated": sims, "commands": commands,
              "total_predicted_s": sum(x["predicted_s"] for x in commands)}
    (out / "scale_plan.json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    print(plan_table(report))
    return 0


def plan_table(r: dict) -> str:
    lines = [f"At-scale plan on {r['num_gpus']} GPUs: one device command per (config, arm, seed), >= {r['min_steps']} "
             f"optimizer steps after warm-up, gas 1 in every arm; predicted from the {r['gpu_profiles']} profiles "
             f"(+{r['setup_s']:.0f} s setup per command; limit {r['command_limit_s']:.0f} s)",
             f"{'config':<9}{'seed':>5}{'arm':>17}{'samples':>8}{'drop':>5}{'steps':>6}{'d steps':>8}{'m_comp s':>9}"
             f"{'pred x':>8}{'pred CV':>8}{'cmd s':>7}{'fits':>6}"]
    for x in r["rows"]:
        mc = x["m_comp_ms"]
        lines.append(f"{x['config']:<9}{x['seed']:>5}{x['arm']:>17}{x['samples']:>8}{x['dropped']:>5}{x['steps']:>6}"
                     f"{x['steps_vs_base']:>+8d}{(mc / 1e3 if isinstance(mc, (int, float)) else 0):>9.2f}"
                     f"{x['predicted_ratio']:>8.3f}{fmt(x['predicted_cv'], pct=True):>8}"
                     f"{x['predicted_command_s']:>7.0f}{'yes' if x['fits'] else 'NO':>6}")
    lines.append(f"total predicted device time: {r['total_predicted_s']:.0f} s in {len(r['commands'])} commands")
    lines.append("Simulator (ds_adaptive.simulation.simulate, 50 steps, same profile / budgets, gas 1): dual/tokens tokens/s")
    for config, sims in r["simulated"].items():
        lines.append("  " + config + ": " + ", ".join(
            f"{s['world']} GPUs (sp {s['sp']}) {s['ratio_dual_over_tokens']:.3f}x (CV {fmt(s['cv']['tokens'], pct=True)}"
            f" -> {fmt(s['cv']['dual'], pct=True)})" for s in sims))
    return "\n".join(lines)


def summary(a: argparse.Namespace) -> int:
    out = Path(a.out)
    runs: dict = {}
    for path in sorted(out.glob("*/seed*/*/e2e.json")):
        rep = json.loads(path.read_text())
        config, seed = path.parts[-4], int(path.parts[-3][4:])
        e2e.finish(rep, path.parent, final=False)
        for name, arm in rep["arms"].items():
            if arm.get("ok"):
                runs.setdefault(config, {}).setdefault(seed, {})[name] = {
                    "arm": arm, "plan": rep["plans"][name], "warmup": rep["settings"]["warmup_steps"],
                    "device": rep["environment"].get("device_name"), "commit": rep["environment"].get("git_commit")}
    res = {}
    for config, seeds in runs.items():
        res[config] = {}
        for name in sorted({n for s in seeds.values() for n in s}):
            pairs = [(s[name], s["baseline"]) for s in seeds.values() if name in s and "baseline" in s]
            if not pairs:
                continue
            ratio = [x["arm"]["tokens_per_s"] / b["arm"]["tokens_per_s"] for x, b in pairs]
            pred = [plan_tokens_per_s(x["plan"], x["warmup"]) / plan_tokens_per_s(b["plan"], b["warmup"]) for x, b in pairs]
            res[config][name] = {
                "seeds": len(pairs), "ratio_mean": float(np.mean(ratio)),
                "ratio_sd": float(np.std(ratio, ddof=1)) if len(ratio) > 1 else float("nan"),
                "predicted_ratio_mean": float(np.mean(pred)),
                "measured_over_predicted_gain": float((np.mean(ratio) - 1) / (np.mean(pred) - 1)) if np.mean(pred) != 1 else float("nan"),
                "cv_step_mean": float(np.mean([x["arm"]["cv_step"] for x, _ in pairs])),
                "loss_curve_gap": float(np.mean([loss_curve_gap(x["arm"], b["arm"]) for x, b in pairs])),
                "loss_last20_rel": float(np.mean([(x["arm"]["loss_last20"] - b["arm"]["loss_last20"]) / b["arm"]["loss_last20"]
                                                  for x, b in pairs])),
                "steps": [x["arm"]["steps"] for x, _ in pairs], "base_steps": [b["arm"]["steps"] for _, b in pairs],
                "peak_vram_gib_per_rank": np.max([x["arm"]["peak_mem_gib_per_rank"] for x, _ in pairs], axis=0).tolist(),
                "devices": sorted({str(x["device"]) for x, _ in pairs}), "commits": sorted({str(x["commit"]) for x, _ in pairs}),
            }
    (out / "scale_summary.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = [f"{'config':<9}{'arm':>17}{'seeds':>6}{'tok/s x base':>16}{'pred x':>8}{'meas/pred gain':>15}{'CV_step':>9}"
             f"{'loss gap':>9}{'last20':>8}{'steps/base':>11}  peak GiB per rank"]
    for config, arms in res.items():
        for name, r in arms.items():
            lines.append(f"{config:<9}{name:>17}{r['seeds']:>6}{r['ratio_mean']:>9.3f} +- {fmt(r['ratio_sd'], '.3f'):<5}"
                         f"{r['predicted_ratio_mean']:>7.3f}{fmt(r['measured_over_predicted_gain'], '.2f'):>15}"
                         f"{fmt(r['cv_step_mean'], pct=True):>9}{fmt(r['loss_curve_gap'], pct=True):>9}"
                         f"{fmt(r['loss_last20_rel'], pct=True):>8}{str(sum(r['steps'])) + '/' + str(sum(r['base_steps'])):>11}"
                         f"  {' '.join(f'{v:.1f}' for v in r['peak_vram_gib_per_rank'])}")
    text = "\n".join(lines)
    (out / "scale_summary.txt").write_text(text + "\n")
    print(text)
    return 0 if res else 1


class _quiet:
    """Silence bench/training/e2e.py's per-seed plan table unless --verbose."""
    def __init__(self, verbose: bool):
        self.verbose = verbose

    def __enter__(self):
        import contextlib
        import io
        self._cm = contextlib.nullcontext() if self.verbose else contextlib.redirect_stdout(io.StringIO())
        return self._cm.__enter__()

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="predicted commands, wall time and gain; runs nothing (any machine)")
    p.add_argument("--num-gpus", type=int, default=8)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--profile", default=None, help="one cost profile for every config (name or json)")
    p.add_argument("--gpu", choices=["h100", "h200"], default="h100", help="shipped profiles of this GPU (default h100)")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "scale"))
    p.add_argument("--verbose", action="store_true", help="print bench/training/e2e.py's plan table of every seed")
    g = sub.add_parser("args", help="print the bench/training/e2e.py arguments of one (config, arm, seed) run")
    g.add_argument("config", choices=list(CONFIGS))
    g.add_argument("--arm", required=True)
    g.add_argument("--seed", type=int, required=True)
    g.add_argument("--num-gpus", type=int, required=True)
    g.add_argument("--profile", default=None)
    g.add_argument("--gpu", choices=["h100", "h200"], default="h100")
    g.add_argument("--out", required=True)
    s = sub.add_parser("summary", help="table over seeds from <out>/<config>/seed<S>/<arm>/e2e.json")
    s.add_argument("--out", default=str(ROOT / "bench" / "out" / "scale"))
    a = ap.parse_args(argv)
    if a.cmd == "plan":
        Path(a.out).mkdir(parents=True, exist_ok=True)
        return plan(a)
    if a.cmd == "args":
        if a.arm not in CONFIGS[a.config]["arms"]:
            raise SystemExit(f"bench/training/scale.py: arm {a.arm!r} is not one of {a.config}'s arms {CONFIGS[a.config]['arms']}")
        print(" ".join(run_args(a.config, num_gpus=a.num_gpus, seed=a.seed, arm=a.arm, out=a.out, profile=a.profile, gpu=a.gpu)))
        return 0
    return summary(a)


if __name__ == "__main__":
    sys.exit(main())
