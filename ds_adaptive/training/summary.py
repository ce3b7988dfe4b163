"""The run summary: totals of the step records (:func:`summarize`), JSON without NaN (:func:`json_safe`), and the
short block rank 0 prints at the end (:func:`format_summary`)."""
from __future__ import annotations

import math
from typing import Optional

__all__ = ["summarize", "json_safe", "format_summary", "COMPUTE_REFIT_HINT"]


def summarize(history: list, run_info: dict, *, timing: str, peak_tflops: float,
              warmup_steps: Optional[int] = None) -> dict:
    """Run totals of the step records ``history``; throughput and balance are measured after ``warmup_steps`` (default: 1 when
    the run has more than 2 steps: the first step pays for compilation and allocator growth)."""
    h = history
    if not h:
        return {**run_info, "steps": 0}
    if warmup_steps is None:
        warmup_steps = 1 if len(h) > 2 else 0
    measured = h[warmup_steps:]
    wall = sum(r.wall_s for r in measured)
    tokens = sum(r.tokens for r in measured)
    samples = sum(r.samples for r in measured)
    finite = [r.loss for r in h if math.isfinite(r.loss)]  # the trend of the steps that trained
    k = max(1, min(5, len(finite) // 2))
    first = sum(finite[:k]) / k if finite else float("nan")
    last = sum(finite[-k:]) / k if finite else float("nan")
    cap = h[-1].mem_capacity_gib
    peak = max(max(r.peak_mem_gib) for r in h)
    return {
        **run_info,
        "steps": len(h),
        "first_step": h[0].step,
        "last_step": h[-1].step,
        "samples": sum(r.samples for r in h),
        "tokens": sum(r.tokens for r in h),
        "wall_s": sum(r.wall_s for r in h),
        "warmup_steps": warmup_steps,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        "step_s_mean": wall / len(measured) if measured else 0.0,
        "peak_mem_gib": peak,
        "mem_capacity_gib": cap,
        "peak_mem_frac": peak / cap if cap > 0 else 0.0,
        "mem_efficiency": (sum(sum(r.peak_mem_gib) / len(r.peak_mem_gib) for r in measured)
                           / len(measured) / cap) if measured and cap > 0 else 0.0,
        "timing": timing,
        "cv_step": sum(r.cv_step for r in measured) / len(measured) if measured else 0.0,
        "cv_step_wall": sum(r.cv_step_wall for r in measured) / len(measured) if measured else 0.0,
        "compute_cv": sum(r.compute_cv for r in measured) / len(measured) if measured else 0.0,
        "idle_frac": sum(r.idle_frac for r in measured) / len(measured) if measured else 0.0,
        "loss_window": k,
        "loss_first": first,
        "loss_last": last,
        "loss_fell": last < first,
        "losses": [r.loss for r in h],
        "peak_tflops": peak_tflops,
        "mfu": _utilisation(measured, "model_flops"),
        "hfu": _utilisation(measured, "hw_flops"),
        "skipped_steps": [r.step for r in h if r.skipped],
        "samples_per_step": _mean_min_max([r.samples for r in h]),
        "tokens_per_step": _mean_min_max([r.tokens for r in h]),
    }


def _mean_min_max(xs: list) -> dict:
    """``{"mean", "min", "max"}`` of per-step global counts (samples or tokens of one optimizer step)."""
    return {"mean": sum(xs) / len(xs), "min": int(min(xs)), "max": int(max(xs))}


def _utilisation(records, attr: str) -> float:
    den = sum(r.wall_s * r.world * r.peak_tflops * 1e12 for r in records)
    return sum(getattr(r, attr) for r in records) / den if den > 0 else 0.0


def json_safe(obj):
    """``obj`` with every non-finite float replaced by None (JSON has no NaN/Infinity: strict readers
    reject Python's bare ``NaN``)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


#: a run's per-micro-step compute prediction error over which the summary gives the ``ds-adaptive refit`` command
COMPUTE_REFIT_HINT = 0.05


def _per_step_line(s: dict) -> str:
    """Samples and tokens per optimizer step (global, mean / min / max) and the set global batch."""
    sm, tk = s.get("samples_per_step"), s.get("tokens_per_step")
    if not sm:
        return "  per step         (no steps)"
    gb = s.get("global_batch")
    return (f"  per step         {sm['mean']:.1f} samples (min {sm['min']}, max {sm['max']}), {tk['mean']:.0f} tokens "
            f"(min {tk['min']}, max {tk['max']}); global_batch " + (", ".join(f"{k} {v}" for k, v in gb.items())
                                                                   if gb else "not set"))


def format_summary(s: dict) -> str:
    """A short human-readable block of the run summary (printed on rank 0)."""
    lines = [
        "=" * 72,
        f"ds_adaptive run summary  ({s.get('model', '?')}, {s.get('world_size', '?')} rank(s) on "
        f"{s.get('device', '?')}, sampler {s.get('sampler', '?')})",
        f"  steps            {s['steps']} (steps {s.get('first_step')}..{s.get('last_step')}), "
        f"{s['samples']} samples, {s['tokens']} tokens, {s['wall_s']:.1f} s",
        _per_step_line(s),
        f"  throughput       {s['tokens_per_s']:.1f} tokens/s, {s['samples_per_s']:.2f} samples/s, "
        f"{s['step_s_mean']:.3f} s/step (after {s['warmup_steps']} warm-up step(s))",
        f"  peak memory      {s['peak_mem_gib']:.2f} GiB of {s['mem_capacity_gib']:.1f} GiB "
        f"({100 * s['peak_mem_frac']:.1f}%; mean per-rank peak {100 * s['mem_efficiency']:.1f}%)",
        f"  balance          CV_step {100 * s['cv_step']:.1f}% ({s.get('timing', 'wall')} time; wall-clock "
        f"{100 * s.get('cv_step_wall', s['cv_step']):.1f}%), compute CV {100 * s['compute_cv']:.1f}%, "
        f"idle {100 * s['idle_frac']:.1f}%",
        f"  loss             first-{s['loss_window']} mean {s['loss_first']:.4f} -> last-{s['loss_window']} mean "
        f"{s['loss_last']:.4f} ({'falling' if s['loss_fell'] else 'NOT falling'})",
    ]
    if s.get("peak_tflops"):
        lines.append(f"  FLOPs            MFU {100 * s.get('mfu', 0.0):.1f}%, HFU {100 * s.get('hfu', 0.0):.1f}% "
                     f"(recompute excluded / included; dense bf16 peak {s['peak_tflops']:g} TFLOP/s per GPU)")
    cp = s.get("compute_prediction")
    if cp:
        off = cp["max_abs_rel_err"] > COMPUTE_REFIT_HINT and cp.get("refit")
        lines.append(f"  cost model       compute {cp['measured_over_predicted']:.3f}x the plan's prediction over "
                     f"{cp['micro_steps']} micro-steps (per micro-step max |err| {100 * cp['max_abs_rel_err']:.1f}%)"
                     + (f"; to plan with this run's costs: {cp['refit']} --out PROFILE.json" if off else ""))
    if s.get("nonfinite_steps"):
        n = s["nonfinite_steps"]
        lines.append(f"  non-finite       {len(n)} step(s) with a non-finite loss or gradient norm, update skipped "
                     f"(steps {n[:10]}{' ...' if len(n) > 10 else ''}); the loss trend leaves them out")
    if s.get("stopped"):
        st = s["stopped"]
        lines.append(f"  stopped          by {st['signal']} after step {st['step']}; checkpoint "
                     f"{st.get('checkpoint') or 'none (no --save)'}")
    sa = s.get("sparse_attention")
    if sa:
        be, calls = sa.get("backend") or {}, sa.get("layer_calls") or {}
        n_sparse = len((sa.get("layers") or {}).get("sparse", []))
        compiled = f", {be['graphs']} compiled graph(s) ({be.get('compile_s', 0.0):.1f} s)" if "graphs" in be else ""
        lines.append(f"  sparse attn      backend {be.get('name', '?')}, stage {sa.get('stage')}, {n_sparse} sparse "
                     f"layer(s); layer calls sparse {calls.get('sparse', 0)}, dense by cost "
                     f"{calls.get('dense_by_cost', 0)}; warm-up {sa.get('warmup_s', 0.0):.1f} s{compiled}")
    bf = s.get("block_fusion")
    if bf and bf.get("fallback"):
        lines.append(f"  block fusion     '{bf['mode']}' could not compile ({bf['fallback']}): the blocks ran eager")
    elif bf:
        later = (f", and {bf['later_warmup_s']:.1f} s for {bf['later_pairs']} new pair(s) of later plans"
                 if bf.get("later_pairs") else "")
        first = bf["warmup_s"] or 0.0
        lines.append(f"  block fusion     '{bf['mode']}': compiled before step 1 in {first:.1f} s{later}")
    if "eval_loss" in s:
        lines.append(f"  held-out loss    {s['eval_loss']:.4f} ({s.get('eval', {}).get('samples', '?')} samples x "
                     f"{s.get('eval', {}).get('timesteps', '?')} fixed timesteps)")
    if "validation_loss" in s:
        v, ema = s.get("validation") or {}, s.get("validation_loss_ema")
        lines.append(f"  validation       loss {s['validation_loss']:.4f}" + (f", EMA weights {ema:.4f}" if ema is not None
                     else "") + f" ({v.get('scored')} held-out samples x {v.get('timesteps')} fixed timesteps)")
    if s.get("ema"):
        e = s["ema"]
        lines.append(f"  EMA              decay {e['decay']:g}, {e['updates']} updates, {e['numel']:,} parameters, "
                     f"{e['bytes_per_rank'] / 2**20:.1f} MiB per rank on {e['device']}")
    if s.get("caption_dropout"):
        c = s["caption_dropout"]
        lines.append(f"  caption dropout  {c['dropped']} of {c['samples']} samples ({100 * c['observed_rate']:.1f}%, "
                     f"rate {c['rate']:g}, {c['replace']})")
    lines.append("=" * 72)
    return "\n".join(lines)
