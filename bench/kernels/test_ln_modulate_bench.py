"""The CPU self-check of bench/kernels/ln_modulate.py, a GPU benchmark (``python -m pytest bench``): the
torch.compile baseline computes what ours computes (same expression and dtypes, gradients w.r.t. x and the modulation, the table sliced inside
the compiled function for per-sample modulation), the floor byte counts, and the kernel-policy
recommendation from --variants timings."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_ln_modulate", HERE / "ln_modulate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _inputs(B, S, D, per_token, seed=0):
    """The bench's input layout (make_inputs) on the CPU."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, S, D, generator=g) * 1.5 + 0.3).to(torch.bfloat16).requires_grad_()
    if per_token:
        table = torch.randn(B, S, 6, D, generator=g) * 0.5
        shift, scale = table[:, :, 0].requires_grad_(), table[:, :, 1].requires_grad_()
    else:
        table = torch.randn(B, 6, D, generator=g) * 0.5
        shift, scale = table[:, 0:1].requires_grad_(), table[:, 1:2].requires_grad_()
    st = {"x": x, "table": table, "shift": shift, "scale": scale,
          "dy": torch.randn(B, S, D, generator=g).to(torch.bfloat16)}
    if not per_token:
        st["table_c"] = table.detach().clone().requires_grad_()
    st["shift_c"] = shift.detach().clone().requires_grad_()
    st["scale_c"] = scale.detach().clone().requires_grad_()
    return st


@pytest.mark.parametrize("B", [1, 3])
def test_compile_baseline_per_sample_slices_the_table_inside(bench, B):
    torch._dynamo.reset()
    fns = bench._compiled_fns("aot_eager")
    st = _inputs(B, 16, 64, per_token=False)
    assert bench.check_compile(st, fns["table"], "table") == ""
    assert bench.check_compile(st, fns["copies"], "copies") == ""
    call, inputs = bench._compile_inputs(st, "table")
    assert inputs[1] is st["table_c"] and inputs[1].shape == (B, 6, 64)  # gradient w.r.t. the whole table
    y = call(fns["table"])
    assert y.dtype == torch.bfloat16 and y.shape == (B, 16, 64)


@pytest.mark.parametrize("B", [1, 2])
def test_compile_baseline_per_token_takes_the_same_views(bench, B):
    torch._dynamo.reset()
    fns = bench._compiled_fns("aot_eager")
    st = _inputs(B, 8, 32, per_token=True)
    assert bench.check_compile(st, fns["views"], "views") == ""
    _, inputs = bench._compile_inputs(st, "views")
    assert inputs[1] is st["shift"] and inputs[1].stride() == (8 * 6 * 32, 6 * 32, 1)


def test_compile_check_rejects_a_different_function(bench):
    st = _inputs(1, 8, 32, per_token=False)

    def wrong(x, table):  # scale and shift swapped
        return bench.ln_modulate_reference(x, table[:, 1:2], table[:, 0:1])

    assert "max |compile - eager|" in bench.check_compile(st, wrong, "table")

    def bad_shape(x, table):  # a graph whose table gradient would not be [B, 6, D]
        raise RuntimeError("invalid gradient at index 0 - got [32] but expected shape compatible with [1, 1, 32]")

    assert "RuntimeError" in bench.check_compile(st, bad_shape, "table")


def test_floor_bytes_match_the_published_floors(bench):
    # the published floors (docs/LN_MODULATE.md): 1.3B 1x32760x1536 fwd 201551808 bytes, fwd+bwd 503748480
    fb = bench.floor_bytes(1, 32760, 1536, False)
    assert fb == {"fwd": 201551808, "fwd+bwd": 503748480}
    tok = bench.floor_bytes(1, 32760, 1536, True)  # per-token: dshift, dscale [B, S, D] fp32 written
    assert tok == {"fwd": 604094400, "fwd+bwd": 1510104960}


def test_policy_recommendation(bench):
    res = [
        {"per_token": False, "ours[v1] fwd": 0.08, "ours[v1] fwd+bwd": 0.21, "ours[v2] fwd": 0.09,
         "ours[v2] fwd+bwd": 0.19},
        {"per_token": False, "ours[v1] fwd": 0.56, "ours[v1] fwd+bwd": 1.44, "ours[v2] fwd": 0.55,
         "ours[v2] fwd+bwd": 1.35},
        {"per_token": True, "ours[v1] fwd": 0.21, "ours[v1] fwd+bwd": 0.62, "ours[v2] fwd": 0.20,
         "ours[v2] fwd+bwd": 0.50},
    ]
    rec = bench.recommend_policy(res)
    # fwd per-sample: v1 0.64 vs v2 0.64 + 0.0 -> 0.08 + 0.56 = 0.64 vs 0.09 + 0.55 = 0.64: a tie keeps v1
    assert rec["fwd_sample"]["winner"] == "v1"
    assert rec["bwd_sample"]["winner"] == "v2"  # (0.13 + 0.88) vs (0.10 + 0.80)
    assert rec["fwd_token"]["winner"] == "v2" and rec["bwd_token"]["winner"] == "v2"
    assert bench.recommend_policy([{"per_token": False, "ours fwd": 1.0}]) is None


