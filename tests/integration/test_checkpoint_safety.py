"""Guards that no checkpoint is lost: content checksums (verified on resume and by export), retention that keeps
the last good checkpoint and deletes only its own run's, the run lock and the start-up checks of --save /
--init-from, the supervisor's rendezvous port, rank-death handling and /dev/shm clean-up; each failure one line
with its documented exit code. The multi-process cases run the real launcher (launch/train_wan.sh, 2 CPU ranks)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import launch_ranks
from ds_adaptive.core.ports import free_port
from ds_adaptive.training import checksum
from ds_adaptive.training.checkpoint import (MARKER, check_checkpoint, find_resumable, last_good, prune_checkpoints,
                                    read_marker, write_latest)
from ds_adaptive.training.checksum import HashingFile, file_digest
from ds_adaptive.training.runlock import LOCK_NAME, STALE_AFTER_S, LockInfo, RunLock, RunLockError, read_lock

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "train_wan.sh"
SUPERVISE = ("-m", "ds_adaptive.launch.supervise")  # as launch/train_wan.sh runs it
CPU_CONFIG = ROOT / "launch" / "configs" / "cpu_tiny.json"
TRAIN = ["--num-samples", "200", "--layers", "1", "--seed", "5"]


def _supervise_module():
    from ds_adaptive.launch import supervise

    return supervise


# --- checksums (no DeepSpeed) ----------------------------------------------------------------

def test_hashing_writer_gives_the_files_digest_and_a_loadable_file(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(checksum, "PIECE", 1 << 20)  # several pieces per tensor, hashed beside their writes
    monkeypatch.setattr(checksum, "_OVERLAP_MIN", 1 << 16)
    state = {"flat": torch.randn(3_000_001), "small": [torch.arange(7)], "n": 3}
    with ThreadPoolExecutor(1) as pool, HashingFile(tmp_path / "a.pt", pool=pool) as f:
        torch.save(state, f)
    assert f.size == (tmp_path / "a.pt").stat().st_size
    assert f.hexdigest() == file_digest(tmp_path / "a.pt")
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["flat"], state["flat"])
    assert file_digest(tmp_path / "a.pt", "blake2b") != f.hexdigest()  # the marker names its algorithm
    with pytest.raises(ValueError, match="'md4' is not available here"):
        file_digest(tmp_path / "a.pt", "md4")


def _fake_checkpoint(save: Path, step: int, *, run_id: str | None = "run-a", good: bool = True,
                     checksums: bool = True, files: int = 2) -> Path:
    d = save / f"global_step{step}"
    d.mkdir(parents=True)
    names = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(files)] + \
            [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(files)]
    for i, name in enumerate(names):
        torch.save({"w": torch.arange(20_000.0) + step + i}, d / name)
    marker = {"tag": d.name, "step": step, "run_id": run_id, "good": good,
              "files": {n: (d / n).stat().st_size for n in names}}
    if checksums:
        marker["checksums"] = {"algorithm": checksum.ALGORITHM, "files": {n: file_digest(d / n) for n in names}}
    (d / MARKER).write_text(json.dumps(marker))
    return d


def _scribble(path: Path, offset: int = 300, size: int = 4000) -> None:
    """Random bytes inside the file, its size unchanged (what the issue did to the optimizer file)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(os.urandom(size))


def test_a_changed_file_of_the_same_size_falls_back_naming_the_file(tmp_path):
    save = tmp_path / "ckpt"
    for s in (2, 4):
        _fake_checkpoint(save, s)
    write_latest(save, "global_step4")
    victim = save / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    size = victim.stat().st_size
    _scribble(victim)
    assert victim.stat().st_size == size and check_checkpoint(save / "global_step4", verify=False) is None
    tag, notes = find_resumable(save)
    assert tag == "global_step2"
    assert notes == [f"skipping checkpoint global_step4: {victim} does not match its {checksum.ALGORITHM} checksum "
                     f"in {MARKER} (its contents changed after it was written: corrupt or overwritten)"]
    # the ranks share the reading: only the part holding the file sees the problem
    parts = [check_checkpoint(save / "global_step4", part=(r, 2)) for r in range(2)]
    assert sum(p is not None for p in parts) == 1 and all(str(victim) in p for p in parts if p)
    # a marker written before checksums existed is checked by size
    _fake_checkpoint(save, 6, checksums=False)
    assert check_checkpoint(save / "global_step6") is None


