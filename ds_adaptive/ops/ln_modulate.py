"""LayerNorm-Modulate (adaLN): ``y = LayerNorm(x) * (1 + scale) + shift``.

The op lives in C++ (``csrc/ln_modulate``), registered with the dispatcher when the extension
loads: ``torch.ops.ds_adaptive.ln_modulate_apply`` (public entry: argument checks, layout
normalisation), ``ln_modulate`` / ``ln_modulate_backward`` (schemas, CUDA kernels, the same math
on CPU, Meta implementations for torch.compile), autograd as a hand-written C++ autograd node
(see ``csrc/ln_modulate/ln_modulate_ops.cpp``). No Python runs per call beyond the path choice:

* ``ln_modulate()``: the public function, a drop-in for ``ln_modulate_reference`` and for
  ``WanModel.set_ln_modulate``: the C++ op on CUDA tensors when it is loaded, else the torch
  reference; ``LayerNormModulate``: the same as a module.

Path selection (``DS_ADAPTIVE_LN_MODULATE``):
  ``auto`` (default): fused on CUDA tensors when the op loads (prebuilt or JIT-built through
  DeepSpeed's builder), else the torch reference with exactly one warning saying why;
  ``fused``: the fused op or an error; ``reference``: always the torch reference.

Kernel generation (``DS_ADAPTIVE_LN_MODULATE_KERNELS``, read when the op loads; at run time
``set_kernel_policy``): ``v1`` (one row per CTA in registers) or ``v2`` (rows staged through shared
memory with cp.async, sample-aware row dealing, single-launch finalize) per direction and
modulation layout, e.g. ``v1``, ``v2``, ``fwd=v2,bwd_sample=v1``; see ``parse_kernel_policy``.
Unset: the compiled-in defaults (``csrc/ln_modulate/ln_modulate.h: KernelPolicy``).
"""
from __future__ import annotations

import functools
import os
import threading
import warnings
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from ds_adaptive.ops.builder import LNModulateBuilder

ENV_VAR = "DS_ADAPTIVE_LN_MODULATE"
MODES = ("auto", "fused", "reference")
KERNELS_ENV_VAR = "DS_ADAPTIVE_LN_MODULATE_KERNELS"
# Kernel-generation policy fields, in the order of the extension's get_kernels / set_kernels.
POLICY_KEYS = ("fwd_sample", "fwd_token", "bwd_sample", "bwd_token", "finalize")
_POLICY_GROUPS = {
    "all": POLICY_KEYS,
    "fwd": ("fwd_sample", "fwd_token"),
    "bwd": ("bwd_sample", "bwd_token", "finalize"),
    "sample": ("fwd_sample", "bwd_sample"),
    "token": ("fwd_token", "bwd_token"),
}
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Register-resident limits of the kernels (csrc/ln_modulate/ln_modulate.h): rows of up to 8192
# elements on every path, 16384 for 16-bit x with D % 8 == 0 (16-byte loads).
MAX_D_ANY = 8192
MAX_D_VEC16 = 16384


