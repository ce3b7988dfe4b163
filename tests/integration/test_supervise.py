"""Guards ds_adaptive/launch/supervise.py (what launch/train_wan.sh runs `deepspeed` under), with real processes: SIGTERM
to the launcher reaches every rank through DeepSpeed's launcher chain and the rank's exit code comes back; SIGKILL
of the launcher leaves no process of the run behind; a rank gets SIGTERM when its parent is SIGKILLed."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUPERVISE = ("-m", "ds_adaptive.launch.supervise")  # as launch/train_wan.sh runs it

# A stand-in for a training rank: records its pid and process group, and on SIGTERM "finishes its step"
# (0.5 s), writes a marker and exits with 75 (what a preempted trainer returns).
FAKE_RANK = textwrap.dedent("""
    import os, signal, sys, time
    out = sys.argv[-1]
    rank = os.environ.get("RANK", "?")
    def stop(signum, frame):
        time.sleep(0.5)
        open(os.path.join(out, f"stopped{rank}"), "w").write(signal.Signals(signum).name)
        sys.exit(75)
    signal.signal(signal.SIGTERM, stop)
    open(os.path.join(out, f"rank{rank}.tmp"), "w").write(f"{os.getpid()} {os.getpgid(0)}")
    os.replace(os.path.join(out, f"rank{rank}.tmp"), os.path.join(out, f"rank{rank}.pid"))
    while True:
        time.sleep(0.1)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    return True


def _group_alive(pgid: int) -> list[int]:
    """Pids of running (non-zombie) processes in process group ``pgid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry))
    return out


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def _start(tmp_path: Path) -> tuple[subprocess.Popen, list[tuple[int, int]]]:
    """supervise.py -- deepspeed --num_gpus 2 fake_rank.py: the real DeepSpeed launcher chain on the CPU."""
    if shutil.which("deepspeed") is None:
        pytest.fail("the `deepspeed` launcher is not on PATH: pip install -e '.[dev]' installs it")
    (tmp_path / "fake_rank.py").write_text(FAKE_RANK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, *SUPERVISE, "--", "deepspeed", "--num_gpus", "2", "--master_port",
                             str(port), str(tmp_path / "fake_rank.py"), str(tmp_path)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: all((tmp_path / f"rank{r}.pid").is_file() for r in (0, 1)) or proc.poll() is not None,
              120, "both ranks to start")
    except BaseException:
        proc.kill()
        raise
    if proc.poll() is not None:
        pytest.fail(f"the launcher exited early ({proc.returncode}):\n{proc.communicate()[0][-4000:]}")
    ranks = [tuple(int(v) for v in (tmp_path / f"rank{r}.pid").read_text().split()) for r in (0, 1)]
    return proc, ranks


def test_sigterm_to_the_launcher_reaches_every_rank(tmp_path):
    proc, ranks = _start(tmp_path)
    pgid = ranks[0][1]
    try:
        assert pgid != os.getpgid(0) and ranks[1][1] == pgid  # the run has its own process group
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        out = proc.stdout.read()
        for r in (0, 1):  # each rank's own handler ran to its end ...
            assert (tmp_path / f"stopped{r}").read_text() == "SIGTERM", out[-3000:]
        assert rc == 75, out[-3000:]  # ... and its exit code is the launcher's
        assert "forwarded to 2 rank process(es)" in out
        _wait(lambda: not _group_alive(pgid), 10, "the run's processes to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _group_alive(pgid):
            os.kill(pid, signal.SIGKILL)


def test_sigkill_of_the_launcher_leaves_no_orphan(tmp_path):
    proc, ranks = _start(tmp_path)
    pgid = ranks[0][1]
    try:
        members = _group_alive(pgid)
        assert {pid for pid, _ in ranks} < set(members)  # ranks + DeepSpeed's runner and per-node launcher
        proc.kill()
        proc.wait(timeout=10)
        _wait(lambda: not any(_alive(pid) for pid in members), 20, f"the run's processes {members} to die")
        assert not _group_alive(pgid)
        assert not any((tmp_path / f"stopped{r}").exists() for r in (0, 1))  # killed, not a graceful stop
    finally:
        for pid in _group_alive(pgid):
            os.kill(pid, signal.SIGKILL)


def test_die_with_parent_sends_sigterm_when_the_parent_is_killed(tmp_path):
    """The rank side: DeepSpeed's per-node launcher SIGKILLed -> its ranks get SIGTERM (prctl PDEATHSIG)."""
    child = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from ds_adaptive.launch.supervise import die_with_parent
        out = sys.argv[1]
        signal.signal(signal.SIGTERM, lambda *a: (open(out + "/got", "w").write("SIGTERM"), sys.exit(0)))
        assert die_with_parent()
        open(out + "/pid", "w").write(str(os.getpid()))
        time.sleep(60)
    """)
    parent = textwrap.dedent(f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {child!r}, sys.argv[1]])
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", parent, str(tmp_path)])
    try:
        _wait(lambda: (tmp_path / "pid").is_file(), 30, "the child to start")
        pid = int((tmp_path / "pid").read_text())
        p.kill()
        p.wait()
        _wait(lambda: (tmp_path / "got").is_file(), 10, "the child to get SIGTERM")
        _wait(lambda: not _alive(pid), 10, "the child to exit")
    finally:
        p.kill()


def test_usage_errors():
    r = subprocess.run([sys.executable, *SUPERVISE, "deepspeed"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "give the command after '--'" in r.stderr
    r = subprocess.run([sys.executable, *SUPERVISE, "--", "/no/such/launcher"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 127 and "cannot start '/no/such/launcher'" in r.stderr
    r = subprocess.run([sys.executable, *SUPERVISE, "--", sys.executable, "-c", "import sys; sys.exit(3)"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3
