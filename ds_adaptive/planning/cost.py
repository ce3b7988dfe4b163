"""Per-GPU compute cost and activation memory of samples and micro-batches.

A micro-batch is ``B`` samples of one shape, i.e. one sequence length ``S`` (tokens). On one GPU,
with Ulysses sequence parallelism of degree ``sp`` (each rank of an SP group holds ``S/sp`` tokens
and ``heads/sp`` attention heads), the cost model predicts:

``calibrated`` (milliseconds, from a profile json written by ``ds-adaptive calibrate``)::

    S_pad           = S rounded up to a multiple of sp
    per_gpu_cost(S) = (a * S_pad + b * S_pad**2) / sp  +  comm(S_pad)          per sample
    comm(S_pad)     = layers * bytes_per_token_per_layer * (S_pad / sp) * (sp - 1) / sp / link_bandwidth
    batch_cost      = c0 + B * per_gpu_cost(S)                                 per micro-batch

    ``c0`` is the per-micro-batch overhead (kernel launches, embed/head), paid once per micro-batch;
    every rank runs exactly one micro-batch per micro-step, so ``c0`` never unbalances a micro-step.

Sparse attention (``sparse=SparseAttentionCost``, calibrated mode only; ``ds_adaptive.planning.sparse_cost``)::

    per_gpu_cost(S) = (a * S_pad + b * S_pad**2 * q(S_pad)) / sp  +  sel(S_pad)  +  comm(S_pad)
    q = 1 - attention_share * (1 - rho_eff(S)),  rho_eff from the busiest SP rank's head densities,
    sel = selection (scoring, top-k) of this rank's heads/sp heads in the layers that run sparse, per sample
    batch_cost = c0 + sel_call(S_pad) + B * per_gpu_cost(S)     sel_call: the selection's fixed part per call
    recomputed forwards (ckpt_cost): a sparse layer's recompute runs sparse too (its quadratic part x g)

    With every density 1 (every layer dense) ``q == 1`` and ``sel == 0``: exactly the dense model.

``power`` (the paper's ``S^p``, unit "S^p"): ``per_gpu_cost = S_pad**p / sp``, ``c0 = 0``, no comm.

``tokens`` (linear, unit "tokens"): ``per_gpu_cost = S_pad / sp``, ``c0 = 0``, no comm.

Memory (GiB, all modes, from the profile)::

    per_gpu_memory(S) = m0 + (m1 + v * m1_pt) * S_pad / sp                     per sample
    batch_memory      = B * per_gpu_memory(S)

    ``v`` is 1 for a video micro-batch of a run that trains with one timestep per token (first-frame
    conditioning: every video micro-batch may hold a conditioned sample), else 0; ``m1_pt`` is what the
    per-token modulation adds (``memory.per_token_timesteps``, :meth:`Profile.with_per_token_timesteps`).

Static memory (parameters, gradients, optimizer state under ZeRO) is separate: see
:meth:`Profile.static_memory_gib`. Profiles are looked up by shipped name (``h100-wan2.1-1.3b``,
``h100-wan2.1-14b``) or by path (:func:`load_profile`).

The profiles themselves (calibrated terms, variants, depth rescaling) are :mod:`ds_adaptive.planning.profile`.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

import numpy as np

from ds_adaptive.core.layout import Layout
from ds_adaptive.core.shapes import SampleShape, pad_to_multiple
from ds_adaptive.models.recompute import CHECKPOINT_ATTENTION_MODES, kept_attention_bytes_per_token
from ds_adaptive.planning.profile import (AUTO_HEADROOM, CHECKPOINT_POLICIES, COST_UNITS, DEFAULT_MEM_UTILIZATION, GIB,
                                          CostMode, Profile, load_profile)

if TYPE_CHECKING:  # pragma: no cover
    from ds_adaptive.planning.sparse_cost import SparseAttentionCost


class CostModel:
    """Per-GPU compute cost and activation memory of samples and micro-batches.

    Args:
        profile: a :class:`Profile` (or name / path / dict): memory always, compute for
            ``calibrated``, ``heads`` for the SP check.
        mode: ``calibrated`` (ms), ``power`` (S^p) or ``tokens`` (S).
        p: exponent of ``power``.
        sp: Ulysses degree (ranks that share one sample's sequence).
        num_heads: attention heads of the model (default: the profile's); must divide by ``sp``.
        sparse: a :class:`ds_adaptive.planning.sparse_cost.SparseAttentionCost` (calibrated mode only):
            the quadratic term scales with the busiest SP rank's attention density, plus selection.
    """

    def __init__(self, profile: Union[Profile, str, Path, Mapping[str, Any]], mode: CostMode = "calibrated",
                 *, p: float = 1.5, sp: int = 1, num_heads: Optional[int] = None,
                 sparse: "Optional[SparseAttentionCost]" = None, checkpointing: str = "all",
                 checkpoint_attention: str = "recompute", context_parallel: str = "heads") -> None:
        self.profile = profile if isinstance(profile, Profile) else load_profile(profile)
        if checkpointing not in CHECKPOINT_POLICIES:
            raise ValueError(f"checkpointing must be one of {list(CHECKPOINT_POLICIES)}, got {checkpointing!r}")
        if checkpoint_attention not in CHECKPOINT_ATTENTION_MODES:
            raise ValueError(f"checkpoint_attention must be one of {list(CHECKPOINT_ATTENTION_MODES)}, "
                             f"got {checkpoint_attention!r}")
        #: activation checkpointing policy the plan is made for: ``all`` blocks (the profile's own
        #: calibration when it was measured with checkpointing), ``none``, or ``auto`` (per micro-batch the
        #: fewest blocks that fit ``m_mem``: :func:`ds_adaptive.planning.memory.checkpoint_blocks`)
        self.checkpointing = checkpointing
        #: what a checkpointed block recomputes: ``recompute`` (all of it, as the profile measured) or ``keep``
        #: (all but the self-attention core, whose output it holds: :mod:`ds_adaptive.models.recompute`)
        self.checkpoint_attention = checkpoint_attention
        if mode not in COST_UNITS:
            raise ValueError(f"cost mode must be one of {sorted(COST_UNITS)}, got {mode!r}")
        heads = self.profile.num_heads if num_heads is None else int(num_heads)
        if sparse is not None and sparse.hybrid:
            context_parallel = sparse.context_parallel.mode
        self.context_parallel = context_parallel  # "heads" (Ulysses) or a hybrid mode: sp may exceed the heads
        Layout(sp_size=sp, context_parallel=context_parallel).validate(
            num_heads=heads, what=f"the model of profile '{self.profile.name}'")
        if not p > 0:
            raise ValueError(f"power-law exponent p must be > 0, got {p!r}")
        if sparse is not None:
            if mode != "calibrated":
                raise ValueError(f"a sparse-attention cost needs cost mode 'calibrated' (ms), got {mode!r}")
            dm = sparse.densities
            if dm.num_heads != heads or dm.num_layers != self.profile.num_layers:
                raise ValueError(
                    f"density table has {dm.num_layers} layers x {dm.num_heads} heads but the model (profile "
                    f"'{self.profile.name}') has {self.profile.num_layers} x {heads}: give densities of the "
                    "trained model (DensityMap.with_num_layers for --layers)")
            sparse = sparse.for_profile(self.profile)  # the layer's dense attention time: the pay check
        self.sparse = sparse
        self.mode: CostMode = mode
        self.p = float(p)
        self.sp = sp
        self.num_heads = heads
        pr = self.profile
        # Coefficients at sp=1 (the profile's per-GPU time at its own sp, times that sp).
        self._a1 = pr.a_ms_per_token * pr.sp
        self._b1 = pr.b_ms_per_token2 * pr.sp
        # ms per token of the all-to-alls: bytes per token per layer -> seconds at GB/s -> ms.
        self._comm_ms_per_token = pr.num_layers * pr.comm_bytes_per_token_per_layer / (pr.link_gbps * 1e9) * 1e3

    # ----------------------------------------------------------------------------- sizes
    @property
    def unit(self) -> str:
        """Unit of costs and of the compute budget (``ms``, ``S^p`` or ``tokens``)."""
        return COST_UNITS[self.mode]

    @property
    def c0(self) -> float:
        """Per-micro-batch overhead in the cost unit (0 unless ``calibrated``)."""
        return self.profile.c0_ms if self.mode == "calibrated" else 0.0

    def padded_tokens(self, shape_or_tokens: Union[SampleShape, int]) -> int:
        """Sequence length padded to a multiple of sp (tokens)."""
        s = shape_or_tokens.tokens if isinstance(shape_or_tokens, SampleShape) else int(shape_or_tokens)
        if s < 1:
            raise ValueError(f"sequence length must be >= 1 token, got {s}")
        return pad_to_multiple(s, self.sp)

    # ----------------------------------------------------------------------------- compute
    def per_gpu_cost(self, shape_or_tokens: Union[SampleShape, int]) -> float:
        """Compute cost of ONE sample on one GPU (without the micro-batch overhead c0)."""
        s = float(self.padded_tokens(shape_or_tokens))
        if self.mode == "calibrated":
            if self.sparse is not None:
                n = int(s)
                quad = self._b1 * s * s * self.sparse.quadratic_factor(n, self.sp)
                sel = self.sparse.selection_ms(n, self.sp, self.num_heads)   # this rank's heads/sp heads
                return (self._a1 * s + quad) / self.sp + sel + self.comm_cost(shape_or_tokens)
            return (self._a1 * s + self._b1 * s * s) / self.sp + self.comm_cost(shape_or_tokens)
        if self.mode == "power":
            return s ** self.p / self.sp
        return s / self.sp

    def comm_cost(self, shape_or_tokens: Union[SampleShape, int]) -> float:
        """Ulysses all-to-all time of one sample on one GPU (ms; 0 for sp=1 or non-ms modes)."""
        if self.mode != "calibrated" or self.sp == 1:
            return 0.0
        s = float(self.padded_tokens(shape_or_tokens))
        if self.sparse is not None and self.sparse.hybrid:  # per-layer meshes (planning.context_parallel)
            return self.sparse.context_parallel_comm_ms(int(s), self.sp)
        return self._comm_ms_per_token * (s / self.sp) * (self.sp - 1) / self.sp

    def batch_overhead(self, shape_or_tokens: Union[SampleShape, int]) -> float:
        """Per-micro-batch cost of a micro-batch of this shape (whatever its size): ``c0``, plus with sparse
        attention the fixed part of the selection call of every layer that runs sparse at this length."""
        if self.sparse is None or self.mode != "calibrated":
            return self.c0
        return self.c0 + self.sparse.selection_call_ms(self.padded_tokens(shape_or_tokens), self.sp)

    def batch_cost(self, shape_or_tokens: Union[SampleShape, int], batch_size: int) -> float:
        """Compute cost of a micro-batch of ``batch_size`` samples of one shape on one GPU."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return self.batch_overhead(shape_or_tokens) + batch_size * self.per_gpu_cost(shape_or_tokens)

    # ----------------------------------------------------------------------------- memory
    def per_gpu_memory(self, shape_or_tokens: Union[SampleShape, int]) -> float:
        """Activation memory of ONE sample on one GPU (GiB)."""
        s = float(self.padded_tokens(shape_or_tokens))
        m1 = self.profile.m1_gib_per_token + self.profile.per_token_extra(shape_or_tokens)[0]
        kv = self.sparse.context_parallel_kv_gib(int(s), self.sp) if self.sparse is not None and self.sparse.hybrid else 0.0
        return self.profile.m0_gib + m1 * s / self.sp + kv

    def batch_memory(self, shape_or_tokens: Union[SampleShape, int], batch_size: int) -> float:
        """Activation memory of a micro-batch on one GPU (GiB)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return batch_size * self.per_gpu_memory(shape_or_tokens)

    def max_batch_size(self, shape_or_tokens: Union[SampleShape, int], m_mem: float,
                       m_comp: Optional[float] = None) -> int:
        """Largest B with ``batch_memory <= m_mem`` (and ``batch_cost <= m_comp`` if given);
        0 when even B=1 is over a budget."""
        mem1 = self.per_gpu_memory(shape_or_tokens)
        b = int(math.floor(m_mem / mem1 * (1 + 1e-12)))
        if m_comp is not None:
            c1 = self.per_gpu_cost(shape_or_tokens)
            b = min(b, int(math.floor((m_comp - self.batch_overhead(shape_or_tokens)) / c1 * (1 + 1e-12)))
                    if c1 > 0 else b)
        return max(b, 0)

    # ----------------------------------------------------------------------------- checkpointing
    @property
    def num_layers(self) -> int:
        """Transformer blocks of the profiled model (the range of a checkpoint count is 0..num_layers)."""
        return self.profile.num_layers

    def profile_ckpt_blocks(self) -> int:
        """Blocks checkpointed in the profile's own calibration (all or none)."""
        return self.profile.num_layers if self.profile.gradient_checkpointing else 0

    def as_profiled(self, ckpt_blocks: int) -> bool:
        """True when a micro-batch with ``ckpt_blocks`` checkpointed blocks runs as the profile's calibration did
        (the same count, and no kept attention in a checkpointed block): its cost and memory are the profile's
        own fits (``per_gpu_cost`` / ``per_gpu_memory``), with no checkpointing correction."""
        return ckpt_blocks == self.profile_ckpt_blocks() and (ckpt_blocks == 0 or self.checkpoint_attention != "keep")

    def ckpt_memory(self, shape_or_tokens: Union[SampleShape, int], batch_size, ckpt_blocks):
        """Activation memory (GiB) with the first ``ckpt_blocks`` blocks checkpointed: :func:`checkpointed_memory`."""
        return checkpointed_memory(self, shape_or_tokens, batch_size, ckpt_blocks)

    def kept_attention_gib_per_token(self) -> float:
        """What a checkpointed block holds beyond its input under ``recompute.attention: keep`` (GiB per token
        of the local shard): the self-attention output and log-sum-exp (``kept_attention_bytes_per_token``,
        exact sizes, not measured); 0 for ``recompute``. Counted for every checkpointed block, a sparse layer
        too (its kernel's output is recomputed, not kept: an over-estimate of 3 KiB per token there)."""
        if self.checkpoint_attention != "keep":
            return 0.0
        act_bytes = int(self.profile.bytes_per_param.get("params", 2.0))
        return kept_attention_bytes_per_token(self.profile.dim, self.num_heads, act_bytes) / GIB

    def recompute_ms(self, shape_or_tokens: Union[SampleShape, int], batch_size):
        """Time (ms) of ONE block's recomputed forward for a micro-batch (per GPU, Ulysses-aware:
        compute / sp, plus that block's share of the all-to-alls)."""
        pr = self.profile
        s = float(self.padded_tokens(shape_or_tokens))
        c0, a, b = pr.recompute_ms
        per = (a * pr.sp * s + b * pr.sp * s * s) / self.sp
        if self.sp > 1:
            passes = 3.0 if pr.gradient_checkpointing else 2.0
            per += self._comm_raw(s) / pr.num_layers / passes
        return c0 + np.asarray(batch_size) * per

    def _recompute_quadratic_ms(self, s: float) -> float:
        """The quadratic part (the self-attention forward) of ONE block's recomputed forward, per sample, at ``s``
        padded tokens (ms, per GPU)."""
        pr = self.profile
        return pr.recompute_ms[2] * pr.sp * s * s / self.sp

    def _sparse_recompute_saving(self, shape_or_tokens: Union[SampleShape, int], batch_size, ckpt_blocks):
        """With sparse attention, the recomputed forward of a sparse layer runs sparse: its quadratic part
        costs ``r_l`` (the layer's kernel ratio) of the dense one that :meth:`recompute_ms` counts. The
        profile's ``b S^2`` holds the recompute of the blocks it checkpointed (all or none), already scaled
        by ``q``; the correction is for the blocks whose state differs from the profile's: ``+(1 - r_l)``
        of a dense recompute's quadratic part for each block not recomputed that the profile recomputed
        (blocks ``>= n``), ``-(1 - r_l)`` for each recomputed that it did not (blocks ``< n``). 0 dense."""
        if self.sparse is None:
            return 0.0
        s = float(self.padded_tokens(shape_or_tokens))
        saved = 1.0 - np.asarray(self.sparse.layer_ratios(int(s), self.sp), float)   # [L], 0 for dense layers
        if not saved.any():
            return 0.0
        pr = self.profile
        quad = self._recompute_quadratic_ms(s)                      # one block's dense recompute, per sample
        n = np.clip(np.asarray(ckpt_blocks).astype(np.int64), 0, len(saved))
        before = np.concatenate([[0.0], np.cumsum(saved)])          # before[n] = sum of saved[l], l < n
        if pr.gradient_checkpointing:
            share = before[-1] - before[n]                          # blocks >= n: recomputed in the profile only
        else:
            share = -before[n]                                      # blocks < n: recomputed here only
        return np.asarray(batch_size) * quad * share

    def _kept_attention_saving(self, shape_or_tokens: Union[SampleShape, int], batch_size, ckpt_blocks):
        """``recompute.attention: keep``: the recomputed forward of a checkpointed block whose attention runs
        dense (SDPA) skips the attention core, the quadratic part of :meth:`recompute_ms`; a sparse layer's
        recompute still runs its kernel (``r_l`` of that part, :meth:`_sparse_recompute_saving`). Returns
        that quadratic part times the dense layers among the first ``ckpt_blocks`` (ms). 0 for ``recompute``."""
        if self.checkpoint_attention != "keep":
            return 0.0
        s = float(self.padded_tokens(shape_or_tokens))
        pr = self.profile
        quad = self._recompute_quadratic_ms(s)                      # one block's dense recompute, per sample
        n = np.clip(np.asarray(ckpt_blocks).astype(np.int64), 0, pr.num_layers)
        if self.sparse is None:
            dense_before = n
        else:
            dense = ~np.asarray(self.sparse.layer_decisions(int(s), self.sp)[0], bool)   # [L]: runs SDPA
            dense_before = np.concatenate([[0], np.cumsum(dense)])[n]
        return np.asarray(batch_size) * quad * dense_before

    def _comm_raw(self, s: float) -> float:
        return self._comm_ms_per_token * (s / self.sp) * (self.sp - 1) / self.sp

    def ckpt_cost(self, shape_or_tokens: Union[SampleShape, int], batch_size, ckpt_blocks):
        """Compute cost of a micro-batch (in :attr:`unit`) with ``ckpt_blocks`` blocks checkpointed:
        the profile's cost, minus (or plus) the recomputed forwards of the blocks that differ from the
        profile's calibration. Non-ms modes are scaled by the calibrated ratio. numpy-broadcasting."""
        bs = np.asarray(batch_size)
        base = self.batch_overhead(shape_or_tokens) + bs * self.per_gpu_cost(shape_or_tokens)
        delta = (np.asarray(ckpt_blocks) - self.profile_ckpt_blocks()) * self.recompute_ms(shape_or_tokens, bs)
        if self.mode == "calibrated":
            return (base + delta + self._sparse_recompute_saving(shape_or_tokens, bs, ckpt_blocks)
                    - self._kept_attention_saving(shape_or_tokens, bs, ckpt_blocks))
        pr = self.profile
        s = float(self.padded_tokens(shape_or_tokens))
        ms = pr.c0_ms + bs * ((self._a1 * s + self._b1 * s * s) / self.sp + self._comm_raw(s))
        return base * (ms + delta) / ms

    # ----------------------------------------------------------------------------- budgets
    def usable_memory_gib(self, gpu_mem_gib: Optional[float] = None, utilization: Optional[float] = None) -> float:
        """GPU memory the plan may fill (static + activations), GiB: ``capacity x utilization`` when
        given; else ``capacity - fragmentation margin - AUTO_HEADROOM x capacity`` when the profile
        measured a margin (``ds-adaptive calibrate``); else ``capacity x DEFAULT_MEM_UTILIZATION``."""
        cap = self.profile.gpu_mem_gib if gpu_mem_gib is None else float(gpu_mem_gib)
        if utilization is not None:
            return cap * float(utilization)
        margin = self.profile.fragmentation_margin_gib
        if margin is None:
            return cap * DEFAULT_MEM_UTILIZATION
        return cap * (1 - AUTO_HEADROOM) - margin

    def auto_memory_budget(self, gpu_mem_gib: Optional[float] = None, utilization: Optional[float] = None,
                           *, zero_stage: int = 3, dp_size: int = 1) -> float:
        """``m_mem: auto``: the usable GPU memory (:meth:`usable_memory_gib`) minus the static memory (GiB).

        ZeRO partitions over all ``dp_size * sp`` ranks (DeepSpeed's sequence-data-parallel group)."""
        cap = self.profile.gpu_mem_gib if gpu_mem_gib is None else float(gpu_mem_gib)
        static = self.profile.static_memory_gib(zero_stage, dp_size * self.sp)
        usable = self.usable_memory_gib(cap, utilization)
        budget = usable - static
        if budget <= 0:
            how = (f"x mem_utilization {utilization}" if utilization is not None else
                   "minus the fragmentation margin and headroom" if self.profile.fragmentation_margin_gib
                   is not None else f"x {DEFAULT_MEM_UTILIZATION}")
            raise ValueError(
                f"m_mem auto: GPU memory {cap:.1f} GiB {how} = "
                f"{usable:.1f} GiB does not cover the static memory {static:.1f} GiB "
                f"(params/grads/optimizer of {self.profile.params / 1e9:.2f}B params, ZeRO-{zero_stage}, "
                f"{dp_size * self.sp} ranks). Use a higher ZeRO stage, more ranks, or set sampler.m_mem.")
        return budget

    def with_sparse(self, sparse: "Optional[SparseAttentionCost]") -> "CostModel":
        """The same model (checkpointing policy included) with another (or no) sparse-attention term."""
        return CostModel(self.profile, self.mode, p=self.p, sp=self.sp, num_heads=self.num_heads, sparse=sparse,
                         checkpointing=self.checkpointing, checkpoint_attention=self.checkpoint_attention,
                         context_parallel=self.context_parallel)

    def describe(self) -> dict:
        """Small JSON-able summary (for logs and plan fingerprints)."""
        return {"sparse": None if self.sparse is None else self.sparse.describe(),"mode": self.mode, "unit": self.unit, "p": self.p, "sp": self.sp,
                "profile": self.profile.name, "c0": self.c0, "a_ms_per_token_sp1": self._a1,
                "b_ms_per_token2_sp1": self._b1, "m0_gib": self.profile.m0_gib,
                "m1_gib_per_token": self.profile.m1_gib_per_token,
                "comm_ms_per_token": self._comm_ms_per_token, "checkpointing": self.checkpointing,
                "checkpoint_attention": self.checkpoint_attention,
                "checkpoint_source": self.profile.checkpoint_source, "context_parallel": self.context_parallel}


def checkpointed_memory(cost: "CostModel", shape_or_tokens: Union[SampleShape, int], batch_size, ckpt_blocks):
    """Activation memory (GiB) of a micro-batch with the FIRST ``ckpt_blocks`` blocks checkpointed
    (numpy arrays broadcast over ``batch_size`` / ``ckpt_blocks``).

    Per sample, with ``E`` the embed/head + backward working set, ``c`` a checkpointed block's
    input, ``g`` a whole block's activations and ``d`` the last-block term (all three
    ``per-sample + per-token x S/sp``)::

        mem(n) = E + n c + max(L - n, 1) g + (d if n < L else 0)

    (the backward starts at the last block: with n < L the L - n whole blocks are held at once and the
    head's backward runs on top of them, ``d`` more than the working set the all-checkpointed fit saw;
    with n = L the last block is recomputed after the head's backward, so one block's g is held on top
    of L inputs: checkpointing the last block saves ``d - c``, nothing in profiles without ``d``).
    ``E`` comes from the profile's own fit (``m0 + m1 S`` at all blocks checkpointed, or none), so
    ``mem(profile's own n)`` is that fit exactly. A video of a run with per-token timesteps adds the
    profile's per-token terms to ``m1`` and ``g`` (:meth:`Profile.per_token_extra`). :meth:`CostModel.ckpt_memory`.: its modulation
    table in every whole block, and once outside the blocks."""
    pr = cost.profile
    s = float(cost.padded_tokens(shape_or_tokens)) / cost.sp
    L = pr.num_layers
    pt_own, pt_block = pr.per_token_extra(shape_or_tokens)
    own = pr.m0_gib + (pr.m1_gib_per_token + pt_own) * s
    g = pr.block_full_gib[0] + (pr.block_full_gib[1] + pt_block) * s
    c = pr.block_ckpt_gib[0] + pr.block_ckpt_gib[1] * s
    d = pr.last_whole_gib[0] + pr.last_whole_gib[1] * s
    e = own - (L * c + g if pr.gradient_checkpointing else L * g + d)
    c += cost.kept_attention_gib_per_token() * s           # ``keep``: the attention output and LSE too
    n = np.asarray(ckpt_blocks)
    return np.asarray(batch_size) * (e + n * c + np.maximum(L - n, 1) * g + np.where(n < L, d, 0.0))
