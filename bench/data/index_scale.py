#!/usr/bin/env python
"""The dataset index at scale: index.arrow against the old index.json, 100k / 1M / 10M samples, one CPU process.

    python bench/data/index_scale.py                                   # arrow 100k, 1M, 10M; JSON 100k, 1M
    python bench/data/index_scale.py --sizes 100000 --json-sizes 100000 --out /tmp/index_scale.json

The entries are what ``ds-adaptive preprocess`` writes: ids ``<item>-<clip>``, ~64 samples per shard (one
shard per work unit), shapes drawn from the default model's mix, text lengths 16..512, and (``--meta``, on
by default) each sample's ``source`` path and a video clip's ``start_s``. No shard file exists: opening
reads none (shards are checked lazily), which is what a rank does at start-up.

Per index and size:

* write: entries -> index file, as preprocess's finalize does (arrow: ``IndexBuilder.add_entries`` per work
  unit of 64 samples, then ``write``; JSON: the old writer, ``write_legacy_index``, one call). The entries'
  generation is not timed.
* in a fresh process (``VmHWM``, so each figure is that process's peak): RSS after the imports (Python,
  torch, ds_adaptive), open time and peak RSS after opening, time for every shape id + the unique shapes
  (what the planner needs; for JSON the old API: ``sample_shapes()`` + ``planning.planner.unique_shapes``),
  time for one rank (a contiguous 1/64 of the samples) to read 1,000 of its entries, and the per-sample
  ``sample_shapes()`` list + ``unique_shapes`` that the sampler still builds (and the peak RSS after it).

The JSON figures are those of the reader before index.arrow: the package of ``--old-commit`` (``git
archive``), opened with ``verify=False`` (its default also opened every shard's header, so its open time
here is a lower bound). A JSON index of 10M samples (~3 GB of text, ~15 GB of Python objects) is not
written: its figures are extrapolated linearly from the two measured sizes, and marked so.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ds_adaptive.core.shapes import load_shape_distribution  # noqa: E402
from ds_adaptive.data import IndexBuilder, write_legacy_index  # noqa: E402

OLD_COMMIT = "cf60f30"        # the last commit whose datasets had only index.json
PER_UNIT = 64                 # samples per work unit = per shard
RANKS = 64
MEASURE = r"""
import json, sys, time
import numpy as np
from ds_adaptive.data.shards import LatentShardDataset
from ds_adaptive.planning.planner import unique_shapes
def rss():  # peak RSS of this process image, MiB (VmHWM; ru_maxrss would carry the parent's peak across exec)
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024
out = {"rss_imports_mb": rss()}
root, new = sys.argv[1], sys.argv[2] == "arrow"
t = time.perf_counter(); ds = LatentShardDataset(root, verify=False)
out["open_s"], out["rss_open_mb"] = time.perf_counter() - t, rss()
t = time.perf_counter()
if new:
    ids, uniq = ds.shape_ids(), ds.unique_shapes(); counts = np.bincount(ids, minlength=len(uniq))
else:
    uniq, ids = unique_shapes(ds.sample_shapes())
out["shape_ids_s"], out["rss_shapes_mb"], out["unique"] = time.perf_counter() - t, rss(), len(uniq)
n = len(ds); lo = n // 64 * 37
t = time.perf_counter(); rows = [ds.entries[i] for i in range(lo, lo + 1000)]
out["rank_1k_entries_ms"] = 1e3 * (time.perf_counter() - t)
out["package"] = __import__("ds_adaptive").__file__
if new:
    t = time.perf_counter(); u2, i2 = unique_shapes(ds.sample_shapes())
    out["sample_shapes_s"], out["rss_sample_shapes_mb"] = time.perf_counter() - t, rss()
    assert u2 == uniq and np.array_equal(i2, ids)
print(json.dumps(out))
"""


def entries(lo: int, hi: int, shapes, weights, meta: bool) -> list[dict]:
    """Index entries of samples lo..hi, preprocess-like and deterministic (two clips per input item)."""
    rng = np.random.default_rng([lo, 7])
    pick = rng.choice(len(shapes), size=hi - lo, p=weights)
    text = rng.integers(16, 513, hi - lo)
    out = []
    for n, i in enumerate(range(lo, hi)):
        s = shapes[pick[n]]
        sid = f"{i // 2:08d}-{i % 2:03d}"
        e = {"id": sid, **s.as_dict(), "latent_shape": list(s.latent_shape), "text_len": int(text[n]),
             "file": f"shard-{i // PER_UNIT:05d}-00000.safetensors", "latents_key": f"{sid}.latents",
             "context_key": f"{sid}.context"}
        if meta:
            e["source"] = f"/data/videos/{i // 2000:05d}/{i // 2:08d}.mp4"
            if not s.is_image:
                e["start_s"] = round(5.0 * (i % 2), 6)
        out.append(e)
    return out


def write_arrow(out: Path, n: int, mix, meta: bool) -> float:
    builder, spent = IndexBuilder(), 0.0
    for lo in range(0, n, PER_UNIT):
        chunk = entries(lo, min(lo + PER_UNIT, n), *mix, meta)
        t = time.perf_counter()
        builder.add_entries(chunk)
        spent += time.perf_counter() - t
    t = time.perf_counter()
    builder.write(out)
    return spent + time.perf_counter() - t


def write_json(out: Path, n: int, mix, meta: bool) -> float:
    rows = entries(0, n, *mix, meta)
    t = time.perf_counter()
    write_legacy_index(out, rows)
    return time.perf_counter() - t


def measure(root: Path, kind: str, pythonpath: Path, repeat: int) -> dict:
    """The figures of ``repeat`` fresh processes: the smallest time of each (the machine may be shared) and the
    largest RSS."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "OMP_NUM_THREADS": "1"}
    runs = []
    for _ in range(repeat):
        # cwd: not the checkout, whose ds_adaptive/ would shadow PYTHONPATH (python -c puts the cwd first)
        r = subprocess.run([sys.executable, "-c", MEASURE, str(root), kind], env=env, capture_output=True, text=True,
                           cwd=root.parent)
        if r.returncode:
            raise SystemExit(f"bench/data/index_scale.py: measuring {root} failed:\n{r.stderr[-3000:]}")
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return {k: (max if k.startswith("rss") else min)(r[k] for r in runs) if k != "package" else runs[0][k]
            for k in runs[0]}


