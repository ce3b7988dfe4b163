"""DSV's two-stage schedule: stage 1 dense while the predictor trains, stage 2 sparse where density is low.

Pure bookkeeping (no torch): which stage, which layers run sparse, when to profile. The runtime
feeds it the predictor loss and the profiled per-layer densities after every optimizer step.
"""
from __future__ import annotations

from typing import Optional, Sequence


class SparseSchedule:
    """Stage and per-layer decisions.

    * stage 1 (dense everywhere): every micro-step profiles (density) and trains the predictor;
      ends after ``warmup_steps`` optimizer steps or once the predictor loss < ``loss_threshold``.
    * stage 2: a layer is sparse iff it is not in ``dense_layers`` and its last profiled mean head
      density <= ``layer_density_threshold``; profiling + predictor training every
      ``profile_interval`` steps.
    * ``forced_density``: stage 2 from step 0, every non-dense layer sparse, no profiling; with
      ``forced_after_warmup`` stage 1 runs first as usual, then every non-dense layer is sparse (at
      the forced density) and profiling continues every ``profile_interval`` steps.
    """

    def __init__(self, num_layers: int, *, warmup_steps: int, loss_threshold: float, profile_interval: int,
                 layer_density_threshold: float, dense_layers: Optional[Sequence[int]] = None,
                 forced_density: Optional[float] = None, forced_after_warmup: bool = False):
        if dense_layers is None:
            dense_layers = sorted({0, num_layers - 1})
        bad = [i for i in dense_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"adaptive_load.sparse_attention.dense_layers has {bad}, outside the model's "
                             f"layers 0..{num_layers - 1}")
        self.num_layers = num_layers
        self.warmup_steps = warmup_steps
        self.loss_threshold = loss_threshold
        self.profile_interval = profile_interval
        self.layer_density_threshold = layer_density_threshold
        self.dense_layers = frozenset(int(i) for i in dense_layers)
        self.forced_density = forced_density
        self.forced_from_start = forced_density is not None and not forced_after_warmup
        self.step = 0
        self.stage = 2 if self.forced_from_start or warmup_steps == 0 else 1
        self.switched_at: Optional[int] = 0 if self.stage == 2 else None
        self.layer_density: list[Optional[float]] = [None] * num_layers

    def profile_now(self) -> bool:
        """Measure density / train the predictor in this optimizer step's forwards."""
        if self.forced_from_start:
            return False
        return self.stage == 1 or self.step % self.profile_interval == 0

    def is_sparse(self, layer: int) -> bool:
        if self.stage != 2 or layer in self.dense_layers:
            return False
        if self.forced_density is not None:
            return True
        d = self.layer_density[layer]
        return d is not None and d <= self.layer_density_threshold

    def sparse_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_sparse(i)]

    def end_step(self, predictor_loss: Optional[float], layer_density: Sequence[Optional[float]]) -> None:
        """After an optimizer step: record densities, maybe switch to stage 2, advance."""
        for i, d in enumerate(layer_density):
            if d is not None:
                self.layer_density[i] = float(d)
        self.step += 1
        if self.stage == 1 and (self.step >= self.warmup_steps
                                or (predictor_loss is not None and predictor_loss < self.loss_threshold)):
            self.stage = 2
            self.switched_at = self.step

    def state_dict(self) -> dict:
        return {"step": self.step, "stage": self.stage, "switched_at": self.switched_at,
                "layer_density": list(self.layer_density)}

    def load_state_dict(self, state: dict) -> None:
        if len(state["layer_density"]) != self.num_layers:
            raise ValueError(f"sparse schedule state has {len(state['layer_density'])} layers, the model "
                             f"{self.num_layers}: a checkpoint of another depth")
        self.step = int(state["step"])
        self.stage = int(state["stage"])
        self.switched_at = state["switched_at"]
        self.layer_density = list(state["layer_density"])