def test_retention_deletes_only_its_own_run_and_never_the_last_good(tmp_path):
    save = tmp_path / "ckpt"
    _fake_checkpoint(save, 1, run_id="other")            # an earlier run's: never deleted by run-a
    _fake_checkpoint(save, 2)
    _fake_checkpoint(save, 3)                            # the last good one
    _fake_checkpoint(save, 4, good=False)                # saved after non-finite steps
    _fake_checkpoint(save, 5, good=False)
    _fake_checkpoint(save, 6, good=False, checksums=False)
    gone = prune_checkpoints(save, 1, protect="global_step6", run_id="run-a")
    assert sorted(p.name for p in gone) == ["global_step2", "global_step4", "global_step5"]
    assert sorted(p.name for p in save.iterdir()) == ["global_step1", "global_step3", "global_step6"]
    assert last_good(save, "run-a") == "global_step3" and last_good(save, "other") == "global_step1"
    assert read_marker(save / "global_step6")["good"] is False


# --- the run lock ------------------------------------------------------------------------------

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_run_lock_live_stale_and_released(tmp_path):
    lock = RunLock.acquire(tmp_path, command="first", heartbeat=False)
    with pytest.raises(RunLockError) as err:
        RunLock.acquire(tmp_path)
    msg = str(err.value)
    assert f"is in use by another run (pid {os.getpid()} on host {socket.gethostname()}" in msg and "\n" not in msg
    assert lock.refresh() and read_lock(tmp_path).heartbeat >= lock.info.heartbeat - 1
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()

    def plant(**changes) -> None:
        info = LockInfo.mine("planted")
        for k, v in changes.items():
            setattr(info, k, v)
        (tmp_path / LOCK_NAME).write_text(json.dumps(info.__dict__))

    plant(pid=_dead_pid())                                                   # this host, process gone
    lock = RunLock.acquire(tmp_path, heartbeat=False)
    assert "is gone" in lock.took_over
    lock.release()
    plant(pid_start=time.time() - 3600)                                      # this pid, another process
    assert "now belongs to another process" in RunLock.acquire(tmp_path, heartbeat=False).took_over
    plant(boot_id="another-boot")                                            # this host rebooted
    assert "rebooted" in RunLock.acquire(tmp_path, heartbeat=False).took_over
    plant(host="node-x", pid=1)                                              # another host, fresh heartbeat
    with pytest.raises(RunLockError, match="on host node-x"):
        RunLock.acquire(tmp_path)
    plant(host="node-x", pid=1, heartbeat=time.time() - STALE_AFTER_S - 5)   # another host, silent too long
    assert "heartbeat is" in RunLock.acquire(tmp_path, heartbeat=False).took_over


# --- start-up checks (one process) -------------------------------------------------------------

def _cfg(tmp_path, **trainer):
    from ds_adaptive.training.run_config import RunConfig

    return RunConfig.load(str(CPU_CONFIG), trainer={"model": "tiny", **trainer})


