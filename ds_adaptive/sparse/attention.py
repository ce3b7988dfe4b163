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


def transpose_blocks(kv_num: torch.Tensor, kv_idx: torch.Tensor, num_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The transposed block lists: for each key block, the query blocks that selected it.

    kv_num ``[B, H, nq]``, kv_idx ``[B, H, nq, w]`` (first ``kv_num`` entries valid, any order) ->
    ``(q_num [B, H, num_cols] int32, q_idx [B, H, num_cols, nq] int32)``, query blocks ascending,
    entries past ``q_num`` 0. A handful of vectorised kernels, no host sync (a bool scatter, an int32
    cumsum, one scatter of the positions), unlike ``BlockMask.from_kv_blocks``' vmapped dense
    transpose and argsort.
    """
    b, h, nq, w = kv_idx.shape
    valid = torch.arange(w, device=kv_idx.device) < kv_num.unsqueeze(-1)
    dense = torch.zeros(b, h, nq, num_cols + 1, dtype=torch.bool, device=kv_idx.device)
    dense.scatter_(-1, torch.where(valid, kv_idx.long(), num_cols), True)
    dense_t = dense[..., :num_cols].transpose(-1, -2)  # [B, H, nk, nq] view
    pos = dense_t.cumsum(-1, dtype=torch.int32)
    q_num = pos[..., -1].contiguous()
    q_idx = torch.zeros(b, h, num_cols, nq + 1, dtype=torch.int32, device=kv_idx.device)
    rows = torch.arange(nq, dtype=torch.int32, device=kv_idx.device).expand(b, h, num_cols, nq)
    q_idx.scatter_(-1, torch.where(dense_t, pos - 1, nq).long(), rows)
    return q_num, q_idx[..., :nq].contiguous()


def block_mask_from_selection(selection: BlockSelection, *, pad_to_block: bool = True, with_q: bool = True):
    """FlexAttention ``BlockMask`` with the selected blocks as full blocks, built directly (no
    ``from_kv_blocks``): the kv side is the selection's own index rows widened to nk (a fixed width,
    so the compiled kernel does not depend on k), the q side (backward only) from
    :func:`transpose_blocks`.

    ``pad_to_block`` and S not a multiple of the block: the mask is for S rounded up to whole
    blocks (:func:`flex_block_sparse_attention` zero-pads q, k, v), so the kernel runs its
    divisible-length path; the ragged last key block, where selected, becomes the one partial
    block (``mask_mod``: key < S). Otherwise every block is full and flex masks the tail itself.
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
    # wrong outputs on the GPU (torch 2.11, B=2, ragged S; bench/results/ at 50dfe55)
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
    length = n * bs if ragged else s
    return BlockMask(seq_lengths=(length, length), kv_num_blocks=part_num, kv_indices=part_idx,
                     full_kv_num_blocks=full_num, full_kv_indices=idx, BLOCK_SIZE=(bs, bs),
                     mask_mod=_keys_below(s) if ragged else _noop_mask(), **q_args)


def _noop_mask():
    from torch.nn.attention.flex_attention import noop_mask
    return noop_mask


def flex_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, *,
                                valid_len: Optional[int] = None, max_shapes: int = 64, block_mask=None,
                                pad_to_block: bool = True, kernel_options: Optional[dict] = None,
                                density: Optional[float] = None) -> torch.Tensor:
    """Block-sparse attention by compiled FlexAttention (CUDA); see the module docstring.

    ``block_mask``: a prebuilt :func:`block_mask_from_selection` of the (valid-length) selection with
    the same ``pad_to_block`` (built here otherwise, with the q side only when autograd needs it).
    ``kernel_options``: passed to flex_attention (tile sizes, warps, stages); None: the measured
    table of :mod:`ds_adaptive.sparse.kernel_options` for ``density`` (the selection's share of
    key blocks, known on the host), torch's defaults where ``density`` is None or no entry fits.
    """
    if kernel_options is None and density is not None:
        from ds_adaptive.sparse.kernel_options import options_for
        kernel_options = options_for(density, head_dim=q.shape[-1], dtype=q.dtype, device=q.device)
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
    if block_mask is None:
        need_q = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        block_mask = block_mask_from_selection(sel, pad_to_block=pad_to_block, with_q=need_q)
    import torch._dynamo as dynamo  # (a plain `import torch._dynamo` would make `torch` local here)
    with dynamo.config.patch(fail_on_recompile_limit_hit=True):
        out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                 kernel_options=kernel_options).transpose(1, 2)
    if tail:
        out = out[:, :s]
    return F.pad(out, (0, 0, 0, 0, 0, pad)) if pad else out


def compiled_shapes() -> int:
    """Shape buckets the flex kernel has been compiled for in this process."""
    return len(_shapes)
