"""Guards the end-to-end benchmark (bench/training/e2e.py) with real ranks: ZeRO-3 waits taken out of per-rank compute
time (single process: compute ~ forward+backward wall time; two ranks: the heavier rank reports more compute while
wall-clock times agree), and a real 2-arm run on 2 CPU processes. The single-process checks are in
tests/unit/bench/test_e2e_bench.py."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

from ds_adaptive.simulation import e2e

TIMER_RUN = textwrap.dedent("""
    import json, sys, time
    import torch, deepspeed
    from ds_adaptive.core.config import MetricsConfig
    from ds_adaptive.training.metrics import StepMetrics
    from ds_adaptive.models.wan import WanModel, get_wan_config
    from ds_adaptive.cli.train import flow_matching_losses, init_distributed

    rank, world, device = init_distributed(0)
    torch.set_num_threads(1)
    batch = [int(x) for x in sys.argv[1].split(",")][rank]
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": False},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "reduce_bucket_size": 100000, "stage3_prefetch_bucket_size": 100000},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = WanModel(get_wan_config("tiny", num_layers=3))
    model.gradient_checkpointing = True
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    m = StepMetrics(MetricsConfig(jsonl=False, tensorboard=False), micro_steps_per_step=1, device=device,
                    is_writer=False)
    assert m.attach_engine(engine), "no DeepSpeed wait point found"
    g = torch.Generator().manual_seed(rank)
    out = []
    for step in range(5):
        lat = torch.randn(batch, 16, 3, 48, 48, generator=g)   # 1728 tokens
        ctx = torch.randn(batch, 32, 4096, generator=g)
        idx = torch.arange(batch) + 100 * step
        m.start_step()
        m.data_ready()
        t0 = time.perf_counter()
        loss = flow_matching_losses(engine, lat, ctx, idx, epoch=0, seed=0, shift=5.0, dtype=torch.float32).mean()
        engine.backward(loss)
        fb_ms = (time.perf_counter() - t0) * 1e3
        m.backward_done()
        engine.step()
        m.end_micro(batch, batch * 1728, float(batch * 1728 ** 2))
        rec = m.end_step(step + 1, float(loss) * batch, batch, 1e-4)
        out.append({"fb_ms": fb_ms, "compute": rec.micro_compute_ms[0], "wall": rec.micro_wall_ms[0],
                    "cv": rec.cv_step, "cv_wall": rec.cv_step_wall})
    print("RESULT " + json.dumps({"rank": rank, "steps": out}), flush=True)
""")


def _timer_results(results) -> list[dict]:
    return [json.loads(line[7:]) for r in results for line in r.stdout.splitlines() if line.startswith("RESULT ")]


@pytest.mark.slow
def test_single_process_compute_time_is_forward_backward_wall_time(tmp_path, run_ranks):
    """One rank has nobody to wait for: the instrumented compute time must be (almost all of) the
    forward + backward wall time measured around it."""
    (tmp_path / "timer_run.py").write_text(TIMER_RUN)
    out, = _timer_results(run_ranks(["timer_run.py", "4"], 1, cwd=tmp_path, timeout=300))
    steps = out["steps"][1:]                       # the first step pays for allocations
    fb = sum(s["fb_ms"] for s in steps)
    compute = sum(s["compute"][0] for s in steps)
    wall = sum(s["wall"][0] for s in steps)
    assert fb <= wall <= 1.1 * fb + 20            # the region is forward + backward
    assert 0.7 * fb <= compute <= wall            # only DeepSpeed's own bookkeeping is taken out


@pytest.mark.slow
def test_a_rank_given_more_work_reports_more_compute_time(tmp_path, run_ranks):
    """Rank 1 gets 8x rank 0's batch. Under ZeRO-3 rank 0 waits for rank 1 inside forward/backward, so
    their wall-clock times agree; their compute times must not."""
    (tmp_path / "timer_run.py").write_text(TIMER_RUN)
    outs = sorted(_timer_results(run_ranks(["timer_run.py", "1,8"], 2, cwd=tmp_path, timeout=300)),
                  key=lambda o: o["rank"])
    steps = outs[0]["steps"][1:]                   # every rank holds the gathered figures of both
    compute = [sum(s["compute"][r] for s in steps) for r in (0, 1)]
    wall = [sum(s["wall"][r] for s in steps) for r in (0, 1)]
    assert compute[1] > 2.0 * compute[0], (compute, wall)
    assert abs(wall[1] - wall[0]) < 0.3 * max(wall), (compute, wall)
    cv = sum(s["cv"] for s in steps) / len(steps)
    cv_wall = sum(s["cv_wall"] for s in steps) / len(steps)
    assert cv > 0.3 and cv > 3 * cv_wall, (cv, cv_wall)


# ----------------------------------------------------------------------------------- a real run
@pytest.mark.slow
def test_two_arm_cpu_run_end_to_end(tmp_path):
    """bench/training/e2e.py on 2 CPU processes with the tiny model: two arms of the real trainer, parsed and
    aggregated; every sample of the epoch seen or counted; the report re-renders from its JSON."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "training" / "e2e.py"), "--device", "cpu", "--num-gpus", "2",
           "--arms", "baseline,adaptive", "--num-samples", "48", "--eval-samples", "2", "--sim-worlds", "8",
           "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rep = json.loads((out / "e2e.json").read_text())
    assert rep["format"] == e2e.FORMAT and set(rep["arms"]) == {"baseline", "adaptive"}
    for name, a in rep["arms"].items():
        assert a["ok"], a
        plan = rep["plans"][name]
        assert a["steps"] == plan["steps"] >= 2 and a["samples_match_plan"] and a["steps_match_plan"]
        assert a["samples_seen"] + a["tail_dropped"] + a["oversize"] == 48
        assert a["trainer_plan"]["samples"] == plan["samples"]          # the trainer planned what we predicted
        assert a["timing"] == "compute" and a["eval_loss"] > 0
        assert all(c <= w + 1.0 for c, w in zip(a["compute_ms_per_rank"], a["wall_ms_per_rank"]))
        assert a["loss_curve"]["samples_seen"][-1] == a["samples_seen"] and len(a["peak_mem_gib_per_rank"]) == 2
        assert 0 <= a["cv_step"] < 2 and 0 <= a["cv_step_wall"] < 2
    assert rep["arms"]["baseline"]["trainer_plan"]["mode"] == "tokens"
    assert rep["arms"]["adaptive"]["trainer_plan"]["mode"] == "dual"
    assert rep["ratios"]["baseline"]["tokens_per_s"] == pytest.approx(1.0)
    assert "same_run" in rep["simulator"] and "8" in rep["simulator"]["scale"]
    text = (out / "e2e.txt").read_text()
    assert "baseline" in text and "Simulator vs measurement" in text
    assert (out / "e2e.png").stat().st_size > 10_000
    assert "===== baseline" in (out / "e2e_logs.txt").read_text()
    again = subprocess.run([sys.executable, str(ROOT / "bench" / "training" / "e2e.py"), "--report-only", "--out", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and (out / "e2e.txt").read_text() == text
