"""Guards bench/mfu_levers.py (the trainer-level A/B of the MFU levers) on the CPU: prepare writes three arms'
configs that differ only in their lever and pin the same plan; report compares arms that ran the same
micro-batches and refuses arms that did not."""
from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import ROOT
from ds_adaptive.training.run_config import RunConfig

_spec = importlib.util.spec_from_file_location("mfu_levers", ROOT / "bench" / "mfu_levers.py")
ml = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ml)


def _arm(d, wall, shapes=("1x480x832",)):
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"tokens_per_s": 1.0, "mfu": 0.4, "peak_mem_gib": 100.0}))
    (d / "metrics.jsonl").write_text("\n".join(json.dumps({"step": k, "tokens": 1000, "wall_s": wall,
                                                           "micro_compute_ms": [[400.0], [400.0]]})
                                               for k in (1, 2, 3)))
    (d / "memory.jsonl").write_text("\n".join(json.dumps({"step": k, "micro": m, "shape": shapes[0], "B": 4,
                                                          "ckpt_blocks": 3}) for k in (1, 2, 3) for m in (0, 1)))


def test_prepare_and_report(tmp_path, capsys):
    ml.prepare(tmp_path, "2", 21, 2000)
    cfgs = {n: RunConfig.load(str(tmp_path / f"{n}.json"), trainer={"model": "wan2.1-1.3b"})
            for n in ("config", "config_fusion", "config_zero")}
    assert cfgs["config"].adaptive_load.block_fusion == "off" and cfgs["config_fusion"].adaptive_load.block_fusion == "regions"
    assert cfgs["config_zero"].ds_config["zero_optimization"]["reduce_bucket_size"] == 200_000_000
    assert cfgs["config"].adaptive_load.sampler == cfgs["config_zero"].adaptive_load.sampler   # one pinned plan
    assert "--log-dir " + str(tmp_path / "runs" / "fusion") in capsys.readouterr().out
    runs = tmp_path / "runs"
    _arm(runs / "ref", 2.0)
    _arm(runs / "fusion", 1.6)
    res = ml.report(runs, ["ref", "fusion"], tmp_path / "r.json")
    assert res["steps"] == [2, 3] and res["rows"][1]["ratio_tokens_per_s"] == pytest.approx(1.25)
    _arm(runs / "other", 1.0, shapes=("81x480x832",))
    with pytest.raises(SystemExit, match="did not run the same plan"):
        ml.report(runs, ["ref", "other"], None)
