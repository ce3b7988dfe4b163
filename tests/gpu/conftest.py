"""GPU tests (tests/gpu): skipped as a whole, with the reason shown, where torch sees no CUDA GPU.

Run on a GPU machine: ``bash bench/gpu/gpu_check.sh`` (builds the fused op once, then runs these).
"""
from __future__ import annotations

import pytest
import torch

CUDA_REASON = None
if not torch.cuda.is_available():
    CUDA_REASON = (f"tests/gpu need a CUDA GPU: torch {torch.__version__} "
                   f"({'CPU-only build' if torch.version.cuda is None else 'no GPU visible'})")


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if CUDA_REASON:
                item.add_marker(pytest.mark.skip(reason=CUDA_REASON))