def test_startup_checks_each_one_line(tmp_path, monkeypatch):
    from ds_adaptive.training.run_config import UsageError
    from ds_adaptive.launch.startup import prepare_save_dir

    def problem(**trainer) -> str:
        with pytest.raises(UsageError) as err:
            prepare_save_dir(_cfg(tmp_path, **trainer), rank=0)
        assert "\n" not in str(err.value), str(err.value)
        return str(err.value)

    (tmp_path / "file").write_text("x")
    assert "--save" in problem(save=str(tmp_path / "file")) and "is a file, not a directory" in problem(
        save=str(tmp_path / "file"))
    assert "cannot create the checkpoint directory" in problem(save=str(tmp_path / "file" / "sub"))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):  # root ignores the mode: an immutable directory, where chattr works
        if subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode != 0:
            ro = Path("/sys/ds_adaptive_ckpt")  # not creatable by anyone
    try:
        assert "not writable" in problem(save=str(ro)) or "cannot create" in problem(save=str(ro))
    finally:
        subprocess.run(["chattr", "-i", str(ro)], capture_output=True)
    # earlier checkpoints: an error naming them, unless resumed or overwritten
    save = tmp_path / "ckpt"
    for s in (10, 20):
        _fake_checkpoint(save, s)
    write_latest(save, "global_step20")
    msg = problem(save=str(save))
    assert "already holds checkpoints of an earlier run (global_step10, global_step20)" in msg and "RESUME=1" in msg
    assert (save / "global_step20").is_dir() and not (save / LOCK_NAME).exists()  # nothing touched, lock released
    ok = prepare_save_dir(_cfg(tmp_path, save=str(save), resume=str(save)), rank=0)
    assert (save / LOCK_NAME).is_file() and (save / "global_step10").is_dir()
    assert "in use by another run" in problem(save=str(save), resume=str(save))  # a second run meanwhile
    ok.release()
    assert "give one of them" in problem(save=str(save), resume=str(save), overwrite=True)
    ok = prepare_save_dir(_cfg(tmp_path, save=str(save), overwrite=True), rank=0)
    assert not any(p.name.startswith("global_step") for p in save.iterdir()) and not (save / "latest").exists()
    assert "deleted the earlier run's checkpoints global_step10, global_step20" in ok.notes[0]
    ok.release()
    # free disk for one checkpoint
    import shutil as sh

    monkeypatch.setattr(sh, "disk_usage", lambda p: sh._ntuple_diskusage(100, 100, 1000))
    # keep + 1 checkpoints (the default --keep-checkpoints 3: 4) coexist before pruning; MB where GiB reads 0.00
    assert "0.0 MB free on its filesystem, 4 checkpoints (--keep-checkpoints + the one being written) need about" \
        in problem(save=str(tmp_path / "d"))
    monkeypatch.undo()
    # --init-from: missing, and weights of another depth (names and shapes from the headers, nothing loaded)
    assert "--init-from" in problem(init_from=str(tmp_path / "nowhere")) and "does not exist" in problem(
        init_from=str(tmp_path / "nowhere"))
    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.models.wan_config import get_wan_config
    from ds_adaptive.models.weights import save_wan_weights

    save_wan_weights(WanModel(get_wan_config("tiny", num_layers=1)), tmp_path / "w", layout="diffusers")
    msg = problem(init_from=str(tmp_path / "w"), layers=2)
    assert msg.startswith(f"--init-from {tmp_path / 'w'} (--model tiny, 2 blocks): ") and "missing parameter" in msg
    prepare_save_dir(_cfg(tmp_path, init_from=str(tmp_path / "w"), layers=1), rank=0).release()


def test_checkpoint_size_estimate():
    from ds_adaptive.models.wan import count_parameters
    from ds_adaptive.models.wan_config import get_wan_config
    from ds_adaptive.training.run_config import RunConfig
    from ds_adaptive.launch.startup import checkpoint_bytes

    n = count_parameters(get_wan_config("wan2.1-1.3b"))
    cfg = RunConfig.load(str(ROOT / "launch" / "configs" / "zero3_adaptive.json"), trainer={"model": "wan2.1-1.3b"})
    assert checkpoint_bytes(cfg)[0] == 12 * n  # ZeRO-3 AdamW: fp32 master + 2 moments, weights partitioned
    raw = {**cfg.ds_config, "zero_optimization": {"stage": 2}}
    assert checkpoint_bytes(RunConfig.load(raw, trainer={"model": "wan2.1-1.3b"}))[0] == 14 * n  # + bf16 weights


# --- the one validation pass ---------------------------------------------------------------------

def _config_with(tmp_path, name: str, **block) -> str:
    raw = json.loads(CPU_CONFIG.read_text())
    for key, value in block.items():
        section, field = key.split("__")
        raw["adaptive_load"].setdefault(section, {})[field] = value
    raw["adaptive_load"]["sampler"]["shapes"] = str(ROOT / "launch" / "configs" / "shapes_cpu.json")
    (tmp_path / name).write_text(json.dumps(raw))
    return str(tmp_path / name)


