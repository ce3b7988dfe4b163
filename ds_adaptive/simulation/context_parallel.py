"""Hybrid context parallelism on paper: per layer, the mesh the solver chooses and its predicted attention +
communication time against Ulysses only, and the predicted step-time gain.

``ds-adaptive simulate --world 64 --sparse 0.1 --context-parallel auto --profile h200-wan2.1-14b`` (or
``bench/planner/context_parallel.py`` for the grid of models, lengths and GPU counts).

For one sample of ``S`` tokens on a context-parallel group of ``N`` GPUs (per GPU, ms, one training step:
forward, recomputed forward, backward):

    hybrid     T_N = c0 + a S / N + sum over layers (attention_l + comm_l) under the solver's mesh at degree N
    Ulysses    T_u at the largest Ulysses degree u <= N that divides the heads and N (u = N where it can);
               N / u such groups train N / u samples at once, so per N GPUs and sample: T_u * u / N
    gain       (T_u * u / N) / T_N                (> 1: the hybrid mesh is predicted faster)

``a`` and ``c0`` come from the calibrated profile, attention and communication from
:mod:`ds_adaptive.planning.context_parallel` (the layer's dense attention ``b S^2 / layers``, the kernel's
efficiency curve, the configured links). Activation memory per GPU ``m0 + m1 S / degree`` (+ the fetched KV of
the largest layer) says whether the Ulysses degree fits at all. All of it is a prediction: no GPU has
measured hybrid context parallelism yet.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Optional, Sequence, Union

from ds_adaptive.core.contracts import DensityMap, KernelEfficiency, load_densities, synthetic_densities
from ds_adaptive.planning.context_parallel import CPLinks, ContextParallelCost, crossover_density, mesh_shapes
from ds_adaptive.planning.profile import Profile, load_profile
from ds_adaptive.planning.sparse_cost import SparseAttentionCost, load_efficiency

__all__ = ["uniform_densities", "context_parallel_report", "context_parallel_table"]


def uniform_densities(num_layers: int, num_heads: int, density: float, dense_layers=None) -> DensityMap:
    """Every head of every layer at ``density``; ``dense_layers`` (default first and last) stay dense."""
    dense = sorted({0, num_layers - 1}) if dense_layers is None else list(dense_layers)
    return DensityMap(tuple((float(density),) * num_heads for _ in range(num_layers)), dense_layers=tuple(dense),
                      source=f"uniform {density}")


def _densities(spec: Union[str, float, DensityMap], profile: Profile, seed: int) -> DensityMap:
    if isinstance(spec, DensityMap):
        return spec
    try:
        return uniform_densities(profile.num_layers, profile.num_heads, float(spec))
    except (TypeError, ValueError):
        pass
    if spec == "synthetic":
        return synthetic_densities(profile.num_layers, profile.num_heads, seed=seed)
    return load_densities(spec)


def _step(cost: SparseAttentionCost, profile: Profile, seq_len: int, degree: int) -> dict:
    meshes = cost.layer_meshes(seq_len, degree)
    a1 = profile.a_ms_per_token * profile.sp
    att = sum(m.attention_ms for m in meshes)
    comm = sum(m.comm_ms for m in meshes)
    mem = profile.m0_gib + profile.m1_gib_per_token * seq_len / degree + max(m.extra_kv_bytes for m in meshes) / 2 ** 30
    return {"degree": degree, "step_ms": profile.c0_ms + a1 * seq_len / degree + att + comm, "attention_ms": att,
            "comm_ms": comm, "activation_gib": mem, "meshes": meshes}


def _ulysses_degree(n: int, heads: int) -> int:
    return max(u for u in range(1, n + 1) if n % u == 0 and heads % u == 0)


def context_parallel_report(*, profile: Union[str, Profile], gpus: int, seq_len: int,
                            densities: Union[str, float, DensityMap] = 0.1, mode: str = "auto",
                            links: Optional[CPLinks] = None, efficiency: Union[None, str, KernelEfficiency] = None,
                            block_size: int = 128, seed: int = 0) -> dict:
    """One (model, tokens, GPUs) configuration: per layer the hybrid mesh and times against Ulysses at the same
    degree (where the heads allow it) and the Ulysses-only step (see the module docstring)."""
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    dm = _densities(densities, prof, seed)
    eff = load_efficiency(efficiency if efficiency is not None else prof.name)
    links = links or CPLinks()
    base = SparseAttentionCost(densities=dm, efficiency=eff, block_size=block_size, head_placement="identity")
    base = base.for_profile(prof)
    head_dim = prof.dim // prof.num_heads
    hybrid = replace(base, context_parallel=ContextParallelCost(mode, links, head_dim))
    # padded as the runner pads: to the degree, and every sequence-wise chunk whole blocks
    mult = gpus
    for m in hybrid.layer_meshes(-(-seq_len // gpus) * gpus, gpus):
        mult = math.lcm(mult, m.seq * block_size) if m.seq > 1 else mult
    s_pad = -(-seq_len // mult) * mult
    u = _ulysses_degree(gpus, prof.num_heads)
    ul_cost = replace(base, context_parallel=ContextParallelCost("heads", links, head_dim))
    h = _step(hybrid, prof, s_pad, gpus)
    ul = _step(ul_cost, prof, -(-seq_len // u) * u, u)
    same = None
    if u == gpus:
        same = ul["meshes"]
    per_layer = []
    for i, m in enumerate(h["meshes"]):
        row = {"layer": i, "mesh": list(m.shape), "attention_ms": m.attention_ms, "comm_ms": m.comm_ms,
               "fetch_share": m.fetch_share}
        if same is not None:
            row.update(ulysses_attention_ms=same[i].attention_ms, ulysses_comm_ms=same[i].comm_ms)
        per_layer.append(row)
    ul_per_n = ul["step_ms"] * u / gpus
    free = prof.gpu_mem_gib - prof.static_memory_gib(3, gpus)   # ZeRO-3 over the N GPUs
    h["fits"], ul["fits"] = h["activation_gib"] <= free, ul["activation_gib"] <= free
    return {"profile": prof.name, "gpus": gpus, "tokens": seq_len, "padded_tokens": s_pad, "mode": mode,
            "density": dm.source, "heads": prof.num_heads, "ulysses_degree": u,
            "crossover_density": crossover_density(sp=gpus, seq_len=s_pad, dim=prof.dim, block=block_size, links=links),
            "hybrid": {k: v for k, v in h.items() if k != "meshes"},
            "ulysses": {k: v for k, v in ul.items() if k != "meshes"},
            "ulysses_step_ms_per_sample_on_all_gpus": ul_per_n,
            "predicted_gain": ul_per_n / h["step_ms"], "gpu_mem_gib": prof.gpu_mem_gib, "activation_budget_gib": free,
            "meshes": sorted({tuple(r["mesh"]) for r in per_layer}), "layers": per_layer,
            "mesh_shapes": mesh_shapes(gpus, prof.num_heads), "links": ContextParallelCost(mode, links).describe()["links"],
            "efficiency": eff.source, "predicted_only": True}


def _runs(layers: Sequence[dict]) -> list[str]:
    """Consecutive layers with one mesh as ``a-b hxs``."""
    out, start = [], 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or layers[i]["mesh"] != layers[start]["mesh"]:
            h, s = layers[start]["mesh"]
            out.append(f"{start}-{i - 1} {h}x{s}" if i - 1 > start else f"{start} {h}x{s}")
            start = i
    return out


def context_parallel_table(reports: Sequence[dict], *, per_layer: bool = False) -> str:
    """A text table of :func:`context_parallel_report` results (one line per configuration; ``per_layer``: the
    layers' meshes and times under it)."""
    head = (f"{'profile':<18} {'tokens':>7} {'GPUs':>4} {'meshes (layers h x s)':<30} {'att ms':>8} {'comm ms':>8} "
            f"{'Ulysses u':>9} {'U att':>8} {'U comm':>8} {'step ms':>9} {'U step/N':>9} {'gain':>6} {'x-over':>6} "
            f"{'act GiB':>7} {'U act':>7} {'budget':>7}")
    lines = [head, "-" * len(head)]
    for r in reports:
        h, u = r["hybrid"], r["ulysses"]
        lines.append(f"{r['profile']:<18} {r['tokens']:>7} {r['gpus']:>4} {', '.join(_runs(r['layers'])):<30.30} "
                     f"{h['attention_ms']:>8.1f} {h['comm_ms']:>8.1f} {r['ulysses_degree']:>9} {u['attention_ms']:>8.1f} "
                     f"{u['comm_ms']:>8.1f} {h['step_ms']:>9.1f} {r['ulysses_step_ms_per_sample_on_all_gpus']:>9.1f} "
                     f"{r['predicted_gain']:>6.2f} {r['crossover_density']:>6.3f} "
                     f"{h['activation_gib']:>7.1f} {u['activation_gib']:>6.1f}{'' if u['fits'] else '!'} "
                     f"{r['activation_budget_gib']:>7.1f}")
        if per_layer:
            for row in r["layers"]:
                ul = (f"  Ulysses att {row['ulysses_attention_ms']:.2f} comm {row['ulysses_comm_ms']:.2f}"
                      if "ulysses_attention_ms" in row else "")
                lines.append(f"    layer {row['layer']:>3} {row['mesh'][0]}x{row['mesh'][1]:<3} att "
                             f"{row['attention_ms']:.2f} comm {row['comm_ms']:.2f} fetch {row['fetch_share']:.2f}{ul}")
    lines.append("step ms: per sample on the N GPUs (one training step: fwd, recomputed fwd, bwd); U step/N: Ulysses "
                 "at degree u, N/u samples at once, per sample; gain = U step/N / step ms; x-over: density below which "
                 "(1, N) moves fewer bytes than Ulysses; act GiB: activation memory per GPU (hybrid, Ulysses; '!': "
                 "over the budget = GPU memory - ZeRO-3 static memory over N GPUs). Predicted, not measured.")
    return "\n".join(lines)


def simulate_context_parallel(*, profile: str, gpus: int, tokens: Sequence[int], densities="0.1", mode: str = "auto",
                              efficiency=None, links: Optional[CPLinks] = None, as_json: bool = False,
                              per_layer: bool = True) -> str:
    """What ``ds-adaptive simulate --sparse D --context-parallel MODE`` prints: one report per length at ``gpus``
    GPUs, as a table (the layers' meshes and times under each line) or one JSON object."""
    reports = [context_parallel_report(profile=profile, gpus=gpus, seq_len=int(t), densities=densities, mode=mode,
                                       efficiency=efficiency, links=links) for t in tokens]
    if as_json:
        return json.dumps({"context_parallel": reports})
    return context_parallel_table(reports, per_layer=per_layer)
