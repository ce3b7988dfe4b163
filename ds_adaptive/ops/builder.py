"""DeepSpeed op builder of the fused LayerNorm-Modulate CUDA op.

``LNModulateBuilder`` is a ``deepspeed.ops.op_builder.builder.CUDAOpBuilder`` that lives outside
DeepSpeed, so it differs from DeepSpeed's own builders in three places:

* ``sources()`` / ``include_paths()`` are absolute: the kernels are found in ``csrc/ln_modulate``
  of a source checkout or in ``ds_adaptive/ops/csrc/ln_modulate`` of an installed package
  (shipped as package data; in the checkout that path is a symlink to ``csrc``).
* ``load()`` imports the prebuilt extension ``ds_adaptive.ops._ln_modulate_C`` first (built by
  ``DS_BUILD_LN_MODULATE=1 pip install .`` or ``DS_BUILD_OPS=1``; DeepSpeed's ``installed_ops``
  never lists external ops), and JIT-builds through DeepSpeed otherwise (``TORCH_EXTENSIONS_DIR``
  is respected by torch's JIT loader).
* ``compute_capability_args()`` parses ``TORCH_CUDA_ARCH_LIST`` itself, arch suffixes included
  (``9.0a`` -> ``-gencode=arch=compute_90a,code=sm_90a``), and always emits explicit ``-gencode``
  flags, so neither DeepSpeed 0.19.8's parser (which fails on ``9.0a``: "invalid literal for
  int(): '0a'") nor torch's re-reads the variable.

Register it in DeepSpeed's op registry with ``ds_adaptive.integrations.deepspeed.register_ops()``.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder

PREBUILT_MODULE = "ds_adaptive.ops._ln_modulate_C"
SOURCE_FILES = (
    "ln_modulate_ops.cpp",
    "ln_modulate_torch.cpp",
    "ln_modulate_api.cu",
    "ln_modulate_bf16_f32.cu",
    "ln_modulate_bf16_bf16.cu",
    "ln_modulate_f16_f32.cu",
    "ln_modulate_f16_f16.cu",
    "ln_modulate_f32_f32.cu",
    "ln_modulate_tune.cu",
)
# The dispatcher registration alone (schemas, autograd, CPU and Meta implementations): no CUDA, so
# it also builds as a CPU-only library (build_cpu_ops) for the CPU tests.
OPS_SOURCE = "ln_modulate_ops.cpp"
CPU_OPS_NAME = "ds_adaptive_ln_modulate_ops_cpu"
# Oldest architecture the kernels are built for (warp shuffles, 16-byte loads, bf16 conversions).
MIN_ARCH = (7, 0)
# torch's named architectures (torch.utils.cpp_extension._get_cuda_arch_flags), kept in sync by hand.
NAMED_ARCHES = {
    "kepler+tesla": "3.7", "kepler": "3.5+PTX", "maxwell+tegra": "5.3", "maxwell": "5.0;5.2+PTX",
    "pascal": "6.0;6.1+PTX", "volta+tegra": "7.2", "volta": "7.0+PTX", "turing": "7.5+PTX",
    "ampere+tegra": "8.7", "ampere": "8.0;8.6+PTX", "ada": "8.9+PTX", "hopper": "9.0+PTX",
    "blackwell+tegra": "11.0", "blackwell": "10.0;10.3;12.0;12.1+PTX",
}
_ARCH_RE = re.compile(r"^(?:sm_)?(\d+)\.?(\d)([af]?)(\+ptx)?$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True, order=True)
class CudaArch:
    """One entry of an arch list: compute capability major.minor, an arch-specific suffix ('' or
    'a' for sm_90a-style, 'f' for family targets) and whether PTX is embedded too."""

    major: int
    minor: int
    suffix: str = ""
    ptx: bool = False

    @property
    def number(self) -> str:
        """nvcc's spelling: '90a' for 9.0a."""
        return f"{self.major}{self.minor}{self.suffix}"

    def gencode(self) -> List[str]:
        flags = [f"-gencode=arch=compute_{self.number},code=sm_{self.number}"]
        if self.ptx:
            flags.append(f"-gencode=arch=compute_{self.number},code=compute_{self.number}")
        return flags

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}{self.suffix}{'+PTX' if self.ptx else ''}"


