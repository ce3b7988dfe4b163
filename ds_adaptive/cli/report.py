"""``ds-adaptive report``: the fused LayerNorm-Modulate op's status (DeepSpeed registry, compatibility, build),
from :func:`ds_adaptive.ops.report.collect`.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional

from ds_adaptive.ops.ln_modulate import KERNELS_ENV_VAR
from ds_adaptive.ops.report import collect


def _print(info: Dict[str, Any]) -> None:
    def row(k: str, v: Any) -> None:
        print(f"  {k:<22} {v}")

    print("ds_adaptive fused LayerNorm-Modulate op")
    row("mode", f"{info.get('mode')}  ({info.get('mode_env')}=auto|fused|reference)")
    row("torch", f"{info.get('torch')}  (CUDA {info.get('torch_cuda')}, "
                 f"{'GPU: ' + ', '.join(info['gpus']) if info.get('gpus') else 'no GPU visible'})")
    row("deepspeed", info.get("deepspeed"))
    if "registered" not in info:
        return
    reg = info["registered"]
    row("registry", f"accelerator {info['accelerator']}: get_op_builder -> "
                    f"{'LNModulateBuilder' if reg['get_op_builder'] else 'NOT registered'}, "
                    f"create_op_builder -> {reg['create_op_builder']}, in ALL_OPS: {reg['in_ALL_OPS']}")
    row("compatible", "yes" if info["compatible"] else "no")
    for r in info["reasons"]:
        row("", f"- {r}")
    row("build", "prebuilt ds_adaptive.ops._ln_modulate_C installed" if info["prebuilt"]
        else f"JIT on first use (cache: {info['jit_cache']})")
    arch = info["arch"]
    row("TORCH_CUDA_ARCH_LIST", arch.get("TORCH_CUDA_ARCH_LIST"))
    if "error" in arch:
        row("arch error", arch["error"])
    if "archs" in arch:
        for note in arch.get("notes", []):
            row("arch", note)
        row("nvcc flags", " ".join(arch["nvcc_flags"]))
    if "load" in info:
        st = info["load"]
        row("load", f"loaded from {st['source']}" if st["loaded"] else f"FAILED: {st['error']}")
        if st.get("kernels"):

            row("kernels", f"{st['kernels']}  ({KERNELS_ENV_VAR}; v1 = row in registers, v2 = staged cp.async)")
    if "smoke_max_abs_err" in info:
        row("smoke test", f"max |fused - reference| = {info['smoke_max_abs_err']:.3g} (bf16, D=1536)")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="ds-adaptive report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", action="store_true", help="load (JIT-build if needed) the op and smoke-test it")
    ap.add_argument("--ds-report", action="store_true", help="also print DeepSpeed's op report (ds_report)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    info = collect(load=args.load)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        _print(info)
    if args.ds_report and "registered" in info:
        from deepspeed.env_report import op_report

        op_report(verbose=False)
    if args.load and not info.get("load", {}).get("loaded"):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
