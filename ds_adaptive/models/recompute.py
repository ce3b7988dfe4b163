"""Selective activation checkpointing that keeps the self-attention core (``recompute.attention``).

A checkpointed block normally keeps only its input and runs its whole forward again in backward. For
video DiTs the expensive part of that recomputed forward is the self-attention core (at long sequences most of a
block's recompute is the attention's ``b S^2`` term, the profile's ``compute.recompute``), and the core's output is small (``[S, D]``, like the
block's input). With ``keep``, the checkpoint region keeps the outputs of the fused SDPA op that
self-attention calls (output and log-sum-exp: ``2 D + 4 H`` bytes per token of the local shard in bf16)
and recomputes everything else (norms, q / k / v projections, RoPE, cross-attention, FFN), so the
attention backward gets its q, k, v from the recompute and its output from the cache: the attention
forward runs once per block instead of twice.

Mechanism: the checkpoint's ``context_fn`` gives a pair of pass markers (:class:`_Phase`, ``keep`` for the
forward, ``reuse`` for the recompute) over one store; they only mark the pass (thread-local). The block enters
:func:`self_attention_core` around its ``attn_fn`` call, and only there a torch dispatch mode runs: in the
forward it stores (detached) the outputs of every fused SDPA op the core calls; in the recompute it answers the
same calls, in the same order, from that store instead of running them, and autograd records the op's backward
with the recomputed q, k, v and the kept output and log-sum-exp, exactly as for a first forward. Every other op of
the block runs in both passes untouched and without a Python hop; the cross-attention's SDPA (linear in S) is
recomputed. torch's own selective checkpointing (``create_selective_checkpoint_contexts``) was the first version:
it counts every op of the region and needs the recompute to issue the same sequence, which ZeRO-3's parameter
gathers inside a block (prefetched in the forward, fetched in the recompute) do not (a CPU run with 2 ranks
failed with "aten.cat.out invocation index 11 encountered during backward but not found in storage"). The rule is
per op, so it holds for every attention path that ends in a fused SDPA op: plain SDPA, Ulysses (the local
attention inside DeepSpeed's ``DistributedAttention``; its all-to-alls run again in the recompute), the dense
layers of a sparse run. Paths that do not (the block-sparse Triton kernel, an SDPA math fallback with a mask) are
recomputed as before; the cost model (``CostModel.ckpt_cost``) counts exactly that: the dense layers' recomputed
quadratic part goes, a sparse layer's (``r_l`` of it) stays.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Iterator, Optional

__all__ = ["CHECKPOINT_ATTENTION_MODES", "kept_attention_ops", "kept_attention_bytes_per_token",
           "keep_attention_context", "self_attention_core"]

#: ``recompute.attention``: ``recompute`` (the whole block again, the default) or ``keep``
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


class _Phase:
    """A checkpointed call's pass (``keep``: its forward, ``reuse``: its recompute) over its store: entered by
    ``torch.utils.checkpoint`` around the block's forward / recompute. Only marks the pass (thread-local): the
    dispatch mode runs inside :func:`self_attention_core` alone, so no other op of the block goes through Python."""

    def __init__(self, store: "_KeptStore", pass_: str) -> None:
        self.store, self.pass_ = store, pass_

    def __enter__(self) -> "_Phase":
        stack = getattr(_state, "phases", None)
        if stack is None:
            stack = _state.phases = []
        stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _state.phases.pop()


def _active_phase() -> "Optional[_Phase]":
    stack = getattr(_state, "phases", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def self_attention_core() -> Iterator[None]:
    """Wraps the self-attention core's call (the block's ``attn_fn(q, k, v)``). Inside a ``keep`` checkpoint's
    forward the fused SDPA ops that run here are kept; inside its recompute they are answered from what was kept.
    Elsewhere (no checkpoint, ``recompute``, no grad) it does nothing."""
    phase = _active_phase()
    if phase is None:
        yield
        return
    _state.phases.append(None)   # what runs inside the core (Ulysses, sparse runtime) sees no checkpoint phase
    try:
        with _modes()[phase.pass_](phase.store):
            yield
    finally:
        _state.phases.pop()


def _detached(out):
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)


class _KeptStore:
    """The kept outputs of one checkpointed call, in call order (freed as the recompute takes them)."""

    def __init__(self) -> None:
        self.outputs: list = []
        self.taken = 0


@functools.lru_cache(maxsize=None)
def _modes() -> dict:
    """{pass: dispatch mode class} (``keep``: forward, ``reuse``: recompute), built on first use, so that importing
    this module needs no torch. A mode is active only while a self-attention core runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _StoreMode(TorchDispatchMode):
        def __init__(self, store: _KeptStore) -> None:
            super().__init__()
            self.store = store

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True   # a compiled attention path runs as it is

    class _KeepAttention(_StoreMode):
        """Forward of a checkpointed block's attention core: runs every op, keeps the fused SDPA outputs."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in kept_attention_ops():
                self.store.outputs.append(_detached(out))
            return out

    class _ReuseAttention(_StoreMode):
        """Recompute of a checkpointed block's attention core: the fused SDPA calls take the kept outputs."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in kept_attention_ops():
                st = self.store
                if st.taken >= len(st.outputs):
                    raise RuntimeError(
                        f"checkpoint_attention keep: the recompute of a checkpointed block called its self-attention "
                        f"core {st.taken + 1} time(s), its forward {len(st.outputs)}: the block's forward must make "
                        "the same attention calls both times (set adaptive_load.recompute.attention to "
                        "'recompute' for a model that does not)")
                out, st.outputs[st.taken] = st.outputs[st.taken], None
                st.taken += 1
                return out
            return func(*args, **(kwargs or {}))

    return {"keep": _KeepAttention, "reuse": _ReuseAttention}


def _contexts() -> tuple:
    store = _KeptStore()
    return _Phase(store, "keep"), _Phase(store, "reuse")


def keep_attention_context() -> Callable:
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` that keeps
    the self-attention core's SDPA outputs (module docstring): a fresh (forward, recompute) pair per call."""
    return _contexts
