"""The ``adaptive_load.sampler`` block: how micro-batches are formed and dealt out, and the global batch they fill
(the schema only: the sampler is :mod:`ds_adaptive.planning.sampler`)."""
from __future__ import annotations

import warnings
from typing import Literal, Optional, Union

from pydantic import Field, PrivateAttr, field_validator, model_validator

from ds_adaptive.core.config_base import _Block, advanced

__all__ = ["DROPPED_ZERO_STAGE", "GlobalBatchConfig", "SamplerConfig"]

#: the one line of a config that still sets ``adaptive_load.sampler.zero_stage``
DROPPED_ZERO_STAGE = ("adaptive_load.sampler.zero_stage is deprecated and goes in the next release: the ZeRO stage is "
                      "the ds_config's zero_optimization.stage (a value that disagrees with it is an error); drop the key")


class GlobalBatchConfig(_Block):
    """The global batch of one optimizer step, over all data-parallel ranks (an SP group counts once): set
    exactly one of `samples` and `tokens`. It means the same on 1 GPU and on 1,024: AdaptiveLoad chooses the
    micro-batches and the micro-steps per step (`gradient_accumulation_steps`) that fill it, and
    `m_comp: auto` / `gradient_accumulation_steps: auto` search only among plans that keep it."""

    samples: Optional[int] = Field(None, gt=0)
    """Samples per optimizer step (mean over the epoch's steps), over all data-parallel ranks."""

    tokens: Optional[int] = Field(None, gt=0)
    """Tokens (unpadded latent tokens) per optimizer step (mean over the epoch's steps), over all DP ranks."""

    tolerance: float = advanced(0.05, gt=0.0, le=0.5)
    """Largest relative gap between the planned mean per optimizer step and the set value; a plan outside it is
    not chosen (and when no plan keeps it, the run stops with one line giving the nearest values that can be
    planned). Single steps vary with the data around the mean (the dry run prints min / max)."""

    micro_step_share: Optional[float] = Field(0.5, gt=0.0, le=1.0)
    """Largest share of the global batch that one micro-step may hold (its batches on all data-parallel ranks): a
    rank's micro-batch holds at most `micro_step_share x value / dp` samples (tokens), however many the budgets
    allow, so that a micro-step of images (dozens per rank) cannot make its step several times the set value while
    the others hold a fraction of it. Lower it to hold single steps closer to the value (more, smaller image
    micro-batches); null: no limit (only the mean over the epoch is held). AdaptiveLoad's plans only: the
    equal-token baseline (`enabled: false`) batches as such setups do."""

    @model_validator(mode="after")
    def _exactly_one(self):
        if (self.samples is None) == (self.tokens is None):
            raise ValueError("set exactly one of 'samples' and 'tokens', e.g. {\"samples\": 256}")
        return self

    @property
    def by(self) -> str:   # what the global batch counts
        return "samples" if self.samples is not None else "tokens"

    @property
    def value(self) -> int:
        return int(self.samples if self.samples is not None else self.tokens)


