"""Guards the `ds-adaptive` console script: usage, dispatch to each module's main(argv), clear unknown-command error."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from ds_adaptive.cli import COMMANDS, main


def test_usage_lists_every_command(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert main(["--help"]) == 0


def test_unknown_command(capsys):
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_dispatch_to_synth_and_train(tmp_path, capsys):
    assert main(["synth", "--out", str(tmp_path / "d"), "--num-samples", "2"]) == 0
    assert (tmp_path / "d" / "index.arrow").is_file()
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--deepspeed_config", "--model", "--steps", "--sp", "--fused-ln-modulate", "--grad-ckpt", "--layers",
                 "--seed", "--data", "--save", "--save-interval", "--resume"):
        assert flag in out


def test_console_script_is_installed(tmp_path):
    exe = shutil.which("ds-adaptive")
    if exe is None:
        pytest.fail("the ds-adaptive console script is not on PATH: pip install -e '.[dev]' installs it")
    r = subprocess.run([exe, "synth", "--out", str(tmp_path / "s"), "--num-samples", "1"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "wrote synthetic latents: 1 samples" in r.stdout
