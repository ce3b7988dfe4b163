"""Issue 52, cases 3, 5, 6, 8 with a stand-in for DeepSpeed's per-node launcher (a process whose command line names
``deepspeed.launcher.launch`` and whose children are the ranks): the first failing rank's message reaches the
console through the supervisor even when the launcher kills that rank first; a launcher that ends with 0 while its
ranks stopped (exit 75) is 75; a rank without a heartbeat (SIGSTOP) stops the job with one line naming it and its
host (the watchdog); resume hints after a start-up error do not advise resuming; the reaper removes the job's
/dev/shm buffers. Real processes, no DeepSpeed, a few seconds each."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ds_adaptive.launch.rank_watch import EXIT_STUCK, read_fatal, stale_heartbeats, write_fatal

ROOT = Path(__file__).resolve().parents[2]

# argv: [fake_launch.py, "deepspeed.launcher.launch", rank_code, world, launcher_rc, kill_others]
FAKE_LAUNCH = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    code, world, launcher_rc, kill_others = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
    ranks = [subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "RANK": str(r)}) for r in range(world)]
    while True:   # like DeepSpeed's launcher: once one rank fails, kill the others at once
        codes = [p.poll() for p in ranks]
        if kill_others and any(c not in (None, 0) for c in codes):
            for p in ranks:
                if p.poll() is None:
                    p.kill()
            break
        if all(c is not None for c in codes):
            break
        time.sleep(0.05)
    for p in ranks:
        p.wait()
    sys.exit(launcher_rc)
""")

RANK_PRELUDE = "import os, sys, time\nfrom ds_adaptive.launch.rank_watch import *\nrank = int(os.environ['RANK'])\n"


def _supervise(tmp_path, rank_code: str, *, world=2, launcher_rc=0, kill_others=True, extra=(), timeout=60,
               **env) -> subprocess.CompletedProcess:
    (tmp_path / "fake_launch.py").write_text(FAKE_LAUNCH)
    cmd = [sys.executable, "-m", "ds_adaptive.launch.supervise", *extra, "--", sys.executable,
           str(tmp_path / "fake_launch.py"), "deepspeed.launcher.launch", RANK_PRELUDE + textwrap.dedent(rank_code),
           str(world), str(launcher_rc), "1" if kill_others else "0", "--save", str(tmp_path / "ck")]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def _lines(r) -> list[str]:
    return [x for x in r.stderr.splitlines() if x.startswith("ds_adaptive supervisor:")]


def test_the_first_failing_ranks_message_reaches_the_console_when_its_launcher_kills_it(tmp_path):
    r = _supervise(tmp_path, """
        if rank == 1:
            write_fatal("ds-adaptive train: error: launch/configs/x.json: line 3: Expecting ',' delimiter",
                        resume=False)
            write_exit(2)
            sys.exit(2)
        time.sleep(30)   # rank 0 never gets to print: the launcher kills it
    """)
    assert r.returncode == 2, r.stderr[-3000:]
    (line,) = _lines(r)
    assert "rank 1 (pid " in line and "exited with status 2 (ds-adaptive train: error: launch/configs/x.json: " \
        "line 3: Expecting ',' delimiter)" in line
    assert line.endswith("Nothing to resume from this launch: do what the message says, then start it again.")


def test_a_launcher_that_says_0_while_its_ranks_stopped_is_75(tmp_path):
    r = _supervise(tmp_path, "write_exit(75)\nsys.exit(75)\n", launcher_rc=0, kill_others=False)
    assert r.returncode == 75, r.stderr[-3000:]
    (line,) = _lines(r)
    assert "the ranks stopped at a step boundary and exited 75; exit 75" in line