class SamplerConfig(_Block):
    """How micro-batches are formed and dealt out to data-parallel ranks."""

    mode: Literal["dual", "tokens", "fixed"] = "dual"
    """`dual`: batches bounded by memory AND compute, micro-steps balanced by cost (AdaptiveLoad).
    `tokens`: equal-token bucketing dealt round-robin (the Open-Sora / DeepSpeed baseline).
    `fixed`: a fixed batch size per shape bucket."""

    cost_model: Literal["calibrated", "power", "tokens"] = "calibrated"
    """Per-sample compute cost: `calibrated` c0 + a*S + b*S^2 from a GPU profile, `power` S^p
    (the paper), `tokens` S (linear)."""

    p: float = advanced(1.5, gt=0.0, le=4.0)
    """Exponent of the `power` cost model, cost = S^p."""

    profile: Optional[str] = "auto"
    """Calibration profile: `auto` (the shipped calibration of the detected GPU, the trained model and the
    run's LayerNorm-modulate path, e.g. `h200-wan2.1-1.3b`; when none is shipped for them, rank 0
    calibrates at start-up (about a minute for Wan 1.3B), every rank plans with that profile and it is
    cached in `profile_cache` for the next run; without a GPU the H100 one), `calibrate` (the same
    start-up calibration, or its cached result, whatever is shipped), a shipped name (`h100-wan2.1-1.3b`,
    `h100-wan2.1-14b`, `h200-wan2.1-1.3b`, `h200-wan2.1-14b`) or a path to a profile json written by
    `ds-adaptive calibrate` (or `ds-adaptive refit`, fitted to your trainer runs). Required for
    `cost_model: calibrated` and for `m_mem: auto`."""

    profile_cache: Optional[str] = None
    """Directory of the profiles calibrated at start-up (`profile: auto` / `calibrate`), one json per GPU
    name, model, LayerNorm-modulate path, torch version and profile format. null: $DS_ADAPTIVE_CACHE_DIR,
    else $XDG_CACHE_HOME/ds_adaptive, else ~/.cache/ds_adaptive (a `profiles/` folder in it). Delete a
    file there to calibrate again."""

    batch_cap: Literal["auto", "off"] = advanced("auto")
    """Whether `m_comp: auto`'s search may stop each shape's batches at their lowest predicted time per sample.
    Under a budget where a shape's largest batch must checkpoint blocks, a smaller batch of it can take less
    time per sample (its cost plus the training loop's time per micro-step, over its samples). `auto`: the
    search scores each such budget as it is and with every shape's batch capped there, and runs the faster
    (the launcher's budget line says when batches are capped). `off`: batches grow to the budget. Only where
    the search runs (`mode: dual`, `cost_model: calibrated`, `recompute.blocks: auto`, `m_comp: auto`)."""

    m_comp: Union[float, Literal["auto"]] = "auto"
    """Compute budget per micro-batch per GPU, in the cost model's unit (ms for `calibrated`,
    S^p for `power`, tokens for `tokens`). `auto`: with `recompute.blocks: auto` and the calibrated model,
    the budget (below or above the costliest sample's B=1 cost, up to the costliest batch within
    `m_mem`) with the highest predicted tokens/s over the epoch's plan, recompute and per-step overheads
    included; samples costlier than it run alone; when the equal-token plan is predicted faster than
    every such budget, that plan (docs/MEMORY.md); otherwise the cost of the costliest sample at B=1.
    A ds_config with `"gradient_accumulation_steps": "auto"` lets the same search choose the micro-steps
    per step."""

    m_mem: Union[float, Literal["auto"]] = "auto"
    """Memory budget per micro-batch per GPU, in GiB of activation memory. `auto`: the GPU's
    capacity x `mem_utilization` minus the model/optimizer state of the profile."""

    mem_utilization: Optional[float] = Field(None, gt=0.0, le=1.0)
    """Fraction of GPU memory that `m_mem: auto` may plan for (static + activations). null: capacity
    minus the profile's measured fragmentation margin minus 3% headroom, or 0.85 when the profile
    has no measured margin."""

    max_tokens: Optional[int] = Field(None, gt=0)
    """`tokens` mode: tokens per micro-batch (default: what `m_mem` allows for the longest sample)."""

    fixed_batch_sizes: Optional[dict[str, int]] = advanced(None)
    """`fixed` mode: batch size per bucket, keyed "FxHxW" in pixels (e.g. "81x480x832": 1); missing buckets
    get the largest size that fits `m_mem`, a key that is not a shape of the data is an error."""

    window: int = advanced(256, ge=1)
    """Samples per data-parallel rank drawn (shuffled) per planning window: the planner sees
    `window` x dp_size samples at a time (plus leftovers carried from the previous window)."""

    balance_tolerance: float = advanced(0.03, gt=0.0, le=1.0)
    """`dual`: largest CV of predicted per-rank cost accepted for a micro-step; a micro-step over it
    is not formed and its long samples wait for partners in the next window (the epoch's last
    window is planned regardless)."""

    seed: int = 0
    """Seed of the shuffle; the plan is a pure function of (seed, epoch, shapes, config, topology)."""

    oversize: Literal["error", "skip"] = "error"
    """A sample over a budget even at B=1: `error` names it and stops; `skip` drops it with a
    counted warning (never silently)."""

    global_batch: Optional[GlobalBatchConfig] = None
    """Samples or tokens per optimizer step over all data-parallel ranks, e.g. `{"samples": 256}` or
    `{"tokens": 4000000}` (docs/SCALE.md): the same on any number of GPUs; the sampler chooses micro-batches and
    micro-steps per step to fill it within `tolerance` (the mean over the epoch; single steps vary with the
    data). An int `gradient_accumulation_steps` is kept, and the compute budget is chosen so that that many
    micro-steps hold it. null: the micro-steps per step alone set the batch (an int `gradient_accumulation_steps`:
    the dry run prints the global batch it gives; `auto`: it follows the world size, with a warning)."""

    shapes: Optional[str] = None
    """Shape-distribution json for the synthetic dataset (default: the trained model's shipped mix)."""

    _dropped_zero_stage: Optional[int] = PrivateAttr(None)

    @model_validator(mode="wrap")
    @classmethod
    def _drop_zero_stage(cls, data, handler):
        # the ZeRO stage is the ds_config's zero_optimization.stage; the old key is checked against it
        # (planning.validate) for one release, then it is an unknown key
        stage = None
        if isinstance(data, dict) and "zero_stage" in data:
            data = dict(data)
            stage = data.pop("zero_stage")
            if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage <= 3:
                raise ValueError(f"zero_stage (deprecated) must be 0..3, got {stage!r}; drop the key: the ZeRO stage "
                                 "is the ds_config's zero_optimization.stage")
            warnings.warn(DROPPED_ZERO_STAGE, FutureWarning, stacklevel=2)   # shown to users by default
        out = handler(data)
        if stage is not None:
            out._dropped_zero_stage = stage
        return out

    @property
    def dropped_zero_stage(self) -> Optional[int]:
        """The deprecated ``sampler.zero_stage`` a config still sets (None when it does not)."""
        return self._dropped_zero_stage

    @field_validator("m_mem", "m_comp")
    @classmethod
    def _budget_positive(cls, v):
        if v != "auto" and not v > 0:
            raise ValueError("must be > 0 or \"auto\"")
        return v
