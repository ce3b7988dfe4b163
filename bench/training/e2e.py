#!/usr/bin/env python
"""End-to-end result: AdaptiveLoad vs the equal-token baseline on real multi-GPU training.

Four arms train the same model (Wan 2.1 1.3B shape: dim 1536, 12 heads, ffn 8960; fewer blocks so
that all arms fit a few minutes) with ZeRO-3 for ONE epoch of the same synthetic dataset (same
samples, same seed, same init, same memory budget):

    baseline      equal-token bucketing (``tokens`` sampler) + torch reference LayerNorm-modulate
    dual_ref      dual-constraint sampler (``dual``)         + torch reference LayerNorm-modulate
    tokens_fused  equal-token bucketing                      + fused LayerNorm-modulate op
    adaptive      dual-constraint sampler                    + fused op  (AdaptiveLoad)

Each arm is the real trainer (``torchrun --nproc_per_node N launch/train_wan.py --deepspeed_config
<arm config> ...``) in a subprocess; the benchmark reads its ``summary.json`` and ``metrics.jsonl``
(every step). Per arm: tokens/s and samples/s after the warm-up (the first optimizer step), CV_step
from per-rank *compute* time (ZeRO-3's waits for other ranks taken out, see ds_adaptive.training.metrics) and
from wall-clock time, compute CV from the predicted cost of each rank's batch, peak memory per rank,
loss per sample seen, held-out loss, and the simulator's prediction for the same run. Writes
``e2e.json`` and ``e2e.png`` to ``--out`` and prints a table of ratios vs the baseline.

    python bench/training/e2e.py --plan-only                       # predicted time per arm, nothing runs
    python bench/training/e2e.py                                   # all GPUs of this node
    python bench/training/e2e.py --device cpu --model tiny --num-gpus 2   # the same pipeline on 2 CPU processes
    python bench/training/e2e.py --report-only --out bench/out/e2e # tables + plots again from e2e.json

Reduced depth: the cost profile (``h100-wan2.1-1.3b``, 30 blocks) is rescaled to the trained depth
(:meth:`ds_adaptive.planning.profile.Profile.with_num_layers`), and the memory budget is the full-depth ``auto``
budget scaled by the activation memory per token, so every arm forms exactly the micro-batches the
30-block model would form at its default budgets; only the time per micro-batch shrinks. Method:
docs/E2E.md.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ds_adaptive.core.config import SamplerConfig  # noqa: E402
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import load_profile  # noqa: E402
from ds_adaptive.planning.budget import resolve_budgets  # noqa: E402
from ds_adaptive.planning.sampler import build_batch_sampler  # noqa: E402
from ds_adaptive.core.layout import Layout  # noqa: E402
from ds_adaptive.core.shapes import load_shape_distribution  # noqa: E402
from ds_adaptive.simulation.e2e import (ARMS, BASE_PROFILE, FORMAT, SIM_WORLDS, Arm, aggregate_arm,  # noqa: E402,F401
                             compact_record, fmt, plan_table, plan_tokens_per_s, ratios, table)


# Run order: the headline pair first, then the single-component arms (a deadline cuts from the end).


# ================================================================================== settings
@dataclass
class Settings:
    device: str
    num_gpus: int
    model: str
    layers: int
    num_samples: int
    shapes: Optional[str]
    gas: int
    dual_gas: str
    grad_ckpt: bool
    workers: int
    eval_samples: int
    m_mem: str
    gpu_mem_gib: Optional[float]
    lr: float
    lr_scaling: str
    seed: int
    warmup_steps: int
    arms: list
    startup_s: float
    step_overhead_s: float
    budget_s: float
    arm_timeout_s: float
    deadline_s: float
    sim_worlds: list
    profile: str
    work_dir: str
    out: str
    python: str = sys.executable
    sp: int = 1                      # Ulysses degree (--sp): dp = num_gpus / sp
    dual_m_comp: str = "auto"        # dual arms' compute budget: auto | match | ms
    sparse_density: float = 0.1      # forced density of the sparse arm(s)
    min_steps: int = 0               # --min-steps: grow num_samples until every arm has this many steps

    @property
    def dp(self) -> int:
        return self.num_gpus // self.sp


def default_num_gpus(device: str) -> int:
    if device == "cpu":
        return 2
    import torch

    return torch.cuda.device_count()


def resolve_settings(a: argparse.Namespace) -> Settings:
    device = a.device or ("cuda" if _cuda_available() else "cpu")
    cpu = device == "cpu"
    from ds_adaptive.models.wan_config import get_wan_config

    model = a.model or ("tiny" if cpu else "wan2.1-1.3b")
    layers = a.layers or (get_wan_config(model).num_layers if cpu else 4)
    shapes = a.shapes if a.shapes is not None else (
        str(ROOT / "launch" / "configs" / "shapes_cpu.json") if cpu else None)
    num_gpus = a.num_gpus if a.num_gpus is not None else default_num_gpus(device)
    if num_gpus < 1:
        raise SystemExit("bench/training/e2e.py: no GPU visible; pass --device cpu (or --num-gpus N)")
    if a.sp < 1 or num_gpus % a.sp:
        raise SystemExit(f"bench/training/e2e.py: --sp {a.sp} must be >= 1 and divide --num-gpus {num_gpus}")
    if not (a.dual_m_comp in ("auto", "match") or _is_number(a.dual_m_comp)):
        raise SystemExit(f"bench/training/e2e.py: --dual-m-comp must be auto, match or a number of ms, got {a.dual_m_comp!r}")
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    bad = [x for x in arms if x not in ARMS]
    if bad or not arms:
        raise SystemExit(f"bench/training/e2e.py: unknown arm(s) {bad}; choose from {', '.join(ARMS)}")
    return Settings(
        device=device, num_gpus=num_gpus, model=model, layers=layers,
        num_samples=a.num_samples or (128 if cpu else 150 * num_gpus), shapes=shapes, gas=a.gas, dual_gas=a.dual_gas,
        grad_ckpt=not a.no_grad_ckpt, workers=a.workers if a.workers is not None else (0 if cpu else 4),
        eval_samples=a.eval_samples if a.eval_samples is not None else (4 if cpu else 16),
        m_mem=a.m_mem or ("3x" if cpu else "auto"), gpu_mem_gib=a.gpu_mem_gib, lr=a.lr if a.lr else (
            2e-3 if cpu else 1e-4), lr_scaling=a.lr_scaling, seed=a.seed, warmup_steps=a.warmup_steps, arms=arms,
        startup_s=a.startup_s if a.startup_s is not None else (10.0 if cpu else 35.0),
        step_overhead_s=a.step_overhead_s if a.step_overhead_s is not None else (0.05 if cpu else 0.15),
        budget_s=a.budget_s, arm_timeout_s=a.arm_timeout_s, deadline_s=a.deadline_s,
        sim_worlds=[int(x) for x in a.sim_worlds.split(",") if x.strip()] if a.sim_worlds else [],
        profile=a.profile,
        work_dir=a.work_dir or str(Path(a.out) / "runs"), out=a.out, sp=a.sp, dual_m_comp=a.dual_m_comp,
        sparse_density=a.sparse_density, min_steps=a.min_steps)


def _is_number(x: str) -> bool:
    try:
        return float(x) > 0
    except ValueError:
        return False


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# ================================================================================== planning
@dataclass
class Budgets:
    m_mem_gib: float
    m_comp_ms: float
    max_tokens: int
    rule: str
    full_depth_m_mem_gib: Optional[float] = None


def dataset_shapes(s: Settings):
    from ds_adaptive.data import build_dataset

    ds = build_dataset("synthetic", num_samples=s.num_samples, shapes=s.shapes, seed=s.seed)
    return ds.sample_shapes(), ds.describe()


def resolve_memory_budget(s: Settings, raw: dict, scaled: dict, shapes) -> Budgets:
    """``auto``: the trainer's ``m_mem: auto`` for the FULL-depth profile on ``gpu_mem_gib`` (default:
    the profile's device) and dp ranks, scaled by the activation memory per sample at the longest
    shape, so batch sizes equal the full-depth ones. ``Kx``: K samples of the longest shape. A number:
    GiB."""
    uniq = sorted(set(shapes))
    cost = CostModel(load_profile(scaled), "calibrated", sp=s.sp)
    longest = max(uniq, key=lambda x: x.tokens)
    full = None
    rule = s.m_mem
    if s.m_mem == "auto":
        full_cost = CostModel(load_profile(raw), "calibrated", sp=s.sp)
        b = resolve_budgets(mode="dual", cost=full_cost, shapes=uniq, m_mem="auto", m_comp="auto", max_tokens=None,
                            gpu_mem_gib=s.gpu_mem_gib, mem_utilization=SamplerConfig().mem_utilization,
                            zero_stage=3, dp_size=s.dp)
        full = b["m_mem"]
        m_mem = full * cost.per_gpu_memory(longest) / full_cost.per_gpu_memory(longest)
        rule = (f"auto at full depth ({raw['model']['num_layers']} blocks, "
                f"{s.gpu_mem_gib or raw['gpu_mem_gib']:.1f} GiB GPU, dp {s.dp}) = {full:.2f} GiB, scaled by "
                f"activation memory per token to {s.layers} blocks")
    elif s.m_mem.endswith("x"):
        m_mem = float(s.m_mem[:-1]) * cost.per_gpu_memory(longest)
        rule = f"{s.m_mem[:-1]} x the longest sample ({longest}, {longest.tokens} tokens)"
    else:
        m_mem = float(s.m_mem)
        rule = f"{m_mem} GiB"
    b = resolve_budgets(mode="dual", cost=cost, shapes=uniq, m_mem=m_mem, m_comp="auto", max_tokens=None,
                        gpu_mem_gib=None, mem_utilization=SamplerConfig().mem_utilization, zero_stage=3,
                        dp_size=s.dp)
    return Budgets(m_mem_gib=m_mem, m_comp_ms=b["m_comp"], max_tokens=b["max_tokens"], rule=rule,
                   full_depth_m_mem_gib=full)


def sampler_config(s: Settings, arm: Arm, profile_path: str, budgets: Budgets, m_comp: "float | str" = "auto") -> dict:
    return {"mode": arm.sampler, "cost_model": "calibrated", "profile": profile_path,
            "m_mem": budgets.m_mem_gib, "m_comp": m_comp, "seed": s.seed}


def optimization_config(s: Settings, reference_batch: Optional[int] = None) -> dict:
    """The arms' ``adaptive_load.optimization`` block: ``--lr-scaling`` against ``reference_batch``."""
    cfg = {"lr_scaling": s.lr_scaling}
    if s.lr_scaling != "none":
        cfg["reference_batch"] = reference_batch
    return cfg


