"""A training process that fails with an error its entry point does not map to an exit status ends at once, with 1.

On an H200 a LoRA run's step 2 ran out of CUDA memory; the rank printed the traceback and then stayed alive until
the benchmark's time limit stopped it. The entry point (``ds_adaptive.cli.train.run``, what ``launch/train_wan.py``
runs) now prints and records the error and ends the process without the interpreter's teardown, which whatever
the failed run left behind can block: here a non-daemon thread that never ends.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from ds_adaptive.launch.rank_watch import ENV_FATAL_DIR

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent("""
    import threading, time
    import ds_adaptive.cli.train as train

    def failing_main(argv=None):
        threading.Thread(target=time.sleep, args=(3600,), name="left-behind").start()   # not a daemon
        raise RuntimeError("CUDA out of memory (simulated)")

    train.main = failing_main
    train.run()
""")


def test_an_unmapped_error_ends_the_process_with_1_despite_a_left_behind_thread(tmp_path):
    fatal = tmp_path / "fatal"
    fatal.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", ENV_FATAL_DIR: str(fatal)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "RuntimeError: CUDA out of memory (simulated)" in proc.stderr
    assert "Traceback" in proc.stderr
    assert (fatal / "rank0.exit").read_text() == "1"


def test_the_launch_script_uses_the_bounded_entry_point():
    text = (ROOT / "launch" / "train_wan.py").read_text()
    assert "from ds_adaptive.cli.train import run" in text and "run()" in text
