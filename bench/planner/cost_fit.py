"""Does the cost model predict real step time? Pearson r of predicted vs measured fwd+bwd time.

GPU (run by the lead on an H100):
    python bench/planner/cost_fit.py --model wan2.1-1.3b --layers 6 --profile h100-wan2.1-1.3b \
        --batches 40 --out bench/out/cost_fit_h100_1.3b
CPU smoke test:
    python bench/planner/cost_fit.py --device cpu --model tiny --shapes tests/data/tiny_shapes.json ...

Micro-batches are the ones the samplers form over the mixed shape distribution (the ``tokens``
baseline's and ``dual``'s plans at the profile's memory budget, deduplicated by (shape, B) and
picked evenly over the predicted-cost range, so that r is not computed on a cluster of
equal-cost batches). Each is timed fwd+bwd on the real Wan model (bf16, gradient checkpointing,
``--layers`` blocks instead of the full depth to keep the run short; the prediction uses the
profile scaled to that depth: c0 + B*(a*S + b*S^2) * layers/num_layers). Reports Pearson r of
the calibrated prediction, of the token count B*S (the paper found 0.35 for token count vs step
latency) and of the paper's B*S^p, the median |relative error| after one least-squares scale,
and writes JSON + a scatter PNG. Target: r >= 0.97 for the calibrated model.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ds_adaptive.calibration.calibrate import _config_dict  # noqa: E402
from ds_adaptive.core.config import SamplerConfig  # noqa: E402
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import load_profile  # noqa: E402
from ds_adaptive.planning.sampler import build_batch_sampler  # noqa: E402
from ds_adaptive.core.layout import Layout  # noqa: E402
from ds_adaptive.core.shapes import default_input_spec, load_shape_distribution  # noqa: E402
from ds_adaptive.simulation.simulate import draw_shapes  # noqa: E402


def candidate_batches(profile: str, shapes_file, m_mem, n_samples: int, seed: int, p: float):
    """(shape, B) pairs from the tokens and dual plans, with predicted per-GPU ms."""
    dist = load_shape_distribution(shapes_file)
    shapes = draw_shapes(dist, n_samples, seed)
    pairs = set()
    for mode in ("tokens", "dual"):
        cfg = SamplerConfig(mode=mode, profile=profile, m_mem=m_mem, window=64)
        s = build_batch_sampler(cfg, shapes, Layout.explicit(dp_size=8), micro_steps_per_step=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = s.plan
        for j, u in enumerate(plan.batch_shape.tolist()):
            pairs.add((plan.shapes[u], int(plan.batch_offsets[j + 1] - plan.batch_offsets[j])))
    return sorted(pairs, key=lambda x: (x[0].tokens, x[1]))


def pick_spread(items, costs, k):
    """k items evenly spread over the sorted cost range."""
    order = np.argsort(costs)
    if len(order) <= k:
        return [items[i] for i in order]
    idx = np.unique(np.rint(np.linspace(0, len(order) - 1, k)).astype(int))
    return [items[order[i]] for i in idx]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="wan2.1-1.3b")
    ap.add_argument("--layers", type=int, default=6, help="transformer blocks to run (default 6 of 30)")
    ap.add_argument("--profile", default="h100-wan2.1-1.3b", help="profile to predict with (name or json)")
    ap.add_argument("--shapes", default=None, help="shape-distribution json (default: the shipped Wan mix)")
    ap.add_argument("--m-mem", default="auto", help="memory budget (GiB) of the plans, default auto")
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--samples", type=int, default=4000, help="samples drawn to form the plans")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--p", type=float, default=1.5, help="exponent of the paper's B*S^p predictor")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--override", action="append", default=[], help="model config KEY=VALUE")
    ap.add_argument("--out", default="bench/out/cost_fit", help="output prefix (.json, .png)")
    args = ap.parse_args(argv)

    import torch

    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.models.wan_config import get_wan_config

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("cost_fit: no CUDA GPU visible; use --device cpu --model tiny for a smoke test", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    m_mem = args.m_mem if args.m_mem == "auto" else float(args.m_mem)
    prof = load_profile(args.profile)
    cost = CostModel(prof, "calibrated")
    pairs = candidate_batches(args.profile, args.shapes, m_mem, args.samples, args.seed, args.p)
    pred_full = [cost.batch_cost(s, b) for s, b in pairs]
    chosen = pick_spread(pairs, pred_full, args.batches)
    overrides = {}
    for ov in args.override:
        k, _, v = ov.partition("=")
        overrides[k] = json.loads(v)
    cfg = get_wan_config(args.model, **{**overrides, "num_layers": args.layers})
    full_layers = int(get_wan_config(args.model, **overrides).num_layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = WanModel(cfg)
    model.to_dtype(dtype)
    model.train()
    model.gradient_checkpointing = True
    depth = args.layers / full_layers
    rows = []
    print(f"{len(chosen)} micro-batches of {len(pairs)} candidates, {args.model} with {args.layers}/{full_layers} "
          f"blocks on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    for shape, b in chosen:
        lat = torch.randn(b, *shape.latent_shape, device=device, dtype=dtype)
        ts = torch.rand(b, device=device) * 1000
        ctx = torch.randn(b, default_input_spec().text_len, cfg.text_dim, device=device, dtype=dtype)

        def step():
            model(lat, ts, ctx).float().square().mean().backward()

        try:
            for _ in range(args.warmup):
                step()
            times = []
            for _ in range(args.iters):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append((time.perf_counter() - t0) * 1e3)
        except torch.OutOfMemoryError:
            print(f"  {shape} B={b}: out of memory, skipped")
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        model.zero_grad(set_to_none=True)
        predicted = cost.c0 + b * cost.per_gpu_cost(shape) * depth
        row = {"shape": str(shape), "B": b, "tokens": b * shape.tokens, "measured_ms": float(np.median(times)),
               "predicted_ms": predicted, "power": b * float(shape.tokens) ** args.p}
        rows.append(row)
        print(f"  {str(shape):>14} B={b:>4} tokens={row['tokens']:>7}: measured {row['measured_ms']:9.1f} ms, "
              f"predicted {predicted:9.1f} ms")
        del lat, ts, ctx
    if len(rows) < 3:
        print("cost_fit: fewer than 3 batches measured", file=sys.stderr)
        return 2
    meas = np.array([r["measured_ms"] for r in rows])
    pred = np.array([r["predicted_ms"] for r in rows])
    tok = np.array([r["tokens"] for r in rows], float)
    pw = np.array([r["power"] for r in rows])
    scale = float(pred @ meas / (pred @ pred))
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "model": args.model, "layers": args.layers, "full_layers": full_layers,
           "model_config": _config_dict(cfg), "profile": prof.name, "batches": rows,
           "pearson_r_calibrated": float(np.corrcoef(pred, meas)[0, 1]),
           "pearson_r_tokens": float(np.corrcoef(tok, meas)[0, 1]),
           "pearson_r_power": float(np.corrcoef(pw, meas)[0, 1]), "p": args.p,
           "scale_measured_over_predicted": scale,
           "median_abs_rel_err_after_scale": float(np.median(np.abs(scale * pred - meas) / meas)),
           "median_abs_rel_err_raw": float(np.median(np.abs(pred - meas) / meas)), "target_r": 0.97}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    axes[0].scatter(pred, meas, s=14)
    lim = [0, max(pred.max(), meas.max()) * 1.05]
    axes[0].plot(lim, [v * scale for v in lim], "k--", lw=0.8, label=f"measured = {scale:.2f} x predicted")
    axes[0].set(xlabel="predicted ms (calibrated c0 + B(aS + bS^2))", ylabel="measured fwd+bwd ms",
                title=f"calibrated: r = {res['pearson_r_calibrated']:.3f}")
    axes[0].legend()
    axes[1].scatter(tok, meas, s=14, color="tab:red")
    axes[1].set(xlabel="tokens in micro-batch (B x S)", ylabel="measured fwd+bwd ms",
                title=f"token count: r = {res['pearson_r_tokens']:.3f}")
    fig.suptitle(f"{res['model']} ({args.layers} blocks) on {res['device']}")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"Pearson r: calibrated {res['pearson_r_calibrated']:.3f}, tokens {res['pearson_r_tokens']:.3f}, "
          f"B*S^{args.p:g} {res['pearson_r_power']:.3f}; median |rel err| after scale "
          f"{res['median_abs_rel_err_after_scale']:.1%}; wrote {out.with_suffix('.json')} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
