"""Guards hybrid sparsity-aware context parallelism on paper: the mesh solver (pure), its cost terms and crossover,
the simulation's report and the CLI, and the planner's cost of meshes beyond the heads. The multi-rank checks
(attention and the model == the one-process reference) are in tests/integration/test_context_parallel_launch.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from ds_adaptive.planning.context_parallel import (CPLinks, choose_mesh, crossover_density, fetch_share, mesh_cost,
                                                   mesh_shapes)

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[3]


def _kw(**over):
    kw = dict(seq_len=75_776, densities=[0.1] * 40, head_dim=128, block=128, attention_ms_per_token2=8e-6,
              efficiency=lambda r: min(1.0, 1.45 * r), links=CPLinks())
    kw.update(over)
    return kw


# ------------------------------------------------------------------------------ the solver (pure)
def test_mesh_shapes_divide_the_group_and_the_heads() -> None:
    assert mesh_shapes(8, 40) == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert mesh_shapes(16, 40) == [(8, 2), (4, 4), (2, 8), (1, 16)]   # no Ulysses: 16 does not divide 40
    assert mesh_shapes(4, 2) == [(2, 2), (1, 4)]
    for sp in (2, 4, 8, 16, 64):
        for heads in (2, 12, 40):
            c = choose_mesh(sp=sp, **_kw(densities=[0.05] * heads))
            assert c.heads * c.seq == sp and heads % c.heads == 0, (sp, heads, c.shape)


def test_solver_picks_ulysses_at_density_one_and_sequence_wise_at_low_density_on_slow_links() -> None:
    for sp in (2, 4, 8):
        assert choose_mesh(sp=sp, **_kw(densities=[1.0] * 40)).shape == (sp, 1)
        assert choose_mesh(sp=sp, sparse=False, **_kw()).shape == (sp, 1)   # a dense layer keeps Ulysses
    slow = CPLinks(intra_node_gbps=5.0, inter_node_gbps=5.0, query_block_overlap=0.98)
    assert choose_mesh(sp=8, **_kw(densities=[0.01] * 40, links=slow)).shape == (1, 8)
    # ... and not at a high density on the same links (the fetch would move more than the all-to-alls)
    assert choose_mesh(sp=8, **_kw(densities=[0.6] * 40, links=slow)).seq < 8
    # fixed modes
    assert choose_mesh(sp=8, mode="sequence", **_kw()).shape == (1, 8)
    assert choose_mesh(sp=16, mode="sequence", sparse=False, **_kw()).shape == (8, 2)
    assert choose_mesh(sp=8, mode="heads", **_kw()).shape == (8, 1)
    with pytest.raises(ValueError, match="needs sp \\(16\\) to divide the 40 heads"):
        choose_mesh(sp=16, mode="heads", **_kw())
    with pytest.raises(ValueError, match="must be one of"):
        choose_mesh(sp=8, mode="ring", **_kw())


def test_cost_terms_and_crossover() -> None:
    links = CPLinks()
    assert fetch_share(0.1, 1, 0.9) == pytest.approx(0.1)
    assert fetch_share(0.1, 10, 1.0) == pytest.approx(0.1) and fetch_share(0.1, 10, 0.0) == pytest.approx(1 - 0.9 ** 10)
    assert fetch_share(1.0, 50, 0.5) == 1.0
    ul, seq = mesh_cost(8, 1, **_kw()), mesh_cost(1, 8, **_kw())
    assert ul.fetch_share == 0.0 and 0 < seq.fetch_share <= 1 and seq.extra_kv_bytes > 0 == ul.extra_kv_bytes
    # the attention term is the busiest head-wise rank's: one dense head slows Ulysses, not the sequence-wise mesh
    skew = [0.9] + [0.05] * 39
    assert mesh_cost(8, 1, **_kw(densities=skew)).attention_ms > mesh_cost(1, 8, **_kw(densities=skew)).attention_ms
    x = crossover_density(sp=8, seq_len=75_776, dim=5120, block=128, links=links)
    n = 75_776 // 8 // 128
    assert 0 < x < 1 and fetch_share(x, n, links.query_block_overlap) == pytest.approx(2 / 8, rel=1e-6)
    assert crossover_density(sp=2, seq_len=4096, dim=512, block=128, links=links) == 1.0   # s=2: always fewer bytes


# ------------------------------------------------------------------------------ on paper: simulate, config --check
def test_simulation_reports_meshes_and_gains_against_ulysses() -> None:
    from ds_adaptive.simulation.context_parallel import context_parallel_report, context_parallel_table

    dense = context_parallel_report(profile="h200-wan2.1-14b", gpus=8, seq_len=75_600, densities=1.0)
    assert dense["meshes"] == [(8, 1)] and dense["predicted_gain"] == pytest.approx(1.0, rel=1e-12)
    assert dense["padded_tokens"] == 75_600   # Ulysses everywhere: no block alignment
    sparse = context_parallel_report(profile="h200-wan2.1-14b", gpus=8, seq_len=75_600, densities=0.02)
    assert (1, 8) in sparse["meshes"] and sparse["predicted_gain"] > 1.0   # the solver picks it only where it pays
    assert sparse["padded_tokens"] % (8 * 128) == 0
    wide = context_parallel_report(profile="h200-wan2.1-14b", gpus=16, seq_len=302_400, densities=0.1)
    assert wide["ulysses_degree"] == 8 and all(h * s == 16 and 40 % h == 0 for h, s in wide["meshes"])
    assert len(wide["layers"]) == 40 and wide["predicted_only"] and "ulysses_attention_ms" not in wide["layers"][0]
    text = context_parallel_table([dense, sparse, wide], per_layer=True)
    assert "h200-wan2.1-14b" in text and "layer  39" in text and "Predicted, not measured" in text


def test_cli_simulate_and_config_check_show_the_meshes(tmp_path, capsys) -> None:
    import json

    from ds_adaptive.cli import config as config_cli
    from ds_adaptive.cli import simulate as simulate_cli

    assert simulate_cli.main(["--world", "16", "--sparse", "0.1", "--context-parallel", "auto", "--profile",
                              "h200-wan2.1-14b", "--cp-tokens", "75600", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["context_parallel"][0]
    assert rep["gpus"] == 16 and rep["tokens"] == 75_600 and rep["meshes"]
    cfg = json.loads((ROOT / "launch" / "configs" / "cpu_tiny.json").read_text())
    cfg["adaptive_load"]["sparse_attention"] = {"enabled": True, "context_parallel": "sequence", "forced_density": 0.1,
                                                "dense_layers": [0]}
    path = tmp_path / "cp.json"
    path.write_text(json.dumps(cfg))
    assert config_cli.main(["--check", str(path), "--model", "tiny", "--sp", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "note: context_parallel sequence, sp 4, 75,600 tokens: layers 0 2x2, layers 1 1x4" in out, out[-500:]
    cfg["adaptive_load"]["sparse_attention"]["context_parallel"] = "heads"
    path.write_text(json.dumps(cfg))
    assert config_cli.main(["--check", str(path), "--model", "tiny", "--sp", "4", "--device", "cpu"]) == 2
    assert "set adaptive_load.sparse_attention.context_parallel to 'sequence' or 'auto'" in capsys.readouterr().out


def test_the_planner_costs_hybrid_meshes_beyond_the_heads() -> None:
    from dataclasses import replace

    from ds_adaptive.core.contracts import DensityMap
    from ds_adaptive.core.layout import SequenceParallelError
    from ds_adaptive.planning.context_parallel import ContextParallelCost
    from ds_adaptive.planning.cost import CostModel
    from ds_adaptive.planning.sparse_cost import SparseAttentionCost

    dm = DensityMap(tuple((0.1,) * 40 for _ in range(40)), dense_layers=(0, 39))
    base = SparseAttentionCost(densities=dm, head_placement="identity")
    with pytest.raises(SequenceParallelError, match="Ulysses sp=16 does not divide the 40 attention heads"):
        CostModel("h200-wan2.1-14b", sp=16, sparse=base)
    hybrid = replace(base, context_parallel=ContextParallelCost("auto", CPLinks(), 128))
    cost = CostModel("h200-wan2.1-14b", sp=16, sparse=hybrid)
    s = cost.padded_tokens(75_600)
    meshes = cost.sparse.layer_meshes(s, 16)
    assert all(m.heads * m.seq == 16 for m in meshes)
    assert cost.comm_cost(75_600) == pytest.approx(sum(m.comm_ms for m in meshes))
    dense_mem = CostModel("h200-wan2.1-14b", sp=16, context_parallel="auto").per_gpu_memory(75_600)
    assert cost.per_gpu_memory(75_600) == pytest.approx(dense_mem + max(m.extra_kv_bytes for m in meshes) / 2 ** 30)
    assert "layers 0-39 8x2" in cost.sparse.mesh_summary(s, 16)