def test_config_check_dry_run_and_build_run_share_the_cross_field_rules(tmp_path, capsys):
    from ds_adaptive.core.config import ConfigError
    from ds_adaptive.cli.config import main as config_main
    from ds_adaptive.cli.dry_run import main as dry_main
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig

    layers = _config_with(tmp_path, "layers.json", sparse_attention__enabled=True, sparse_attention__dense_layers=[99])
    flex = _config_with(tmp_path, "flex.json", sparse_attention__enabled=True, sparse_attention__backend="flex")
    mmem = _config_with(tmp_path, "mmem.json", sampler__m_mem=-0.4)
    lr = _config_with(tmp_path, "lr.json", optimization__lr_scaling="sqrt")
    cases = [(layers, [], "dense_layers has [99], outside the model's layers 0..39"),   # the deepest preset
             (layers, ["--model", "tiny"], "dense_layers has [99], outside the model's layers 0..1"),
             (flex, ["--device", "cpu"], "backend is 'flex' but backend 'flex' has no backward on cpu"),
             (mmem, [], "adaptive_load.sampler.m_mem: must be > 0 or \"auto\" (got -0.4)"),
             (lr, [], "lr_scaling is 'sqrt' but reference_batch is not set"),
             (str(CPU_CONFIG), ["--model", "tiny", "--sp", "4"], "Ulysses sp=4 does not divide the 2 attention heads")]
    for path, flags, message in cases:
        assert config_main(["--check", path, *flags]) == 2, (path, flags)
        assert message in capsys.readouterr().out, message
    assert config_main(["--check", flex, "--device", "cuda"]) == 0
    capsys.readouterr()
    # the dry run (train_wan.sh DRY_RUN=1) of a CPU launch: the same rules, reported as failed checks
    for path, message in ((layers, "outside the model's layers 0..1"), (flex, "'flex' has no backward on cpu")):
        assert dry_main(["--deepspeed_config", path, "--model", "tiny", "--world", "2", "--device", "cpu",
                         "--gpu-mem-gib", "8"]) == 2
        assert message in capsys.readouterr().out
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                       env={**_env(DRY_RUN="1", DS_CONFIG=flex)})  # DRY_RUN=1 of the CPU launch says --device cpu
    assert r.returncode == 2 and "'flex' has no backward on cpu" in r.stderr, r.stderr[-2000:]
    # and the trainer (build_run), before the model is built
    cfg = RunConfig.load(layers, trainer={"model": "tiny", "num_samples": 20})
    with pytest.raises(ConfigError, match=r"outside the model's layers 0..1"):
        build_run(cfg, layout=Layout.for_world(2, 1))


# --- the supervisor's pieces -----------------------------------------------------------------

def test_supervisor_exit_codes_ports_and_shm(tmp_path):
    from ds_adaptive.training import preempt

    sv = _supervise_module()
    assert (sv.EXIT_PREEMPTED, sv.EXIT_PEER_LOST) == (preempt.EXIT_PREEMPTED, preempt.EXIT_PEER_LOST)
    assert [sv.launcher_status(rc) for rc in (0, 2, 75, 247, -9, -15)] == [0, 2, 75, 137, 137, 143]
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    assert sv.process_end(p.pid) is None
    p.kill()
    time.sleep(0.5)
    assert sv.process_end(p.pid) == (signal.SIGKILL, None)  # read from the zombie, before the parent reaps it
    p.wait()
    assert sv.process_end(p.pid) == (None, None)
    end = sv.RankEnd(rank=1, pid=p.pid, signal=9)
    assert end.describe() == f"rank 1 (pid {p.pid}) was killed by SIGKILL (signal 9)" and end.exit_status() == 137
    assert not sv.RankEnd(0, 1, code=sv.EXIT_PEER_LOST).cause and sv.RankEnd(0, 1, code=2).cause
    # a busy default port is replaced (and said); a busy explicit one is an error
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        said = []
        cmd, got, fd = sv.choose_master_port(["deepspeed", "--num_gpus", "2", "x.py", "--a"], default=port,
                                             log=said.append)
        assert got != port and cmd == ["deepspeed", "--num_gpus", "2", "--master_port", str(got), "x.py", "--a"]
        assert f"the default rendezvous port {port} is in use on this host: another program listens on it" in said[0]
        with pytest.raises(sv.PortInUse, match=f"MASTER_PORT {got} is in use on this host: held by another "
                                               "ds_adaptive run"):
            sv.choose_master_port(["deepspeed", "--master_port", str(got), "x.py"])
        sv.release_port(got, fd)
        with pytest.raises(sv.PortInUse, match=f"MASTER_PORT {port} is in use .* another program listens"):
            sv.choose_master_port(["deepspeed", f"--master_port={port}", "x.py"])
    assert sv.choose_master_port(["deepspeed", "--hostfile", "h", "x.py"])[1] is None  # multi-node: not here
    assert sv.choose_master_port(["python", "x.py"]) == (["python", "x.py"], None, None)
    mine = Path(f"{sv.SHM_PREFIX}_{os.getuid()}_127.0.0.1_{port}_0")
    other = Path(f"{sv.SHM_PREFIX}_{os.getuid()}_127.0.0.1_{port + 1}_0")
    mine.write_bytes(b"x")
    other.write_bytes(b"x")
    try:
        assert sv.remove_shm_buffers(port) == [str(mine)] and other.exists()
    finally:
        other.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)


