"""Shared test helpers: repository paths and multi-process (gloo) launches of the trainer.

Multi-process tests start real processes, like the ``deepspeed`` launcher does (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the environment), with one thread each so that
two ranks share a 2-core CI machine fairly. DeepSpeed JIT-builds a small CPU op on its first
init; set TORCH_EXTENSIONS_DIR to a cached directory to pay that once (.ci/run does).

``launch_ranks`` forks its ranks from a server that has imported torch, DeepSpeed and the trainer once per pytest
process (tests/_rank_zygote.py): a rank then starts without ~8 CPU-s of imports. Where a rank's environment could
change what those imports did, and with ``DS_ADAPTIVE_TEST_FRESH_RANKS=1``, ranks are fresh interpreters
(``DS_ADAPTIVE_TEST_ZYGOTE_LOG=FILE`` appends which keys decided it). Tests of the launchers themselves
(``launch/train_wan.sh``, the multi-node launcher) start real processes either way.

The session starts only where a fresh interpreter imports this checkout's ``ds_adaptive`` (the editable install of
README's set-up); otherwise it stops with one line that names the package it found and the fix.
"""
from __future__ import annotations

import glob
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_HERE = Path(__file__).resolve().parent
_THIS = sys.modules[__name__]
CONFIGS = ROOT / "launch" / "configs"

# tests/unit/<sub-package>/ and tests/integration/ hold the test modules (no __init__.py: every basename is unique, and
# each module is imported by its basename). A few import another's helpers by that name (``from test_preprocess import
# tiny_models``) across directories: every test directory is on sys.path from the start, as the one flat directory was.
for _dir in sorted({p.parent for p in _HERE.glob("*/**/test_*.py")} - {_HERE / "gpu"}):
    if str(_dir) not in sys.path:
        sys.path.append(str(_dir))


def _tiny_models() -> tuple:
    """Each model family's first ``tiny*`` preset: the CPU test matrix runs once per family."""
    from ds_adaptive.models.registry import families

    return tuple(next(p.name for p in fam.presets if p.name.startswith("tiny"))
                 for fam in families().values() if any(p.name.startswith("tiny") for p in fam.presets))


TINY_MODELS = _tiny_models()


def pytest_collectstart(collector) -> None:
    """Keep ``from conftest import launch_ranks, ROOT`` working in the test modules of tests/unit and tests/integration.

    tests/gpu has its own conftest.py; both are imported under the module name ``conftest``, and the
    one imported last would answer. Before a module under tests/ (outside tests/gpu) is imported, point the name
    back at this file.
    """
    if (isinstance(collector, pytest.Module) and collector.path.is_relative_to(_HERE)
            and not collector.path.is_relative_to(_HERE / "gpu")):
        sys.modules["conftest"] = _THIS


# DeepSpeed's CPU communication backend (deepspeed/ops/csrc/cpu/comm/shm.cpp, 0.19.8) creates one shared-memory
# buffer per rank, /dev/shm/deepspeed_allreduce_buffer_<rank>_<addr>_<port>_<n> (~69 MB each), and never unlinks
# it: each multi-rank CPU job of the suite left ~140 MB behind, and repeated runs filled /dev/shm until the
# kernel's OOM killer ended the suite (seen on the 24 GiB development machine). The jobs' buffers are removed once
# their ranks have exited; whatever else this session left (jobs started without launch_ranks) at its end.
_SHM_GLOB = "/dev/shm/deepspeed_allreduce_buffer_*"
_SESSION_START = time.time()


def _remove_shm(pattern: str, newer_than: float = 0.0) -> None:
    for f in glob.glob(pattern):
        try:
            if os.path.getmtime(f) >= newer_than:
                os.unlink(f)
        except OSError:  # gone already, or not ours to remove
            pass


def pytest_sessionfinish(session, exitstatus) -> None:
    if hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker: the other workers' jobs may still run; the controller cleans up at the end
    _remove_shm(_SHM_GLOB, newer_than=_SESSION_START)


