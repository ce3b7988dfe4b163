"""The ``flex`` backend: compiled FlexAttention block-sparse attention, one graph for every shape.

The selected blocks are passed as *full* blocks (no mask_mod runs on them), so the kernel does only
the QK^T / PV tiles it must. S is padded to whole blocks (the kernel's divisible path; a
``torch._check`` tells Inductor that the padded length is a multiple of the block) and the ragged
last key block, where selected, is the one partial block, masked by ``key < S`` with S a 0-dim
device tensor captured by the mask_mod.

No compile per shape: the op is compiled with ``dynamic=True`` (B and S symbolic), and nothing in
what it captures changes with the shape (the length lives in a tensor, not in a Python int or a
new function). Dynamo still specialises a size of 1, so a run compiles one graph for B == 1 and one
for B >= 2 (per dtype, head count, kernel-options bucket, and training vs a forward without
autograd); :meth:`FlexBackend.warmup` compiles the ones the plan needs before step 1. A graph
counter (a counting Inductor backend) and dynamo's ``fail_on_recompile_limit_hit`` with the limit at
``max_graphs`` make a recompile storm an error (:class:`SparseKernelError`), never a silent fallback
to flex's unfused path that materialises S x S.
"""
from __future__ import annotations

import functools
import math
import threading
import time
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from ds_adaptive.attention.attention import SparseKernelError, check_qkv, split_valid, transpose_blocks
from ds_adaptive.attention.backends.base import BackendSupport, SparseAttentionBackend
from ds_adaptive.attention.backends.registry import register_backend
from ds_adaptive.attention.selection import BlockSelection
from ds_adaptive.attention.kernel_options import options_for
from ds_adaptive.attention.backends.measure import random_selection
from ds_adaptive.core.contracts import KernelEfficiency

__all__ = ["FlexBackend", "block_mask_from_selection", "compiled_graphs", "flex_block_sparse_attention",
           "transpose_blocks", "DEFAULT_MAX_GRAPHS"]

DEFAULT_MAX_GRAPHS = 8
"""Compiled graphs allowed per process (expected: 2 per dtype / heads / options bucket / mode)."""

SHIPPED_CURVES = {
    # g(rho) = flex fwd+bwd / cuDNN SDPA fwd+bwd, bf16, head dim 128, 128-token blocks, compiled with dynamic
    # shapes (this backend), the worst over S 32,760 / 75,600 x H 12 / 40: H200, bench/kernels/sparse_backends.py at
    # 6eceb6a (bench/results/sparse/sparse_backends_h200_6eceb6a/). H100: the static-shape anchors of DSV.md (S 32,768,
    # 12 heads) x 1.22, the dynamic / static ratio measured on the H200 (no H100 measurement of this backend).
    "H200": ((0.05, 0.1, 0.2, 0.4), (0.1271, 0.2093, 0.3731, 0.6938)),
    "H100": ((0.05, 0.1, 0.2, 0.4), tuple(1.22 * ms / 40.3 for ms in (3.1, 5.9, 11.4, 22.2))),
}
"""Shipped curves by GPU name substring (a measurement in the cache of this GPU + torch wins)."""

_lock = threading.Lock()
_compiled: dict = {}
_graphs = {"count": 0, "compile_s": 0.0}


def _counting_inductor(gm, example_inputs):
    """Inductor, counting the graphs dynamo hands it (one per compile or recompile of the op)."""
    from torch._inductor.compile_fx import compile_fx

    t0 = time.perf_counter()
    _graphs["count"] += 1
    out = compile_fx(gm, example_inputs)
    _graphs["compile_s"] += time.perf_counter() - t0
    return out


def compiled_graphs() -> int:
    """Graphs compiled for the flex op in this process (forward compiles; a backward is compiled
    lazily with its forward's graph and does not count again)."""
    return _graphs["count"]


