"""The test harness gives every test torch's ``F.linear`` back (tests/conftest.py): a ZeRO-3 ``Init`` in the pytest
process replaces it for the rest of the process, and a later bit-exact comparison of two model paths then depended
on test order. The two tests run in this order on one worker (one xdist group, file order)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("deepspeed")

TORCH_LINEAR = torch._C._nn.linear


@pytest.mark.xdist_group("torch_linear_restored")
def test_a_zero3_init_replaces_linear():
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Patcher

    assert F.linear is TORCH_LINEAR
    if not hasattr(Patcher, "linear_bk"):
        Patcher.linear_bk = F.linear   # what zero.Init's memory_efficient_linear does, without an engine
    F.linear = zero3_linear_wrap
    x, w, b = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64), torch.randn(5)
    assert F.linear(x, w, b.double()).shape == (2, 3, 5)


@pytest.mark.xdist_group("torch_linear_restored")
def test_b_next_test_has_torch_linear():
    assert F.linear is TORCH_LINEAR
