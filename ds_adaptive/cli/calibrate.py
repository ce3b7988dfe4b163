"""``ds-adaptive calibrate``: profile the real model on this GPU -> a cost / memory profile json
(:mod:`ds_adaptive.calibration.calibrate` measures, :mod:`ds_adaptive.calibration.fit` fits,
:mod:`ds_adaptive.calibration.profile_json` writes); ``--sparse`` measures the block-sparse kernel instead
(:mod:`ds_adaptive.calibration.sparse`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from ds_adaptive.calibration import calibrate  # a module: tests replace calibrate.measure
from ds_adaptive.calibration.calibrate import (_batch_sizes, _config_dict, ran_ln_modulate,
                                               resolve_ln_modulate)
from ds_adaptive.calibration.fit import MAX_FIT_ERROR, fit_quality_problem
from ds_adaptive.cli import calibrate_sparse
from ds_adaptive.calibration.profile_json import (CPU_MODEL, DEFAULT_LINK_GBPS, block_scaling_models,
                                                  calibration_shapes, profile_from_block_scaling, profile_from_rows,
                                                  refit_profile)
from ds_adaptive.core.shapes import GridRule, SampleShape
from ds_adaptive.models.registry import default_model, get_model, model_names
from ds_adaptive.planning.memory import configure_allocator
from ds_adaptive.planning.profile import GIB, PROFILES_DIR, Profile


def parse_lengths(spec: str, grid: Optional[GridRule] = None) -> list[SampleShape]:
    """``--lengths 1x480x832,81x720x1280`` -> shapes (FxHxW, valid under the model's ``grid``)."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            f, h, w = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--lengths: '{item}' is not FRAMESxHEIGHTxWIDTH (e.g. 81x480x832)") from None
        out.append(SampleShape(f, h, w, grid))
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ds-adaptive calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sparse", action="store_true",
                    help="measure the block-sparse attention kernel's cost vs density instead (see "
                         "`ds-adaptive calibrate --sparse --help`)")
    ap.add_argument("--model", default=None, choices=model_names(),
                    help=f"the model (default {default_model()}, {CPU_MODEL} with --device cpu)")
    ap.add_argument("--sp", type=int, default=1, help="Ulysses degree to emulate on one GPU (default 1)")
    ap.add_argument("--out", help="profile json to write")
    ap.add_argument("--name", help="profile name stored in the json (default: stem of --out)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny model, for testing)")
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp32", "fp16"],
                    help="default bf16 on cuda, fp32 on cpu")
    ap.add_argument("--layers", default="2,4", help="two depths k1,k2 to difference (default 2,4)")
    ap.add_argument("--lengths", default=None,
                    help="comma list of FxHxW shapes (default: the model's calibration grids, e.g. 8 from "
                         "1x480x832 to 81x720x1280; the tiny model's are 5 small grids of 64-2304 tokens)")
    ap.add_argument("--batch-sizes", default=None,
                    help="extra batch sizes for short shapes, e.g. '1560:1,12;4096:1,4' (default: auto)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs per point (default 2; 1 on cpu)")
    ap.add_argument("--iters", type=int, default=None, help="timed runs per point (default 5; 2 on cpu)")
    ap.add_argument("--no-checkpointing", action="store_true", help="measure without gradient checkpointing")
    ap.add_argument("--checkpoint-memory", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure every point in the other checkpointing mode: per-block memory with and "
                         "without checkpointing and the recompute time, for `recompute.blocks: auto` (default on)")
    ap.add_argument("--min-fit-tokens", type=int, default=8192,
                    help="exclude latency-bound points with fewer tokens per micro-batch from the fit")
    ap.add_argument("--gpu-mem-gib", type=float, default=None, help="GPU capacity (default: detected)")
    ap.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS,
                    help="all-to-all bandwidth per GPU for the Ulysses comm term (GB/s)")
    ap.add_argument("--override", action="append", default=[],
                    help="model config override KEY=VALUE (e.g. dim=64), repeatable")
    ap.add_argument("--max-fit-error", type=float, default=MAX_FIT_ERROR,
                    help="quality bar: refuse to write a profile whose compute fit is worse (max |rel err|; "
                         "default %(default)s) or does not grow with length")
    ap.add_argument("--accept-poor-fit", action="store_true",
                    help="write the profile even when the fit misses the quality bar (with a warning)")
    ap.add_argument("--ln-modulate", default="auto", choices=["auto", "fused", "reference"],
                    help="LayerNorm-modulate path to measure with (its activation memory differs): auto (default) "
                         "= the fused op when it loads on CUDA (as a run with adaptive_load.fused_ln_modulate), "
                         "else the torch reference; recorded in the profile as \"ln_modulate\"")
    ap.add_argument("--block-fusion", default="off", choices=["off", "rope", "regions"],
                    help="adaptive_load.block_fusion to measure with (fused blocks hold less activation memory and "
                         "run faster): recorded in the profile as \"block_fusion\"; `python -m "
                         "ds_adaptive.cli.autocalibrate ship` adds it to a profile as its block_fusion_variants entry")
    ap.add_argument("--from-block-scaling", metavar="JSON",
                    help="instead of measuring, rebuild the shipped profiles from a per-block scaling json")
    ap.add_argument("--refit", metavar="PROFILE",
                    help="instead of measuring, re-derive a profile's memory fits from its own raw measurements "
                         "(measurements.raw) with this version's fitting; writes --out (default: in place)")
    return ap