def plan_all(s: Settings, shapes, profile_path: str, budgets: Budgets) -> dict:
    """Plans of the selected arms. ``--dual-gas match``: the dual arms accumulate over k micro-steps,
    k = round(dual micro-steps / baseline optimizer steps), so that an optimizer step of every arm
    holds about as many samples (the same number of updates per epoch: a fair loss-per-sample
    comparison). ``--lr-scaling``: reference batch = the baseline's mean samples per optimizer step."""
    tok = plan_arm(s, ARMS["baseline"], shapes, profile_path, budgets, s.gas)
    ref = max(1, round(tok["samples"] / max(tok["steps"], 1))) if s.lr_scaling != "none" else None
    if s.dual_gas == "match":
        dual1 = plan_arm(s, ARMS["dual_ref"], shapes, profile_path, budgets, s.gas)
        k = max(1, round(dual1["micro_steps"] / max(tok["micro_steps"], 1)))
        dual_gas = s.gas * k
    else:
        dual_gas = int(s.dual_gas)
    m_comp: "float | str" = "auto"
    if s.dual_m_comp == "match":
        m_comp = match_m_comp(s, shapes, profile_path, budgets, dual_gas, tok["steps"])
    elif s.dual_m_comp != "auto":
        m_comp = float(s.dual_m_comp)
    return {name: plan_arm(s, ARMS[name], shapes, profile_path, budgets,
                           dual_gas if ARMS[name].sampler == "dual" else s.gas, ref,
                           m_comp if ARMS[name].sampler == "dual" else "auto") for name in s.arms}


