"""Guards the Triton block-sparse kernels on CPU under the Triton interpreter: forward (out, lse) and backward
(dq, dk, dv) vs a float64 masked dense reference on awkward sizes (ragged S, B = 1/2/3, H = 3, rows with one
block and with every block, valid_len < S, split tiles, atomic dQ), into NaN-poisoned buffers; the tile-config
table; the kernels' run-time (never specialised) arguments."""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_adaptive.attention.attention import SparseKernelError
from ds_adaptive.attention.kernels import reference_attention, triton_status
from ds_adaptive.attention.kernels import triton_block_sparse as op
from ds_adaptive.attention.kernels.triton_configs import (KernelConfig, TileConfig, TritonConfigError, config_for,
                                                       default_config, validate_table)
from ds_adaptive.attention.selection import BlockSelection, select_blocks

_OK, _WHY = triton_status()
needs_triton = pytest.mark.skipif(not _OK, reason=f"Triton interpreter tests need triton ({_WHY}); "
                                                  "pip install -e '.[dev]' installs it")


def _interpreter_ready() -> bool:
    """True when triton was imported under TRITON_INTERPRET=1 (its standard library too: a process that
    imported triton before, e.g. through deepspeed or torch.compile, cannot switch to the interpreter)."""
    if not _OK or os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton.language.standard as std
    return type(std.cdiv).__name__ == "InterpretedFunction"


IN_INTERPRETER = _interpreter_ready()
interpreter_only = pytest.mark.skipif(not IN_INTERPRETER, reason="runs in the interpreter subprocess of "
                                      "test_interpreter_cases_in_a_fresh_process (TRITON_INTERPRET=1 before triton imports)")