def _refit(args: argparse.Namespace) -> int:
    path = Path(args.refit)
    prof = refit_profile(json.loads(path.read_text()))
    Profile.from_dict(prof, where=str(path))
    out = Path(args.out) if args.out else path
    out.write_text(json.dumps(prof, indent=1) + "\n")
    _print_fit(prof["compute"], prof["memory"])
    print(f"wrote {out} (re-fitted from {path}'s measurements.raw)")
    return 0


def _rebuild_from_block_scaling(args: argparse.Namespace) -> int:
    """--from-block-scaling: the shipped profiles from per-block timings, no measurement."""
    data = json.loads(Path(args.from_block_scaling).read_text())
    out_dir = Path(args.out) if args.out else PROFILES_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in block_scaling_models(data):
        prof = profile_from_block_scaling(data, name, source="shared/data/h100_block_scaling.json")
        Profile.from_dict(prof)
        path = out_dir / f"{prof['name']}.json"
        path.write_text(json.dumps(prof, indent=1) + "\n")
        c = prof["compute"]
        print(f"{path}: c0={c['c0_ms']:.3f} ms a={c['a_ms_per_token']:.4g} ms/tok "
              f"b={c['b_ms_per_token2']:.4g} ms/tok^2 fit max|err|={c['fit']['max_rel_err']:.1%}")
    return 0


def _device_defaults(args: argparse.Namespace, on_cpu: bool) -> None:
    """--warmup / --iters / --model defaults: short runs and the tiny model on a CPU."""
    args.warmup = args.warmup if args.warmup is not None else (1 if on_cpu else 2)
    args.iters = args.iters if args.iters is not None else (2 if on_cpu else 5)
    args.model = args.model or (CPU_MODEL if on_cpu else default_model())


def _parse_batch_sizes(ap: argparse.ArgumentParser, args: argparse.Namespace, shapes: list, on_cpu: bool) -> dict:
    if args.batch_sizes:  # explicit: listed lengths get these sizes, the others B=1
        batch_sizes = {sh.tokens: [1] for sh in shapes}
        for part in args.batch_sizes.split(";"):
            try:
                s, bs = part.split(":")
                batch_sizes[int(s)] = [int(b) for b in bs.split(",")]
            except ValueError:
                ap.error(f"--batch-sizes: '{part}' is not TOKENS:B1,B2 (e.g. '1560:1,12;4096:1,4')")
        return batch_sizes
    if on_cpu:  # no saturated batches on a CPU: B=1, and B=4 for the two shortest lengths
        short = sorted(sh.tokens for sh in shapes)[:2]
        return {sh.tokens: [1, 4] if sh.tokens in short else [1] for sh in shapes}
    return _batch_sizes(shapes, args.sp)


