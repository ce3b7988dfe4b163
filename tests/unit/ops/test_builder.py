"""Guards LNModulateBuilder: arch-list parsing (9.0a etc.), DeepSpeed registry/report, ds_config switch, packaging."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from ds_adaptive.ops import builder as bmod  # noqa: E402
from ds_adaptive.ops.builder import (  # noqa: E402
    PREBUILT_MODULE,
    SOURCE_FILES,
    CudaArch,
    LNModulateBuilder,
    gencode_flags,
    parse_arch_list,
)

try:
    from ds_adaptive.integrations import deepspeed as dsp
except ImportError:  # source checkout without the package_dir mapping
    from patches import deepspeed as dsp  # type: ignore

ROOT = Path(__file__).resolve().parents[3]


# ------------------------------------------------------------------------------------------------
# arch lists
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,archs,flags", [
    ("9.0a", ["9.0a"], ["-gencode=arch=compute_90a,code=sm_90a"]),
    ("8.0;9.0+PTX", ["8.0", "9.0+PTX"], ["-gencode=arch=compute_80,code=sm_80",
                                          "-gencode=arch=compute_90,code=sm_90",
                                          "-gencode=arch=compute_90,code=compute_90"]),
    ("9.0a 10.0", ["9.0a", "10.0"], ["-gencode=arch=compute_90a,code=sm_90a",
                                      "-gencode=arch=compute_100,code=sm_100"]),
    ("Hopper", ["9.0+PTX"], ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90"]),
    ("Ampere+Tegra; 8.0,8.0+PTX", ["8.0+PTX", "8.7"], None),
    ("10.0a+ptx", ["10.0a+PTX"], ["-gencode=arch=compute_100a,code=sm_100a",
                                  "-gencode=arch=compute_100a,code=compute_100a"]),
])
def test_parse_arch_list(text, archs, flags):
    parsed = parse_arch_list(text)
    assert [str(a) for a in parsed] == archs
    if flags is not None:
        assert gencode_flags(parsed) == flags


@pytest.mark.parametrize("text", ["9.x", "sm90", "", ";", "9.0b"])
def test_parse_arch_list_rejects_with_the_entry(text):
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST"):
        parse_arch_list(text)


def test_deepspeeds_own_parser_fails_on_suffixes_and_ours_does_not(monkeypatch):
    """The pitfall this builder exists for: DeepSpeed 0.19.8's compute_capability_args and 9.0a."""
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    class PlainBuilder(CUDAOpBuilder):  # a builder with DeepSpeed's own arch handling
        def absolute_name(self):
            return "plain"

        def sources(self):
            return []

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with pytest.raises(ValueError, match="0a"):
        PlainBuilder("plain").compute_capability_args()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    b = LNModulateBuilder()
    for jit in (False, True):
        b.jit_mode = jit
        assert b.compute_capability_args() == ["-gencode=arch=compute_90a,code=sm_90a"]
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a"  # left untouched
    assert b.enable_bf16
    assert b.filter_ccs(["9.0a", "8.6"]) == [["9", "0"], ["8", "6"]]


def test_arch_list_sources_and_filtering(monkeypatch):
    b = LNModulateBuilder()
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    archs = b.arch_list(cross_compile_archs="8.0;9.0")
    assert [str(a) for a in archs] == ["8.0", "9.0"] and "cross_compile_archs" in b.arch_notes[0]
    archs = b.arch_list()  # no GPU here: the default list for the installed CUDA
    assert archs[-1].ptx and all((a.major, a.minor) >= (7, 0) for a in archs)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "5.2;9.0")
    archs = b.arch_list()
    assert [str(a) for a in archs] == ["9.0"] and any("dropped 5.2" in n for n in b.arch_notes)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "6.0")
    with pytest.raises(RuntimeError, match="no buildable architecture"):
        b.arch_list()
    assert CudaArch(9, 0, "a").number == "90a"


# ------------------------------------------------------------------------------------------------
# the builder itself
# ------------------------------------------------------------------------------------------------
def test_builder_identity_and_sources():
    b = LNModulateBuilder()
    assert b.NAME == b.name == "ln_modulate"
    assert b.BUILD_VAR == "DS_BUILD_LN_MODULATE"
    assert b.absolute_name() == PREBUILT_MODULE == "ds_adaptive.ops._ln_modulate_C"
    srcs = b.sources()
    assert [Path(s).name for s in srcs] == list(SOURCE_FILES)
    assert all(os.path.isabs(s) and os.path.isfile(s) for s in srcs)
    assert all(os.path.isdir(p) and os.path.isabs(p) for p in b.include_paths())


def test_nvcc_args(monkeypatch):
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        pytest.skip("no CUDA toolkit")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    args = LNModulateBuilder().nvcc_args()
    assert "-gencode=arch=compute_90a,code=sm_90a" in args
    assert "--use_fast_math" not in args and "-O3" in args


def test_sources_found_through_the_package_data_path():
    """ds_adaptive/ops/csrc (package data in an install; a symlink to csrc/ in the checkout)."""
    pkg = ROOT / "ds_adaptive" / "ops" / "csrc" / "ln_modulate"
    assert all((pkg / f).is_file() for f in SOURCE_FILES)
    assert bmod.csrc_dir() == (ROOT / "csrc" / "ln_modulate").resolve()


