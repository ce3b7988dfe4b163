"""Sparse-attention densities that changed during training go back to the plan: :func:`sparse_rebalance`.

DSV's predictor learns which key blocks matter; the measured densities change the cost of attention, so the
sampler may re-plan the rest of the epoch (or the next one) and the Ulysses head placement may move heads. A
re-plan inside an epoch restarts the loader at that step: every sample is still seen exactly once, as after a
resume.
"""
from __future__ import annotations

from typing import Callable

__all__ = ["sparse_rebalance"]


def sparse_rebalance(sparse, run, *, epoch: int, step_in_epoch: int, global_step: int,
                     log: Callable[[str], None]) -> bool:
    """Hand changed densities to the sampler (re-plan from the next step of this epoch, or from the next epoch at
    its end) and the head placement; one line says what happened. Returns True when the sampler re-planned this
    epoch (the caller restarts its batch iterator)."""
    sampler = run.sampler
    ends = step_in_epoch >= sampler.steps_per_epoch
    rec = sparse.rebalance(sampler, model=run.model, layout=run.layout, at_step=None if ends else step_in_epoch,
                           measured_at=global_step)
    if rec is None:
        return False
    restart = False
    if not rec["sampler"]:
        what = "the sampler plans dense costs"
    elif rec["at_step"] is None:
        what = "the sampler re-plans from the next epoch (or keeps its plan where that is predicted faster)"
    elif sampler.density_updates and sampler.density_updates[-1].get("kept"):
        tps = sampler.density_updates[-1]["predicted_tokens_per_s"]
        comp = sampler.density_updates[-1]["predicted_compute_tokens_per_s"]
        what = (f"the sampler keeps its plan (predicted {tps['kept']:,.0f} tokens/s under the new cost, a re-plan "
                f"{tps['replan']:,.0f}; on compute alone {comp['kept']:,.0f} vs {comp['replan']:,.0f}); its "
                f"batches go on")
    else:
        what = f"the sampler re-planned epoch {epoch} from its step {rec['at_step']}"
        restart = True
    heads = "; heads re-placed" if rec["placement"] is not None else ""
    log(f"ds_adaptive: step {global_step}: sparse-attention densities changed (max {rec['max_change']:.3f}): "
        f"{what}{heads}")
    return restart