@pytest.fixture(autouse=True)
def _torch_linear_after_test():
    """Every test starts with torch's ``F.linear``. A test that runs ``deepspeed.zero.Init`` in the pytest process
    leaves DeepSpeed's ``memory_efficient_linear`` in ``torch.nn.functional.linear`` for the whole process (its
    bias added after the product: one more bf16 rounding), so a later test comparing two paths of a block bit for
    bit saw a one-ulp difference that depended on test order (tests/gpu/test_lean_backward_gpu.py after
    test_checkpoint_gpu.py, H200, 2026-11-29)."""
    yield
    if "deepspeed.runtime.zero.partition_parameters" in sys.modules:   # only where DeepSpeed's ZeRO-3 was imported
        from ds_adaptive.training.assemble import use_torch_linear

        use_torch_linear()


_COMPILER_CONFIGS = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")


@pytest.fixture(autouse=True)
def _process_state_restored():
    """Every test ends with the process-wide torch state it started with: the compiler configs (dynamo, inductor,
    functorch: a test that switches the autograd cache or the C++ compiler off must not change what a later test
    compiles), the intra-op thread count (the trainer sets 1 under a pinning DataLoader) and the default dtype, so
    that the suite passes in any order (``pytest -p randomly``)."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    configs = [sys.modules[m] for m in _COMPILER_CONFIGS if m in sys.modules]
    saved = [c.get_config_copy() for c in configs]
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    yield
    for config, before in zip(configs, saved):
        after = config.get_config_copy()
        for key, value in before.items():
            if after.get(key) != value:
                setattr(config, key, value)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if torch.get_default_dtype() != dtype:
        torch.set_default_dtype(dtype)


def installed_package_problem(env: dict | None = None) -> str | None:
    """Why the processes the tests start would not run this checkout's code, or None: a fresh interpreter (``env``,
    default this process's environment, in a neutral directory) must find ``ds_adaptive`` in this checkout, as the
    editable install of README's set-up makes it (the console scripts and every rank started without this checkout on
    PYTHONPATH import the installed package)."""
    want = ROOT / "ds_adaptive" / "__init__.py"
    probe = "import importlib.util as u; s = u.find_spec('ds_adaptive'); print(s.origin if s else '')"
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run([sys.executable, "-c", probe], cwd=cwd, env=os.environ if env is None else env,
                           capture_output=True, text=True, timeout=60)
    found = r.stdout.strip()
    if r.returncode == 0 and found and Path(found).resolve() == want:
        return None
    where = (f"finds it at {found}" if found else "does not find it") if r.returncode == 0 else \
        f"fails: {(r.stderr.strip().splitlines() or ['no output'])[-1]}"
    return (f"tests: `import ds_adaptive` in a fresh {sys.executable} {where}, expected {want} (this checkout): "
            f"the tests start `ds-adaptive` and ranks that import the installed package; run `pip install -e \".[dev]\"` "
            f"in {ROOT}")


# --- pytest-xdist (.ci/run: -n 2 --dist loadgroup) -----------------------------------------------------------

def pytest_configure(config) -> None:
    """Before any test: the processes the tests start run this checkout (``installed_package_problem``), or the
    session stops with one line saying what to do. An xdist worker computes with one thread, and so do the processes
    its tests start without saying otherwise: two workers on two cores, instead of four OpenMP threads whose barriers
    wait on a descheduled thread."""
    if not hasattr(config, "workerinput"):
        problem = installed_package_problem()
        if problem:
            raise pytest.UsageError(problem)
    else:
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


def _shared_fixture_module(item) -> str | None:
    """The test's module, if the test uses a fixture of that module scoped wider than a function (a training run
    several tests read): xdist then runs those tests on one worker, so that the fixture is built once."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    module = item.nodeid.split("::")[0]
    for fixturedefs in defs.values():
        if any(d.scope != "function" and d.baseid == module for d in fixturedefs):
            return module
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items) -> None:
    """Under xdist: tests sharing a module-scoped fixture form one group (``--dist loadgroup``), and the ``slow``
    tests (with their groups) are handed out first, so that no minute-long test is left for the end of the run."""
    if not hasattr(config, "workerinput"):
        return
    unit = {}  # test -> its work unit: its module's group, or itself
    slow: dict[str, bool] = {}
    for item in items:
        module = _shared_fixture_module(item)
        if module is not None:
            item.add_marker(pytest.mark.xdist_group(module))
        unit[item.nodeid] = module or item.nodeid
        slow[unit[item.nodeid]] = slow.get(unit[item.nodeid], False) or item.get_closest_marker("slow") is not None
    items.sort(key=lambda it: not slow[unit[it.nodeid]])  # stable: the collection order otherwise


