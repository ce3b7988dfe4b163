"""One-off probe (lead): dynamic-shape FlexAttention block-sparse fwd+bwd on CUDA.

Static (dynamic=False, per-shape compile) vs dynamic (dynamic=True, torch._check(S % 128 == 0),
tensor-captured valid length for the ragged last block): compile count over new (B, S) pairs,
first-call time of a new shape after warm-up, steady-state speed at S = 32,760 / 75,600 (H 12, D 128,
density 0.1) against cuDNN SDPA.
"""
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import torch._dynamo as dynamo
from torch.nn.attention.flex_attention import flex_attention
from triton.testing import do_bench

from ds_adaptive.sparse.attention import block_mask_from_selection
from ds_adaptive.sparse.selection import select_blocks

H, D, BS = 12, 128, 128
dev = torch.device("cuda")
dynamo.config.recompile_limit = 64
dynamo.config.accumulated_recompile_limit = 256


def static_fn():
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


def _inner(q, k, v, bm):
    torch._check(q.size(2) % BS == 0)
    return flex_attention(q, k, v, block_mask=bm)


def _inner_nocheck(q, k, v, bm):
    return flex_attention(q, k, v, block_mask=bm)


def inputs(b, s, density, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    n = math.ceil(s / BS)
    sp = n * BS
    q, k, v = (torch.randn(b, H, sp, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3))
    scores = torch.randn(b, H, n, n, device=dev, generator=g)
    kk = max(1, round(density * n))
    sel = select_blocks(scores, torch.full((H,), kk), seq_len=s, block_size=BS)
    bm = block_mask_from_selection(sel, with_q=True)
    if s % BS:
        st = torch.tensor(s, device=dev)

        def mask_mod(b_, h_, qi, ki):
            return ki < st
        bm.mask_mod = mask_mod
    return q, k, v, bm


def fwd_bwd(fn, q, k, v, bm):
    out = fn(q, k, v, bm) if fn is not None else None
    out.sum().backward()
    return out


def call(fn, q, k, v, bm):
    o = fn(q, k, v, block_mask=bm) if getattr(fn, "_static", False) else fn(q, k, v, bm)
    o.backward(torch.ones_like(o))


def timed_first(fn, b, s):
    q, k, v, bm = inputs(b, s, 0.1, seed=b * 7 + s)
    torch.cuda.synchronize()
    t = time.perf_counter()
    call(fn, q, k, v, bm)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def bench(fn, b, s, density):
    q, k, v, bm = inputs(b, s, density)
    return do_bench(lambda: call(fn, q, k, v, bm), warmup=50, rep=300, return_mode="median")


def dense_ms(b, s):
    g = torch.Generator(device=dev).manual_seed(1)
    q, k, v = (torch.randn(b, H, s, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3))

    def f():
        o = F.scaled_dot_product_attention(q, k, v)
        o.backward(torch.ones_like(o))
    return do_bench(f, warmup=50, rep=300, return_mode="median")


def main():
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    st = static_fn()
    st._static = True
    dyn = torch.compile(_inner, dynamic=True, fullgraph=True)
    dyn_nc = torch.compile(_inner_nocheck, dynamic=True, fullgraph=True)
    # warm-up compiles: B = 1 and B = 2 at a small S
    rows = []
    for name, fn in (("dynamic", dyn), ("dynamic_nocheck", dyn_nc)):
        dynamo.utils.counters.clear()
        t = time.perf_counter()
        for b in (1, 2):
            call(fn, *inputs(b, 1560, 0.3))
        torch.cuda.synchronize()
        warm = time.perf_counter() - t
        firsts = []
        for b, s in [(1, 32760), (2, 15600), (1, 75600), (3, 7800), (1, 20280), (4, 4096), (1, 32761), (2, 14040)]:
            firsts.append({"B": b, "S": s, "first_ms": round(timed_first(fn, b, s), 2)})
        graphs = dict(dynamo.utils.counters["stats"]).get("unique_graphs")
        rows.append({"variant": name, "warmup_s": round(warm, 2), "unique_graphs": graphs, "first_calls": firsts})
        print(name, "warm-up", round(warm, 1), "s; graphs", graphs, "; first calls ms",
              [f["first_ms"] for f in firsts], flush=True)
    out["compile"] = rows
    # static: compile time of one new shape
    t = time.perf_counter()
    call(st, *inputs(1, 32760, 0.1))
    torch.cuda.synchronize()
    out["static_first_s"] = round(time.perf_counter() - t, 2)
    print("static first call (compile) s", out["static_first_s"], flush=True)
    speed = []
    for s in (32760, 75600):
        dn = dense_ms(1, s)
        for dens in (0.05, 0.1, 0.2, 0.4):
            ms = {name: bench(fn, 1, s, dens) for name, fn in (("static", st), ("dynamic", dyn), ("dynamic_nocheck", dyn_nc))}
            row = {"S": s, "density": dens, "dense_ms": round(dn, 3), **{k: round(v, 3) for k, v in ms.items()},
                   "dyn/static": round(ms["dynamic"] / ms["static"], 3),
                   "eff_dynamic": round(dn * dens / ms["dynamic"], 3), "eff_static": round(dn * dens / ms["static"], 3)}
            speed.append(row)
            print(row, flush=True)
    out["speed"] = speed
    path = os.path.join(os.environ.get("OUT", "."), "probe_flex_dynamic.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("| S | density | dense ms | static ms | dynamic ms | dyn/static | eff static | eff dyn |")
    for r in speed:
        print(f"| {r['S']} | {r['density']} | {r['dense_ms']} | {r['static']} | {r['dynamic']} | {r['dyn/static']} | "
              f"{r['eff_static']} | {r['eff_dynamic']} |")


if __name__ == "__main__":
    sys.exit(main())
