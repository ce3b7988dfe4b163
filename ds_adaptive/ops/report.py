"""``ds-adaptive report``: status of the fused LayerNorm-Modulate op.

Prints the path-selection mode, torch / CUDA / DeepSpeed versions, whether DeepSpeed's registry
resolves ``LNModulateBuilder``, whether the op can be built here (and why not), whether a prebuilt
extension is installed or a JIT build would run (and where it is cached), and how
TORCH_CUDA_ARCH_LIST is turned into nvcc flags. ``--load`` also loads (or JIT-builds) the op and
runs it once on a small CUDA input; ``--ds-report`` appends DeepSpeed's own op report.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional
from ds_adaptive.ops.ln_modulate import ENV_VAR, get_mode, load_op, op_status
from ds_adaptive.ops.builder import LNModulateBuilder, parse_arch_list, gencode_flags
from ds_adaptive.ops.registry import is_registered, register_ops
from ds_adaptive.ops.ln_modulate import ln_modulate, ln_modulate_reference
from ds_adaptive.ops.ln_modulate import KERNELS_ENV_VAR


def collect(load: bool = False) -> Dict[str, Any]:
    """The report as a dict (what ``main`` prints)."""
    import torch

    info: Dict[str, Any] = {}

    try:
        info["mode"] = get_mode()
    except ValueError as e:
        info["mode"] = f"invalid ({e})"
    info["mode_env"] = ENV_VAR
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    info["gpus"] = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                    if torch.cuda.is_available() else [])
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except Exception as e:  # noqa: BLE001
        info["deepspeed"] = f"not importable: {e}"
        return info


    register_ops()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    acc = get_accelerator()
    info["accelerator"] = acc._name
    info["registered"] = {"get_op_builder": is_registered(),
                          "create_op_builder": type(acc.create_op_builder("LNModulateBuilder")).__name__,
                          "in_ALL_OPS": LNModulateBuilder.NAME in ALL_OPS}
    b = LNModulateBuilder()
    ok, reasons = b.compatibility()
    info["compatible"] = ok
    info["reasons"] = reasons
    info["prebuilt"] = b.prebuilt_available()
    info["jit_cache"] = os.environ.get("TORCH_EXTENSIONS_DIR") or "~/.cache/torch_extensions (torch default)"
    raw = os.environ.get("TORCH_CUDA_ARCH_LIST")
    arch: Dict[str, Any] = {"TORCH_CUDA_ARCH_LIST": raw}
    try:
        archs = b.arch_list()
        arch["archs"] = [str(a) for a in archs]
        arch["nvcc_flags"] = gencode_flags(archs)
        arch["notes"] = b.arch_notes
    except (ValueError, RuntimeError) as e:
        arch["error"] = str(e)
    if raw:
        try:
            parse_arch_list(raw)
        except ValueError as e:
            arch["error"] = str(e)
    info["arch"] = arch
    if load:
        ext = load_op(strict=False)
        info["load"] = op_status()
        if ext is not None and torch.cuda.is_available():

            x = torch.randn(2, 7, 1536, device="cuda", dtype=torch.bfloat16)
            mod = torch.randn(2, 6, 1536, device="cuda")
            y = ln_modulate(x, mod[:, 0:1], mod[:, 1:2])
            ref = ln_modulate_reference(x, mod[:, 0:1], mod[:, 1:2])
            info["smoke_max_abs_err"] = float((y.float() - ref.float()).abs().max())
    return info


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