def test_compatibility_on_a_cpu_only_torch_says_why():
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this torch is a CUDA build")
    b = LNModulateBuilder()
    ok, reasons = b.compatibility()
    assert not ok and any("CPU-only build" in r for r in reasons)
    assert b.is_compatible() is False and "CPU-only build" in b.error_log
    ok, why = b.check_prebuild()
    assert not ok and "CPU-only build" in why
    assert not b.prebuilt_available()
    with pytest.raises(RuntimeError, match="cannot JIT-build the ln_modulate op: .*CPU-only build"):
        b.load()


def test_setup_py_refuses_a_prebuild_it_cannot_do():
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this torch is a CUDA build")
    env = {**os.environ, "DS_BUILD_LN_MODULATE": "1"}
    res = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode != 0
    assert "DS_BUILD_LN_MODULATE=1 but the op cannot be built here" in res.stderr
    assert "CPU-only build" in res.stderr


@pytest.mark.slow
def test_wheel_ships_the_kernel_sources(tmp_path):
    had_build = (ROOT / "build").exists()
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "DS_BUILD_LN_MODULATE": "0", "DS_BUILD_OPS": "0"})
    if not had_build:  # setuptools builds in the source tree: leave no build/ behind
        import shutil

        shutil.rmtree(ROOT / "build", ignore_errors=True)
    assert res.returncode == 0, res.stderr[-2000:]
    (whl,) = tmp_path.glob("ds_adaptive-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for f in SOURCE_FILES:
        assert f"ds_adaptive/ops/csrc/ln_modulate/{f}" in names
    assert "ds_adaptive/integrations/deepspeed.py" in names


# ------------------------------------------------------------------------------------------------
# DeepSpeed registry and report
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def registered():
    dsp.register_ops()
    yield
    dsp.unregister_ops()


def test_builder_found_through_deepspeeds_registry(registered):
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.all_ops import ALL_OPS, __op_builders__

    acc = get_accelerator()
    assert acc.get_op_builder("LNModulateBuilder") is LNModulateBuilder
    assert isinstance(acc.create_op_builder("LNModulateBuilder"), LNModulateBuilder)
    assert acc.get_op_builder("FusedAdamBuilder") is not None  # DeepSpeed's own names still resolve
    assert isinstance(ALL_OPS["ln_modulate"], LNModulateBuilder)
    dsp.register_ops()  # idempotent
    assert sum(isinstance(b, LNModulateBuilder) for b in __op_builders__) == 1
    assert getattr(type(acc).get_op_builder, "__wrapped__", None) is not None
    from deepspeed.ops.op_builder import LNModulateBuilder as exported

    assert exported is LNModulateBuilder
    assert dsp.is_registered()


def test_unregister_restores_deepspeed():
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    dsp.register_ops()
    dsp.unregister_ops()
    acc = get_accelerator()
    assert acc.get_op_builder("LNModulateBuilder") is not LNModulateBuilder
    assert "ln_modulate" not in ALL_OPS
    assert not getattr(type(acc).get_op_builder, "_ds_adaptive_registered", False)


def test_cuda_accelerator_class_dict_gets_the_builder():
    """The CUDA accelerator resolves names through class_dict (scanned from op_builder modules)."""
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    try:
        acc = CUDA_Accelerator()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"CUDA_Accelerator cannot be built here: {e}")
    try:
        dsp.register_ops(accelerator=acc)
        assert acc.class_dict["LNModulateBuilder"] is LNModulateBuilder
        assert acc.get_op_builder("LNModulateBuilder") is LNModulateBuilder
        assert isinstance(acc.create_op_builder("LNModulateBuilder"), LNModulateBuilder)
    finally:
        dsp.unregister_ops(accelerator=acc)
    assert "LNModulateBuilder" not in acc.class_dict


def test_deepspeed_env_report_lists_the_op(registered, capsys):
    from deepspeed.env_report import op_report

    op_report(verbose=False)
    out = capsys.readouterr().out
    assert "ln_modulate" in out


def test_ds_adaptive_report(capsys):
    from ds_adaptive.cli import report

    assert report.main([]) == 0
    out = capsys.readouterr().out
    assert "get_op_builder -> LNModulateBuilder" in out and "compatible" in out
    assert report.main(["--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["registered"]["in_ALL_OPS"] and "arch" in info
    dsp.unregister_ops()


def test_report_shows_the_arch_handling(monkeypatch, capsys):
    from ds_adaptive.cli import report

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    report.main([])
    out = capsys.readouterr().out
    assert "-gencode=arch=compute_90a,code=sm_90a" in out
    dsp.unregister_ops()


# ------------------------------------------------------------------------------------------------
# the run configuration's switch
# ------------------------------------------------------------------------------------------------
def test_apply_ln_modulate_follows_the_run_config(tmp_path):
    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.ops import apply_ln_modulate
    from ds_adaptive.ops.ln_modulate import ln_modulate, ln_modulate_reference
    from ds_adaptive.training.run_config import RunConfig

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 1, "adaptive_load": {"fused_ln_modulate": True}}))
    model = WanModel("tiny")
    on = RunConfig.load(str(path))
    assert apply_ln_modulate(model, on.adaptive_load.fused_ln_modulate) is ln_modulate
    assert model.ln_modulate_fn is ln_modulate and all(b.ln_modulate is ln_modulate for b in model.blocks)
    off = RunConfig.load(str(path), overrides={"fused_ln_modulate": False})  # --no-fused-ln-modulate
    assert apply_ln_modulate(model, off.adaptive_load.fused_ln_modulate) is ln_modulate_reference
    assert model.head.ln_modulate is ln_modulate_reference
