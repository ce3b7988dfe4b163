"""The preprocess job: media + captions -> latent shards of a model that ``train --data DIR`` reads.
``ds-adaptive preprocess`` (``ds_adaptive/cli/preprocess.py``, which says how to run it) calls :func:`run`.

The input is split into work units of ``items_per_unit`` consecutive items; rank r of WORLD_SIZE takes units
r, r + W, ... No process group is needed: a unit is finished when its record ``parts/unit-NNNNN.json`` exists
(written after its shard files ``shard-NNNNN-*``, each renamed into place when complete), so a rerun skips
finished units and gives the same bytes. The process that finishes the last unit writes ``index.arrow``,
``rejects.jsonl`` and ``report.json`` (:func:`finalize`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ds_adaptive.core.shapes import SampleShape
from ds_adaptive.data.index import INDEX_FILE, LEGACY_INDEX_FILE, IndexBuilder, find_index
from ds_adaptive.data.shards import LatentShardWriter
from ds_adaptive.preprocess.manifest import MediaItem, read_inputs
from ds_adaptive.preprocess.media import MediaError, decode_item
from ds_adaptive.preprocess.policy import ShapePolicy, model_from_args, policy_from_args
from ds_adaptive.data.shards import EMPTY_PROMPT_FILE, write_empty_prompt
from ds_adaptive.media.encode import LatentEncoders, component_dirs

if TYPE_CHECKING:
    from argparse import Namespace

SETTINGS_FILE = "preprocess.json"
REJECTS_FILE = "rejects.jsonl"
REPORT_FILE = "report.json"
PARTS_DIR = "parts"
FORMAT_VERSION = 1


class PreprocessError(ValueError):
    """The job cannot start (bad arguments, a different job's output in --out)."""


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)  # open(): the user's umask applies (mkstemp would force 0600)
    os.replace(tmp, path)


