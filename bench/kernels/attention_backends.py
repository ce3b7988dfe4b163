"""Which SDPA backend is fastest for the attention calls a Wan training step makes, per shape of a mix.

    python bench/kernels/attention_backends.py [--model wan2.1-1.3b] [--shapes MIX.json] [--batch-tokens 17160]
                                       [--reps 10] [--out JSON]

For each shape of the mix (the model's default mix unless ``--shapes``) at the micro-batch size a 1,707 ms
budget gives on an H200 (``B = max(1, batch_tokens // S)``; 11 x 1,560 for the 480x832 image), it times
torch SDPA forward and forward + backward, in the model's layout (``[B, S, H, Dh]`` transposed to
``[B, H, S, Dh]`` views), for two calls per block:

* self-attention: ``S x S``;
* cross-attention: ``S x L`` text tokens (512 for Wan);

on each backend torch offers on this GPU (cuDNN, flash, memory-efficient), and the model's cross-attention with
its queries in chunks (``ds_adaptive.models.cross_attention``, the chunk count its policy picks on this GPU) against
one call (``--cross-only``: that alone). It prints per shape each backend's
ms and its ratio to cuDNN (the backend torch picks on an H200), then the mix-weighted time of one sample
(``weight x t / B``) per backend and for the best backend per (call, shape): how much a per-shape backend
policy could save at most. Outputs of every backend are checked against cuDNN's (max abs error).

It explains a figure (the attention share of the default job's step); the trainer's A/B is what counts.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sparse_common import cuda_time, run_meta, write_results  # noqa: E402


def backends() -> dict:
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def mix_rows(model: str, shapes_path: str, batch_tokens: int) -> list[dict]:
    """(shape, weight, S, B) of each distinct token count of the mix, heaviest first."""
    from ds_adaptive.models.registry import get_model
    from ds_adaptive.core.shapes import SampleShape

    m = get_model(model)
    mix = json.loads(Path(shapes_path or m.shapes).read_text())["shapes"]
    rows = {}
    for e in mix:
        sh = SampleShape(e["frames"], e["height"], e["width"]).with_grid(m.grid)
        s = sh.tokens
        r = rows.setdefault(s, {"shapes": [], "weight": 0.0, "seq": s, "batch": max(1, batch_tokens // s)})
        r["shapes"].append(str(sh))
        r["weight"] += float(e.get("weight", 1.0))
    return sorted(rows.values(), key=lambda r: r["seq"])


def time_call(backend, q, k, v, dout, reps: int) -> dict:
    from torch.nn.attention import sdpa_kernel

    def fwd():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v)

    def fwd_bwd():
        return torch.autograd.grad(fwd(), (q, k, v), dout)

    out = fwd().detach()
    return {"fwd_ms": cuda_time(fwd, 3, reps), "fwd_bwd_ms": cuda_time(fwd_bwd, 3, reps), "out": out}


def tensors(b: int, sq: int, sk: int, heads: int, head_dim: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def bshd(s):  # the model's layout: [B, S, H, Dh] viewed as [B, H, S, Dh]
        return torch.randn(b, s, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)

    q, k, v = bshd(sq).requires_grad_(True), bshd(sk).requires_grad_(True), bshd(sk).requires_grad_(True)
    return q, k, v, bshd(sq)


def time_split(q, k, v, dout, reps: int) -> dict:
    """The model's cross-attention (``models.cross_attention``, the default backend) with the queries in the
    policy's chunks on this GPU, against one call: ms and the chunk count."""
    from ds_adaptive.models.cross_attention import cross_attention, query_chunks

    b, s, h = q.shape[0], q.shape[2], q.shape[1]
    n = query_chunks(b, s, h, k.shape[2], q.device)
    q4, k4, v4, d4 = (t.transpose(1, 2) for t in (q, k, v, dout))   # back to the model's [B, S, H, Dh]
    out = {"chunks": n}
    for label, c in (("one_call", 1), ("chunked", n)):
        out[f"{label}_fwd_bwd_ms"] = cuda_time(
            lambda c=c: torch.autograd.grad(cross_attention(q4, k4, v4, chunks=c), (q4, k4, v4), d4), 3, reps)
    return out


def measure_row(row: dict, heads: int, head_dim: int, text_len: int, reps: int, cross_only: bool = False) -> dict:
    b, s = row["batch"], row["seq"]
    res = {k: row[k] for k in ("shapes", "weight", "seq", "batch")}
    for call, sk in (("cross", text_len),) if cross_only else (("self", s), ("cross", text_len)):
        q, k, v, dout = tensors(b, s, sk, heads, head_dim, seed=s + sk)
        if call == "cross":
            res["cross_split"] = time_split(q, k, v, dout, reps)
        if cross_only:
            continue
        per = {}
        ref = None
        for name, be in backends().items():
            try:
                t = time_call(be, q, k, v, dout, reps)
            except RuntimeError as e:  # a backend that cannot run this shape on this GPU
                per[name] = {"error": str(e).splitlines()[0][:160]}
                continue
            out = t.pop("out").float()
            ref = out if ref is None else ref
            t["max_abs_err_vs_first"] = float((out - ref).abs().max())
            per[name] = t
        res[call] = per
        del q, k, v, dout
        torch.cuda.empty_cache()
    return res


