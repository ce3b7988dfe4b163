"""The memory model's last-block term, checked against every recorded run.

With the last block NOT checkpointed (n < L) the backward starts (head, loss) on top of a whole last block;
with every block checkpointed it starts on top of L block inputs and recomputes the last block afterwards.
``calibrate`` measures both at two depths, so the difference of the rest of the model between the two
modes, ``d = E(none) - E(all)``, is in every profile's raw rows; the memory model lacked it (it used
``E(all)`` for every n), which under-predicted the equal-token baseline's ~520k-token micro-batches
(n = 29) by 3.4-3.7%. This script

1. fits ``d`` from the shipped H200 profiles' raw rows (``calibrate.checkpoint_fit``, both LayerNorm-modulate
   entries) and with ``--write`` stores it in ``memory.checkpointing.last_block_whole``;
2. with ``--merge-fused-14b JSON`` makes that fused-op calibration the 14B profile's top level and keeps the
   former (reference-path) calibration under ``ln_modulate_variants.reference`` (as `bench/memory_recheck.py` did for 1.3B);
3. recomputes predicted vs measured peak memory per micro-step of recorded runs (a trainer's memory.jsonl)
   without and with the term, and prints one table of predicted/measured ratios per run; writes JSON.

    python bench/memory_last_block.py --write --merge-fused-14b bench/results/mem16c/h200-wan2.1-14b-fused.json \
        --out bench/results/mem16c/last_block.json
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from pathlib import Path

import numpy as np

from ds_adaptive.calibration.fit import checkpoint_fit
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import PROFILES_DIR, Profile

# (label, memory.jsonl, LayerNorm-modulate path of the run, what it was)
RUNS = (
    ("baseline (memory16)", "bench/results/memory16/mem_baseline_auto.jsonl", "reference",
     "zero3_baseline.json, 3 steps, 1 H200, f4eaebc"),
    ("baseline (memory)", "bench/results/memory/mem_baseline_auto.jsonl", "reference",
     "zero3_baseline.json, 2 steps, 1 H200, bc9c857"),
    ("baseline (mem16c)", "bench/results/mem16c/mem_baseline_auto.jsonl", "reference",
     "zero3_baseline.json, 3 steps, 1 H200, 6e4e0bf: planned WITH the term (n = 30)"),
    ("auto ref (memory16)", "bench/results/memory16/mem_adaptive_auto.jsonl", "reference", "150 samples, 6be0184"),
    ("all ref (memory16)", "bench/results/memory16/mem_adaptive_all.jsonl", "reference", "150 samples, 6be0184"),
    ("auto fused (mem16c)", "bench/results/mem16c/mem_adaptive_auto.jsonl", "fused", "350 samples, 38db71e"),
    ("all fused (mem16c)", "bench/results/mem16c/mem_adaptive_all.jsonl", "fused", "350 samples, 38db71e"),
)


def last_block_term(d: dict) -> dict | None:
    """``memory.checkpointing.last_block_whole`` fitted from a profile (or variant) dict's raw rows."""
    raw = (d.get("measurements") or {}).get("raw")
    fit = checkpoint_fit(raw) if raw else None
    return None if fit is None else fit["memory"].get("last_block_whole")


def add_last_block(d: dict) -> dict:
    """The profile dict with the term stored in its top level and every LayerNorm-modulate variant."""
    out = copy.deepcopy(d)
    for part in [out, *(out.get("ln_modulate_variants") or {}).values()]:
        term = last_block_term(part)
        if term is not None and "checkpointing" in part.get("memory", {}):
            part["memory"]["checkpointing"]["last_block_whole"] = term
    return out


def merge_fused(shipped: dict, fused: dict, note: str) -> dict:
    """``fused`` (a ``calibrate --ln-modulate fused`` profile) as the top level, ``shipped``'s own calibration
    (a reference-path profile) under ``ln_modulate_variants.reference``; other shipped keys kept."""
    if fused.get("ln_modulate") != "fused" or shipped.get("ln_modulate", "reference") != "reference":
        raise SystemExit(f"merge_fused: expected a fused calibration and a reference profile, got "
                         f"{fused.get('ln_modulate')!r} and {shipped.get('ln_modulate', 'reference')!r}")
    out = {**copy.deepcopy(shipped), **copy.deepcopy(fused)}
    out["source"] = f"{fused['source']}  [{note}]"
    out["ln_modulate_variants"] = {"reference": {k: copy.deepcopy(shipped[k]) for k in
                                                 ("source", "date", "compute", "memory", "measurements")}}
    return out