def rank_info(local_rank_arg: Optional[int] = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", local_rank_arg if local_rank_arg is not None else 0))
    if not 0 <= rank < world:
        raise PreprocessError(f"RANK={rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    return rank, world, local


def units_of(n_items: int, per_unit: int) -> list[range]:
    """Consecutive item ranges of ``per_unit`` items (the last may be shorter)."""
    return [range(s, min(s + per_unit, n_items)) for s in range(0, n_items, per_unit)]


def _unit_record(out: Path, k: int) -> Path:
    return out / PARTS_DIR / f"unit-{k:05d}.json"


def _reject(item: MediaItem, reason: str) -> dict:
    return {"index": item.index, "path": item.path, "where": item.where, "reason": reason}


def _reason_kind(reason: str) -> str:
    """'too short: 3 frame(s) ...' -> 'too short' (the report counts rejects per kind)."""
    return reason.split(":")[0].split(" (")[0].strip()


class _DecodeSet:
    """Map-style dataset for a DataLoader: item -> decoded clips (uint8 tensors) or a reject reason."""

    def __init__(self, items: list[MediaItem], policy: ShapePolicy) -> None:
        self.items, self.policy = items, policy

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        import torch

        item = self.items[i]
        try:
            d = decode_item(item, self.policy)
        except MediaError as exc:
            return {"i": i, "error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a bad file must become a reject, never end the job
            return {"i": i, "error": f"unexpected error while decoding ({type(exc).__name__}: {exc})"}
        return {"i": i, "error": None, "clips": [torch.from_numpy(c) for c in d.clips], "starts": d.starts,
                "frames": d.source_frames, "seconds": d.seconds, "upscale": d.upscale}


def settings_of(args: Namespace, items: list[MediaItem], policy: ShapePolicy, storage_dtype: str) -> dict:
    """What determines the output bytes; a resumed job must match it exactly."""
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps([it.path, it.caption, it.start, it.end, it.fps, it.problem]).encode())
    models = {k: (str(Path(v).resolve()) if v else None)
              for k, v in (("pipeline", args.pipeline), ("vae", args.vae), ("text_encoder", args.text_encoder),
                           ("tokenizer", args.tokenizer))}
    return {"format_version": FORMAT_VERSION, "model": model_from_args(args).name,
            "input": str(Path(args.input).resolve()), "num_items": len(items),
            "items_sha256": h.hexdigest(), "policy": policy.model_dump(), "models": models,
            "compute_dtype": args.dtype, "storage_dtype": storage_dtype, "vae_tiling": args.vae_tiling,
            "vae_batch": args.vae_batch, "text_len": args.text_len, "items_per_unit": args.items_per_unit,
            "shard_mb": args.shard_mb}


def _check_settings(out: Path, settings: dict, overwrite: bool, world: int) -> None:
    path = out / SETTINGS_FILE
    ours = [out / SETTINGS_FILE, out / PARTS_DIR, out / INDEX_FILE, out / LEGACY_INDEX_FILE, out / REJECTS_FILE,
            out / REPORT_FILE, out / EMPTY_PROMPT_FILE]
    if overwrite:
        if world > 1:
            raise PreprocessError("--overwrite clears --out and cannot run under several ranks (they would race); "
                                  f"delete {out} or run once with one process")
        for p in ours:
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        for p in out.glob("shard-*.safetensors*"):
            p.unlink()
    if path.is_file():
        old = json.loads(path.read_text())
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if diff:
            rows = "; ".join(f"{k}: was {old.get(k)!r}, now {settings.get(k)!r}" for k in diff)
            raise PreprocessError(f"{out} holds the output of a different preprocess job ({rows}). Resuming would "
                                  "mix two datasets: pass the same arguments, another --out, or --overwrite")
        return
    found = find_index(out)
    if found is not None:
        raise PreprocessError(f"{out} already holds a dataset ({found.name}) not written by preprocess; pick another "
                              "--out or pass --overwrite")
    out.mkdir(parents=True, exist_ok=True)
    (out / PARTS_DIR).mkdir(exist_ok=True)
    _atomic_write(path, json.dumps(settings, indent=1) + "\n")


def _encode_unit(k: int, unit: range, results, items: list[MediaItem], encoders, args, storage_dtype: str,
                 out: Path, bar) -> dict:
    """Decode (from the loader), encode and write unit ``k``; returns its record (written last)."""
    import torch

    stats = Counter()
    rejects, accepted = [], []  # accepted: (item, [(shape, start, latents)])
    pending: list = []          # consecutive same-shape clips waiting for one VAE call

    def flush() -> None:
        if not pending:
            return
        t0 = time.perf_counter()
        lat = encoders.encode_video(torch.stack([c for _, _, c in pending]))
        stats["vae_s"] += time.perf_counter() - t0
        for (slot, pos, _), z in zip(pending, lat):
            slot[pos] = z
        pending.clear()

    for _ in unit:
        r = next(results)
        item = items[r["item"]]
        if r["error"] is not None:
            rejects.append(_reject(item, r["error"]))
            stats["rejects"] += 1
        else:
            stats["decode_s"] += r["seconds"]
            stats["sampled_frames"] += r["frames"]
            latents: list = [None] * len(r["clips"])
            for pos, clip in enumerate(r["clips"]):
                if pending and (pending[0][2].shape != clip.shape or len(pending) >= args.vae_batch):
                    flush()
                pending.append((latents, pos, clip))
            accepted.append((item, r["starts"], [tuple(c.shape[:3]) for c in r["clips"]], latents))
            stats["images" if item.is_image else "videos"] += 1
            stats["upscaled"] += int(r["upscale"] > 1 + 1e-6)   # said in the report, never silent
        stats["items"] += 1
        if bar is not None:
            bar.n_clips = getattr(bar, "n_clips", 0) + (0 if r["error"] else len(r["clips"]))
            bar.n_rejects = getattr(bar, "n_rejects", 0) + (1 if r["error"] else 0)
            bar.set_postfix(clips=bar.n_clips, rejects=bar.n_rejects, refresh=False)
            bar.update(1)
    flush()
    t0 = time.perf_counter()
    captions = [item.caption for item, *_ in accepted]
    contexts = []
    for s in range(0, len(captions), args.text_batch):
        contexts += encoders.encode_text(captions[s: s + args.text_batch])
    stats["truncated_captions"] += sum(
        len(encoders.tokenizer(c, add_special_tokens=True).input_ids) > encoders.text_len for c in captions)
    stats["text_s"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    writer = LatentShardWriter(out, shard_bytes=int(args.shard_mb * 2**20), dtype=storage_dtype,
                               prefix=f"shard-{k:05d}", index=False, spec=encoders.spec)
    shapes = Counter()
    for (item, starts, clip_shapes, latents), ctx in zip(accepted, contexts):
        for pos, (shape_t, start, z) in enumerate(zip(clip_shapes, starts, latents)):
            shape = SampleShape(*shape_t, encoders.spec.grid)
            meta = {"source": item.path} if item.is_image else {"source": item.path, "start_s": round(start, 6)}
            # clips of one video share the caption: one copy each (safetensors refuses shared storage)
            writer.add(f"{item.index:08d}-{pos:03d}", shape, z, ctx if pos == 0 else ctx.clone(), meta=meta)
            shapes[str(shape)] += 1
    writer.close()
    stats["write_s"] += time.perf_counter() - t0
    stats["clips"] += sum(shapes.values())
    record = {"unit": k, "items": [unit.start, unit.stop], "samples": writer.entries, "rejects": rejects,
              "shapes": dict(sorted(shapes.items())), "stats": {key: round(v, 6) for key, v in sorted(stats.items())}}
    _atomic_write(_unit_record(out, k), json.dumps(record) + "\n")
    return record


def finalize(out: Path, n_units: int, spec=None) -> Optional[dict]:
    """When every unit record exists: write index.arrow (latents for ``spec``, the model's inputs),
    rejects.jsonl and report.json; else None. The records are read one at a time (the index holds compact
    columns, not every sample's entry)."""
    if not all(_unit_record(out, k).is_file() for k in range(n_units)):
        return None
    builder, rejects = IndexBuilder(), []
    totals, shapes = Counter(), Counter()
    for k in range(n_units):
        r = json.loads(_unit_record(out, k).read_text())
        builder.add_entries(r["samples"])
        rejects += r["rejects"]
        totals.update(r["stats"])
        shapes.update(r["shapes"])
    _atomic_write(out / REJECTS_FILE, "".join(json.dumps(x) + "\n" for x in rejects))
    if builder.num_rows:
        builder.write(out, spec=spec)
        (out / LEGACY_INDEX_FILE).unlink(missing_ok=True)   # this job's index from before index.arrow
    kinds = Counter(_reason_kind(x["reason"]) for x in rejects)
    ranks = {}
    for p in sorted((out / PARTS_DIR).glob("rank-*.json")):
        ranks[p.stem] = json.loads(p.read_text())
    report = {"out": str(out), "items": int(totals["items"]), "samples": builder.num_rows,
              "images": int(totals["images"]), "videos": int(totals["videos"]), "rejects": len(rejects),
              "rejects_by_reason": dict(sorted(kinds.items())), "truncated_captions": int(totals["truncated_captions"]),
              "upscaled": int(totals["upscaled"]),
              "shapes": dict(sorted(shapes.items(), key=lambda kv: tuple(map(int, kv[0].split("x"))))),
              "seconds": {k: round(totals[k], 3) for k in ("decode_s", "vae_s", "text_s", "write_s")},
              "ranks_last_run": ranks}
    _atomic_write(out / REPORT_FILE, json.dumps(report, indent=1) + "\n")
    return report


def format_report(report: dict) -> str:
    lines = [f"preprocess report ({report['out']}): {report['items']} items -> {report['samples']} samples "
             f"({report['images']} images, {report['videos']} videos accepted), {report['rejects']} rejected"]
    for kind, n in report["rejects_by_reason"].items():
        lines.append(f"  rejected, {kind}: {n}")
    if report["rejects"]:
        lines.append(f"  every reject with its path and reason: {Path(report['out']) / REJECTS_FILE}")
    if report["truncated_captions"]:
        lines.append(f"  captions cut to the model's text length: {report['truncated_captions']}")
    if report.get("upscaled"):
        lines.append(f"  upscaled to reach a size bucket (smaller than every bucket it could go to): "
                     f"{report['upscaled']} item(s); add smaller --video-sizes / --image-sizes to keep them as they are")
    lines.append("  shape (FxHxW)      samples")
    for s, n in report["shapes"].items():
        lines.append(f"  {s:<18} {n:>7}")
    sec = report["seconds"]
    lines.append(f"  summed time: decode {sec['decode_s']:.1f} s (in loader workers), VAE {sec['vae_s']:.1f} s, "
                 f"text {sec['text_s']:.1f} s, write {sec['write_s']:.1f} s")
    if not report["samples"]:
        lines.append(f"  no sample was written, so there is no {INDEX_FILE}: see the rejects")
    return "\n".join(lines)


def _device_and_dtypes(args, local_rank: int):
    import torch

    dev = args.device
    if dev == "auto":
        dev = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    elif dev == "cuda":
        dev = f"cuda:{local_rank}"
    device = torch.device(dev)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    compute = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    storage = args.storage_dtype if args.storage_dtype != "auto" else compute
    return device, compute, storage


def _check_args(args: Namespace, encoders):
    """The counts, ``--text-len`` (default: the model's) and given encoders against ``--model``; returns the model."""
    for name in ("items_per_unit", "vae_batch", "text_batch"):
        if getattr(args, name) < 1:
            raise PreprocessError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    model = model_from_args(args)
    args.text_len = model.text_len if args.text_len is None else args.text_len
    if not 1 <= args.text_len <= model.text_len:
        raise PreprocessError(f"--text-len must be in 1..{model.text_len} (model {model.name}), got {args.text_len}")
    if encoders is not None and encoders.spec.grid != model.grid:
        raise PreprocessError(f"the encoders are for {encoders.spec.describe()}, --model is {model.describe()}")
    return model


def run(args: Namespace, encoders=None) -> dict:
    """The job; ``encoders`` (``LatentEncoders`` of the model) skips loading (tests, benchmarks). Returns this
    rank's summary."""
    import torch

    model = _check_args(args, encoders)
    rank, world, local = rank_info(args.local_rank)
    policy = policy_from_args(args)
    items = read_inputs(args.input)
    device, compute, storage = _device_and_dtypes(args, local)
    args.dtype = compute
    out = Path(args.out)
    if encoders is None:  # the weights' folders before anything is written: a failed check leaves --out as it was
        component_dirs(vae=args.vae, text_encoder=args.text_encoder, tokenizer=args.tokenizer, pipeline=args.pipeline)
    _check_settings(out, settings_of(args, items, policy, storage), args.overwrite, world)
    units = units_of(len(items), args.items_per_unit)
    mine = [k for k in range(len(units)) if k % world == rank and not _unit_record(out, k).is_file()]
    for k in mine:  # leftovers of a killed attempt at this rank's units
        for p in out.glob(f"shard-{k:05d}-*.safetensors.tmp*"):
            p.unlink(missing_ok=True)
    t_start = time.perf_counter()
    summary = {"rank": rank, "world_size": world, "device": str(device), "units_done_before": 0,
               "units": len(mine), "items": 0, "clips": 0, "rejects": 0}
    summary["units_done_before"] = sum(1 for k in range(len(units)) if k % world == rank) - len(mine)
    need_empty = not (out / EMPTY_PROMPT_FILE).is_file() and (bool(mine) or rank == 0)
    if (mine or need_empty) and encoders is None:
        encoders = LatentEncoders.from_pretrained(
            model, vae=args.vae, text_encoder=args.text_encoder, tokenizer=args.tokenizer, pipeline=args.pipeline,
            device=device, dtype=getattr(torch, compute), vae_tiling=args.vae_tiling, text_len=args.text_len)
    if need_empty:   # the same bytes from every rank that writes it (atomic rename)
        write_empty_prompt(out, encoders.encode_text([""])[0].to(getattr(torch, storage)))
    if mine:
        todo = [i for k in mine for i in units[k]]
        workers = args.workers if args.workers is not None else min(8, max(1, (os.cpu_count() or 1) // world - 1))
        loader = torch.utils.data.DataLoader(_DecodeSet([items[i] for i in todo], policy), batch_size=None,
                                             shuffle=False, num_workers=workers,
                                             prefetch_factor=1 if workers else None,
                                             persistent_workers=False)

        def results():
            for r in loader:
                r["item"] = todo[r["i"]]
                yield r

        bar = None
        if rank == 0 and not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(todo), unit="video", desc=f"preprocess rank 0/{world}", dynamic_ncols=True,
                       mininterval=0.5 if sys.stderr.isatty() else 30.0)
        stream = results()
        try:
            for k in mine:
                rec = _encode_unit(k, units[k], stream, items, encoders, args, storage, out, bar)
                summary["items"] += rec["stats"].get("items", 0)
                summary["clips"] += len(rec["samples"])
                summary["rejects"] += len(rec["rejects"])
        finally:
            if bar is not None:
                bar.close()
    wall = time.perf_counter() - t_start
    summary.update(seconds=round(wall, 3), items_per_s=round(summary["items"] / wall, 4) if wall else 0.0,
                   clips_per_s=round(summary["clips"] / wall, 4) if wall else 0.0)
    if device.type == "cuda":
        summary["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    _atomic_write(out / PARTS_DIR / f"rank-{rank:04d}.json", json.dumps(summary) + "\n")
    print(f"preprocess rank {rank}/{world}: {summary['items']} items -> {summary['clips']} samples, "
          f"{summary['rejects']} rejected, in {wall:.1f} s ({summary['items_per_s']:.2f} videos/s, "
          f"{summary['clips_per_s']:.2f} clips/s)"
          + (f", peak GPU memory {summary['peak_gpu_mem_gib']:.1f} GiB" if "peak_gpu_mem_gib" in summary else "")
          + (f"; {summary['units_done_before']} unit(s) were already done" if summary["units_done_before"] else ""),
          flush=True)
    report = finalize(out, len(units), model.input_spec)
    if report is not None:
        print(format_report(report), flush=True)
    else:
        print(f"preprocess rank {rank}: units of other ranks are still running; the last rank to finish writes "
              f"{out / INDEX_FILE} (or rerun the same command)", flush=True)
    summary["report"] = report
    return summary


if __name__ == "__main__":   # the command moved to the cli layer: say where, never exit 0 having done nothing
    print("python -m ds_adaptive.preprocess.run is no longer a command: run `ds-adaptive preprocess` (or python -m ds_adaptive.cli.preprocess) "
          "with the same arguments", file=sys.stderr)
    raise SystemExit(2)