def weighted(results: list[dict], key: str) -> dict:
    """Mix-weighted ms of one sample's calls per backend (weight x t / B), and the best backend per (call, row)."""
    names = list(backends())
    tot = {n: 0.0 for n in names}
    best = 0.0
    for r in results:
        for call in ("self", "cross"):
            ts = {n: r[call][n][key] for n in names if key in r[call].get(n, {})}
            if "cudnn" not in ts:
                continue
            for n in names:
                tot[n] += r["weight"] * ts.get(n, ts["cudnn"]) / r["batch"]
            best += r["weight"] * min(ts.values()) / r["batch"]
    return {**tot, "best_per_shape": best}


def print_table(results: list[dict]) -> None:
    names = list(backends())
    print("| call | S | B | weight | " + " | ".join(f"{n} fwd+bwd ms" if n == "cudnn" else f"{n} / cudnn"
                                                 for n in names) + " | cudnn fwd ms | cudnn bwd / fwd |")
    print("|---|---:|---:|---:|" + "---:|" * (len(names) + 2))
    for r in results:
        for call in ("self", "cross"):
            per = r[call]
            c = per.get("cudnn", {})
            if "fwd_bwd_ms" not in c:
                print(f"| {call} | {r['seq']} | {r['batch']} | {r['weight']:g} | cudnn: {c.get('error', '?')} |")
                continue
            cells = [f"{c['fwd_bwd_ms']:.3f}"] + [
                f"{per[n]['fwd_bwd_ms'] / c['fwd_bwd_ms']:.3f}" if "fwd_bwd_ms" in per.get(n, {}) else "n/a"
                for n in names[1:]]
            bwd = (c["fwd_bwd_ms"] - c["fwd_ms"]) / c["fwd_ms"]
            print(f"| {call} | {r['seq']} | {r['batch']} | {r['weight']:g} | " + " | ".join(cells)
                  + f" | {c['fwd_ms']:.3f} | {bwd:.2f} |")


def print_split(results: list[dict]) -> None:
    print("| S | B | chunks | cross fwd+bwd ms, one call | chunked | one call / chunked |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        c = r["cross_split"]
        print(f"| {r['seq']} | {r['batch']} | {c['chunks']} | {c['one_call_fwd_bwd_ms']:.3f} | "
              f"{c['chunked_fwd_bwd_ms']:.3f} | {c['one_call_fwd_bwd_ms'] / c['chunked_fwd_bwd_ms']:.3f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan2.1-1.3b")
    ap.add_argument("--shapes", default="", help="a shape-mix json (default: the model's mix)")
    ap.add_argument("--batch-tokens", type=int, default=17160,
                    help="micro-batch size per shape: max(1, this // tokens) (17,160 = 11 x 1,560: the shipped "
                         "H200 plan's 480x832 image micro-batch)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cross-only", action="store_true",
                    help="only the cross-attention with its queries in chunks vs one call (no backend sweep)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "attention_backends.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("attention_backends: needs a CUDA GPU (torch SDPA backends)", file=sys.stderr)
        return 2
    from ds_adaptive.models.registry import get_model

    m = get_model(args.model)
    cfg = m.config()
    heads, head_dim = cfg.num_heads, cfg.dim // cfg.num_heads
    results = []
    for row in mix_rows(args.model, args.shapes, args.batch_tokens):
        results.append(measure_row(row, heads, head_dim, m.text_len, args.reps, args.cross_only))
        print(f"S={row['seq']} B={row['batch']}: done", flush=True)
    print_split(results)
    if args.cross_only:
        write_results(args.out, run_meta(model=args.model, heads=heads, head_dim=head_dim,
                                         batch_tokens=args.batch_tokens, reps=args.reps), results)
        return 0
    print_table(results)
    summary = {key: weighted(results, key) for key in ("fwd_ms", "fwd_bwd_ms")}
    for key, tot in summary.items():
        c = tot["cudnn"]
        print(f"mix-weighted {key} per sample (relative to cudnn): "
              + ", ".join(f"{n} {v / c:.3f}" for n, v in tot.items()))
    write_results(args.out, run_meta(model=args.model, heads=heads, head_dim=head_dim,
                                     batch_tokens=args.batch_tokens, reps=args.reps, weighted=summary), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
