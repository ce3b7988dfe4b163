"""The adaptive sampler inside Megatron's data pipeline on 2 CPU processes (gloo) with megatron-core's parallel_state:
DP ranks partition the epoch and resume from the checkpoint state, a context-parallel group gets identical batches.
The single-process checks (and the test dataset) are in tests/unit/integrations/test_megatron_hook.py."""
from __future__ import annotations

import json
import os
import socket

import pytest

torch = pytest.importorskip("torch")
ps = pytest.importorskip("megatron.core.parallel_state")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from ds_adaptive.core.layout import Layout  # noqa: E402
from ds_adaptive.integrations.megatron import (MegatronAdaptiveLoader, add_sampler_state, load_sampler_state,  # noqa: E402
                                               restore_sampler_state, save_sampler_state)
from test_megatron_hook import CFG, LatentDataset, collate  # noqa: E402


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