def test_the_failure_line_is_said_however_the_other_ranks_ended():
    """DeepSpeed's launcher terminates the other ranks when one exits non-zero; when that beats their own lost-peer
    check (EXIT_PEER_LOST), they end by its signal or with another status, and the line was not said (seen once in
    a full CPU suite run of test_a_failure_on_one_rank_stops_the_others_with_its_message)."""
    sv = _supervise_module()
    for other in (sv.RankEnd(0, 11, code=sv.EXIT_PEER_LOST), sv.RankEnd(0, 11, signal=signal.SIGTERM),
                  sv.RankEnd(0, 11, code=sv.EXIT_PREEMPTED), sv.RankEnd(0, 11, code=1), sv.RankEnd(0, 11)):
        said = []
        sup = sv.Supervisor(["deepspeed", "--num_gpus", "2", "t.py", "--save", "ck"], log=said.append)
        sup.watch = sv.RankWatch.__new__(sv.RankWatch)
        sup.watch.ended = [sv.RankEnd(1, 12, code=2), other]
        assert sup._exit_status(2) == 2 and len(said) == 1, (other, said)
        assert said[0].startswith("rank 1 (pid 12) exited with status 2; the other rank(s) stopped; exit 2. "), said
    said = []
    alone = sv.Supervisor(["deepspeed", "--num_gpus", "1", "t.py"], log=said.append)
    alone.watch = sv.RankWatch.__new__(sv.RankWatch)
    alone.watch.ended = [sv.RankEnd(0, 12, code=2)]
    assert alone._exit_status(2) == 2 and said == []   # one rank: its own error line is the whole story


def test_peer_loss_is_told_apart_from_a_bug():
    from ds_adaptive.training.preempt import peer_lost

    assert peer_lost(RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                                  "[127.0.0.1]:46223: Connection reset by peer."))
    assert peer_lost(torch.distributed.DistBackendError("NCCL error in: ..."))
    assert not peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not peer_lost(ValueError("Connection reset by peer"))


# --- multi-process: the launcher as a user runs it ---------------------------------------------

def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUM_GPUS", "HOSTFILE", "DS_CONFIG", "MODEL", "STEPS", "SAVE_DIR", "RESUME", "OVERWRITE",
                        "SAVE_INTERVAL", "KEEP_CHECKPOINTS")}
    port = str(free_port("127.0.0.1"))
    return {**env, "CUDA_VISIBLE_DEVICES": "", "NUM_GPUS": "0", "MASTER_PORT": port, "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1", **extra}


