"""Guards the EMA (ds_adaptive.training.ema) in one process: partitioned like ZeRO-3's parameters (slices cover every
element once), its schedule, saved, restored and re-cut to another world size, its errors, its placement, and
counted by the memory model. The 2-rank fp64 reference checks are in tests/integration/test_ema_launch.py."""
from __future__ import annotations

import pytest
import torch

from ds_adaptive.core.features import EmaConfig
from ds_adaptive.training.ema import EmaError, EmaState, consolidate, select_parameters, slice_bounds

pytest.importorskip("deepspeed")


def test_slices_cover_every_element_once():
    for numel in (1, 5, 6, 7, 1000):
        for parts in (1, 2, 3, 8):
            spans = [slice_bounds(numel, k, parts) for k in range(parts)]
            assert sum(n for _, n in spans) == numel
            flat = [i for s, n in spans for i in range(s, s + n)]
            assert flat == list(range(numel))


def _single(cfg, model):
    return EmaState(cfg, select_parameters(model, cfg.parameters), device=torch.device("cpu"), log=lambda m: None)


def test_schedule_single_process_and_recut(tmp_path):
    """One process: nothing before ``start_step``, a copy at it, an update every ``every`` steps after; a file cut
    into 2 slices (as 2 ranks wrote it) loads re-cut into 1."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    cfg = EmaConfig(decay=0.5, every=2, start_step=2)
    ema = _single(cfg, model)
    assert [ema.due(s) for s in range(1, 7)] == ["", "start", "", "update", "", "update"]
    with torch.no_grad():
        model.weight.fill_(1.0)
    assert ema.after_step(2) == "start" and torch.equal(ema.tensors[0], torch.ones(3, 5).view(-1))
    with torch.no_grad():
        model.weight.fill_(3.0)
    ema.after_step(3)
    ema.after_step(4)
    assert torch.allclose(ema.tensors[0], torch.full((15,), 2.0))
    # two rank files of the same average, as a 2-rank run writes them
    state = ema.state_dict()
    for part in (0, 1):
        s = {**state, "rank": part, "part": part, "parts": 2, "tensors": {}, "slices": {}}
        for name, t in state["tensors"].items():
            numel = t.numel()
            start, n = slice_bounds(numel, part, 2)
            s["tensors"][name] = t[start:start + n].clone()
            s["slices"][name] = [start, n, numel, list(state["slices"][name][3])]
        torch.save(s, tmp_path / f"ema_rank{part:05d}.pt")
    full = consolidate(tmp_path)
    assert torch.equal(full["weight"], ema.tensors[0].view(3, 5))
    fresh = _single(cfg, model)
    line = fresh.load(tmp_path)
    assert "re-cut from 2 slices into 1" in line and fresh.updates == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.tensors, ema.tensors))


def test_errors_name_the_problem(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(EmaError, match="no LoRA adapters"):
        select_parameters(model, "lora")
    with pytest.raises(EmaError, match="trained without adaptive_load.ema"):
        consolidate(tmp_path)
    ema = _single(EmaConfig(), model)
    ema.save(tmp_path)
    other = _single(EmaConfig(), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(EmaError, match="averages other parameters"):
        other.load(tmp_path)
    assert "holds no EMA" in _single(EmaConfig(), model).load(tmp_path / "none")


def test_memory_model_counts_the_partitioned_average():
    """The profile's static memory grows by 4 bytes x averaged parameters / ranks (nothing with the EMA on the
    host), and ``m_mem: auto`` shrinks by it."""
    from ds_adaptive.planning.cost import CostModel
    from ds_adaptive.planning.profile import load_profile

    p = load_profile("h100-wan2.1-1.3b")
    n = 1_300_000_000
    for stage, ranks in ((3, 8), (2, 4), (0, 1)):
        with_ema = p.with_ema(n)
        parts = with_ema.static_memory_parts(stage, ranks)
        assert parts["ema"] == pytest.approx(4 * n / ranks / 2**30)
        assert with_ema.static_memory_gib(stage, ranks) == pytest.approx(p.static_memory_gib(stage, ranks) + parts["ema"])
    assert p.with_ema(None).static_memory_parts(3, 8).get("ema", 0.0) == 0.0
    a = CostModel(p, "calibrated").auto_memory_budget(80.0, 0.9, zero_stage=3, dp_size=8)
    b = CostModel(p.with_ema(n), "calibrated").auto_memory_budget(80.0, 0.9, zero_stage=3, dp_size=8)
    assert a - b == pytest.approx(4 * n / 8 / 2**30)


def test_the_config_block_is_strict():
    from ds_adaptive.core.config import AdaptiveLoadConfig
    from ds_adaptive.planning.validate import run_problems

    assert AdaptiveLoadConfig().ema is None   # off by default
    for bad in ({"decay": 1.0}, {"every": 0}, {"parameters": "some"}, {"device": "gpu"}, {"decya": 0.9}):
        with pytest.raises(ValueError):
            AdaptiveLoadConfig.model_validate({"ema": bad})
    block = AdaptiveLoadConfig.model_validate({"ema": {"parameters": "lora"}})
    assert any(p.key == "ema" and "adaptive_load.lora is not enabled" in p.message for p in run_problems({}, block))


@pytest.mark.parametrize("model, device, where", [("wan2.1-1.3b", "auto", "accelerator"),
                                                  ("wan2.1-14b", "auto", "cpu"),
                                                  ("wan2.1-14b", "accelerator", "accelerator")])
def test_auto_placement_keeps_the_ema_where_the_plan_has_room(model, device, where):
    """The dry-run build of 8 GPUs: Wan 1.3B's EMA (0.66 GiB per GPU) stays on the accelerator and the budget
    shrinks by it; Wan 14B's (6.65 GiB) would cost the plan a shape that fits without it, so ``auto`` keeps it in
    host memory (a note says why) and plans without it; ``accelerator`` keeps it there regardless."""
    import json as _json
    import warnings

    from conftest import CONFIGS
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig

    raw = _json.loads((CONFIGS / "zero3_adaptive.json").read_text())
    raw["adaptive_load"]["sampler"]["oversize"] = "skip"
    raw["adaptive_load"]["ema"] = {"device": device}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = build_run(RunConfig.load(raw, trainer={"model": model}), layout=Layout.for_world(8), meta=True,
                        gpu_mem_gib=80.0)
    parts = run.profile.static_memory_parts(run.zero_stage, 8)
    n = sum(p.numel() for p in run.model.parameters())
    if where == "accelerator":
        assert run.ema_device.type == "meta" and parts["ema"] == pytest.approx(4 * n / 8 / 2**30)
    else:
        assert run.ema_device.type == "cpu" and "ema" not in parts
        assert any(note.startswith("EMA on the CPU") and "fits without the EMA" in note for note in run.notes)
