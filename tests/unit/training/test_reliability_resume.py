"""Issue 52, cases 5, 7, 8 that need no DeepSpeed run: a shard that exists but cannot be read is "cannot be read"
(not "No such file"); a resume after the dataset changed names ``--restart-epoch`` and, with it, keeps the weights
and step and plans the epoch afresh; a resume on another world size or another model is refused before loading with
one line; metrics.jsonl keeps each step once after a resume; the lock's guard file goes with the lock."""
from __future__ import annotations

import errno
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ds_adaptive.core.shapes import SampleShape, ShapeWeight
from ds_adaptive.data import DataError, LatentShardDataset, LatentShardWriter, SyntheticLatentDataset
from ds_adaptive.planning.sampler import SamplerStateError
from ds_adaptive.training.checkpointing import Checkpointing, TrainState
from ds_adaptive.training.run_config import UsageError

SMALL = [ShapeWeight(SampleShape(1, 64, 96), 3.0), ShapeWeight(SampleShape(9, 64, 64), 1.0)]


def test_an_unreadable_shard_is_permission_denied_not_missing(tmp_path, monkeypatch):
    from ds_adaptive.data import shards

    ds = SyntheticLatentDataset(4, SMALL, seed=2)
    with LatentShardWriter(tmp_path / "ds") as w:
        for i in range(len(ds)):
            s = ds[i]
            w.add(f"{i:04d}", ds.shape_of(i), s["latents"], s["context"])
    real_open = open

    def denied(path, *a, **kw):   # what chmod 000 does for anyone but root
        if str(path).endswith(".safetensors"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(shards, "open", denied, raising=False)
    with pytest.raises(DataError) as e:
        LatentShardDataset(tmp_path / "ds", verify=True)
    msg = str(e.value)
    assert "exists but cannot be read (Permission denied" in msg and "No such file" not in msg and "chmod" in msg


class FakeSampler:
    def __init__(self, fail: bool) -> None:
        self.fail, self.epoch = fail, None

    def load_state_dict(self, state):
        if self.fail:
            raise SamplerStateError("sampler state was saved for a dataset of 80 samples (shapes ab), this dataset "
                                    "has 79 (cd): the consumed samples cannot be identified. Resume with the same "
                                    "dataset, or pass --restart-epoch")

    def set_epoch(self, epoch):
        self.epoch = epoch


def _ckpt(restart: bool, fail: bool, log):
    run = SimpleNamespace(cfg=SimpleNamespace(trainer=SimpleNamespace(restart_epoch=restart)),
                          sampler=FakeSampler(fail))
    return Checkpointing(run, engine=None, log=log), run


def test_a_changed_dataset_names_the_flag_and_the_flag_replans_the_epoch():
    said = []
    ck, run = _ckpt(False, True, said.append)
    with pytest.raises(SamplerStateError, match="--restart-epoch"):
        ck._load_sampler({"sampler": {}, "epoch": 1, "global_step": 40})
    ck, run = _ckpt(True, True, said.append)
    assert ck._load_sampler({"sampler": {}, "epoch": 1, "global_step": 40}) is True
    assert run.sampler.epoch == 1 and len(said) == 1 and said[0].startswith("ds_adaptive: --restart-epoch: ")
    assert "epoch 1 is planned afresh for this dataset from step 40 on" in said[0]
    ck, run = _ckpt(True, False, said.append)
    assert ck._load_sampler({"sampler": {}, "epoch": 1, "global_step": 40}) is False


def test_the_restart_epoch_flag_parses():
    from ds_adaptive.cli.train import build_parser

    assert build_parser().parse_args(["--deepspeed_config", "x", "--restart-epoch"]).restart_epoch is True


def test_the_lock_guard_file_goes_with_the_lock(tmp_path):
    from ds_adaptive.training.runlock import RunLock

    lock = RunLock.acquire(tmp_path, command="test")
    lock.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_metrics_jsonl_keeps_each_step_once_after_a_resume(tmp_path):
    from ds_adaptive.training.metrics import truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 9)) + '{"step": 9, "lo')
    assert truncate_jsonl(path, 6) == 3
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert truncate_jsonl(tmp_path / "none.jsonl", 6) == 0


def test_resume_on_another_world_size_or_model_is_one_line_before_loading(tmp_path):
    from ds_adaptive.training.checkpointing import resume_mismatch

    saved = {"world_size": 2, "model": "tiny", "num_layers": 1}
    assert resume_mismatch(saved, world=2, model="tiny", layers=1) is None
    msg = resume_mismatch(saved, world=1, model="tiny", layers=1)
    assert msg is not None and "\n" not in msg and "saved by 2 rank(s), this run has 1" in msg and "NUM_PROCS=2" in msg
    assert resume_mismatch(saved, world=1, model="tiny", layers=1, zero_sharded=False) is None  # no ZeRO shards
    msg = resume_mismatch(saved, world=2, model="wan2.1-1.3b", layers=30)
    assert msg is not None and "--model tiny (1 blocks), this run is --model wan2.1-1.3b" in msg and "MODEL=tiny" in msg
    assert resume_mismatch(saved, world=2, model="tiny", layers=2) is not None
    assert resume_mismatch({}, world=1, model="tiny", layers=None) is None  # markers of older checkpoints
    with pytest.raises(UsageError):
        raise UsageError(msg)
    assert TrainState().global_step == 0 and Path(tmp_path).is_dir()
