"""The CPU self-check of bench/kernels/ln_modulate_per_token.py, a GPU benchmark (``python -m pytest bench``): its
floors (bytes that must move per row kind), its rows end to end with a fake timer (ours runs the torch reference on
the CPU), and the target line; the GPU figures are not tested."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_ln_modulate_per_token",
                                                  HERE / "ln_modulate_per_token.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_floor_bytes_per_element(bench):
    """bf16 x, fp32 modulation: the op 30 bytes per element + 16 per row (statistics); the table's gradient
    adds 6 x 4 written minus the 2 x 4 of dshift / dscale it replaces; chunk()'s backward reads 2 x 4, writes 6 x 4."""
    B, S, D = 1, 32760, 1536
    n, rows = B * S * D, B * S
    fb = bench.floor_bytes(B, S, D)
    assert fb == {"leaves": 30 * n + 16 * rows, "table": 46 * n + 16 * rows, "split": 32 * n}
    assert fb["leaves"] == 1510104960   # bench/kernels/ln_modulate.py's per-token fwd+bwd floor
    ms = bench.floors(B, S, D, 3.0e12)
    assert ms["leaves"] == pytest.approx(fb["leaves"] / 3.0e9)


def test_rows_and_target_on_the_cpu(bench, monkeypatch):
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    timed = []

    def fake_bench(fn, rep_ms=300, flush="read"):
        out = fn()
        timed.append(out)
        return 0.5

    monkeypatch.setattr(bench.lb, "bench_ms", fake_bench)
    monkeypatch.setattr(bench.lb, "graphed", lambda fns: (lambda: [f() for f in fns][-1]))
    B, S, D = 2, 5, 64
    rows = bench.measure(B, S, D, bw=2e7)   # leaves floor ~0.97 ms: 0.5 ms is "met"
    assert [(r["fn"], r["how"]) for r in rows] == [("ours", "leaves"), ("ours", "table"), ("torch", "split"),
                                                  ("reference", "leaves"), ("reference", "table")]
    fl = bench.floors(B, S, D, 2e7)
    for r in rows:
        assert r["floor_ms"] == fl[r["how"]] and r["gpu_over_floor"] == pytest.approx(0.5 / fl[r["how"]])
    # what each row differentiates: leaves -> x, shift, scale; table -> x and the [B, S, 6, D] table (its
    # chunks 0 / 1 hold dshift / dscale, the other four zeros); split -> the table
    leaves, table, split = timed[0], timed[2], timed[4]
    assert [tuple(g.shape) for g in leaves] == [(B, S, D)] * 3
    assert [tuple(g.shape) for g in table] == [(B, S, D), (B, S, 6, D)]
    assert torch.equal(table[1][:, :, 2:], torch.zeros(B, S, 4, D))
    torch.testing.assert_close(table[1][:, :, 1], leaves[2], rtol=0, atol=0)   # same inputs (seeded by S + D)
    assert [tuple(g.shape) for g in split] == [(B, S, 6, D)]
    lines = bench.verdict(rows)
    assert lines[0].endswith("(met)") and len(lines) == 3


def test_verdict_reports_a_miss(bench):
    rows = [{"fn": f, "how": h, "gpu_ms": 1.0, "call_ms": 1.0, "gpu_over_floor": 1.2, "call_over_floor": 1.2}
            for f, h in (("ours", "table"), ("torch", "split"))]
    rows.append({"fn": "ours", "how": "leaves", "gpu_ms": 1.0, "call_ms": 1.6, "gpu_over_floor": 1.0,
                 "call_over_floor": 1.6})
    assert bench.verdict(rows)[0].endswith("(MISSED)")