# ------------------------------------------------------------------------------------------------
# Torch reference (the contract: signature and numerics the model calls)
# ------------------------------------------------------------------------------------------------
def ln_modulate_reference(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
                          weight: Optional[torch.Tensor] = None,
                          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Torch reference. x [B, S, D]; shift/scale [B, 1, D], [B, D] or [B, S, D] (any dtype).

    Statistics and the modulation are computed in fp32, rounded once to x.dtype
    (diffusers' WanTransformer3DModel numerics).
    """
    if shift.dim() == 2:
        shift = shift.unsqueeze(1)
    if scale.dim() == 2:
        scale = scale.unsqueeze(1)
    xf = x.float()
    y = F.layer_norm(xf, (x.shape[-1],), None if weight is None else weight.float(),
                     None if bias is None else bias.float(), eps)
    y = y * (1 + scale.float()) + shift.float()
    return y.to(x.dtype)


# ------------------------------------------------------------------------------------------------
# Extension loading (once per process) and path selection
# ------------------------------------------------------------------------------------------------
class _OpState:
    def __init__(self):
        self.lock = threading.Lock()
        self.tried = False
        self.ext = None
        self.error: Optional[str] = None
        self.source: Optional[str] = None  # "prebuilt" / "jit"
        self.apply = None  # torch.ops.ds_adaptive.ln_modulate_apply.default once the extension is loaded
        # the extension's `apply`: the same op called through the dispatcher without torch.ops' Python
        # argument parsing (eager calls on plain tensors: less host time per call)
        self.fast_apply = None
        # the extension's `try_apply`: the eager fast path in one C++ call (its conditions checked there;
        # None when they do not hold)
        self.try_apply = None
        self.warned: set = set()
        self.mode = "auto"  # last mode read from the environment
        self.fast_raw = None  # the raw environment value `mode` was parsed from (the fast path's _mode)
        self.fast_valid = False
        self.calls = {"fused": 0, "reference": 0}  # eager ln_modulate calls per path (call_counts)


_STATE = _OpState()


def _not_compiled(fn):
    """``torch.compiler.disable(fn)``, made at the first call: importing torch._dynamo costs seconds of CPU, which a
    process that only imports the model (a dry run, the CLI) never needs. A first call inside a compiled function
    works too (a test checks it: the function runs once, eagerly)."""
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        disabled = getattr(fn, "_ds_adaptive_disabled", None)
        if disabled is None:
            disabled = fn._ds_adaptive_disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)
    return inner


def call_counts() -> dict:
    """Eager ``ln_modulate`` calls so far that ran the fused op / the torch reference (compiled calls are
    not counted). The trainer's summary reports from this what really ran, not what was asked for."""
    return dict(_STATE.calls)


@_not_compiled
def _load_extension():
    """The compiled module, or None (reason in _STATE.error). Never raises."""
    if _STATE.tried:
        return _STATE.ext
    with _STATE.lock:
        if _STATE.tried:
            return _STATE.ext
        try:

            builder = LNModulateBuilder()
            ext = builder.load(verbose=False)
            if hasattr(ext, "set_kernels"):
                _apply_kernel_env(ext)
            _STATE.apply = torch.ops.ds_adaptive.ln_modulate_apply.default  # registered by the extension
            _STATE.fast_apply = getattr(ext, "apply", None)
            _STATE.try_apply = getattr(ext, "try_apply", None)
            _STATE.ext = ext
            _STATE.source = builder.loaded_from
        except Exception as e:  # noqa: BLE001 - any failure means "use the reference"
            _STATE.ext = None
            _STATE.error = f"{type(e).__name__}: {e}".strip()
        _STATE.tried = True
    return _STATE.ext


def parse_kernel_policy(spec: str, defaults: dict) -> dict:
    """Kernel-generation policy from a spec string, applied left to right on top of ``defaults``
    (a dict over POLICY_KEYS with values 1 or 2).

    ``""`` / ``"default"``: the defaults; ``"v1"`` / ``"v2"``: every field; otherwise a comma (or
    space) separated list of ``key=v1|v2`` (``1`` / ``2`` accepted too) with keys ``fwd_sample``,
    ``fwd_token``, ``bwd_sample``, ``bwd_token``, ``finalize`` or the groups ``all``, ``fwd``
    (both forward fields), ``bwd`` (both backward fields and the finalize), ``sample``
    (fwd_sample + bwd_sample), ``token`` (fwd_token + bwd_token). Raises ValueError naming the bad
    item.
    """
    policy = {k: int(defaults[k]) for k in POLICY_KEYS}
    text = (spec or "").strip().lower()
    if text in ("", "default"):
        return policy

    def gen(value: str, item: str) -> int:
        v = value.strip()
        if v in ("v1", "1"):
            return 1
        if v in ("v2", "2"):
            return 2
        raise ValueError(f"{KERNELS_ENV_VAR}: bad generation {value!r} in {item!r} (expected v1 or v2)")

    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        if "=" not in item:
            g = gen(item, item)
            policy = {k: g for k in POLICY_KEYS}
            continue
        key, value = item.split("=", 1)
        key = key.strip()
        keys = _POLICY_GROUPS.get(key, (key,) if key in POLICY_KEYS else None)
        if keys is None:
            raise ValueError(f"{KERNELS_ENV_VAR}: unknown key {key!r} in {item!r} (expected one of "
                             f"{', '.join(POLICY_KEYS + tuple(_POLICY_GROUPS))})")
        g = gen(value, item)
        for k in keys:
            policy[k] = g
    return policy


def format_kernel_policy(policy: dict) -> str:
    """The spec string that reproduces ``policy`` (for DS_ADAPTIVE_LN_MODULATE_KERNELS)."""
    return ",".join(f"{k}=v{int(policy[k])}" for k in POLICY_KEYS)


def _apply_kernel_env(ext) -> None:
    spec = os.environ.get(KERNELS_ENV_VAR, "")
    if spec.strip():
        defaults = dict(zip(POLICY_KEYS, ext.default_kernels()))
        policy = parse_kernel_policy(spec, defaults)
        ext.set_kernels([policy[k] for k in POLICY_KEYS])


def kernel_policy() -> Optional[dict]:
    """The current kernel-generation policy of the loaded op ({field: 1 or 2}), or None when the
    op is not loaded."""
    ext = _STATE.ext
    if ext is None:
        return None
    return dict(zip(POLICY_KEYS, (int(v) for v in ext.get_kernels())))


def set_kernel_policy(spec="default") -> dict:
    """Set the kernel-generation policy of the fused op (a spec string as parse_kernel_policy
    takes, applied on top of the compiled-in defaults, or a dict over POLICY_KEYS); returns the
    policy now in effect. Loads the op (RuntimeError if it is unavailable). Kernels are chosen at
    launch: CUDA graphs keep the kernels they were captured with."""
    ext = load_op(strict=True)
    defaults = dict(zip(POLICY_KEYS, (int(v) for v in ext.default_kernels())))
    if isinstance(spec, dict):
        unknown = set(spec) - set(POLICY_KEYS)
        if unknown:
            raise ValueError(f"set_kernel_policy: unknown keys {sorted(unknown)}")
        policy = {**defaults, **{k: int(v) for k, v in spec.items()}}
        if any(v not in (1, 2) for v in policy.values()):
            raise ValueError(f"set_kernel_policy: every value must be 1 or 2, got {spec}")
    else:
        policy = parse_kernel_policy(str(spec), defaults)
    ext.set_kernels([policy[k] for k in POLICY_KEYS])
    return kernel_policy()


def load_op(strict: bool = False):
    """Load (or JIT-build) the fused op now; returns the extension module or None.
    ``strict=True`` raises RuntimeError with the reason instead of returning None."""
    ext = _load_extension()
    if ext is None and strict:
        raise RuntimeError(f"the fused ln_modulate op is unavailable: {_STATE.error}")
    return ext


def op_status() -> dict:
    """What ``ln_modulate`` would do on a CUDA tensor now (does not load the op)."""
    policy = kernel_policy() if _STATE.ext is not None and hasattr(_STATE.ext, "get_kernels") else None
    return {"mode": get_mode(), "tried": _STATE.tried, "loaded": _STATE.ext is not None,
            "source": _STATE.source, "error": _STATE.error,
            "kernels": format_kernel_policy(policy) if policy else None}


def get_mode() -> str:
    """The path-selection mode from DS_ADAPTIVE_LN_MODULATE (auto | fused | reference). Read on
    every eager call; while torch.compile traces, the value of the last eager read (or "auto")."""
    if torch.compiler.is_compiling():
        return _STATE.mode
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={mode!r}: expected one of {', '.join(MODES)}")
    _STATE.mode = mode
    return mode


# The environment as CPython's os.environ keeps it (a dict of encoded keys / values, updated by every
# os.environ assignment and by monkeypatch.setenv): one dict lookup instead of os.environ.get's key
# encoding (host time on every call).
try:
    _ENV_DATA, _ENV_KEY = os.environ._data, os.environ.encodekey(ENV_VAR)  # type: ignore[attr-defined]
except AttributeError:  # not CPython's os._Environ
    _ENV_DATA, _ENV_KEY = None, None


def _mode() -> str:
    """get_mode() for the eager fast path: the environment is still read on every call, parsed only
    when the value changed."""
    raw = _ENV_DATA.get(_ENV_KEY) if _ENV_DATA is not None else os.environ.get(ENV_VAR)
    if _STATE.fast_valid and raw == _STATE.fast_raw:
        return _STATE.mode
    mode = get_mode()
    _STATE.fast_raw, _STATE.fast_valid = raw, True
    return mode


@_not_compiled
def _warn_once(key: str, msg: str) -> None:
    if key in _STATE.warned:
        return
    _STATE.warned.add(key)
    warnings.warn(msg, RuntimeWarning, stacklevel=4)


def _kernel_limitation(x: Tensor) -> Optional[str]:
    """Why the fused kernel cannot take this x (None when it can)."""
    if x.dtype not in _KERNEL_DTYPES:
        return f"x dtype {x.dtype} (the kernel takes float32, float16, bfloat16)"
    d = x.shape[-1]
    vec = 16 // x.element_size()
    limit = MAX_D_VEC16 if (x.element_size() == 2 and d % vec == 0) else MAX_D_ANY
    if d > limit:
        return f"D = {d} exceeds the register-resident limit of the fused kernel ({limit})"
    return None


def _use_fused(x: Tensor) -> bool:
    """Whether ln_modulate runs the C++ op for this x; warns once (auto) or raises (fused) when it
    cannot. x: a tensor (or anything with its is_cuda, device, dtype, shape, element_size)."""
    mode = get_mode()
    if mode == "reference":
        return False
    if not x.is_cuda:
        if mode == "fused":
            raise ValueError(f"{ENV_VAR}=fused but x is on {x.device}: the fused op runs on CUDA tensors only")
        return False
    limitation = _kernel_limitation(x)
    if limitation is not None:
        if mode == "fused":
            raise ValueError(f"{ENV_VAR}=fused but the fused op cannot take this input: {limitation}")
        _warn_once("limit:" + limitation, f"ln_modulate: using the torch reference: {limitation}")
        return False
    ext = _STATE.ext if _STATE.tried else _load_extension()
    if ext is None:
        if mode == "fused":
            raise RuntimeError(f"{ENV_VAR}=fused but the fused ln_modulate op is unavailable: {_STATE.error}")
        _warn_once("load", f"ln_modulate: the fused CUDA op is unavailable, using the torch reference "
                           f"(set {ENV_VAR}=reference to silence this): {_STATE.error}")
        return False
    return True


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------
def _check_args(x: Tensor, shift: Tensor, scale: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]):
    if not isinstance(x, Tensor) or x.dim() != 3:
        raise ValueError(f"ln_modulate: x must be a [B, S, D] tensor, got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"ln_modulate: x must be a floating-point tensor, got {x.dtype}")
    b, s, d = x.shape
    for name, m in (("shift", shift), ("scale", scale)):
        ok = isinstance(m, Tensor) and (
            (m.dim() == 2 and m.shape[0] in (1, b) and m.shape[1] == d)
            or (m.dim() == 3 and m.shape[0] in (1, b) and m.shape[1] in (1, s) and m.shape[2] == d))
        if not ok:
            raise ValueError(f"ln_modulate: {name} must be [B, D], [B, 1, D] or [B, S, D] with B = {b}, S = {s}, "
                             f"D = {d} (B may be 1), got {tuple(m.shape) if isinstance(m, Tensor) else m!r}")
        if not m.is_floating_point():
            raise TypeError(f"ln_modulate: {name} must be floating point, got {m.dtype}")
        if m.device != x.device:
            raise ValueError(f"ln_modulate: {name} is on {m.device} but x is on {x.device}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if not isinstance(p, Tensor) or tuple(p.shape) != (d,):
            raise ValueError(f"ln_modulate: {name} must be a [D] = [{d}] tensor or None, got "
                             f"{tuple(p.shape) if isinstance(p, Tensor) else p!r}")
        if p.device != x.device:
            raise ValueError(f"ln_modulate: {name} is on {p.device} but x is on {x.device}")


def ln_modulate(x: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6, weight: Optional[Tensor] = None,
                bias: Optional[Tensor] = None) -> Tensor:
    """Fused adaLN: ``LayerNorm(x; eps, weight, bias) * (1 + scale) + shift``.

    Args:
        x: [B, S, D], float32 / float16 / bfloat16 (other float dtypes use the reference). Any
            strides; a non-unit last-dim stride is copied to contiguous first.
        shift, scale: per-sample [B, D] / [B, 1, D] or per-token [B, S, D] (B may be 1 to
            broadcast), float32 or x.dtype (other combinations run in float32). Strided views such
            as ``table[:, k]`` of a [B, 6, D] or [B, S, 6, D] fp32 table are read in place.
        eps: added to the variance.
        weight, bias: optional elementwise-affine [D] parameters of the LayerNorm (any float dtype;
            their gradients come back in their own dtype).

    Returns:
        y: [B, S, D] in x.dtype, contiguous. Statistics and modulation in fp32, one rounding.

    Differentiable in x, shift, scale, weight and bias. On CUDA tensors the C++ op runs when the
    extension loads; see the module docstring for DS_ADAPTIVE_LN_MODULATE.
    """
    try_apply = _STATE.try_apply
    if try_apply is not None and not torch.compiler.is_compiling() and _mode() != "reference":
        # Eager fast path (host time per call): one C++ call checks that the arguments are plain
        # tensors (or nn.Parameter) without a torch-function mode and that x is a CUDA [B, S, D] tensor of a
        # kernel dtype with D <= 8192, then runs the op, which checks the rest; None when it does not apply.
        # On an error _check_args runs to raise the Python layer's ValueError / TypeError (the extension's
        # pybind entry point turns the C++ ones into RuntimeError), else the C++ error propagates.
        try:
            y = try_apply(x, shift, scale, eps, weight, bias)
        except Exception:
            _check_args(x, shift, scale, weight, bias)
            raise
        if y is not None:
            _STATE.calls["fused"] += 1
            return y
    _check_args(x, shift, scale, weight, bias)
    if _is_cuda_float(x) and _use_fused(x):
        if torch.compiler.is_compiling():
            return _STATE.apply(x, shift, scale, float(eps), weight, bias)
        _STATE.calls["fused"] += 1
        if _STATE.fast_apply is not None and _plain(x, shift, scale, weight, bias):
            return _STATE.fast_apply(x, shift, scale, float(eps), weight, bias)
        return _STATE.apply(x, shift, scale, float(eps), weight, bias)
    if not _is_cuda_float(x):
        _use_fused(x)  # DS_ADAPTIVE_LN_MODULATE=fused: an error for CPU tensors
    if not torch.compiler.is_compiling():
        _STATE.calls["reference"] += 1
    return ln_modulate_reference(x, shift, scale, eps, weight, bias)


def _plain(*tensors) -> bool:
    """Plain tensors (or None) and no torch-function mode: the extension's direct entry point
    skips torch.ops' __torch_function__ handling, so subclasses (nn.Parameter included) and modes
    take torch.ops. Dispatch modes / keys are unaffected: both paths call the dispatcher."""
    return all(t is None or type(t) is Tensor for t in tensors) and not torch._C._is_torch_function_mode_enabled()


def _is_cuda_float(x) -> bool:
    """A floating-point CUDA tensor: the only inputs the C++ op may take (others go through
    ``_check_args``, whose errors name what was expected)."""
    return isinstance(x, Tensor) and x.is_cuda and x.is_floating_point()


class LayerNormModulate(nn.Module):
    """``LayerNorm(dim, eps, elementwise_affine)`` followed by ``* (1 + scale) + shift``, fused.

    forward(x [B, S, D], shift, scale) -> [B, S, D] in x.dtype; shift/scale as in ``ln_modulate``.
    """

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = False, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
            self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        return ln_modulate(x, shift, scale, self.eps, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
