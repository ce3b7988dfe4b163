"""The ``adaptive_load`` sub-blocks of what a diffusion training run keeps besides its weights: an EMA of the
weights, caption dropout for classifier-free guidance, validation on a held-out split of the run's own data.

Each block is off when it is absent (null), so a ds_config without them trains exactly as before::

    "adaptive_load": {
      "ema": {"decay": 0.999},
      "caption_dropout": {"rate": 0.1},
      "validation": {"samples": 64, "every": 200}
    }

The schema only (pydantic, strict, ``extra="forbid"``, every field documented); the behaviour is
``ds_adaptive.training.ema``, ``ds_adaptive.models.objective.caption_dropout_draws`` and
``ds_adaptive.training.validation``. :func:`feature_problems` holds the rules that span these blocks and others
(``ds_adaptive.planning.validate`` reports them with the rest).
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["EmaConfig", "CaptionDropoutConfig", "ValidationConfig", "feature_problems", "validation_count"]


class _Strict(BaseModel):
    # as ds_adaptive.core.config._Block: no coercion, unknown keys are errors naming the key
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, use_attribute_docstrings=True)


class EmaConfig(_Strict):
    """An exponential moving average of the trained weights (ds_adaptive.training.ema), partitioned like them."""

    decay: float = Field(0.999, gt=0.0, lt=1.0)
    """Each update sets `ema = decay * ema + (1 - decay) * weights`; the average spans about
    `every / (1 - decay)` optimizer steps (0.999, every 1: the last ~1000 steps)."""

    every: int = Field(1, ge=1)
    """Update the EMA after every `every`-th optimizer step (counted from `start_step`)."""

    start_step: int = Field(0, ge=0)
    """The EMA starts as a copy of the weights after this optimizer step and is updated from then on (0: it
    starts from the initial weights, i.e. `--init-from` or the random init)."""

    parameters: Literal["all", "lora"] = "all"
    """Which parameters are averaged: `all` every trained parameter (the whole DiT; under LoRA the adapters,
    the frozen base being its own average), `lora` the LoRA adapters only (an error without
    `adaptive_load.lora.enabled`: a run that means to average only adapters never averages 14B weights)."""

    device: Literal["auto", "accelerator", "cpu"] = "auto"
    """Where each rank keeps the EMA of its partition (fp32, 4 bytes per averaged parameter / ranks):
    `accelerator` the training device (the memory planner counts it, `m_mem: auto` shrinks by it), `cpu`
    host memory (each update copies the rank's partition to the host), `auto` the accelerator unless the
    plan's memory budget with the EMA on it would not hold every sample at batch 1; then the CPU (a start-up
    note says so)."""


class CaptionDropoutConfig(_Strict):
    """Caption dropout: the model sees the empty prompt in a share of its training samples, so that
    classifier-free guidance (the unconditional branch) keeps working after fine-tuning."""

    rate: float = Field(0.1, gt=0.0, le=1.0)
    """Probability that a training sample's caption is replaced; drawn per sample from (seed, epoch, sample
    index), like the noise, so it does not depend on ranks or micro-batches and a resumed run drops the
    captions the straight run would have."""

    replace: Literal["empty", "zeros"] = "empty"
    """What replaces a dropped caption: `empty` the text encoder's embedding of the empty prompt (what Wan's
    pipelines feed the unconditional branch without a negative prompt; `ds-adaptive preprocess` stores it as
    `empty_prompt.safetensors` in the dataset, the synthetic dataset has its own), `zeros` an all-zero context."""

    embedding: Optional[str] = None
    """`replace: empty` from this safetensors file (one `[L, text width]` tensor, e.g. written by `ds-adaptive
    sample --text-encoder DIR --prompt "" --save-embeddings FILE`) instead of the dataset's own. null: the
    dataset's."""


class ValidationConfig(_Strict):
    """A held-out split of the run's dataset, excluded from training and scored during it at fixed timesteps
    and noise (ds_adaptive.training.validation)."""

    samples: Union[int, float]
    """Held-out samples: a count (an int >= 1) or a fraction of the dataset (a float in (0, 1)). They are never
    planned into a training batch."""

    every: int = Field(500, ge=1)
    """Score the split every `every` optimizer steps, and after the last step."""

    seed: int = 0
    """Picks the held-out samples and their fixed noise: the same split on every rank, after a resume and on
    another world size."""

    timesteps: int = Field(4, ge=1, le=64)
    """Fixed timesteps per held-out sample, `u = lo + (hi - lo) (k + 0.5) / timesteps` on the model's noise
    interval (the rows of one sample are planned like training samples)."""

    ema: bool = True
    """With `adaptive_load.ema`, also score the EMA weights (`validation_loss_ema`); doubles the forwards."""

    @field_validator("samples")
    @classmethod
    def _count_or_fraction(cls, v):
        if isinstance(v, bool):
            raise ValueError("must be a count (int >= 1) or a fraction (0 < float < 1), got a bool")
        if isinstance(v, int) and v < 1:
            raise ValueError(f"a count must be >= 1, got {v}")
        if isinstance(v, float) and not 0.0 < v < 1.0:
            raise ValueError(f"a fraction must be in (0, 1), got {v} (write a count as an int, e.g. 64)")
        return v


def validation_count(cfg: ValidationConfig, num_samples: int) -> int:
    """Held-out samples of a dataset of ``num_samples``: the count, or ``round(fraction x num_samples)`` (at
    least 1). A split that would leave no sample to train is a ``ValueError`` naming the key."""
    n = int(num_samples)
    k = cfg.samples if isinstance(cfg.samples, int) else max(1, round(cfg.samples * n))
    if k >= n:
        raise ValueError(f"adaptive_load.validation.samples {cfg.samples!r} holds out {k} of the dataset's {n} "
                         "samples, leaving none to train; hold out fewer (a count, or a fraction < 1)")
    return int(k)


def feature_problems(ema: Optional[EmaConfig], lora_enabled: bool) -> list[str]:
    """The rules that span these blocks and the rest of ``adaptive_load`` (one line each, naming the keys)."""
    out = []
    if ema is not None and ema.parameters == "lora" and not lora_enabled:
        out.append("adaptive_load.ema.parameters is 'lora' but adaptive_load.lora is not enabled: enable LoRA, or "
                   "set ema.parameters to 'all' to average every trained parameter")
    return out
