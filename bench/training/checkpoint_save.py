"""What content checksums add to a checkpoint save: the trainer's ``write_checkpoint`` vs the save it replaced.

Arms, each a complete save of the same engine state into a fresh tag directory (deleted after each save;
``os.sync()`` between saves, untimed), interleaved over ``--repeats`` rounds after one untimed warm-up save:

* ``baseline``: DeepSpeed's ``save_checkpoint(save_latest=False)`` + the size-only completeness marker
  (what ``ds_adaptive.training.checkpoint.write_checkpoint`` did before checksums; torch's per-record CRC32 on);
* ``checksums``: ``write_checkpoint`` as the trainer runs it: XXH3-128 (else BLAKE2b) of every file computed
  while it is written, torch's unchecked CRC32 off meanwhile;
* ``checksums+crc32``: the same with torch's CRC32 left on (the cost of the hash alone).

Also timed: ``verify``, the resume-side check of the last checkpoint (``check_checkpoint``: every byte read
and hashed), and with ``--hashes`` the throughput of each hash on random bytes in memory.

    # one GPU (the figure: Wan 2.1 1.3B under ZeRO-3, bf16, AdamW; ~17 GB per save)
    python bench/training/checkpoint_save.py --out bench/out/checkpoint_save.json
    # CPU: a synthetic state of --synthetic-gib GiB in --files files through DeepSpeed's torch writer
    python bench/training/checkpoint_save.py --synthetic-gib 1 --files 4 --hashes --out /tmp/checkpoint_save_cpu.json

Prints one table (seconds: median and min of the repeats, GB/s, ratio to ``baseline``) and writes JSON.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GB = 1e9


def hash_throughput(mib: int = 256) -> dict:
    """GB/s of each hash over ``mib`` MiB of random bytes in memory (64 MiB updates)."""
    from ds_adaptive.training.checksum import ALGORITHMS

    data = memoryview(os.urandom(1 << 20) * mib)
    candidates = {name: make for name, make in ALGORITHMS.items()}
    candidates.update({"sha1": hashlib.sha1, "sha256": hashlib.sha256})
    out = {}
    for name, make in candidates.items():
        h = make()
        t = time.perf_counter()
        for i in range(0, len(data), 64 << 20):
            h.update(data[i:i + (64 << 20)])
        out[name] = len(data) / (time.perf_counter() - t) / GB
    crc, t = 0, time.perf_counter()
    for i in range(0, len(data), 64 << 20):
        crc = zlib.crc32(data[i:i + (64 << 20)], crc)
    out["zlib.crc32"] = len(data) / (time.perf_counter() - t) / GB
    return out


def baseline_save(engine, save_dir: Path, tag: str, client_state: dict) -> None:
    """The save before checksums: DeepSpeed's files, then the size-only marker, then ``latest``."""
    from ds_adaptive.training.checkpoint import MARKER, _atomic_write, _files, write_latest

    engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state, save_latest=False)
    _atomic_write(save_dir / tag / MARKER, json.dumps({"tag": tag, "files": _files(save_dir / tag)}) + "\n")
    write_latest(save_dir, tag)


def checksum_save(engine, save_dir: Path, tag: str, client_state: dict, *, torch_crc32: bool = False) -> None:
    import ds_adaptive.training.checkpoint as ck
    from ds_adaptive.training.checksum import HashingSaves

    saves = ck.HashingSaves
    ck.HashingSaves = functools.partial(HashingSaves, torch_crc32=torch_crc32)
    try:
        ck.write_checkpoint(engine, save_dir, tag, client_state, step=1, keep=0, run_id="bench", log=lambda m: None)
    finally:
        ck.HashingSaves = saves


def deepspeed_engine(model_name: str, layers) -> tuple[object, str]:
    """A one-process ZeRO-3 engine of the Wan preset (bf16 on a GPU, fp32 on the CPU) with AdamW."""
    import deepspeed
    import torch

    from ds_adaptive.core.ds_config import prepare_ds_config, read_ds_config
    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.models.wan_config import get_wan_config
    from ds_adaptive.training.engine import init_distributed

    _, _, device = init_distributed(0)
    raw = dict(read_ds_config(ROOT / "launch" / "configs" / "zero3_adaptive.json"))
    raw["gradient_accumulation_steps"] = 1
    raw.get("adaptive_load", {}).get("sampler", {}).pop("global_batch", None)  # a pinned A/B: its own gas, not the shipped global batch
    ds_config = prepare_ds_config(raw, dp_size=1, on_gpu=device.type == "cuda")
    cfg = get_wan_config(model_name, **({"num_layers": layers} if layers else {}))
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = WanModel(cfg)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=list(model.parameters()))
    n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    what = (f"{model_name} ({cfg.num_layers} blocks, {n / 1e9:.3f}B params), ZeRO-3, "
            f"{'bf16' if ds_config['bf16']['enabled'] else 'fp32'}, AdamW, {device.type}")
    if device.type == "cuda":
        what += f" ({torch.cuda.get_device_name()})"
    return engine, what


