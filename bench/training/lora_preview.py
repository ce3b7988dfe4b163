"""LoRA vs full fine-tuning on the default job, with a sample preview inside the run (one GPU).

    python bench/training/lora_preview.py --out bench/out/lora_preview.json            # two arms, ~3-4 min on one H200
    bash bench/gpu/lora_preview.sh                                                # the same after the wheelhouse

Each arm is the real trainer (``python -m ds_adaptive.cli.train``, a world of one) on the shipped default job
(``launch/configs/zero3_adaptive.json``: ZeRO-3, AdaptiveLoad, ``m_mem``/``m_comp``/gas ``auto``, i.e. planned
to ~95% of the GPU), ``--model wan2.1-1.3b``, with ``adaptive_load.preview`` on (one prompt from the dataset at
``--preview-size``, ``--preview-steps`` Euler steps, after step ``--preview-at`` and after the last step):

* ``full``: full fine-tuning;
* ``lora``: the same with ``adaptive_load.lora`` (rank ``--rank`` on attention + FFN, base frozen). Its static
  memory is smaller (adapter-only gradients and Adam state), so ``m_mem: auto`` plans larger micro-batches.

The base is the random init in both arms (no pretrained weights on the bench node): throughput and memory do
not depend on the weights' values. Per arm it reads ``summary.json`` (tokens/s after one warm-up step, peak
memory), ``memory.jsonl`` (predicted static memory) and ``previews.jsonl`` (generation time, measured peak,
memory above the static state, the plan's bound and budget), prints one table with the LoRA / full ratios and
writes JSON to ``--out``. A preview that OOMs fails its arm (the run's exit code and log tail are reported).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "launch" / "configs" / "zero3_adaptive.json"


def arm_config(name: str, args) -> dict:
    raw = json.loads(CONFIG.read_text())
    cfg = copy.deepcopy(raw)
    al = cfg["adaptive_load"]
    al["preview"] = {"enabled": True, "interval": args.preview_at, "steps": args.preview_steps, "num_prompts": 1,
                     "size": args.preview_size, "guidance_scale": args.guidance}
    if name == "lora":
        al["lora"] = {"enabled": True, "rank": args.rank, "alpha": float(args.rank)}
    return cfg


def run_arm(name: str, args, work: Path, timeout_s: float) -> dict:
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    cfg_path = d / "ds_config.json"
    cfg_path.write_text(json.dumps(arm_config(name, args), indent=1))
    cmd = [sys.executable, "-m", "ds_adaptive.cli.train", "--deepspeed_config", str(cfg_path), "--model", args.model,
           "--steps", str(args.steps), "--num-samples", str(args.num_samples), "--log-dir", str(d / "logs"),
           "--seed", str(args.seed)]
    if args.shapes:
        cmd += ["--shapes", args.shapes]
    if args.global_batch:
        cmd += ["--global-batch", str(args.global_batch)]
    if args.fused is not None:
        cmd.append("--fused-ln-modulate" if args.fused else "--no-fused-ln-modulate")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    with open(d / "log.txt", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=max(timeout_s, 1)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    out = {"arm": name, "rc": rc, "wall_s": time.perf_counter() - t0, "cmd": " ".join(cmd)}
    text = (d / "log.txt").read_text()
    out["oom"] = "OutOfMemoryError" in text or "CUDA out of memory" in text
    if rc != 0:
        out["log_tail"] = text[-3000:]
        return out
    s = json.loads((d / "logs" / "summary.json").read_text())
    out.update({k: s.get(k) for k in ("tokens_per_s", "samples_per_s", "step_s_mean", "peak_mem_gib", "peak_mem_frac",
                                      "mem_capacity_gib", "gradient_accumulation_steps", "steps", "loss_last",
                                      "fused_ln_modulate", "lora", "preview")})
    mem = [json.loads(x) for x in (d / "logs" / "memory.jsonl").read_text().splitlines()] \
        if (d / "logs" / "memory.jsonl").is_file() else []
    out["static_gib_predicted"] = mem[0]["static_gib"] if mem else None
    out["max_predicted_gib"] = max((m["predicted_gib"] for m in mem), default=None)
    out["previews"] = [json.loads(x) for x in (d / "logs" / "previews.jsonl").read_text().splitlines()]
    return out


def ratio(a, b):
    return a / b if a and b else float("nan")


def report(arms: list[dict]) -> str:
    rows = [f"{'arm':<5} {'rc':>4} {'tok/s':>9} {'peak GiB':>9} {'peak %':>7} {'static':>7} {'gas':>4} "
            f"{'prev s':>7} {'prev peak':>9} {'prev +GiB':>9} {'bound':>7} {'m_mem':>7}"]
    for a in arms:
        p = (a.get("previews") or [{}])[0]
        f = lambda v, spec: format(v, spec) if isinstance(v, (int, float)) else "-"  # noqa: E731
        rows.append(f"{a['arm']:<5} {str(a['rc']):>4} {f(a.get('tokens_per_s'), '9.0f')} {f(a.get('peak_mem_gib'), '9.2f')} "
                    f"{f(100 * (a.get('peak_mem_frac') or 0), '7.1f')} {f(a.get('static_gib_predicted'), '7.2f')} "
                    f"{f(a.get('gradient_accumulation_steps'), '4d')} {f(p.get('generate_s'), '7.2f')} "
                    f"{f(p.get('peak_gib'), '9.2f')} {f(p.get('preview_gib'), '9.2f')} {f(p.get('predicted_gib'), '7.2f')} "
                    f"{f(p.get('budget_gib'), '7.2f')}")
    by = {a["arm"]: a for a in arms}
    if "full" in by and "lora" in by:
        lo, fu = by["lora"], by["full"]
        rows.append(f"lora / full: tokens/s {ratio(lo.get('tokens_per_s'), fu.get('tokens_per_s')):.3f}x, peak memory "
                    f"{ratio(lo.get('peak_mem_gib'), fu.get('peak_mem_gib')):.3f}x, predicted static memory "
                    f"{ratio(lo.get('static_gib_predicted'), fu.get('static_gib_predicted')):.3f}x")
    rows.append("prev s: preview generation (all Euler steps); prev peak: allocated peak during it; prev +GiB: above "
                "the allocation before it; bound: the memory model's bound of +GiB; m_mem: the plan's activation budget")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON result path")
    ap.add_argument("--work-dir", default="/tmp/lora_preview_runs")
    ap.add_argument("--model", default="wan2.1-1.3b")
    ap.add_argument("--arms", default="full,lora")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per arm (tokens/s after the first)")
    ap.add_argument("--num-samples", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shapes", default=None, help="shape mix of the synthetic data (default: the shipped mix; a CPU "
                                                   "smoke test: launch/configs/shapes_cpu.json with --model tiny)")
    ap.add_argument("--global-batch", type=int, default=None, metavar="SAMPLES",
                    help="samples per optimizer step in both arms (default: the shipped config's sampler.global_batch)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--preview-at", type=int, default=2, help="preview after this step (and after the last)")
    ap.add_argument("--preview-steps", type=int, default=5)
    ap.add_argument("--preview-size", default="81x480x832")
    ap.add_argument("--guidance", type=float, default=1.0)
    ap.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                    help="force the fused LayerNorm-modulate op on/off (default: the shipped config's)")
    ap.add_argument("--deadline-s", type=float, default=230.0, help="all arms together; a late arm is stopped")
    args = ap.parse_args(argv)
    work = Path(args.work_dir)
    arms, t0 = [], time.perf_counter()
    names = [a for a in args.arms.split(",") if a]
    for i, name in enumerate(names):
        left = args.deadline_s - (time.perf_counter() - t0)
        share = left / (len(names) - i)
        print(f"[lora_preview] arm {name}: up to {share:.0f} s", flush=True)
        arms.append(run_arm(name, args, work, share))
        print(f"[lora_preview] arm {name}: rc {arms[-1]['rc']}, {arms[-1]['wall_s']:.0f} s", flush=True)
    text = report(arms)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"arms": arms, "table": text, "args": vars(args)}, indent=1, default=str))
    return 0 if all(a["rc"] == 0 for a in arms) else 1


if __name__ == "__main__":
    sys.exit(main())
