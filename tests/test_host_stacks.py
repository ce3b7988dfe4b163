"""Guards bench/host_stacks.py: the sampler attributes a thread's time to the functions on its stack (inclusive,
by function, only the counted roots) and to its innermost frames, per thread kind; threads that only wait in
``threading`` / ``queue`` are left out; shares stay within the sampled wall."""
from __future__ import annotations

import sys
import threading
import time

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from host_stacks import ROOTS, HostSampler, format_report  # noqa: E402


def _spin_in_main(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))


def _sleeper(stop: threading.Event) -> None:
    while not stop.is_set():
        time.sleep(0.002)


def test_each_thread_kind_gets_its_own_stacks_and_waiting_threads_are_left_out():
    # threads the test runner keeps (pytest-xdist's channel to the controller, started outside `threading`): the
    # sampler sees them as 'other' threads too
    foreign = [tid for tid in sys._current_frames() if tid != threading.main_thread().ident]
    stop, idle = threading.Event(), threading.Event()
    worker = threading.Thread(target=_sleeper, args=(stop,), daemon=True)
    waiter = threading.Thread(target=idle.wait, daemon=True)   # innermost frame in threading.py: left out
    worker.start()
    waiter.start()
    try:
        with HostSampler(interval=0.001) as s:
            _spin_in_main(0.3)
    finally:
        stop.set()
        idle.set()
    doc = s.report(top=50)
    assert set(doc["threads"]) == {"main", "other"}
    main, other = doc["threads"]["main"], doc["threads"]["other"]
    assert any("_spin_in_main" in r["stack"] for r in main["stacks"])
    assert not any("_sleeper" in r["stack"] for r in main["stacks"])
    assert any(r["stack"].startswith("tests/test_host_stacks.py:_sleeper:") for r in other["stacks"])
    assert not any("wait" in r["stack"].split(" <- ")[0] for r in other["stacks"])
    for t, threads in ((main, 1), (other, 1 + len(foreign))):   # each thread: at most the whole wall
        assert 0 < t["share_of_wall"] <= threads + 1e-6
        assert all(0 < r["share"] <= t["share_of_wall"] + 1e-9 for r in t["stacks"])
    # the counted roots: this test file is not one of them, so its functions are left out of the inclusive list
    assert "bench" in ROOTS and not any("test_host_stacks" in f["fn"] for f in main["functions"])
    text = format_report(doc)
    assert "[main thread]" in text and "[other thread]" in text and "_spin_in_main" in text


def test_train_step_profile_refuses_host_stacks_without_kernels_only(tmp_path, capsys):
    import pytest
    import train_step_profile

    with pytest.raises(SystemExit) as exc:
        train_step_profile.main(["--out", str(tmp_path / "p"), "--host-stacks"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--host-stacks" in err and "add --kernels-only" in err
