"""Block fusion's compile-ahead in the trainer (``adaptive_load.block_fusion``): :class:`FusionWarmup`.

The compiled block pieces specialise on a few sizes (B = 1, element counts behind Inductor's fusion decisions),
so a micro-batch of a new (B, tokens per rank) pair can compile mid-step, for seconds, with
every other rank waiting at the next collective. The trainer therefore asks the model to compile (its optional
``warm_up_block_fusion``) for every pair of a plan before a step runs it: all of the first plan's pairs before
step 1, and the pairs a later plan adds (a new epoch's shuffle, a sparse re-plan) before that plan's first step.
Pairs already warmed cost nothing. Where torch.compile cannot work, the model raises
:class:`~ds_adaptive.models.family.BlockFusionUnavailable` with its blocks back on the eager path: one warning,
no further attempt, and the summary says so.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

from ds_adaptive.models.family import BlockFusionUnavailable

__all__ = ["FusionWarmup"]


class FusionWarmup:
    """Compiles the block-fusion pieces for each new plan's (B, tokens per rank) pairs before its first step."""

    def __init__(self, mode: str, warm: Callable[..., float], *, dtype, device, per_token: bool,
                 log: Callable[[str], None]) -> None:
        self.mode, self._warm_fn, self._log = mode, warm, log
        self._kw = {"dtype": dtype, "device": device, "per_token": per_token}
        self.warmed: set = set()
        self._plan = None
        self.first_s: Optional[float] = None   # before step 1
        self.later_s = 0.0                     # for pairs later plans added
        self.later_pairs = 0
        self.fallback: Optional[str] = None    # why the blocks run eager, if they do

    @classmethod
    def attach(cls, run, log: Callable[[str], None]) -> Optional["FusionWarmup"]:
        """The warm-up of ``run``'s model, or None with block fusion off (or a model without compiled pieces)."""
        mode = run.cfg.adaptive_load.block_fusion
        warm = getattr(run.model, "warm_up_block_fusion", None)
        if mode == "off" or warm is None:
            return None
        return cls(mode, warm, dtype=run.dtype, device=run.device,
                   per_token=run.preset.trains_per_token_timesteps(run.objective), log=log)

    def before_step(self, plan, pairs: Callable[[], Iterable[tuple[int, int]]], epoch: int) -> Optional[float]:
        """Call before each optimizer step with the sampler's current ``plan``. When it is not the plan seen last,
        compiles for its (B, tokens per rank) pairs (``pairs()``) that no earlier plan had; returns the seconds
        spent (None when nothing ran: the same plan, or block fusion fell back to eager)."""
        if self.fallback is not None or plan is self._plan:
            return None
        first = self._plan is None
        self._plan = plan
        new = set(pairs()) - self.warmed
        if not new:
            return None
        try:
            spent = self._warm_fn(new, **self._kw)
        except BlockFusionUnavailable as exc:   # the model's blocks are back on their eager path
            self.fallback = str(exc)
            self._log(f"ds_adaptive: warning: block fusion '{self.mode}' could not compile on this machine ({exc}); "
                      "the blocks run eager. Install a working triton (GPU) or C++ compiler (CPU), or set "
                      "adaptive_load.block_fusion to 'off' to skip the attempt")
            return None
        self.warmed |= new
        per_token = ", per-token modulation" if self._kw["per_token"] else ""
        if first:
            self.first_s = spent
            self._log(f"ds_adaptive: block fusion '{self.mode}' warm-up: {spent:.1f} s (compiled for the plan's "
                      f"{len(new)} (batch, tokens) pairs{per_token})")
        else:
            self.later_s += spent
            self.later_pairs += len(new)
            self._log(f"ds_adaptive: block fusion warm-up for {len(new)} new (batch, tokens) pair(s) of epoch "
                      f"{epoch}'s plan: {spent:.1f} s")
        return spent

    def summary(self) -> dict:
        """``block_fusion`` of the run summary."""
        return {"mode": self.mode, "warmup_s": self.first_s, "later_warmup_s": self.later_s,
                "later_pairs": self.later_pairs, "fallback": self.fallback}
