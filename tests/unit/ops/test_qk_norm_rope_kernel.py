"""Guards the Triton q / k RMSNorm + RoPE kernels (``ds_adaptive.ops.qk_norm_rope``) on CPU under the Triton
interpreter: forward and backward (dq, dk, dwq, dwk) vs the float64 reference (``wan_blocks.qk_norm_rope``) on awkward
sizes (D / 2 not a power of two, head dims 6 / 12 / 24, H = 3 / 5, S below and above the program count,
B = 1 / 3), fp32 and bf16, into NaN-poisoned buffers: within twice the eager path's own error plus one rounding
step; block fusion's dispatch (the kernel where it can run, else the compiled function); the reasons the kernel
refuses inputs, its launch defaults and their override (checked in the main process)."""
from __future__ import annotations


import pytest
import torch

from ds_adaptive.models.testing import block_fusion_errors
from ds_adaptive.ops import qk_norm_rope as op
from test_sparse_kernels import IN_INTERPRETER, interpreter_only, needs_triton, run_file_in_interpreter  # noqa: E402


@needs_triton
@pytest.mark.skipif(IN_INTERPRETER, reason="this process is the interpreter run")
def test_interpreter_cases_in_a_fresh_process() -> None:
    """The interpreter cases below, in a fresh python with TRITON_INTERPRET=1 (set before triton imports)."""
    run_file_in_interpreter(__file__, 5)   # skipped there: the five main-process tests


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the kernels write starts as NaN: a row or pair they skip shows."""
    def nan_alloc(*shape, **kw):
        return torch.full(*shape, float("nan"), **kw) if shape and isinstance(shape[0], (tuple, list, torch.Size)) \
            else torch.full(shape, float("nan"), **kw)
    monkeypatch.setattr(op, "_alloc", nan_alloc)
    assert op.interpreted()


@interpreter_only
@pytest.mark.parametrize("size", [(2, 37, 3, 12), (1, 5, 2, 6), (3, 11, 5, 24), (1, 9, 4, 8)],
                         ids=["odd-tiny", "S-below-programs", "odd-heads", "pow2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_fp64_within_torchs_own_error(poisoned, dtype, size):
    rows = block_fusion_errors(dtype, size, "cpu", impls={"qk_norm_rope": op.triton_qk_norm_rope})
    assert len(rows) == 6   # q, k outputs; dq, dk, dwq, dwk
    for name, i, err, eager_err, ref_max in rows:
        # twice the eager path's error, plus one rounding step of the dtype at the largest value (the kernel
        # rounds fp32 values that differ in the last bits: a tie may go the other way), plus fp32 accumulation in
        # another order (the weight gradient: per-program sums, then over programs)
        bound = (2 * eager_err + torch.finfo(dtype).eps * ref_max + 64 * torch.finfo(torch.float32).eps * ref_max
                 + 1e-12)
        assert err <= bound, (name, dtype, size, i, err, bound)


@pytest.mark.skipif(IN_INTERPRETER, reason="checked in the main process")
def test_refuses_what_it_cannot_take_with_the_reason():
    q = torch.zeros(1, 4, 12)
    w = torch.zeros(12)
    f = torch.zeros(4, 3, 2)
    if op.unsupported(q, q, w, w, f, 2) is not None:   # CPU tensors outside the interpreter
        assert "CUDA" in op.unsupported(q, q, w, w, f, 2) or "triton" in op.unsupported(q, q, w, w, f, 2)
    with pytest.raises(ValueError, match="triton_qk_norm_rope"):
        op.triton_qk_norm_rope(q, q, w, w, f, 1e-6, 2)


@pytest.mark.skipif(IN_INTERPRETER, reason="checked in the main process")
def test_unsupported_names_the_input(monkeypatch):
    monkeypatch.setattr(op, "interpreted", lambda: True)   # the shape checks, as on a GPU
    q, w, f = torch.zeros(1, 4, 12), torch.zeros(12), torch.zeros(4, 3, 2)
    assert op.unsupported(q, q, w, w, f, 2) is None
    assert "[B, S, D]" in op.unsupported(q[0], q[0], w, w, f, 2)
    assert "even head dim" in op.unsupported(q, q, w, w, f, 4)   # Dh 3
    assert "RMSNorm weights" in op.unsupported(q, q, w[:6], w, f, 2)
    assert "freqs" in op.unsupported(q, q, w, w, f[:3], 2)
    assert "freqs" in op.unsupported(q, q, w, w, f.double(), 2)
    assert "dtype" in op.unsupported(q, q.double(), w, w, f, 2)


def _qk_inputs(dtype=torch.float32):
    from ds_adaptive.models.rope import rope_table

    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 15, 24, generator=g).to(dtype) for _ in range(2))
    w = torch.ones(24, dtype=dtype)
    return q, k, w, w, rope_table((1, 3, 5), (2, 1, 1)), 1e-6, 3


@interpreter_only
def test_block_fusion_runs_the_kernel_where_it_can(monkeypatch):
    """Inputs the kernel takes (the interpreter's CPU tensors stand for CUDA ones) never reach the compiled fallback."""
    from ds_adaptive.models import fusion

    def no_compile(name):
        raise AssertionError(f"compiled({name!r}) called for inputs the kernel takes")

    monkeypatch.setattr(fusion, "compiled", no_compile)
    args = _qk_inputs()
    got = fusion.qk_norm_rope_kernel(*args)
    want = op.triton_qk_norm_rope(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # eps None is F.rms_norm's default (the dtype's machine epsilon), as nn.RMSNorm(eps=None) passes it
    from ds_adaptive.models import wan_blocks
    q, k, wq, wk, freqs, _, heads = args
    got = op.triton_qk_norm_rope(q, k, wq, wk, freqs, None, heads)
    ref = wan_blocks.qk_norm_rope(q.double(), k.double(), wq.double(), wk.double(), freqs.double(), torch.finfo(q.dtype).eps,
                           heads)
    assert all(torch.allclose(a.double(), b, atol=1e-5) for a, b in zip(got, ref))


@pytest.mark.skipif(IN_INTERPRETER, reason="checked in the main process")
def test_block_fusion_falls_back_to_the_compiled_function(monkeypatch):
    """CPU tensors outside the interpreter: the compiled ``wan_blocks.qk_norm_rope`` (here its eager stand-in) runs."""
    from ds_adaptive.models import fusion, wan_blocks

    calls = []
    monkeypatch.setattr(fusion, "compiled", lambda name: calls.append(name) or getattr(wan_blocks, name))
    args = _qk_inputs()
    got = fusion.qk_norm_rope_kernel(*args)
    assert calls == ["qk_norm_rope"]
    assert all(torch.equal(a, b) for a, b in zip(got, wan_blocks.qk_norm_rope(*args)))


@pytest.mark.skipif(IN_INTERPRETER, reason="checked in the main process")
def test_launch_defaults_and_the_override_and_its_error(monkeypatch):
    from ds_adaptive.core.config import ConfigError
    from ds_adaptive.models import fusion
    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.models.wan_config import get_wan_config

    monkeypatch.delenv(op.TILES_ENV, raising=False)
    assert [op.default_warps(d) for d in (24, 1536, 3072, 5120)] == [4, 4, 8, 16]   # ~16 channels a thread
    assert op.tiles(1536) == (op.PROGRAMS_PER_SM, 4)
    monkeypatch.setenv(op.TILES_ENV, "16,8")
    assert op.tiles(1536) == (16, 8)
    m = WanModel(get_wan_config("tiny", num_layers=1))
    for bad in ("16", "a,4", "0,4", "8,3"):
        monkeypatch.setenv(op.TILES_ENV, bad)
        with pytest.raises(ValueError, match=op.TILES_ENV):
            op.tiles(1536)
        with pytest.raises(ConfigError, match=f"{op.TILES_ENV}={bad!r}: expected") as err:   # before the run starts
            fusion.apply_block_fusion(m, "rope")
        assert "\n" not in str(err.value)