def test_a_stopped_rank_is_named_by_the_watchdog(tmp_path):
    t = time.monotonic()
    r = _supervise(tmp_path, """
        start_heartbeat(0.2)
        time.sleep(1.5)
        if rank == 1:
            os.kill(os.getpid(), __import__('signal').SIGSTOP)
        time.sleep(60)
    """, extra=("--watchdog", "3"))
    assert r.returncode == EXIT_STUCK, r.stderr[-3000:]
    (line,) = _lines(r)
    assert line.startswith(f"ds_adaptive supervisor: watchdog: rank 1 (pid ") and \
        f"on host {socket.gethostname()} made no progress for" in line and "exit 124" in line, line
    assert "No complete checkpoint in" in line
    assert time.monotonic() - t < 40


def test_the_watchdog_reads_heartbeats(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ADAPTIVE_FATAL_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    from ds_adaptive.launch.rank_watch import start_heartbeat

    assert start_heartbeat(0.05) is not None
    time.sleep(0.2)
    assert stale_heartbeats(str(tmp_path), 5) == []
    (stale,) = stale_heartbeats(str(tmp_path), 5, now=time.time() + 60)
    assert stale["rank"] == 3 and stale["host"] == socket.gethostname() and stale["pid"] == os.getpid()
    assert stale_heartbeats(str(tmp_path), 5, now=time.time() + 60, ended={3}) == []
    write_fatal("one", resume=True, rank=2)
    assert read_fatal(str(tmp_path))["message"] == "one"


def test_the_reaper_removes_the_jobs_shm_buffers_and_fatal_dir(tmp_path):
    from ds_adaptive.launch.supervise import SHM_PREFIX

    port = 40000 + os.getpid() % 20000
    buf = Path(f"{SHM_PREFIX}_{os.getuid()}_127.0.0.1_{port}_0")
    (tmp_path / "fake_launch.py").write_text(FAKE_LAUNCH)
    from ds_adaptive.launch.rank_watch import ENV_FATAL_DIR

    told = tmp_path / "fatal_dir.txt"   # the supervisor's own fatal dir, as its rank sees it (other tests make theirs)
    code = RANK_PRELUDE + (f"open({str(told)!r}, 'w').write(os.environ[{ENV_FATAL_DIR!r}])\n"
                           f"open({str(buf)!r}, 'wb').write(b'x')\ntime.sleep(60)\n")
    # the supervisor's master-port handling needs a ``deepspeed`` command: run the fake launcher under that name
    stub = tmp_path / "deepspeed"
    stub.write_text(f"#!{sys.executable}\nimport os, sys\nos.execv(sys.executable, [sys.executable, "
                    f"{str(tmp_path / 'fake_launch.py')!r}, 'deepspeed.launcher.launch', {code!r}, '1', '0', '0'])\n")
    stub.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    sup = subprocess.Popen([sys.executable, "-m", "ds_adaptive.launch.supervise", "--", "deepspeed", "--master_port",
                            str(port), "x.py"], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not buf.exists():
            assert sup.poll() is None and time.monotonic() < deadline, sup.stderr.read()
            time.sleep(0.1)
        fatal_dirs = [Path(told.read_text())]
        assert fatal_dirs[0].is_dir()
        sup.send_signal(signal.SIGKILL)
        sup.wait(timeout=10)
        deadline = time.monotonic() + 20
        while buf.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not buf.exists()
        assert fatal_dirs and not any(d.exists() for d in fatal_dirs)  # the reaper removed the supervisor's dir
    finally:
        buf.unlink(missing_ok=True)
        if sup.poll() is None:
            sup.kill()


@pytest.mark.parametrize("resume", [True, False])
def test_resume_hints_follow_the_ranks_record(tmp_path, resume):
    r = _supervise(tmp_path, f"""
        if rank == 0:
            write_fatal("ds-adaptive train: error: boom", resume={resume})
            write_exit(2)
            sys.exit(2)
        time.sleep(30)
    """)
    (line,) = _lines(r)
    assert ("No complete checkpoint in" in line) is resume
    assert ("Nothing to resume from this launch" in line) is not resume
