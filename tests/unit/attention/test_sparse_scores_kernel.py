"""Guards the fused Triton pooled log-sum-exp block scores on CPU under the Triton interpreter: vs a float64
definition on awkward sizes (ragged S, S < block, query tiles and key ranges that do not divide, H = 3, B = 2,
head dims 64 / 128, blocks 64 / 128, head-slice and transposed views) into a NaN-poisoned output, 16-bit inputs
within the torch path's own error, the selection on planted RoPE data equal to the torch reference's, and the
one dispatch point (``selection.pooled_lse_scores``)."""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from ds_adaptive.attention.attention import SparseKernelError
from ds_adaptive.attention.kernels import triton_block_scores as op
from ds_adaptive.attention.kernels.triton_block_scores import ScoreTiles, scores_unsupported, triton_pooled_lse_scores
from ds_adaptive.attention.selection import SelectionError, blocks_for_density, select_blocks
from ds_adaptive.attention.scores import pooled_lse_scores, pooled_lse_scores_torch
from test_sparse_kernels import (IN_INTERPRETER, _fix_interpreter_bf16_dot, interpreter_only,  # noqa: E402
                                 needs_triton, run_file_in_interpreter)


@needs_triton
@pytest.mark.skipif(IN_INTERPRETER, reason="this process is the interpreter run")
def test_interpreter_cases_in_a_fresh_process() -> None:
    """The interpreter cases below, in a fresh python with TRITON_INTERPRET=1 (set before triton imports)."""
    run_file_in_interpreter(__file__, 3)   # skipped there: the three main-process tests


def reference_scores64(q: torch.Tensor, k: torch.Tensor, block: int) -> torch.Tensor:
    """The definition in float64: ``log sum_{t in j} exp(mean(q over block i) . k_t / sqrt(Dh))`` [B, H, nq, nk]."""
    s, d = q.shape[1], q.shape[-1]
    qbar = torch.stack([q[:, i:i + block].double().mean(1) for i in range(0, s, block)], 2)  # [B, H, nq, Dh]
    lg = torch.einsum("bhid,bshd->bhis", qbar, k.double()) / math.sqrt(d)
    return torch.stack([torch.logsumexp(lg[..., j:j + block], -1) for j in range(0, s, block)], -1)


def _qk(b, s, h, d, seed, view=None):
    """q, k [B, S, H, Dh] fp32 (scaled so that the logits spread over several units); ``view``: ``"slice"`` = heads
    1..H of a wider tensor, ``"transposed"`` = a [B, H, S, Dh] tensor seen as [B, S, H, Dh]."""
    g = torch.Generator().manual_seed(seed)
    if view == "slice":
        return [torch.randn(b, s, h + 2, d, generator=g)[:, :, 1:h + 1] * 2 for _ in range(2)]
    if view == "transposed":
        return [(torch.randn(b, h, s, d, generator=g) * 2).transpose(1, 2) for _ in range(2)]
    return [torch.randn(b, s, h, d, generator=g) * 2 for _ in range(2)]


