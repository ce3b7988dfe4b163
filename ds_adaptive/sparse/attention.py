"""The block-sparse self-attention op (forward + backward) and its masked dense reference.

All functions take ``q, k, v`` ``[B, S, H, Dh]`` (the model's attention-fn layout) and a
:class:`~ds_adaptive.sparse.selection.BlockSelection` over blocks of consecutive tokens, and
return ``[B, S, H, Dh]``. ``valid_len``: positions >= valid_len are padding (Ulysses pads S to a
multiple of the SP degree): like ``parallel.ulysses.valid_len_attention`` the real tokens are
attended among themselves and padded query rows give 0.

* :func:`flex_block_sparse_attention`: compiled FlexAttention with the selected blocks passed as
  *full* blocks (no mask_mod runs, so the kernel does only the QK^T / PV tiles it must). One
  compiled kernel per shape bucket; the recompile limit is raised to ``max_shapes`` and every call
  runs with ``fail_on_recompile_limit_hit``, and a registry of compiled shapes errors out before
  that, so the op never silently drops to flex's unfused path that materialises S x S.
* :func:`masked_attention_reference`: plain torch on the token-level mask (S^2 memory), the
  reference of the tests and the CPU path.
* :func:`dense_attention`: SDPA (cuDNN / flash), used when a layer's density is above break-even.
"""
from __future__ import annotations

import functools
import math
import threading
from typing import Optional

import torch
import torch.nn.functional as F

from ds_adaptive.sparse.selection import BlockSelection

REFERENCE_MAX_TOKENS = 16384
"""The masked reference materialises [B, H, S, S]: refuse longer sequences (use the flex backend)."""


class SparseKernelError(RuntimeError):
    """The block-sparse kernel cannot run as configured (shape budget, device, fallback guard)."""


def truncate_selection(selection: BlockSelection, valid_len: int) -> BlockSelection:
    """The selection restricted to the first ``valid_len`` tokens (blocks past them dropped)."""
    n = math.ceil(valid_len / selection.block_size)
    if n == selection.num_blocks:
        return BlockSelection(selection.kv_num, selection.kv_idx, selection.block_size, valid_len)
    dense = selection.dense_block_mask()[..., :n, :n]
    dense.diagonal(dim1=-2, dim2=-1).fill_(True)  # a row whose blocks were all padding keeps its own
    return BlockSelection.from_dense(dense, selection.block_size, valid_len)


def _split_valid(q, k, v, selection, valid_len):
    s = q.shape[1]
    if valid_len is None or valid_len >= s:
        return q, k, v, selection, 0
    if valid_len < 1:
        raise ValueError(f"valid_len must be >= 1, got {valid_len}")
    return q[:, :valid_len], k[:, :valid_len], v[:, :valid_len], truncate_selection(selection, valid_len), s - valid_len


def _check(q, k, v, selection: BlockSelection) -> None:
    b, s, h, _ = q.shape
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k, v must be [B, S, H, Dh] alike, got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if selection.seq_len != s or tuple(selection.kv_num.shape) != (b, h, math.ceil(s / selection.block_size)):
        raise ValueError(f"selection is for {tuple(selection.kv_num.shape)} (B, H, blocks) over {selection.seq_len} "
                         f"tokens, q is {list(q.shape)} with block {selection.block_size}")


def masked_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, *,
                               valid_len: Optional[int] = None) -> torch.Tensor:
    """Masked dense attention in q's dtype (fp32 softmax for 16-bit inputs); differentiable."""
    _check(q, k, v, selection)
    q, k, v, sel, pad = _split_valid(q, k, v, selection, valid_len)
    s = q.shape[1]
    if s > REFERENCE_MAX_TOKENS:
        raise SparseKernelError(
            f"the masked reference would materialise {s}x{s} scores per head; use "
            "adaptive_load.sparse_attention.backend 'flex' on a GPU (limit REFERENCE_MAX_TOKENS = "
            f"{REFERENCE_MAX_TOKENS})")
    mask = sel.token_mask()  # [B, H, S, S]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = torch.matmul(qt.to(work), kt.to(work).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.matmul(p, vt.to(work)).to(q.dtype).transpose(1, 2)
    return F.pad(out, (0, 0, 0, 0, 0, pad)) if pad else out


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    valid_len: Optional[int] = None) -> torch.Tensor:
    """SDPA on the real tokens (cuDNN / flash on CUDA), padded query rows 0."""
    s = q.shape[1]
    if valid_len is not None and valid_len < s:
        q, k, v = q[:, :valid_len], k[:, :valid_len], v[:, :valid_len]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    return F.pad(out, (0, 0, 0, 0, 0, s - q.shape[1])) if q.shape[1] < s else out


