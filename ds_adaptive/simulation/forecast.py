"""Forecasts of a training job's plan on the CPU: the budget search's candidates and a plan's predicted MFU.

A forecast plans the job the way the trainer plans it on one GPU (the job's ``adaptive_load.sampler`` block, the
trainer's embedded synthetic dataset, ``gradient_accumulation_steps: auto``, ZeRO-3, the fused LayerNorm-modulate
path, block fusion ``regions``) and times the plan with a profile's calibrated cost plus the training loop's terms
(``Profile.micro_step_overhead_ms``, ``Profile.optimizer_step_overhead_ms``). It explains a plan choice; what a
plan trains at is the trainer's figure. ``bench/planner/budget_candidates.py`` and ``bench/planner/plan_mfu.py``
print these forecasts.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from ds_adaptive.core.config import SamplerConfig
from ds_adaptive.core.layout import Layout
from ds_adaptive.core.shapes import SampleShape
from ds_adaptive.data.synthetic import SyntheticLatentDataset
from ds_adaptive.models.registry import get_model
from ds_adaptive.planning.budget import BudgetChoice, predicted_times
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import Profile
from ds_adaptive.planning.sampler import build_batch_sampler


def job_shapes(samples: int, seed: int = 0) -> list[SampleShape]:
    """Every sample's shape of the trainer's embedded synthetic dataset of ``samples`` samples drawn with
    ``seed`` (the default job's data: ``--num-samples``, seed 0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SyntheticLatentDataset(samples, seed=seed).sample_shapes()


def default_job_sampler(sampler_cfg: Mapping, profile: Profile, gpu_mem_gib: float, samples: int, *,
                        model_name: str, recompute: Optional[Mapping] = None, **overrides):
    """The job's batch sampler on one GPU, as the trainer builds it.

    ``sampler_cfg``: a ds_config's ``adaptive_load.sampler`` block, with ``overrides`` of its keys (e.g.
    ``batch_cap="off"``); ``recompute``: the job's ``adaptive_load.recompute`` block (e.g. ``{"attention":
    "recompute"}``; None: its defaults); ``profile``: the profile to plan with;
    ``gpu_mem_gib``: the GPU's memory, GiB; ``samples``: the synthetic dataset's size; ``model_name``: a
    registered model (``ds_adaptive.models.registry``)."""
    cfg = SamplerConfig.model_validate({**dict(sampler_cfg), **overrides})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_batch_sampler(cfg, job_shapes(samples), Layout.explicit(dp_size=1, sp_size=1),
                                   micro_steps_per_step="auto", gpu_mem_gib=gpu_mem_gib, model_name=model_name,
                                   zero_stage=3, ln_modulate="fused", profile=profile, per_token_timesteps=False,
                                   block_fusion="regions", recompute=recompute)


def loop_name(micro_ms: float, step_ms: float) -> str:
    """The name of a pair of loop terms (ms per micro-step, ms per optimizer step): ``"35.4 / 66.4 ms"``."""
    return f"{micro_ms:g} / {step_ms:g} ms"


def budget_choices(sampler_cfg: Mapping, profile: Profile, gpu_mem_gib: float, samples: int, *, model_name: str,
                   loops: Optional[Sequence[tuple[float, float]]] = None,
                   checkpoint_attention: str = "auto") -> dict[str, tuple[BudgetChoice, str]]:
    """The budget search's choice under each pair of training-loop terms.

    ``loops``: pairs of (ms per micro-step, ms per optimizer step) to plan with; ``None``: the profile's own.
    Returns ``{loop_name: (BudgetChoice, checkpoint_attention planned)}``; ``checkpoint_attention``: the
    ``recompute.attention`` to plan with (``auto`` plans both modes and takes the one predicted faster, as the
    trainer does)."""
    pairs = loops or [(profile.micro_step_overhead_ms, profile.optimizer_step_overhead_ms)]
    out = {}
    for micro, step in pairs:
        s = default_job_sampler(sampler_cfg, profile.with_train_overheads(micro, step), gpu_mem_gib, samples,
                                model_name=model_name, recompute={"attention": checkpoint_attention})
        out[loop_name(micro, step)] = (s.budget_choice, s.cost.checkpoint_attention)
    return out


def describe_choices(choices: Mapping[str, tuple[BudgetChoice, str]]) -> dict:
    """``budget_choices``' result as JSON: per loop-term name, ``BudgetChoice.describe()`` and
    ``checkpoint_attention``."""
    return {n: {**c.describe(), "checkpoint_attention": attention} for n, (c, attention) in choices.items()}


def parse_arm(text: str) -> tuple[str, dict]:
    """``NAME:key=value,...`` -> (NAME, overrides of :func:`default_job_sampler`); a key is one of the ``sampler``
    block, or ``recompute.KEY`` one of the ``recompute`` block (``overrides["recompute"]``, e.g.
    ``keep:recompute.attention=keep,batch_cap=off``). ``ValueError`` on a malformed arm."""
    name, _, rest = text.partition(":")
    if not name:
        raise ValueError(f"--arm {text!r}: expected NAME:key=value,... (NAME not empty)")
    over = {}
    for item in filter(None, rest.split(",")):
        k, eq, v = item.partition("=")
        if not eq:
            raise ValueError(f"--arm {text!r}: expected key=value, got {item!r}")
        block, dot, key = k.strip().rpartition(".")
        if dot and block != "recompute":
            raise ValueError(f"--arm {text!r}: {k.strip()!r} is not a sampler key or recompute.KEY")
        (over.setdefault("recompute", {}) if dot else over)[key] = v.strip()
    return name, over


def _plan_flops(plan, cost: CostModel, model_name: str, lo: int, hi: int) -> np.ndarray:
    """[batches, 2] model and hardware FLOPs of batches ``lo:hi`` of ``plan``, as the trainer counts them."""
    preset = get_model(model_name)
    cfg = preset.config(num_layers=cost.profile.num_layers)
    kept = cost.checkpoint_attention == "keep"
    sizes, tokens, ckpt = plan.batch_sizes()[lo:hi], plan.batch_tokens[lo:hi], plan.batch_ckpt[lo:hi]
    return np.array([preset.flops(cfg, int(t // b), int(b), int(n), kept_attention=kept)
                     for t, b, n in zip(tokens.tolist(), sizes.tolist(), ckpt.tolist())])


def plan_mfu(sampler, first: int, last: int, peak_tflops: float, *, model_name: str,
             truth: Optional[Profile] = None) -> dict:
    """Predicted totals of the plan's optimizer steps ``first..last`` (0-based, inclusive).

    Time: each micro-step's costliest batch plus the loop's terms. Returns tokens, samples, ``predicted_s``
    (seconds), ``tokens_per_s``, ``mfu`` / ``hfu`` (model / hardware FLOPs over time x ``peak_tflops``, the dense
    bf16 peak of one GPU in TFLOP/s, as the trainer's summary counts them) and checkpointed blocks per token.
    ``truth``: a profile to time the plan with instead of the one it was made with (e.g. a refit to the
    trainer's compute windows, ``ds-adaptive refit``)."""
    plan, cost = sampler.plan, sampler.cost
    if truth is not None:
        cost = CostModel(truth, cost.mode, p=cost.p, sp=cost.sp, num_heads=cost.num_heads,
                         checkpointing=cost.checkpointing, checkpoint_attention=cost.checkpoint_attention)
    gas, dp = plan.micro_steps_per_step, plan.dp_size
    last = min(last, plan.num_steps - 1)
    lo, hi = first * gas * dp, (last + 1) * gas * dp
    sizes, tokens, ckpt = plan.batch_sizes()[lo:hi], plan.batch_tokens[lo:hi], plan.batch_ckpt[lo:hi]
    flops = _plan_flops(plan, cost, model_name, lo, hi)
    t = predicted_times(plan, cost)[first * gas:(last + 1) * gas]
    n_steps = last - first + 1
    ms = float(t.max(axis=1).sum()) + n_steps * gas * cost.profile.micro_step_overhead_ms \
        + n_steps * cost.profile.optimizer_step_overhead_ms
    den = ms / 1e3 * dp * peak_tflops * 1e12
    return {"m_comp_ms": sampler.params.m_comp, "gas": gas, "batch_cap": sampler.params.efficient_batches,
            "checkpoint_attention": cost.checkpoint_attention, "steps": n_steps, "samples": int(sizes.sum()),
            "tokens": int(tokens.sum()), "predicted_s": ms / 1e3, "tokens_per_s": float(tokens.sum()) / ms * 1e3,
            "mfu": float(flops[:, 0].sum()) / den, "hfu": float(flops[:, 1].sum()) / den,
            "ckpt_blocks_per_token": float((ckpt * tokens).sum() / tokens.sum())}


def match_runs(rows: Mapping[str, dict], run_dirs: Iterable[str]) -> list[dict]:
    """Each measured run (a trainer ``--log-dir`` with ``summary.json``) beside the arm of ``rows`` whose plan
    trains its tokens (``job_tokens``: all steps' tokens): the run's MFU, the arm, and measured / predicted MFU
    (``None`` without a matching arm). ``FileNotFoundError`` for a directory without ``summary.json``."""
    runs = []
    for d in run_dirs:
        path = Path(d) / "summary.json"
        if not path.is_file():
            raise FileNotFoundError(f"--run {d}: no summary.json there; pass a run's --log-dir")
        s = json.loads(path.read_text())
        match = next((n for n, r in rows.items() if r["job_tokens"] == s["tokens"]), None)
        runs.append({"run": str(d), "tokens": s["tokens"], "mfu": s["mfu"], "tokens_per_s": s["tokens_per_s"],
                     "arm": match, "measured_over_predicted_mfu": s["mfu"] / rows[match]["mfu"] if match else None})
    return runs


def run_lines(runs: Sequence[dict], rows: Mapping[str, dict]) -> list[str]:
    """One line per :func:`match_runs` row: its measured MFU against its arm's prediction."""
    lines = []
    for r in runs:
        if r["arm"] is None:
            lines.append(f"run {r['run']}: measured MFU {r['mfu']:.1%} over {r['tokens']:,} tokens; no arm planned "
                         "those tokens (other settings or code)")
        else:
            lines.append(f"run {r['run']}: measured MFU {r['mfu']:.1%}, arm {r['arm']} predicted "
                         f"{rows[r['arm']]['mfu']:.1%}: measured / predicted {r['measured_over_predicted_mfu']:.3f}")
    return lines