def _parse_overrides(items: list) -> dict:
    """``--override key=value`` (json values: numbers, lists, objects, true/false) -> {key: value}."""
    overrides = {}
    for ov in items:
        k, _, v = ov.partition("=")
        overrides[k] = json.loads(v) if v[:1] in "0123456789-[{tf" else v
    return overrides


def _write_profile(prof: dict, compute: dict, memory: dict, args: argparse.Namespace) -> int:
    """Validate, apply the fit-quality bar, write ``args.out`` and print the fit."""
    Profile.from_dict(prof)  # validate before writing
    problem = fit_quality_problem(compute, args.max_fit_error)
    if problem and not args.accept_poor_fit:
        _print_fit(compute, memory)
        print(f"calibrate: error: {problem}; the profile would mis-plan batches, so {args.out} was NOT written. "
              "Measure longer lengths (--lengths), more --iters, on an idle device, or pass --accept-poor-fit to "
              "write it anyway.", file=sys.stderr)
        return 2
    if problem:
        prof["fit_warning"] = problem
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(prof, indent=1) + "\n")
    _print_fit(compute, memory)
    if problem:
        print(f"calibrate: warning: {problem}; written anyway (--accept-poor-fit)", file=sys.stderr)
    print(f"wrote {args.out} ({prof['wall_s']} s)")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--sparse" in argv:   # the sparse kernel's efficiency table (ds_adaptive.calibration.sparse)
        return calibrate_sparse.main([a for a in argv if a != "--sparse"])
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.from_block_scaling:
        return _rebuild_from_block_scaling(args)
    if args.refit:
        return _refit(args)
    if not args.out:
        ap.error("--out is required (path of the profile json to write)")
    print(configure_allocator())   # as the trainer: before CUDA's allocator starts
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("calibrate: --device cuda but no CUDA GPU is visible; run on a GPU node or pass "
              "--device cpu --model tiny to test the pipeline", file=sys.stderr)
        return 2
    dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    try:
        k1, k2 = (int(v) for v in args.layers.split(","))
    except ValueError:
        ap.error(f"--layers must be two depths 'k1,k2', got {args.layers!r}")
    if not 1 <= k1 < k2:
        ap.error(f"--layers needs 1 <= k1 < k2, got {k1},{k2}")
    on_cpu = args.device == "cpu"
    _device_defaults(args, on_cpu)
    model = get_model(args.model)
    shapes = parse_lengths(args.lengths, model.grid) if args.lengths else [  # on a CPU: the tiny model's grids
        s.with_grid(model.grid) for s in calibration_shapes(CPU_MODEL if on_cpu else args.model)]
    batch_sizes = _parse_batch_sizes(ap, args, shapes, on_cpu)
    overrides = _parse_overrides(args.override)
    full_cfg = _config_dict(model.config(**overrides))
    num_layers = int(full_cfg["num_layers"])
    device = torch.device(args.device)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gpu_mem = args.gpu_mem_gib or (torch.cuda.get_device_properties(device).total_memory / GIB
                                   if device.type == "cuda" else 16.0)
    ln_path = resolve_ln_modulate(args.ln_modulate, device.type)
    print(f"calibrate {args.model} on {dev_name} ({dtype}, sp={args.sp}, layers {k1},{k2} -> {num_layers}, {ln_path}, "
          f"block fusion {args.block_fusion})")
    t_start = time.perf_counter()
    rows, _ = calibrate.measure(args.model, layers=[k1, k2], shapes=shapes, batch_sizes=batch_sizes, sp=args.sp,
                      device_name=args.device, dtype_name=dtype, warmup=args.warmup, iters=args.iters,
                      gradient_checkpointing=not args.no_checkpointing, overrides=overrides,
                      both_checkpointing=args.checkpoint_memory, ln_modulate=ln_path, block_fusion=args.block_fusion)
    ln_path = ran_ln_modulate(ln_path)
    prof = profile_from_rows(
        rows, model_name=args.model, overrides=overrides, layers=(k1, k2), sp=args.sp, device_name=dev_name,
        gpu_mem_gib=float(gpu_mem), dtype=dtype, ln_modulate=ln_path, gradient_checkpointing=not args.no_checkpointing,
        min_fit_tokens=args.min_fit_tokens, link_gbps=args.link_gbps, name=args.name or Path(args.out).stem,
        source=f"ds-adaptive calibrate {' '.join(argv if argv is not None else sys.argv[1:])}",
        wall_s=time.perf_counter() - t_start, block_fusion=args.block_fusion)
    compute, memory = prof["compute"], prof["memory"]
    return _write_profile(prof, compute, memory, args)


