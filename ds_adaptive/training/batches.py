"""The training batches: a DataLoader over the planned batch sampler, one iterator per epoch (or per re-plan).

    batches = Batches(run, workers=opts.workers)
    batch = batches.next(micro, epoch=e, step_in_epoch=s)   # {"latents", "context", "index"} of one micro-step
    batches.restart()                                        # a new epoch, a re-plan or a resume: a new iterator

The sampler yields every micro-batch of the epoch in order (all samples of one shape); a new iterator starts
where the sampler's cursor is (the step after a resume or a re-plan), so every sample is seen exactly once.
"""
from __future__ import annotations

from typing import Optional

import torch

from ds_adaptive.data import DataError, collate_latents
from ds_adaptive.training.preempt import ignore_stop_signals

__all__ = ["Batches", "worker_message"]


class Batches:
    """The DataLoader of ``run.dataset`` over ``run.sampler`` (its batch sampler), opened lazily per epoch."""

    def __init__(self, run, workers: Optional[int] = None) -> None:
        """``workers``: DataLoader workers per rank (None: 2 on CUDA, 0 on the CPU)."""
        self.run = run
        self.workers = workers if workers is not None else (2 if run.device.type == "cuda" else 0)
        self._iter = None

    @property
    def pin_memory(self) -> bool:
        """Whether the DataLoader pins host memory (on CUDA)."""
        return self.run.device.type == "cuda"

    def restart(self) -> None:
        """Drop the current iterator: the next :meth:`next` opens one at the sampler's cursor."""
        self._iter = None

    def next(self, micro: int, *, epoch: int, step_in_epoch: int) -> dict:
        """The next micro-batch of the epoch (``micro``, ``step_in_epoch``: for the messages). A DataError raised in
        a worker is re-raised with the worker's own message."""
        run, sampler = self.run, self.run.sampler
        if self._iter is None:
            sampler.set_epoch(epoch)  # a no-op for the epoch just resumed
            if sampler.steps_per_epoch < 1:
                raise DataError(f"the batch sampler planned no optimizer step for epoch {epoch} "
                                f"({len(run.dataset)} samples, {run.layout.dp_size} DP ranks, gas "
                                f"{run.gas}); use more samples")
            # Contexts travel padded to the batch's longest prompt and are zero-padded to the model's text
            # length (Wan: 512) on the device: the model sees the same input, the host moves ~4x fewer bytes.
            loader = torch.utils.data.DataLoader(run.dataset, batch_sampler=sampler, collate_fn=_collate_unpadded,
                                                 num_workers=self.workers, pin_memory=self.pin_memory,
                                                 worker_init_fn=ignore_stop_signals if self.workers else None)
            self._iter = iter(loader)
        try:
            return next(self._iter)
        except DataError as exc:  # from a DataLoader worker the message carries the worker's traceback
            raise DataError(worker_message(str(exc))) from None
        except StopIteration:
            raise RuntimeError(f"the batch sampler ran out after {micro} micro-step(s) of step {step_in_epoch} "
                               f"of epoch {epoch}, but reported {sampler.steps_per_epoch} steps x "
                               f"{run.gas} micro-steps") from None


def worker_message(msg: str) -> str:
    """The original message of an exception re-raised by a DataLoader worker ("Caught X in DataLoader
    worker process N. Original Traceback ...: X: <message>")."""
    if "Original Traceback" not in msg:
        return msg
    last = msg.rstrip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last


def _collate_unpadded(samples: list) -> dict:
    return collate_latents(samples, pad_text_to=None)
