"""Guards multi-node runs without ssh (ds_adaptive/launch/multinode.py, launch/train_wan.sh's per-node and SLURM modes,
launch/slurm/train_wan.sbatch): SLURM host lists and variables, Kubernetes' variables, the dry run of a multi-node
layout, and two "nodes" on one machine (two launchers, NODE_RANK 0 and 1, MASTER_ADDR 127.0.0.1; and the sbatch
script under a stand-in `srun`): the same losses as one node of 4 processes, one agreed stop with a checkpoint and
exit 75 on both nodes, a resume that matches, and a dead node's rank ending the other node with one message."""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import launch_ranks
from ds_adaptive.training.checkpoint import check_checkpoint
from ds_adaptive.launch.multinode import (EXIT_PEER_FAILED, SLURM_PORT_BASE, SLURM_PORT_SPAN, NodeLauncher,
                                   RendezvousError, expand_hostlist, rendezvous_from_env, slurm_hostnames, slurm_port,
                                   tasks_on_node)
from ds_adaptive.training.preempt import EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "train_wan.sh"
SBATCH = ROOT / "launch" / "slurm" / "train_wan.sbatch"
CPU_CONFIG = ROOT / "launch" / "configs" / "cpu_tiny.json"
SHIM = ROOT / "tests" / "slurm_shim"
TRAIN = ["--num-samples", "200", "--layers", "1", "--seed", "5"]
STEPS = 6
_KNOBS = ("NUM_GPUS", "NUM_PROCS", "HOSTFILE", "DS_CONFIG", "MODEL", "STEPS", "SP", "SAVE_DIR", "SAVE_INTERVAL",
          "RESUME", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "LAUNCH_MODE", "NODE_TIMEOUT", "DRY_RUN",
          "GRAD_CKPT", "TASKS", "LOG_DIR", "REQUEUE", "RANK", "LOCAL_RANK", "WORLD_SIZE")


# --- SLURM host lists and variables ----------------------------------------------------------