def _print_fit(compute: Mapping[str, Any], memory: Mapping[str, Any]) -> None:
    print("\nfull-model fit  t = c0 + B*(a*S + b*S^2)  [ms]")
    print(f"  c0 = {compute['c0_ms']:.4g} ms   a = {compute['a_ms_per_token']:.4g} ms/token   "
          f"b = {compute['b_ms_per_token2']:.4g} ms/token^2")
    print(f"  {'S':>7} {'B':>4} {'measured':>10} {'predicted':>10} {'rel err':>8}")
    for r in compute["fit"]["points"]:
        tag = "" if r["fit"] else "  (latency-bound, not fitted)"
        print(f"  {r['S']:>7} {r['B']:>4} {r['measured_ms']:>10.2f} {r['predicted_ms']:>10.2f} "
              f"{r['rel_err']:>+8.1%}{tag}")
    print(f"  max |rel err| {compute['fit']['max_rel_err']:.1%}, mean {compute['fit']['mean_rel_err']:.1%}")
    if "points" in memory.get("fit", {}):
        print(f"memory fit  act/B = m0 + m1*S: m0 = {memory['m0_gib']:.4g} GiB, "
              f"m1 = {memory['m1_gib_per_token'] * 1024 ** 2:.4g} KiB/token; max |rel err| "
              f"{memory['fit']['max_rel_err']:.1%}, mean {memory['fit']['mean_rel_err']:.1%}")
    ck, rc = memory.get("checkpointing"), compute.get("recompute")
    if ck is not None and rc is not None:
        bf, bc = ck["block_full"], ck["block_checkpointed"]
        print(f"per block: whole {bf['m1_gib_per_token'] * 2**30 / 1024:.1f} KiB/token (+{bf['m0_gib'] * 1024:.1f} MiB/sample, "
              f"max err {bf['fit']['max_rel_err']:.1%}), checkpointed {bc['m1_gib_per_token'] * 2**30 / 1024:.2f} KiB/token; "
              f"recompute c0 {rc['c0_ms']:.3g} ms a {rc['a_ms_per_token']:.3g} ms/token b {rc['b_ms_per_token2']:.3g} "
              f"ms/token^2 (max err {rc['fit']['max_rel_err']:.1%})")
        if "last_block_whole" in ck:
            lw = ck["last_block_whole"]
            print(f"last block whole (n < L) adds {lw['m1_gib_per_token'] * 2**30 / 1024:.2f} KiB/token "
                  f"(+{lw['m0_gib'] * 1024:.1f} MiB/sample, max err {lw['fit']['max_rel_err']:.1%})")
    pt = memory.get("per_token_timesteps")
    if pt is not None:
        print(f"one timestep per token (first-frame conditioned videos) adds {pt['m1_gib_per_token'] * 2**20:.1f} "
              f"KiB/token to m1 and {pt['block_full_m1_gib_per_token'] * 2**20:.1f} KiB/token to a whole block")
    if memory.get("fragmentation_margin_gib") is not None:
        print(f"fragmentation margin (reserved - allocated peak at the sweep's high-water marks): "
              f"{memory['fragmentation_margin_gib']:.3f} GiB (PYTORCH_CUDA_ALLOC_CONF={memory.get('allocator', '')!r})")