def match_m_comp(s: Settings, shapes, profile_path: str, budgets: Budgets, gas: int, target_steps: int,
                 iters: int = 24) -> float:
    """``--dual-m-comp match``: the dual compute budget (ms) whose plan takes as many optimizer steps
    as the baseline's (``target_steps``) at the same gradient accumulation: same samples, same gas,
    same number of updates. Bisection on ``m_comp`` between the ``auto`` budget (the costliest sample
    at B=1: the most micro-steps) and the cost of a whole ``m_mem`` batch of the cheapest shape (no
    compute cap left: about the baseline's micro-steps). Step counts are not strictly monotone in
    ``m_comp``; the budget whose count is closest to the target (then the smallest such budget) wins,
    and the plan table shows any remaining difference."""
    arm = ARMS["dual_ref"]
    lo = budgets.m_comp_ms
    truth = CostModel(load_profile(profile_path), "calibrated", sp=s.sp)
    hi = max(lo, max(truth.batch_cost(x, max(1, int(budgets.m_mem_gib // max(truth.per_gpu_memory(x), 1e-12))))
                     for x in set(shapes)))
    steps = lambda mc: plan_arm(s, arm, shapes, profile_path, budgets, gas, None, mc)["steps"]  # noqa: E731
    best = (abs(steps(lo) - target_steps), lo)
    if steps(lo) <= target_steps:
        return lo
    for _ in range(iters):
        mid = (lo + hi) / 2
        n = steps(mid)
        best = min(best, (abs(n - target_steps), mid))
        if n == target_steps:
            hi = mid
        elif n > target_steps:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-3 * hi:
            break
    return float(best[1])


def plan_arm(s: Settings, arm: Arm, shapes, profile_path: str, budgets: Budgets, gas: int,
             reference_batch: Optional[int] = None, m_comp: "float | str" = "auto") -> dict:
    """The plan every rank of ``arm`` will compute (pure function of the config): steps, samples,
    drops, predicted per-rank cost of every micro-step (ms, the scaled calibrated profile)."""
    cfg = SamplerConfig.model_validate(sampler_config(s, arm, profile_path, budgets, m_comp))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        smp = build_batch_sampler(cfg, shapes, Layout.explicit(dp_size=s.dp, sp_size=s.sp), micro_steps_per_step=gas,
                                  enabled=arm.enabled, mode=arm.sampler, checkpointing="all" if s.grad_ckpt else "none",
                                  optimization=optimization_config(s, reference_batch))
        plan = smp.plan
    from ds_adaptive.planning.budget import predicted_times

    truth = CostModel(load_profile(profile_path), "calibrated", sp=s.sp)
    sizes = plan.batch_sizes()
    cost = predicted_times(plan, truth)                  # [micro, rank] ms: the simulator's prediction
    quad = (sizes * np.array([x.tokens ** 2 for x in plan.shapes])[plan.batch_shape]).reshape(-1, s.dp)
    step_ms = cost.max(axis=1).reshape(-1, gas).sum(axis=1)
    return {
        "sampler": type(smp).__name__, "mode": arm.sampler, "gas": gas, "reference_batch": reference_batch,
        "m_comp": m_comp,
        "steps": plan.num_steps,
        "micro_steps": plan.num_micro_steps, "samples": plan.num_samples,
        "tokens": int(plan.batch_tokens.sum()), "tail_dropped": len(plan.tail_dropped),
        "oversize": len(plan.oversize), "max_batch": int(sizes.max()) if len(sizes) else 0,
        "budgets": {"m_mem_gib": smp.params.m_mem, "m_comp_ms": smp.params.m_comp,
                    "max_tokens": smp.params.max_tokens},
        "predicted_micro_ms": cost.round(3).tolist(),
        "predicted_step_ms": step_ms.round(3).tolist(),
        "predicted_compute_s": float(cost.max(axis=1).sum() / 1e3),
        "predicted_cv": [float(x) for x in cost.std(axis=1) / cost.mean(axis=1)],
        "quad_cv": [float(x) for x in quad.std(axis=1) / np.maximum(quad.mean(axis=1), 1e-30)],
        "step_samples": [int(plan.step_totals(k).samples) for k in range(plan.num_steps)],
        "step_tokens": [int(plan.step_totals(k).tokens) for k in range(plan.num_steps)],
    }


def plan_with_min_steps(s: Settings, raw: dict, scaled: dict, profile_path: str) -> tuple[dict, Budgets, dict]:
    """Dataset, budgets and plans; with ``--min-steps N`` the dataset (``s.num_samples``, updated in
    place) grows until every arm plans at least N optimizer steps after the warm-up."""
    for _ in range(40):
        shapes, described = dataset_shapes(s)
        budgets = resolve_memory_budget(s, raw, scaled, shapes)
        plans = plan_all(s, shapes, profile_path, budgets)
        need = s.min_steps + s.warmup_steps
        fewest = min(p["steps"] for p in plans.values())
        dropped = any(p["tail_dropped"] for p in plans.values())
        if not s.min_steps or (fewest >= need and not dropped):
            return described, budgets, plans
        # too few steps: grow in proportion; enough steps but an arm drops tail samples: one more sample
        # per try (the same samples in every arm)
        s.num_samples = (s.num_samples + 1 if fewest >= need else
                         max(s.num_samples + s.dp, int(math.ceil(s.num_samples * need / max(fewest, 1) * 1.02))))
    raise SystemExit(f"bench/training/e2e.py: --min-steps {s.min_steps}: no dataset size found (last {s.num_samples} samples)")


def eval_estimate_s(s: Settings, profile_path: str) -> float:
    """Forward-only held-out evaluation: ceil(E/dp) batches of EVAL_TIMESTEPS per rank, a forward ~1/4
    of forward + backward + recomputed forward."""
    if not s.eval_samples:
        return 0.0
    from ds_adaptive.data import build_dataset
    from ds_adaptive.models.objective import EVAL_TIMESTEPS
    from ds_adaptive.training.evaluation import EVAL_SEED_OFFSET

    held = build_dataset("synthetic", num_samples=s.eval_samples, shapes=s.shapes,
                         seed=s.seed + EVAL_SEED_OFFSET).sample_shapes()
    truth = CostModel(load_profile(profile_path), "calibrated", sp=s.sp)
    per_rank = [sum(truth.batch_cost(held[j], EVAL_TIMESTEPS) / 4 for j in range(r, len(held), s.dp))
                for r in range(s.dp)]
    return max(per_rank) / 1e3


def predict_arm_s(s: Settings, plan: dict, eval_s: float) -> dict:
    compute = plan["predicted_compute_s"]
    steps = plan["steps"]
    total = s.startup_s + compute + steps * s.step_overhead_s + eval_s
    return {"startup_s": s.startup_s, "compute_s": compute, "overhead_s": steps * s.step_overhead_s,
            "eval_s": eval_s, "total_s": total}


# ================================================================================== running
def arm_ds_config(s: Settings, arm: Arm, plan: dict, profile_path: str, budgets: Budgets, log_dir: str) -> dict:
    """The arm's ds_config: the shipped ZeRO-3 config (GPU) or the CPU one, with a constant LR (no
    warm-up schedule: arms take different numbers of steps) and the arm's adaptive_load block."""
    base_name = "cpu_tiny.json" if s.device == "cpu" else (
        "zero3_adaptive_14b.json" if s.model == "wan2.1-14b" else "zero3_adaptive.json")
    base = json.loads((ROOT / "launch" / "configs" / base_name).read_text())
    cfg = {k: v for k, v in base.items() if k not in ("adaptive_load", "scheduler")}
    cfg["gradient_accumulation_steps"] = plan["gas"]
    cfg.get("adaptive_load", {}).get("sampler", {}).pop("global_batch", None)  # a pinned A/B: its own gas, not the shipped global batch
    cfg["optimizer"] = copy.deepcopy(base["optimizer"])
    cfg["optimizer"]["params"]["lr"] = s.lr
    cfg["adaptive_load"] = {
        "enabled": arm.enabled,
        "fused_ln_modulate": arm.fused,
        "sampler": sampler_config(s, arm, profile_path, budgets, plan.get("m_comp", "auto")),
        "optimization": optimization_config(s, plan.get("reference_batch")),
        "metrics": {"interval": 1, "log_dir": log_dir, "tensorboard": False, "jsonl": True, "sync_timing": True},
    }
    if arm.sparse:
        # DSV sparse attention at a forced density (no stage 1, no profiling; first and last layer dense).
        # The plan is the dense-cost one: same micro-batches as the dual arm it is compared with.
        cfg["adaptive_load"]["sparse_attention"] = {"enabled": True, "forced_density": s.sparse_density,
                                                    "max_compiled_graphs": 8}
    return cfg


def trainer_command(s: Settings, arm: Arm, config_path: str, steps: int, log_dir: str) -> list[str]:
    cmd = [s.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(s.num_gpus),
           str(ROOT / "launch" / "train_wan.py"), "--deepspeed_config", config_path, "--model", s.model,
           "--layers", str(s.layers), "--steps", str(steps), "--num-samples", str(s.num_samples),
           "--seed", str(s.seed), "--workers", str(s.workers), "--log-dir", log_dir,
           "--eval-samples", str(s.eval_samples), "--compute-timing",
           "--fused-ln-modulate" if arm.fused else "--no-fused-ln-modulate"]
    if s.shapes:
        cmd += ["--shapes", s.shapes]
    cmd += ["--grad-ckpt", "all" if s.grad_ckpt else "none"]   # the arms' plans assume every block or none
    if s.sp > 1:
        cmd += ["--sp", str(s.sp)]
    return cmd


def run_arm(s: Settings, arm: Arm, plan: dict, profile_path: str, budgets: Budgets, timeout_s: float) -> dict:
    """Run one arm's trainer to the end of its epoch; returns its raw result (summary, per-step records)."""
    wd = Path(s.work_dir) / arm.name
    wd.mkdir(parents=True, exist_ok=True)
    for old in ("metrics.jsonl", "summary.json"):
        (wd / old).unlink(missing_ok=True)
    cfg_path = wd / "ds_config.json"
    cfg_path.write_text(json.dumps(arm_ds_config(s, arm, plan, profile_path, budgets, str(wd)), indent=2) + "\n")
    cmd = trainer_command(s, arm, str(cfg_path), plan["steps"], str(wd))
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if s.device == "cuda":
        # The fused arms must run the fused kernels (an error, not a silent fallback); the others never do.
        env["DS_ADAPTIVE_LN_MODULATE"] = "fused" if arm.fused else "reference"
    log_path = wd / "train.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("+ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout_s, 1.0))
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc, timed_out = proc.returncode, True
    wall = time.perf_counter() - t0
    res = {"arm": arm.name, "label": arm.label, "command": cmd, "returncode": rc, "timed_out": timed_out,
           "process_wall_s": wall, "timeout_s": timeout_s, "work_dir": str(wd)}
    summary_path, jsonl_path = wd / "summary.json", wd / "metrics.jsonl"
    if rc == 0 and summary_path.is_file() and jsonl_path.is_file():
        res["summary"] = json.loads(summary_path.read_text())
        res["records"] = [compact_record(json.loads(line)) for line in jsonl_path.read_text().splitlines()
                          if line.strip()]
        res["ok"] = True
    else:
        res["ok"] = False
        res["log_tail"] = log_path.read_text(errors="replace")[-6000:]
    return res


# ================================================================================== aggregation


# ================================================================================== simulator
def simulator_section(s: Settings, plans: dict, arms: dict, profile_path: str, budgets: Budgets) -> dict:
    """Prediction for the measured run (the arms' own plans: same world, samples, budgets) against the
    measurement, and ``ds_adaptive.simulation.simulate`` at larger scales with the same profile and budgets."""
    out = {"measured_world": s.num_gpus, "profile": profile_path}
    tok, dual = plans.get("baseline") or plans.get("tokens_fused"), plans.get("dual_ref") or plans.get("adaptive")
    if tok and dual:
        w = s.warmup_steps
        out["same_run"] = {
            "predicted_tokens_per_s": {"tokens": plan_tokens_per_s(tok, w), "dual": plan_tokens_per_s(dual, w)},
            "predicted_ratio_dual_over_tokens": plan_tokens_per_s(dual, w) / max(plan_tokens_per_s(tok, w), 1e-30),
            "predicted_cv": {"tokens": float(np.mean(tok["predicted_cv"][w * tok["gas"]:] or [0])),
                             "dual": float(np.mean(dual["predicted_cv"][w * dual["gas"]:] or [0]))},
        }
        meas = {}
        pairs = (("baseline", "dual_ref", "reference LN"), ("tokens_fused", "adaptive", "fused LN"))
        for t_name, d_name, label in pairs:
            a, b = arms.get(d_name), arms.get(t_name)
            if a and b and a.get("ok") and b.get("ok"):
                meas[label] = {"ratio_dual_over_tokens": a["tokens_per_s"] / b["tokens_per_s"],
                               "cv_step": {"tokens": b["cv_step"], "dual": a["cv_step"]},
                               "cv_step_wall": {"tokens": b["cv_step_wall"], "dual": a["cv_step_wall"]}}
        out["same_run"]["measured"] = meas
    if s.sim_worlds:
        from ds_adaptive.simulation.simulate import simulate

        cfg = SamplerConfig(profile=profile_path, m_mem=budgets.m_mem_gib, m_comp="auto", seed=s.seed)
        dist = load_shape_distribution(s.shapes)
        sims = {}
        for world in s.sim_worlds:
            t0 = time.perf_counter()
            r = simulate(world=world, sp=1, steps=40, seed=s.seed, dist=dist, profile=profile_path, sampler_cfg=cfg,
                         micro_steps_per_step=s.gas, samplers=("tokens", "dual"))
            t, d = r["samplers"]["tokens"], r["samplers"]["dual"]
            sims[str(world)] = {
                "ratio_dual_over_tokens": d["predicted_tokens_per_s"] / t["predicted_tokens_per_s"],
                "cv": {"tokens": t["compute_cv_mean"], "dual": d["compute_cv_mean"]},
                "idle": {"tokens": t["idle_fraction"], "dual": d["idle_fraction"]},
                "predicted_tokens_per_s": {"tokens": t["predicted_tokens_per_s"], "dual": d["predicted_tokens_per_s"]},
                "seconds": time.perf_counter() - t0,
            }
        out["scale"] = sims
    return out


# ================================================================================== output


def plot(report: dict, path: Path) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG (run --report-only where it is)"
    arms = {n: a for n, a in report["arms"].items() if a.get("ok")}
    if not arms:
        return "no finished arm to plot"
    colors = {"baseline": "tab:red", "dual_ref": "tab:cyan", "tokens_fused": "tab:orange", "adaptive": "tab:blue"}
    styles = {"baseline": "-", "dual_ref": "-", "tokens_fused": "--", "adaptive": "--"}
    fig, ax = plt.subplots(2, 3, figsize=(19, 10))
    st = report["settings"]
    # (1) throughput per step
    a0 = ax[0, 0]
    for n, a in arms.items():
        steps = np.arange(1, len(a["tokens_per_s_steps"]) + 1)
        a0.plot(steps, a["tokens_per_s_steps"], marker=".", ls=styles.get(n, "-"), color=colors.get(n),
                label=f"{n} ({a['tokens_per_s']:,.0f} tok/s)")
    a0.axvspan(0.5, st["warmup_steps"] + 0.5, color="0.9", label="warm-up (excluded)")
    a0.set(xlabel="optimizer step", ylabel="tokens/s (step tokens / step wall time)", title="Throughput per step")
    a0.legend(fontsize=8)
    # (2) CV_step distributions: compute vs wall-clock
    a1 = ax[0, 1]
    data, labels, cols = [], [], []
    for n, a in arms.items():
        data += [np.array(a["cv_step_micro"]) * 100, np.array(a["cv_step_wall_micro"]) * 100]
        labels += [f"{n}\ncompute", f"{n}\nwall"]
        cols += [colors.get(n), "0.7"]
    bp = a1.boxplot(data, whis=(5, 95), showfliers=False, patch_artist=True)
    for patch, c in zip(bp["boxes"], cols):
        patch.set_facecolor(c)
        patch.set_alpha(0.6)
    a1.set_xticks(range(1, len(labels) + 1), labels, fontsize=7)
    a1.set(ylabel="CV over ranks per micro-step [%]", title="CV_step: per-rank compute vs wall-clock time")
    # (3) VRAM per rank
    a2 = ax[0, 2]
    width = 0.8 / len(arms)
    offset = lambda i: (i - (len(arms) - 1) / 2) * width  # noqa: E731 - bars of one rank centred on it
    n_ranks = len(next(iter(arms.values()))["peak_mem_gib_per_rank"])
    for i, (n, a) in enumerate(arms.items()):
        x = np.arange(len(a["peak_mem_gib_per_rank"])) + offset(i)
        a2.bar(x, a["peak_mem_gib_per_rank"], width, color=colors.get(n), label=n)
    a2.set_xticks(range(n_ranks))
    cap = next(iter(arms.values()))["mem_capacity_gib"]
    a2.axhline(cap, color="k", lw=0.8, ls="--", label=f"capacity {cap:.0f} GiB")
    a2.set(xlabel="rank", ylabel="peak memory [GiB]", title="Peak memory per rank (whole run)")
    a2.legend(fontsize=8)
    # (4) loss per sample seen
    a3 = ax[1, 0]
    for n, a in arms.items():
        lc = a["loss_curve"]
        a3.plot(lc["samples_seen"], lc["loss"], marker=".", ls=styles.get(n, "-"), color=colors.get(n),
                label=f"{n} (last 20%: {a['loss_last20']:.4f}" +
                      (f", held-out {a['eval_loss']:.4f})" if a.get("eval_loss") is not None else ")"))
    a3.set(xlabel="samples seen", ylabel="training loss (step mean per sample)", title="Loss vs samples seen")
    a3.legend(fontsize=8)
    # (5) predicted vs measured micro-step time
    a4 = ax[1, 1]
    for n, a in arms.items():
        p = a["predicted"]
        a4.scatter(np.array(p["micro_max_ms"]) / 1e3, np.array(p["measured_micro_max_ms"]) / 1e3, s=12,
                   color=colors.get(n),
                   label=f"{n} (r={fmt(p['pearson_step_max'], '.3f')})")
    a4.set(xlabel="predicted slowest-rank cost [s] (profile)", ylabel="measured slowest-rank compute [s]",
           title="Cost model vs measurement, per micro-step")
    a4.legend(fontsize=8)
    # (6) per-rank compute vs wall per micro-step
    a5 = ax[1, 2]
    for i, (n, a) in enumerate(arms.items()):
        x = np.arange(len(a["compute_ms_per_rank"])) + offset(i)
        a5.bar(x, np.array(a["wall_ms_per_rank"]) / 1e3, width, color="0.85", edgecolor=colors.get(n))
        a5.bar(x, np.array(a["compute_ms_per_rank"]) / 1e3, width, color=colors.get(n), label=f"{n} compute")
    a5.set_xticks(range(n_ranks))
    a5.set(xlabel="rank", ylabel="mean per micro-step [s]",
           title="Per-rank compute (colour) inside wall-clock time (grey)")
    a5.legend(fontsize=8)
    fig.suptitle(f"AdaptiveLoad end-to-end: {st['model']} ({st['layers']} blocks), {st['num_gpus']} x "
                 f"{report['environment']['device_name']}, ZeRO-3, {st['num_samples']} samples, one epoch")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def environment(s: Settings) -> dict:
    """Versions and device names, read without creating a CUDA context in this (parent) process: a
    context would hold memory on GPU 0 while the arms run."""
    from importlib import metadata

    env = {"python": sys.version.split()[0], "device": s.device, "device_name": "CPU"}
    for pkg in ("torch", "deepspeed"):
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            env[pkg] = None
    if s.device == "cuda":
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
            env["device_name"] = q[0].split(",")[0].strip() if q else "GPU"
            env["gpus"] = q
        except (OSError, subprocess.SubprocessError):
            env["device_name"] = "GPU"
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                           timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        env["git_commit"] = None
    return env


def finish(report: dict, out: Path, *, final: bool) -> None:
    """Re-aggregate, write e2e.json (always) and, when ``final``, e2e.png and the table."""
    plans = report["plans"]
    arms = {}
    for name, raw in report["raw"].items():
        if raw.get("ok"):
            try:
                arms[name] = aggregate_arm(raw, plans[name], report["settings"]["warmup_steps"])
            except Exception as exc:  # noqa: BLE001 - a broken arm must not hide the others
                arms[name] = {"arm": name, "ok": False, "error": f"aggregation failed: {type(exc).__name__}: {exc}"}
        else:
            arms[name] = {"arm": name, "ok": False,
                          "error": "timed out" if raw.get("timed_out") else f"exit code {raw.get('returncode')}"
                          if "returncode" in raw else raw.get("error", "not run")}
    report["arms"] = arms
    report["ratios"] = ratios(arms)
    out.mkdir(parents=True, exist_ok=True)
    if final:
        s = Settings(**report["settings"])
        try:
            report["simulator"] = simulator_section(s, plans, arms, report["profile"]["path"],
                                                    Budgets(**report["budgets"]))
        except Exception as exc:  # noqa: BLE001
            report["simulator"] = {"error": f"{type(exc).__name__}: {exc}"}
    (out / "e2e.json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    if final:
        logs = []
        for name, raw in report["raw"].items():
            path = Path(raw.get("work_dir", "")) / "train.log"
            found = raw.get("work_dir") and path.is_file()
            text = path.read_text(errors="replace") if found else raw.get("log_tail", "")
            logs.append(f"===== {name} (rc {raw.get('returncode')}, {raw.get('process_wall_s', 0):.0f} s) =====\n"
                        f"{text[-5000:]}\n")
        if any(not x.rstrip().endswith("=====") for x in logs):
            (out / "e2e_logs.txt").write_text("\n".join(logs))
        msg = plot(report, out / "e2e.png")
        text = table(report)
        (out / "e2e.txt").write_text(text + "\n")
        print(text, flush=True)
        print(msg or f"wrote {out / 'e2e.json'}, {out / 'e2e.png'}, {out / 'e2e.txt'}", flush=True)


# ================================================================================== main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    ap.add_argument("--num-gpus", type=int, default=None, help="ranks per arm (default: all GPUs; 2 on CPU)")
    ap.add_argument("--model", default=None, help="Wan preset (default: wan2.1-1.3b; tiny on CPU)")
    ap.add_argument("--layers", type=int, default=None,
                    help="transformer blocks (default: 4 on GPU; the preset's on CPU)")
    ap.add_argument("--num-samples", type=int, default=None,
                    help="dataset size = samples of the epoch (default 150 per GPU; 128 on CPU)")
    ap.add_argument("--shapes", default=None,
                    help="shape mix (default: the shipped Wan mix; launch/configs/shapes_cpu.json on CPU)")
    ap.add_argument("--arms", default=",".join(n for n, a in ARMS.items() if not a.sparse),
                    help=f"comma-separated subset of {', '.join(ARMS)} (default: all but the sparse arm)")
    ap.add_argument("--sp", type=int, default=1, help="Ulysses degree: dp = num-gpus / sp (default 1)")
    ap.add_argument("--dual-m-comp", default="auto",
                    help="compute budget of the dual arms: auto (costliest sample at B=1), match (the budget whose "
                         "plan takes as many optimizer steps as the baseline's at the same gas; use with "
                         "--dual-gas equal to the baseline's) or ms")
    ap.add_argument("--sparse-density", type=float, default=0.1,
                    help="forced density of the adaptive_sparse arm's sparse attention (default 0.1)")
    ap.add_argument("--min-steps", type=int, default=0,
                    help="grow --num-samples (by 25%% at a time) until every arm plans at least this many "
                         "optimizer steps (0: off)")
    ap.add_argument("--gas", type=int, default=1, help="gradient_accumulation_steps of the tokens arms (default 1)")
    ap.add_argument("--dual-gas", default="match",
                    help="gradient_accumulation_steps of the dual arms: 'match' (default: as many samples per "
                         "optimizer step as the baseline, see docs/E2E.md) or a number")
    ap.add_argument("--no-grad-ckpt", action="store_true", help="no activation checkpointing (the profile assumes it)")
    ap.add_argument("--workers", type=int, default=None, help="DataLoader workers per rank (default 4; 0 on CPU)")
    ap.add_argument("--eval-samples", type=int, default=None, help="held-out samples (default 16; 4 on CPU; 0: off)")
    ap.add_argument("--m-mem", default=None,
                    help="memory budget: 'auto' (full-depth auto budget, scaled; GPU default), 'Kx' (K longest "
                         "samples; CPU default 3x) or GiB")
    ap.add_argument("--gpu-mem-gib", type=float, default=None,
                    help="GPU capacity behind m_mem auto (default: the profile's device, 79.19 GiB H100)")
    ap.add_argument("--lr", type=float, default=None, help="constant AdamW LR (default 1e-4; 2e-3 on CPU)")
    ap.add_argument("--lr-scaling", choices=["none", "linear", "sqrt"], default="none",
                    help="optimization.lr_scaling of every arm (default none)")
    ap.add_argument("--profile", default=BASE_PROFILE,
                    help=f"cost profile (shipped name or json) of the FULL-depth model, rescaled to --layers "
                         f"(default {BASE_PROFILE})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-steps", type=int, default=1, help="optimizer steps excluded from throughput and CV")
    ap.add_argument("--startup-s", type=float, default=None,
                    help="--plan-only: start-up per arm (default 35; 10 on CPU)")
    ap.add_argument("--step-overhead-s", type=float, default=None,
                    help="--plan-only: per optimizer step beyond the profile's compute (default 0.15; 0.05 on CPU)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="--plan-only: budget for all arms (default 300)")
    ap.add_argument("--arm-timeout-s", type=float, default=0.0,
                    help="kill an arm after this long (default: 3 x its prediction + 120 s)")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="start no arm whose prediction would end after this many seconds from the start (0: none)")
    ap.add_argument("--sim-worlds", default=",".join(map(str, SIM_WORLDS)), help="simulator world sizes ('' for none)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "e2e"), help="output directory (e2e.json/png/txt)")
    ap.add_argument("--work-dir", default=None, help="per-arm configs and logs (default OUT/runs)")
    ap.add_argument("--plan-only", action="store_true", help="print the plan and predicted time per arm; run nothing")
    ap.add_argument("--report-only", action="store_true",
                    help="re-aggregate, tabulate and plot an e2e.json (--from-json, default OUT/e2e.json) into OUT")
    ap.add_argument("--from-json", default=None,
                    help="--report-only: the e2e.json to read (e.g. one fetched from a GPU run)")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    out = Path(a.out)
    if a.report_only:
        report = json.loads(Path(a.from_json or out / "e2e.json").read_text())
        finish(report, out, final=True)
        return 0
    s = resolve_settings(a)
    if s.warmup_steps < 0 or s.gas < 1 or s.layers < 1 or not (s.dual_gas == "match" or s.dual_gas.isdigit()
                                                                  and int(s.dual_gas) >= 1):
        raise SystemExit("bench/training/e2e.py: --warmup-steps >= 0, --gas >= 1, --layers >= 1, --dual-gas match or >= 1")
    base = load_profile(s.profile)
    raw = copy.deepcopy(dict(base.raw))
    scaled = copy.deepcopy(dict(base.with_num_layers(s.layers).raw))
    work = Path(s.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    profile_path = str((work / f"profile-{s.layers}blocks.json").resolve())
    Path(profile_path).write_text(json.dumps(scaled, indent=1) + "\n")
    described, budgets, plans = plan_with_min_steps(s, raw, scaled, profile_path)
    eval_s = eval_estimate_s(s, profile_path)
    pred = {name: predict_arm_s(s, p, eval_s) for name, p in plans.items()}
    report = {
        "format": FORMAT, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "settings": asdict(s),
        "environment": environment(s), "dataset": described,
        "profile": {"path": profile_path, "base": s.profile, "layers": s.layers, "scaled": scaled["source"]
                    if "source" in scaled else None,
                    "c0_ms": scaled["compute"]["c0_ms"], "a_ms_per_token": scaled["compute"]["a_ms_per_token"],
                    "b_ms_per_token2": scaled["compute"]["b_ms_per_token2"],
                    "m1_gib_per_token": scaled["memory"]["m1_gib_per_token"]},
        "budgets": asdict(budgets), "plans": plans, "predicted_time": pred,
        "predicted_total_s": sum(p["total_s"] for p in pred.values()),
        "arms_meta": {n: asdict(ARMS[n]) for n in s.arms},
        "raw": {},
    }
    print(plan_table(report), flush=True)
    if a.plan_only:
        out.mkdir(parents=True, exist_ok=True)
        (out / "e2e_plan.json").write_text(json.dumps({k: v for k, v in report.items() if k != "raw"}, indent=1) + "\n")
        return 0
    t_start = time.perf_counter()
    for name in s.arms:
        arm = ARMS[name]
        elapsed = time.perf_counter() - t_start
        if s.deadline_s and elapsed + pred[name]["total_s"] > s.deadline_s:
            report["raw"][name] = {"ok": False, "error": f"skipped: {elapsed:.0f} s elapsed + predicted "
                                                         f"{pred[name]['total_s']:.0f} s > deadline "
                                                         f"{s.deadline_s:.0f} s"}
            print(f"[e2e] {name}: {report['raw'][name]['error']}", flush=True)
            continue
        timeout = s.arm_timeout_s or (3 * pred[name]["total_s"] + 120)
        if s.deadline_s:
            timeout = min(timeout, max(s.deadline_s - elapsed, 30.0))
        print(f"[e2e] {name}: {arm.label}: {plans[name]['steps']} steps, predicted {pred[name]['total_s']:.0f} s "
              f"(timeout {timeout:.0f} s)", flush=True)
        res = run_arm(s, arm, plans[name], profile_path, budgets, timeout)
        report["raw"][name] = res
        if res["ok"]:
            summ = res["summary"]
            print(f"[e2e] {name}: done in {res['process_wall_s']:.0f} s: {summ['steps']} steps, "
                  f"{summ['tokens_per_s']:,.0f} tok/s, CV_step {100 * summ['cv_step']:.1f}% "
                  f"(wall {100 * summ.get('cv_step_wall', 0):.1f}%)", flush=True)
        else:
            print(f"[e2e] {name}: FAILED (rc {res['returncode']}, timed out {res['timed_out']}); log tail:\n"
                  f"{res['log_tail'][-3000:]}", flush=True)
        finish(report, out, final=False)
    finish(report, out, final=True)
    return 0 if all(r.get("ok") for r in report["raw"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
