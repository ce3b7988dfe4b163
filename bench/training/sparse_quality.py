"""Quality of DSV sparse attention in training: dense vs sparse, same seeds, through the trainer.

Two arms are built the way users run them (``build_run`` + ``Trainer``, ``adaptive_load.sparse_attention``)
from one config and trained step by step *interleaved* in one process (arm A step k, arm B step k,
...), so that a deadline stops both at the same step. Same model init, same samples, same flow-matching
noise (seeded per sample), same held-out samples:

* ``dense``: plain SDPA attention;
* ``sparse``: DSV's two stages: stage 1 (``--stage1`` steps) dense attention while the profiler
  measures every step (and, with ``block_score`` lse / mean, the predictor trains); stage 2 every layer
  except the first and the last runs block-sparse at ``--density`` (top-k key blocks per query block by
  the run's block scores, default ``pooled_lse``;
  ``forced_density`` + ``forced_after_warmup``: a randomly initialised model is dense, its natural
  density would never make a layer sparse), re-profiled every ``--profile-interval`` steps;
  ``rebalance: off``, so that the sampler keeps the dense plan and both arms see the same batches.

Data: the embedded default shape distribution (``ds_adaptive/data/default_shapes.json``) bounded to
three shapes (as the first runs, when flex compiled once per shape): its image weight goes to one image shape, its
17-33-frame videos to one short video and its 49-81-frame videos to one long video, all at
``--resolution`` (default 480x832: 1,560 / 7,800 / 14,040 tokens on Wan's 1.3B grid) with fixed
batch sizes of ~12-16k tokens (``--batch``). Held-out loss: ``Trainer.evaluate`` (held-out
synthetic samples, 4 fixed timesteps each) every ``--eval-every`` steps, for both arms the same way, and
for the sparse arm once more with dense attention in every layer (``SparseAttentionRuntime.dense_only``):
is a gap in the weights, or in the attention the sparse arm evaluates with? ``--seeds 0 1 2`` runs both
arms per seed, one after the other (one JSON per seed and one with the mean / spread of the ratios).

At the end: the natural density (share of key blocks holding 99% of the softmax mass) the profiler
measured in training, and on held-out inputs the recall (exact softmax mass inside the selected
blocks, sampled query rows) of the trained predictor's selection at ``--density`` and at each head's
natural density, next to random blocks at the same density. Prints a table of ratios, writes JSON
and a PNG of the training and held-out loss curves.

    python bench/training/sparse_quality.py --out bench/out/sparse_quality.json       # H200
    python bench/training/sparse_quality.py --model tiny --layers 4 --resolution 64x128 --stage1 3 --stage2 4 \\
        --eval-every 3 --out /tmp/q.json                                            # CPU smoke
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from ds_adaptive.simulation.curves import steps_to_loss  # noqa: E402

ARMS = ("dense", "sparse")


def shape_mix(resolution: str, batch: list[int]) -> tuple[list[dict], dict]:
    """The default distribution bounded to 3 shapes (image / short video / long video) at ``resolution``."""
    default = json.loads((ROOT / "ds_adaptive" / "data" / "default_shapes.json").read_text())["shapes"]
    w = {"image": 0.0, "short": 0.0, "long": 0.0}
    for s in default:
        w["image" if s["frames"] == 1 else "short" if s["frames"] <= 33 else "long"] += s["weight"]
    h, wd = (int(x) for x in resolution.split("x"))
    frames = {"image": 1, "short": 17, "long": 33}
    shapes = [{"frames": frames[k], "height": h, "width": wd, "weight": w[k]} for k in ("image", "short", "long")]
    fixed = {f"{s['frames']}x{h}x{wd}": b for s, b in zip(shapes, batch)}
    return shapes, fixed


def arm_config(args, arm: str, shapes_path: Path, fixed: dict, log_dir: Path) -> dict:
    stage = 3
    cfg = {
        "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage, "overlap_comm": False, "contiguous_gradients": True,
                              "stage3_param_persistence_threshold": 100000},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.99], "eps": 1e-8,
                                                  "weight_decay": 0.0, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                                     "warmup_num_steps": 20}},
        "adaptive_load": {
            "enabled": True, "fused_ln_modulate": False,
            "sampler": {"mode": "fixed", "profile": args.profile, "m_mem": args.m_mem, "shapes": str(shapes_path),
                        "fixed_batch_sizes": fixed},
            "recompute": {"blocks": args.grad_ckpt},
            "metrics": {"interval": args.log_interval, "log_dir": str(log_dir)}}}
    if arm == "sparse":
        last = args.layers - 1
        cfg["adaptive_load"]["sparse_attention"] = {
            "enabled": True, "forced_density": args.density, "forced_after_warmup": True,
            "warmup_steps": args.stage1, "loss_threshold": 0.0, "profile_interval": args.profile_interval,
            "dense_layers": [0, last], "backend": args.backend, "block_size": args.block_size,
            "cube": args.cube, "sample_rows": args.sample_rows, "block_score": args.block_score,
            "rebalance": args.rebalance}  # off (default): the dense plan, both arms train the same batches
    return cfg


def build_trainers(args, out_dir: Path):
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig
    from ds_adaptive.planning.memory import configure_allocator
    from ds_adaptive.training.trainer import Trainer
    from ds_adaptive.training.engine import init_distributed

    configure_allocator()  # as the trainer's main does, before the first CUDA allocation
    _, _, device = init_distributed(0)
    if args.device == "cpu":
        device = torch.device("cpu")
    shapes, fixed = shape_mix(args.resolution, args.batch)
    shapes_path = out_dir / "shapes_quality.json"
    shapes_path.write_text(json.dumps({"description": "sparse_quality.py: default_shapes.json bounded to 3 shapes",
                                       "shapes": shapes}, indent=1))
    trainers = {}
    for arm in ARMS:
        raw = arm_config(args, arm, shapes_path, fixed, out_dir / f"run_{arm}")
        cfg = RunConfig.load(raw, trainer={"model": args.model, "layers": args.layers, "steps": args.stage1 + args.stage2,
                                           "seed": args.seed, "num_samples": args.num_samples,
                                           "workers": args.workers, "compute_timing": False})
        run = build_run(cfg, layout=Layout.detect(1, ds_config=cfg.ds_config), device=device)
        trainers[arm] = Trainer(run)
    return trainers, shapes, fixed, device


def train(args, trainers) -> dict:
    """Interleaved steps; held-out loss every ``eval_every`` steps; stops both arms at the deadline."""
    total = args.stage1 + args.stage2
    hist = {a: {"loss": [], "step_s": [], "eval": []} for a in ARMS}
    hist["sparse"]["eval_dense_attn"] = []  # the sparse arm's weights, evaluated with full attention
    t_start = time.perf_counter()
    stopped = None
    for step in range(1, total + 1):
        for arm in ARMS:
            t0 = time.perf_counter()
            rec = trainers[arm].train_step()
            hist[arm]["loss"].append(float(rec.loss))
            hist[arm]["step_s"].append(time.perf_counter() - t0)
        if step % args.eval_every == 0 or step == total:
            evaluate_arms(trainers, hist, step, args.eval_samples)
        if step % args.log_interval == 0 or step == 1:
            rt = trainers["sparse"].sparse.runtime
            print(f"step {step}/{total}  dense {hist['dense']['loss'][-1]:.4f}  sparse "
                  f"{hist['sparse']['loss'][-1]:.4f}  stage {rt.schedule.stage}  "
                  f"({time.perf_counter() - t_start:.0f} s)", flush=True)
        if time.perf_counter() - t_start > args.deadline_s:
            stopped = step
            print(f"deadline {args.deadline_s} s reached after step {step}: both arms stop here", flush=True)
            if not hist["dense"]["eval"] or hist["dense"]["eval"][-1][0] != step:
                evaluate_arms(trainers, hist, step, args.eval_samples)
            break
    hist["steps"] = len(hist["dense"]["loss"])
    hist["stopped_at_deadline"] = stopped
    hist["train_s"] = time.perf_counter() - t_start
    return hist


def evaluate_arms(trainers, hist: dict, step: int, samples: int) -> None:
    """Held-out loss of both arms the same way (``Trainer.evaluate``: the same held-out samples, timesteps
    and noise), and of the sparse arm once more with dense attention in every layer."""
    for arm in ARMS:
        hist[arm]["eval"].append((step, trainers[arm].evaluate(samples)["eval_loss"]))
    with trainers["sparse"].sparse.runtime.dense_only():
        hist["sparse"]["eval_dense_attn"].append((step, trainers["sparse"].evaluate(samples)["eval_loss"]))


@torch.no_grad()
def capture_qk(trainer, num_samples: int, seed: int) -> list[dict]:
    """q, k of every sparse-runtime layer on held-out samples (4 fixed timesteps each, as ``evaluate``)."""
    import torch.nn.functional as F

    from ds_adaptive.data import build_dataset
    from ds_adaptive.models.objective import eval_inputs
    from ds_adaptive.training.evaluation import EVAL_SEED_OFFSET

    run, rt = trainer.run, trainer.sparse.runtime
    ds = build_dataset("synthetic", num_samples=num_samples, spec=run.preset.input_spec,
                       shapes=run.cfg.adaptive_load.sampler.shapes or run.preset.shapes, seed=seed + EVAL_SEED_OFFSET + 17)
    captured: list[dict] = []
    orig = rt.attention

    def spy(layer, q, k, v, **kw):
        captured[-1][layer] = (q.detach(), k.detach(), kw.get("valid_len"))
        return orig(layer, q, k, v, **kw)

    rt.attention = spy
    trainer.engine.eval()
    try:
        for i in range(len(ds)):
            s = ds[i]
            x_t, ts, _ = eval_inputs(s["latents"].to(run.device), i, seed=seed, shift=trainer.opts.shift)
            ctx = F.pad(s["context"].to(run.device), (0, 0, 0, run.text_len - s["context"].shape[0]))
            captured.append({})
            trainer.engine(x_t.to(run.dtype), ts, ctx.unsqueeze(0).expand(x_t.shape[0], -1, -1).to(run.dtype))
    finally:
        del rt.attention
        trainer.engine.train()
    return captured


@torch.no_grad()
def recall_table(trainer, captured: list[dict], density: float, rows: int, seed: int) -> list[dict]:
    """Per sparse layer: natural density on held-out inputs and the recall of the predictor's selection."""
    from ds_adaptive.attention.profiler import exact_logits, profile_rows, sample_row_groups
    from ds_adaptive.attention.selection import blocks_for_density, select_blocks

    rt = trainer.sparse.runtime
    cfg, bs = rt.cfg, rt.cfg.block_size
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in rt.schedule.sparse_layers():
        acc: dict[str, list] = {k: [] for k in ("natural", "rec_forced", "rec_natural", "rec_random_natural",
                                                "tokens")}
        for sample in captured:
            q, k, valid = sample[layer]
            s = q.shape[1]
            nk = math.ceil(s / bs)
            r, per = sample_row_groups(s, rows, bs, generator=gen, valid_len=valid, device=q.device)
            logits = exact_logits(q, k, r, valid_len=valid)
            nat = profile_rows(logits, r, bs, cfg.mass, per_block=per).density  # [H], what the profiler measures
            scores = rt.block_scores(layer, q, k)  # the run's block_score
            rand = torch.rand(scores.shape, generator=gen).to(scores.device)
            k_forced = blocks_for_density(torch.full((q.shape[2],), density), nk)
            k_nat = blocks_for_density(nat.cpu(), nk)
            for key, sc, kph in (("rec_forced", scores, k_forced), ("rec_natural", scores, k_nat),
                                 ("rec_random_natural", rand, k_nat)):
                sel = select_blocks(sc, kph, seq_len=s, block_size=bs, keep_sink=cfg.keep_sink)
                acc[key].append(profile_rows(logits, r, bs, cfg.mass, sel).recall.mean().item())
            acc["natural"].append(nat.mean().item())
            acc["tokens"].append(s)
        row = {"layer": layer, **{k: sum(v) / len(v) for k, v in acc.items() if k != "tokens"},
               "tokens": sorted(set(acc["tokens"])),
               "natural_profiled": float(rt.head_density[layer].mean())}
        out.append(row)
    return out