#: the launcher knobs a CPU launcher test must not inherit from the developer's shell (launch/train_wan.sh reads them)
_LAUNCHER_KNOBS = ("NUM_GPUS", "NUM_PROCS", "HOSTFILE", "DS_CONFIG", "MODEL", "STEPS", "SAVE_DIR", "RESUME", "OVERWRITE",
                   "SAVE_INTERVAL", "KEEP_CHECKPOINTS", "SP", "GLOBAL_BATCH")


def launcher_env(**extra) -> dict:
    """The environment of a CPU ``bash launch/train_wan.sh`` in a test: the shell's, less its launcher knobs, with no
    GPU, a free rendezvous port, this checkout on PYTHONPATH and ``extra`` (values as strings)."""
    from ds_adaptive.core.ports import free_port

    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_KNOBS}
    return {**env, "CUDA_VISIBLE_DEVICES": "", "NUM_GPUS": "0", "MASTER_PORT": str(free_port("127.0.0.1")),
            "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "PYTHONUNBUFFERED": "1",
            **{k: str(v) for k, v in extra.items()}}


#: every rank runs through this wrapper (``python _rank_main.py <argv>``): the rank's own exit status, without the
#: interpreter's teardown, where DeepSpeed's CPU communication op could abort a rank whose work had passed
_RANK_MAIN = Path(__file__).resolve().parent / "_rank_main.py"


def _free_port() -> int:
    """A rendezvous port for a test job (``ds_adaptive.core.ports``: below the ephemeral range, where the connections of
    the jobs running alongside take theirs)."""
    from ds_adaptive.core.ports import free_port

    return free_port("127.0.0.1")


def _port_taken(results: list[subprocess.CompletedProcess]) -> bool:
    """A rank failed because another process took the rendezvous port between ``_free_port`` and
    the bind (happens when several test sessions share the machine)."""
    return any(r.returncode != 0 and "address already in use" in r.stdout.lower() for r in results)


def launch_ranks(argv: list[str], world: int, *, cwd: Path, timeout: float = 600,
                 env: dict | None = None, check: bool = True) -> list[subprocess.CompletedProcess]:
    """Run ``python <argv>`` as ``world`` ranks of one gloo job; fail the test (with every rank's
    output) if a rank fails (unless ``check=False``: a job expected to fail, its ranks' exit statuses in the
    results) or the job exceeds ``timeout`` seconds. A job whose rendezvous port was taken by another process
    is started once more on a new port."""
    what = " ".join(a if len(a) < 60 else a[:57] + "..." for a in argv[:4]).replace("\n", " ")
    for attempt in range(2):
        results = _launch_once(argv, world, cwd=cwd, timeout=timeout, env=env, what=what)
        if not (attempt == 0 and _port_taken(results)):
            break
    bad = [i for i, r in enumerate(results) if r.returncode != 0]
    if bad and check:
        outs = "\n".join(f"--- rank {i} (exit {r.returncode}) ---\n{r.stdout[-6000:]}" for i, r in enumerate(results))
        pytest.fail(f"{world}-rank job `{what}` failed on rank(s) {bad}\n{outs}")
    return results


