"""Report of bench/gpu_memory.sh's training arms (issue 16): one table of throughput ratios, peak memory
and MFU, and the predicted-vs-measured peak memory per micro-batch; writes JSON.

    python bench/memory_report.py --runs /tmp/runs --out bench/out/memory/memory.json

Each arm is a directory of ``ds_adaptive.train`` logs (``summary.json``, ``memory.jsonl``); an arm without
``summary.json`` did not finish (its log says why: time limit or out of memory).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REFERENCE_ARM = "adaptive_all"     # every block checkpointed: the throughput reference


def load_arm(d: Path) -> dict:
    s = d / "summary.json"
    mem = [json.loads(line) for line in (d / "memory.jsonl").read_text().splitlines()] if (d / "memory.jsonl").exists() else []
    out = {"arm": d.name, "finished": s.exists(), "memory": mem}
    if s.exists():
        out["summary"] = json.loads(s.read_text())
    return out


def memory_table(rows: list[dict], skip_steps: int = 1) -> list[dict]:
    """Per (shape, B, checkpointed blocks): micro-steps, predicted and measured peak (GiB), max |rel err|.
    The first ``skip_steps`` steps are left out (first-step allocations: optimizer state, workspaces)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["step"] > skip_steps:
            groups.setdefault((r["tokens"], r["shape"], r["B"], r["ckpt_blocks"]), []).append(r)
    out = []
    for (tok, shape, b, n), rs in sorted(groups.items()):
        meas = [r["measured_gib"] for r in rs]
        pred = rs[0]["predicted_gib"]
        errs = [(pred - m) / m for m in meas]
        out.append({"shape": shape, "tokens": tok, "B": b, "ckpt_blocks": n, "count": len(rs),
                    "predicted_gib": pred, "measured_gib_mean": sum(meas) / len(meas), "measured_gib_max": max(meas),
                    "max_abs_rel_err": max(abs(e) for e in errs)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="directory holding one log directory per arm")
    ap.add_argument("--out", required=True, help="JSON to write")
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args(argv)
    arms = [load_arm(d) for d in sorted(Path(a.runs).iterdir()) if d.is_dir()]
    ref = next((x for x in arms if x["arm"] == REFERENCE_ARM and x["finished"]), None)
    ref_tps = ref["summary"]["tokens_per_s"] if ref else None
    print(f"{'arm':<15} {'done':>4} {'steps':>5} {'tok/s':>9} {'x all-ckpt':>10} {'peak GiB':>9} {'peak %':>7} "
          f"{'MFU %':>6} {'HFU %':>6} {'mem err max':>11}")
    for x in arms:
        s = x.get("summary", {})
        tps = s.get("tokens_per_s", 0.0)
        table = memory_table(x["memory"])
        x["memory_table"] = table
        err = max((t["max_abs_rel_err"] for t in table), default=float("nan"))
        ratio = f"{tps / ref_tps:.3f}" if ref_tps and s else "-"
        print(f"{x['arm']:<15} {'yes' if x['finished'] else 'NO':>4} {s.get('steps', 0):>5} {tps:>9.0f} {ratio:>10} "
              f"{s.get('peak_mem_gib', 0):>9.2f} {100 * s.get('peak_mem_frac', 0):>7.1f} {100 * s.get('mfu', 0):>6.1f} "
              f"{100 * s.get('hfu', 0):>6.1f} {err:>11.1%}")
    for x in arms:
        if not x["memory_table"]:
            continue
        print(f"\n{x['arm']}: predicted vs measured peak memory per micro-batch (steps > 1)")
        print(f"  {'shape':>14} {'B':>4} {'ckpt':>4} {'n':>3} {'pred GiB':>9} {'meas GiB':>9} {'max|err|':>8}")
        for t in x["memory_table"]:
            print(f"  {t['shape']:>14} {t['B']:>4} {t['ckpt_blocks']:>4} {t['count']:>3} {t['predicted_gib']:>9.2f} "
                  f"{t['measured_gib_max']:>9.2f} {t['max_abs_rel_err']:>8.1%}")
    for x in arms:
        x.pop("memory", None)
        if "summary" in x:
            x["summary"].pop("losses", None)
    Path(a.out).write_text(json.dumps({"commit": a.commit, "reference_arm": REFERENCE_ARM, "arms": arms}, indent=1) + "\n")
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
