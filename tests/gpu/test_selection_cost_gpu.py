"""The selection calibration on the GPU: the runtime's own select call is timed over a grid, the fit covers
every point, and ``calibrate --sparse --selection`` writes a profile that the planner's sparse cost reads
(no timing thresholds: correctness of the pipeline only)."""
from __future__ import annotations

import json

from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import load_profile
from ds_adaptive.planning.selection_cost import SelectionCost
from ds_adaptive.planning.sparse_cost import SparseAttentionCost
from ds_adaptive.core.contracts import DensityMap


def test_measure_fit_and_profile_round_trip(tmp_path):
    from ds_adaptive.cli.calibrate_sparse import main

    out = tmp_path / "prof.json"
    assert main(["--selection", "--profile", "h200-wan2.1-1.3b", "--out", str(out), "--iters", "3",
                 "--selection-grid", "4:1560,1:8190,2:8190,1:16380,2:16380"]) == 0
    sec = json.loads(out.read_text())["sparse_attention"]["selection"]
    assert len(sec["fit"]["points"]) == 5 and all(p["select_ms"] > 0 for p in sec["fit"]["points"])
    assert sec["fit"]["split"] and sec["block_score"] == "pooled_lse" and sec["block_size"] == 128
    sel = SelectionCost.from_dict(sec)
    # The loaded cost is the fit that was written: it reproduces every point's prediction and error. (How the
    # timings grow with B and S is the GPU's: at these sizes a call is launch-bound and may fit a constant.)
    for p in sec["fit"]["points"]:
        assert abs(sel.call_ms(p["B"], p["S"], p["heads"]) - p["predicted_ms"]) <= 1e-9 * max(1.0, p["predicted_ms"])
        assert abs((p["predicted_ms"] - p["select_ms"]) / p["select_ms"] - p["rel_err"]) <= 1e-9
    assert sec["fit"]["max_rel_err"] == max(abs(p["rel_err"]) for p in sec["fit"]["points"])
    assert sel.call_ms(2, 16380, 12) >= sel.call_ms(1, 8190, 12) > 0
    dm = DensityMap(tuple((0.1,) * 12 for _ in range(30)), dense_layers=(0, 29))
    cm = CostModel(load_profile(str(out)), sparse=SparseAttentionCost(dm))
    assert cm.sparse.selection_cost == sel
