"""A fork server for the ranks of multi-process test jobs (``conftest.launch_ranks``): it imports once what a
trainer rank imports (torch, DeepSpeed, torch's compiler stack, the trainer), then forks one child per rank, so a
rank skips the ~8 CPU-s of imports a fresh interpreter spends before its first line (2-core CI machine: about a third
of the suite's CPU went there).

Protocol, one JSON object a line. In (stdin): ``{"id", "argv", "env", "cwd", "out"}``: run ``python argv`` as
``_rank_main.py`` would, with exactly ``env`` as the environment, in ``cwd``, stdout and stderr to the file ``out``.
Out (stdout): ``{"ready": pid, "ds_adaptive": path, "env": {...}, "added_env": {...}}`` once (the environment it
started with, what its imports set), ``{"id", "pid"}`` per child, ``{"exit":
pid, "code"}`` when a child ends (``code`` as ``subprocess``'s ``returncode``: negative for a signal). The server
ends when its stdin closes. It starts no thread (a forked child would inherit a held lock); it refuses to serve
(``{"ready": 0, "why"}``) when an import left one running.

A child starts from the server's imported modules and resets what a fresh interpreter would have fresh: the
environment, the working directory, ``sys.path`` (the caller checks that the modules the server imported resolve
to the same files under the child's PYTHONPATH), the random states of ``random``, numpy and torch (torch's default
seed), and stdout / stderr (line-buffered, to ``out``). ``conftest.launch_ranks`` falls back to fresh interpreters
for an environment the server cannot serve, and always with ``DS_ADAPTIVE_TEST_FRESH_RANKS=1``.
"""
from __future__ import annotations

import importlib
import json
import os
import select
import sys
import threading
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
#: what a trainer rank imports before its first step (the Muon module: DeepSpeed imports it in every ZeRO engine,
#: and it imports torch's Inductor)
PRELOAD = ("torch", "numpy", "deepspeed", "torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer",
           "ds_adaptive.cli.train", "ds_adaptive.training.trainer", "ds_adaptive.training.assemble", "ds_adaptive.training.checkpoint",
           "matplotlib.figure", "matplotlib.backends.backend_agg")   # rank 0's run.png at the end of every run
TORCH_DEFAULT_SEED = 67280421310721


#: the protocol's output: the process's stdout, moved off fd 1 so that what the imports print goes to stderr
_PROTO: list[int] = []
#: environment variables the imports set (DeepSpeed's PYTORCH_NVML_BASED_CUDA_CHECK, Inductor's cache default)
_ADDED_ENV: dict[str, str] = {}


def _send(msg: dict) -> None:
    os.write(_PROTO[0], (json.dumps(msg) + "\n").encode())


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _child(req: dict, base_path: list[str]) -> None:
    """In the forked child: become a fresh rank process, run it, never return."""
    try:
        os.close(_PROTO[0])
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update({**_ADDED_ENV, **req["env"]})   # what the imports set, as in a fresh rank after them
        fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [HERE, *extra, *[p for p in base_path if p not in extra]]
        import random

        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        import torch

        torch.manual_seed(TORCH_DEFAULT_SEED)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        import _rank_main

        _rank_main.main(req["argv"])   # ends the process
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(1)


def main() -> None:
    _PROTO.append(os.dup(1))
    os.dup2(2, 1)
    start_env = dict(os.environ)
    zygote_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path if p != HERE and p not in zygote_path]
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a rank that needs it imports it itself
            print(f"rank zygote: {name} not preloaded: {exc}", file=sys.stderr)
    if _threads() != 1:
        _send({"ready": 0, "why": f"{_threads()} threads after the imports"})
        return
    import ds_adaptive

    sys.stdout.flush()
    _ADDED_ENV.update({k: v for k, v in os.environ.items() if start_env.get(k) != v})
    _send({"ready": os.getpid(), "ds_adaptive": os.path.dirname(os.path.abspath(ds_adaptive.__file__)),
           "env": start_env, "added_env": _ADDED_ENV})
    live: set[int] = set()
    buf = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05 if live else 1.0)
        if ready:
            data = os.read(0, 1 << 16)
            if not data:
                return   # the test process is gone
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(req, base_path)
                live.add(pid)
                _send({"id": req["id"], "pid": pid})
        while live:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            live.discard(pid)
            _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