def _cost(profile: Profile, with_term: bool) -> CostModel:
    pr = profile if with_term else dataclasses.replace(profile, last_whole_gib=(0.0, 0.0))
    return CostModel(pr, "calibrated", checkpointing="auto")


def recheck(path: str, profile: Profile) -> dict:
    """Per micro-step: measured, predicted without / with the term (the run's own static memory)."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    models = {"old": _cost(profile, False), "new": _cost(profile, True)}
    out = []
    for r in rows:
        rec = {k: r[k] for k in ("step", "micro", "shape", "tokens", "B", "ckpt_blocks", "measured_gib")}
        for key, cost in models.items():
            rec[f"{key}_gib"] = r["static_gib"] + float(cost.ckpt_memory(int(r["tokens"]), r["B"], r["ckpt_blocks"]))
            rec[f"{key}_ratio"] = rec[f"{key}_gib"] / r["measured_gib"]
        out.append(rec)
    summary = {}
    for part, sel in (("steps>1", [x for x in out if x["step"] > 1]), ("step 1", [x for x in out if x["step"] == 1])):
        if sel:
            summary[part] = {f"{k}_{f.__name__}": float(f([x[f"{k}_ratio"] for x in sel]))
                             for k in ("old", "new") for f in (np.min, np.max)}
            summary[part]["micro_steps"] = len(sel)
    return {"rows": out, "summary": summary}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="store the term in the shipped H200 profiles")
    ap.add_argument("--merge-fused-14b", default=None, help="a 14B fused-op calibration json to make the shipped "
                    "h200-wan2.1-14b.json's top level (reference kept as a variant)")
    ap.add_argument("--commit", default="unknown", help="commit of the merged calibration (for its source note)")
    ap.add_argument("--out", required=True, help="JSON to write")
    a = ap.parse_args()
    names = ("h200-wan2.1-1.3b", "h200-wan2.1-14b")
    dicts = {n: json.loads((PROFILES_DIR / f"{n}.json").read_text()) for n in names}
    if a.merge_fused_14b:
        dicts[names[1]] = merge_fused(dicts[names[1]], json.loads(Path(a.merge_fused_14b).read_text()),
                                      f"bench/gpu_memory.sh PURPOSE=fused_arm CALIB14=1, commit {a.commit}; "
                                      "ln_modulate_variants.reference: the former reference-path calibration")
    dicts = {n: add_last_block(d) for n, d in dicts.items()}
    terms = {}
    print(f"{'profile':<18} {'path':<10} {'d MiB/sample':>12} {'d KiB/token':>11} {'c KiB/token':>11} "
          f"{'at 75,600 tok GiB':>17}")
    for n, d in dicts.items():
        for path, part in [(d.get("ln_modulate", "reference"), d), *(d.get("ln_modulate_variants") or {}).items()]:
            ck = part["memory"]["checkpointing"]
            t = ck.get("last_block_whole")
            if t is None:
                continue
            terms[f"{n}/{path}"] = {k: t[k] for k in ("m0_gib", "m1_gib_per_token")}
            print(f"{n:<18} {path:<10} {t['m0_gib'] * 1024:>12.2f} {t['m1_gib_per_token'] * 2**20:>11.2f} "
                  f"{ck['block_checkpointed']['m1_gib_per_token'] * 2**20:>11.2f} "
                  f"{t['m0_gib'] + 75600 * t['m1_gib_per_token']:>17.3f}")
    if a.write:
        for n, d in dicts.items():
            (PROFILES_DIR / f"{n}.json").write_text(json.dumps(d, indent=1) + "\n")
            print(f"wrote {PROFILES_DIR / (n + '.json')}")
    base = Profile.from_dict(dicts[names[0]], where=names[0])
    results = {}
    print("\npredicted / measured peak memory per micro-step (static as logged), without -> with the term")
    print(f"{'run':<22} {'steps':<8} {'n':>4} {'old min':>8} {'old max':>8} {'new min':>8} {'new max':>8}")
    for label, path, ln, what in RUNS:
        if not Path(path).exists():
            continue
        res = recheck(path, base.for_ln_modulate(ln)[0])
        res["what"], res["ln_modulate"], res["memory"] = what, ln, path
        results[label] = res
        for part, s in res["summary"].items():
            print(f"{label:<22} {part:<8} {s['micro_steps']:>4} {s['old_min']:>8.3f} {s['old_max']:>8.3f} "
                  f"{s['new_min']:>8.3f} {s['new_max']:>8.3f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"terms": terms, "runs": results}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
