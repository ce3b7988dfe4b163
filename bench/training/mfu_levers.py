"""Trainer-level A/B of the MFU levers on the shipped job, every arm on the SAME pinned plan (one GPU).

    python bench/training/mfu_levers.py prepare --dir D [--gas 2]
        D/config.json             the shipped zero3_adaptive.json with the pinned plan of bench/training/ln_modulate_e2e.py
                                  (the H200 1.3B profile's reference entries; m_comp auto; gas as given),
                                  metrics every step and block fusion off: the baseline arm "ref"
        D/config_fusion.json      + adaptive_load.block_fusion "regions"     (arm "fusion")
        D/config_zero.json        + ZeRO-3 settings for one GPU / few ranks  (arm "zero", ZERO_CANDIDATE)
        D/config_zero2.json       ZeRO stage 2 instead of 3 (arm "zero2"): a diagnostic, not a lever: on one GPU
                                  stage 3 partitions nothing, so this arm is what ZeRO-3's hooks cost there
        and prints the train commands (one per arm, log dirs D/runs/<arm>)
    python bench/training/mfu_levers.py report --runs D/runs [--arms ref,fusion,zero] [--out JSON]
        checks that every arm ran the same micro-batches as "ref" (shape, B, checkpointed blocks, in order),
        prints tokens/s, summed compute, MFU and peak memory per arm over the steps all arms finished
        (step 1 excluded) and each arm's ratio to "ref"

The plan is a pure function of profile, data and config, and neither lever enters it, so the arms train
the same samples; tokens/s differences are the levers'. Keep what measures faster: a lever goes into the
shipped config only on a measured gain.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import ln_modulate_e2e as pinned  # noqa: E402  (bench/training/)
from ds_adaptive.calibration.trainer_runs import PlanMismatch, pinned_ab  # noqa: E402

#: ZeRO-3 settings tried against the shipped ones (50M buckets, persistence 1e5, 1e9 live): larger buckets
#: and prefetch, a reuse distance that keeps a block's parameters between its forward and recompute, and
#: persistent parameters up to 1M elements (every norm, bias and modulation table of Wan 1.3B; ~10 MB)
ZERO_CANDIDATE = {"reduce_bucket_size": 200_000_000, "stage3_prefetch_bucket_size": 200_000_000,
                  "stage3_max_live_parameters": 3_000_000_000, "stage3_max_reuse_distance": 3_000_000_000,
                  "stage3_param_persistence_threshold": 1_000_000}
TRAIN = ("{py} -m ds_adaptive.cli.train --deepspeed_config {cfg} --model wan2.1-1.3b --steps {steps} "
         "--num-samples {n} --fused-ln-modulate --log-dir {runs}/{arm}")


def prepare(d: Path, gas: str, steps: int, n: int, m_comp: str = "auto") -> None:
    pinned.prepare(d, m_comp, gas)
    base = json.loads((d / "config.json").read_text())
    base["adaptive_load"]["block_fusion"] = "off"   # the shipped config turns it on: the baseline arm runs eager
    (d / "config.json").write_text(json.dumps(base, indent=1))
    fusion = json.loads(json.dumps(base))
    fusion["adaptive_load"]["block_fusion"] = "regions"
    zero = json.loads(json.dumps(base))
    zero["zero_optimization"].update(ZERO_CANDIDATE)
    (d / "config_fusion.json").write_text(json.dumps(fusion, indent=1))
    (d / "config_zero.json").write_text(json.dumps(zero, indent=1))
    zero2 = json.loads(json.dumps(base))
    zero2["zero_optimization"] = {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": base["zero_optimization"]["reduce_bucket_size"]}
    (d / "config_zero2.json").write_text(json.dumps(zero2, indent=1))
    for arm, name in (("ref", "config.json"), ("fusion", "config_fusion.json"), ("zero", "config_zero.json"),
                      ("zero2", "config_zero2.json")):
        print(TRAIN.format(py=sys.executable, cfg=d / name, steps=steps, n=n, runs=d / "runs", arm=arm))


def report(runs: Path, arms: list, out: Path) -> dict:
    try:
        res = pinned_ab(runs, arms)
    except (PlanMismatch, ValueError, FileNotFoundError) as exc:
        raise SystemExit(str(exc)) from exc
    steps, rows = res["steps"], res["rows"]
    print(f"same plan in all arms: steps {steps[0]}-{steps[-1]}, {res['tokens']} tokens")
    print(f"{'arm':8} {'tok/s':>8} {'x ref':>7} {'wall s':>8} {'compute s':>10} {'MFU':>6} {'peak GiB':>9}")
    for r in rows:
        print(f"{r['arm']:8} {r['tokens_per_s']:8.0f} {r['ratio_tokens_per_s']:6.3f}x {r['wall_s']:8.1f} "
              f"{r['compute_ms'] / 1e3:10.1f} {100 * (r['mfu'] or 0):5.1f}% {r['peak_mem_gib'] or 0:9.2f}")
    if out is not None:
        out.write_text(json.dumps(res, indent=1))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--dir", type=Path, required=True)
    a.add_argument("--gas", default="2", help="micro-steps per optimizer step (default 2: 20 steps in ~2 min)")
    a.add_argument("--steps", type=int, default=21)
    a.add_argument("--m-comp", default="auto",
                   help="the pinned compute budget per micro-batch, ms (auto: the search's; at gas 1 it picks ~39 s "
                        "micro-batches). A number must hold the costliest sample alone (a pinned budget has no "
                        "solo-over-budget rule): 9700 at full depth on the H200 (81x720x1280: 9.6 s); 1700, the "
                        "shipped job's auto value, stops at the first 720p video")
    a.add_argument("--num-samples", type=int, default=2000)
    b = sub.add_parser("report")
    b.add_argument("--runs", type=Path, required=True)
    b.add_argument("--arms", default="ref,fusion,zero", help="comma list; the first is the baseline")
    b.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.dir, args.gas, args.steps, args.num_samples, args.m_comp)
    else:
        report(args.runs, [x for x in args.arms.split(",") if x], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