def window_mean(xs: list, frac: float = 0.2) -> float:
    n = max(1, int(round(len(xs) * frac)))
    tail = xs[-n:]
    return sum(tail) / len(tail)


def summarize(hist: dict, recall: list[dict], stage1: int) -> dict:
    steps = hist["steps"]
    lo = steps - max(1, int(round(steps * 0.2)))  # last 20% of steps
    tr = {a: window_mean(hist[a]["loss"]) for a in ARMS}
    evals = {**{a: hist[a]["eval"] for a in ARMS}, "sparse_dense_attn": hist["sparse"]["eval_dense_attn"]}
    ev = {a: [v for s, v in e if s > lo] or [e[-1][1]] for a, e in evals.items()}
    ev = {a: sum(v) / len(v) for a, v in ev.items()}
    st = {a: sorted(hist[a]["step_s"][stage1:])[len(hist[a]["step_s"][stage1:]) // 2]
          if len(hist[a]["step_s"]) > stage1 else float("nan") for a in ARMS}
    mean = lambda key: sum(r[key] for r in recall) / len(recall) if recall else float("nan")  # noqa: E731
    s = {"steps": steps, "stage2_steps": max(0, steps - stage1), "last20_from_step": lo + 1,
         "train_loss_last20": tr, "eval_loss_last20": ev,
         "train_ratio": tr["sparse"] / tr["dense"], "eval_ratio": ev["sparse"] / ev["dense"],
         "eval_ratio_dense_attn": ev["sparse_dense_attn"] / ev["dense"],
         "stage1_end_eval": {a: next((v for st_, v in evals[a] if st_ >= stage1), None) for a in evals},
         "median_stage2_step_s": st, "step_time_ratio": st["dense"] / st["sparse"],
         "natural_density": mean("natural"), "natural_density_profiled": mean("natural_profiled"),
         "recall_forced": mean("rec_forced"), "recall_natural": mean("rec_natural"),
         "recall_random_natural": mean("rec_random_natural")}
    s["train_within_2pct"] = abs(s["train_ratio"] - 1) <= 0.02
    s["eval_within_2pct"] = abs(s["eval_ratio"] - 1) <= 0.02
    # the gap in steps: while the curves still fall, a lead of a few dozen steps is a 10% last-window ratio
    s["steps_to_loss"] = steps_to_loss(hist["dense"]["loss"], hist["sparse"]["loss"])
    return s


def plot(hist: dict, stage1: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"dense": "tab:blue", "sparse": "tab:orange"}
    for arm in ARMS:
        ys = hist[arm]["loss"]
        xs = list(range(1, len(ys) + 1))
        w = 20
        smooth = [sum(ys[max(0, i - w + 1):i + 1]) / len(ys[max(0, i - w + 1):i + 1]) for i in range(len(ys))]
        a.plot(xs, ys, color=colors[arm], alpha=0.2, lw=0.5)
        a.plot(xs, smooth, color=colors[arm], label=f"{arm} (mean of 20 steps)")
        es = hist[arm]["eval"]
        b.plot([s for s, _ in es], [v for _, v in es], "o-", color=colors[arm], ms=3, label=arm)
    for ax, title in ((a, "training loss"), (b, "held-out loss")):
        ax.axvline(stage1 + 0.5, color="gray", ls="--", lw=0.8)
        ax.set_xlabel("optimizer step (dashed: stage 2 begins)")
        ax.set_title(title)
        ax.legend()
    a.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def meta(args, device) -> dict:
    commit = os.environ.get("GIT_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                            capture_output=True, text=True).stdout.strip()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python bench/training/sparse_quality.py " + " ".join(sys.argv[1:]), "args": vars(args)}


def print_table(s: dict, recall: list[dict], density: float) -> None:
    print(f"\nsteps {s['steps']} (stage 2: {s['stage2_steps']}); last 20% = steps {s['last20_from_step']}..{s['steps']}")
    print("| metric | dense | sparse | sparse / dense |")
    print("|---|---:|---:|---:|")
    for key, name in (("train_loss_last20", "training loss, last 20%"), ("eval_loss_last20", "held-out loss, last 20%")):
        d, sp = s[key]["dense"], s[key]["sparse"]
        print(f"| {name} | {d:.5f} | {sp:.5f} | {sp / d:.4f} |")
    d, sp = s["eval_loss_last20"]["dense"], s["eval_loss_last20"]["sparse_dense_attn"]
    print(f"| held-out loss, last 20%, sparse arm evaluated with dense attention | {d:.5f} | {sp:.5f} | {sp / d:.4f} |")
    st = s["median_stage2_step_s"]
    print(f"| median stage-2 step time (s) | {st['dense']:.4f} | {st['sparse']:.4f} | {st['sparse'] / st['dense']:.3f} |")
    print(f"\nwithin 2%: training {s['train_within_2pct']}, held-out {s['eval_within_2pct']}")
    lead = s["steps_to_loss"]
    print(f"sparse lead (steps to the dense arm's last-window losses): median {lead['lead_median']}, range "
          f"{lead['lead_range']}; the dense loss still falls {lead['dense_drop_per_100_steps']:.3f} per 100 steps "
          "(bench/training/sparse_quality_curves.py compares runs)")
    print("\n| sparse layer | tokens | natural density (held-out) | natural density (profiled) | "
          f"recall @ {density} | recall @ natural | random @ natural |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in recall:
        print(f"| {r['layer']} | {r['tokens']} | {r['natural']:.3f} | {r['natural_profiled']:.3f} | "
              f"{r['rec_forced']:.3f} | {r['rec_natural']:.3f} | {r['rec_random_natural']:.3f} |")
    print(f"| mean | | {s['natural_density']:.3f} | {s['natural_density_profiled']:.3f} | {s['recall_forced']:.3f} | "
          f"{s['recall_natural']:.3f} | {s['recall_random_natural']:.3f} |")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="wan2.1-1.3b")
    p.add_argument("--layers", type=int, default=6, help="reduced depth (first and last layer stay dense)")
    p.add_argument("--resolution", default="480x832", help="HxW of every shape (multiples of 16)")
    p.add_argument("--batch", type=int, nargs=3, default=[8, 2, 1], help="fixed B of image / 17-frame / 33-frame")
    p.add_argument("--stage1", type=int, default=100, help="stage-1 steps (dense, predictor training)")
    p.add_argument("--stage2", type=int, default=500, help="stage-2 steps (sparse layers)")
    p.add_argument("--density", type=float, default=0.2, help="forced density of the sparse layers in stage 2")
    p.add_argument("--profile-interval", type=int, default=25)
    p.add_argument("--sample-rows", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--cube", type=int, nargs=3, default=[2, 8, 8])
    p.add_argument("--backend", default="auto")
    p.add_argument("--block-score", default="pooled_lse", choices=["pooled_lse", "lse", "mean"],
                   help="the sparse arm's block scores (the 600-step run at 1cd4fbb used the predictor's 'mean')")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--rebalance", default="off", choices=["off", "epoch", "step"],
                   help="sparse_attention.rebalance of the sparse arm (not off: its batches differ from the dense arm's)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run of both arms per seed (model init, "
                   "data, noise), one after the other; the summary has every seed and the mean / spread of the ratios")
    p.add_argument("--num-samples", type=int, default=20000)
    p.add_argument("--eval-every", type=int, default=30)
    p.add_argument("--eval-samples", type=int, default=6)
    p.add_argument("--recall-samples", type=int, default=3)
    p.add_argument("--recall-rows", type=int, default=256)
    p.add_argument("--profile", default="auto")
    p.add_argument("--m-mem", default="auto")
    p.add_argument("--grad-ckpt", default="none", choices=["none", "all"])
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--log-interval", type=int, default=25)
    p.add_argument("--deadline-s", type=float, default=1e9, help="stop both arms after this much training time")
    p.add_argument("--device", default="auto", choices=["auto", "cpu"])
    p.add_argument("--out", default="bench/out/sparse_quality.json")
    p.add_argument("--runs-dir", default=None, help="the arms' log dirs (default: next to --out); the density "
                   "PNG and sparse.jsonl are copied next to --out")
    args = p.parse_args(argv)
    if args.m_mem != "auto":
        args.m_mem = float(args.m_mem)
    return args


def run_seed(args, out: Path, out_dir: Path) -> dict:
    """Both arms for ``args.seed``: curves, recall, summary; writes ``out`` as it goes."""
    trainers, shapes, fixed, device = build_trainers(args, out_dir)
    hist = train(args, trainers)
    rt = trainers["sparse"].sparse.runtime
    doc = {"meta": {**meta(args, device), "shapes": shapes, "fixed_batch_sizes": fixed,
                    "sparse_layers": rt.schedule.sparse_layers(), "stage2_from_step": rt.schedule.switched_at},
           "history": hist}
    out.write_text(json.dumps(doc, indent=1, default=str))  # the curves are kept even if what follows fails
    captured = capture_qk(trainers["sparse"], args.recall_samples, args.seed)
    recall = recall_table(trainers["sparse"], captured, args.density, args.recall_rows, args.seed)
    del captured
    s = summarize(hist, recall, args.stage1)
    sp_summary: dict = {}
    trainers["sparse"].sparse.finish(sp_summary)  # sparse_density.png + the runtime's summary
    for t in trainers.values():
        t.metrics.close()
        t.memory_log.close()
    print_table(s, recall, args.density)
    doc.update(summary=s, recall=recall, sparse_runtime=sp_summary.get("sparse_attention"))
    out.write_text(json.dumps(doc, indent=1, default=str))
    png = out.with_suffix(".png")
    plot(hist, args.stage1, png)
    if args.runs_dir:
        import shutil
        for name in ("sparse_density.png", "sparse.jsonl"):
            if (out_dir / "run_sparse" / name).exists():
                shutil.copy(out_dir / "run_sparse" / name, out.parent / f"{out.stem}_{name}")
    print(f"wrote {out} and {png}")
    del trainers, rt
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return doc


def main(argv=None) -> int:
    args = parse(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    seeds, docs = list(args.seeds), {}
    for seed in seeds:
        args.seed = seed
        one = out if len(seeds) == 1 else out.with_name(f"{out.stem}_seed{seed}{out.suffix}")
        base = Path(args.runs_dir) if args.runs_dir else out.parent / (out.stem + "_runs")
        out_dir = base if len(seeds) == 1 else base / f"seed{seed}"
        out_dir.mkdir(parents=True, exist_ok=True)
        docs[seed] = run_seed(args, one, out_dir)
    if len(seeds) > 1:
        keys = ("train_ratio", "eval_ratio", "eval_ratio_dense_attn")
        agg = {}
        for k in keys:
            xs = [docs[sd]["summary"][k] for sd in seeds]
            m = sum(xs) / len(xs)
            agg[k] = {"per_seed": xs, "mean": m, "std": (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5}
        print("\nover seeds " + ", ".join(map(str, seeds)) + ": " + "; ".join(
            f"{k} {v['mean']:.4f} +- {v['std']:.4f}" for k, v in agg.items()))
        out.write_text(json.dumps({"seeds": seeds, "aggregate": agg,
                                   "per_seed_files": [str(out.with_name(f"{out.stem}_seed{sd}{out.suffix}"))
                                                      for sd in seeds]}, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
