"""q / k RMSNorm + RoPE of a Wan self-attention by one Triton kernel per tensor, forward and backward.

:func:`triton_qk_norm_rope` computes what :func:`ds_adaptive.models.wan.qk_norm_rope` (the torch reference)
does: ``F.rms_norm`` of q and k ``[B, S, D]`` over all D channels with their weights, then the 3D RoPE of
``freqs [S, Dh / 2, 2]`` on each head, -> ``[B, S, H, Dh]`` each, in the input dtype with the reference's two
roundings (after the norm, after the rotation). One kernel reads a tensor once and writes it once each way
(:mod:`._triton_qk_norm_rope`); the weight gradient is summed per program in fp32, then over programs.

Why a hand kernel: in the trainer, Inductor's kernels for this function (``block_fusion: regions``, dynamic
shapes) ran at a small fraction of the memory bandwidth (``bench/kernels/block_fusion_kernels.py`` times both). :func:`unsupported` says why the kernel cannot run for given inputs (None: it can); callers
fall back to the reference (or to its compiled form).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Activation dtypes the kernels take (the weight may be any of them too)."""

_alloc = torch.empty
"""Allocator of every buffer the kernels write (the tests poison it with NaN)."""

PROGRAMS_PER_SM = 8
"""Programs per streaming multiprocessor (each walks rows with a stride of the grid): enough resident warps to
keep the loads in flight, few enough partial weight-gradient rows to sum (P x D fp32)."""
ELEMENTS_PER_WARP = 512
"""A program holds one row of D channels (padded to a power of two) at a time: one warp per 512 of them (16 a
thread), so that a wider model (Wan 14B: D 5,120 -> 16 warps) keeps the row in registers. Wan 1.3B: 4 warps."""
TILES_ENV = "DS_ADAPTIVE_QK_ROPE_TILES"
"""``"PROGRAMS_PER_SM,NUM_WARPS"`` overrides the launch defaults above (``bench/kernels/block_fusion_kernels.py
--sweep`` times the alternatives)."""