def _compiled_flex(block: Optional[int], max_graphs: int):
    """The compiled op for padded lengths that are multiples of ``block`` (None: any length)."""
    import torch._dynamo

    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, max_graphs)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, max_graphs + 64)
    fn = _compiled.get(block)
    if fn is None:
        from torch.nn.attention.flex_attention import flex_attention

        def flex_op(q, k, v, block_mask, kernel_options):
            if block is not None:  # whole blocks: lets Inductor keep its divisible (unmasked) path
                torch._check(q.size(2) % block == 0)
            return flex_attention(q, k, v, block_mask=block_mask, kernel_options=kernel_options)

        fn = _compiled[block] = torch.compile(flex_op, backend=_counting_inductor, dynamic=True, fullgraph=True)
    return fn


@functools.lru_cache(maxsize=512)
def _length(seq_len: int, device: torch.device) -> torch.Tensor:
    """The sequence length as a 0-dim int64 device tensor (made by a fill kernel: no host copy)."""
    return torch.full((), seq_len, dtype=torch.int64, device=device)


def _keys_below(length: torch.Tensor):
    """mask_mod of the ragged last key block: ``key < length`` (a tensor: one graph for every S)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < length
    return mask_mod


def block_mask_from_selection(selection: BlockSelection, *, pad_to_block: bool = True, with_q: bool = True):
    """FlexAttention ``BlockMask`` with the selected blocks as full blocks, built directly (no
    ``from_kv_blocks``): the kv side is the selection's own index rows widened to nk (a fixed width,
    so the compiled kernel does not depend on k), the q side (backward only) from
    :func:`transpose_blocks`.

    ``pad_to_block`` and S not a multiple of the block: the mask is for S rounded up to whole
    blocks (:func:`flex_block_sparse_attention` zero-pads q, k, v), so the kernel runs its
    divisible-length path; the ragged last key block, where selected, becomes the one partial
    block (``mask_mod``: key < S, S a device tensor). Otherwise every block is full and flex masks
    the tail itself. Every mask carries the same mask_mod code and the same partial-list tensors
    (zero where S is whole blocks), so ragged and whole-block lengths share one compiled graph.
    ``with_q=False``: no q-side lists (enough for a forward without autograd, e.g. evaluation; a
    non-reentrant checkpoint's first pass runs with autograd on and must save what its recompute
    saves, so it gets the q side too).
    """
    from torch.nn.attention.flex_attention import BlockMask
    s, bs, n = selection.seq_len, selection.block_size, selection.num_blocks
    kv_num = selection.kv_num.to(torch.int32)
    idx = selection.flex_indices()
    ragged = pad_to_block and s % bs != 0
    # every index tensor is nk wide, as from_kv_blocks makes them: a one-column partial kv list gave
    # wrong outputs on the GPU (torch 2.11, B=2, ragged S; commit 50dfe55)
    if ragged:  # selected indices are ascending: the last block, if selected, sits at kv_num - 1
        pos = (kv_num.long() - 1).clamp_min(0).unsqueeze(-1)
        has_last = ((idx.gather(-1, pos).squeeze(-1) == n - 1) & (kv_num > 0)).to(torch.int32)
        part_num, part_idx = has_last, torch.full_like(idx, n - 1)
        full_num = kv_num - has_last
    else:
        part_num, part_idx = torch.zeros_like(kv_num), torch.zeros_like(idx)
        full_num = kv_num
    q_args = dict(q_num_blocks=None, q_indices=None, full_q_num_blocks=None, full_q_indices=None)
    if with_q:
        # one transpose of all selected blocks; the ragged last key block's row is the partial set,
        # the other rows the full sets (the partial list is its own tensor: no aliased kernel inputs)
        q_num, q_idx = transpose_blocks(kv_num, idx, n)
        zero = torch.zeros_like(q_num)
        if ragged:
            q_part = torch.cat([zero[..., :-1], q_num[..., -1:]], -1)
            q_full = torch.cat([q_num[..., :-1], zero[..., -1:]], -1)
            q_part_idx = q_idx.clone()
        else:
            q_part, q_full = zero, q_num
            q_part_idx = torch.zeros_like(q_idx)
        q_args = dict(q_num_blocks=q_part, q_indices=q_part_idx, full_q_num_blocks=q_full, full_q_indices=q_idx)
    length = n * bs if pad_to_block else s
    return BlockMask(seq_lengths=(length, length), kv_num_blocks=part_num, kv_indices=part_idx,
                     full_kv_num_blocks=full_num, full_kv_indices=idx, BLOCK_SIZE=(bs, bs),
                     mask_mod=_keys_below(_length(s, kv_num.device)), **q_args)


def flex_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, *,
                                valid_len: Optional[int] = None, max_graphs: int = DEFAULT_MAX_GRAPHS,
                                block_mask=None, pad_to_block: bool = True, kernel_options: Optional[dict] = None,
                                density: Optional[float] = None) -> torch.Tensor:
    """Block-sparse attention by compiled FlexAttention; see the module docstring.

    q, k, v ``[B, S, H, Dh]``, ``selection`` over S; returns ``[B, S, H, Dh]`` (padded query rows
    past ``valid_len`` 0). ``block_mask``: a prebuilt :func:`block_mask_from_selection` of the
    (valid-length) selection with the same ``pad_to_block`` (built here otherwise, with the q side
    only when autograd needs it). ``kernel_options``: passed to flex_attention (tile sizes, warps,
    stages); None: the measured table of :mod:`ds_adaptive.attention.kernel_options` for ``density``
    (the selection's share of key blocks, known on the host), torch's defaults where ``density`` is
    None or no entry fits. ``max_graphs``: one more compiled graph than this is an error.
    """
    if kernel_options is None and density is not None:
        kernel_options = options_for(density, head_dim=q.shape[-1], dtype=q.dtype, device=q.device)
    check_qkv(q, k, v, selection)
    q, k, v, sel, pad = split_valid(q, k, v, selection, valid_len)
    s, bs = q.shape[1], sel.block_size
    tail = (-s) % bs if pad_to_block else 0
    if tail:  # whole blocks: the kernel's divisible path (the padded keys are masked in the last block)
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, tail)) for t in (q, k, v))
    elif pad:  # a valid_len slice of B > 1 samples is not contiguous: one stride pattern, one graph
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    with _lock:
        fn = _compiled_flex(bs if pad_to_block else None, max_graphs)
        before = _graphs["count"]
    if before > max_graphs:
        raise SparseKernelError(_too_many(before, max_graphs, q))
    if block_mask is None:
        need_q = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        block_mask = block_mask_from_selection(sel, pad_to_block=pad_to_block, with_q=need_q)
    import torch._dynamo as dynamo  # (a plain `import torch._dynamo` would make `torch` local here)
    try:
        with dynamo.config.patch(fail_on_recompile_limit_hit=True):
            out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask,
                     kernel_options).transpose(1, 2)
    except Exception as exc:  # dynamo's recompile-limit error: say what it means here
        if "recompile" in str(exc).lower() and "limit" in str(exc).lower():
            raise SparseKernelError(_too_many(_graphs["count"], max_graphs, q)) from exc
        raise
    if _graphs["count"] > max_graphs:
        raise SparseKernelError(_too_many(_graphs["count"], max_graphs, q))
    if tail:
        out = out[:, :s]
    return F.pad(out, (0, 0, 0, 0, 0, pad)) if pad else out


def _too_many(n: int, limit: int, q: torch.Tensor) -> str:
    return (f"flex block-sparse attention has compiled {n} graphs (adaptive_load.sparse_attention."
            f"max_compiled_graphs = {limit}; expected 2 per dtype / head count / kernel-options bucket / "
            f"training or evaluation, whatever B and S); shape (B, S, H, Dh) = {tuple(q.shape)} needed another. "
            "Something makes the op shape-specific: report it, or raise max_compiled_graphs")


# ------------------------------------------------------------------------------------- backend
def _graph_class(batch: int, seq_len: int, block: int) -> tuple:
    """What dynamo specialises on: sizes of 1 (B, and the block count of a sequence of one block)."""
    return batch == 1, math.ceil(seq_len / block) == 1


@register_backend
class FlexBackend(SparseAttentionBackend):
    """Compiled FlexAttention (torch >= 2.5), CUDA fwd+bwd; CPU forward only (tests)."""

    name = "flex"
    support = BackendSupport(
        device_types=("cuda", "cpu"), backward_device_types=("cuda",),
        dtypes=(torch.bfloat16, torch.float16, torch.float32), block_sizes=(128,),
        head_dims=(16, 32, 64, 128, 256), min_capability=(8, 0), runtime_shapes=True,
        notes="compiled FlexAttention, selected blocks as full blocks; one graph per B == 1 / B >= 2")

    def __init__(self) -> None:
        self.max_graphs = DEFAULT_MAX_GRAPHS
        self._warm: set = set()
        self._warmup_s = 0.0

    def attention(self, q, k, v, selection, *, valid_len=None, density=None):
        return flex_block_sparse_attention(q, k, v, selection, valid_len=valid_len, max_graphs=self.max_graphs,
                                           density=density)

    def warmup(self, shapes: Sequence[tuple[int, int]], *, num_heads: int, head_dim: int, dtype: torch.dtype,
               device: Any, block_size: int, backward: bool = True) -> float:
        """Per graph class of ``shapes`` (B == 1 or not; one-block sequences), at the class's shortest S
        and a 10% random selection: fwd+bwd, plain and under a non-reentrant activation checkpoint (as
        the trainer runs it), or a forward without autograd; classes already warm cost nothing."""
        from torch.utils.checkpoint import checkpoint


        dev = torch.device(device)
        todo: dict = {}
        for b, s in shapes:
            key = (_graph_class(int(b), int(s), block_size), num_heads, head_dim, dtype, dev, block_size, backward)
            if key not in self._warm and (key not in todo or s < todo[key][1]):
                todo[key] = (int(b), int(s))
        t0 = time.perf_counter()
        for key, (b, s) in todo.items():
            q, k, v = (torch.randn(b, s, num_heads, head_dim, device=dev, dtype=dtype) for _ in range(3))
            sel = random_selection(b, num_heads, s, block_size, 0.1, device=dev)
            fn = lambda q_, k_, v_: self.attention(q_, k_, v_, sel, density=0.1)  # noqa: E731
            if backward:
                for t in (q, k, v):
                    t.requires_grad_()
                fn(q, k, v).float().sum().backward()
                # as the trainer runs it: a non-reentrant checkpoint's first pass (saved-tensor hooks on)
                # and its recompute inside the backward
                checkpoint(fn, q, k, v, use_reentrant=False).float().sum().backward()
            else:
                with torch.no_grad():
                    fn(q, k, v)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            self._warm.add(key)
        spent = time.perf_counter() - t0
        self._warmup_s += spent
        return spent

    def shipped_efficiency(self, device, *, dtype, head_dim, block_size):
        dev = torch.device(device)
        gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" and torch.cuda.is_available() else ""
        for tag, (dens, ratio) in SHIPPED_CURVES.items():
            if tag in gpu and dtype == torch.bfloat16 and head_dim == 128 and block_size == 128:
                return KernelEfficiency(dens, ratio, source=f"flex, shipped {tag} curve (see SHIPPED_CURVES)")
        return KernelEfficiency.default()

    def stats(self) -> dict:
        return {"warmup_s": self._warmup_s, "graphs": compiled_graphs(), "compile_s": _graphs["compile_s"],
                "max_graphs": self.max_graphs}
