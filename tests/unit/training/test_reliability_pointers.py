"""Issue 52, cases 1-2: a checkpoint pointer can only name a checkpoint of its own directory and run (trainer,
supervisor and export agree), saves are atomic at the checkpoint level, a full disk is one line that keeps the last
complete checkpoint, and the start-up space check sizes keep + 1 checkpoints (in MB where GiB would read 0.00).
One process, a fake engine that writes DeepSpeed-like files: no DeepSpeed run needed."""
from __future__ import annotations

import errno
import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from ds_adaptive.core.ckpt_pointer import newest_complete, partial_dirs, read_pointer
from ds_adaptive.inference.export import ExportError, resolve_checkpoint, verify_checkpoint
from ds_adaptive.launch.supervise import resume_advice
from ds_adaptive.training.checkpoint import (MARKER, CheckpointSpaceError, checkpoint_tags, find_resumable,
                                             human_bytes, read_marker, write_checkpoint)


class FakeEngine:
    """Writes a model-states file and an optimizer file into ``save_dir/tag`` like DeepSpeed's save_checkpoint."""

    def __init__(self, fail_with: OSError | None = None, size: int = 1000) -> None:
        self.fail_with, self.size, self.calls = fail_with, size, []

    def save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters):
        self.calls.append(tag)
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"module": {"w": torch.zeros(self.size // 4)}, "ds_adaptive": client_state},
                   d / "mp_rank_00_model_states.pt")
        if self.fail_with is not None:
            (d / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"\0" * 10)
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 4096") from self.fail_with
        torch.save({"opt": torch.zeros(self.size // 4)}, d / "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def _save(save_dir: Path, step: int, run_id: str = "runA", engine=None, keep: int = 0) -> Path:
    return write_checkpoint(engine or FakeEngine(), save_dir, f"global_step{step}", {"step": step}, step=step,
                            run_id=run_id, keep=keep, log=lambda m: None)


@pytest.fixture
def ck(tmp_path) -> Path:
    d = tmp_path / "ck"
    _save(d, 10)
    _save(d, 12)
    return d


# garbage bytes are fixed ones: a test id must be the same on every pytest-xdist worker
@pytest.mark.parametrize("pointer", [b"../other_run/global_step20", b"/abs/other_run/global_step20",
                                     bytes(range(128, 192)) + b"\xff", b"global_step12/../../x"])
def test_a_pointer_elsewhere_or_garbage_is_ignored_in_one_line(ck, tmp_path, pointer):
    other = tmp_path / "other_run"
    _save(other, 20, run_id="runB")
    (ck / "latest").write_bytes(pointer)
    tag, notes = find_resumable(ck)
    assert tag == "global_step12"
    assert len(notes) == 1 and "latest" in notes[0] and "ignored" in notes[0] and "\n" not in notes[0]
    assert resume_advice(["x", "--save", str(ck)]).startswith(f"The last complete checkpoint is {ck / 'global_step12'}")
    save_dir, tag = resolve_checkpoint(str(ck), log=lambda m: None)
    assert (save_dir, tag) == (ck, "global_step12")


def test_an_unreadable_pointer_is_ignored(ck, monkeypatch):
    real = Path.read_bytes

    def denied(self):
        if self.name == "latest":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", denied)
    assert read_pointer(ck)[0] is None and "cannot be read (Permission denied)" in read_pointer(ck)[1]
    tag, notes = find_resumable(ck)
    assert tag == "global_step12" and len(notes) == 1
    assert "global_step12" in resume_advice(["x", "--save", str(ck)])


def test_a_checkpoint_of_another_run_in_the_directory_is_not_resumed(ck):
    foreign = ck / "global_step20"
    _save(ck.parent / "elsewhere", 20, run_id="runB")
    shutil.copytree(ck.parent / "elsewhere" / "global_step20", foreign)
    (ck / "latest").write_text("global_step20")
    tag, notes = find_resumable(ck)
    assert tag == "global_step12" and any("written by another run (run id runB" in n for n in notes)
    assert "global_step12" in resume_advice(["x", "--save", str(ck)])
    logged = []
    assert resolve_checkpoint(str(ck), log=logged.append) == (ck, "global_step12")
    assert "another run" in logged[0]


def test_export_refuses_a_markerless_checkpoint_unless_allowed(ck):
    (ck / "global_step12" / MARKER).unlink()
    with pytest.raises(ExportError, match="--allow-unverified") as e:
        verify_checkpoint(ck, "global_step12")
    assert "--tag global_step10" in str(e.value)
    verify_checkpoint(ck, "global_step12", allow_unverified=True, log=lambda m: None)


def test_a_save_is_atomic_and_a_partial_one_never_has_its_final_name(tmp_path):
    d = tmp_path / "ck"
    engine = FakeEngine()
    _save(d, 2, engine=engine)
    assert engine.calls == [".global_step2.partial"] and checkpoint_tags(d) == ["global_step2"]
    assert partial_dirs(d) == [] and read_marker(d / "global_step2")["step"] == 2
    # a save killed half-way leaves only a .partial directory: not a checkpoint, never resumed
    (d / ".global_step4.partial").mkdir()
    torch.save({}, d / ".global_step4.partial" / "mp_rank_00_model_states.pt")
    assert checkpoint_tags(d) == ["global_step2"] and find_resumable(d)[0] == "global_step2"
    # a second save of the same step (after a resume) replaces the old one only when complete
    _save(d, 2, engine=FakeEngine(size=2000))
    assert checkpoint_tags(d) == ["global_step2"] and not any(p.name.startswith(".global_step2.") for p in d.iterdir())


def test_enospc_during_a_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    d = tmp_path / "ck"
    _save(d, 6)
    monkeypatch.setenv("DS_ADAPTIVE_RESUME_HINT", "RESUME=1 SAVE_DIR=ck bash launch/train_wan.sh")
    full = FakeEngine(fail_with=OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(CheckpointSpaceError) as e:
        _save(d, 8, engine=full)
    msg = str(e.value)
    assert "\n" not in msg and f"{d} has " in msg and "free, it needs about" in msg
    assert f"The last complete checkpoint {d / 'global_step6'} is kept" in msg
    assert "resume with: RESUME=1 SAVE_DIR=ck bash launch/train_wan.sh" in msg
    assert checkpoint_tags(d) == ["global_step6"] and partial_dirs(d) == []
    assert (d / "latest").read_text() == "global_step6" and find_resumable(d) == ("global_step6", [])


def test_a_save_that_does_not_fit_stops_before_writing(tmp_path, monkeypatch):
    d = tmp_path / "ck"
    _save(d, 6)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 100, 100))
    engine = FakeEngine()
    with pytest.raises(CheckpointSpaceError, match=r"checkpoint global_step8 does not fit: .* has 0.0 MB free") as e:
        _save(d, 8, engine=engine)
    assert e.value.shared and engine.calls == [] and checkpoint_tags(d) == ["global_step6"]


def test_human_bytes_says_mb_where_gib_reads_zero():
    assert human_bytes(5_000_000) == "5.0 MB" and human_bytes(3 * 2**30) == "3.00 GiB"


def test_startup_removes_partial_saves_ignores_markerless_and_sizes_keep_plus_one(tmp_path, monkeypatch):
    from ds_adaptive.launch import startup
    from ds_adaptive.training.run_config import RunConfig

    d = tmp_path / "ck"
    _save(d, 6)
    (d / ".global_step8.partial").mkdir()
    (d / "global_step4").mkdir()  # interrupted before atomic saves: no marker
    cfg = RunConfig.load(Path(__file__).resolve().parents[3] / "launch" / "configs" / "cpu_tiny.json",
                         trainer={"model": "tiny", "save": str(d), "resume": str(d), "keep_checkpoints": 2})
    out = startup._rank0_checks(cfg, "test")
    try:
        assert not (d / ".global_step8.partial").exists()
        assert any("removed .global_step8.partial" in n for n in out.notes)
    finally:
        out.release()
    # a new run (no resume) is not blocked by the markerless directory alone
    shutil.rmtree(d / "global_step6")
    (d / "latest").unlink()
    cfg = RunConfig.load(Path(__file__).resolve().parents[3] / "launch" / "configs" / "cpu_tiny.json",
                         trainer={"model": "tiny", "save": str(d), "keep_checkpoints": 2})
    out = startup._rank0_checks(cfg, "test")
    out.release()
    assert any("ignoring global_step4: no completeness marker" in n for n in out.notes)
    assert startup._checkpoints_to_keep(cfg, d, resuming=False) == 3
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 5_000_000, 5_000_000))
    problem = startup.disk_problem(str(d), 2_000_000, "test", count=3)
    assert problem.startswith(f"--save {d}: 5.0 MB free on its filesystem, 3 checkpoints") and "6.0 MB" in problem


def test_newest_complete_skips_truncated(ck):
    victim = ck / "global_step12" / "mp_rank_00_model_states.pt"
    victim.write_bytes(victim.read_bytes()[:100])
    assert newest_complete(ck) == "global_step10"
    (ck / "latest").write_text("global_step12")
    assert "global_step10" in resume_advice(["x", "--save", str(ck)])
    assert json.loads((ck / "global_step10" / MARKER).read_text())["run_id"] == "runA"


def test_export_destinations_are_one_line_each(tmp_path, monkeypatch):
    from ds_adaptive.inference import export

    (tmp_path / "afile").write_text("x")
    with pytest.raises(ExportError, match=r"--to .*afile is an existing file, not a directory; nothing was written"):
        export.destination_problem(str(tmp_path / "afile"))
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != ro)   # a read-only filesystem (root included)
    with pytest.raises(ExportError, match=r"is not writable \(permission denied or a read-only filesystem\)"):
        export.destination_problem(str(ro / "out"))
    monkeypatch.undo()
    export.destination_problem(str(tmp_path / "new" / "out"))   # created later: fine
    out = tmp_path / "full"
    out.mkdir()

    def fills_the_disk():
        (out / "config.json").write_text("{}")
        (out / "diffusion_pytorch_model.safetensors").write_bytes(b"\0" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ExportError, match=r"writing the weights failed \(No space left on device; .* MB free there\); "
                                          "the partial files were removed") as e:
        export._written(fills_the_disk, out)
    assert "\n" not in str(e.value) and list(out.iterdir()) == []


def test_resume_1_with_only_a_partial_checkpoint_starts_fresh(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    ck = tmp_path / "ck"
    (ck / "global_step2").mkdir(parents=True)   # a first save killed before atomic saves: no marker
    env = {k: v for k, v in os.environ.items() if k not in ("RESUME", "OVERWRITE", "SAVE_DIR", "NUM_PROCS")}
    env.update(NUM_GPUS="0", DRY_RUN="1", SAVE_DIR=str(ck), RESUME="1", PYTHONPATH=str(root), PYTHON=sys.executable)
    r = subprocess.run(["bash", str(root / "launch" / "train_wan.sh")], capture_output=True, text=True, env=env,
                       timeout=120, cwd=tmp_path)
    cmd = next(x for x in r.stdout.splitlines() if x.startswith("+ "))
    assert "--resume" not in cmd and "no complete checkpoint in" in r.stdout, r.stdout + r.stderr[-2000:]
    _save(ck, 4)
    r = subprocess.run(["bash", str(root / "launch" / "train_wan.sh")], capture_output=True, text=True, env=env,
                       timeout=120, cwd=tmp_path)
    assert f"--resume {ck}" in next(x for x in r.stdout.splitlines() if x.startswith("+ "))