@pytest.mark.parametrize("expr, hosts", [
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("node-001", ["node-001"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("a[098-101]", ["a098", "a099", "a100", "a101"]),
    ("rack[1-2]-n[01-02],x", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02", "x"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_slurm_host_lists_expand_like_scontrol(expr, hosts):
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize("expr, message", [
    ("gpu[01-03", "a '[' without its ']'"), ("gpu01]", "a ']' without its '['"), ("gpu[3-1]", "runs backwards"),
    ("gpu[a-b]", "not a number or a range"), ("a,,b", "an empty entry"), ("", "host list is empty"),
])
def test_bad_host_lists_name_the_problem(expr, message):
    with pytest.raises(RendezvousError, match=message.replace("[", r"\[").replace("]", r"\]")):
        expand_hostlist(expr)


def test_scontrol_is_asked_first_and_the_parser_is_the_fallback(tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text("#!/usr/bin/env bash\n[[ \"$1 $2\" == 'show hostnames' ]] && printf 'h1\\nh2\\n'\n")
    fake.chmod(0o755)
    assert slurm_hostnames("whatever[1-9]", scontrol=str(fake)) == ["h1", "h2"]
    fake.write_text("#!/usr/bin/env bash\nexit 1\n")  # scontrol present but failing (no controller)
    assert slurm_hostnames("gpu[01-02]", scontrol=str(fake)) == ["gpu01", "gpu02"]
    assert slurm_hostnames("gpu[01-02]", scontrol=None) == ["gpu01", "gpu02"]


def test_tasks_per_node_and_port():
    assert [tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]
    assert tasks_on_node("8", 0) == 8
    with pytest.raises(RendezvousError, match="describes 4 node"):
        tasks_on_node("2(x3),1", 4)
    assert slurm_port(1234) == slurm_port(1234) == 21234 and slurm_port(10000) == 20000


def _slurm(**extra) -> dict:
    return {"SLURM_JOB_ID": "987654", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "gpu[01-03,07]",
            "SLURM_JOB_NUM_NODES": "4", **extra}


def test_slurm_one_task_per_node_launches_the_node():
    r = rendezvous_from_env(_slurm(SLURM_NTASKS="4", SLURM_NODEID="2", SLURM_PROCID="2", SLURM_LOCALID="0",
                                   SLURM_TASKS_PER_NODE="1(x4)"), scontrol=None)
    assert (r.mode, r.nnodes, r.node_rank, r.master_addr, r.master_port) == ("node", 4, 2, "gpu01", 20000 + 7654)
    env = dict(line.removeprefix("export ").split("=", 1) for line in r.shell().splitlines())
    assert env["LAUNCH_MODE"] == "node" and env["DS_ADAPTIVE_REPEAT_SIGNAL"] == "ignore" and "RANK" not in env
    # the step's node list wins over the job's, an explicit MASTER_PORT / MASTER_ADDR over the derived ones
    r = rendezvous_from_env(_slurm(SLURM_NTASKS="2", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NODELIST="gpu[03,07]",
                                   SLURM_NODEID="1", MASTER_PORT="31000"), scontrol=None)
    assert (r.nnodes, r.master_addr, r.master_port) == (2, "gpu03", 31000)


def test_slurm_one_task_per_gpu_is_a_rank():
    r = rendezvous_from_env(_slurm(SLURM_JOB_NODELIST="gpu[01-02]", SLURM_JOB_NUM_NODES="2", SLURM_NTASKS="16",
                                   SLURM_TASKS_PER_NODE="8(x2)", SLURM_NODEID="1", SLURM_PROCID="11",
                                   SLURM_LOCALID="3"), scontrol=None)
    env = dict(line.removeprefix("export ").split("=", 1) for line in r.shell().splitlines())
    assert env["LAUNCH_MODE"] == "task"
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "NODE_RANK", "MASTER_ADDR")} == {
        "RANK": "11", "LOCAL_RANK": "3", "WORLD_SIZE": "16", "LOCAL_SIZE": "8", "NODE_RANK": "1", "MASTER_ADDR": "gpu01"}


@pytest.mark.parametrize("env, message", [
    ({"LAUNCH_MODE": "slurm"}, "SLURM_JOB_ID / SLURM_JOBID is not set"),
    (_slurm(SLURM_NTASKS="4"), "SLURM_NODEID is not set"),
    (_slurm(SLURM_NTASKS="4", SLURM_NODEID="4"), "SLURM_NODEID=4 but the step has 4 node"),
    (_slurm(SLURM_NTASKS="4", SLURM_NODEID="0", SLURM_JOB_NUM_NODES="3"), "names 4 host.* but SLURM_JOB_NUM_NODES=3"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "a"}, "NODE_RANK=2 but there are 2 node.*0..1"),
    ({"NNODES": "2", "NODE_RANK": "1"}, "MASTER_ADDR is not set: with NNODES=2"),
    ({"NNODES": "two"}, "NNODES='two' is not a whole number"),
    ({"NNODES": "2", "MASTER_ADDR": "a"}, "NODE_RANK / PET_NODE_RANK / JOB_COMPLETION_INDEX is not set"),
    ({"NNODES": "1", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    ({"LAUNCH_MODE": "ssh"}, "LAUNCH_MODE='ssh': expected one of auto, deepspeed, node, slurm"),
])
def test_bad_multi_node_variables_are_one_clear_error(env, message):
    with pytest.raises(RendezvousError, match=message):
        rendezvous_from_env(env, scontrol=None)


def test_kubernetes_and_plain_per_node_variables():
    # Kubeflow PyTorchJob / TrainJob (torchrun's PET_* names); its pod-level RANK / WORLD_SIZE are not read
    r = rendezvous_from_env({"PET_NNODES": "4", "PET_NODE_RANK": "3", "PET_MASTER_ADDR": "job-master-0",
                             "PET_MASTER_PORT": "23456", "RANK": "3", "WORLD_SIZE": "4"})
    assert (r.mode, r.nnodes, r.node_rank, r.master_addr, r.master_port, r.scheduler) == (
        "node", 4, 3, "job-master-0", 23456, "kubernetes")
    # JobSet / Indexed Job: the pod's completion index is the node rank
    r = rendezvous_from_env({"NNODES": "2", "JOB_COMPLETION_INDEX": "1", "MASTER_ADDR": "js-w-0-0.js"})
    assert (r.node_rank, r.master_port, r.scheduler) == (1, 29500, "kubernetes")
    r = rendezvous_from_env({"NNODES": "1"})
    assert (r.mode, r.node_rank, r.master_addr) == ("node", 0, "127.0.0.1")
    assert rendezvous_from_env({}).mode == "deepspeed"
    assert rendezvous_from_env({"SLURM_JOB_ID": "5", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).mode == "deepspeed"


def test_rank_environment_of_the_node_launcher():
    launcher = NodeLauncher(["train.py"], nnodes=3, node_rank=2, nproc=4, master_addr="n0", master_port=1234)
    env = launcher.rank_env(1, {"KEEP": "x", "RANK": "stale"})
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
                                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "KEEP")} == {
        "RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "12", "LOCAL_SIZE": "4", "CROSS_RANK": "2", "CROSS_SIZE": "3",
        "MASTER_ADDR": "n0", "MASTER_PORT": "1234", "TORCHELASTIC_USE_AGENT_STORE": "True", "KEEP": "x"}


# --- the launcher's dry run in the multi-node modes --------------------------------------------

def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in _KNOBS and not k.startswith(("SLURM_", "PET_", "JOB_COMPLETION"))}
    return {**env, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            **{k: str(v) for k, v in extra.items()}}


def _dry(**env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], env=_env(DRY_RUN=1, **env), capture_output=True, text=True,
                          timeout=180)


def test_dry_run_per_node_checks_nodes_x_gpus_and_prints_the_node_command():
    r = _dry(NUM_GPUS=8, NNODES=4, NODE_RANK=3, MASTER_ADDR="node-001", MASTER_PORT=29600, SP=4)
    assert r.returncode == 0, r.stdout + r.stderr
    cmd = shlex.split(r.stdout.splitlines()[-1].removeprefix("+ "))
    i = cmd.index("launch")
    assert cmd[i - 2:i] == ["-m", "ds_adaptive.launch.multinode"]
    assert cmd[i + 1:cmd.index("--")] == ["--nnodes", "4", "--node-rank", "3", "--nproc-per-node", "8",
                                          "--master-addr", "node-001", "--master-port", "29600"]
    assert Path(cmd[cmd.index("--") + 1]).name == "train_wan.py"
    assert "world 32 = 4 node(s) x 8 GPU(s); Ulysses sp 4" in r.stderr
    assert "every SP group of 4 ranks stays inside one node" in r.stderr and "OK" in r.stderr


def test_dry_run_launcher_node_layouts(capsys):
    from ds_adaptive.cli.dry_run import main as dry_run

    base = ["--deepspeed_config", str(ROOT / "launch" / "configs" / "zero3_adaptive.json"), "--launcher", "node"]
    assert dry_run([*base, "--num-gpus", "6", "--num-nodes", "2", "--sp", "4", "--master-addr", "a"]) == 0
    out = capsys.readouterr().out  # 12 ranks in SP groups of 4: the second group spans both nodes
    assert "some SP groups span two nodes" in out and "[warn]" in out and "without --hostfile" not in out
    assert dry_run([*base, "--num-gpus", "8", "--num-nodes", "2", "--node-rank", "2", "--master-addr", "a"]) == 2
    assert "--node-rank 2 but the job has 2 node(s): use 0..1" in capsys.readouterr().out
    assert dry_run([*base, "--num-gpus", "8", "--num-nodes", "2", "--sp", "2"]) == 0
    assert "no --master-addr: every node needs node 0's address" in capsys.readouterr().out


def test_dry_run_under_slurm_and_bad_combinations(tmp_path):
    slurm = dict(SLURM_JOB_ID=77, SLURM_PROCID=1, SLURM_NODEID=1, SLURM_LOCALID=0, SLURM_NTASKS=2,
                 SLURM_JOB_NUM_NODES=2, SLURM_JOB_NODELIST="gpu[07-08]", NUM_GPUS=8)
    (tmp_path / "ck" / "global_step4").mkdir(parents=True)
    (tmp_path / "ck" / "global_step4" / "ds_adaptive_complete.json").write_text("{}")  # RESUME=1 needs a complete one
    r = _dry(**slurm, SAVE_DIR=tmp_path / "ck")
    assert r.returncode == 0, r.stdout + r.stderr
    cmd = r.stdout.splitlines()[-1]
    assert "--nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr gpu07 --master-port 20077" in cmd
    assert "slurm: node 1 of 2, rendezvous gpu07:20077" in r.stderr
    assert cmd.endswith(f"--resume {tmp_path / 'ck'}")  # RESUME=1 is the default under SLURM (a requeued job)
    r = _dry(**{**slurm, "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_NTASKS": 16, "SLURM_PROCID": 9, "SLURM_LOCALID": 1})
    assert r.returncode == 0, r.stdout + r.stderr
    cmd = shlex.split(r.stdout.splitlines()[-1].removeprefix("+ "))
    assert cmd[1] == "-u" and Path(cmd[2]).name == "train_wan.py"  # one task per GPU: this task is rank 9
    assert "rank 9 of 16 (SLURM task 9, node 1 of 2)" in r.stdout
    r = _dry(NUM_GPUS=8, NNODES=2, NODE_RANK=0, MASTER_ADDR="a", HOSTFILE=str(ROOT / "launch" / "hostfile.example"))
    assert r.returncode == 2 and "HOSTFILE is for DeepSpeed's ssh launch" in r.stderr
    r = _dry(NUM_GPUS=8, NNODES=2, NODE_RANK=5, MASTER_ADDR="a")
    assert r.returncode == 2 and "NODE_RANK=5 but there are 2 node(s)" in r.stderr and "Traceback" not in r.stderr


def test_sbatch_script_parses_and_its_dry_run_checks_the_job_layout(tmp_path):
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0
    env = _env(SLURM_JOB_ID=5, SLURM_JOB_NUM_NODES=4, SLURM_JOB_NODELIST="gpu[01-04]", SLURM_GPUS_PER_NODE="h100:8",
               SLURM_SUBMIT_DIR=ROOT, DRY_RUN=1, SP=2, MODEL="wan2.1-14b")
    r = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "world 32 = 4 node(s) x 8 GPU(s); Ulysses sp 2" in r.stderr and "zero3_adaptive_14b.json" in r.stdout
    env.pop("SLURM_GPUS_PER_NODE")
    r = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2 and "cannot tell the GPUs per node" in r.stderr
    r = subprocess.run(["bash", str(SBATCH)], env={**env, "SLURM_SUBMIT_DIR": str(tmp_path)}, capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2 and "submit from the repository root or set DS_ADAPTIVE_ROOT" in r.stderr


# --- the watchdog with stand-in ranks (no training) ---------------------------------------------

SLEEPER = "import time\nwhile True:\n    time.sleep(1)\n"


def _free_port(lo: int = 0, hi: int = 0) -> int:
    """A port in ``lo..hi`` that binds now; without a range ``ds_adaptive.core.ports.free_port``."""
    if not hi:
        from ds_adaptive.core.ports import free_port

        return free_port("127.0.0.1")
    for port in range(lo, hi):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port")


def _wait_text(proc: subprocess.Popen, log: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.is_file() and text in log.read_text():
            return
        if proc.poll() is not None:
            pytest.fail(f"exit {proc.returncode} before {text!r}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    pytest.fail(f"no {text!r} within {timeout} s:\n{log.read_text()[-4000:]}")


def _kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            for child in psutil.Process(p.pid).children(recursive=True):
                child.kill()
            p.kill()
            p.wait()


@pytest.mark.slow
@pytest.mark.parametrize("lost", [1, 0])
def test_a_node_that_vanishes_ends_the_other_within_the_node_timeout(tmp_path, lost):
    """The whole node goes (its supervisor SIGKILLed: the reaper kills its launcher and ranks, as a power cut
    would): node 1 lost -> node 0 sees its heartbeat stop; node 0 lost -> node 1 loses the store."""
    (tmp_path / "rank.py").write_text(SLEEPER)
    port = _free_port()
    procs, logs = [], []
    for node in (0, 1):
        logs.append(tmp_path / f"node{node}.log")
        cmd = [sys.executable, "-m", "ds_adaptive.launch.supervise", "--", sys.executable, "-m",
               "ds_adaptive.launch.multinode", "launch", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
               "--master-addr", "127.0.0.1", "--master-port", str(port), "--node-timeout", "4", "--",
               str(tmp_path / "rank.py")]
        with open(logs[-1], "w") as f:
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=f, stderr=subprocess.STDOUT))
    try:
        for p, log in zip(procs, logs):
            _wait_text(p, log, "started rank", 120)
        time.sleep(3)  # a few heartbeats
        procs[lost].kill()
        t0 = time.monotonic()
        other = 1 - lost
        rc = procs[other].wait(timeout=60)
        took = time.monotonic() - t0
        out = logs[other].read_text()
        assert rc == EXIT_PEER_FAILED, out
        host = socket.gethostname()
        if lost == 1:
            assert f"node 1 ({host}, rank 1) stopped responding: no heartbeat from its launcher for" in out, out
        else:
            assert "lost node 0 (127.0.0.1:" in out and "its launcher holds the job's rendezvous store" in out, out
        assert out.count("ending the job") == 1 and "stopping this node's rank(s) " + str(other) in out
        assert took < 4 + 15, took
    finally:
        _kill_all(procs)


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named_before_the_errors_it_causes(tmp_path):
    """Local rank 0 fails first with status 1 (what a collective error looks like), rank 1 is SIGKILLed 1 s later:
    the message names the killed rank, and the node exits with its status."""
    (tmp_path / "rank.py").write_text(textwrap.dedent("""
        import os, signal, sys, time
        if os.environ["LOCAL_RANK"] == "0":
            time.sleep(0.5)
            sys.exit(1)
        time.sleep(1.5)
        os.kill(os.getpid(), signal.SIGKILL)
    """))
    r = subprocess.run([sys.executable, "-m", "ds_adaptive.launch.multinode", "launch", "--nnodes", "1", "--node-rank", "0",
                        "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                        "--", str(tmp_path / "rank.py")], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 128 + signal.SIGKILL, r.stderr
    lines = [x for x in r.stderr.splitlines() if "ending the job" in x]
    assert len(lines) == 1 and f"node 0 ({socket.gethostname()}) rank 1 (local rank 1, pid " in lines[0], r.stderr
    assert "was killed by SIGKILL" in lines[0]


# --- two nodes of real training on one machine ----------------------------------------------------

def _summary(d: Path) -> dict:
    return json.loads((d / "summary.json").read_text())


def _start_nodes(tmp_path: Path, name: str, port: int, **env) -> tuple[list[subprocess.Popen], list[Path]]:
    """launch/train_wan.sh on two "nodes": NNODES=2, NODE_RANK 0 and 1, MASTER_ADDR 127.0.0.1 (2 CPU ranks each)."""
    procs, logs = [], []
    for node in (0, 1):
        logs.append(tmp_path / f"{name}-node{node}.log")
        with open(logs[-1], "w") as f:
            procs.append(subprocess.Popen(
                ["bash", str(SCRIPT), *TRAIN, "--log-dir", name], cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT,
                env=_env(NUM_GPUS=0, NNODES=2, NODE_RANK=node, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env)))
    return procs, logs


def _wait_nodes(procs, logs, timeout: float = 420) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        _kill_all(procs)
        pytest.fail("the two nodes did not finish in time:\n" + "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}"
                                                                          for log in logs))


def _trainer_argv(steps: int, *args: str) -> list[str]:
    """The trainer as launch/train_wan.sh starts it on the CPU (its default config and model, STEPS=steps), with
    ``args`` after TRAIN: for 4 ranks of the test harness (conftest.launch_ranks), one node of 4 processes."""
    return ["-m", "ds_adaptive.cli.train", "--deepspeed_config", str(CPU_CONFIG), "--model", "tiny", "--steps",
            str(steps), *TRAIN, *args]


@pytest.fixture(scope="module")
def one_node_of_four(tmp_path_factory) -> list[float]:
    """The reference: one node of 4 CPU processes, STEPS steps, no --save: the trainer with the arguments
    launch/train_wan.sh gives it (SAVE_DIR="") on 4 ranks of the test harness. The launcher on one node is
    tests/test_launch.py's; here the launchers under test are the two nodes' (and the sbatch script's)."""
    d = tmp_path_factory.mktemp("one_node")
    launch_ranks(_trainer_argv(STEPS, "--log-dir", "ref"), 4, cwd=d, env={"PYTHONPATH": str(ROOT)}, timeout=600)
    losses = _summary(d / "ref")["losses"]
    assert len(losses) == STEPS
    return losses


@pytest.mark.slow
def test_sigterm_to_one_node_stops_both_at_one_step_and_resume_matches(tmp_path, one_node_of_four):
    """Two launchers without ssh (NNODES=2, NODE_RANK 0 / 1) stop at one agreed step with a complete checkpoint;
    the interrupted run and its resume together give the losses of one node of 4 processes."""
    port = _free_port()
    procs, logs = _start_nodes(tmp_path, "first", port, STEPS=STEPS, SAVE_DIR="ckpt", SAVE_INTERVAL=0)
    try:
        _wait_text(procs[0], logs[0], f"step 1/{STEPS}", 300)
        procs[1].send_signal(signal.SIGTERM)  # node 1's launcher only (train_wan.sh execs the supervisor)
        rcs = _wait_nodes(procs, logs)
    finally:
        _kill_all(procs)
    outs = [log.read_text() for log in logs]
    assert rcs == [EXIT_PREEMPTED, EXIT_PREEMPTED], "\n".join(o[-3000:] for o in outs)
    assert "SIGTERM: forwarded to 2 rank process(es)" in outs[1] and "forwarded" not in outs[0]
    assert "started ranks 0-1 of 4" in outs[0] and "started ranks 2-3 of 4" in outs[1]
    first = _summary(tmp_path / "first")
    assert first["world_size"] == 4
    k = first["stopped"]["step"]
    assert first["stopped"]["signal"] == "a signal to another rank" and 1 <= k < STEPS, first["stopped"]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"global_step{k}"
    assert check_checkpoint(tmp_path / "ckpt" / f"global_step{k}") is None
    assert len(list((tmp_path / "ckpt" / f"global_step{k}").glob("*model_states.pt"))) == 4  # every rank's shard
    assert first["losses"] == pytest.approx(one_node_of_four[:k], rel=0, abs=1e-6)

    # the resume: the 4 ranks as train_wan.sh RESUME=1 starts them (--resume ckpt), on the test harness; a
    # resume through the two nodes' launchers is the sbatch test's requeued job
    launch_ranks(_trainer_argv(STEPS, "--save", "ckpt", "--save-interval", "0", "--keep-checkpoints", "2",
                               "--resume", "ckpt", "--log-dir", "resumed"), 4, cwd=tmp_path,
                 env={"PYTHONPATH": str(ROOT)}, timeout=420)
    resumed = _summary(tmp_path / "resumed")
    assert resumed["first_step"] == k + 1 and resumed["last_step"] == STEPS
    assert resumed["losses"] == pytest.approx(one_node_of_four[k:], rel=0, abs=1e-6)


@pytest.mark.slow
def test_sigkill_of_one_nodes_ranks_ends_the_other_node_with_one_message(tmp_path):
    procs, logs = _start_nodes(tmp_path, "killed", _free_port(), STEPS=50, SAVE_DIR="")
    try:
        _wait_text(procs[0], logs[0], "step 1/50", 300)
        launcher = next(p for p in psutil.Process(procs[1].pid).children(recursive=True)
                        if "ds_adaptive.launch.multinode launch" in " ".join(p.cmdline()))
        ranks = launcher.children()
        assert len(ranks) == 2
        for r in ranks:
            r.kill()
        t0 = time.monotonic()
        rc0 = procs[0].wait(timeout=60)
        took = time.monotonic() - t0
        rc1 = procs[1].wait(timeout=60)
    finally:
        _kill_all(procs)
    outs = [log.read_text() for log in logs]
    assert rc0 == EXIT_PEER_FAILED and rc1 == 128 + signal.SIGKILL, (rc0, rc1, outs[0][-3000:], outs[1][-3000:])
    host = socket.gethostname()
    lines = [x for x in outs[0].splitlines() if "ending the job" in x]
    assert len(lines) == 1, outs[0][-3000:]
    assert lines[0].startswith(f"ds_adaptive node 0: node 1 ({host}) rank ") and "was killed by SIGKILL" in lines[0]
    assert f"pid {ranks[0].pid})" in lines[0] or f"pid {ranks[1].pid})" in lines[0]
    assert took < 60, took


# --- SLURM: the sbatch script under a stand-in srun ---------------------------------------------

@pytest.mark.slow
def test_sbatch_usr1_stops_every_node_saves_requeues_and_the_requeued_job_resumes(tmp_path, one_node_of_four):
    """launch/slurm/train_wan.sbatch with tests/slurm_shim/srun (2 nodes, one task per node, SLURM's variables set
    per task) and a scontrol that records `requeue`. SIGUSR1 reaches every process of the step (as SLURM's
    --signal=USR1@N does), each only once-effective; the requeued job (same command, RESUME=1 by default) resumes."""
    port = _free_port(SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN)
    job = port - SLURM_PORT_BASE + 3 * SLURM_PORT_SPAN  # MASTER_PORT comes from the job id
    env = _env(PATH=f"{SHIM}:{os.environ['PATH']}", SLURM_JOB_ID=job, SLURM_JOB_NAME="wan", SLURM_JOB_NUM_NODES=2,
               SLURM_JOB_NODELIST="127.0.0.[1-2]", SLURM_SUBMIT_DIR=ROOT, NUM_GPUS=0, STEPS=STEPS, SAVE_DIR="ckpt",
               SAVE_INTERVAL=0, FAKE_SLURM_LOG=tmp_path / "slurm.log")
    logs = [tmp_path / "logs" / f"wan-{job}-node{n}.log" for n in (0, 1)]
    with open(tmp_path / "batch1.out", "w") as f:
        batch = subprocess.Popen(["bash", str(SBATCH), *TRAIN, "--log-dir", "first"], cwd=tmp_path, env=env,
                                 stdout=f, stderr=subprocess.STDOUT)
    try:
        _wait_text(batch, logs[0], f"step 1/{STEPS}", 300)
        srun = next(p for p in psutil.Process(batch.pid).children() if any(a.endswith("/srun") for a in p.cmdline()))
        srun.send_signal(signal.SIGUSR1)
        rc = batch.wait(timeout=300)
    finally:
        _kill_all([batch])
    outs = [log.read_text() for log in logs]
    batch_out = (tmp_path / "batch1.out").read_text()
    assert rc == EXIT_PREEMPTED, batch_out + "\n".join(o[-3000:] for o in outs)
    assert (tmp_path / "slurm.log").read_text().split() == ["requeue", str(job)]
    assert f"rendezvous 127.0.0.1:{port}" in outs[0] and "started ranks 2-3 of 4" in outs[1]
    for out in outs:  # both nodes: the supervisor forwarded USR1 once, the ranks ignored the repeats
        assert "SIGUSR1: forwarded to 2 rank process(es)" in out and "Traceback" not in out
    first = _summary(tmp_path / "first")
    k = first["stopped"]["step"]
    assert first["stopped"]["signal"] == "SIGUSR1" and 1 <= k < STEPS, first["stopped"]
    assert check_checkpoint(tmp_path / "ckpt" / f"global_step{k}") is None

    r = subprocess.run(["bash", str(SBATCH), *TRAIN, "--log-dir", "requeued"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    outs = [log.read_text() for log in logs]
    assert r.returncode == 0, r.stdout + "\n".join(o[-3000:] for o in outs)
    assert (tmp_path / "slurm.log").read_text().split() == ["requeue", str(job)]  # finished: no second requeue
    resumed = _summary(tmp_path / "requeued")
    assert resumed["first_step"] == k + 1 and resumed["last_step"] == STEPS
    assert first["losses"] + resumed["losses"] == pytest.approx(one_node_of_four, rel=0, abs=1e-6)
    assert all(out.count("started ranks") == 2 for out in outs)  # per-node logs, appended across the requeue


@pytest.mark.slow
def test_sbatch_one_task_per_rank_trains_like_one_node_of_four(tmp_path, one_node_of_four):
    """TASKS=gpu: srun starts 2 x 2 tasks, each a rank (RANK/LOCAL_RANK/WORLD_SIZE from SLURM_PROCID/LOCALID/NTASKS)."""
    port = _free_port(SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN)
    env = _env(PATH=f"{SHIM}:{os.environ['PATH']}", SLURM_JOB_ID=port - SLURM_PORT_BASE, SLURM_JOB_NAME="wan",
               SLURM_JOB_NUM_NODES=2, SLURM_JOB_NODELIST="localhost,127.0.0.2", SLURM_SUBMIT_DIR=ROOT, NUM_GPUS=0,
               TASKS="gpu", STEPS=2, SAVE_DIR="")
    r = subprocess.run(["bash", str(SBATCH), *TRAIN, "--log-dir", "tasks"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    logs = sorted((tmp_path / "logs").glob(f"wan-{port - SLURM_PORT_BASE}-node*.log"))
    outs = [log.read_text() for log in logs]
    assert r.returncode == 0, r.stdout + r.stderr + "\n".join(o[-3000:] for o in outs)
    assert len(logs) == 2 and "2 task(s) per node" in r.stdout
    assert "rank 2 of 4 (SLURM task 2, node 1 of 2)" in outs[1] and "rank 3 of 4 (SLURM task 3, node 1 of 2)" in outs[1]
    s = _summary(tmp_path / "tasks")
    assert s["world_size"] == 4 and s["losses"] == pytest.approx(one_node_of_four[:2], rel=0, abs=1e-6)


def test_a_node_stopped_by_another_exits_like_a_rank_stopped_by_another() -> None:
    from ds_adaptive.training.preempt import EXIT_PEER_LOST

    assert EXIT_PEER_FAILED == EXIT_PEER_LOST == 3