def _err(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


@pytest.fixture
def poisoned(monkeypatch):
    """The kernel writes into a NaN-filled output: an entry it misses shows as NaN."""
    _fix_interpreter_bf16_dot()
    monkeypatch.setattr(op, "_alloc", lambda *a, **kw: torch.full(*a, float("nan"), **kw))


SPLIT = ScoreTiles(block_q=16, min_programs=10 ** 6, min_key_blocks=3)
"""Query tiles of 16 (38 query blocks: 3 tiles, the last partial) and key ranges of 3 blocks (the last ragged)."""
ONE = ScoreTiles(block_q=16, min_programs=10 ** 6, min_key_blocks=1)
"""One key block per program."""

# (B, S, H, Dh, block, tiles, view): S ragged except one case; S < block; nq < and > the query tile
CASES = [
    (2, 150, 3, 64, 64, None, None),
    (1, 40, 3, 64, 64, None, None),
    (1, 40, 3, 128, 128, ONE, None),
    (1, 64 * 37 + 5, 3, 64, 64, SPLIT, "slice"),
    (2, 128 * 5, 3, 128, 128, SPLIT, "transposed"),
    (1, 128 * 4 + 100, 3, 128, 64, ONE, "slice"),
    (2, 300, 3, 64, 128, None, "transposed"),
]


@interpreter_only
@pytest.mark.parametrize("b,s,h,d,block,tiles,view", CASES)
def test_fp32_scores_equal_the_fp64_definition(poisoned, b, s, h, d, block, tiles, view) -> None:
    q, k = _qk(b, s, h, d, seed=s + d, view=view)
    got = triton_pooled_lse_scores(q, k, block, tiles=tiles)
    nb = math.ceil(s / block)
    assert got.shape == (b, h, nb, nb) and got.dtype == torch.float32
    assert torch.isfinite(got).all(), "an entry was not written (NaN poison) or overflowed"
    want = reference_scores64(q, k, block)
    assert _err(got, want) < 1e-4 * max(1.0, float(want.abs().max())), _err(got, want)


@interpreter_only
def test_the_comparison_can_fail(poisoned) -> None:
    """Negative control: scores of other keys (one block rolled) are far from the definition."""
    q, k = _qk(1, 150, 3, 64, seed=3)
    got = triton_pooled_lse_scores(q, k.roll(64, dims=1), 64)
    assert _err(got, reference_scores64(q, k, 64)) > 0.5


@interpreter_only
@pytest.mark.parametrize("dtype,d,block", [(torch.bfloat16, 128, 64), (torch.float16, 64, 128)])
def test_16bit_scores_within_the_torch_paths_own_error(poisoned, dtype, d, block) -> None:
    """16-bit q, k: the kernel's error vs float64 (of the same 16-bit inputs) <= 2x that of the torch reference
    path, which rounds the logits to the 16-bit dtype (the kernel keeps them in fp32), + a small floor."""
    q, k = (t.to(dtype) for t in _qk(2, 3 * block + 17, 3, d, seed=7))
    exact = reference_scores64(q, k, block)
    got = triton_pooled_lse_scores(q, k, block)
    torch_err = _err(pooled_lse_scores_torch(q, k, block), exact)
    assert torch.isfinite(got).all()
    assert _err(got, exact) <= 2 * torch_err + 1e-3 * float(exact.abs().max()), (_err(got, exact), torch_err)


@interpreter_only
def test_selection_from_kernel_scores_equals_the_reference_selection_on_planted_data(poisoned) -> None:
    """On Wan-3D-RoPE planted q, k (local, far, sink, mixed heads; cube order) the top-k from the kernel's scores is
    the top-k from the torch reference's (fp32) and from the float64 definition's, at several densities."""
    from ds_adaptive.attention.cube_order import CubeOrder
    from ds_adaptive.attention.planted import PLANTED_KINDS, planted_rope_qk

    q, k = planted_rope_qk((2, 16, 16), 4, 64, kinds=PLANTED_KINDS, order=CubeOrder((2, 4, 4)), seed=1,
                           temperature=60.0)
    q, k = q[:, :-20], k[:, :-20]  # a ragged last block
    s, block = q.shape[1], 64
    nk = math.ceil(s / block)
    ours, ref, exact = (fn(q, k, block) for fn in (triton_pooled_lse_scores, pooled_lse_scores_torch,
                                                    reference_scores64))
    for dens in (0.1, 0.25, 0.5):
        kph = blocks_for_density(torch.full((4,), dens), nk)
        sels = [select_blocks(x, kph, seq_len=s, block_size=block, keep_sink=True) for x in (ours, ref, exact)]
        assert torch.equal(sels[0].kv_idx, sels[1].kv_idx) and torch.equal(sels[0].kv_idx, sels[2].kv_idx), dens
        assert torch.equal(sels[0].kv_num, sels[1].kv_num)


@interpreter_only
def test_dispatch_forces_either_path_and_auto_keeps_cpu_on_torch() -> None:
    q, k = _qk(1, 150, 3, 64, seed=5)
    torch_path = pooled_lse_scores_torch(q, k, 64)
    assert torch.equal(pooled_lse_scores(q, k, 64), torch_path)  # auto on CPU: torch, even under the interpreter
    assert torch.equal(pooled_lse_scores(q, k, 64, impl="torch"), torch_path)
    assert torch.equal(pooled_lse_scores(q, k, 64, impl="triton"), triton_pooled_lse_scores(q, k, 64))


def test_inputs_the_kernel_does_not_take_are_named() -> None:
    q = torch.zeros(1, 70, 2, 64)
    assert "head dims" in scores_unsupported(torch.zeros(1, 70, 2, 48), torch.zeros(1, 70, 2, 48), 64)
    assert "blocks of" in scores_unsupported(q, q, 96)
    assert "dtype" in scores_unsupported(q.double(), q.double(), 64)
    assert "[B, S, H, Dh]" in scores_unsupported(q, q[:, :69], 64)
    if not IN_INTERPRETER:  # CPU tensors outside the interpreter
        assert "need CUDA tensors" in scores_unsupported(q, q, 64)
        with pytest.raises(SparseKernelError, match="need CUDA tensors"):
            triton_pooled_lse_scores(q, q, 64)
        assert torch.equal(pooled_lse_scores(q, q, 64), pooled_lse_scores_torch(q, q, 64))
    with pytest.raises(SelectionError, match="impl must be one of"):
        pooled_lse_scores(q, q, 64, impl="cuda")
    with pytest.raises(SparseKernelError, match="block_q must be a power of two"):
        ScoreTiles(block_q=48).check()


def test_tile_split_covers_every_key_block() -> None:
    """The key range per program: ranges of at least ``min_key_blocks`` (or all), enough programs when B*H is small."""
    t = ScoreTiles(block_q=64, min_programs=2048, min_key_blocks=8)
    for nq, bh in ((3, 1), (9, 1), (17, 2), (220, 156), (1182, 12), (512, 24), (5, 40)):
        kb = t.key_blocks(nq, nq, bh)
        ranges = math.ceil(nq / kb)
        assert (ranges - 1) * kb < nq <= ranges * kb and (kb >= 8 or kb == nq)
    assert t.key_blocks(1182, 1182, 12) * 12 * 19 < 1182 * 12 * 19 // 4  # a long clip at B = 1: split


@needs_triton
@pytest.mark.skipif(IN_INTERPRETER, reason="the interpreter does not keep do_not_specialize")
def test_run_time_arguments_are_never_specialised() -> None:
    """Every argument that varies with S, B, H or the grid exists in the kernel and is marked (one compile per dtype,
    head dim, block and tiles: a renamed argument would be specialised again)."""
    from ds_adaptive.attention.kernels import _triton_block_scores as kmod
    params = {p.name: p for p in kmod.pooled_lse_scores_kernel.params}
    assert set(kmod._RUNTIME_INTS) <= set(params)
    assert all(params[n].do_not_specialize for n in kmod._RUNTIME_INTS)


def test_warm_up_runs_the_dispatch() -> None:
    from ds_adaptive.attention.scores import warm_pooled_lse_scores
    assert warm_pooled_lse_scores("cpu", torch.float32, 3, 64, 64) >= 0.0


@needs_triton
@pytest.mark.skipif(IN_INTERPRETER, reason="runs its own interpreter process")
def test_cost_bench_runs_end_to_end_on_cpu_under_the_interpreter(tmp_path) -> None:
    """bench/kernels/sparse_select_cost.py's whole path (scores both ways, top-k, selection, triton attention fwd+bwd, the
    tile sweep, table, JSON) on tiny shapes under the interpreter, so a GPU run does not die on plumbing."""
    import json
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[3]
    out = tmp_path / "ssc.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, str(root / "bench" / "kernels" / "sparse_select_cost.py"), "--device", "cpu", "--heads", "2",
                        "--head-dim", "64", "--dtype", "float16", "--reps", "1", "--shapes", "200x2", "130",
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=300, cwd=str(root / "bench" / "kernels"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(x["seq"], x["batch"]) for x in res["results"]] == [(200, 2), (130, 1)]
    row = res["results"][0]
    assert row["agree"] == 1.0 and row["attn_ms"] > 0 and row["triton_ms"] > 0 and row["nk"] == 4
    assert len(res["meta"]["sweep"]) == 7 and "x6 old" in r.stdout