def _launch(tmp_path, *args, timeout=400, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--deepspeed_config", str(CPU_CONFIG), *TRAIN, *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=timeout, env=_env(**env))


def _errors(r: subprocess.CompletedProcess | str) -> list[str]:
    text = r if isinstance(r, str) else r.stderr
    return [x for x in text.splitlines() if "error" in x.lower() and not x.startswith("[20")]


def _trainer_ranks(tmp_path, *args, steps: int, save: str, timeout: float = 200) -> list[subprocess.CompletedProcess]:
    """The trainer with the arguments launch/train_wan.sh gives it on the CPU (STEPS=steps, SAVE_DIR=save and its
    defaults --save-interval 10 --keep-checkpoints 2, then ``args``) on 2 ranks of the test harness, failed or not:
    for a start-up check on the ranks' side, which needs no launcher (~10 s of DeepSpeed's launcher start-up saved);
    how the launcher reports a refused start is tested with it below (test_two_runs_at_once_and_...)."""
    argv = ["-m", "ds_adaptive.cli.train", "--deepspeed_config", str(CPU_CONFIG), "--model", "tiny", "--steps",
            str(steps), "--save", save, "--save-interval", "10", "--keep-checkpoints", "2",
            "--deepspeed_config", str(CPU_CONFIG), *TRAIN, *args]
    return launch_ranks(argv, 2, cwd=tmp_path, env={"PYTHONPATH": str(ROOT)}, timeout=timeout, check=False)


def _shm(port: str) -> list[str]:
    import glob

    return glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*")


@pytest.mark.slow
def test_second_run_corrupt_checkpoint_and_export(tmp_path, capsys):
    """The issue's sequence: a second run into the same SAVE_DIR, then random bytes inside the latest optimizer
    file (same size): nothing is overwritten, the resume falls back to the previous checkpoint naming the file,
    export refuses the corrupt one, and the run's /dev/shm buffers are gone after each run."""
    env = _env()
    r = _launch(tmp_path, "--log-dir", "first", STEPS="4", SAVE_DIR="ck", SAVE_INTERVAL="2", MASTER_PORT=env["MASTER_PORT"])
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert _shm(env["MASTER_PORT"]) == []
    ck = tmp_path / "ck"
    before = {p.name: file_digest(p) for p in (ck / "global_step4").glob("*.pt")}
    marker = read_marker(ck / "global_step4")
    assert marker["good"] and marker["run_id"] and set(marker["checksums"]["files"]) == set(before)

    # a second run, no RESUME (the ranks' start-up check: 2 ranks of the test harness, as train_wan.sh starts them)
    rs = _trainer_ranks(tmp_path, "--data", "synthetic", steps=4, save="ck")
    outs = "\n".join(f"--- rank {i}\n{r.stdout[-3000:]}" for i, r in enumerate(rs))
    assert [r.returncode for r in rs] == [2, 2], outs
    assert [_errors(r.stdout) for r in rs] == [[
        "ds-adaptive train: error: --save ck already holds checkpoints of an earlier run (global_step2, global_step4): "
        "continue that run with RESUME=1 (--resume ck), start a new one there with OVERWRITE=1 (--overwrite deletes "
        "them), or choose another SAVE_DIR / --save"], []], outs   # one line for the job: rank 0's
    assert all("Traceback" not in r.stdout and "ds_adaptive: tiny (" not in r.stdout for r in rs), outs  # before the model
    assert {p.name: file_digest(p) for p in (ck / "global_step4").glob("*.pt")} == before

    victim = ck / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _scribble(victim, offset=victim.stat().st_size // 3, size=min(400_000, victim.stat().st_size // 3))
    from ds_adaptive.cli import main as cli_main
    from ds_adaptive.cli.export import main as export_main

    capsys.readouterr()
    assert cli_main(["export", str(ck), "--to", str(tmp_path / "out")]) == 2   # `ds-adaptive export`, in this process
    err = capsys.readouterr().err   # (a traceback would have failed the call)
    assert f"{victim} does not match its" in err and "--tag global_step2" in err
    assert not (tmp_path / "out").exists()

    r = _launch(tmp_path, "--log-dir", "resumed", STEPS="6", SAVE_DIR="ck", RESUME="1", SAVE_INTERVAL="2")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert f"skipping checkpoint global_step4: {victim.relative_to(tmp_path)} does not match its" in r.stdout
    assert "resumed from " in r.stdout and "step 2 (epoch" in r.stdout
    assert "replacing the checkpoint ck/global_step4" in r.stdout  # the corrupt one is superseded, not mixed
    s = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert s["first_step"] == 3 and s["nonfinite_steps"] == [] and all(x is not None for x in s["losses"])
    assert read_marker(ck / "global_step6")["run_id"] == marker["run_id"]  # the resumed run goes on
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("global_step")) == ["global_step4", "global_step6"]
    assert export_main([str(ck), "--to", str(tmp_path / "out")]) == 0
    assert not (ck / LOCK_NAME).exists() and _shm(env["MASTER_PORT"]) == []


POISON = textwrap.dedent("""
    import sys
    import torch
    import ds_adaptive.training.engine as T
    from ds_adaptive.cli.train import exit_process, main

    calls = {"n": 0}
    real = T.flow_matching_losses
    def poisoned(engine, *a, **kw):   # optimizer steps 3 and 4 (gas 2: micro-steps 5-8) not finite on rank 1
        calls["n"] += 1
        out = real(engine, *a, **kw)
        if calls["n"] >= 5 and torch.distributed.get_rank() == 1:
            out = out * float("nan")
        return out
    T.flow_matching_losses = poisoned
    exit_process(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_nonfinite_steps_never_rotate_out_the_last_good_checkpoint(tmp_path, run_ranks):
    (tmp_path / "poison.py").write_text(POISON)
    args = ["--deepspeed_config", str(CPU_CONFIG), *TRAIN, "--steps", "4", "--save", "ck", "--save-interval", "1",
            "--keep-checkpoints", "1", "--log-dir", "logs"]
    out = run_ranks(["poison.py", *args], 2, cwd=tmp_path, env={"PYTHONPATH": str(ROOT)}, timeout=400)[0].stdout
    ck = tmp_path / "ck"
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("global_step")) == ["global_step2", "global_step4"]
    assert read_marker(ck / "global_step2")["good"] is True
    m = read_marker(ck / "global_step4")
    assert m["good"] is False and m["nonfinite_steps"] == [4]
    assert "not marked good: non-finite step(s) [3] since the previous checkpoint" in out
    assert last_good(ck) == "global_step2"


@pytest.mark.slow
def test_two_runs_at_once_and_a_save_dir_that_is_a_file(tmp_path):
    import psutil

    (tmp_path / "afile").write_text("x")
    rs = _trainer_ranks(tmp_path, steps=4, save="afile")   # the ranks' start-up check, without the launcher
    outs = "\n".join(f"--- rank {i}\n{r.stdout[-3000:]}" for i, r in enumerate(rs))
    assert [r.returncode for r in rs] == [2, 2] and [_errors(r.stdout) for r in rs] == [[
        "ds-adaptive train: error: --save afile is a file, not a directory; pass a directory for the checkpoints "
        "(SAVE_DIR)"], []], outs
    assert all("ds_adaptive: tiny (" not in r.stdout and "Traceback" not in r.stdout for r in rs), outs

    log = tmp_path / "first.log"
    with open(log, "w") as f:
        first = subprocess.Popen(["bash", str(SCRIPT), "--deepspeed_config", str(CPU_CONFIG), *TRAIN, "--log-dir",
                                  "first"], cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT,
                                 env=_env(STEPS="200", SAVE_DIR="ck", SAVE_INTERVAL="0"))
    try:
        deadline = time.monotonic() + 240
        while "step 1/200" not in log.read_text():
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        # the first run's ranks pause (alive, holding the lock) while the second launch starts: their training
        # steps would only take the CPU from it (the first run is at step 1 of 200)
        ranks = [psutil.Process(_rank_pid(first.pid, rank)) for rank in (0, 1)]
        for p in ranks:
            p.suspend()
        t = time.monotonic()
        try:
            r = _launch(tmp_path, STEPS="4", SAVE_DIR="ck", RESUME="1", timeout=200)
        finally:
            for p in ranks:
                p.resume()
        assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
        (line,) = _errors(r)
        assert f"ck is in use by another run (pid " in line and f"on host {socket.gethostname()}" in line
        assert time.monotonic() - t < 120 and "ds_adaptive: tiny (" not in r.stdout
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 75, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    assert not (tmp_path / "ck" / LOCK_NAME).exists()


def _rank_pid(root_pid: int, rank: int) -> int:
    import psutil

    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            if p.environ().get("RANK") == str(rank) and "train_wan.py" in " ".join(p.cmdline()):
                return p.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} under {root_pid}")


@pytest.mark.slow
def test_sigkill_of_one_rank_stops_all_with_one_line_and_the_resume_command(tmp_path):
    env = _env(STEPS="200", SAVE_DIR="ck", SAVE_INTERVAL="1")
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", str(SCRIPT), "--deepspeed_config", str(CPU_CONFIG), *TRAIN], cwd=tmp_path,
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        while "saved checkpoint step 2" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        victim = _rank_pid(proc.pid, 1)
        os.kill(victim, signal.SIGKILL)
        t = time.monotonic()
        rc = proc.wait(timeout=120)
        stopped_in = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert rc == 128 + signal.SIGKILL, out[-4000:]
    assert stopped_in < 40, stopped_in  # bounded: the grace (10 s) and the launcher's own exit
    lines = [x for x in out.splitlines() if x.startswith("ds_adaptive supervisor:")]
    assert len(lines) == 1, out[-4000:]
    assert lines[0].startswith(f"ds_adaptive supervisor: rank 1 (pid {victim}) was killed by SIGKILL (signal 9); ")
    assert "exit 137. The last complete checkpoint is ck/global_step" in lines[0]
    assert "resume with: RESUME=1 " in lines[0] and "SAVE_DIR=ck" in lines[0] and "train_wan.sh" in lines[0]
    assert "Traceback" not in out and "lost contact" not in out, out[-4000:]
    assert _shm(env["MASTER_PORT"]) == []
    tag = (tmp_path / "ck" / "latest").read_text().strip()
    assert check_checkpoint(tmp_path / "ck" / tag) is None  # nothing lost: the last checkpoint is complete
    assert not (tmp_path / "ck" / LOCK_NAME).exists() or "is gone" in str(read_lock(tmp_path / "ck").stale_reason())


ONE_RANK_FAILS = textwrap.dedent("""
    import os, sys
    import torch
    import ds_adaptive.training.batches as B
    from ds_adaptive.data import DataError
    from ds_adaptive.launch.supervise import die_with_parent
    from ds_adaptive.cli.train import exit_process, main

    die_with_parent()
    calls = {"n": 0}
    real = B.Batches.next
    def failing(self, micro, **position):   # the 5th batch of rank 1 cannot be read (a bad sample, a failing load)
        calls["n"] += 1
        if calls["n"] == 5 and torch.distributed.get_rank() == 1:
            raise DataError("sample 17 (id 'clip-017') of shard-00003.safetensors: 2 non-finite values")
        return real(self, micro, **position)
    B.Batches.next = failing
    exit_process(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_a_failure_on_one_rank_stops_the_others_with_its_message(tmp_path):
    """Before: the other rank was left in a gloo error (a traceback) or a hang until the launcher killed it."""
    (tmp_path / "fails.py").write_text(ONE_RANK_FAILS)
    env = _env()
    cmd = [sys.executable, *SUPERVISE, "--", "deepspeed", "--num_gpus", "2", "--master_port", env["MASTER_PORT"],
           str(tmp_path / "fails.py"), "--deepspeed_config", str(CPU_CONFIG), *TRAIN, "--steps", "20", "--save", "ck",
           "--save-interval", "1"]
    t = time.monotonic()
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=400, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    errors = [x for x in out.splitlines() if x.startswith(("ds-adaptive train:", "ds_adaptive supervisor:"))]
    assert errors[0] == ("ds-adaptive train: error: sample 17 (id 'clip-017') of shard-00003.safetensors: "
                         "2 non-finite values"), errors
    assert len(errors) == 2 and errors[1].startswith("ds_adaptive supervisor: rank 1 (pid ") and \
        "exited with status 2; the other rank(s)" in errors[1] and "exit 2. The last complete checkpoint is ck/" in \
        errors[1], errors
    assert check_checkpoint(tmp_path / "ck" / (tmp_path / "ck" / "latest").read_text().strip()) is None
    assert _shm(env["MASTER_PORT"]) == []


HOLDS_THE_PORT = textwrap.dedent("""
    import os, sys, time
    open(os.path.join(sys.argv[-1], f"rank{os.environ['RANK']}.pid"), "w").write(str(os.getpid()))
    time.sleep(120)
""")


def test_a_second_launch_on_a_busy_port_never_starts(tmp_path):
    """Two launches on one MASTER_PORT: the second says so in one line (exit 2) and starts no rank, so none of
    its ranks can join the first job's rendezvous; the first job runs on untouched."""
    (tmp_path / "hold.py").write_text(HOLDS_THE_PORT)
    env = _env()
    cmd = [sys.executable, *SUPERVISE, "--", "deepspeed", "--num_gpus", "2", "--master_port", env["MASTER_PORT"],
           str(tmp_path / "hold.py"), str(tmp_path)]
    first = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank{r}.pid").exists() for r in (0, 1)):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
            time.sleep(0.2)
        ranks = [int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)]
        (tmp_path / "second").mkdir()
        second = subprocess.run([*cmd[:-1], str(tmp_path / "second")], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=60)
        assert second.returncode == 2, second.stdout + second.stderr
        assert second.stderr.splitlines() == [
            f"ds_adaptive supervisor: error: MASTER_PORT {env['MASTER_PORT']} is in use on this host: held by another "
            f"ds_adaptive run (supervisor pid {first.pid}, started " + second.stderr.split(", started ", 1)[1].split(")")[0]
            + "); a second job on it fails or joins the first one's rendezvous. Choose a free port (MASTER_PORT=...), "
              "or leave MASTER_PORT unset to have one picked"]
        assert not any((tmp_path / "second").iterdir())  # no rank of the second launch started
        for pid in ranks:
            os.kill(pid, 0)  # the first job's ranks run on
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
