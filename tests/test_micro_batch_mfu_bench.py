"""Guards bench/micro_batch_mfu.py on a recorded trainer run: per micro-batch kind, model FLOPs over compute time."""
from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("micro_batch_mfu", ROOT / "bench" / "micro_batch_mfu.py")
mm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mm)
RUN = ROOT / "bench" / "results" / "default_job_h200_2f0fcdc"


def test_rows_are_model_flops_over_the_compute_windows(tmp_path):
    from ds_adaptive.models import get_model

    assert mm.main([str(RUN), "--out", str(tmp_path / "m.json")]) == 0
    (t,) = json.loads((tmp_path / "m.json").read_text())
    steps = [json.loads(x) for x in (RUN / "metrics.jsonl").read_text().splitlines()]
    n_micro = sum(len(s["micro_compute_ms"]) for s in steps if s["step"] > 1)
    assert sum(r["micro_steps"] for r in t["rows"]) == n_micro
    row = next(r for r in t["rows"] if r["shape"] == "49x720x1280")
    model = get_model("wan2.1-1.3b")
    flops = model.flops(model.config(), 46800, 1, 0)
    flops = flops[0] if isinstance(flops, tuple) else flops
    assert row["mfu"] == pytest.approx(flops / (row["compute_ms"] * 1e-3) / 989e12)
    # the summary's MFU holds the time outside the compute windows as well
    assert t["summary_mfu"] < max(r["mfu"] for r in t["rows"])
