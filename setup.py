"""ds_adaptive: AdaptiveLoad for DeepSpeed/Megatron video-DiT training.

Install (CPU or GPU node; install torch first so pip does not pull another build):
    pip install torch==2.13.0            # or the CUDA build your cluster uses (>= 2.6)
    pip install -e ".[dev]"

Extras:
    dev        tests, plots and the optional integrations the tests cover (megatron-core, diffusers, preprocess, peft)
    lora       peft (+ transformers), for LoRA fine-tuning (adaptive_load.lora); wandb is optional and not an extra
    preprocess ds-adaptive preprocess: PyAV, diffusers (Wan VAE), transformers (umT5), ftfy
    megatron   megatron-core, for the sampler inside Megatron's data pipeline (ds_adaptive/integrations/megatron.py)
    diffusers  diffusers, for the fused op / Ulysses in diffusers' WanTransformer3DModel
    plots      matplotlib + tensorboard (TensorBoard logs of the trainer, simulation plots)
    apex       NVIDIA apex is NOT on PyPI: build it from https://github.com/NVIDIA/apex; ds_adaptive
               uses its fused kernels only when ``import apex`` works (this extra installs nothing).

Prebuild the fused LayerNorm-Modulate CUDA op at install time (GPU node with nvcc):
    DS_BUILD_LN_MODULATE=1 pip install .     # or DS_BUILD_OPS=1
Without a prebuild the op is JIT-built by DeepSpeed's builder on first use.
"""
import os
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

PACKAGES = sorted(find_packages(HERE, include=["ds_adaptive", "ds_adaptive.*"]))

install_requires = [
    "torch>=2.6",                # tested: 2.11 (GPU nodes) and 2.13 (CPU CI)
    "deepspeed>=0.19,<0.20",     # tested: 0.19.8; ZeRO-3 internals and the op builder API move between minors
    "einops>=0.7",
    "pydantic>=2.7",             # use_attribute_docstrings (field docs in the config model)
    "numpy",
    "safetensors>=0.4",
    "pyarrow>=14",               # the dataset index (index.arrow, memory-mapped by every rank); tested: 26.0
    "tqdm",
    "xxhash>=3",                 # checkpoint checksums (XXH3-128, ~10x BLAKE2b); without it: BLAKE2b (hashlib)
]

extras_require = {
    "dev": ["pytest>=7", "pytest-timeout", "pytest-xdist>=3.6", "pytest-randomly", "ruff", "hypothesis>=6",
            "matplotlib", "tensorboard",
            "diffusers>=0.33", "accelerate", "megatron-core>=0.12",
            "av>=14", "transformers>=4.56", "ftfy",  # the preprocess tests (tests/unit/preprocess/test_preprocess.py)
            "triton>=3.2",  # the block-sparse kernels under the Triton interpreter (tests/unit/attention/)
            "peft>=0.17"],  # LoRA (tests/unit/training/test_lora.py)
    # our Triton block-sparse kernels (GPU nodes get triton with torch's CUDA wheels; on CPU: the interpreter)
    "triton": ["triton>=3.2"],
    # ds-adaptive preprocess: PyAV (wheels bundle FFmpeg), diffusers' AutoencoderKLWan, transformers' umT5,
    # ftfy (Wan's caption cleaning). Tested: av 18.1, diffusers 0.42.1, transformers 5.23 with torch 2.13.
    "preprocess": ["av>=14", "diffusers>=0.33", "accelerate", "transformers>=4.56", "ftfy", "pillow"],
    # adaptive_load.lora: peft injects the adapters (it imports transformers); diffusers' load_lora_weights reads the
    # exported file. Tested: peft 0.21.2, transformers 5.24.
    "lora": ["peft>=0.17", "transformers>=4.56"],
    "megatron": ["megatron-core>=0.12"],
    "diffusers": ["diffusers>=0.33", "accelerate"],  # from_pretrained of Wan needs accelerate
    "plots": ["matplotlib", "tensorboard"],
    "apex": [],  # not on PyPI: see the module docstring
}


def _ext_modules():
    """CUDA extension for the fused op when DS_BUILD_LN_MODULATE=1 or DS_BUILD_OPS=1."""
    flag = os.environ.get("DS_BUILD_LN_MODULATE", os.environ.get("DS_BUILD_OPS", "0"))
    if flag != "1":
        return [], {}
    from ds_adaptive.ops.builder import LNModulateBuilder  # noqa: E402  (needs torch + deepspeed)

    builder = LNModulateBuilder()
    ok, why = builder.check_prebuild()
    if not ok:
        raise RuntimeError(f"DS_BUILD_LN_MODULATE=1 but the op cannot be built here: {why}")
    from torch.utils.cpp_extension import BuildExtension

    return [builder.builder()], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _ext_modules()

setup(
    name="ds_adaptive",
    version="0.1.0",
    description="AdaptiveLoad for DeepSpeed/Megatron: dual-constraint batching and a fused "
                "LayerNorm-Modulate op for video diffusion transformers (Wan 2.1)",
    long_description=open(os.path.join(HERE, "README.md")).read() if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_data={"ds_adaptive": ["data/*.json", "planning/profiles/*.json", "attention/*.json",
                                  "attention/kernels/*.json"],
                  "ds_adaptive.ops": ["csrc/**/*"]},
    include_package_data=True,
    install_requires=install_requires,
    extras_require=extras_require,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["ds-adaptive=ds_adaptive.cli:main"]},
)
