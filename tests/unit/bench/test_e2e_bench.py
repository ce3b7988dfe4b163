"""Guards the end-to-end benchmark (bench/training/e2e.py) in one process: the compute-time instrumentation (fake
engines and CUDA events), the depth-rescaled cost profile it plans with
(ds_adaptive.planning.profile.Profile.with_num_layers), the GPU defaults' time budget and aggregation. The runs with
real ranks are in tests/integration/test_e2e_bench_launch.py."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ds_adaptive.planning.profile import load_profile
from ds_adaptive.training.metrics import StepMetrics
from ds_adaptive.training.timers import WAIT_POINTS, ComputeTimer
from ds_adaptive.core.config import MetricsConfig
from ds_adaptive.simulation import e2e

ROOT = Path(__file__).resolve().parents[3]


# ----------------------------------------------------------------------------------- ComputeTimer
class _Offload:
    def __init__(self, wait_s: float) -> None:
        self.wait_s, self.calls = wait_s, 0

    def pre_sub_module_forward_function(self, module):
        self.calls += 1
        time.sleep(self.wait_s)

    def pre_sub_module_backward_function(self, module):
        self.calls += 1
        time.sleep(self.wait_s)


class _FakeEngine:
    """The attributes ComputeTimer looks for, with waits we control."""

    def __init__(self, wait_s: float) -> None:
        self.optimizer = SimpleNamespace(parameter_offload=_Offload(wait_s))
        self.optimizer.reduce_ready_partitions_and_remove_grads = lambda param: time.sleep(wait_s)
        self.wait_s = wait_s

    def _backward_epilogue(self):   # calls a wait point inside itself: nested, counted once
        self.optimizer.reduce_ready_partitions_and_remove_grads(None)
        time.sleep(self.wait_s)


def test_compute_timer_subtracts_wait_windows_once():
    eng = _FakeEngine(0.02)
    timer = ComputeTimer(torch.device("cpu"))
    assert len(timer.attach(eng)) == len(WAIT_POINTS)
    assert timer.attach(eng) == timer.wrapped  # idempotent: no double wrapping
    off = eng.optimizer.parameter_offload
    off.pre_sub_module_forward_function(None)   # outside a region: passes through, untimed
    timer.begin()
    time.sleep(0.05)                             # "compute"
    off.pre_sub_module_forward_function(None)    # 20 ms wait
    off.pre_sub_module_backward_function(None)   # 20 ms wait
    eng._backward_epilogue()                     # 40 ms, with a nested 20 ms wait point inside
    timer.end()
    (wall, wait), = timer.collect()
    assert off.calls == 3
    assert wall >= 130 and 75 <= wait <= wall
    assert 45 <= wall - wait <= 75               # the 50 ms of compute, nested window not double-counted
    assert timer.collect() == []
    with pytest.raises(RuntimeError, match="without begin"):
        timer.end()


class _FakeCudaEvent:
    """torch.cuda.Event stand-in: record() takes the host clock, elapsed_time() in ms."""

    created = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        type(self).created += 1
        self.t = None

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: "_FakeCudaEvent") -> float:
        return (other.t - self.t) * 1e3


def test_compute_timer_cuda_path_pools_events_and_syncs_once_per_collect(monkeypatch):
    """The CUDA branch's bookkeeping (events per window, one device sync per collect, events reused
    across steps), with events that read the host clock."""
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    eng = _FakeEngine(0.01)
    timer = ComputeTimer(torch.device("cuda", 0))
    timer.attach(eng)
    for step in range(3):
        for _ in range(2):                        # two micro-steps per collect
            timer.begin()
            time.sleep(0.02)
            eng.optimizer.parameter_offload.pre_sub_module_forward_function(None)
            timer.end()
        timed = timer.collect()
        assert len(timed) == 2 and len(syncs) == step + 1
        for wall, wait in timed:
            assert 28 <= wall and 9 <= wait <= wall and 15 <= wall - wait <= 35
        if step == 0:
            first = _FakeCudaEvent.created
    assert _FakeCudaEvent.created == first      # later steps reuse the pooled events


@pytest.mark.parametrize("setting,device,attach,want", [
    ("auto", "cuda", True, False),    # CUDA events time the compute: the host may run ahead
    ("auto", "cuda", False, True),    # no wait points attached: host-clock timing needs the sync
    ("auto", "cpu", True, True),      # (no effect on CPU)
    (True, "cuda", True, True), (False, "cuda", False, False)])
def test_sync_timing_auto_syncs_only_for_host_clock_timing(setting, device, attach, want):
    m = StepMetrics(MetricsConfig(jsonl=False, tensorboard=False, sync_timing=setting), micro_steps_per_step=1,
                    device=torch.device(device, 0) if device == "cuda" else torch.device(device), is_writer=False)
    if attach:
        assert m.attach_engine(_FakeEngine(0.0))
        assert m.run_info["sync_timing"] is want
    assert m._use_sync is want


def test_step_metrics_report_compute_and_wall_per_micro_step():
    eng = _FakeEngine(0.03)
    m = StepMetrics(MetricsConfig(jsonl=False, tensorboard=False), micro_steps_per_step=2,
                    device=torch.device("cpu"), is_writer=False)
    assert m.attach_engine(eng) and m.timing == "compute"
    m.start_step()
    for busy in (0.02, 0.04):
        m.data_ready()
        time.sleep(busy)
        eng.optimizer.parameter_offload.pre_sub_module_forward_function(None)
        m.backward_done()
        time.sleep(0.02)                         # engine.step(): outside the region
        m.end_micro(1, 10, 100.0)
    rec = m.end_step(1, 1.0, 1.0, 1e-3)
    (c0,), (c1,) = rec.micro_compute_ms
    (w0,), (w1,) = rec.micro_wall_ms
    assert 15 <= c0 <= 35 and 35 <= c1 <= 60
    assert w0 - c0 >= 25 and w1 - c1 >= 25 and w1 < 100
    assert rec.compute_ms == [pytest.approx(c0 + c1)] and rec.wall_ms == [pytest.approx(w0 + w1)]
    s = m.summary()
    assert s["timing"] == "compute" and "cv_step_wall" in s


def test_gpu_defaults_fit_the_time_budget(tmp_path):
    """The lead runs all four arms on 4 GPUs (or 2) in one short call: the default plan must predict
    <= 300 s and give every arm >= warm-up + 8 optimizer steps, all samples planned or counted."""
    for gpus in (4, 2):
        out = tmp_path / f"g{gpus}"
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "training" / "e2e.py"), "--plan-only", "--device", "cuda",
                            "--num-gpus", str(gpus), "--out", str(out), "--sim-worlds", ""],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        plan = json.loads((out / "e2e_plan.json").read_text())
        assert plan["predicted_total_s"] <= 300
        assert plan["settings"]["layers"] < 30 and plan["settings"]["model"] == "wan2.1-1.3b"
        # every arm plans with the full-depth profile rescaled by cost.py
        # (tests/unit/planning/test_cost.py pins its numbers)
        scaled = load_profile(e2e.BASE_PROFILE).with_num_layers(plan["settings"]["layers"])
        assert json.loads(Path(plan["profile"]["path"]).read_text()) == dict(scaled.raw)
        assert plan["profile"]["c0_ms"] == scaled.c0_ms
        assert plan["profile"]["m1_gib_per_token"] == scaled.m1_gib_per_token
        n = plan["settings"]["num_samples"]
        for name, p in plan["plans"].items():
            assert p["steps"] >= 9, name
            assert p["samples"] + p["tail_dropped"] + p["oversize"] == n
        # identical budgets for every arm; the dual compute budget is the costliest sample at B=1
        assert len({json.dumps(p["budgets"]["m_mem_gib"]) for p in plan["plans"].values()}) == 1
        assert plan["plans"]["adaptive"]["budgets"]["m_comp_ms"] == pytest.approx(plan["budgets"]["m_comp_ms"])


# ----------------------------------------------------------------------------------- aggregation
def test_weighted_tail_mean_and_pearson():
    assert e2e.weighted_tail_mean([4, 3, 2, 1], [10, 10, 10, 10], 0.2) == pytest.approx(1.0)
    assert e2e.weighted_tail_mean([4, 3, 2, 1], [10, 10, 10, 10], 0.3) == pytest.approx((10 * 1 + 2 * 2) / 12)
    assert e2e.pearson([1, 2, 3, 4], [2, 4, 6, 8]) == pytest.approx(1.0)


def _fake_arm(name: str, compute: list, wall: list, samples: list, loss: list) -> tuple[dict, dict]:
    recs = []
    for k, (c, w, n, lo) in enumerate(zip(compute, wall, samples, loss)):
        recs.append({"step": k + 1, "loss": lo, "lr": 1e-4, "samples": n, "tokens": 100 * n,
                     "wall_s": sum(w) / 1e3 + 0.01,
                     "micro_compute_ms": [c], "micro_wall_ms": [w], "compute_ms": c, "wall_ms": w,
                     "peak_mem_gib": [1.0 + k, 2.0], "mem_capacity_gib": 10.0, "data_ms": 1.0})
    plan = {"samples": sum(samples), "tail_dropped": 1, "oversize": 0, "steps": len(recs), "gas": 1,
            "predicted_micro_ms": [[float(x) for x in c] for c in compute],
            "predicted_cv": [0.1] * len(recs), "quad_cv": [0.2] * len(recs),
            "predicted_step_ms": [max(c) for c in compute], "step_tokens": [100 * n for n in samples]}
    res = {"arm": name, "label": name, "ok": True, "process_wall_s": 30.0, "records": recs,
           "summary": {"timing": "compute", "eval_loss": 1.5, "eval": {"s": 1.0}, "plan": {"tail_dropped": 1}}}
    return res, plan


def test_aggregate_ratios_and_table():
    base_res, base_plan = _fake_arm("baseline", [[100, 300], [100, 300], [200, 200]], [[310, 310], [305, 305],
                                    [210, 210]], [4, 4, 4], [2.0, 1.8, 1.6])
    dual_res, dual_plan = _fake_arm("adaptive", [[200, 200], [150, 150], [150, 150]], [[205, 205], [155, 155],
                                    [155, 155]], [4, 4, 4], [2.0, 1.8, 1.7])
    b = e2e.aggregate_arm(base_res, base_plan, warmup_steps=1)
    d = e2e.aggregate_arm(dual_res, dual_plan, warmup_steps=1)
    assert b["measured_steps"] == 2 and b["samples_seen"] == 12 and b["samples_match_plan"]
    assert b["cv_step"] == pytest.approx((0.5 + 0.0) / 2)          # CV of (100, 300), then of (200, 200)
    assert b["cv_step_wall"] == pytest.approx(0.0)
    assert b["idle_frac"] == pytest.approx((300 - 200) / (300 + 200))
    assert b["compute_ms_per_rank"] == [150.0, 250.0] and b["peak_mem_gib_per_rank"] == [3.0, 2.0]
    assert b["loss_last20"] == pytest.approx(1.6) and b["tokens_per_s"] == pytest.approx(800 / (0.62 + 0.43))
    assert d["cv_step"] == 0.0 and d["cv_step_wall"] == 0.0 and d["idle_frac"] == 0.0
    r = e2e.ratios({"baseline": b, "adaptive": d})
    assert r["baseline"]["tokens_per_s"] == pytest.approx(1.0)
    assert r["adaptive"]["tokens_per_s"] == pytest.approx(b["step_s_mean"] / d["step_s_mean"])
    assert r["adaptive"]["loss_last20_rel_diff"] == pytest.approx((1.7 - 1.6) / 1.6)
    assert r["adaptive"]["eval_loss_rel_diff"] == pytest.approx(0.0)
    report = {"arms": {"baseline": b, "adaptive": d}, "ratios": r, "budgets": {"m_mem_gib": 1.0, "m_comp_ms": 100.0},
              "environment": {"device_name": "CPU"},
              "settings": {"model": "tiny", "layers": 2, "num_gpus": 2, "gas": 1, "num_samples": 13, "seed": 0,
                           "warmup_steps": 1}}
    report["plans"] = {"baseline": base_plan, "adaptive": dual_plan}
    text = e2e.table(report)
    assert "baseline" in text and "adaptive" in text and "12/1" in text


def test_aggregate_with_gradient_accumulation_excludes_whole_warmup_steps():
    res, plan = _fake_arm("adaptive", [[100, 100], [300, 100], [100, 100], [200, 200]], [[300] * 2] * 4,
                          [2, 2, 2, 2], [2.0, 1.9, 1.8, 1.7])
    recs = res["records"]                      # regroup as 2 optimizer steps of 2 micro-steps
    res["records"] = [{**recs[0], "micro_compute_ms": [recs[0]["micro_compute_ms"][0], recs[1]["micro_compute_ms"][0]],
                       "micro_wall_ms": [recs[0]["micro_wall_ms"][0], recs[1]["micro_wall_ms"][0]], "samples": 4},
                      {**recs[2], "micro_compute_ms": [recs[2]["micro_compute_ms"][0], recs[3]["micro_compute_ms"][0]],
                       "micro_wall_ms": [recs[2]["micro_wall_ms"][0], recs[3]["micro_wall_ms"][0]], "samples": 4}]
    plan.update(gas=2, steps=2, samples=8, predicted_step_ms=[400.0, 300.0], step_tokens=[400, 400])
    a = e2e.aggregate_arm(res, plan, warmup_steps=1)
    assert a["measured_steps"] == 1 and len(a["cv_step_micro"]) == 2   # the second step's two micro-steps
    assert a["cv_step"] == 0.0 and a["samples_seen"] == 8 and a["steps_match_plan"]
    assert a["predicted"]["micro_max_ms"] == [100.0, 200.0]           # the plan's micro-steps 2 and 3


