"""Does Ulysses SP=2 train the same model as SP=1? Loss of both over N steps.

Runs the real trainer twice at the same time on one node: SP=2 on 2 GPUs and SP=1 on a third
GPU, both with DP=1, the same seed, data and a `fixed` sampler (explicit batch size per shape),
so both see the same batches in the same order and differ only in how a sample's sequence is
split across GPUs. Prints a per-step table of the relative loss difference and writes JSON + PNG.

    python bench/training/sp_loss.py --steps 50 --layers 4 --out bench/out/sp_loss     # needs 3 GPUs

bf16 noise: with bf16 activations, the two runs reduce the same sums in a different order, so
their losses drift apart slightly; we report the mean and max |rel diff| per step and of the
last-10-step means. CPU (`--device cpu --model tiny`) runs 2 + 1 gloo processes for testing.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE_CONFIG = ROOT / "launch" / "configs" / "zero3_adaptive.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_config(out: Path, shapes: Path, batch: dict[str, int], lr: float) -> Path:
    cfg = json.loads(BASE_CONFIG.read_text())
    cfg["scheduler"]["params"].update(warmup_max_lr=lr, warmup_num_steps=5)
    cfg["optimizer"]["params"]["lr"] = lr
    cfg["adaptive_load"]["sampler"] = {"mode": "fixed", "fixed_batch_sizes": batch, "m_mem": 60.0,
                                      "cost_model": "tokens", "shapes": str(shapes)}
    path = out / "sp_loss_config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def launch(nproc: int, devices: str, argv: list[str], log: Path, cpu: bool) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0"}
    env["CUDA_VISIBLE_DEVICES"] = "" if cpu else devices
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(_free_port()), str(ROOT / "launch" / "train_wan.py"), *argv]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan2.1-1.3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--out", default="bench/out/sp_loss")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if cpu:  # small mix for the tiny model
        shapes = ROOT / "launch" / "configs" / "shapes_cpu.json"
    else:  # real Wan shapes: an odd token count per rank (45x... grids) is exercised by 81x720x1280
        shapes = ROOT / "ds_adaptive" / "data" / "default_shapes.json"
    spec = json.loads(shapes.read_text())
    spec = spec["shapes"] if isinstance(spec, dict) else spec
    from ds_adaptive.core.shapes import SampleShape

    batch = {}
    for s in spec:
        shp = SampleShape(s["frames"], s["height"], s["width"])
        batch[str(shp)] = max(1, 16_000 // shp.tokens) if not cpu else max(1, 1024 // shp.tokens)
    cfg = make_config(out, shapes, batch, args.lr)
    common = ["--deepspeed_config", str(cfg), "--model", args.model, "--steps", str(args.steps), "--seed", "3",
              "--num-samples", "2000", "--grad-ckpt"]
    if args.layers and not cpu:
        common += ["--layers", str(args.layers)]
    runs = {"sp1": (1, "2"), "sp2": (2, "0,1")}
    procs = {name: launch(n, dev, [*common, "--sp", name[-1], "--log-dir", str(out / name)], out / f"{name}.log", cpu)
             for name, (n, dev) in runs.items()}
    failed = []
    for name, p in procs.items():
        try:
            rc = p.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "timeout"
        if rc != 0:
            failed.append(f"{name}: rc={rc}, log {out / (name + '.log')}")
    if failed:
        for name in procs:
            print(f"--- {name} log tail ---\n" + "\n".join((out / f"{name}.log").read_text().splitlines()[-25:]))
        print("sp_loss: a run failed:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    s1 = json.loads((out / "sp1" / "summary.json").read_text())
    s2 = json.loads((out / "sp2" / "summary.json").read_text())
    l1, l2 = s1["losses"], s2["losses"]
    n = min(len(l1), len(l2))
    rel = [abs(a - b) / abs(a) for a, b in zip(l1[:n], l2[:n])]
    tail = min(10, n)
    m1, m2 = sum(l1[n - tail:n]) / tail, sum(l2[n - tail:n]) / tail
    res = {"model": args.model, "layers": args.layers, "steps": n, "device": args.device,
           "samples_sp1": s1["samples"], "samples_sp2": s2["samples"],
           "loss_sp1": l1[:n], "loss_sp2": l2[:n], "rel_diff_mean": sum(rel) / n, "rel_diff_max": max(rel),
           "last10_mean_sp1": m1, "last10_mean_sp2": m2, "last10_rel_diff": abs(m1 - m2) / abs(m1),
           "loss_first5_sp1": sum(l1[:5]) / 5, "step_s_sp1": s1["step_s_mean"], "step_s_sp2": s2["step_s_mean"],
           "peak_mem_gib_sp1": s1["peak_mem_gib"], "peak_mem_gib_sp2": s2["peak_mem_gib"]}
    (out / "sp_loss.json").write_text(json.dumps(res, indent=1))
    print(f"{'step':>5} {'loss sp1':>10} {'loss sp2':>10} {'rel diff':>9}")
    for i in range(0, n, max(1, n // 10)):
        print(f"{i + 1:>5} {l1[i]:>10.4f} {l2[i]:>10.4f} {rel[i]:>9.2e}")
    print(f"samples sp1 {s1['samples']} / sp2 {s2['samples']} (must be equal); |rel diff| mean {res['rel_diff_mean']:.2e} "
          f"max {res['rel_diff_max']:.2e}; last-10 mean {m1:.4f} vs {m2:.4f} ({res['last10_rel_diff']:.2e}); "
          f"loss {res['loss_first5_sp1']:.4f} (first 5) -> {m1:.4f}")
    print(f"step time sp1 {s1['step_s_mean']:.3f} s, sp2 {s2['step_s_mean']:.3f} s; peak GiB sp1 {s1['peak_mem_gib']:.2f}, "
          f"sp2 {s2['peak_mem_gib']:.2f}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(range(1, n + 1), l1[:n], label="SP=1 (1 GPU)")
        ax.plot(range(1, n + 1), l2[:n], "--", label="SP=2 (2 GPUs)")
        ax.set_xlabel("optimizer step"), ax.set_ylabel("flow-matching loss"), ax.legend()
        ax.set_title(f"Ulysses SP=2 vs SP=1, {args.model} ({args.layers} blocks), same batches")
        fig.tight_layout(), fig.savefig(out / "sp_loss.png", dpi=120)
    except ImportError:
        pass
    return 0 if s1["samples"] == s2["samples"] else 1


if __name__ == "__main__":
    sys.exit(main())