def _launch_once(argv: list[str], world: int, *, cwd: Path, timeout: float, env: dict | None,
                 what: str) -> list[subprocess.CompletedProcess]:
    port = str(_free_port())
    envs = [{**os.environ, **(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            for rank in range(world)]
    zygote = _rank_zygote()
    if zygote is not None and all(zygote.serves(e) for e in envs):
        try:
            return zygote.run(argv, envs, cwd=cwd, timeout=timeout, what=what)
        finally:
            _remove_shm(f"{_SHM_GLOB}_127.0.0.1_{port}_*")
    outdir = Path(tempfile.mkdtemp(prefix="ranks_"))
    procs, logs = [], [outdir / f"rank{rank}.log" for rank in range(world)]
    try:
        for e, log in zip(envs, logs):
            with open(log, "w") as f:
                procs.append(subprocess.Popen([sys.executable, str(_RANK_MAIN), *argv], cwd=cwd, env=e,
                                              stdout=f, stderr=subprocess.STDOUT, text=True))
        ends = _Ends(time.monotonic() + timeout)
        while not ends.over(len([p for p in procs if p.poll() is not None]), len(procs)):
            ends.failed(any(p.returncode not in (None, 0) for p in procs))
            time.sleep(0.1)
        for p in procs:   # left running past the deadline, or after another rank failed
            if p.poll() is None:
                p.kill()
            p.wait()
        outs = [log.read_text(errors="replace") for log in logs]
        if ends.timed_out:
            _fail_timeout(what, timeout, outs)
        return [subprocess.CompletedProcess(p.args, p.returncode, out, "") for p, out in zip(procs, outs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(outdir, ignore_errors=True)
        _remove_shm(f"{_SHM_GLOB}_127.0.0.1_{port}_*")  # this job's ranks have exited (or were killed)


#: seconds the other ranks get to print their own errors after one rank failed; then they are killed. A rank that
#: failed leaves the others waiting in a rendezvous or a collective (its rendezvous port taken, say), and the job
#: would otherwise run to its timeout, with no retry on a new port.
FAILED_RANK_GRACE_S = 15.0


class _Ends:
    """When a job's wait ends: every rank exited, the timeout passed, or ``FAILED_RANK_GRACE_S`` after a rank
    failed (``timed_out`` only for the timeout)."""

    def __init__(self, deadline: float) -> None:
        self.deadline, self.timed_out, self.grace = deadline, False, False

    def failed(self, any_failed: bool) -> None:
        if any_failed and not self.grace:
            self.deadline = min(self.deadline, time.monotonic() + FAILED_RANK_GRACE_S)
            self.grace = True

    def over(self, exited: int, world: int) -> bool:
        if exited == world:
            return True
        if time.monotonic() >= self.deadline:
            self.timed_out = not self.grace
            return True
        return False

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _fail_timeout(what: str, timeout: float, outs: list[str]) -> None:
    text = "\n".join(f"--- rank {i} ---\n{out[-4000:]}" for i, out in enumerate(outs))
    pytest.fail(f"{len(outs)}-rank job `{what}` timed out after {timeout} s\n{text}")


#: environment keys a rank may set differently from the fork server's (read at run time, not at import)
_ZYGOTE_FREE_KEYS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONUNBUFFERED",
                     "TORCH_EXTENSIONS_DIR", "PYTEST_CURRENT_TEST",
                     "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"}   # Inductor's, set when this process compiled


class _RankZygote:
    """The client of tests/_rank_zygote.py (its doc): one per pytest process, started at the first multi-process
    job, ended with the process."""

    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parent / "_rank_zygote.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self._buf = b""
        ready = self._read(time.monotonic() + 300)
        if not ready or not ready.get("ready"):
            raise RuntimeError(f"rank fork server not ready: {ready}")
        self.env, self.added, self.package = ready["env"], ready.get("added_env", {}), ready["ds_adaptive"]
        self._next = 0

    def serves(self, env: dict) -> bool:
        """Whether a rank with exactly ``env`` behaves as a fresh interpreter would when forked from the server:
        the same environment but for run-time keys, and a PYTHONPATH that finds the server's ds_adaptive."""
        keys = set(env) | set(self.env)
        # the same value as the server started with, or the one its imports set (the test process may have made the
        # same imports since, e.g. DeepSpeed's PYTORCH_NVML_BASED_CUDA_CHECK)
        diff = {k for k in keys
                if env.get(k) != self.env.get(k) and not (k in self.added and env.get(k) == self.added[k])}
        diff -= _ZYGOTE_FREE_KEYS | {"PYTHONPATH"}
        first = next((p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p), None)
        if first is not None and Path(first, "ds_adaptive").resolve() != Path(self.package).resolve():
            diff.add("PYTHONPATH")
        if env.get("OMP_NUM_THREADS") != "1":
            diff.add("OMP_NUM_THREADS")
        if diff and os.environ.get("DS_ADAPTIVE_TEST_ZYGOTE_LOG"):   # why a job's ranks start fresh
            with open(os.environ["DS_ADAPTIVE_TEST_ZYGOTE_LOG"], "a") as f:
                f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}: {sorted(diff)}\n")
        return not diff

    def _read(self, deadline: float):
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if select.select([self.proc.stdout], [], [], left)[0]:
                data = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not data:
                    raise RuntimeError("rank fork server ended")
                self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: list[str], envs: list[dict], *, cwd: Path, timeout: float,
            what: str) -> list[subprocess.CompletedProcess]:
        outdir = Path(tempfile.mkdtemp(prefix="ranks_"))
        ids = []
        for rank, env in enumerate(envs):
            self._next += 1
            ids.append(self._next)
            req = {"id": self._next, "argv": [str(a) for a in argv], "env": env, "cwd": str(cwd),
                   "out": str(outdir / f"rank{rank}.log")}
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        pids, codes = {}, {}
        ends = _Ends(time.monotonic() + timeout)
        while not ends.over(len(codes), len(envs)):
            msg = self._read(time.monotonic() + max(0.0, ends.left()))
            if msg is None:
                continue   # the deadline passed: ``over`` ends the wait
            if "pid" in msg:
                pids[msg["id"]] = msg["pid"]
            elif "exit" in msg:
                codes[msg["exit"]] = msg["code"]
                ends.failed(msg["code"] != 0)
        self._kill_left(pids, codes)
        outs = [(outdir / f"rank{rank}.log").read_text(errors="replace") for rank in range(len(envs))]
        shutil.rmtree(outdir, ignore_errors=True)
        if ends.timed_out:
            _fail_timeout(what, timeout, outs)
        return [subprocess.CompletedProcess([sys.executable, str(_RANK_MAIN), *argv], codes.get(pids.get(i), -9),
                                            out, "") for i, out in zip(ids, outs)]

    def _kill_left(self, pids: dict, codes: dict) -> None:
        """Kill the ranks still running (past the deadline, or after another rank failed) and collect their exits."""
        for pid in pids.values():
            if pid not in codes:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        while len(codes) < len(pids):
            msg = self._read(time.monotonic() + 30)
            if msg is None:
                break
            if "exit" in msg:
                codes[msg["exit"]] = msg["code"]


_ZYGOTE: list = []   # [server or None], once per process
_ZYGOTE_WHY: list[str] = []   # why it could not start (tests/integration/test_rank_launch.py fails on it)


def _rank_zygote():
    """The process's rank fork server, or None: DS_ADAPTIVE_TEST_FRESH_RANKS=1, or it could not start."""
    if os.environ.get("DS_ADAPTIVE_TEST_FRESH_RANKS") == "1":
        return None
    if not _ZYGOTE:
        try:
            _ZYGOTE.append(_RankZygote())
        except Exception as exc:  # noqa: BLE001 - fresh interpreters then, as before
            print(f"conftest: rank fork server unavailable ({exc}); starting ranks as fresh interpreters",
                  file=sys.stderr)
            _ZYGOTE.append(None)
            _ZYGOTE_WHY.append(str(exc))
    return _ZYGOTE[0]


def launch_script(text: str, world: int, tmp_path: Path, *, name: str = "ranks.py", timeout: float = 240) -> str:
    """Write ``text`` to ``tmp_path/name``, run it as ``world`` gloo ranks against this checkout
    (PYTHONPATH = the repository root) and return rank 0's output."""
    script = tmp_path / name
    script.write_text(text)
    return launch_ranks([str(script)], world, cwd=tmp_path, timeout=timeout, env={"PYTHONPATH": str(ROOT)})[0].stdout


@pytest.fixture
def run_ranks():
    """``run_ranks(argv, world, cwd=..., timeout=...)``: ``launch_ranks`` as a fixture."""
    return launch_ranks


@pytest.fixture
def cpu_config() -> Path:
    return CONFIGS / "cpu_tiny.json"
