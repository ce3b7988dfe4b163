"""Compile the Triton block-sparse kernels for a GPU architecture on any machine (no GPU needed) and report
per tile config: shared memory, registers per thread, register spills and resident programs per SM (sm90 limits) (``cuobjdump --dump-resource-usage``
of the cubin, with the ptxas / cuobjdump that ship in triton's wheel).

It is how the tile candidates of ``bench/kernels/sparse_backends.py`` (``TILES``) and ``default_config`` were chosen
without a GPU: a config that spills (STACK > 0) or needs more shared memory than the SM has is not worth a
GPU minute. Results depend on the triton version (the GPU nodes' torch pins its own): run it with that one.

    python bench/kernels/sparse_kernel_compile.py --arch 90 --head-dim 128 --block 128 [--out compile.json]
    python bench/kernels/sparse_kernel_compile.py --arch 90 --head-dim 128 --block 64 --kernels scores   # block scores
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PTRS = {
    "fwd": {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "Lse": "*fp32", "KvNum": "*i32", "KvIdx": "*i32"},
    "dq": {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "DQ": "*bf16", "Lse": "*fp32", "Delta": "*fp32",
           "KvNum": "*i32", "KvIdx": "*i32"},
    "dkdv": {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "DK": "*bf16", "DV": "*bf16", "DQacc": "*fp32",
             "Lse": "*fp32", "Delta": "*fp32", "QNum": "*i32", "QIdx": "*i32"},
    "scores": {"Qbar": "*bf16", "K": "*bf16", "Out": "*fp32"},
}
CONSTEXPRS = ("BLOCK", "BLOCK_M", "BLOCK_N", "BLOCK_Q", "HEAD_DIM", "ATOMIC_DQ", "TMA_REDUCE")


def compile_tile(kind: str, tile, *, head_dim: int, block: int, arch: int) -> dict:
    """Compile one kernel for ``arch``; ``{"smem_kib", "regs", "spill_bytes"}`` (or ``{"error"}``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ds_adaptive.attention.kernels import _triton_block_scores as KS
    from ds_adaptive.attention.kernels import _triton_block_sparse as K

    fn = {"fwd": K.block_sparse_fwd, "dq": K.block_sparse_bwd_dq,
          "scores": KS.pooled_lse_scores_kernel}.get(kind, K.block_sparse_bwd_dkdv)
    ptrs = PTRS["dkdv" if kind == "atomic" else kind]
    sig = {p: ptrs.get(p, "fp32" if p in ("qk_scale", "sm_scale") else "constexpr" if p in CONSTEXPRS else "i32")
           for p in fn.arg_names}
    consts = ({"BLOCK": block, "BLOCK_Q": tile.block_q, "HEAD_DIM": head_dim} if kind == "scores" else
              {"BLOCK": block, "BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "HEAD_DIM": head_dim})
    if fn is K.block_sparse_bwd_dkdv:
        consts["ATOMIC_DQ"] = kind == "atomic"
        consts["TMA_REDUCE"] = True
    try:
        k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": tile.num_warps, "num_stages": tile.num_stages})
    except Exception as exc:  # e.g. out of shared memory: that is the answer for this tile
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    fields = dict(x.split(":", 1) for x in next((ln for ln in usage.splitlines() if "REG:" in ln), "").split() if ":" in x)
    regs = int(fields.get("REG", -1))
    smem = k.metadata.shared / 1024
    # resident programs per SM on sm90: 228 KiB shared memory (1 KiB reserved per block), 64 Ki registers
    per_sm = min(int(228 // (smem + 1)), 65536 // max(1, regs * 32 * tile.num_warps), 32 // tile.num_warps)
    return {"smem_kib": smem, "regs": regs, "spill_bytes": int(fields.get("STACK", -1)), "programs_per_sm": per_sm}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--kernels", nargs="+", default=["fwd", "dq", "dkdv", "atomic"],
                   help="fwd dq dkdv atomic (block-sparse attention), scores (the selection's block scores)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton

    from sparse_backends import _tiles
    from sparse_select_cost import score_tiles

    rows = []
    print(f"# triton {triton.__version__}, sm{args.arch}, head dim {args.head_dim}, block {args.block}")
    for kind in args.kernels:
        for t in (score_tiles() if kind == "scores" else _tiles(args.block, kind)):
            r = {"kernel": kind, "tile": t.short(), **compile_tile(kind, t, head_dim=args.head_dim, block=args.block,
                                                                   arch=args.arch)}
            rows.append(r)
            print(f"{kind:6s} {t.short():14s} " + (r["error"] if "error" in r else
                  f"smem {r['smem_kib']:6.1f} KiB  regs {r['regs']:3d}  spills {r['spill_bytes']} B  "
                  f"programs/SM {r['programs_per_sm']}"), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"triton": triton.__version__, "arch": args.arch, "head_dim": args.head_dim,
                                              "block": args.block, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