def old_package(tmp: Path, commit: str) -> Path:
    """The ds_adaptive package of ``commit`` (git archive) under ``tmp``."""
    dest = tmp / f"old-{commit}"
    if not (dest / "ds_adaptive").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "ds_adaptive"], capture_output=True, check=True)
        with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
            t.extractall(dest)
    return dest


def run_one(kind: str, n: int, tmp: Path, mix, meta: bool, pythonpath: Path, repeat: int) -> dict:
    d = tmp / f"{kind}-{n}"
    d.mkdir(parents=True, exist_ok=True)
    write_s = (write_arrow if kind == "arrow" else write_json)(d, n, mix, meta)
    path = d / ("index.arrow" if kind == "arrow" else "index.json")
    row = {"index": kind, "samples": n, "write_s": write_s, "file_mb": path.stat().st_size / 2**20,
           **measure(d, kind, pythonpath, repeat), "measured": True}
    path.unlink()
    print(f"  {kind} {n}: done", file=sys.stderr, flush=True)
    return row


def extrapolate(rows: list[dict], n: int) -> dict:
    """Linear in the samples from the two largest measured JSON rows (RSS: its growth over the imports)."""
    a, b = sorted((r for r in rows if r["index"] == "json"), key=lambda r: r["samples"])[-2:]
    f = (n - b["samples"]) / (b["samples"] - a["samples"])
    out = {"index": "json", "samples": n, "measured": False, "unique": b["unique"]}
    for k in ("write_s", "file_mb", "open_s", "shape_ids_s", "rss_open_mb", "rss_shapes_mb"):
        out[k] = b[k] + f * (b[k] - a[k])
    out["rss_imports_mb"], out["rank_1k_entries_ms"] = b["rss_imports_mb"], b["rank_1k_entries_ms"]
    return out


def table(rows: list[dict]) -> str:
    head = (f"{'index':<6} {'samples':>10} {'write s':>8} {'file MB':>8} {'open s':>7} {'RSS MB':>15} "
            f"{'shapes s':>8} {'rank 1k ms':>10} {'sample_shapes() s / RSS MB':>26}")
    lines = [head, "-" * len(head)]
    for r in rows:
        star = "" if r["measured"] else " *"
        rss = f"{r['rss_imports_mb']:.0f}->{max(r['rss_open_mb'], r['rss_shapes_mb']):.0f}"
        compat = (f"{r['sample_shapes_s']:.2f} / {r['rss_sample_shapes_mb']:.0f}" if "sample_shapes_s" in r
                  else "(is the shapes column)")
        lines.append(f"{r['index']:<6} {r['samples']:>10,} {r['write_s']:>8.2f} {r['file_mb']:>8.1f} "
                     f"{r['open_s']:>7.3f} {rss:>15} {r['shape_ids_s']:>8.3f} {r['rank_1k_entries_ms']:>10.1f} "
                     f"{compat:>26}{star}")
    lines.append("RSS MB: after the imports -> peak after open + shape ids (VmHWM of a fresh process). "
                 "* extrapolated linearly from the measured JSON sizes, not measured.")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    p.add_argument("--json-sizes", type=int, nargs="*", default=[100_000, 1_000_000])
    p.add_argument("--extrapolate-json", type=int, nargs="*", default=[10_000_000])
    p.add_argument("--no-meta", action="store_true", help="entries without source / start_s")
    p.add_argument("--old-commit", default=OLD_COMMIT)
    p.add_argument("--repeat", type=int, default=2, help="fresh processes per measurement (smallest time kept)")
    p.add_argument("--tmp", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--out", default=None, help="JSON results (default: bench/results/index_scale_cpu_<commit>.json)")
    args = p.parse_args(argv)
    dist = load_shape_distribution(None)
    w = np.array([s.weight for s in dist], dtype=np.float64)
    mix = ([s.shape for s in dist], w / w.sum())
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        tmp = Path(tmp)
        old = old_package(tmp, args.old_commit) if args.json_sizes else None
        rows = [run_one("arrow", n, tmp, mix, not args.no_meta, ROOT, args.repeat) for n in args.sizes]
        rows += [run_one("json", n, tmp, mix, not args.no_meta, old, args.repeat) for n in args.json_sizes]
    if len(args.json_sizes) >= 2:
        rows += [extrapolate(rows, n) for n in args.extrapolate_json]
    print(table(rows))
    result = {"bench": "index_scale", "commit": commit, "old_commit": args.old_commit, "meta": not args.no_meta,
              "samples_per_shard": PER_UNIT, "repeat": args.repeat, "cpu": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "python": platform.python_version(), "pyarrow": pyarrow.__version__,
              "rows": rows}
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"index_scale_cpu_{commit}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
