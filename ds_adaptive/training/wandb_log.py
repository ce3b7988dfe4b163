"""Optional Weights & Biases logging next to TensorBoard (``adaptive_load.metrics.wandb``).

Off unless the config enables it; enabled without the ``wandb`` package installed, the run says so
once and logs without it (TensorBoard and metrics.jsonl are unaffected). Only the writer rank logs.
Entity, mode (``WANDB_MODE=offline``) and credentials come from wandb's own environment variables.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional


class WandbLogger:
    """One W&B run: scalars per step and images (previews)."""

    def __init__(self, run) -> None:
        self.run = run

    @classmethod
    def open(cls, *, project: str, log_dir: Path, config: dict, log=print) -> Optional["WandbLogger"]:
        """A logger for a run named after ``log_dir``, or None (with one message) when wandb is missing."""
        try:
            import wandb
        except ImportError:
            log("ds_adaptive.metrics: adaptive_load.metrics.wandb is true but the 'wandb' package is not installed; "
                "logging to TensorBoard / metrics.jsonl only (pip install wandb, or set metrics.wandb=false)")
            return None
        run = wandb.init(project=project, name=Path(log_dir).name, dir=str(log_dir), config=config)
        return cls(run)

    def scalars(self, step: int, values: dict) -> None:
        self.run.log(dict(values), step=int(step))

    def image(self, tag: str, image, step: int, caption: str = "") -> None:
        """``image``: uint8 ``[H, W, 3]`` numpy array."""
        import wandb

        self.run.log({tag: wandb.Image(image, caption=caption or None)}, step=int(step))

    def close(self) -> None:
        self.run.finish()