def test_tuning_summary(bench):
    rows = [{"slot": 7, "gen": "v2", "D": 5120, "layout": "per-sample", "kind": "fwd+bwd", "variant": v,
             "config": c, "ms": ms, "max_rel_diff_vs_default": 1e-4}
            for v, c, ms in ((0, "320x2 s3/2", 1.3), (1, "640x1 s3/2", 1.4), (2, "128x5 s3/2", 1.25))]
    (line,) = bench.summarize_tuning(rows)
    assert "best   128x5 s3/2 1.2500 ms (variant 2)" in line and "default 320x2 s3/2 1.3000" in line
    assert set(bench.TUNE) == set(range(8)) and all(len(v[3]) == 6 for v in bench.TUNE.values())


@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
def test_time_case_and_check_case_plumbing_on_cpu(bench, monkeypatch, per_token):
    """time_case / check_case end to end on the CPU with a fake timer and no CUDA graphs (ours runs
    the torch reference there): every method is timed, the compile baseline passes its check with
    the variant the GPU run uses first, and the accuracy keys exist."""
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "COMPILE_BACKEND", "aot_eager")
    calls = []

    def fake_bench(fn, rep_ms=300, flush="read"):
        fn()
        calls.append((rep_ms, flush))
        return 0.5 if flush == "read" else 0.75

    def fake_graphed(fns):
        def replay():
            for f in fns:
                f()
        return replay

    monkeypatch.setattr(bench, "bench_ms", fake_bench)
    monkeypatch.setattr(bench, "graphed", fake_graphed)
    monkeypatch.setattr(bench, "FLUSHES", ["read", "zero"])  # --flush both
    torch._dynamo.reset()
    r = bench.time_case("cpu case", 2, 8, 64, per_token, l2_bytes=1 << 16, quick=True, variants=False)
    assert r["compile variant"] == ("views" if per_token else "table"), r
    for m in ("ours", "eager", "compile"):
        for kind in ("fwd", "fwd+bwd"):
            assert r[f"{m} {kind}"] == 0.5, (m, kind, r.get(f"{m} {kind} error"))
            assert r[f"{m} {kind} @zero"] == 0.75, (m, kind)
    assert r["ours launch fwd"] == 0.5 and not any(k.endswith("error") for k in r)
    acc = bench.check_case(2, 8, 64, per_token, variants=False)
    assert acc["ours y err"] == acc["eager y err"]  # on the CPU ours is the reference
    assert {"ours dshift rel", "ours dscale rel", "eager dx err"} <= set(acc)


class _FakeExt:
    """The extension's policy / tuning hooks (ours itself runs the torch reference on the CPU)."""

    def __init__(self):
        self.policy = [2, 2, 2, 2, 2]
        self.tuning = {}

    def default_kernels(self):
        return [2, 2, 2, 2, 2]

    def get_kernels(self):
        return list(self.policy)

    def set_kernels(self, values):
        self.policy = list(values)

    def set_tuning(self, slot, variant):
        self.tuning[slot] = variant
        return True


def test_variants_tune_and_report_plumbing_on_cpu(bench, monkeypatch, capsys):
    lnm = bench.lnm_mod
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(bench, "bench_ms", lambda fn, rep_ms=300, flush="read": (fn(), 0.25)[1])
    monkeypatch.setattr(bench, "graphed", lambda fns: (lambda: [f() for f in fns]))
    monkeypatch.setattr(bench, "TUNE_S", {1536: (8, 8), 5120: (4, 4)})
    ext = _FakeExt()
    monkeypatch.setattr(lnm, "_STATE", lnm._OpState())
    lnm._STATE.tried, lnm._STATE.ext = True, ext
    torch._dynamo.reset()
    results = []
    for name, B, S, D, pt in (("ps", 2, 8, 64, False), ("tok", 1, 8, 64, True)):
        r = bench.time_case(name, B, S, D, pt, l2_bytes=1 << 16, quick=True, variants=True)
        r.update(bench.check_case(B, S, D, pt, variants=True))
        r.update({"floor fwd": 0.2, "floor fwd+bwd": 0.5})
        results.append(r)
        assert r["ours[v1] fwd"] == 0.25 and r["ours[v2] fwd+bwd"] == 0.25
        assert "ours[v2] dscale rel" in r
    assert ext.policy == [2, 2, 2, 2, 2]  # restored after the variants
    tuning = bench.tune(ext, quick=True)
    assert len(tuning) == 8 * 6 * 2 and all(v == 0 for v in ext.tuning.values())
    assert all(row["max_rel_diff_vs_default"] == 0.0 for row in tuning)
    meta = {"device": "cpu", "kernels": "fwd_sample=v2", "kernels_default": lnm.format_kernel_policy(
        dict(zip(lnm.POLICY_KEYS, ext.default_kernels())))}
    bench.print_report(results, tuning, None, bench.recommend_policy(results), meta, 3e12)
    out = capsys.readouterr().out
    assert "LayerNorm-Modulate, cpu" in out and "kernel generations" in out
    assert "recommended: DS_ADAPTIVE_LN_MODULATE_KERNELS=" in out and "tuning sweep" in out
    assert out.count("ours[v2]") >= 2
