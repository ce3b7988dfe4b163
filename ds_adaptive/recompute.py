"""Selective activation checkpointing that keeps the self-attention core (``sampler.checkpoint_attention``).

A checkpointed block normally keeps only its input and runs its whole forward again in backward. For
video DiTs the expensive part of that recomputed forward is the self-attention core: on an H200, one
Wan 1.3B block's recompute at 75,600 tokens is ~76 ms, ~58 ms of it the attention's ``b S^2`` term
(the shipped profile's ``compute.recompute``), and the core's output is small (``[S, D]``, like the
block's input). With ``keep``, the checkpoint region keeps the outputs of the fused SDPA op that
self-attention calls (output and log-sum-exp: ``2 D + 4 H`` bytes per token of the local shard in bf16)
and recomputes everything else (norms, q / k / v projections, RoPE, cross-attention, FFN), so the
attention backward gets its q, k, v from the recompute and its output from the cache: the attention
forward runs once per block instead of twice.

Mechanism: the checkpoint's ``context_fn`` gives a pair of torch dispatch modes (the idea of torch's
selective activation checkpointing, restricted to the ops it keeps). In the forward, :class:`_KeepAttention`
stores (detached) the outputs of every fused SDPA op that runs while a block's *self*-attention core runs
(:func:`self_attention_core`, entered by the block around its ``attn_fn`` call; the cross-attention's SDPA,
linear in S, is recomputed). In the recompute, :class:`_ReuseAttention` answers the same calls, in the same
order, from that store instead of running them; autograd records the op's backward with the recomputed
q, k, v and the kept output and log-sum-exp, exactly as for a first forward. Every other op runs in both
passes untouched, and nothing else is counted: torch's own selective checkpointing
(``create_selective_checkpoint_contexts``) requires the recompute to issue every op the same number of times
as the forward, which ZeRO-3's parameter gathers inside a block (prefetched in the forward, fetched in the
recompute) do not (a CPU run with 2 ranks failed with "aten.cat.out invocation index 11 encountered during
backward but not found in storage"). The rule is per op, so it holds for every attention path that ends in a
fused SDPA op: plain SDPA, Ulysses (the local attention inside DeepSpeed's ``DistributedAttention``; its
all-to-alls run again in the recompute), the dense layers of a sparse run. Paths that do not (the
block-sparse Triton kernel, an SDPA math fallback with a mask) are recomputed as before; the cost model
(``CostModel.ckpt_cost``) counts exactly that: the dense layers' recomputed quadratic part goes, a sparse
layer's (``r_l`` of it) stays. The two modes see every op of a checkpointed block (a Python call each, a few
microseconds): host time that a GPU-bound step hides.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Iterator

__all__ = ["CHECKPOINT_ATTENTION_MODES", "kept_attention_ops", "kept_attention_bytes_per_token",
           "keep_attention_context", "self_attention_core"]

#: ``sampler.checkpoint_attention``: ``recompute`` (the whole block again, the default) or ``keep``
CHECKPOINT_ATTENTION_MODES = ("recompute", "keep")

#: the fused SDPA ops whose outputs a checkpointed block keeps (CUDA: cuDNN, flash, memory-efficient; CPU: flash)
_KEPT_OP_NAMES = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")

_state = threading.local()


@functools.lru_cache(maxsize=None)
def kept_attention_ops() -> frozenset:
    """The aten overloads of ``_KEPT_OP_NAMES`` this torch has (torch is imported here, not at module
    import: the planner reads this module's constants without torch)."""
    import torch

    aten = torch.ops.aten
    return frozenset(getattr(aten, n).default for n in _KEPT_OP_NAMES if hasattr(aten, n))


def kept_attention_bytes_per_token(dim: int, num_heads: int, act_bytes: int = 2) -> int:
    """Bytes a checkpointed block keeps in addition to its input, per token of the local shard: the
    attention output (``dim`` values in the activation dtype) and its log-sum-exp (fp32 per head). Under
    Ulysses a rank holds all S tokens of H / sp heads, the same bytes as S / sp tokens of all heads."""
    return int(dim) * int(act_bytes) + 4 * int(num_heads)


@contextlib.contextmanager
def self_attention_core() -> Iterator[None]:
    """Marks the self-attention core's call (the block wraps ``attn_fn(q, k, v)`` in it): the fused SDPA
    ops that run inside are the ones a ``keep`` checkpoint keeps. Cheap: a thread-local counter."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _in_self_attention() -> bool:
    return getattr(_state, "depth", 0) > 0


def _detached(out):
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)


def _dispatch_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


class _KeptStore:
    """The kept outputs of one checkpointed call, in call order (freed as the recompute takes them)."""

    def __init__(self) -> None:
        self.outputs: list = []
        self.taken = 0


@functools.lru_cache(maxsize=None)
def _modes() -> tuple:
    """(forward mode class, recompute mode class): built on first use, so that importing this module needs no torch."""
    class _StoreMode(_dispatch_mode()):
        def __init__(self, store: _KeptStore) -> None:
            super().__init__()
            self.store = store

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True   # compiled block pieces (block_fusion) run as they are

    class _KeepAttention(_StoreMode):
        """Forward of a checkpointed block: runs every op, keeps the self-attention core's SDPA outputs."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in kept_attention_ops() and _in_self_attention():
                self.store.outputs.append(_detached(out))
            return out

    class _ReuseAttention(_StoreMode):
        """Recompute of a checkpointed block: the self-attention core's SDPA calls take the kept outputs."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in kept_attention_ops() and _in_self_attention():
                st = self.store
                if st.taken >= len(st.outputs):
                    raise RuntimeError(
                        f"checkpoint_attention keep: the recompute of a checkpointed block called its self-attention "
                        f"core {st.taken + 1} time(s), its forward {len(st.outputs)}: the block's forward must make "
                        "the same attention calls both times (set adaptive_load.sampler.checkpoint_attention to "
                        "'recompute' for a model that does not)")
                out, st.outputs[st.taken] = st.outputs[st.taken], None
                st.taken += 1
                return out
            return func(*args, **(kwargs or {}))

    return _KeepAttention, _ReuseAttention


def _contexts():
    keep, reuse = _modes()
    store = _KeptStore()
    return keep(store), reuse(store)


def keep_attention_context() -> Callable:
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` that keeps
    the self-attention core's SDPA outputs (module docstring): a fresh (forward, recompute) mode pair per call."""
    return _contexts
