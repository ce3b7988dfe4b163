"""The batch sampler's resumable state: ``state_dict`` after some optimizer steps of an epoch, ``load_state_dict`` on
the same or another layout (the samples of the epoch not yet consumed are re-planned for the new one)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ds_adaptive.planning.sparse_cost import SparseAttentionCost

STATE_FORMAT = "ds_adaptive.sampler_state/1"


class SamplerStateError(ValueError):
    """A sampler state that does not belong to this dataset / sampler."""


class ResumableState:
    """``state_dict`` / ``load_state_dict`` of :class:`ds_adaptive.planning.sampler._PlannedBatchSampler` (a mixin: it
    reads the sampler's plan, segments, cost and params)."""

    def state_dict(self, consumed_steps: int) -> dict:
        """JSON-able state after ``consumed_steps`` optimizer steps of the current epoch."""
        plan, start = self._plans()
        consumed_steps = int(consumed_steps)
        if not start <= consumed_steps <= start + plan.num_steps:
            raise ValueError(f"consumed_steps {consumed_steps} is outside epoch {self.epoch} "
                             f"({start}..{start + plan.num_steps})")
        segs = [dict(s) for s in self._segments]
        segs.append({**self._segment_config(), "consumed_steps": consumed_steps - start})
        out = {"format": STATE_FORMAT, "mode": self.mode, "seed": self.seed, "epoch": self.epoch,
               "consumed_steps": consumed_steps, "num_samples": len(self.shapes),
               "shapes_sha": self._fingerprint, "segments": segs}
        if self.cost.sparse is not None:   # run state, not config: restored by load_state_dict
            out["sparse"] = {"active": self.cost.sparse.describe(), "m_comp": self.params.m_comp,
                             "pending": self._pending}
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: same layout and config continue the saved plan exactly; otherwise the samples
        of the epoch not yet consumed are re-planned for this layout/config."""
        if state.get("format") != STATE_FORMAT:
            raise SamplerStateError(f"sampler state has format {state.get('format')!r}, expected "
                                    f"{STATE_FORMAT!r}; it was not written by this sampler")
        if state["num_samples"] != len(self.shapes) or state["shapes_sha"] != self._fingerprint:
            raise SamplerStateError(
                f"sampler state was saved for a dataset of {state['num_samples']} samples (shapes "
                f"{state['shapes_sha']}), this dataset has {len(self.shapes)} ({self._fingerprint}): the "
                "consumed samples cannot be identified. Resume with the same dataset, or pass --restart-epoch "
                "(RESUME=1 bash launch/train_wan.sh ... --restart-epoch) to keep the weights, optimizer and step "
                "and plan this epoch afresh for this dataset.")
        if int(state["seed"]) != self.seed:
            raise SamplerStateError(f"sampler state has seed {state['seed']}, this sampler {self.seed}: "
                                    "set sampler.seed to the saved value to resume")
        self.epoch = int(state["epoch"])
        segs = [dict(s) for s in state["segments"]]
        self._cache = None
        sparse_state = state.get("sparse")
        if sparse_state is not None and self.cost.sparse is not None:
            self.cost = self.cost.with_sparse(SparseAttentionCost.from_description(sparse_state["active"]))
            if self.m_comp_auto and sparse_state.get("m_comp") is not None:
                self.params = dataclasses.replace(self.params, m_comp=float(sparse_state["m_comp"]))
            self._pending = sparse_state.get("pending")
        last = segs[-1]
        if {k: v for k, v in last.items() if k != "consumed_steps"} == self._segment_config():
            self._segments = segs[:-1]
            self._resume_step = int(last["consumed_steps"])
        else:
            self._segments = segs
            self._resume_step = 0
