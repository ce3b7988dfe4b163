"""Hybrid sparsity-aware context parallelism in the model: per layer, the ``(h, s)`` mesh around the sparse runtime.

Installed by :meth:`SparseAttentionRuntime.install` when ``sparse_attention.context_parallel`` is ``sequence``
or ``auto`` and the SP degree is > 1 (instead of one DistributedAttention per layer). A block's attention
fn gets this rank's residual shard ``q, k, v [B, L, H, Dh]`` (``L = S_pad / sp``) and:

1. takes the layer's mesh for this sequence length (:meth:`ContextParallelAttention.layer_meshes`: the
   planner's solver through the runtime's decision cost, ``SparseAttentionCost.layer_meshes``, at the densities
   the layers run at; for ``sequence`` without a cost: sparse layers ``(1, sp)``, the others the largest
   head-wise size);
2. ``h > 1``: one head-wise all-to-all of q, k, v stacked (:class:`ds_adaptive.parallel.mesh.HeadAllToAll`)
   -> the chunk of ``h * L`` tokens of the rank's head-wise group, ``H / h`` heads;
3. ``s == 1``: the runtime's ordinary attention on the full sequence (Ulysses); ``s > 1``: the sequence-wise
   selection and attention (:mod:`ds_adaptive.attention.sequence_parallel`) over the sequence-wise group;
4. ``h > 1``: the output back by the inverse all-to-all.

The runner pads the sequence so that every chunk is whole key blocks (:meth:`token_multiple`, read by
``UlyssesRunner``). Bytes each rank sends are counted per layer (:attr:`counter`, the last step's in
:attr:`last_bytes`). Every rank of an SP group chooses the same meshes: they depend only on the sequence
length and the all-reduced densities.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ds_adaptive.attention.density import clock
from ds_adaptive.attention.scores import lse_columns
from ds_adaptive.attention.selection import pooled_queries
from ds_adaptive.attention.sequence_parallel import (ShardGeometry, gather_full_keys, select_shard_blocks,
                                                     sequence_attention, shard_block_scores)
from ds_adaptive.parallel.kv_gather import CommCounter
from ds_adaptive.parallel.mesh import CPMesh, HeadAllToAll, create_meshes, mesh_shapes

__all__ = ["ContextParallelAttention", "sequence_rule"]


def sequence_rule(sp: int, num_heads: int, sparse: tuple[bool, ...]) -> tuple[tuple[int, int], ...]:
    """The ``sequence`` mode's meshes: ``(1, sp)`` for a layer that runs sparse, else the largest head-wise
    size the heads allow (Ulysses where ``sp`` divides them)."""
    h0, s0 = mesh_shapes(sp, num_heads)[0]
    return tuple((1, sp) if x else (h0, s0) for x in sparse)


class _CPLayer:
    """``fn(q, k, v, **kwargs)`` of one layer (what a block calls)."""

    def __init__(self, owner: "ContextParallelAttention", layer: int):
        self.owner, self.layer = owner, layer

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, valid_len: Optional[int] = None,
                 **_: Any) -> torch.Tensor:
        return self.owner.attention(self.layer, q, k, v, valid_len=valid_len)


class ContextParallelAttention:
    """``model.set_attention`` target for a hybrid mode (see the module docstring). ``runtime``: the
    :class:`~ds_adaptive.attention.runtime.SparseAttentionRuntime`; ``layout``: the SP group's Layout. Creates
    the process groups of every mesh the SP degree allows (a collective of the whole world)."""

    def __init__(self, runtime, layout):
        self.runtime, self.layout = runtime, layout
        self.sp = layout.sp_size
        self.shapes = mesh_shapes(self.sp, runtime.num_heads)
        self.meshes: dict[tuple[int, int], CPMesh] = create_meshes(layout, self.shapes)
        self.counter = CommCounter()
        self.last_bytes: dict = {}
        self._mesh_cache: dict = {}
        self._fns = [_CPLayer(self, i) for i in range(runtime.num_layers)]

    def for_layer(self, i: int) -> _CPLayer:
        return self._fns[i]

    def __call__(self, *args, **kwargs):
        raise RuntimeError("per-layer attention: install with model.set_attention(obj) so each block gets obj.for_layer(i)")

    def __deepcopy__(self, memo):
        return self  # process groups cannot be copied; an EMA copy runs over the same meshes

    # ------------------------------------------------------------------ meshes
    def layer_meshes(self, seq_len: int) -> tuple[tuple[int, int], ...]:
        """``(h, s)`` of every layer for a sample of ``seq_len`` real tokens (cached per length and decision)."""
        rt = self.runtime
        cost = rt.decider.cost
        row = cost.layer_decisions(seq_len, self.sp)[0] if cost is not None else None
        sparse = tuple(rt.schedule.is_sparse(i) and (row is None or bool(row[i])) for i in range(rt.num_layers))
        key = (seq_len, id(cost), sparse)
        out = self._mesh_cache.get(key)
        if out is None:
            if cost is not None and getattr(cost, "hybrid", False):
                out = tuple(m.shape for m in cost.layer_meshes(seq_len, self.sp, sparse=sparse))
            elif rt.cfg.context_parallel == "sequence":
                out = sequence_rule(self.sp, rt.num_heads, sparse)
            else:
                raise ValueError("adaptive_load.sparse_attention.context_parallel 'auto' needs the planner's cost "
                                 "model (build_run passes it as the runtime's decision); use 'sequence' without it")
            if len(self._mesh_cache) > 4096:
                self._mesh_cache.clear()
            self._mesh_cache[key] = out
        return out

    def token_multiple(self, seq_len: int) -> int:
        """Tokens the padded sequence must be a multiple of for ``seq_len`` real tokens: every sequence-wise
        chunk whole blocks (``lcm`` of ``s * block`` over the layers with ``s > 1``; 1 when none)."""
        bs = self.runtime.cfg.block_size
        m = 1
        for _, s in set(self.layer_meshes(int(seq_len))):
            if s > 1:
                m = math.lcm(m, s * bs)
        return m

    def end_step(self) -> None:
        """After the optimizer step: the step's bytes per layer into :attr:`last_bytes`, the counter reset."""
        self.last_bytes = {k: dict(v) for k, v in self.counter.bytes.items()}
        self.counter.reset()

    # ------------------------------------------------------------------ the attention fn
    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  valid_len: Optional[int] = None) -> torch.Tensor:
        rt = self.runtime
        padded = q.shape[1] * self.sp
        valid = padded if valid_len is None else int(valid_len)
        h, s = self.layer_meshes(valid)[layer]
        mesh = self.meshes[(h, s)]
        heads = mesh.head_slice(rt.num_heads)
        if h > 1:
            qkv = HeadAllToAll.apply(torch.stack((q, k, v), 2), mesh.head_group, h, True, self.counter, layer)
            q, k, v = qkv.unbind(2)
        if s == 1:
            out = rt.attention(layer, q, k, v, valid_len=valid_len, head_ids=heads)
        else:
            geo = ShardGeometry(valid, rt.cfg.block_size, padded // s, mesh.seq_rank, s)
            out = self._sequence_layer(layer, q, k, v, geo, mesh, heads)
        if h > 1:
            out = HeadAllToAll.apply(out, mesh.head_group, h, False, self.counter, layer)
        return out

    def _sequence_layer(self, layer, q, k, v, geo: ShardGeometry, mesh: CPMesh, heads) -> torch.Tensor:
        rt = self.runtime
        if rt.dense_forced:  # dense_only(): every block, no selection, no profiling
            return sequence_attention(q, k, v, None, geo, mesh.seq_group, counter=self.counter, layer=layer)
        key = ("sequence", tuple(q.shape), geo, heads)
        if rt.selections.recompute_hit(layer, key):  # the checkpoint recompute: the forward's selection
            entry, selection = rt.selections.entry(layer), rt.selections.selection(layer)
        else:
            selection, density = None, None
            if rt.schedule.is_sparse(layer) and rt.runs_sparse(layer, geo.valid):
                t0 = clock(q.device)
                selection, density = self._select(layer, q, k, geo, mesh, heads)
                rt.profiler.record_selection(layer, t0, q.device, (q.shape[0], geo.valid), selection)
            if torch.is_grad_enabled() and rt.schedule.profile_now() and q.requires_grad:
                keys = gather_full_keys(k, geo, mesh.seq_group, counter=self.counter, layer=layer)
                if geo.real_tokens:  # this rank's query rows against every key (densities summed over ranks)
                    rt.profiler.profile_and_train(layer, q[:, :geo.real_tokens], keys, selection, None, heads,
                                                  rt.selector.head_arg(heads))
            entry = rt.selections.store(layer, key, selection, density)
            entry.selection = None
        kernel = rt.backend_for(q) if selection is not None else None
        return sequence_attention(q, k, v, selection, geo, mesh.seq_group, kernel=kernel, density=entry.density,
                                  counter=self.counter, layer=layer)

    @torch.no_grad()
    def _select(self, layer, q, k, geo: ShardGeometry, mesh: CPMesh, heads):
        """(this rank's query blocks' selection or None: denser than ``dense_above``, its host-known share)."""
        rt = self.runtime
        cfg, sel = rt.cfg, rt.selector
        kph = sel.head_k(layer, geo.num_blocks, heads, rt.head_density)
        density = float(kph.float().mean()) / geo.num_blocks
        if density > cfg.dense_above:
            return None, density
        bs = cfg.block_size
        if sel.uses_predictor:
            arg = sel.head_arg(heads)
            summary = lambda x: sel.predictor.query_summary(layer, x, bs, arg)  # noqa: E731
            columns = lambda qs, kk: sel.predictor.key_columns(layer, qs, kk, bs, arg, mode=cfg.block_score)  # noqa: E731
        else:
            summary = lambda x: pooled_queries(x, bs, k.dtype)  # noqa: E731
            columns = lambda qs, kk: lse_columns(qs, kk, bs)  # noqa: E731
        scores = shard_block_scores(q, k, geo, mesh.seq_group, summary=summary, columns=columns,
                                    counter=self.counter, layer=layer)
        return select_shard_blocks(scores, kph, geo, keep_sink=cfg.keep_sink), density
