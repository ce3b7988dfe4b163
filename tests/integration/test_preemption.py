"""Issue 20 (trainer side): stop on SIGTERM at a step boundary with a checkpoint, complete checkpoints
with fallback on resume, non-finite guards, --init-from through build_run, one-message failures."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import launch_ranks, launcher_env
import torch

from ds_adaptive.training.checkpoint import MARKER, check_checkpoint, find_resumable, prune_checkpoints, write_latest
from ds_adaptive.training.summary import json_safe
from ds_adaptive.training.preempt import EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "train_wan.sh"
CPU_CONFIG = ROOT / "launch" / "configs" / "cpu_tiny.json"
TRAIN = ["--num-samples", "200", "--layers", "1", "--seed", "5"]


def _env(**extra) -> dict:
    return launcher_env(**extra)


def _summary(d: Path) -> dict:
    return json.loads((d / "summary.json").read_text())


# --- checkpoint files (no DeepSpeed) ---------------------------------------------------------

def _fake_checkpoint(save: Path, step: int, *, marker: bool = True) -> Path:
    d = save / f"global_step{step}"
    d.mkdir(parents=True)
    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"w": torch.arange(1000.0)}, d / name)
    if marker:
        files = {p.name: p.stat().st_size for p in d.iterdir()}
        (d / MARKER).write_text(json.dumps({"tag": d.name, "step": step, "files": files}))
    return d


def test_fallback_names_what_is_wrong_with_each_skipped_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    for s in (2, 4, 6, 8):
        _fake_checkpoint(save, s)
    write_latest(save, "global_step10")                      # latest names a missing tag
    assert find_resumable(save)[0] == "global_step8"
    write_latest(save, "global_step8")
    opt = save / "global_step8" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    opt.write_bytes(opt.read_bytes()[:200])                  # truncated optimizer file
    (save / "global_step6" / MARKER).unlink()                # an interrupted save: no marker
    model = save / "global_step4" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    model.write_bytes(b"x" * model.stat().st_size)           # right size, not a torch file
    tag, notes = find_resumable(save)
    assert tag == "global_step2"
    assert len(notes) == 3
    assert "global_step8" in notes[0] and "optim_states.pt has 200 bytes" in notes[0] and "truncated" in notes[0]
    assert "global_step6" in notes[1] and "no completeness marker" in notes[1]
    assert "global_step4" in notes[2] and "not a readable torch checkpoint" in notes[2]
    assert check_checkpoint(save / "global_step2") is None
    assert check_checkpoint(save / "global_step6", need_marker=False) is None  # an explicit tag may lack it


def test_prune_keeps_the_newest_complete_and_never_the_protected(tmp_path):
    save = tmp_path / "ckpt"
    for s in (1, 2, 3, 4):
        _fake_checkpoint(save, s)
    _fake_checkpoint(save, 5, marker=False)
    corrupt = save / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    corrupt.write_bytes(corrupt.read_bytes()[:50])
    gone = prune_checkpoints(save, 2, protect="global_step4")
    assert [p.name for p in gone] == ["global_step1"]  # the good ones are 1, 2, 4: keep 2 and 4
    assert sorted(p.name for p in save.iterdir()) == ["global_step2", "global_step3", "global_step4", "global_step5"]
    assert prune_checkpoints(save, 0, protect="x") == []


def test_json_logs_have_no_bare_nan():
    rec = {"loss": float("nan"), "losses": [1.0, float("inf"), 0.5], "x": {"y": -float("inf")}, "n": 3}
    text = json.dumps(json_safe(rec), allow_nan=False)
    assert json.loads(text) == {"loss": None, "losses": [1.0, None, 0.5], "x": {"y": None}, "n": 3}


def test_nan_sample_is_an_error_naming_sample_and_shard(tmp_path):
    from safetensors.torch import load_file, save_file

    from ds_adaptive.data import DataError
    from ds_adaptive.data.shards import LatentShardDataset
    from ds_adaptive.cli.synth import main as synth_main

    assert synth_main(["--out", str(tmp_path / "d"), "--num-samples", "6", "--shapes",
                       str(ROOT / "launch" / "configs" / "shapes_cpu.json")]) == 0
    ds = LatentShardDataset(tmp_path / "d")
    e = ds.entries[3]
    shard = tmp_path / "d" / e["file"]
    tensors = load_file(str(shard))
    tensors[e["latents_key"]].view(-1)[7] = float("nan")
    save_file(tensors, str(shard))
    ds = LatentShardDataset(tmp_path / "d")
    ds[2]  # the others still load
    with pytest.raises(DataError) as err:
        ds[3]
    msg = str(err.value)
    assert f"sample 3 (id {e['id']!r})" in msg and str(shard) in msg and "1 non-finite" in msg


# --- the trainer: one process ----------------------------------------------------------------

NAN_STEP = textwrap.dedent("""
    import json, sys
    import torch
    import ds_adaptive.training.engine as T
    from ds_adaptive.cli.train import main

    calls = {"n": 0}
    real = T.flow_matching_losses
    def poisoned(engine, *a, **kw):   # micro-steps 3 and 4 (= optimizer step 2 with gas 2) on rank 1 only
        calls["n"] += 1
        out = real(engine, *a, **kw)
        if calls["n"] in (3, 4) and torch.distributed.get_rank() == 1:
            out = out * float("nan")
        return out
    T.flow_matching_losses = poisoned
    sys.exit(main(sys.argv[1:]))
