"""Steps whose loss or gradient norm is not finite: counted, logged, and the run stopped when they must stop it.

    guard = NonFiniteGuard(policy="skip", limit=20, fp16=False, log=print)
    guard.check(rec, applied, state.nonfinite_steps)   # after every optimizer step; raises NonFiniteError

DeepSpeed's ZeRO optimizers skip the update themselves when the global gradient norm is inf/NaN (zeroed
gradients, no LR-scheduler step, ``engine.skipped_steps``); ``engine.was_step_applied()`` says whether it did.
"""
from __future__ import annotations

import math
from typing import Callable

__all__ = ["NonFiniteError", "NonFiniteGuard"]


class NonFiniteError(RuntimeError):
    """The run stops on non-finite steps (``--nonfinite stop``, or more than ``--nonfinite-limit``)."""


class NonFiniteGuard:
    """The trainer's policy for non-finite steps (``--nonfinite``, ``--nonfinite-limit``)."""

    def __init__(self, policy: str = "skip", limit: int = 20, *, fp16: bool = False,
                 log: Callable[[str], None] = print) -> None:
        """``policy``: ``skip`` (count the step, go on) or ``stop``; ``limit``: more skipped steps than this stop
        the run; ``fp16``: a skipped step with a finite loss is fp16 loss scaling at work, not a bad step."""
        self.policy, self.limit, self.fp16, self.log = policy, int(limit), bool(fp16), log

    def check(self, rec, applied: bool, seen: list) -> None:
        """After the optimizer step of ``rec`` (``rec.loss`` is global over the ranks): a non-finite loss or
        gradient norm is appended to ``seen`` and logged; raises :class:`NonFiniteError` when the policy stops the
        run, or when the update was applied anyway (the weights are no longer finite)."""
        bad = not math.isfinite(rec.loss) or (not applied and not self.fp16)  # fp16: overflow skips are loss scaling
        if not bad:
            return
        seen.append(rec.step)
        what = f"loss {rec.loss}" if not math.isfinite(rec.loss) else "gradient norm not finite"
        if applied:
            raise NonFiniteError(f"step {rec.step}: {what}, and the optimizer applied the update (this ds_config's "
                                 "optimizer does not skip non-finite steps; use ZeRO stage 3, or set "
                                 "'bf16': {'check_grad_overflow': true} with stage 1/2): the weights are no longer "
                                 "finite; resume from the last checkpoint")
        self.log(f"ds_adaptive: step {rec.step}: {what}: update skipped ({len(seen)} non-finite "
                 f"step(s) so far)")
        if self.policy == "stop":
            raise NonFiniteError(f"step {rec.step}: {what} (--nonfinite stop); the update was not applied; resume "
                                 "from the last checkpoint or use --nonfinite skip")
        if len(seen) > self.limit:
            raise NonFiniteError(f"{len(seen)} non-finite steps (steps {seen[-5:]} "
                                 f"the last), more than --nonfinite-limit {self.limit}: the run "
                                 "diverged; lower the learning rate or check the data")
