"""Guards checkpoint checksums on a GPU: a ZeRO-3 bf16 engine (one process) saved through ``write_checkpoint``
has every file hashed while written (the digests match the files), loads back, and a changed byte is found."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")


def test_zero3_bf16_checkpoint_checksums_on_cuda(tmp_path):
    from ds_adaptive.training.checkpoint import check_checkpoint, read_marker, write_checkpoint
    from ds_adaptive.training.checksum import file_digest
    from ds_adaptive.core.ds_config import prepare_ds_config, read_ds_config
    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.models.wan_config import get_wan_config
    from ds_adaptive.training.engine import init_distributed

    init_distributed(0)
    raw = dict(read_ds_config(Path(__file__).resolve().parents[2] / "launch" / "configs" / "zero3_adaptive.json"))
    raw["gradient_accumulation_steps"] = 1
    ds_config = prepare_ds_config(raw, dp_size=1, on_gpu=True)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = WanModel(get_wan_config("tiny"))
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=list(model.parameters()))
    tag_dir = write_checkpoint(engine, tmp_path, "global_step1", {"ds_adaptive": {"global_step": 1}}, step=1,
                               run_id="gpu", log=lambda m: None)
    marker = read_marker(tag_dir)
    sums = marker["checksums"]
    assert set(sums["files"]) == set(marker["files"]) and sums["files"]
    for name, digest in sums["files"].items():
        assert file_digest(tag_dir / name, sums["algorithm"]) == digest
    assert check_checkpoint(tag_dir) is None
    load_path, client = engine.load_checkpoint(str(tmp_path), tag="global_step1")
    assert load_path is not None and client["ds_adaptive"]["global_step"] == 1
    victim = next(tag_dir.glob("*optim_states.pt"))
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 2)
        f.write(b"\xff" * 64)
    assert "does not match its" in check_checkpoint(tag_dir)
    torch.distributed.destroy_process_group()
