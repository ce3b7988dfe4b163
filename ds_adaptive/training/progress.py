"""The progress display of rank 0: tqdm on a terminal, a log line every ``metrics.interval`` steps otherwise."""
from __future__ import annotations

import sys

__all__ = ["Progress"]


class Progress:
    """tqdm on an interactive rank 0; plain log lines every ``interval`` steps otherwise."""

    def __init__(self, enabled: bool, total: int, initial: int, interval: int) -> None:
        self.enabled, self.interval, self.bar, self.first = enabled, interval, None, True
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def update(self, rec, total: int) -> None:
        if not self.enabled:
            return
        msg = (f"loss {rec.loss:.4f}  {rec.tokens_per_s:,.0f} tok/s  {rec.samples} samples  "
               f"CV_step {100 * rec.cv_step:.1f}%  peak {max(rec.peak_mem_gib):.2f} GiB")
        if self.bar is not None:
            self.bar.set_postfix_str(msg, refresh=False)
            self.bar.update(1)
        elif rec.step % self.interval == 0 or rec.step == total or self.first:
            print(f"step {rec.step}/{total}  {msg}  ({rec.wall_s:.2f} s)", flush=True)
        self.first = False

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
