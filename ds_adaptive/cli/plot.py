"""``ds-adaptive plot RUN_DIR``: one PNG of a training run (losses, tokens/s, peak memory and compute per rank) from
its logs (:mod:`ds_adaptive.training.plot`); the trainer draws the same picture at the end of a run.

Exit status: 0 written, 2 a log directory that cannot be drawn (one message).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from ds_adaptive.training.plot import PLOT_FILE, PlotError, plot_run


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="ds-adaptive plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="the run's log directory (--log-dir / adaptive_load.metrics.log_dir)")
    ap.add_argument("--out", default=None, help=f"the PNG to write (default RUN_DIR/{PLOT_FILE})")
    args = ap.parse_args(argv)
    try:
        path = plot_run(args.run_dir, args.out)
    except PlotError as exc:
        print(f"ds-adaptive plot: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
