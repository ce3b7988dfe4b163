"""Planning at cluster scale: a whole epoch from a ds_config at 1 to 4,096 GPUs and 100k to 10M samples.

    taskset -c 0 python bench/planner/scale.py [--config launch/configs/zero3_adaptive.json] \\
        [--cases 1x100k,8x100k,...] [--out bench/results/planner/scale_cpu_<commit>.json]

Each case is one fresh process (``ds-adaptive simulate --config CONFIG --world W --num-samples N --json``, pinned
to the first CPU this process may use), so that its plan time and peak memory are its own: the sampler built as the
trainer builds it (the budget search, the global batch, the epoch's plan) plus the equal-token baseline at the
same global batch. The global batch of a case is the config's ``sampler.global_batch`` unless the case names one
(``WxN:G``, G samples per optimizer step). Prints a table and writes JSON (the cases' ``simulate`` objects).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the issue's sizes: the done-when global batches (2,048 up to 256 GPUs, 8,192 at 1,024, 32,768 at 4,096)
DEFAULT_CASES = ("1x100k:2048,8x100k:2048,64x100k:2048,256x100k:2048,1024x100k:8192,1024x1M:8192,"
                 "4096x1M:32768,4096x10M:32768")


def _count(text: str) -> int:
    mult = {"k": 1_000, "M": 1_000_000}
    return int(float(text[:-1]) * mult[text[-1]]) if text[-1] in mult else int(text)


def parse_cases(spec: str) -> list[tuple[int, int, int | None]]:
    """``"8x100k:2048,1024x1M"`` -> ``[(8, 100000, 2048), (1024, 1000000, None)]``."""
    out = []
    for item in spec.split(","):
        size, _, gb = item.strip().partition(":")
        w, n = size.split("x")
        out.append((int(w), _count(n), int(gb) if gb else None))
    return out


def _config_with(config: Path, gb: int | None, tmp: Path) -> Path:
    if gb is None:
        return config
    d = json.loads(config.read_text())
    d.setdefault("adaptive_load", {}).setdefault("sampler", {})["global_batch"] = {"samples": gb}
    path = tmp / f"{config.stem}_gb{gb}.json"
    path.write_text(json.dumps(d))
    return path


def run_case(config: Path, world: int, n: int, gb: int | None, tmp: Path, cpu: int | None) -> dict:
    cmd = [sys.executable, "-m", "ds_adaptive.cli", "simulate", "--config", str(_config_with(config, gb, tmp)),
           "--world", str(world), "--num-samples", str(n), "--json"]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu)] + cmd
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        return {"world": world, "num_samples": n, "global_batch": gb, "error": (r.stderr.strip().splitlines() or ["?"])[-1],
                "process_s": wall}
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["process_s"] = wall
    return res


def table(rows: list[dict]) -> str:
    head = ("| GPUs | samples | global batch | gas | optimizer steps | samples/step mean (min-max) | plan s (CPU s) | "
            "peak RSS MB | dual CV | dual tokens/s | tokens CV | tokens tokens/s | dual/tokens |")
    out = [head, "|" + "---|" * 13]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['world']:,} | {r['num_samples']:,} | {r['global_batch']} | error: {r['error']} |" + " |" * 9)
            continue
        s, d, t = r["samples_per_step"], r["dual"], r.get("tokens", {})
        gain = d["predicted_tokens_per_s"] / t["predicted_tokens_per_s"] if t.get("predicted_tokens_per_s") else float("nan")
        t = {k: (float("nan") if v is None else v) for k, v in t.items() if k != "error"}
        gb = r["global_batch"] or {}
        out.append(f"| {r['world']:,} | {r['num_samples']:,} | {', '.join(f'{k} {v:,}' for k, v in gb.items() if k != 'tolerance') or '-'} "
                   f"| {r['micro_steps_per_step']} | {r['optimizer_steps']:,} | {s['mean']:,.0f} ({s['min']:,}-{s['max']:,}) "
                   f"| {r['plan_s']:.1f} ({r.get('plan_cpu_s', float('nan')):.1f}) | {r['peak_rss_mb']:,.0f} | {d['predicted_cv']:.2%} "
                   f"| {d['predicted_tokens_per_s']:,.0f} | {t.get('predicted_cv', float('nan')):.2%} "
                   f"| {t.get('predicted_tokens_per_s', float('nan')):,.0f} | {gain:.3f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "launch" / "configs" / "zero3_adaptive.json"))
    ap.add_argument("--cases", default=DEFAULT_CASES, help="WORLDxSAMPLES[:GLOBAL_BATCH],... (default: %(default)s)")
    ap.add_argument("--out", default=None, help="JSON path (default: bench/out/scale.json)")
    args = ap.parse_args(argv)
    cpu = sorted(os.sched_getaffinity(0))[0] if hasattr(os, "sched_getaffinity") else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for w, n, gb in parse_cases(args.cases):
            rows.append(run_case(Path(args.config), w, n, gb, Path(tmp), cpu))
            r = rows[-1]
            print(f"{w} GPUs x {n:,}: " + (r["error"] if "error" in r else f"plan {r['plan_s']:.1f} s, "
                  f"{r['samples_per_step']['mean']:,.0f} samples/step, peak {r['peak_rss_mb']:,.0f} MB"), flush=True)
    print(table(rows))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    out = Path(args.out or ROOT / "bench" / "out" / "scale.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "planner/scale", "device": "CPU (1 core)", "commit": commit,
                               "date": time.strftime("%Y-%m-%d", time.gmtime()), "config": args.config,
                               "command": " ".join(["python", "bench/planner/scale.py"] + (argv or sys.argv[1:])),
                               "cases": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