def parse_arch_list(text: str) -> List[CudaArch]:
    """Parse a TORCH_CUDA_ARCH_LIST value: entries separated by ';', ',' or whitespace, each
    'X.Y', 'X.Ya' / 'X.Yf' (arch-specific / family targets), optionally '+PTX', or a torch named
    arch ('Hopper', 'Ampere', ...). Duplicates merge (PTX kept if any copy asks for it); the result
    is sorted. Raises ValueError naming the bad entry."""
    expanded = text.strip()
    for name in sorted(NAMED_ARCHES, key=len, reverse=True):
        expanded = re.sub(rf"\b{re.escape(name)}\b", NAMED_ARCHES[name], expanded, flags=re.IGNORECASE)
    merged: dict = {}
    for tok in re.split(r"[;,\s]+", expanded):
        if not tok:
            continue
        m = _ARCH_RE.match(tok)
        if not m:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST entry {tok!r} is not an architecture: expected e.g. "
                             f"'8.0', '9.0a', '9.0+PTX' or 'Hopper' (separated by ';' or spaces); "
                             f"the whole value was {text!r}")
        key = (int(m.group(1)), int(m.group(2)), m.group(3).lower())
        merged[key] = merged.get(key, False) or m.group(4) is not None
    if not merged:
        raise ValueError(f"TORCH_CUDA_ARCH_LIST={text!r} names no architecture")
    return sorted(CudaArch(ma, mi, sfx, ptx) for (ma, mi, sfx), ptx in merged.items())


def gencode_flags(archs: Iterable[CudaArch]) -> List[str]:
    """nvcc -gencode flags for these archs (one sm_XY per arch, plus compute_XY PTX where asked)."""
    return [flag for a in archs for flag in a.gencode()]


def csrc_dir() -> Path:
    """Directory of the kernel sources: ds_adaptive/ops/csrc/ln_modulate (installed package; a
    symlink into csrc/ in a checkout), else <repo>/csrc/ln_modulate."""
    here = Path(__file__).resolve().parent
    candidates = [Path(__file__).parent / "csrc" / "ln_modulate", here / "csrc" / "ln_modulate",
                  here.parent.parent / "csrc" / "ln_modulate"]
    for cand in candidates:
        if all((cand / f).is_file() for f in SOURCE_FILES):
            return cand.resolve()
    raise FileNotFoundError("ln_modulate CUDA sources not found; looked in "
                            + ", ".join(str(c) for c in candidates)
                            + ". Reinstall ds_adaptive (they ship as package data ds_adaptive/ops/csrc).")


def _nvcc_path() -> Optional[str]:
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:  # pragma: no cover - torch always has it
        CUDA_HOME = None
    if CUDA_HOME:
        nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
        if os.path.exists(nvcc):
            return nvcc
    return shutil.which("nvcc")


def _nvcc_version(nvcc: str) -> Tuple[int, int]:
    out = subprocess.check_output([nvcc, "-V"], universal_newlines=True, stderr=subprocess.STDOUT)
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise RuntimeError(f"cannot read the CUDA release from `{nvcc} -V`: {out.strip()[:200]}")
    return int(m.group(1)), int(m.group(2))


def _oldest_arch_for(cuda: Tuple[int, int]) -> Tuple[int, int]:
    """Oldest compute capability the installed nvcc can target."""
    if cuda >= (13, 0):
        return (7, 5)
    if cuda >= (12, 0):
        return (5, 0)
    return (3, 5)


def _default_archs(cuda: Tuple[int, int]) -> List[CudaArch]:
    """Cross-compile default without TORCH_CUDA_ARCH_LIST and without visible GPUs."""
    caps = [(7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0)]
    if cuda >= (12, 8):
        caps += [(10, 0), (12, 0)]
    archs = [CudaArch(ma, mi) for ma, mi in caps]
    archs[-1] = dataclasses.replace(archs[-1], ptx=True)
    return archs


