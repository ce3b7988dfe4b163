"""The supervisor's account of a failure when the watch missed the failing rank: its exit record names it.

DeepSpeed's launcher kills the other ranks the moment one exits non-zero and reaps the failed one at once, so the
supervisor's watch can miss the failing rank entirely (it ended before the watch's next poll found it) and see only
the ranks killed after it. The ranks' exit records (``rankR.exit``, written before they exit) and the time each end
was seen put the blame where it belongs. No processes: a watch with set ends and a records directory."""
from __future__ import annotations

import json
import os
import signal
import time

from ds_adaptive.launch import rank_watch, supervise
from ds_adaptive.launch.rank_watch import EXIT_PEER_LOST, RankEnd, RankWatch


def _supervisor(tmp_path, ended: list[RankEnd]) -> tuple[supervise.Supervisor, list[str]]:
    said: list[str] = []
    sup = supervise.Supervisor(["deepspeed", "--num_gpus", "2", "t.py", "--save", str(tmp_path / "ck")],
                               log=said.append)
    sup.watch = RankWatch.__new__(RankWatch)
    sup.watch.ended = ended
    sup.fatal_dir = str(tmp_path / "fatal")
    os.makedirs(sup.fatal_dir, exist_ok=True)
    return sup, said


def _record(sup, rank: int, code: int, at: float, message: str = "") -> None:
    path = os.path.join(sup.fatal_dir, f"rank{rank}.exit")
    with open(path, "w") as f:
        f.write(str(code))
    os.utime(path, (at, at))
    if message:
        with open(os.path.join(sup.fatal_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "pid": 4242, "message": message, "resume": False, "printed": False,
                       "time": at}, f)


def test_an_unseen_rank_that_recorded_its_failure_is_blamed_not_the_rank_killed_after_it(tmp_path):
    now = time.time()
    sup, said = _supervisor(tmp_path, [RankEnd(0, 11, signal=signal.SIGKILL, seen=now)])
    _record(sup, 1, 2, now - 0.5, "ds-adaptive train: error: boom")
    assert sup._exit_status(0) == 2
    (line,) = said
    assert line.startswith("rank 1 (pid 4242) exited with status 2 (ds-adaptive train: error: boom); the other "
                           "rank(s) stopped; exit 2. Nothing to resume from this launch"), line


def test_a_record_written_after_the_seen_end_is_its_consequence(tmp_path):
    now = time.time()
    sup, said = _supervisor(tmp_path, [RankEnd(0, 11, signal=signal.SIGSEGV, seen=now)])
    _record(sup, 1, 1, now + 1.0)   # rank 1 raised on the lost collective after rank 0 crashed
    assert sup._exit_status(0) == 128 + signal.SIGSEGV
    (line,) = said
    assert line.startswith("rank 0 (pid 11) was killed by SIGSEGV"), line


def test_a_rank_seen_stopping_on_the_lost_peer_is_not_the_cause(tmp_path):
    now = time.time()
    sup, said = _supervisor(tmp_path, [RankEnd(0, 11, code=EXIT_PEER_LOST, seen=now)])
    _record(sup, 0, EXIT_PEER_LOST, now - 0.1)
    _record(sup, 1, 2, now - 0.4)
    assert sup._exit_status(EXIT_PEER_LOST) == 2
    assert said[0].startswith("rank 1 exited with status 2; the other rank(s) stopped; exit 2."), said


def test_a_seen_failure_with_its_own_status_stands(tmp_path):
    now = time.time()
    sup, said = _supervisor(tmp_path, [RankEnd(1, 12, code=2, seen=now), RankEnd(0, 11, signal=9, seen=now + 0.1)])
    _record(sup, 1, 2, now - 0.01)
    assert sup._exit_status(2) == 2
    assert said[0].startswith("rank 1 (pid 12) exited with status 2; the other rank(s) stopped; exit 2."), said


def test_an_unseen_end_of_the_recorded_rank_keeps_its_record(tmp_path):
    now = time.time()
    sup, said = _supervisor(tmp_path, [RankEnd(1, 12, seen=now)])   # reaped before its status was read
    _record(sup, 1, 2, now - 0.2)
    assert sup._exit_status(0) == 2


class _Proc:
    def __init__(self, cmd, parent=None):
        self._cmd, self._parent = cmd, parent

    def cmdline(self):
        return self._cmd

    def parent(self):
        return self._parent


def test_a_forked_child_is_not_a_rank_until_it_runs_its_own_program():
    launcher = _Proc(["python", "-m", "deepspeed.launcher.launch", "--world_info=x", "t.py"])
    assert not rank_watch._started(_Proc(list(launcher.cmdline()), launcher))   # forked, not exec'd yet
    assert rank_watch._started(_Proc(["python", "-u", "t.py", "--local_rank=0"], launcher))
