"""The measuring half of the sparse runtime: profiled head densities, recall, selection timers, and the
predictor's training (its AdamW step after the one all-reduce of a profiling step).

:class:`DensityProfiler` keeps ``head_density [L, H]`` (original head ids, the same on every rank after
:meth:`exchange`) and this step's sums; the runtime calls :meth:`profile_and_train` from a layer's forward
on profiling steps and :meth:`exchange` from its ``step()``.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from ds_adaptive.core.config import SparseAttentionConfig
from ds_adaptive.attention.predictor import LowRankPredictor
from ds_adaptive.attention.profiler import exact_logits, profile_rows, sample_row_groups

__all__ = ["DensityProfiler", "clock", "elapsed_ms"]


def clock(device: torch.device):
    """A CUDA event recorded now on ``device``'s stream, else ``time.perf_counter()`` (no sync either way)."""
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def elapsed_ms(a, b) -> float:
    """Milliseconds between two :func:`clock` readings (a CUDA pair synchronises on ``b``)."""
    if isinstance(a, float):
        return (b - a) * 1e3
    b.synchronize()
    return a.elapsed_time(b)


class DensityProfiler:
    """Per-head densities, recall and the predictor's training for one model (see the module docstring).

    ``predictor``: the selector's :class:`LowRankPredictor` (trained here with its own AdamW when
    ``train_predictor``); ``group``: the all-reduce group of :meth:`exchange` (None: the world = DP x SP);
    ``seed_rank``: this rank's row-sampler stream (``cfg.seed + 1 + 7919 * seed_rank``)."""

    def __init__(self, cfg: SparseAttentionConfig, predictor: LowRankPredictor, *, num_layers: int, num_heads: int,
                 device: torch.device, train_predictor: bool, group=None, seed_rank: int = 0):
        self.cfg, self.predictor = cfg, predictor
        self.num_layers, self.num_heads, self.device = num_layers, num_heads, device
        self.train_predictor, self.group = train_predictor, group
        self.optimizer = torch.optim.AdamW(predictor.parameters(), lr=cfg.predictor_lr, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(cfg.seed + 1 + 7919 * seed_rank)
        # profiled density of every head [L, H] (original head ids), the same on every rank: each rank
        # profiles the heads it holds, exchange() all-reduces the sums over the group (DP x SP)
        self.head_density = torch.full((num_layers, num_heads), float("nan"))
        self.reset()

    def reset(self) -> None:
        """Forget this step's sums, timers and device scalars (after :meth:`exchange` / the runtime's step)."""
        L = self.num_layers
        self.loss_sum = torch.zeros(L, dtype=torch.float64, device=self.device)
        self.loss_n = torch.zeros(L, dtype=torch.float64, device=self.device)
        self.density_sum = torch.zeros(L, self.num_heads, dtype=torch.float64, device=self.device)
        self.density_n = torch.zeros(L, self.num_heads, dtype=torch.float64, device=self.device)
        self.select_events: list[list] = [[] for _ in range(L)]
        self.select_shapes: list[list] = [[] for _ in range(L)]
        self.selected: dict[int, torch.Tensor] = {}
        self.recall: dict[int, torch.Tensor] = {}

    def profile_and_train(self, layer: int, q: torch.Tensor, k: torch.Tensor, selection, valid_len,
                          heads: tuple[int, ...], head_arg) -> None:
        """Exact logits of sampled query rows of q against k ``[B, S, Hl, Dh]``: the heads' density (blocks
        for ``mass``) and the selection's recall into this step's sums, and (``train_predictor``) the
        predictor's loss backpropagated in its own graph (gradients accumulate until :meth:`exchange`)."""
        cfg = self.cfg
        rows, per_block = sample_row_groups(q.shape[1], cfg.sample_rows, cfg.block_size, generator=self.generator,
                                            valid_len=valid_len, device=q.device)
        qd, kd = q.detach(), k.detach()
        with torch.no_grad():
            logits = exact_logits(qd, kd, rows, valid_len=valid_len)
            stats = profile_rows(logits, rows, cfg.block_size, cfg.mass, selection, per_block=per_block)
        if self.train_predictor:
            # the predictor's own graph: identity saved-tensor hooks shield it from an enclosing
            # activation-checkpoint region (whose hooks would otherwise pack these tensors)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                loss = self.predictor.loss(layer, qd[:, rows], kd, logits, head_arg, valid_len,
                                           cos_weight=cfg.predictor_cos_weight)
                loss.backward()
            self.loss_sum[layer] += loss.detach().to(self.loss_sum.device, torch.float64)
            self.loss_n[layer] += 1
        idx = list(heads)
        self.density_sum[layer, idx] += stats.density.detach().to(self.density_sum.device, torch.float64)
        self.density_n[layer, idx] += 1
        if stats.recall is not None:  # a device tensor: read in step(), no sync per layer here
            self.recall[layer] = stats.recall.mean()

    def exchange(self) -> tuple[Optional[float], list, dict]:
        """One all-reduce of densities (+ predictor gradients and losses); the predictor's AdamW step.
        Returns ``(mean predictor loss or None, per-layer mean density or None, {layer: its mean predictor
        loss} of the layers trained)``; ``head_density`` takes the measured heads' new values."""
        params = list(self.predictor.parameters()) if self.train_predictor else []
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        dsum, dn = self.density_sum.to(self.loss_sum.device), self.density_n.to(self.loss_sum.device)
        flat = torch.cat([g.reshape(-1).double() for g in grads]
                         + [dsum.reshape(-1), dn.reshape(-1), self.loss_sum, self.loss_n])
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(flat, group=self.group)
        L, LH = self.num_layers, self.num_layers * self.num_heads
        n_total = flat[-L:]
        loss_sum = flat[-2 * L:-L]
        dens = flat[-2 * L - 2 * LH:-2 * L].view(2, L, self.num_heads).cpu()
        trained = n_total > 0
        if bool(trained.any()):
            # each rank's loss is the mean over its local heads: a head's summed gradient / n_total is
            # its share of the mean over all heads and contributions (the same for any SP degree)
            per_layer = n_total.clamp_min(1.0)
            off = 0
            for p in params:
                n = p.numel()
                g = flat[off:off + n].view(p.shape) / per_layer.view(-1, *([1] * (p.dim() - 1)))
                p.grad = g.to(p.dtype)
                off += n
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        layer_loss = torch.where(trained, loss_sum / n_total.clamp_min(1.0), torch.nan).cpu()
        measured = dens[1] > 0
        self.head_density[measured] = (dens[0][measured] / dens[1][measured]).float()
        layer_density = [float(self.head_density[i].mean()) if bool(measured[i].any()) else None
                         for i in range(self.num_layers)]
        mean_loss = float(layer_loss[trained.cpu()].mean()) if bool(trained.any()) else None
        return mean_loss, layer_density, {i: float(layer_loss[i]) for i in range(L) if bool(trained[i])}

    def record_selection(self, layer: int, t0, device: torch.device, shape: tuple[int, int], selection) -> None:
        """A selection call of this step: its timer pair, its ``(B, S)`` (host ints: the predicted time in
        step()) and, when it selected, its mean selected share (a device scalar, read in step())."""
        self.select_events[layer].append((t0, clock(device)))
        self.select_shapes[layer].append(shape)
        if selection is not None:
            self.selected[layer] = selection.density().mean()

    def step_figures(self, last: dict, decision, sp_size: int) -> None:
        """This step's selected share, recall and selection times (measured, and the decision cost's
        prediction for the same calls) into ``last`` (per-layer lists)."""
        for i, d in self.selected.items():
            last["selected_density"][i] = float(d)
        for i, r in self.recall.items():
            last["recall"][i] = float(r)
        # this step's figures only: a layer that selected nothing this step (every micro-batch ran it dense) reads
        # NaN, not the time of an earlier step (the step's sums then count no selection for it)
        last["select_ms"] = [sum(elapsed_ms(a, b) for a, b in evs) / len(evs) if evs else float("nan")
                             for evs in self.select_events]
        last["select_ms_predicted"] = [
            sum(decision.layer_selection_ms(s, sp_size, self.num_heads, batch=b) for b, s in calls) / len(calls)
            if calls and decision is not None else float("nan") for calls in self.select_shapes]