def run_file_in_interpreter(path: str, main_process_tests: int) -> None:
    """Run the test file ``path`` in a fresh python with TRITON_INTERPRET=1 (set before triton imports): every test
    passes, and exactly its ``main_process_tests`` (skipped there) are skipped."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider", "-x"],
                       env=env, capture_output=True, text=True, timeout=300, cwd=str(root / "tests"))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    assert " passed" in last and f"{main_process_tests} skipped" in last, last


@needs_triton
@pytest.mark.skipif(IN_INTERPRETER, reason="this process is the interpreter run")
def test_interpreter_cases_in_a_fresh_process() -> None:
    """The interpreter cases below, in a fresh python with TRITON_INTERPRET=1 (set before triton imports)."""
    run_file_in_interpreter(__file__, 3)   # skipped there: the three main-process tests


def _fix_interpreter_bf16_dot() -> None:
    """triton 3.9's interpreter multiplies bf16 tiles as their raw uint16 bits (numpy has no bf16): widen
    them to fp32 first (exact), so bf16 runs can be checked on CPU."""
    from triton.runtime import interpreter as itp
    import triton.language as tl
    if getattr(itp.InterpreterBuilder.create_dot, "_bf16_fixed", False):
        return
    orig = itp.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return itp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)
    create_dot._bf16_fixed = True
    itp.InterpreterBuilder.create_dot = create_dot


@pytest.fixture(scope="module")
def interp():
    """The kernels module, built by the interpreter (it takes CPU tensors)."""
    from ds_adaptive.attention.kernels import _triton_block_sparse as kmod
    _fix_interpreter_bf16_dot()
    assert op.interpreted()
    return kmod


def _selection(b, h, s, bs, kph, seed) -> BlockSelection:
    n = math.ceil(s / bs)
    g = torch.Generator().manual_seed(seed)
    k = torch.tensor([min(x, n) for x in kph])
    return select_blocks(torch.randn(b, h, n, n, generator=g), k, seq_len=s, block_size=bs)


def _qkv(b, s, h, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
            for _ in range(3)]


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def _err(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


SPLIT = KernelConfig(fwd=TileConfig(32, 16, 4, 2), dq=TileConfig(16, 32, 4, 2), dkdv=TileConfig(16, 32, 4, 2))
ATOMIC = KernelConfig(fwd=TileConfig(64, 32, 4, 2), dq=TileConfig(64, 32, 4, 2), dkdv=TileConfig(32, 16, 4, 2),
                      atomic_dq=True)

# (B, S, H, D, block, key blocks per head, valid_len, config): ragged S everywhere; k = 1 (the diagonal only)
# and k = all blocks; valid_len that drops a block (120 of 140 at 64) and one that keeps them (66 of 70 at 16)
CASES = [
    (1, 150, 3, 64, 32, (1, 2, 99), None, None),
    (2, 140, 3, 64, 64, (1, 2, 99), 120, SPLIT),
    (3, 70, 3, 64, 16, (1, 3, 99), 66, None),
    (1, 140, 3, 64, 64, (2, 1, 99), None, ATOMIC),
    (1, 70, 3, 128, 32, (1, 2, 3), None, None),
]


@interpreter_only
@pytest.mark.parametrize("b,s,h,d,bs,kph,valid,cfg", CASES)
def test_fp32_matches_fp64_reference_fwd_bwd(interp, monkeypatch, b, s, h, d, bs, kph, valid, cfg) -> None:
    # every buffer the kernels write starts as NaN: a row they miss or a read of an unwritten entry shows
    monkeypatch.setattr(op, "_alloc", lambda *a, **kw: torch.full(*a, float("nan"), **kw))
    sel = _selection(b, h, s, bs, kph, seed=s + bs)
    q, k, v = _qkv(b, s, h, d, torch.float32, seed=s)
    dout = torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(9))
    out = op.triton_block_sparse_attention(q, k, v, sel, valid_len=valid, config=cfg)
    grads = _grads(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, lse = reference_attention(q64, k64, v64, sel, valid_len=valid)
    ref_grads = _grads(ref, (q64, k64, v64), dout.double())
    assert _err(out, ref) < 2e-5, _err(out, ref)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert torch.isfinite(g).all(), name
        assert _err(g, r) < 5e-5 * max(1.0, float(r.abs().max())), (name, _err(g, r))
    # the saved log-sum-exp (log2 domain inside the op) on the valid rows
    seq = s if valid is None else valid
    from ds_adaptive.attention.attention import truncate_selection
    tsel = truncate_selection(sel, seq) if seq < s else sel
    _, lse2 = op.block_sparse_forward(q.detach(), k.detach(), v.detach(), tsel.kv_num, tsel.kv_idx, block=bs,
                                      seq=seq, config=cfg or default_config(d, bs))
    assert _err(lse2 * math.log(2.0), lse) < 2e-5
    if valid is not None:  # padded rows: exactly 0, output and gradients
        assert out[:, valid:].abs().max() == 0 and all(g[:, valid:].abs().max() == 0 for g in grads)
    if cfg is None:  # the registered backend is this op (its contract: density is a hint, valid_len as here)
        from ds_adaptive.attention.backends import get_backend
        with torch.no_grad():
            via_backend = get_backend("triton").attention(q, k, v, sel, valid_len=valid, density=0.3)
        assert torch.equal(via_backend, out.detach())


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_torch_own_error(interp, dtype) -> None:
    """16-bit inputs: error vs float64 <= 3x the error of the same masked attention computed by torch in the
    16-bit dtype throughout (flash-attention's yardstick: its reference without upcast) + a small floor."""
    b, s, h, d, bs = 2, 150, 3, 64, 32
    sel = _selection(b, h, s, bs, (1, 2, 99), seed=4)
    q, k, v = _qkv(b, s, h, d, dtype, seed=5)
    dout = torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(6)).to(dtype)
    out = op.triton_block_sparse_attention(q, k, v, sel, valid_len=140)
    ours = (out, *_grads(out, (q, k, v), dout))
    low, _ = reference_attention(q, k, v, sel, valid_len=140, work_dtype=dtype)
    lowp = (low, *_grads(low, (q, k, v), dout))
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, _ = reference_attention(q64, k64, v64, sel, valid_len=140)
    exact = (ref, *_grads(ref, (q64, k64, v64), dout.double()))
    for name, a, lo, e in zip(("out", "dq", "dk", "dv"), ours, lowp, exact):
        assert a.dtype == dtype
        bound = 3 * _err(lo, e) + 1e-3 * float(e.detach().abs().max())
        assert _err(a, e) <= bound, (name, _err(a, e), bound)


@interpreter_only
def test_another_selection_changes_the_output(interp) -> None:
    """Negative control: the comparison above can fail (a different selection is far from the reference)."""
    b, s, h, d, bs = 1, 150, 3, 64, 32
    q, k, v = _qkv(b, s, h, d, torch.float32, seed=1)
    sel, other = _selection(b, h, s, bs, (2, 2, 2), seed=1), _selection(b, h, s, bs, (2, 2, 2), seed=2)
    with torch.no_grad():
        ours = op.triton_block_sparse_attention(q, k, v, other)
        ref, _ = reference_attention(q, k, v, sel)
    assert _err(ours, ref) > 0.05


