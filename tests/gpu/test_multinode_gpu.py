"""Guards the per-node launcher on GPUs (NCCL through the launcher-held rendezvous store): launch/train_wan.sh with
NNODES / NODE_RANK trains like DeepSpeed's own single-node launch. Two "nodes" of one GPU each where the machine
has 2 GPUs or more, else one node of one GPU (the NCCL rendezvous through the agent store is what is tested)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "train_wan.sh"
ARGS = ["--num-samples", "64", "--layers", "2", "--seed", "3", "--grad-ckpt", "none"]
STEPS = 3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    drop = ("NUM_GPUS", "HOSTFILE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "LAUNCH_MODE", "RESUME")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])  # keep where deepspeed lives
    return {**env, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "MODEL": "tiny", "STEPS": str(STEPS),
            "SAVE_DIR": "", **{k: str(v) for k, v in extra.items()}}


def _losses(d: Path) -> list:
    return json.loads((d / "summary.json").read_text())["losses"]


def test_per_node_launch_on_gpus_trains_like_deepspeeds_launch(tmp_path):
    pytest.importorskip("deepspeed")
    if shutil.which("deepspeed") is None:
        pytest.skip("the `deepspeed` launcher is not on PATH")
    nodes = 2 if torch.cuda.device_count() >= 2 else 1
    ref = subprocess.run(["bash", str(SCRIPT), *ARGS, "--log-dir", "ref"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, env=_env(NUM_GPUS=nodes, MASTER_PORT=_port(),
                                                          CUDA_VISIBLE_DEVICES=",".join(map(str, range(nodes)))))
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-4000:]
    port = _port()
    procs = [subprocess.Popen(["bash", str(SCRIPT), *ARGS, "--log-dir", "nodes"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_env(NUM_GPUS=1, NNODES=nodes, NODE_RANK=r, MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port, CUDA_VISIBLE_DEVICES=r))
             for r in range(nodes)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * nodes, "\n".join(o[-3000:] for o in outs)
    assert f"started rank 0 of {nodes}" in outs[0]
    ours, theirs = _losses(tmp_path / "nodes"), _losses(tmp_path / "ref")
    assert len(ours) == STEPS and ours == pytest.approx(theirs, rel=2e-3), (ours, theirs)
