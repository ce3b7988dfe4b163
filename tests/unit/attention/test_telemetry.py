"""sparse_density.png shows what the run had: the profiled densities, or, where nothing was profiled (a forced
density, a run that ended in stage 1), the densities the layers ran at, titled so, never a blank map."""
from __future__ import annotations

import math

import pytest
import torch

from ds_adaptive.attention.runtime import SparseAttentionRuntime
from ds_adaptive.attention.telemetry import SparseTrainerHook, density_to_draw

CFG = {"warmup_steps": 0, "dense_layers": [0], "layer_density_threshold": 1.0, "dense_above": 1.0,
       "backend": "reference"}


def _runtime(**over) -> SparseAttentionRuntime:
    return SparseAttentionRuntime({**CFG, **over}, num_layers=3, num_heads=2, head_dim=16)


def test_a_forced_density_run_draws_the_densities_it_ran_at() -> None:
    rt = _runtime(forced_density=0.1)
    assert bool(torch.isnan(rt._all_head_density()).all())  # nothing profiled
    dens, title = density_to_draw(rt)
    assert dens.tolist() == [[1.0, 1.0], pytest.approx([0.1, 0.1]), pytest.approx([0.1, 0.1])]
    assert "not profiled: forced_density 0.1" in title


def test_an_unprofiled_run_without_a_forced_density_says_so() -> None:
    dens, title = density_to_draw(_runtime())
    assert not any(math.isnan(x) for row in dens.tolist() for x in row)
    assert "not profiled: no step profiled" in title


def test_profiled_densities_are_drawn_as_profiled() -> None:
    rt = _runtime(forced_density=0.1)
    rt.head_density = torch.tensor([[float("nan")] * 2, [0.2, 0.3], [0.4, 0.5]])
    dens, title = density_to_draw(rt)
    assert title == "profiled attention density"
    torch.testing.assert_close(dens[1:], torch.tensor([[0.2, 0.3], [0.4, 0.5]]))
    assert bool(torch.isnan(dens[0]).all())


def test_finish_writes_the_png_on_the_writer_only(tmp_path) -> None:
    summary: dict = {}
    SparseTrainerHook(_runtime(forced_density=0.1), tmp_path / "w", is_writer=True).finish(summary)
    assert (tmp_path / "w" / "sparse_density.png").stat().st_size > 1000 and "sparse_attention" in summary
    SparseTrainerHook(_runtime(forced_density=0.1), tmp_path / "r", is_writer=False).finish({})
    assert not (tmp_path / "r").exists()