""")


def test_nonfinite_loss_step_is_skipped_counted_and_logged_as_valid_json(tmp_path, run_ranks):
    (tmp_path / "poison.py").write_text(NAN_STEP)
    args = ["--deepspeed_config", str(CPU_CONFIG), *TRAIN, "--steps", "4", "--log-dir", "logs"]
    results = run_ranks(["poison.py", *args], 2, cwd=tmp_path, env={"PYTHONPATH": str(ROOT)}, timeout=300)
    out = results[0].stdout
    assert "step 2: loss nan: update skipped (1 non-finite step(s) so far)" in out, out[-3000:]
    s = _summary(tmp_path / "logs")
    assert s["nonfinite_steps"] == [2] and s["skipped_steps"] == [2] and s["steps"] == 4
    assert s["losses"][1] is None and all(isinstance(x, float) for i, x in enumerate(s["losses"]) if i != 1)
    assert s["loss_first"] is not None  # the trend leaves the skipped step out
    rows = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert all("NaN" not in json.dumps(r) for r in rows)


def _checker(**opts):
    from types import SimpleNamespace

    from ds_adaptive.training.nonfinite import NonFiniteGuard

    logs = []
    o = {"nonfinite": "skip", "nonfinite_limit": 20, "fp16": False, **opts}
    guard = NonFiniteGuard(o["nonfinite"], o["nonfinite_limit"], fp16=o["fp16"], log=logs.append)
    fake = SimpleNamespace(nonfinite_steps=[])
    return (lambda step, loss, applied: guard.check(SimpleNamespace(step=step, loss=loss), applied,
                                                    fake.nonfinite_steps)), fake, logs


def test_nonfinite_policy_stop_limit_and_an_applied_update():
    from ds_adaptive.training.nonfinite import NonFiniteError

    check, fake, logs = _checker()
    check(1, 0.5, True)
    check(2, 0.5, False)  # finite loss, DeepSpeed skipped: the gradient norm was not finite
    assert fake.nonfinite_steps == [2] and "step 2: gradient norm not finite: update skipped" in logs[0]
    check, fake, _ = _checker(nonfinite="stop")
    with pytest.raises(NonFiniteError, match=r"step 3: loss nan \(--nonfinite stop\); the update was not applied"):
        check(3, float("nan"), False)
    check, fake, _ = _checker(nonfinite_limit=2)
    check(1, float("inf"), False)
    check(2, float("nan"), False)
    with pytest.raises(NonFiniteError, match="3 non-finite steps .* more than --nonfinite-limit 2"):
        check(5, float("nan"), False)
    check, fake, _ = _checker()
    with pytest.raises(NonFiniteError, match="step 4: loss nan, and the optimizer applied the update"):
        check(4, float("nan"), True)
    check, fake, _ = _checker(fp16=True)
    check(6, 1.0, False)  # fp16 loss-scale overflow skips are normal
    assert fake.nonfinite_steps == []


# --- SIGTERM through the launcher, resume equivalence, fallback, resume past the end -------------

def _wait_for(proc: subprocess.Popen, log: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.is_file() and text in log.read_text():
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before {text!r}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"no {text!r} within {timeout} s:\n{log.read_text()[-4000:]}")


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_and_resume_matches_an_uninterrupted_run(tmp_path):
    if shutil.which("deepspeed") is None:
        pytest.fail("the `deepspeed` launcher is not on PATH")
    steps = 6
    args = [*TRAIN, "--deepspeed_config", str(CPU_CONFIG)]
    log = tmp_path / "first.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", str(SCRIPT), *args, "--log-dir", "first"], cwd=tmp_path, stdout=f,
                                stderr=subprocess.STDOUT,
                                env=_env(STEPS=str(steps), SAVE_DIR="ckpt", SAVE_INTERVAL="0"))
        _wait_for(proc, log, f"step 1/{steps}", 240)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    out = log.read_text()
    assert rc == EXIT_PREEMPTED, out[-4000:]
    first = _summary(tmp_path / "first")
    stop = first["stopped"]
    k = stop["step"]
    assert stop["signal"] == "SIGTERM" and 1 <= k < steps and first["final_step"] == k, stop
    assert f"stopped after step {k} of {steps}" in out
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"global_step{k}"
    assert check_checkpoint(tmp_path / "ckpt" / f"global_step{k}") is None
    # no rank kept running: nothing but the stopped checkpoint was written
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if "global_step" in p.name) == [f"global_step{k}"]

    # a corrupt newer checkpoint named by latest: resume falls back to global_step{k} and says why
    bad = tmp_path / "ckpt" / f"global_step{k + 1}"
    shutil.copytree(tmp_path / "ckpt" / f"global_step{k}", bad)
    victim = next(bad.glob("*optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[:100])
    write_latest(tmp_path / "ckpt", bad.name)
    r = subprocess.run(["bash", str(SCRIPT), *args, "--log-dir", "resumed"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=400, env=_env(STEPS=str(steps), SAVE_DIR="ckpt", RESUME="1",
                                                        SAVE_INTERVAL="0"))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert f"skipping checkpoint global_step{k + 1}: {victim.relative_to(tmp_path)} has 100 bytes" in r.stdout
    assert f"resumed from " in r.stdout and f"step {k} (epoch" in r.stdout
    resumed = _summary(tmp_path / "resumed")
    assert resumed["first_step"] == k + 1 and resumed["last_step"] == steps
    # retention (KEEP_CHECKPOINTS 2) counts good checkpoints only: the corrupt one does not push out global_step{k}
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if "global_step" in p.name) == sorted(
        [f"global_step{k}", f"global_step{k + 1}", f"global_step{steps}"])

    # the uninterrupted run: the trainer with the arguments train_wan.sh gives it (STEPS, SAVE_DIR="": no --save) on
    # 2 ranks of the test harness (conftest.launch_ranks fails the test if a rank fails); the launcher's part is
    # the interrupted run and its resume above
    launch_ranks(["-m", "ds_adaptive.cli.train", "--deepspeed_config", str(CPU_CONFIG), "--model", "tiny", "--steps",
                  str(steps), *args, "--log-dir", "straight"], 2, cwd=tmp_path, env={"PYTHONPATH": str(ROOT)},
                 timeout=400)
    ref = _summary(tmp_path / "straight")["losses"]
    assert len(ref) == steps
    assert first["losses"] == pytest.approx(ref[:k], rel=1e-5, abs=1e-6)
    assert resumed["losses"] == pytest.approx(ref[k:], rel=1e-5, abs=1e-6)

    # resuming a finished run: one message, exit 2 (the ranks' check, before loading: the 2 ranks as train_wan.sh
    # RESUME=1 starts them, --resume ckpt with its default --save-interval / --keep-checkpoints, on the test harness)
    rs = launch_ranks(["-m", "ds_adaptive.cli.train", "--deepspeed_config", str(CPU_CONFIG), "--model", "tiny",
                       "--steps", str(steps), "--save", "ckpt", "--save-interval", "10", "--keep-checkpoints", "2",
                       "--resume", "ckpt", *args], 2, cwd=tmp_path, env={"PYTHONPATH": str(ROOT)}, timeout=300,
                      check=False)
    outs = "\n".join(f"--- rank {i}\n{r.stdout[-3000:]}" for i, r in enumerate(rs))
    assert [r.returncode for r in rs] == [2, 2], outs
    said = f"the checkpoint is at step {steps} and --steps is {steps}: nothing left to train"
    assert said in rs[0].stdout and not any(said in r.stdout for r in rs[1:]), outs   # one message: rank 0's
    assert all("Traceback" not in r.stdout and "KeyError" not in r.stdout for r in rs), outs


# --- --init-from through build_run -----------------------------------------------------------

INIT_FROM = textwrap.dedent("""
    import json, sys
    import torch, deepspeed
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig
    from ds_adaptive.cli.train import init_distributed

    src, config = sys.argv[1], sys.argv[2]
    rank, world, device = init_distributed(0)
    torch.set_num_threads(1)
    cfg = RunConfig.load(config, trainer={"model": "tiny", "layers": 2, "init_from": src, "num_samples": 50})
    run = build_run(cfg, layout=Layout.detect(None, ds_config=cfg.ds_config), device=device)
    x, t, c = torch.load("inputs.pt")
    with deepspeed.zero.GatheredParameters(list(run.model.parameters())), torch.no_grad():
        out = run.model(x, t, c)
    partitioned = all(p.numel() == 0 or p.numel() < p.ds_numel for p in run.model.parameters())
    if rank == 0:
        torch.save(out, "out.pt")
    print("RESULT " + json.dumps({"notes": run.notes, "partitioned": partitioned}), flush=True)
