"""Softmax mass kept by each block selection on attention with a video DiT's structure (CPU, ~1 min).

q / k from ``ds_adaptive.attention.planted.planted_rope_qk``: through Wan's 3D RoPE, one head of each kind
(``local`` window, ``far`` regions, attention ``sink``, ``mixed``), in cube order, 128-token-like blocks
scaled down (grid 4x16x16, 32-token blocks of 2x4x4 cubes, head dim 64), at two sharpnesses
(``--temperatures``). Per head the density is what the runtime's profiler chooses (``mass`` 0.99 of
the softmax on 128 sampled rows): per query block (``per_block`` 8 rows of each sampled block, the
default) or per row (the old profiler). At that density each selection picks its top-k key blocks
per query block and we report the exact softmax mass it keeps (mean over every query row):

* ``pooled_lse`` (the default): the real q / k, the query block's mean query, log-sum-exp per key block;
* ``lse`` / ``mean``: the low-rank predictor (rank 16, trained ``--steps`` steps on 4 other inputs with
  the runtime's loss), log-sum-exp / block-mean scores;
* ``oracle``: the exact mean block mass of the query block's rows (the best any block selection can do);
* ``random``: random blocks (the floor).

Also the scoring time per call on this CPU (relative costs only: the GPU figures are bench/kernels/sparse_select.py's).

    python bench/kernels/sparse_mass.py --out bench/out/sparse_mass.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ds_adaptive.attention.selection import blocks_for_density, select_blocks
from ds_adaptive.attention.predictor import LowRankPredictor
from ds_adaptive.attention.cube_order import CubeOrder
from ds_adaptive.attention.planted import PLANTED_KINDS, planted_rope_qk
from ds_adaptive.attention.profiler import block_mass, exact_logits, profile_rows, sample_row_groups, sample_rows
from ds_adaptive.attention.scores import pooled_lse_scores

GRID, BLOCK, CUBE, HEAD_DIM, RANK = (4, 16, 16), 32, (2, 4, 4), 64, 16


def _kept(bm: torch.Tensor, sel, s: int) -> list[float]:
    rows = sel.dense_block_mask().repeat_interleave(BLOCK, dim=2)[:, :, :s]
    return [round(float(x), 4) for x in (bm * rows).sum(-1).mean(dim=(0, 2))]


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def run(temperature: float, steps: int, mass: float) -> dict:
    order = CubeOrder(CUBE)
    h = len(PLANTED_KINDS)
    make = lambda seed: planted_rope_qk(GRID, h, HEAD_DIM, order=order, seed=seed, temperature=temperature)  # noqa: E731
    pool = [make(s) for s in range(4)]
    q, k = make(99)
    s = q.shape[1]
    nb = s // BLOCK
    bm = block_mass(exact_logits(q, k, torch.arange(s)), BLOCK)
    gen = torch.Generator().manual_seed(0)
    pred = LowRankPredictor(1, h, HEAD_DIM, RANK, seed=0)
    opt = torch.optim.AdamW(pred.parameters(), lr=3e-3)
    for i in range(steps):
        qq, kk = pool[i % 4]
        r = sample_rows(s, 64, generator=gen)
        loss = pred.loss(0, qq[:, r], kk, exact_logits(qq, kk, r), 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    scorers = {"pooled_lse": lambda: pooled_lse_scores(q, k, BLOCK),
               "lse": lambda: pred.block_scores(0, q, k, BLOCK, 0, mode="lse"),
               "mean": lambda: pred.block_scores(0, q, k, BLOCK, 0, mode="mean"),
               "oracle": lambda: bm.view(1, h, nb, BLOCK, nb).mean(3),
               "random": lambda: torch.rand(1, h, nb, nb, generator=torch.Generator().manual_seed(1))}
    out = {"temperature": temperature, "kinds": list(PLANTED_KINDS), "predictor_loss": float(loss.detach()),
           "profiles": {}}
    for profile in ("per_block", "per_row"):
        if profile == "per_block":
            rows, per = sample_row_groups(s, 128, BLOCK, generator=torch.Generator().manual_seed(2))
        else:
            rows, per = sample_rows(s, 128, generator=torch.Generator().manual_seed(2)), 1
        dens = profile_rows(exact_logits(q, k, rows), rows, BLOCK, mass, per_block=per).density
        kph = blocks_for_density(dens.clamp(0.02, 1.0), nb)
        res = {"density": [round(float(x), 4) for x in kph.float() / nb]}
        for name, fn in scorers.items():
            scores, ms = _timed(fn)
            res[name] = {"kept": _kept(bm, select_blocks(scores.clone(), kph, seq_len=s, block_size=BLOCK), s),
                         "score_ms_cpu": round(ms, 2)}
        out["profiles"][profile] = res
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[30.0, 60.0])
    ap.add_argument("--steps", type=int, default=300, help="predictor training steps (lse / mean)")
    ap.add_argument("--mass", type=float, default=0.99, help="the profiler's mass target (the config's default)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    results = [run(t, args.steps, args.mass) for t in args.temperatures]
    print(f"softmax mass kept per head ({', '.join(PLANTED_KINDS)}) at the profiler's density (mass {args.mass})")
    print(f"{'T':>4} {'profile':>9} {'selection':>10}  kept per head                      density per head")
    for r in results:
        for prof, res in r["profiles"].items():
            for name in ("pooled_lse", "lse", "mean", "oracle", "random"):
                print(f"{r['temperature']:4.0f} {prof:>9} {name:>10}  {str(res[name]['kept']):34} {res['density']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"grid": GRID, "block": BLOCK, "head_dim": HEAD_DIM, "rank": RANK,
                                          "mass": args.mass, "results": results}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