@interpreter_only
def test_inputs_the_kernels_do_not_take_fail_loudly(interp) -> None:
    q, k, v = _qkv(1, 64, 1, 48, torch.float32, seed=0)
    with pytest.raises(SparseKernelError, match="head dim"):
        op.triton_block_sparse_attention(q, k, v, BlockSelection.full(1, 1, 64, 32))
    q, k, v = _qkv(1, 64, 1, 64, torch.float64, seed=0)
    with pytest.raises(SparseKernelError, match="float64"):
        op.triton_block_sparse_attention(q, k, v, BlockSelection.full(1, 1, 64, 32))
    q, k, v = _qkv(1, 64, 1, 64, torch.float32, seed=0)
    with pytest.raises(SparseKernelError, match="blocks of 16..128"):
        op.triton_block_sparse_attention(q, k, v, BlockSelection.full(1, 1, 64, 48))


@needs_triton
@pytest.mark.skipif(IN_INTERPRETER, reason="the interpreter does not keep do_not_specialize")
def test_run_time_arguments_are_never_specialised() -> None:
    """Every argument named in the no-specialisation list exists in the kernels that take lists and is marked
    (a renamed argument would silently be specialised again: one compile per S or per batch)."""
    from ds_adaptive.attention.kernels import _triton_block_sparse as kmod
    for fn in (kmod.block_sparse_fwd, kmod.block_sparse_bwd_dq, kmod.block_sparse_bwd_dkdv):
        params = {p.name: p for p in fn.params}
        assert set(kmod._RUNTIME_INTS) <= set(params), fn
        assert all(params[n].do_not_specialize for n in kmod._RUNTIME_INTS), fn


# ------------------------------------------------------------------------------ tile configs (no triton)
def test_tile_config_checks_and_table() -> None:
    with pytest.raises(TritonConfigError, match="dividing the block 64"):
        KernelConfig(fwd=TileConfig(128, 64, 8, 3), dq=TileConfig(64, 64, 4, 3), dkdv=TileConfig(64, 64, 4, 3)).check(64)
    cfg = default_config(128, 128)
    assert KernelConfig.from_json(cfg.to_json(), 128) == cfg
    bucket = {"max_density": 1.0, "config": cfg.to_json(), "measured": [{"seq": 32760, "density": 0.1, "ms": 1.0}]}
    validate_table({"entries": [{"device": "X", "capability": [9, 0], "head_dim": 128, "block": 128,
                                 "buckets": [bucket]}]})
    with pytest.raises(TritonConfigError, match="must reach max_density 1.0"):
        validate_table({"entries": [{"device": "X", "capability": [9, 0], "head_dim": 128, "block": 128,
                                     "buckets": [{**bucket, "max_density": 0.5}]}]})
    with pytest.raises(TritonConfigError, match="needs fwd, dq, dkdv"):
        validate_table({"entries": [{"device": "X", "capability": [9, 0], "head_dim": 128, "block": 128,
                                     "buckets": [{**bucket, "config": {"fwd": {}}}]}]})
    assert config_for(64, 64, 0.1, "cpu") == default_config(64, 64)  # no GPU: the defaults


def test_triton_backend_is_registered_and_says_what_it_needs() -> None:
    from ds_adaptive.attention.backends import backend_names, get_backend

    assert "triton" in backend_names()
    be = get_backend("triton")
    assert "runs on cuda, not cpu" in be.unsupported("cpu")
    assert "block_size [64, 128], not 32" in be.unsupported("meta", block_size=32)
    assert "head dims [64, 128], not 96" in be.unsupported("meta", head_dim=96)
    if _OK:  # "meta" is a GPU launch in a dry run
        assert be.unsupported("meta", dtype=torch.bfloat16, head_dim=128, block_size=64) is None
    else:
        assert "needs triton" in be.unsupported("meta")
    assert be.describe()["runtime_shapes"] and be.efficiency("cpu")(0.1) > 0


