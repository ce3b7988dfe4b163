"""``ds-adaptive calibrate --sparse``: the block-sparse kernel's time against dense vs density on this GPU
(:mod:`ds_adaptive.calibration.sparse`), and with ``--selection`` the block selection's cost
(:mod:`ds_adaptive.calibration.selection_timing`), written into a profile json.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Optional

from ds_adaptive.calibration.selection_timing import DEFAULT_GRID, measure_selection, selection_section
from ds_adaptive.calibration.sparse import DEFAULT_DENSITIES, measure_efficiency
from ds_adaptive.planning.profile import PROFILES_DIR


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="ds-adaptive calibrate --sparse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None,
                    help="profile (shipped name or json) to add the sparse_attention section to; default: write "
                         "a json with only that section")
    ap.add_argument("--out", required=True, help="json to write")
    ap.add_argument("--seq-lens", default="32768,16384", help="sequence lengths (tokens), comma separated")
    ap.add_argument("--densities", default=",".join(map(str, DEFAULT_DENSITIES)))
    ap.add_argument("--heads", type=int, default=12, help="attention heads per call (e.g. 12: a 1.3B model's)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--selection", action="store_true",
                    help="time the runtime's block selection instead and write sparse_attention.selection")
    ap.add_argument("--selection-grid", default=None,
                    help="--selection: micro-batches B:S,B:S,... (default: images to 81x720x1280 videos)")
    ap.add_argument("--block-size", type=int, default=128, help="--selection: the runtime's block_size")
    ap.add_argument("--block-score", default="pooled_lse", help="--selection: the runtime's block_score")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("calibrate --sparse needs a CUDA GPU (FlexAttention block-sparse kernels, the selection's timing)",
              file=sys.stderr)
        return 2
    if args.selection:
        return _selection_main(args, argv)
    seq_lens = [int(x) for x in args.seq_lens.split(",")]
    dens = [float(x) for x in args.densities.split(",")]
    res = measure_efficiency(seq_lens, dens, heads=args.heads, head_dim=args.head_dim, iters=args.iters)
    section = {"format": "ds_adaptive.sparse_attention/1", "device": torch.cuda.get_device_name(0),
               "torch": torch.__version__, "date": _dt.date.today().isoformat(),
               "kernel": "flex_attention block-sparse, 128x128 full blocks, torch.compile; dense: SDPA default",
               "heads": args.heads, "head_dim": args.head_dim, "seq_lens": seq_lens,
               "source": "ds-adaptive calibrate --sparse " + " ".join(argv if argv is not None else sys.argv[1:]),
               **res}
    data = _base_profile(args.profile)
    old = data.get("sparse_attention") or {}
    data["sparse_attention"] = {**section, **({"selection": old["selection"]} if "selection" in old else {})}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1))
    print("density " + " ".join(f"{d:>6.3f}" for d in res["efficiency"]["density"]))
    print("ratio   " + " ".join(f"{r:>6.3f}" for r in res["efficiency"]["ratio"]))
    be = next((d for d, r in zip(res["efficiency"]["density"], res["efficiency"]["ratio"]) if r >= 1.0), None)
    print(f"break-even density: {be if be is not None else '> ' + str(dens[-1])}; wrote {args.out}")
    return 0


def _base_profile(profile: Optional[str]) -> dict:
    """The profile json (shipped name or path) the section goes into; ``{}`` without one."""
    if not profile:
        return {}

    p = Path(profile)
    p = p if p.is_file() else PROFILES_DIR / f"{profile}.json"
    if not p.is_file():
        print(f"calibrate --sparse: --profile {profile}: not a file and not a shipped profile name; give a profile "
              "json or one of ds_adaptive/planning/profiles/", file=sys.stderr)
        raise SystemExit(2)
    return json.loads(p.read_text())


def _selection_main(args, argv) -> int:
    """``--selection``: time the runtime's selection, fit, write ``sparse_attention.selection``."""
    try:
        grid = DEFAULT_GRID if not args.selection_grid else tuple(
            tuple(int(x) for x in pair.split(":")) for pair in args.selection_grid.split(","))
    except ValueError:
        print(f"calibrate --sparse --selection: --selection-grid {args.selection_grid!r}: expected B:S,B:S,... "
              "(e.g. 1:32760,4:32760)", file=sys.stderr)
        return 2
    rows = measure_selection(grid, heads=args.heads, head_dim=args.head_dim, block_size=args.block_size,
                             block_score=args.block_score, iters=args.iters)
    command = "ds-adaptive calibrate --sparse " + " ".join(argv if argv is not None else sys.argv[1:])
    sec = selection_section(rows, heads=args.heads, head_dim=args.head_dim, block_size=args.block_size,
                            block_score=args.block_score, command=command)
    data = _base_profile(args.profile)
    data.setdefault("sparse_attention", {"format": "ds_adaptive.sparse_attention/1"})["selection"] = sec
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1))
    fit = sec["fit"]
    print(f"selection cost: {sec['ms_per_call']:.4f} ms per call + per sample and head "
          f"{sec['ms_per_token']:.3e} ms x S + {sec['ms_per_logit']:.3e} ms x nq S + {sec['ms_per_block_pair']:.3e} "
          f"ms x nq nk; fit max |error| {fit['max_rel_err']:.1%}, mean {fit['mean_rel_err']:.1%}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
