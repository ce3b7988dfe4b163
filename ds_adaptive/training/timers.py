"""Compute time without the waits for other ranks: :class:`ComputeTimer` around DeepSpeed's wait points.

Compute time versus wall-clock time. Under ZeRO-3 every module's parameters are all-gathered
inside forward and backward, and gradients are reduce-scattered inside backward: collectives
that complete only when every rank has reached them. A rank with a light batch therefore
*waits* inside its own forward/backward for the rank with the heavy one, and a wall-clock timer
around forward + backward reads about the same on every rank (``cv_step_wall`` is small even
when the load is not balanced). :class:`ComputeTimer` (``StepMetrics.attach_engine(engine)``)
takes those waits out: it brackets every DeepSpeed entry point that can wait for another rank
(ZeRO-3's parameter fetch before a module's forward and backward, the gradient reduce hook, the
backward epilogue; see ``WAIT_POINTS``) and subtracts them from the micro-step's region
(``data_ready()`` .. ``backward_done()``). On CUDA both the region and the windows are CUDA
events on the compute stream, read once per optimizer step (no per-micro-step sync): a window's
length is how long the *stream* stalled there (a stream wait on NCCL or an idle stream while the
host blocked), so kernels that were still queued while the host waited count as compute, not as
waiting. On the CPU, where gloo collectives block the caller, the same points are timed with
``perf_counter``. Without an engine (or with ``attach_engine`` not called) compute time is the
region's wall-clock time.
"""
from __future__ import annotations

import time

import torch

__all__ = ["WAIT_POINTS", "ComputeTimer"]


# (attribute path from the DeepSpeed engine, method name): every entry point through which a
# rank can wait for another one inside forward/backward. ZeRO-3 calls them through ``self.``,
# so an instance attribute that wraps the bound method is what runs.
WAIT_POINTS = (
    ("optimizer.parameter_offload", "pre_sub_module_forward_function"),   # ZeRO-3 all-gather wait (fwd)
    ("optimizer.parameter_offload", "pre_sub_module_backward_function"),  # ZeRO-3 all-gather wait (bwd)
    ("optimizer", "reduce_ready_partitions_and_remove_grads"),            # gradient reduce(-scatter) hook
    ("", "_backward_epilogue"),                                           # final reduce + stream syncs
)


class ComputeTimer:
    """Per micro-step: the wall-clock length of a region and the part of it spent inside
    DeepSpeed's wait points (``WAIT_POINTS``); compute = region - waits.

    ``begin()`` / ``end()`` bracket one micro-step's forward + backward; ``collect()`` returns
    ``[(wall_ms, wait_ms), ...]`` for the micro-steps since the last call (one device sync on
    CUDA). Windows nest (the epilogue calls the reduce hook): only the outermost one counts.
    Calls outside a region pass straight through, so evaluation and the optimizer step cost
    one attribute check per call.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.wrapped: list[str] = []
        self._active = False
        self._depth = 0
        self._start = None
        self._windows: list = []
        self._done: list = []         # (start, end, windows) per micro-step
        self._pool: list = []         # reusable CUDA events

    # timestamps: CUDA events on the current stream, or perf_counter seconds
    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def attach(self, engine) -> list[str]:
        """Wrap the wait points that ``engine`` has; returns their names (empty: none found,
        compute time then equals wall-clock time)."""
        for path, name in WAIT_POINTS:
            owner = engine
            for part in filter(None, path.split(".")):
                owner = getattr(owner, part, None)
            fn = getattr(owner, name, None) if owner is not None else None
            if fn is None or getattr(fn, "_ds_adaptive_wait_point", False):
                continue
            setattr(owner, name, self._wrap(fn))
            self.wrapped.append(f"{path + '.' if path else ''}{name}")
        return list(self.wrapped)

    def _wrap(self, fn):
        timer = self

        def wait_point(*args, **kwargs):
            if not timer._active:
                return fn(*args, **kwargs)
            timer._depth += 1
            t0 = timer._mark() if timer._depth == 1 else None
            try:
                return fn(*args, **kwargs)
            finally:
                timer._depth -= 1
                if t0 is not None:
                    timer._windows.append((t0, timer._mark()))

        wait_point._ds_adaptive_wait_point = True
        wait_point.__wrapped__ = fn
        return wait_point

    @property
    def active(self) -> bool:
        return self._active

    def begin(self) -> None:
        self._windows = []
        self._depth = 0
        self._start = self._mark()
        self._active = True

    def end(self) -> None:
        if not self._active:
            raise RuntimeError("ComputeTimer.end() without begin()")
        self._active = False
        self._done.append((self._start, self._mark(), self._windows))
        self._windows = []

    def collect(self) -> list[tuple[float, float]]:
        """``(wall_ms, wait_ms)`` of every micro-step ended since the last call."""
        if self.cuda and self._done:
            torch.cuda.synchronize()
        out = []
        for start, end, windows in self._done:
            out.append((self._ms(start, end), sum(self._ms(a, b) for a, b in windows)))
            if self.cuda:
                self._pool.extend([start, end, *(e for w in windows for e in w)])
        self._done = []
        return out