# ------------------------------------------------------------------------------------- flex
_lock = threading.Lock()
_compiled = None
_shapes: set = set()


def _flex(max_shapes: int):
    global _compiled
    import torch._dynamo
    cfg = torch._dynamo.config
    # one compile per shape bucket: room for all of them, and an error (not eager) past it
    cfg.recompile_limit = max(cfg.recompile_limit, max_shapes + 8)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, max_shapes + 64)
    if _compiled is None:
        from torch.nn.attention.flex_attention import flex_attention
        _compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _compiled


@functools.lru_cache(maxsize=256)
def _keys_below(seq_len: int):
    """mask_mod of the ragged last key block (one function object per length: no recompiles)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < seq_len
    return mask_mod


def block_mask_from_selection(selection: BlockSelection, *, pad_to_block: bool = True):
    """FlexAttention ``BlockMask`` with the selected blocks as full blocks.

    ``pad_to_block`` and S not a multiple of the block: the mask is for S rounded up to whole
    blocks (:func:`flex_block_sparse_attention` zero-pads q, k, v), so the kernel runs its
    divisible-length path; the ragged last key block, where selected, becomes the one partial
    block (``mask_mod``: key < S). Otherwise every block is full and flex masks the tail itself.
    """
    from torch.nn.attention.flex_attention import BlockMask
    s, bs, n = selection.seq_len, selection.block_size, selection.num_blocks
    idx = selection.flex_indices()
    if not pad_to_block or s % bs == 0:
        return BlockMask.from_kv_blocks(torch.zeros_like(selection.kv_num), torch.zeros_like(idx),
                                        selection.kv_num, idx, BLOCK_SIZE=bs, seq_lengths=(s, s))
    # selected indices are ascending, so the last block, if selected, sits at position kv_num - 1
    pos = (selection.kv_num.long() - 1).clamp_min(0).unsqueeze(-1)
    has_last = ((selection.kv_idx.gather(-1, pos).squeeze(-1) == n - 1) & (selection.kv_num > 0)).to(torch.int32)
    return BlockMask.from_kv_blocks(has_last, torch.full_like(idx, n - 1), selection.kv_num - has_last, idx,
                                    BLOCK_SIZE=bs, mask_mod=_keys_below(s), seq_lengths=(n * bs, n * bs))


def flex_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, *,
                                valid_len: Optional[int] = None, max_shapes: int = 64, block_mask=None,
                                pad_to_block: bool = True, kernel_options: Optional[dict] = None) -> torch.Tensor:
    """Block-sparse attention by compiled FlexAttention (CUDA); see the module docstring.

    ``block_mask``: a prebuilt :func:`block_mask_from_selection` of the (valid-length) selection with
    the same ``pad_to_block``, e.g. cached by the caller for the activation-checkpointing recompute.
    ``kernel_options``: passed to flex_attention (tile sizes, warps, stages).
    """
    _check(q, k, v, selection)
    if not q.is_cuda:
        raise SparseKernelError("the flex block-sparse kernel needs CUDA tensors; use backend 'reference' on CPU")
    q, k, v, sel, pad = _split_valid(q, k, v, selection, valid_len)
    s, bs = q.shape[1], sel.block_size
    tail = (-s) % bs if pad_to_block else 0
    if tail:  # whole blocks: the kernel's divisible path (the padded keys are masked in the last block)
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, tail)) for t in (q, k, v))
    key = (q.shape[0], q.shape[2], q.shape[1], q.shape[3], v.shape[3], q.dtype, bs, q.device.index,
           tuple(sorted((kernel_options or {}).items())))
    with _lock:
        fn = _flex(max_shapes)
        if key not in _shapes:
            if len(_shapes) >= max_shapes:
                raise SparseKernelError(
                    f"flex block-sparse attention is already compiled for {len(_shapes)} shapes "
                    f"(adaptive_load.sparse_attention.max_compiled_shapes = {max_shapes}); shape (B, H, S, Dh) = "
                    f"{key[:4]} would need one more compile. Raise max_compiled_shapes or bucket the shapes")
            _shapes.add(key)
    bm = block_mask if block_mask is not None else block_mask_from_selection(sel, pad_to_block=pad_to_block)
    import torch._dynamo
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm,
                 kernel_options=kernel_options).transpose(1, 2)
    if tail:
        out = out[:, :s]
    return F.pad(out, (0, 0, 0, 0, 0, pad)) if pad else out


def compiled_shapes() -> int:
    """Shape buckets the flex kernel has been compiled for in this process."""
    return len(_shapes)