def synthetic_engine(gib: float, files: int) -> tuple[object, str]:
    """An object with DeepSpeed's torch checkpoint engine and a ``save_checkpoint`` that writes ``files``
    files of random fp32 tensors (``gib`` GiB in all), as ZeRO ranks write their shards."""
    import torch
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    ckpt_engine = TorchCheckpointEngine()
    ckpt_engine.zipfile_serialization = True  # DeepSpeed's default checkpoint serialization
    per = int(gib * (1 << 30) / 4 / files)
    states = [{"flat": torch.randn(per), "small": [torch.randn(1000) for _ in range(50)], "step": 1}
              for _ in range(files)]

    def save_checkpoint(save_dir, tag, client_state, save_latest):
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        ckpt_engine.save({"module": {}, **client_state}, str(d / "mp_rank_00_model_states.pt"))
        for i, state in enumerate(states):
            ckpt_engine.save(state, str(d / f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt"))

    return (SimpleNamespace(checkpoint_engine=ckpt_engine, save_checkpoint=save_checkpoint),
            f"synthetic: {files} files, {gib:g} GiB of fp32, DeepSpeed's torch checkpoint engine")


def run(args) -> dict:
    from ds_adaptive.training.checkpoint import check_checkpoint
    from ds_adaptive.training.checksum import ALGORITHM

    engine, what = (synthetic_engine(args.synthetic_gib, args.files) if args.synthetic_gib
                    else deepspeed_engine(args.model, args.layers))
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    arms = {"baseline": baseline_save, "checksums": checksum_save,
            "checksums+crc32": functools.partial(checksum_save, torch_crc32=True)}
    times: dict[str, list[float]] = {a: [] for a in arms}
    size = 0
    verify_s = None
    client = {"ds_adaptive": {"global_step": 1}}
    rounds = [("warm-up", ["checksums"])] + [(r, list(arms)) for r in range(1, args.repeats + 1)]
    for r, names in rounds:  # the warm-up save (untimed): first-touch of the CPU copies, the writer's imports
        for name in names:
            fn = arms[name]
            tag = f"global_step{r}_{name.replace('+', '_')}".replace("-", "_")
            os.sync()  # the previous save's files are deleted: nothing left to write back
            t = time.perf_counter()
            fn(engine, root, tag, client)
            dt = time.perf_counter() - t
            size = sum(f.stat().st_size for f in (root / tag).iterdir() if f.is_file())
            if r != "warm-up":
                times[name].append(dt)
            if name == "checksums" and r == args.repeats:
                t = time.perf_counter()
                problem = check_checkpoint(root / tag)
                verify_s = time.perf_counter() - t
                assert problem is None, problem
            shutil.rmtree(root / tag)
    shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(times["baseline"])
    rows = {name: {"median_s": statistics.median(v), "min_s": min(v), "all_s": v,
                   "gb_per_s": size / statistics.median(v) / GB, "ratio_to_baseline": statistics.median(v) / base}
            for name, v in times.items()}
    return {"what": what, "bytes_per_checkpoint": size, "algorithm": ALGORITHM, "repeats": args.repeats,
            "arms": rows, "verify_s": verify_s, "verify_gb_per_s": size / verify_s / GB if verify_s else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--model", default="wan2.1-1.3b", help="Wan preset (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=None, help="number of blocks (default: the preset's)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed rounds of every arm (default 2, after one untimed warm-up save)")
    ap.add_argument("--dir", default="/tmp/ds_adaptive_checkpoint_bench", help="where the checkpoints are written")
    ap.add_argument("--synthetic-gib", type=float, default=0.0,
                    help="instead of a Wan engine: this many GiB of random tensors through DeepSpeed's torch writer")
    ap.add_argument("--files", type=int, default=4, help="--synthetic-gib: number of files (ranks' shards)")
    ap.add_argument("--hashes", action="store_true", help="also the throughput of each hash in memory")
    args = ap.parse_args(argv)
    res = {"host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count()}
    if args.hashes:
        res["hash_gb_per_s"] = hash_throughput()
    res.update(run(args))
    print(f"checkpoint save, {res['what']}: {res['bytes_per_checkpoint'] / GB:.2f} GB per checkpoint, "
          f"hash {res['algorithm']}, {args.repeats} repeat(s)")
    print(f"  {'arm':<16} {'median s':>9} {'min s':>8} {'GB/s':>6} {'/ baseline':>10}")
    for name, row in res["arms"].items():
        print(f"  {name:<16} {row['median_s']:9.3f} {row['min_s']:8.3f} {row['gb_per_s']:6.2f} "
              f"{row['ratio_to_baseline']:10.3f}")
    if res.get("verify_s"):
        print(f"  verify (resume / export check of one checkpoint): {res['verify_s']:.3f} s, "
              f"{res['verify_gb_per_s']:.2f} GB/s")
    for name, gbs in (res.get("hash_gb_per_s") or {}).items():
        print(f"  hash {name:<12} {gbs:6.2f} GB/s in memory")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
