"""Guards the run's picture (ds_adaptive.training.plot, ``ds-adaptive plot``): drawn from metrics.jsonl and
validation.jsonl (resumed runs: the last line of a step wins), many ranks reduced to a band, clear errors."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from ds_adaptive.cli.plot import main as plot_main  # noqa: E402
from ds_adaptive.training.plot import PlotError, plot_run, read_jsonl  # noqa: E402


def _write_logs(d, steps: int, ranks: int, *, validation: bool = True) -> None:
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "loss": 2.0 - 0.01 * s, "tokens_per_s": 1000.0 + s,
                                "peak_mem_gib": [0.5 + 0.01 * r for r in range(ranks)],
                                "compute_ms": [100.0 + r for r in range(ranks)]}) + "\n")
        f.write('{"step": 3, "loss": 1.5, "tokens_per_s": 5, "peak_mem_gib": [1], "compute_ms": [1]}\n')  # a resume
        f.write('{"step": 4, "lo')   # a line a killed run did not finish
    if validation:
        (d / "validation.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.9 - 0.01 * s, "loss_ema": 1.95})
                                                    + "\n" for s in (5, 10, steps)))


def _png(path):
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 800 and im.size[1] > 500
        colours = len(im.convert("RGB").getcolors(maxcolors=1 << 24))
    assert colours > 50   # lines, labels and legends were drawn, not a blank canvas


@pytest.mark.parametrize("ranks", [2, 32])
def test_a_run_is_drawn(tmp_path, ranks):
    _write_logs(tmp_path / "run", 20, ranks)
    path = plot_run(tmp_path / "run")
    assert path == tmp_path / "run" / "run.png"
    _png(path)


def test_logs_by_step_and_the_command(tmp_path, capsys):
    _write_logs(tmp_path / "run", 6, 2, validation=False)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[2]["loss"] == 1.5
    assert plot_main([str(tmp_path / "run"), "--out", str(tmp_path / "x.png")]) == 0
    assert "wrote" in capsys.readouterr().out
    _png(tmp_path / "x.png")
    assert plot_main([str(tmp_path / "nothing")]) == 2
    assert "metrics.jsonl is missing or empty" in capsys.readouterr().err
    with pytest.raises(PlotError):
        plot_run(tmp_path / "nothing")


def test_the_command_is_registered():
    from ds_adaptive.cli import COMMANDS

    assert COMMANDS["plot"][0] == "ds_adaptive.cli.plot"


def test_drawing_leaves_the_process_as_it_was(tmp_path):
    """The trainer draws at the end of a run in its own process (and `ds-adaptive plot` may run in a notebook): the
    picture takes no pyplot, switches no backend and keeps no figure open."""
    import subprocess
    import sys

    _write_logs(tmp_path / "run", 12, 2)
    code = ("import sys, matplotlib; before = matplotlib.get_backend()\n"
            "from ds_adaptive.training.plot import plot_run\n"
            f"plot_run({str(tmp_path / 'run')!r})\n"
            "print('pyplot' if 'matplotlib.pyplot' in sys.modules else 'no pyplot', matplotlib.get_backend() == before)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"MPLBACKEND": "svg", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["no", "pyplot", "True"], r.stdout
    _png(tmp_path / "run" / "run.png")
