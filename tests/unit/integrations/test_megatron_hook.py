"""The adaptive sampler inside Megatron's data pipeline: 2 CPU processes (gloo) with megatron-core's
parallel_state, external DataLoader, checkpoint state round trip."""
from __future__ import annotations

import json
import os
import socket

import pytest

torch = pytest.importorskip("torch")
ps = pytest.importorskip("megatron.core.parallel_state")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from ds_adaptive.integrations.megatron import (MegatronAdaptiveLoader, ShapedDataset, add_sampler_state,  # noqa: E402
                                               dataset_shapes, load_sampler_state, restore_sampler_state,
                                               save_sampler_state)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, cp: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ps.initialize_model_parallel(context_parallel_size=cp, create_gloo_process_groups=True)
        topo = Layout.detect()
        ds = LatentDataset(600)
        loader = MegatronAdaptiveLoader(ds, CFG, micro_steps_per_step=2, collate_fn=collate)
        steps = loader.sampler.steps_per_epoch
        first = []
        for _ in range(4 * 2):                   # 4 optimizer steps
            first.append(next(loader)["index"].tolist())
        sd = {}
        add_sampler_state(sd, loader)
        if rank == 0:
            save_sampler_state(out_dir, loader)
        rest = []
        while loader.epoch == 0:
            b = next(loader)
            if loader.epoch == 0:
                rest.append(b["index"].tolist())
        # a fresh loader resumed from the checkpoint state
        loader2 = MegatronAdaptiveLoader(ds, CFG, micro_steps_per_step=2, collate_fn=collate)
        restore_sampler_state(sd, loader2)
        resumed = [next(loader2)["index"].tolist() for _ in range(len(rest))]
        loader3 = MegatronAdaptiveLoader(ds, CFG, micro_steps_per_step=2, collate_fn=collate)
        dist.barrier()
        assert load_sampler_state(out_dir, loader3)
        resumed3 = next(loader3)["index"].tolist()
        totals = loader2.current_step_totals
        json.dump({"topo": [topo.dp_rank, topo.dp_size, topo.sp_rank, topo.sp_size], "steps": steps,
                   "first": first, "rest": rest, "resumed": resumed, "resumed3": resumed3,
                   "totals": [totals.samples, totals.tokens, totals.micro_steps],
                   "ckpt_json": isinstance(sd["ds_adaptive_sampler"], str)},
                  open(os.path.join(out_dir, f"rank{rank}.json"), "w"))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _run(tmp_path, cp: int):
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path), cp), nprocs=2, start_method="spawn")
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]


@pytest.mark.slow
def test_two_dp_ranks_partition_the_epoch_and_resume(tmp_path):
    r0, r1 = _run(tmp_path, cp=1)
    assert r0["topo"] == [0, 2, 0, 1] and r1["topo"] == [1, 2, 0, 1]
    assert r0["steps"] == r1["steps"] > 4
    # equal micro-step counts, disjoint samples, every sample at most once
    assert len(r0["first"]) + len(r0["rest"]) == len(r1["first"]) + len(r1["rest"])
    ids0 = [i for b in r0["first"] + r0["rest"] for i in b]
    ids1 = [i for b in r1["first"] + r1["rest"] for i in b]
    assert not set(ids0) & set(ids1)
    assert len(set(ids0)) == len(ids0) and len(set(ids1)) == len(ids1)
    # resume from the checkpoint state continues exactly where the first run was
    for r in (r0, r1):
        assert r["resumed"] == r["rest"]
        assert r["resumed3"] == r["rest"][0]
        assert r["ckpt_json"]
    assert r0["totals"] == r1["totals"]


@pytest.mark.slow
def test_context_parallel_group_gets_identical_batches(tmp_path):
    r0, r1 = _run(tmp_path, cp=2)
    assert r0["topo"] == [0, 1, 0, 2] and r1["topo"] == [0, 1, 1, 2]
    assert r0["first"] == r1["first"] and r0["rest"] == r1["rest"]


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