class LNModulateBuilder(CUDAOpBuilder):
    """Builds ``ds_adaptive.ops._ln_modulate_C`` (prebuilt) or the JIT module ``ln_modulate``."""

    BUILD_VAR = "DS_BUILD_LN_MODULATE"
    NAME = "ln_modulate"

    def __init__(self, name: Optional[str] = None):
        super().__init__(name=self.NAME if name is None else name)
        self.arch_notes: List[str] = []  # what compute_capability_args() decided, for reports
        self.loaded_from: Optional[str] = None  # "prebuilt" or "jit" after load()

    # -- what to build ---------------------------------------------------------------------------
    def absolute_name(self) -> str:
        return PREBUILT_MODULE

    def sources(self) -> List[str]:
        root = csrc_dir()
        return [str(root / f) for f in SOURCE_FILES]

    def include_paths(self) -> List[str]:
        return [str(csrc_dir())]

    def cxx_args(self) -> List[str]:
        return [a for a in super().cxx_args() if a != "-g"]

    def nvcc_args(self) -> List[str]:
        # DeepSpeed's defaults (-O3, C++ standard, half/bf16 operator macros, --threads) without
        # --use_fast_math: the statistics keep IEEE fp32 division and denormals.
        args = [a for a in super().nvcc_args() if a != "--use_fast_math"]
        if not self.build_for_cpu:
            args.append("-lineinfo")
        return args

    # -- architectures ----------------------------------------------------------------------------
    def arch_list(self, cross_compile_archs: Optional[str] = None) -> List[CudaArch]:
        """The archs to build for: TORCH_CUDA_ARCH_LIST if set, else ``cross_compile_archs``, else
        (JIT) the visible GPUs, else a default list for the installed CUDA. Entries the installed
        nvcc cannot target or older than MIN_ARCH are dropped (noted in ``arch_notes``)."""
        self.arch_notes = []
        env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
        if env and env.lower() != "native":
            archs, origin = parse_arch_list(env), f"TORCH_CUDA_ARCH_LIST={env!r}"
        elif cross_compile_archs:
            archs, origin = parse_arch_list(cross_compile_archs), f"cross_compile_archs={cross_compile_archs!r}"
        else:
            archs, origin = self._visible_archs(), "visible GPUs"
            if not archs:
                archs, origin = _default_archs(self._cuda_version_or_default()), "default list"
        cuda = self._cuda_version_or_default()
        oldest = max(MIN_ARCH, _oldest_arch_for(cuda))
        kept = [a for a in archs if (a.major, a.minor) >= oldest]
        dropped = [str(a) for a in archs if (a.major, a.minor) < oldest]
        if dropped:
            self.arch_notes.append(f"dropped {', '.join(dropped)} (below {oldest[0]}.{oldest[1]}: oldest arch "
                                   f"for this op with CUDA {cuda[0]}.{cuda[1]})")
        if not kept:
            raise RuntimeError(f"ln_modulate: no buildable architecture left from {origin} "
                               f"({', '.join(str(a) for a in archs)}); need >= {oldest[0]}.{oldest[1]}")
        self.arch_notes.insert(0, f"archs from {origin}: {';'.join(str(a) for a in kept)}")
        return kept

    def _visible_archs(self) -> List[CudaArch]:
        import torch

        if not torch.cuda.is_available():
            return []
        if hasattr(torch.cuda, "_is_in_bad_fork") and torch.cuda._is_in_bad_fork():
            raise RuntimeError("ln_modulate: cannot probe GPUs in a forked process with CUDA initialised; "
                               "set TORCH_CUDA_ARCH_LIST (e.g. '9.0')")
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        archs = [CudaArch(ma, mi) for ma, mi in caps]
        if archs:
            archs[-1] = dataclasses.replace(archs[-1], ptx=True)
        return archs

    def _cuda_version_or_default(self) -> Tuple[int, int]:
        nvcc = _nvcc_path()
        if nvcc:
            try:
                return _nvcc_version(nvcc)
            except Exception:
                pass
        return (12, 0)

    def compute_capability_args(self, cross_compile_archs: Optional[str] = None) -> List[str]:
        """Explicit -gencode flags in both JIT and setup builds (replaces DeepSpeed's parser, which
        rejects '9.0a'). Torch adds no arch flags of its own when the nvcc args already name one,
        and TORCH_CUDA_ARCH_LIST is left untouched."""
        archs = self.arch_list(cross_compile_archs)
        self.enable_bf16 = all(a.major >= 8 for a in archs)
        return gencode_flags(archs)

    def filter_ccs(self, ccs: Sequence) -> List:
        # Only reached if DeepSpeed code calls it directly; keep DeepSpeed's [major, minor] format
        # but strip arch suffixes so its int() parsing cannot fail.
        out = []
        for cc in ccs:
            parts = cc.split(".") if isinstance(cc, str) else list(cc)
            major, minor = parts[0], re.sub(r"[a-zA-Z]", "", parts[1])
            out.append([major, minor])
        return out

    # -- can it be built here? --------------------------------------------------------------------
    def compatibility(self) -> Tuple[bool, List[str]]:
        """(ok, reasons): why the op cannot be built on this machine (empty when it can)."""
        reasons: List[str] = []
        try:
            import torch
        except ImportError as e:
            return False, [f"torch is not importable: {e}"]
        if getattr(torch.version, "hip", None):
            reasons.append(f"torch {torch.__version__} is a ROCm build; the op is CUDA-only")
        elif torch.version.cuda is None:
            reasons.append(f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None); "
                           "install a CUDA build of torch")
        nvcc = _nvcc_path()
        if nvcc is None:
            reasons.append("nvcc not found (set CUDA_HOME to a CUDA toolkit with bin/nvcc)")
        else:
            try:
                cuda = _nvcc_version(nvcc)
            except Exception as e:
                reasons.append(f"cannot run {nvcc}: {e}")
            else:
                tc = getattr(torch.version, "cuda", None)
                if tc and int(tc.split(".")[0]) != cuda[0]:
                    reasons.append(f"nvcc is CUDA {cuda[0]}.{cuda[1]} but torch was built with CUDA {tc}: "
                                   "the major versions must match")
        try:
            self.arch_list()
        except (ValueError, RuntimeError) as e:
            reasons.append(str(e))
        try:
            csrc_dir()
        except FileNotFoundError as e:
            reasons.append(str(e))
        return not reasons, reasons

    def is_compatible(self, verbose: bool = False) -> bool:
        ok, reasons = self.compatibility()
        if not ok:
            self.error_log = "; ".join(reasons)
            if verbose:
                self.warning(f"{self.NAME} cannot be built here: {self.error_log}")
        return ok and super().is_compatible(verbose)

    def check_prebuild(self) -> Tuple[bool, str]:
        """For setup.py: (ok, why) for building the extension at install time."""
        ok, reasons = self.compatibility()
        if not ok:
            return False, "; ".join(reasons)
        return True, "; ".join(self.arch_notes)

    def builder(self):
        """setuptools Extension for setup.py (sources relative to setup.py's directory when under it;
        a CUDA minor-version mismatch between nvcc and torch is accepted)."""
        import torch
        from torch.utils.cpp_extension import CUDAExtension

        self.build_for_cpu = False
        self.jit_mode = False
        include_dirs = [os.path.abspath(p) for p in self.include_paths()]
        ext = CUDAExtension(name=self.absolute_name(), sources=[self._rel(s) for s in self.sources()],
                            include_dirs=include_dirs,
                            extra_compile_args={"cxx": self.strip_empty_entries(self.cxx_args()),
                                                "nvcc": self.strip_empty_entries(self.nvcc_args())})
        del torch
        return ext

    @staticmethod
    def _rel(path: str) -> str:
        try:
            rel = os.path.relpath(path, os.getcwd())
        except ValueError:
            return path
        return path if rel.startswith("..") else rel

    # -- loading ----------------------------------------------------------------------------------
    def prebuilt_available(self) -> bool:
        """Whether the prebuilt extension is installed (found without importing it)."""
        try:
            return importlib.util.find_spec(PREBUILT_MODULE) is not None
        except (ImportError, ValueError):
            return False

    def load(self, verbose: bool = False):
        """The extension module: the prebuilt one if it imports, else a JIT build (cached by torch
        under TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions)."""
        if self.name in OpBuilder._loaded_ops:
            self.loaded_from = self.loaded_from or "cache"
            return OpBuilder._loaded_ops[self.name]
        prebuilt_error = None
        if self.prebuilt_available():
            try:
                mod = importlib.import_module(PREBUILT_MODULE)
            except ImportError as e:  # built for another torch / CUDA: rebuild below
                prebuilt_error = e
            else:
                OpBuilder._loaded_ops[self.name] = mod
                self.loaded_from = "prebuilt"
                return mod
        if not self.is_compatible(verbose):
            extra = f"; the prebuilt {PREBUILT_MODULE} failed to import: {prebuilt_error}" if prebuilt_error else ""
            raise RuntimeError(f"cannot JIT-build the {self.name} op: {self.error_log}{extra}")
        if prebuilt_error is not None:
            print(f"[ds_adaptive] prebuilt {PREBUILT_MODULE} failed to import ({prebuilt_error}); JIT-building",
                  file=sys.stderr)
        mod = self.jit_load(verbose)
        self.loaded_from = "jit"
        return mod


def build_cpu_ops(build_directory: Optional[str] = None, verbose: bool = False) -> str:
    """Compile ``ln_modulate_ops.cpp`` alone with the host compiler into a library and load it
    (``torch.ops.load_library``): ``torch.ops.ds_adaptive.ln_modulate*`` then exist with their CPU,
    Meta, autograd and composite implementations, on a CPU-only torch too. For tests of the
    registration; the CUDA extension (``LNModulateBuilder``) contains the same file. Returns the
    library's path. Do not call it in a process that loads the CUDA extension (both define the
    ops)."""
    from torch.utils.cpp_extension import load

    kwargs = {"build_directory": build_directory} if build_directory else {}
    if build_directory:
        os.makedirs(build_directory, exist_ok=True)
    return load(name=CPU_OPS_NAME, sources=[str(csrc_dir() / OPS_SOURCE)], extra_cflags=["-O1"],
                is_python_module=False, verbose=verbose, **kwargs)