""")


def test_init_from_a_diffusers_dir_in_build_run_reproduces_diffusers(tmp_path, run_ranks):
    pytest.importorskip("diffusers")
    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.models.wan_config import get_wan_config
    from ds_adaptive.models.testing import diffusers_twin, random_init_

    cfg = get_wan_config("tiny", num_layers=2)
    twin = diffusers_twin(random_init_(WanModel(cfg), seed=11))
    twin.save_pretrained(str(tmp_path / "wan"), safe_serialization=True)
    g = torch.Generator().manual_seed(2)
    x, t, c = torch.randn(1, 16, 3, 8, 12, generator=g), torch.tensor([400.0]), torch.randn(1, 12, cfg.text_dim,
                                                                                          generator=g)
    torch.save((x, t, c), tmp_path / "inputs.pt")
    with torch.no_grad():
        ref = twin(x, t, c, return_dict=False)[0]
    (tmp_path / "r.py").write_text(INIT_FROM)
    res = run_ranks(["r.py", str(tmp_path / "wan"), str(CPU_CONFIG)], 2, cwd=tmp_path,
                    env={"PYTHONPATH": str(ROOT)}, timeout=300)
    info = json.loads(next(x for x in res[0].stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert info["partitioned"] and any("--init-from" in n and "ZeRO-3" in n for n in info["notes"]), info
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), ref, rtol=1e-5, atol=1e-5)
    assert float(ref.abs().mean()) > 1e-2


# --- a signal to the whole process group (timeout, Ctrl-C, SLURM) with DataLoader workers -----------

class _SignalsItsOwnWorker(torch.utils.data.Dataset):
    """Each item sends SIGTERM to the process that loads it (a DataLoader worker)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)   # a worker without the fix is dead by now
        return i


