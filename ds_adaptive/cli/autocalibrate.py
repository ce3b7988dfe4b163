"""``python -m ds_adaptive.cli.autocalibrate ship CAL.json PROFILE.json [--replace]``: add a start-up calibration
(:mod:`ds_adaptive.calibration.autocalibrate`) to a shipped profile as its variant.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ds_adaptive.calibration.autocalibrate import ship_variant


def main(argv=None) -> int:
    """``python -m ds_adaptive.calibration.autocalibrate ship CAL.json PROFILE.json``: add a calibration (start-up cache
    or ``ds-adaptive calibrate``) to a profile json as its other LayerNorm-modulate path or block-fusion mode
    (``ship_variant``), in place."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ds_adaptive.calibration.autocalibrate", description=main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("ship")
    s.add_argument("cached", type=Path, help="a profile json from the start-up calibration cache or ds-adaptive calibrate")
    s.add_argument("profile", type=Path, help="the profile json to extend (a shipped one in ds_adaptive/planning/profiles/)")
    s.add_argument("--replace", action="store_true", help="replace the profile's entries of that variant")
    args = ap.parse_args(argv)
    try:
        out = ship_variant(json.loads(args.profile.read_text()), json.loads(args.cached.read_text()),
                           replace=args.replace)
    except (OSError, ValueError, KeyError) as exc:
        print(f"autocalibrate ship: error: {exc}", file=sys.stderr)
        return 2
    args.profile.write_text(json.dumps(out, indent=1) + "\n")
    added = {k: sorted(out.get(k) or {}) for k in ("ln_modulate_variants", "block_fusion_variants") if out.get(k)}
    print(f"{args.profile}: variants now {added}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
