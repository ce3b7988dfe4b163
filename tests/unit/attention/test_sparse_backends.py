"""Guards the sparse-attention backends: the registry and the choice of `backend: auto | <name>` (loud
fallback), the contract on awkward shapes vs an fp64 reference, flex's dynamic shapes (a fixed number of
compiled graphs across many (B, S), never the unfused path), the shared "sparse only where it pays"
decision of planner and runtime, and the start-up checks."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.sparse_cost import SparseAttentionCost
from ds_adaptive.core.contracts import DensityMap, KernelEfficiency
from ds_adaptive.core.config import ConfigError, SparseAttentionConfig
from ds_adaptive.attention.backends import (BackendSupport, SparseAttentionBackend, SparseBackendError, backend_names,
                                         get_backend, register_backend, select_backend)
from ds_adaptive.attention.backends import registry
from ds_adaptive.attention.backends.check import check_sparse_config, sparse_config_notes
from ds_adaptive.attention.backends.measure import cache_key, random_selection, store

ROOT = Path(__file__).resolve().parents[3]
H200 = "h200-wan2.1-1.3b"


# ------------------------------------------------------------------------------ registry and choice
def test_registry_names_lookup_and_errors() -> None:
    assert backend_names()[:1] == ["flex"] and "reference" in backend_names()
    assert get_backend("flex") is get_backend("flex")
    with pytest.raises(SparseBackendError, match="no such backend; registered: flex"):
        get_backend("nope")
    with pytest.raises(TypeError):
        register_backend(int)

    class Other(SparseAttentionBackend):
        name = "flex"
        support = get_backend("flex").support

        def attention(self, q, k, v, selection, *, valid_len=None, density=None):
            raise AssertionError

        def efficiency(self, device, **kw):
            raise AssertionError

    with pytest.raises(ValueError, match="already registered"):
        register_backend(Other)
    # the schema holds no behaviour: the one validation pass (config --check, the dry run, the trainer) names it
    problems = check_sparse_config(SparseAttentionConfig(enabled=True, backend="nope"), 2, "cpu")
    assert len(problems) == 1 and "unknown sparse-attention backend 'nope'; use 'auto' or one of" in problems[0]


def test_auto_falls_back_loudly_and_a_named_backend_that_cannot_run_is_an_error() -> None:
    c = select_backend("auto", "cpu")
    assert c.backend.name == "reference" and c.fallback and "WARNING" in c.line and "S^2" in c.line
    assert "no backward on cpu" in c.line and c.curve(0.1) == 1.0  # the reference never looks cheaper than dense
    with pytest.raises(SparseBackendError, match="backend is 'flex' but backend 'flex' has no backward on cpu"):
        select_backend("flex", "cpu")
    fwd = select_backend("auto", "cpu", backward=False, dtype=torch.float32, head_dim=16)  # CPU flex: forward only
    assert fwd.backend.name == "flex" and not fwd.fallback
    on_gpu = select_backend("auto", "meta")  # a dry run of a GPU launch
    assert on_gpu.backend.name == "flex" and not on_gpu.fallback and on_gpu.curve(0.1) < 0.2


class _Fake(SparseAttentionBackend):
    support = BackendSupport(device_types=("cpu",), backward_device_types=("cpu",), dtypes=(torch.float32,),
                             block_sizes=(32,))

    def attention(self, q, k, v, selection, *, valid_len=None, density=None):
        return get_backend("reference").attention(q, k, v, selection, valid_len=valid_len)

    def efficiency(self, device, **kw):
        return KernelEfficiency((0.1,), (0.5,), source="shipped")


def test_auto_picks_the_fastest_measured_backend(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DS_ADAPTIVE_CACHE_DIR", str(tmp_path))
    slow = register_backend(type("SlowFake", (_Fake,), {"name": "zz_slow"}))
    fast = register_backend(type("FastFake", (_Fake,), {"name": "zz_fast"}))
    try:
        kw = dict(dtype=torch.float32, head_dim=16, block_size=32)
        # nothing measured: the shipped curves tie, the registry order breaks it, and the line says so
        c = select_backend("auto", "cpu", **kw)
        assert c.backend.name == "zz_fast" and "not measured here" in c.line
        store(cache_key("zz_slow", "cpu", **kw), {"density": [0.1], "ratio": [0.3]})
        store(cache_key("zz_fast", "cpu", **kw), {"density": [0.1], "ratio": [0.2]})
        c = select_backend("auto", "cpu", **kw)
        assert c.backend.name == "zz_fast" and c.curve(0.1) == pytest.approx(0.2) and "not measured" not in c.line
        assert c.candidates["zz_slow"]["g_ref"] == pytest.approx(0.3) and c.candidates["zz_slow"]["measured"]
        # another torch version or GPU is another key
        assert cache_key("zz_fast", "cpu", **kw) != cache_key("zz_fast", "cpu", dtype=torch.float32, head_dim=16,
                                                               block_size=64)
    finally:
        for cls in (slow, fast):
            registry._classes.pop(cls.name, None)
            registry._instances.pop(cls.name, None)


# ------------------------------------------------------------------------------ the contract on awkward shapes
def _fp64_block_reference(q, k, v, sel, valid_len=None):
    """Per (b, h, query token): softmax over the tokens of its selected key blocks, fp64, loops."""
    from ds_adaptive.attention.attention import truncate_selection

    b, s, h, d = q.shape
    n = s if valid_len is None else valid_len
    dense = (sel if valid_len is None else truncate_selection(sel, valid_len)).dense_block_mask()
    out = torch.zeros(b, s, h, d, dtype=torch.float64)
    bs = sel.block_size
    for bi in range(b):
        for hi in range(h):
            keep = dense[bi, hi].repeat_interleave(bs, 0).repeat_interleave(bs, 1)[:n, :n]
            sc = q[bi, :n, hi].double() @ k[bi, :n, hi].double().T / math.sqrt(d)
            p = torch.softmax(sc.masked_fill(~keep, float("-inf")), -1)
            out[bi, :n, hi] = p @ v[bi, :n, hi].double()
    return out


@pytest.mark.parametrize("name", ["reference", "flex"])
@pytest.mark.parametrize("b,s,h,valid", [(1, 197, 2, None), (2, 300, 3, 290), (3, 513, 1, None)])
def test_backends_match_an_fp64_reference_on_awkward_shapes(name, b, s, h, valid) -> None:
    """Every backend that runs on this CPU (backward where it has one); tests/gpu does CUDA."""
    be = get_backend(name)
    block = be.support.block_sizes[0] if 128 not in be.support.block_sizes else 128
    kw = dict(dtype=torch.float32, head_dim=16, block_size=block)
    if be.unsupported("cpu", backward=False, **kw) is not None:
        pytest.skip(f"{name} does not run on this CPU: {be.unsupported('cpu', backward=False, **kw)}")
    grad = be.unsupported("cpu", **kw) is None
    g = torch.Generator().manual_seed(s + b)
    q, k, v = (torch.randn(b, s, h, 16, generator=g) for _ in range(3))
    sel = random_selection(b, h, s, block, 0.4, device="cpu", seed=s)
    ref = _fp64_block_reference(q, k, v, sel, valid)
    if grad:
        for t in (q, k, v):
            t.requires_grad_()
        out = be.attention(q, k, v, sel, valid_len=valid, density=0.4)
        dout = torch.randn(out.shape, generator=g)
        out.backward(dout)
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        _fp64_block_reference(qd, kd, vd, sel, valid).backward(dout.double())
        for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
            assert (got.double() - want).abs().max() < 1e-4
    else:
        with torch.no_grad():
            out = be.attention(q, k, v, sel, valid_len=valid, density=0.4)
    assert out.shape == q.shape and (out.double() - ref).abs().max() < 1e-5
    if valid is not None:
        assert out[:, valid:].abs().max() == 0


def test_flex_compiles_a_fixed_number_of_graphs_across_shapes_and_never_falls_back(monkeypatch) -> None:
    """CPU forward (flex has no CPU backward): B and S change every call, incl. ragged S and Ulysses
    padding; dynamo specialises only B == 1 vs B >= 2, so at most 2 graphs appear, and flex's unfused
    (S x S) path is never taken."""
    import torch.nn.attention.flex_attention as fa
    from ds_adaptive.attention.backends.flex import compiled_graphs

    unfused = []
    orig = fa._warn_once
    monkeypatch.setattr(fa, "_warn_once", lambda *a, **kw: (unfused.append(kw.get("warning_id", a[:1])),
                                                            orig(*a, **kw)))
    fb = get_backend("flex")
    start = compiled_graphs()
    seen = []
    for b, s, valid in [(1, 1000, None), (2, 1024, None), (1, 2000, 1900), (3, 1536, None), (1, 3000, None),
                        (2, 2560, 2500), (5, 1100, None), (1, 896, None), (4, 777, None), (2, 1280, 1279),
                        (3, 1100, 1024)]:
        g = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(b, s, 2, 16, generator=g) for _ in range(3))
        sel = random_selection(b, 2, s, 128, 0.3, device="cpu", seed=s)
        with torch.no_grad():
            out = fb.attention(q, k, v, sel, valid_len=valid)
        ref = get_backend("reference").attention(q, k, v, sel, valid_len=valid)
        assert (out - ref).abs().max() < 1e-5
        seen.append(compiled_graphs() - start)
    assert seen[-1] <= 2 and seen[1] == seen[-1], seen  # nothing new after B == 1 and B >= 2 were seen
    assert "flex_attention_performance" not in unfused and not any("without torch.compile" in str(u) for u in unfused)
    assert get_backend("flex").stats()["graphs"] == compiled_graphs()


def test_flex_raises_past_its_graph_budget() -> None:
    from ds_adaptive.attention.attention import SparseKernelError
    from ds_adaptive.attention.backends.flex import compiled_graphs, flex_block_sparse_attention

    q = k = v = torch.randn(1, 256, 2, 16)
    sel = random_selection(1, 2, 256, 128, 0.5, device="cpu")
    with torch.no_grad():
        flex_block_sparse_attention(q, k, v, sel, max_graphs=compiled_graphs() + 1)  # B == 1: known or one more
        with pytest.raises(SparseKernelError, match="max_compiled_graphs"):
            flex_block_sparse_attention(q, k, v, sel, max_graphs=compiled_graphs() - 1)


# ------------------------------------------------------------------------------ sparse only where it pays
def _decision(density: float, layers: int = 30, heads: int = 12, **kw) -> SparseAttentionCost:
    dm = DensityMap(tuple((density,) * heads for _ in range(layers)), dense_layers=(0, layers - 1))
    return CostModel(H200, sparse=SparseAttentionCost(dm, **kw)).sparse


def test_images_run_dense_and_long_videos_sparse_by_one_decision() -> None:
    d = _decision(0.1)
    assert d.attention_ms_per_token2_per_layer > 0  # filled from the profile by CostModel
    img, _ = d.layer_decisions(1560, 1)
    vid, ratio = d.layer_decisions(32760, 1)
    assert not img.any()                                    # selection would cost more than it saves
    assert vid.sum() == 28 and not vid[0] and not vid[29] and (ratio[vid] < 0.2).all() and (ratio[~vid] == 1).all()
    # the planner's cost uses it: no selection and no scaling where every layer is dense
    dense = CostModel(H200)
    sparse = CostModel(H200, sparse=d)
    assert sparse.per_gpu_cost(1560) == dense.per_gpu_cost(1560)
    assert sparse.per_gpu_cost(32760) < 0.6 * dense.per_gpu_cost(32760)
    # whole blocks: 0.1 of 13 blocks is 2 blocks (0.154), as the runtime's top-k selects
    assert d.busiest_densities(1560, 1)[1] == pytest.approx(2 / 13)
    # without the pay check (a reference backend) every eligible layer runs sparse
    assert d.__class__(**{**d.__dict__, "pay_check": False}).layer_decisions(1560, 1)[0].sum() == 28


def test_runtime_decides_as_the_planner() -> None:
    from ds_adaptive.attention.runtime import SparseAttentionRuntime

    cfg = SparseAttentionConfig(enabled=True, forced_density=0.1)
    template = _decision(1.0)
    rt = SparseAttentionRuntime(cfg, num_layers=30, num_heads=12, head_dim=128, decision=template)
    planner = template.with_densities(DensityMap(tuple((0.1,) * 12 for _ in range(30)), dense_layers=(0, 29)))
    for s in (1560, 7800, 14040, 32760, 75600):
        want = planner.layer_decisions(s, 1)[0]
        got = [rt.schedule.is_sparse(i) and rt.runs_sparse(i, s) for i in range(30)]
        assert got == list(want), s
    assert rt.calls["dense_by_cost"] > 0 and rt.calls["sparse"] > 0


# ------------------------------------------------------------------------------ start-up checks
def test_check_sparse_config_catches_what_the_trainer_rejects() -> None:
    on = dict(enabled=True)
    assert check_sparse_config(SparseAttentionConfig(), 30, "cpu") == []  # disabled: nothing to check
    p = check_sparse_config(SparseAttentionConfig(**on, dense_layers=[0, 31]), 30, "cuda")
    assert len(p) == 1 and "dense_layers has [31], outside the model's layers 0..29" in p[0]
    p = check_sparse_config(SparseAttentionConfig(**on, backend="flex"), 30, "cpu", head_dim=128)
    assert len(p) == 1 and "backend is 'flex' but backend 'flex' has no backward on cpu" in p[0] and "reference" in p[0]
    assert check_sparse_config(SparseAttentionConfig(**on, backend="flex"), 30, "meta", head_dim=128) == []
    p = check_sparse_config(SparseAttentionConfig(**on, predictor_rank=64), 30, "cuda", head_dim=32)
    assert "predictor_rank = 64 is larger than the head dim 32" in p[0]
    p = check_sparse_config(SparseAttentionConfig(**on), 30, "cpu", head_dim=128, max_tokens=75600)
    assert "takes at most 16,384 tokens; the data has samples of 75,600" in p[0]
    assert sparse_config_notes(SparseAttentionConfig(**on), 2)[0].startswith("note: adaptive_load.sparse_attention is "
                                                                             "enabled but every layer")
    assert sparse_config_notes(SparseAttentionConfig(**on), 30) == []


def test_build_run_attaches_sparse_attention_and_the_dry_run_sees_it() -> None:
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig

    path = ROOT / "launch" / "configs" / "zero3_adaptive.json"
    cfg = RunConfig.load(str(path), trainer={"model": "wan2.1-1.3b", "num_samples": 200})
    cfg.adaptive_load.sampler.profile = H200
    cfg.adaptive_load.sparse_attention = SparseAttentionConfig(enabled=True, forced_density=0.1)
    run = build_run(cfg, layout=Layout.for_world(1, 1), meta=True, gpu_mem_gib=140)
    assert run.sparse is not None and run.sparse.backend_choice.backend.name == "flex"
    assert any(n.startswith("sparse attention: backend 'flex'") for n in run.notes)
    # the runtime decides with the sampler's sparse cost (the same object): what runs is what is planned
    assert run.sparse._decision_template is run.sampler.cost.sparse
    cfg.adaptive_load.sparse_attention = SparseAttentionConfig(enabled=True, dense_layers=[30])
    with pytest.raises(ConfigError, match=r"dense_layers has \[30\]"):
        build_run(cfg, layout=Layout.for_world(1, 1), meta=True, gpu_mem_gib=140)


def test_start_up_says_where_sparse_attention_will_not_run() -> None:
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig

    path = ROOT / "launch" / "configs" / "zero3_adaptive.json"
    cfg = RunConfig.load(str(path), trainer={"model": "wan2.1-1.3b", "num_samples": 200, "layers": 2})
    cfg.adaptive_load.sampler.profile = H200
    cfg.adaptive_load.sparse_attention = SparseAttentionConfig(enabled=True)  # default dense layers: 0 and 1
    run = build_run(cfg, layout=Layout.for_world(1, 1), meta=True, gpu_mem_gib=140)
    notes = [n for n in run.notes if "sparse" in n]
    assert any("every layer of the 2-layer model is in dense_layers ([0, 1])" in n for n in notes), notes
    assert sum("sparse attention: backend" in n for n in notes) == 1  # one line for the backend
