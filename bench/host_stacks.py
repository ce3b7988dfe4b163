"""Where the host's Python time goes during training steps: a sampling profiler of every thread's Python stack.

``torch.profiler`` names the GPU's idle gaps (the kernels either side) but not the host code that held the GPU up.
:class:`HostSampler` reads every thread's stack (``sys._current_frames``) every ``interval`` seconds from a daemon
thread and counts, per thread kind (``main``, or ``other``: the autograd engine's device thread, where backward
hooks such as ZeRO-3's gradient reduction run, and any worker with Python frames), each function's inclusive share
of the samples and the innermost stacks. A thread blocked in a CUDA synchronisation shows the Python line that
called it, so "who waits for the GPU" and "what keeps the GPU waiting" both read off the table. Only frames of
``ROOTS`` (the trainer, DeepSpeed, torch's autograd / nn / checkpoint code) are counted by function; threads idle
in ``threading`` / ``queue`` waits are left out.

Used by ``bench/train_step_profile.py --host-stacks``; compares nothing.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from typing import Optional

#: path fragments of the frames counted by function
ROOTS = ("ds_adaptive", "deepspeed", "torch/autograd", "torch/nn/modules", "torch/utils/checkpoint", "launch",
         "bench", "torch/_dynamo", "torch/_inductor", "torch/cuda", "torch/utils/data")
#: files whose frame innermost on a thread's stack means it is only waiting (that thread is left out)
IDLE = ("threading.py", "queue.py", "selectors.py", "connection.py", "host_stacks.py")


def _frame_name(frame) -> str:
    path = frame.f_code.co_filename
    parts = path.split("/")
    short = "/".join(parts[-2:])
    return f"{short}:{frame.f_code.co_name}"


class HostSampler:
    """``with HostSampler() as s: ...``; then ``s.report()``."""

    def __init__(self, interval: float = 0.001, depth: int = 5) -> None:
        self.interval, self.depth = interval, depth
        self.samples = Counter()                 # thread kind -> seconds sampled with Python frames
        self.inclusive = Counter()               # (kind, function) -> seconds with it on the stack
        self.stacks = Counter()                  # (kind, innermost ``depth`` frames) -> seconds
        self.wall_s = 0.0
        self.ticks = 0                           # rounds of sampling (the denominator of every share)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._main = threading.main_thread().ident
        self._switch = sys.getswitchinterval()

    def __enter__(self) -> "HostSampler":
        sys.setswitchinterval(self.interval / 2)   # the sampler gets the GIL while the main thread runs Python
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="host-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.wall_s = time.perf_counter() - self._t0
        sys.setswitchinterval(self._switch)

    def _run(self) -> None:
        me = threading.get_ident()
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            now = time.perf_counter()
            dt, last = now - last, now   # a round stands for the time since the last one (a busy GIL spaces them)
            self.ticks += 1
            for tid, frame in sys._current_frames().items():
                if tid != me and frame is not None:
                    self._record("main" if tid == self._main else "other", frame, dt)

    def _record(self, kind: str, frame, dt: float) -> None:
        names = []
        while frame is not None:
            names.append((frame.f_code.co_filename, _frame_name(frame), frame.f_lineno))
            frame = frame.f_back
        if not names or os.path.basename(names[0][0]) in IDLE:
            return
        self.samples[kind] += dt
        for fn in {n for path, n, _ in names if any(r in path for r in ROOTS)}:
            self.inclusive[(kind, fn)] += dt
        self.stacks[(kind, " <- ".join(f"{n}:{line}" for _, n, line in names[:self.depth]))] += dt

    def report(self, top: int = 30) -> dict:
        """Per thread kind: samples, the ``top`` functions by inclusive share of that kind's samples, the ``top``
        innermost stacks; shares are of the sampled wall (each round of sampling stands for the time since the last)."""
        possible = max(1e-9, self.wall_s)
        doc = {"interval_s": self.interval, "wall_s": self.wall_s, "rounds": self.ticks, "threads": {}}
        for kind, n in self.samples.items():
            inc = sorted(((c, fn) for (k, fn), c in self.inclusive.items() if k == kind), reverse=True)[:top]
            st = sorted(((c, s) for (k, s), c in self.stacks.items() if k == kind), reverse=True)[:top]
            doc["threads"][kind] = {
                "samples": n, "share_of_wall": n / possible,
                "functions": [{"fn": fn, "share": c / possible} for c, fn in inc],
                "stacks": [{"stack": s, "share": c / possible} for c, s in st]}
        return doc


def format_report(doc: dict) -> str:
    lines = [f"host stacks: {doc['wall_s']:.1f} s, {doc['rounds']} rounds of sampling (every "
             f"{doc['interval_s'] * 1e3:g} ms asked); share = the wall's share with it on the thread's stack"]
    for kind, t in doc["threads"].items():
        lines.append(f"\n[{kind} thread] Python frames in {t['share_of_wall']:.1%} of the wall")
        lines.append("inclusive, by function:")
        lines += [f"  {f['share']:7.2%}  {f['fn']}" for f in t["functions"]]
        lines.append("innermost stacks:")
        lines += [f"  {s['share']:7.2%}  {s['stack']}" for s in t["stacks"]]
    return "\n".join(lines)