def test_dataloader_workers_ignore_the_stop_signals():
    from ds_adaptive.training.preempt import ignore_stop_signals

    loader = torch.utils.data.DataLoader(_SignalsItsOwnWorker(), batch_size=None, num_workers=1,
                                         worker_init_fn=ignore_stop_signals)
    assert [int(x) for x in loader] == [0, 1, 2, 3]


@pytest.mark.slow
def test_sigterm_to_the_process_group_with_loader_workers_stops_cleanly(tmp_path):
    """`timeout`, Ctrl-C and schedulers signal the whole process group: the loader workers too. The rank
    must still finish its step and write its summary (before: 'DataLoader worker ... killed by signal')."""
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "ds_adaptive.cli.train", "--deepspeed_config", str(CPU_CONFIG),
                                 *TRAIN, "--steps", "50", "--workers", "1", "--log-dir", "run"], cwd=tmp_path,
                                stdout=f, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
        _wait_for(proc, log, "step 1/50", 240)
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=120)
    out = log.read_text()
    assert rc == EXIT_PREEMPTED, out[-4000:]
    assert "killed by signal" not in out, out[-4000:]
    stop = _summary(tmp_path / "run")["stopped"]
    assert stop["signal"] == "SIGTERM" and 1 <= stop["step"] < 50, stop
