"""The multi-process test harness (``conftest.launch_ranks``): a rank that fails ends the job promptly, and a job
whose rendezvous port another process took starts once more on a new port. Both launch paths: ranks forked from
the fork server, and fresh interpreters."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import conftest
from conftest import launch_ranks

#: rank 0 fails at once; rank 1 waits forever, as a rank does in a rendezvous whose rank 0 is gone
FAIL_ONE = "import os, sys, time\nif os.environ['RANK'] == '0':\n    print('rank 0 gives up')\n    sys.exit(3)\n" \
           "while True:\n    time.sleep(1)\n"
#: the first launch's rank 0 reports a taken port (as torch's TCPStore does); the second launch runs
PORT_ONCE = ("import os, sys, pathlib\nmark = pathlib.Path('first_done')\n"
             "if os.environ['RANK'] == '0' and not mark.exists():\n    mark.write_text(os.environ['MASTER_PORT'])\n"
             "    print('EADDRINUSE, message: address already in use')\n    sys.exit(1)\n"
             "print('port', os.environ['MASTER_PORT'])\n")


@pytest.fixture(params=["forked", "fresh"])
def path(request, monkeypatch):
    if request.param == "fresh":
        monkeypatch.setenv("DS_ADAPTIVE_TEST_FRESH_RANKS", "1")
    else:
        monkeypatch.delenv("DS_ADAPTIVE_TEST_FRESH_RANKS", raising=False)
    monkeypatch.setattr(conftest, "FAILED_RANK_GRACE_S", 2.0)
    return request.param


def test_the_fork_server_starts():
    """Without it every test rank is a fresh interpreter (~8 CPU-s of imports each) and nothing says so but a line on
    stderr: an import that starts a thread (pyarrow's, imported by the trainer's data module) made the server refuse
    to start, and the suite's multi-process tests ran ~2x slower."""
    if os.environ.get("DS_ADAPTIVE_TEST_FRESH_RANKS") == "1":
        pytest.skip("DS_ADAPTIVE_TEST_FRESH_RANKS=1 asks for fresh interpreters")
    assert conftest._rank_zygote() is not None, f"the rank fork server did not start: {conftest._ZYGOTE_WHY}"


def test_a_failed_rank_ends_the_job_before_its_timeout(tmp_path, path):
    (tmp_path / "job.py").write_text(FAIL_ONE)
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as err:
        launch_ranks([str(tmp_path / "job.py")], 2, cwd=tmp_path, timeout=120)
    assert time.monotonic() - t0 < 60
    msg = str(err.value)
    assert "failed on rank(s) [0, 1]" in msg and "--- rank 0 (exit 3) ---\nrank 0 gives up" in msg
    assert "timed out" not in msg


def test_a_taken_port_starts_the_job_once_more_on_a_new_port(tmp_path, path):
    (tmp_path / "job.py").write_text(PORT_ONCE)
    results = launch_ranks([str(tmp_path / "job.py")], 2, cwd=tmp_path, timeout=120)
    first = (tmp_path / "first_done").read_text()
    ports = {r.stdout.split()[-1] for r in results}
    assert all(r.returncode == 0 for r in results) and len(ports) == 1 and first not in ports


def test_a_job_past_its_timeout_fails_with_every_rank_output(tmp_path, path):
    (tmp_path / "job.py").write_text("import time\nprint('waiting', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(pytest.fail.Exception, match=r"2-rank job .* timed out after 3 s\n--- rank 0 ---\nwaiting"):
        launch_ranks([str(tmp_path / "job.py")], 2, cwd=tmp_path, timeout=3)


def test_ports_are_drawn_below_the_ephemeral_range():
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not ephemeral.is_file() or int(ephemeral.read_text().split()[0]) < 21000:
        pytest.skip("no ephemeral port range below which to draw on this machine")
    ports = {conftest._free_port() for _ in range(20)}
    assert all(20000 <= p < int(ephemeral.read_text().split()[0]) for p in ports) and len(ports) > 1
