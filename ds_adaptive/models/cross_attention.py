"""Cross-attention of a long token sequence to a short text context, with the queries split into chunks.

A DiT block's cross-attention has S video tokens attend to L = 512 text tokens. Flash-style backward kernels
(cuDNN's, which torch picks on Hopper) give each thread block one (sample, head, block of 128 keys) and walk
every query block in turn: 512 keys make 4 key blocks, so one sample of Wan 1.3B (12 heads) gives 48 thread
blocks to a GPU with 132 SMs, and the backward runs far slower than its FLOPs need
(``bench/kernels/attention_backends.py``). Splitting the S queries into ``n`` chunks, each a batch
entry with its own copy of the (small) keys and values, gives ``n`` times the thread blocks; the result is the
same attention (every query still sees all L keys), and the keys' and values' gradients are summed over the
chunks by autograd. It speeds up a long sample's cross-attention; in a whole training step, where the
cross-attention is a small part of the attention, the gain is small (docs/RESULTS.md).

``query_chunks`` picks ``n``: on CUDA, up to the count that gives ~2 thread blocks per SM, held to chunks of at
least ``MIN_CHUNK_TOKENS`` queries and to a divisor of S (a view, no padding); 1 (no split) on other devices,
where the samples and heads already fill the GPU (an image micro-batch) and where nothing divides.
``DS_ADAPTIVE_CROSS_ATTN_CHUNKS`` = ``auto`` (the default) or a positive integer (``1``: off; ``n``: the largest
divisor of S up to n) overrides it, for A/B runs.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

ENV = "DS_ADAPTIVE_CROSS_ATTN_CHUNKS"
#: the queries of one chunk, at least: smaller chunks measured slower on short batched samples; from this size up
#: the split was as fast or faster everywhere measured
MIN_CHUNK_TOKENS = 4096
#: the key-block size of the backward kernels the policy counts thread blocks for
KEY_BLOCK = 128
#: thread blocks wanted per SM
BLOCKS_PER_SM = 2


@functools.lru_cache(maxsize=None)
def _setting(text: str) -> int:
    """0 for ``auto``, else the positive chunk cap; a bad value is one line naming the variable."""
    if text.strip().lower() == "auto":
        return 0
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV}={text!r}: expected 'auto' or a positive integer (1 = no split); unset it for the "
                         "default policy")
    return n


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _largest_divisor(seq: int, cap: int) -> int:
    for n in range(min(cap, seq), 1, -1):
        if seq % n == 0:
            return n
    return 1


def query_chunks(batch: int, seq: int, heads: int, keys: int, device: torch.device) -> int:
    """How many chunks to split ``seq`` queries into (1: none); see the module doc."""
    cap = _setting(os.environ.get(ENV, "auto"))
    if cap:
        return _largest_divisor(seq, cap)
    if device.type != "cuda":
        return 1
    blocks = batch * heads * math.ceil(keys / KEY_BLOCK)
    want = math.ceil(BLOCKS_PER_SM * _sm_count(device.index if device.index is not None else
                                                torch.cuda.current_device()) / blocks)
    return _largest_divisor(seq, min(want, seq // MIN_CHUNK_TOKENS)) if want > 1 else 1


def cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: int | None = None) -> torch.Tensor:
    """SDPA of ``q [B, S, H, Dh]`` over all of ``k``, ``v [B, L, H, Dh]`` -> ``[B, S, H, Dh]``, the queries split
    into ``chunks`` (None: :func:`query_chunks`; it must divide S)."""
    b, s, h = q.shape[:3]
    n = query_chunks(b, s, h, k.shape[1], q.device) if chunks is None else int(chunks)
    if n > 1:
        if s % n:
            raise ValueError(f"cross_attention: {n} chunks do not divide {s} queries")
        q = q.reshape(b * n, s // n, *q.shape[2:])
        k, v = (t.unsqueeze(1).expand(b, n, *t.shape[1:]).reshape(b * n, *t.shape[1:]) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    return out.reshape(b, s, *out.shape[2:])
