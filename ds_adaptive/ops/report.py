"""``ds-adaptive report``: status of the fused LayerNorm-Modulate op.

Prints the path-selection mode, torch / CUDA / DeepSpeed versions, whether DeepSpeed's registry
resolves ``LNModulateBuilder``, whether the op can be built here (and why not), whether a prebuilt
extension is installed or a JIT build would run (and where it is cached), and how
TORCH_CUDA_ARCH_LIST is turned into nvcc flags. ``--load`` also loads (or JIT-builds) the op and
runs it once on a small CUDA input; ``--ds-report`` appends DeepSpeed's own op report.
"""
from __future__ import annotations

import os
from typing import Any, Dict

from ds_adaptive.ops.builder import LNModulateBuilder, gencode_flags, parse_arch_list
from ds_adaptive.ops.ln_modulate import ENV_VAR, get_mode, ln_modulate, ln_modulate_reference, load_op, op_status
from ds_adaptive.ops.registry import is_registered, register_ops


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