def test_bench_table_from_a_sweep_is_a_valid_config_table() -> None:
    """A tile sweep's per-density winners (bench/kernels/sparse_backends.py) become buckets (same config merged, edges
    at midpoints) that validate and route densities; the curves take the worst shape."""
    from ds_adaptive.attention.kernels import triton_configs as sb

    a = default_config(128, 128)
    b = KernelConfig(fwd=TileConfig(64, 64, 4, 3), dq=a.dq, dkdv=a.dkdv)
    rec = lambda d: {"density": d, "seq": 32760, "heads": 12, "fwd_ms": 1.0, "dq_ms": 1.0, "dkdv_ms": 1.0}  # noqa: E731
    chosen = {0.05: (b, rec(0.05)), 0.1: (b, rec(0.1)), 0.2: (a, rec(0.2)), 0.4: (a, rec(0.4))}
    meta = {"device": "GPU X", "torch": "2.11", "commit": "abc", "date": "today", "dtype": "bfloat16"}
    table = validate_table(sb.table_from_sweep(chosen, meta, 128, 128, [9, 0], "3.6", "bench/kernels/sparse_backends.py"))
    buckets = table["entries"][0]["buckets"]
    assert [x["max_density"] for x in buckets] == [0.15, 1.0] and len(buckets[0]["measured"]) == 2
    assert KernelConfig.from_json(buckets[0]["config"], 128) == b
    rows = [{"dense_ms": 10.0, "backends": {"triton": {"rows": [{"density": 0.1, "ms": 1.0, "eff_vs_dense": 1.0,
                                                                  "speedup_vs_dense": 10.0}]}}},
            {"dense_ms": 10.0, "backends": {"triton": {"rows": [{"density": 0.1, "ms": 2.0, "eff_vs_dense": 0.5,
                                                                  "speedup_vs_dense": 5.0}]}}}]
    assert sb.worst_curves(rows) == {"triton": {0.1: {"g": 0.2, "eff": 0.5, "speedup": 5.0}}}
    # --table-out into an existing file: other head dims' (blocks', GPUs') entries stay, the same one is replaced
    d64 = {**table["entries"][0], "head_dim": 64}
    merged = validate_table(sb.merge_tables({"entries": [d64, table["entries"][0]]}, table))
    assert [e["head_dim"] for e in merged["entries"]] == [128, 64]


@needs_triton
@pytest.mark.skipif(IN_INTERPRETER, reason="runs its own interpreter process")
def test_bench_runs_end_to_end_on_cpu_under_the_interpreter(tmp_path) -> None:
    """bench/kernels/sparse_backends.py's whole path (sweep of every tile candidate, table, rows, new-S probe, report,
    JSON) on a tiny shape under the interpreter, so a GPU run does not die on plumbing."""
    import json
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[3]
    out, table = tmp_path / "sb.json", tmp_path / "table.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, str(root / "bench" / "kernels" / "sparse_backends.py"), "--device", "cpu", "--seq", "130",
                        "--heads", "1", "--head-dim", "64", "--block", "64", "--densities", "0.5", "--reps", "1",
                        "--dtype", "float16", "--out", str(out), "--table-out", str(table)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    row = res["results"][0]["backends"]["triton"]
    assert row["rows"][0]["ms"] > 0 and row["new_seq"]["kernels_compiled"] == 0
    assert abs(row["rel_diff_vs_triton_at_0.1"]) == 0
    entry = validate_table(json.loads(table.read_text()))["entries"][0]
    assert entry["block"] == 64 and entry["curve"]["density"] == [0.5]
    assert {x["kernel"] for x in res["meta"]["sweep"]} == {"fwd", "dq", "dkdv", "atomic", "delta"}


def test_auto_does_not_prefer_an_unmeasured_triton(monkeypatch) -> None:
    """The shipped table gives its GPU the measured curve; without a table entry or a measurement of this GPU, triton's curve is worse than flex's shipped one at auto's reference
    density, so auto keeps flex until a measurement (or the shipped table) says otherwise."""
    from ds_adaptive.attention.backends import get_backend, select_backend
    from ds_adaptive.attention.backends import measure as m

    from ds_adaptive.attention.kernels import triton_configs

    monkeypatch.setattr(m, "cached_curve", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    shipped = get_backend("triton").efficiency("cuda")  # the shipped H200 table's measured curve
    assert "shipped NVIDIA H200 measurement" in shipped.source and 0.1 < shipped(0.1) < 0.2
    monkeypatch.setattr(triton_configs, "shipped_table", lambda: {"entries": []})
    flex, tri = get_backend("flex").efficiency("cuda"), get_backend("triton").efficiency("cuda")
    assert "not measured" in tri.source and tri(0.1) > flex(0.1)
    if _OK:
        assert select_backend("auto", "meta").backend.name == "flex"
