"""Guards the commands that moved to the cli layer (synth, preprocess, stats): the old ``python -m`` paths exit 2
with one line naming the new command, never 0 having done nothing."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module, command", [("ds_adaptive.data.synth", "synth"),
                                             ("ds_adaptive.preprocess.run", "preprocess"),
                                             ("ds_adaptive.preprocess.stats", "stats")])
def test_the_old_module_path_says_where_the_command_went(module, command):
    r = subprocess.run([sys.executable, "-m", module, "--out", "x"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    line = [x for x in r.stderr.splitlines() if "no longer a command" in x]
    assert line and f"ds-adaptive {command}" in line[0] and f"ds_adaptive.cli.{command}" in line[0]
