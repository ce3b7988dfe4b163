"""Guards README.md's own-data workflow: its marked bash blocks run as written, in order, in a fresh directory on
the CPU with the stand-in pipeline of `ds-adaptive demo-assets` (preprocess -> stats -> simulate -> train -> sample
-> export; the fine-tune line as the dry run of that launch), and end with a trained checkpoint, a sampled mp4 and
an export that diffusers loads."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("av")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("ftfy")

ROOT = Path(__file__).resolve().parents[2]


def workflow_commands() -> list[str]:
    """The lines of README.md's bash blocks marked ``<!-- workflow: ...``, in order (less the install line)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"<!-- workflow:[^\n]*\n```bash\n(.*?)```", text, re.S)
    lines = [line.strip() for b in blocks for line in b.splitlines() if line.strip()]
    return [line for line in lines if not line.startswith("pip install")]


def test_the_workflow_is_in_the_readme():
    cmds = workflow_commands()
    firsts = [c.split()[1] if c.startswith("ds-adaptive") else c for c in cmds]
    assert firsts[:3] == ["demo-assets", "preprocess", "stats"], cmds
    assert any("launch/train_wan.sh --data" in c for c in cmds) and any("--init-from" in c for c in cmds)
    assert any(c.startswith("ds-adaptive sample") for c in cmds) and any(c.startswith("ds-adaptive export") for c in cmds)


@pytest.mark.slow
def test_readme_own_data_workflow_runs_as_written(tmp_path):
    if shutil.which("deepspeed") is None or shutil.which("ds-adaptive") is None:
        pytest.fail("`deepspeed` / `ds-adaptive` are not on PATH: pip install -e '.[dev]' installs them")
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUM_GPUS", "HOSTFILE", "DS_CONFIG", "MODEL", "STEPS", "SP", "SAVE_DIR", "RESUME", "DRY_RUN")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep))
    with socket.socket() as sock:  # a free rendezvous port: other jobs on the machine may hold 29500
        sock.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(sock.getsockname()[1])
    (tmp_path / "launch").symlink_to(ROOT / "launch")  # `bash launch/train_wan.sh` as written, from a fresh directory
    for cmd in workflow_commands():
        run_env = dict(env, DRY_RUN="1") if "--init-from" in cmd else env  # the fine-tune launch: its dry run
        r = subprocess.run(["bash", "-c", f"set -eo pipefail; {cmd}"], cwd=tmp_path, env=run_env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        assert "Traceback" not in r.stderr, f"{cmd}\n{r.stderr[-3000:]}"
    assert sorted(p.name for p in (tmp_path / "runs" / "mine").glob("global_step*")) == ["global_step4"]
    mp4 = tmp_path / "samples" / "ball.mp4"
    assert mp4.is_file() and mp4.stat().st_size > 0
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(str(tmp_path / "exports" / "mine"))
    assert model.config.num_layers == 2 and model.config.in_channels == 16
