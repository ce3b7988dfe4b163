"""The adaptive sampler inside Megatron's data pipeline, in one process: the dataset protocol and its errors, a
token-length dataset. Two gloo ranks with megatron-core's parallel_state (DP and context-parallel groups, the
checkpoint state round trip) are in tests/integration/test_megatron_hook_launch.py."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
ps = pytest.importorskip("megatron.core.parallel_state")

from ds_adaptive.integrations.megatron import MegatronAdaptiveLoader, ShapedDataset, dataset_shapes  # noqa: E402
from ds_adaptive.core.layout import Layout  # noqa: E402
from ds_adaptive.core.shapes import SampleShape  # noqa: E402

SHAPES = [SampleShape(1, 480, 832), SampleShape(1, 720, 1280), SampleShape(17, 480, 832),
          SampleShape(33, 480, 832), SampleShape(81, 480, 832), SampleShape(81, 720, 1280)]
CFG = {"mode": "dual", "profile": "h100-wan2.1-1.3b", "m_mem": 20.0, "m_comp": "auto", "window": 64, "seed": 3}


class LatentDataset:
    """Megatron-core-style map dataset: tensors on demand, shapes without loading."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.shapes = [SHAPES[int(i)] for i in torch.randint(len(SHAPES), (n,), generator=g)]

    def __len__(self):
        return len(self.shapes)

    def __getitem__(self, i):
        t, h, w = self.shapes[i].latent_grid
        return {"index": i, "latent_thw": torch.tensor([t, h, w])}

    def sample_shapes(self):
        return self.shapes


def collate(items):
    grids = {tuple(x["latent_thw"].tolist()) for x in items}
    assert len(grids) == 1, f"a micro-batch mixes shapes {grids}"
    return {"index": torch.tensor([x["index"] for x in items])}


def test_dataset_protocol_errors():
    class NoShapes:
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return i

    with pytest.raises(TypeError, match="sample_shapes"):
        dataset_shapes(NoShapes())

    class Lengths(NoShapes):
        def sample_token_lengths(self):
            return [10, 20]

    with pytest.raises(ValueError, match="2 entries but len"):
        dataset_shapes(Lengths())
    ds = LatentDataset(5)
    assert isinstance(ds, ShapedDataset)
    assert dataset_shapes(ds) == ds.shapes


def test_token_length_dataset_single_process():
    class Seqs:
        def __init__(self):
            self.lens = [64 * (1 + (i * 7) % 20) for i in range(300)]

        def __len__(self):
            return len(self.lens)

        def __getitem__(self, i):
            return i

        def sample_token_lengths(self):
            return self.lens

    loader = MegatronAdaptiveLoader(Seqs(), {**CFG, "m_mem": 2.0}, micro_steps_per_step=1,
                                    layout=Layout.explicit(), collate_fn=list)
    seen = []
    while loader.epoch == 0:
        b = next(loader)
        if loader.epoch == 0:
            seen.extend(b)
            assert len({loader.dataset.lens[i] for i in b}) == 1
    stats = loader.sampler.epoch_stats()
    assert len(seen) == len(set(seen)) == stats["samples"]
    assert stats["samples"] + stats["oversize"] + stats["tail_dropped"] == 300
