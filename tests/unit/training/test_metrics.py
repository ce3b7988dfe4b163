"""Guards the step metrics: CV figures, per-step records, JSONL/TensorBoard output and the run summary."""
from __future__ import annotations

import json
import time

import pytest
import torch

from ds_adaptive.core.config import MetricsConfig
from ds_adaptive.training.metrics import StepMetrics
from ds_adaptive.training.balance import cv
from ds_adaptive.training.summary import format_summary


def test_cv():
    assert cv([2.0, 2.0, 2.0]) == 0.0
    assert cv([1.0, 3.0]) == pytest.approx(0.5)
    assert cv([5.0]) == 0.0 and cv([0.0, 0.0]) == 0.0


def _step(m: StepMetrics, step: int, micro: list[tuple[float, int, int]], loss: float):
    m.start_step()
    for sleep_s, samples, tokens in micro:
        m.data_ready()
        time.sleep(sleep_s)
        m.end_micro(samples, tokens, float(samples * (tokens / samples) ** 2))
    return m.end_step(step, loss * sum(s for _, s, _ in micro), float(sum(s for _, s, _ in micro)), 1e-3,
                      log=step == 5)


def test_records_summary_and_logs(tmp_path):
    cfg = MetricsConfig(interval=2, log_dir=str(tmp_path / "logs"))
    m = StepMetrics(cfg, micro_steps_per_step=2, device=torch.device("cpu"), run_info={"model": "tiny"})
    losses = [2.0, 1.8, 1.7, 1.5, 1.2, 1.1]
    for k, loss in enumerate(losses, start=1):
        rec = _step(m, k, [(0.02, 3, 300), (0.01, 1, 500)], loss)
        assert rec.samples == 4 and rec.tokens == 800 and rec.loss == pytest.approx(loss)
        assert rec.samples_per_rank == [4] and rec.tokens_per_rank == [800]
        assert rec.compute_ms[0] >= 25  # both micro-steps timed
        assert rec.cv_step == 0.0 and rec.compute_cv == 0.0  # one rank: nothing to compare
        assert rec.tokens_per_s == pytest.approx(800 / rec.wall_s)
        assert rec.peak_mem_gib[0] > 0 and rec.mem_capacity_gib > 0
    s = m.summary()
    assert s["model"] == "tiny" and s["steps"] == 6 and s["samples"] == 24 and s["tokens"] == 4800
    assert s["warmup_steps"] == 1 and s["loss_window"] == 3
    assert s["loss_first"] == pytest.approx(sum(losses[:3]) / 3) and s["loss_last"] == pytest.approx(sum(losses[3:]) / 3)
    assert s["loss_fell"] is True and s["tokens_per_s"] > 0 and s["samples_per_s"] > 0
    assert 0 < s["peak_mem_frac"] < 1
    path = m.write_summary(s)
    assert json.loads(path.read_text())["steps"] == 6
    m.close()
    logged = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]   # metrics.jsonl: every step (jsonl_interval 1)
    assert {"loss", "cv_step", "compute_cv", "tokens_per_s", "peak_mem_gib"} <= set(logged[0])
    assert any((tmp_path / "logs" / "tensorboard").iterdir())
    text = format_summary(s)
    assert "tokens/s" in text and "CV_step" in text and "falling" in text


def test_jsonl_interval_null_logs_at_the_tensorboard_interval(tmp_path):
    cfg = MetricsConfig(interval=2, jsonl_interval=None, tensorboard=False, log_dir=str(tmp_path / "logs"))
    m = StepMetrics(cfg, micro_steps_per_step=2, device=torch.device("cpu"))
    for k in range(1, 7):
        _step(m, k, [(0.0, 1, 10), (0.0, 1, 10)], 1.0)
    m.close()
    logged = [json.loads(line)["step"] for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 4, 5, 6]   # the first, every 2nd and the one asked for (log=True at step 5)


def test_summary_reports_a_rising_loss():
    m = StepMetrics(MetricsConfig(jsonl=False, tensorboard=False), micro_steps_per_step=1,
                    device=torch.device("cpu"), is_writer=False)
    for k, loss in enumerate([1.0, 1.1, 1.3, 1.6], start=1):
        _step(m, k, [(0.0, 1, 10)], loss)
    s = m.summary()
    assert s["loss_fell"] is False and "NOT falling" in format_summary(s)


def test_misuse_is_an_error():
    m = StepMetrics(MetricsConfig(jsonl=False, tensorboard=False), micro_steps_per_step=2,
                    device=torch.device("cpu"), is_writer=False)
    m.start_step()
    with pytest.raises(RuntimeError, match="without data_ready"):
        m.end_micro(1, 1, 1.0)
    m.data_ready()
    m.end_micro(1, 1, 1.0)
    with pytest.raises(RuntimeError, match="recorded 1 micro-steps, expected 2"):
        m.end_step(1, 1.0, 1.0, 0.0)