def default_warps(d: int) -> int:
    """Warps per program for D channels (``ELEMENTS_PER_WARP``), 4 to 16."""
    return min(16, max(4, (1 << max(0, d - 1).bit_length()) // ELEMENTS_PER_WARP))


def tiles(d: int) -> tuple[int, int]:
    """(programs per SM, warps per program) for D channels: ``TILES_ENV`` if set, else the defaults; a malformed
    value is an error that names the variable."""
    raw = os.environ.get(TILES_ENV)
    if not raw:
        return PROGRAMS_PER_SM, default_warps(d)
    try:
        ppsm, warps = (int(v) for v in raw.split(","))
    except ValueError:
        ppsm = warps = 0
    if ppsm < 1 or warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{TILES_ENV}={raw!r}: expected 'PROGRAMS_PER_SM,NUM_WARPS' (e.g. '8,4'; warps a power of "
                         f"two <= 16); unset it for the defaults ({PROGRAMS_PER_SM},{default_warps(d)} at D {d})")
    return ppsm, warps


def _kernels():
    from ds_adaptive.ops import _triton_qk_norm_rope
    return _triton_qk_norm_rope


def interpreted() -> bool:
    """True when the kernels were built under ``TRITON_INTERPRET=1`` (they then run on CPU tensors)."""
    return type(_kernels().qk_norm_rope_fwd).__name__ == "InterpretedFunction"


def unsupported(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, freqs: torch.Tensor,
                heads: int) -> Optional[str]:
    """Why the kernel cannot run on these inputs (None: it can)."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        return f"triton does not import: {type(exc).__name__}: {exc}"
    if q.device.type != "cuda" and not interpreted():
        return f"the kernel runs on CUDA tensors (got {q.device.type})"
    if q.shape != k.shape or q.dim() != 3:
        return f"q and k must both be [B, S, D], got {list(q.shape)} and {list(k.shape)}"
    if q.dtype not in DTYPES or k.dtype != q.dtype:
        return f"q / k dtype must be one of {[str(d) for d in DTYPES]} and equal, got {q.dtype} / {k.dtype}"
    d = q.shape[-1]
    if heads < 1 or d % heads or (d // heads) % 2:
        return f"D = {d} must split into {heads} heads of an even head dim"
    if wq.shape != (d,) or wk.shape != (d,):
        return f"the RMSNorm weights must be [{d}], got {list(wq.shape)} and {list(wk.shape)}"
    if freqs.shape != (q.shape[1], d // heads // 2, 2) or freqs.dtype != torch.float32:
        return (f"freqs must be fp32 [S, Dh/2, 2] = [{q.shape[1]}, {d // heads // 2}, 2], got {freqs.dtype} "
                f"{list(freqs.shape)}")
    return None


def _launch(n: int, d: int, device: torch.device) -> tuple[int, int]:
    """(programs, warps) for N rows of D channels: one read of the launch defaults / override per kernel call."""
    ppsm, warps = tiles(d)
    if device.type != "cuda":
        return max(1, min(n, 4)), warps
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n, ppsm * sms)), warps


def _block_p(d: int) -> int:
    import triton

    return triton.next_power_of_2(d // 2)


class _NormRope(torch.autograd.Function):
    """One tensor ``x [B, S, D]`` with its weight ``w [D]`` -> ``[B, S, D]`` (norm, then rotation)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, freqs: torch.Tensor, eps: float, half_dh: int):
        x = x.contiguous()
        b, s, d = x.shape
        n = b * s
        out = _alloc(x.shape, dtype=x.dtype, device=x.device)
        rstd = _alloc((n,), dtype=torch.float32, device=x.device)
        programs, warps = _launch(n, d, x.device)
        _kernels().qk_norm_rope_fwd[(programs,)](x, w.contiguous(), freqs, out, rstd, n, s, float(eps), D=d,
                                                 HALF_DH=half_dh, BLOCK_P=_block_p(d), num_warps=warps)
        ctx.save_for_backward(x, w, freqs, rstd)
        ctx.half_dh = half_dh
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, freqs, rstd = ctx.saved_tensors
        b, s, d = x.shape
        n = b * s
        grad = grad.contiguous()
        dx = _alloc(x.shape, dtype=x.dtype, device=x.device)
        programs, warps = _launch(n, d, x.device)
        dw_part = _alloc((programs, d), dtype=torch.float32, device=x.device)
        _kernels().qk_norm_rope_bwd[(programs,)](grad, x, w.contiguous(), freqs, rstd, dx, dw_part, n, s, D=d,
                                                 HALF_DH=ctx.half_dh, BLOCK_P=_block_p(d), num_warps=warps)
        dw = dw_part.sum(0).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None


def try_triton_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                            freqs: torch.Tensor, eps: float, heads: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``wan.qk_norm_rope`` by the kernels, or None when they cannot take the inputs (:func:`unsupported`): one
    check per call, for a caller with a fallback (``models.fusion.qk_norm_rope_kernel``)."""
    if unsupported(q, k, wq, wk, freqs, heads) is not None:
        return None
    freqs = freqs.contiguous()
    half_dh = q.shape[-1] // heads // 2
    eps = torch.finfo(q.dtype).eps if eps is None else eps   # F.rms_norm's default (nn.RMSNorm(eps=None))
    return (_NormRope.apply(q, wq, freqs, eps, half_dh).unflatten(-1, (heads, -1)),
            _NormRope.apply(k, wk, freqs, eps, half_dh).unflatten(-1, (heads, -1)))


def triton_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, freqs: torch.Tensor,
                        eps: float, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``wan.qk_norm_rope`` by the kernels: q, k ``[B, S, D]`` -> ``[B, S, H, Dh]`` each (see the module).
    Raises ValueError with :func:`unsupported`'s reason when the kernel cannot take the inputs."""
    out = try_triton_qk_norm_rope(q, k, wq, wk, freqs, eps, heads)
    if out is None:
        raise ValueError(f"triton_qk_norm_rope: {unsupported(q, k, wq, wk, freqs, heads)}")
    return out
