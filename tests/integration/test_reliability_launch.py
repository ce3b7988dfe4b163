"""Issue 52 with the real launcher (launch/train_wan.sh, 2 CPU ranks under DeepSpeed): SIGKILL of DeepSpeed's per-node
launcher exits 75 (not 0); a SIGSTOPped rank is stopped by the watchdog with one line naming it, and RESUME=1
continues with each step once in metrics.jsonl; NUM_PROCS=1 RESUME=1 after a 2-rank run is one line before loading;
a save that fills a small (40 MB) filesystem keeps the last complete checkpoint and RESUME=1 continues once space is freed.
The runs around each launcher test (a first checkpoint, a resume, a refused start) are the trainer's ranks as the
launcher starts them, on the test harness."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import launch_ranks, launcher_env

from ds_adaptive.training.checkpoint import check_checkpoint, checkpoint_tags

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "train_wan.sh"
CPU_CONFIG = ROOT / "launch" / "configs" / "cpu_tiny.json"
TRAIN = ["--num-samples", "200", "--layers", "1", "--seed", "5"]


def _env(**extra) -> dict:
    return launcher_env(**extra)


def _launch(tmp_path, *args, timeout=300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--deepspeed_config", str(CPU_CONFIG), *TRAIN, *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout, env=_env(**env))


def _trainer_ranks(tmp_path, world: int, *args, steps: int, save, save_interval: int = 10, keep: int = 2,
                   resume: bool = False, check: bool = True) -> list[subprocess.CompletedProcess]:
    """The trainer with the arguments launch/train_wan.sh gives it on the CPU (STEPS, SAVE_DIR, SAVE_INTERVAL,
    KEEP_CHECKPOINTS, RESUME=1: --resume SAVE_DIR) on ``world`` ranks of the test harness (conftest.launch_ranks):
    for the runs whose checks are the ranks' (a resume, a refused start), which need no launcher (~10 s of
    DeepSpeed's launcher start-up each); the launcher's part is the interrupted run of each test."""
    argv = ["-m", "ds_adaptive.cli.train", "--deepspeed_config", str(CPU_CONFIG), "--model", "tiny", "--steps",
            str(steps), "--save", str(save), "--save-interval", str(save_interval), "--keep-checkpoints", str(keep),
            *(["--resume", str(save)] if resume else []), "--deepspeed_config", str(CPU_CONFIG), *TRAIN, *args]
    return launch_ranks(argv, world, cwd=tmp_path, env={"PYTHONPATH": str(ROOT)}, timeout=300, check=check)


def _start(tmp_path, log: Path, *args, **env) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(["bash", str(SCRIPT), "--deepspeed_config", str(CPU_CONFIG), *TRAIN, *args],
                                cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT, env=_env(**env))


def _wait_for(proc, log: Path, text: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def _procs(root_pid: int, pattern: str, rank=None) -> list:
    import psutil

    out = []
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            if pattern in " ".join(p.cmdline()) and (rank is None or p.environ().get("RANK") == str(rank)):
                out.append(p)
        except psutil.Error:
            continue
    return out


def _sup_lines(out: str) -> list[str]:
    return [x for x in out.splitlines() if x.startswith("ds_adaptive supervisor:")]


@pytest.mark.slow
def test_sigkill_of_deepspeeds_launcher_is_75_not_0(tmp_path):
    log = tmp_path / "run.log"
    proc = _start(tmp_path, log, STEPS=200, SAVE_DIR="ck", SAVE_INTERVAL=0)
    try:
        _wait_for(proc, log, "step 5/200")
        (launcher,) = _procs(proc.pid, "deepspeed.launcher.launch")
        launcher.send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert rc == 75, out[-4000:]
    assert "Traceback" not in out
    tag = (tmp_path / "ck" / "latest").read_text().strip()
    assert check_checkpoint(tmp_path / "ck" / tag) is None
    # the saved run on 1 process (NUM_PROCS=1 RESUME=1): refused before anything is loaded, one line saying how
    (r,) = _trainer_ranks(tmp_path, 1, steps=300, save="ck", resume=True, check=False)
    assert r.returncode == 2, r.stdout[-3000:]
    errors = [x for x in r.stdout.splitlines() if "error" in x]
    assert len(errors) == 1 and "saved by 2 rank(s), this run has 1" in errors[0] and "NUM_PROCS=2" in errors[0]
    assert "Traceback" not in r.stdout and "resumed from" not in r.stdout
    r = _launch(tmp_path, STEPS=300, SAVE_DIR="ck", RESUME=1, OVERWRITE=1)
    assert r.returncode == 2 and "give one of them" in r.stderr
    r = _launch(tmp_path, NUM_PROCS=0, SAVE_DIR="")
    assert r.returncode == 2 and "NUM_PROCS must be a number of CPU processes >= 1, got '0'" in r.stderr


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_and_resume_continues(tmp_path):
    log = tmp_path / "run.log"
    proc = _start(tmp_path, log, "--log-dir", "logs", STEPS=200, SAVE_DIR="ck", SAVE_INTERVAL=2,
                  DS_ADAPTIVE_WATCHDOG_S=8)
    try:
        _wait_for(proc, log, "saved checkpoint step 4")
        (rank1,) = _procs(proc.pid, "train_wan.py", rank=1)
        rank1.suspend()   # kill -STOP
        t = time.monotonic()
        rc = proc.wait(timeout=120)
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert rc == 124, out[-4000:]
    lines = [x for x in _sup_lines(out) if "watchdog" in x]
    assert len(lines) == 1 and f"rank 1 (pid {rank1.pid}) on host {socket.gethostname()} made no progress" in lines[0]
    assert "The last complete checkpoint is ck/global_step" in lines[0] and "RESUME=1" in lines[0]
    assert took < 90, took
    last = int((tmp_path / "ck" / "latest").read_text().strip().removeprefix("global_step"))
    # RESUME=1: the 2 ranks as the launcher starts them (--resume ck), on the test harness
    out = _trainer_ranks(tmp_path, 2, "--log-dir", "logs", steps=last + 2, save="ck", save_interval=2,
                         resume=True)[0].stdout
    assert f"step {last} (epoch" in out
    steps = [json.loads(x)["step"] for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == last + 2, steps
    assert not any(p.name.startswith(".ds_adaptive.lock") for p in (tmp_path / "ck").iterdir())


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "fs20"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs a 40 MB tmpfs (root and mount)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_keeps_the_last_checkpoint_and_resume_continues(tmp_path, small_fs):
    ck = small_fs / "ck"
    _trainer_ranks(tmp_path, 2, steps=2, save=ck, save_interval=2, keep=0)   # the first checkpoint (2 ranks)
    size = sum(f.stat().st_size for f in (ck / "global_step2").rglob("*") if f.is_file())
    log = tmp_path / "run.log"
    proc = _start(tmp_path, log, STEPS=12, SAVE_DIR=ck, SAVE_INTERVAL=10, KEEP_CHECKPOINTS=0, RESUME=1)
    try:
        _wait_for(proc, log, "resumed from")   # the start-up check passed; the disk fills before the save of step 10
        free = shutil.disk_usage(small_fs).free
        (small_fs / "filler").write_bytes(b"\0" * max(0, free - size // 2))
        rc = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert rc == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [x for x in out.splitlines() if x.startswith("ds-adaptive train: error:")]
    assert len(errors) == 1 and f"{ck} has " in errors[0] and "it needs about" in errors[0], out[-3000:]
    assert f"The last complete checkpoint {ck / 'global_step2'} is kept" in errors[0] and "RESUME=1" in errors[0]
    assert checkpoint_tags(ck) == ["global_step2"] and not any(p.name.endswith(".partial") for p in ck.iterdir())
    (small_fs / "filler").unlink()
    out = _trainer_ranks(tmp_path, 2, steps=4, save=ck, save_interval=2, keep=1, resume=True)[0].stdout  # RESUME=1
    assert "step 2 (epoch" in out and checkpoint_tags(ck)[-1] == "global_step4"
