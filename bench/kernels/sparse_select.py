"""Selection cost of one sparse layer per training step, for bench/kernels/sparse_kernel.py.

Parts (Wan 1.3B heads, density 0.1, random q / k, the runtime's own calls):

* ``score_topk``: block scores of the default ``block_score`` (``pooled_lse``: exact logits of each
  query block's mean query) + ``select_blocks`` (once per step: the forward); ``score_topk_<mode>``
  the same for every ``block_score`` (``pooled_lse``, ``lse``, ``mean``: the last two by the predictor);
* ``mask_full``: ``block_mask_from_selection`` with the q side, built twice per step under
  (non-reentrant) activation checkpointing: the first pass runs with autograd on and must save the
  same tensors as the recompute; ``mask_kv``: without the q side (a forward without autograd: eval);
* ``host_cache``: parking the selection in pinned host buffers and fetching it back (the default
  ``selection_cache: host``);
* ``old_mask``: the previous path, ``BlockMask.from_kv_blocks`` (built twice per step).

Each part: eager host-inclusive time (CUDA events around the call with the GPU idle: what the step
pays when the host is the bottleneck), host time (launch only, no sync) and GPU time (sum of its
kernels' device time from torch.profiler). A trace (--trace) of one layer as checkpointing runs it: selection + mask +
flex forward, then the recompute's mask + flex forward and backward; the CUDA runtime calls
that wait on the host (stream / device / event synchronize, blocking memcpy) inside the selection
calls are counted.
"""
from __future__ import annotations

import math
import time

import torch

from sparse_common import cuda_time

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""CUDA runtime calls that make the host wait for the GPU (an ``.item()`` of a CUDA tensor shows as a
memcpy + cudaStreamSynchronize; ``aten::item`` alone is also called on CPU tensors and is no sync)."""


def legacy_block_mask(selection):
    """The BlockMask as built before (``from_kv_blocks``: vmapped dense transpose + argsort)."""
    from torch.nn.attention.flex_attention import BlockMask

    from ds_adaptive.attention.backends.flex import _keys_below, _length
    s, bs, n = selection.seq_len, selection.block_size, selection.num_blocks
    idx = selection.flex_indices()
    pos = (selection.kv_num.long() - 1).clamp_min(0).unsqueeze(-1)
    has_last = ((selection.kv_idx.gather(-1, pos).squeeze(-1) == n - 1) & (selection.kv_num > 0)).to(torch.int32)
    return BlockMask.from_kv_blocks(has_last, torch.full_like(idx, n - 1), selection.kv_num - has_last, idx,
                                    BLOCK_SIZE=bs, mask_mod=_keys_below(_length(s, idx.device)), seq_lengths=(n * bs, n * bs))


def _gpu_ms(fn, reps: int) -> float:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:  # a kernel / memcpy / memset on the GPU
            total += e.time_range.elapsed_us()
    return total / 1e3 / reps


def _host_ms(fn, reps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t = (time.perf_counter() - t0) * 1e3 / reps
    torch.cuda.synchronize()
    return t


def _measure(fn, args) -> dict:
    return {"eager_ms": cuda_time(fn, args.warmup, args.reps), "host_ms": _host_ms(fn, args.reps),
            "gpu_ms": _gpu_ms(fn, args.reps)}


def selection_overhead(s: int, args, *, trace=None, sparse_ms_at_01=None) -> dict:
    from ds_adaptive.attention.backends.flex import block_mask_from_selection
    from ds_adaptive.attention.predictor import LowRankPredictor
    from ds_adaptive.attention.runtime import _HostCopy
    from ds_adaptive.core.config import SparseAttentionConfig
    from ds_adaptive.attention.selection import blocks_for_density, select_blocks
    from ds_adaptive.attention.scores import pooled_lse_scores

    dev = torch.device("cuda")
    b, h, d, bs = args.batch, args.heads, args.head_dim, args.block
    g = torch.Generator(device=dev).manual_seed(s + 1)
    q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
    nk = math.ceil(s / bs)
    pred = LowRankPredictor(1, h, d, 16).to(dev)
    kph = blocks_for_density(torch.full((h,), 0.1), nk)

    scorers = {"pooled_lse": lambda: pooled_lse_scores(q, k, bs),
               "lse": lambda: pred.block_scores(0, q, k, bs, mode="lse"),
               "mean": lambda: pred.block_scores(0, q, k, bs, mode="mean")}

    def topk(mode):
        return lambda: select_blocks(scorers[mode](), kph, seq_len=s, block_size=bs, inplace=True)
    score_topk = topk(SparseAttentionConfig().block_score)
    sel = score_topk()
    cache = _HostCopy()

    def host_cache():
        cache.put(0, sel)
        return cache.get(0)
    parts = {"score_topk": _measure(score_topk, args),
             **{f"score_topk_{m}": _measure(topk(m), args) for m in scorers},
             "mask_kv": _measure(lambda: block_mask_from_selection(sel, with_q=False), args),
             "mask_full": _measure(lambda: block_mask_from_selection(sel), args),
             "host_cache": _measure(host_cache, args),
             "old_mask": _measure(lambda: legacy_block_mask(sel), args)}
    new = {"score_topk": 1, "mask_full": 2, "host_cache": 1}  # calls per step
    out = {"parts": parts, "sparse_ms_at_0.1": sparse_ms_at_01,
           "step_eager_ms": sum(n * parts[p]["eager_ms"] for p, n in new.items()),
           "step_gpu_ms": sum(n * parts[p]["gpu_ms"] for p, n in new.items()),
           "old_step_eager_ms": parts["score_topk"]["eager_ms"] + 2 * parts["old_mask"]["eager_ms"],
           "old_step_gpu_ms": parts["score_topk"]["gpu_ms"] + 2 * parts["old_mask"]["gpu_ms"]}
    for key in ("eager", "gpu"):
        out[f"share_{key}"] = out[f"step_{key}_ms"] / sparse_ms_at_01 if sparse_ms_at_01 else float("nan")
        out[f"old_share_{key}"] = out[f"old_step_{key}_ms"] / sparse_ms_at_01 if sparse_ms_at_01 else float("nan")
    out["syncs"] = _trace_layer(q, k, v, score_topk, trace, s)
    return out


def _trace_layer(q, k, v, score_topk, path, s) -> dict:
    """One checkpointed layer under torch.profiler: host-sync calls counted inside the selection ops."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from ds_adaptive.attention.backends.flex import flex_block_sparse_attention
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    share = 0.1

    def layer():
        with record_function("selection"):
            sel = score_topk()
        flex_block_sparse_attention(qg, kg, vg, sel, density=share)  # the checkpointed first pass (graph dropped)
        out = flex_block_sparse_attention(qg, kg, vg, sel, density=share)  # the recompute
        out.sum().backward()
    layer()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("layer"):
            layer()
        torch.cuda.synchronize()
    if path:
        prof.export_chrome_trace(path)
    counts = {}
    for region in ("selection", "layer"):
        ranges = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.name == region]
        for e in prof.events():
            if e.name in SYNC_CALLS and any(a <= e.time_range.start <= z for a, z in ranges):
                counts[f"{region}:{e.name}"] = counts.get(f"{region}:{e.name}", 0) + 1
    return counts
