"""The per-node launcher of a multi-node job without ssh, and the node watchdog (see ``ds_adaptive.launch.multinode``).

    NodeLauncher(script, nnodes=2, node_rank=1, nproc=8, master_addr="node-001", master_port=29500).run()

Standard library at import; torch's ``TCPStore`` when a launcher starts.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping, Optional

from ds_adaptive.launch.multinode.rendezvous import RendezvousError

__all__ = ["NodeLauncher", "NodeWatchdog", "EXIT_PEER_FAILED", "DEFAULT_NODE_TIMEOUT", "STOP_SIGNALS"]

EXIT_PEER_FAILED = 3
"""Exit status of a node whose ranks were stopped because another node's rank failed or a node was lost: the
exit-status table's 3 (``ds_adaptive.training.preempt.EXIT_PEER_LOST``, "stopped because another rank was gone"), as for a
rank on one node (a literal: the launcher imports no torch)."""
DEFAULT_NODE_TIMEOUT = 60.0
"""Seconds without a heartbeat after which a node counts as lost (``NODE_TIMEOUT``)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
_STOPPED = 75  # ds_adaptive.training.preempt.EXIT_PREEMPTED (not imported: that module needs torch)
_NORMAL = (0, _STOPPED)
_KEY = "ds_adaptive/watchdog"      # store keys of the launchers (the ranks' own keys have other prefixes)


# --- the node watchdog -----------------------------------------------------------------------

def _key(*parts) -> str:
    return "/".join((_KEY, *map(str, parts)))


def _ranks_of(node: int, nproc: int) -> str:
    first = node * nproc
    return f"rank {first}" if nproc == 1 else f"ranks {first}-{first + nproc - 1}"


class NodeWatchdog:
    """Heartbeats of the node launchers through the job's TCP store, in a thread of each launcher (a
    store call never blocks the launcher's own loop).

    Every launcher increments ``hb/<node>`` each ``interval`` s and reads every node's counter and
    ``done/<node>`` (0 while it runs, its exit status + 1 once its ranks ended) in one ``multi_get``, and
    the job's ``abort`` message: three requests per node and beat. A node whose counter stops moving
    for ``timeout`` s (after it moved once: nodes start at different times) and that is not done is
    lost: published as ``abort``, first writer wins. A launcher that cannot reach the store (a closed
    connection: node 0's launcher, which holds it, is gone) or gets no answer for ``timeout`` s has
    lost node 0."""

    def __init__(self, store, *, node: int, nnodes: int, nproc: int, master: str, timeout: float,
                 interval: float = 1.0) -> None:
        self.store = store.clone()  # its own connection: the launcher's thread uses the original
        self.node, self.nnodes, self.nproc, self.master = node, nnodes, nproc, master
        self.timeout, self.interval = timeout, interval
        self.last_ok = time.monotonic()
        self.error: Optional[str] = None
        self.remote_abort: Optional[str] = None
        self.hosts: dict[int, str] = {}
        self._seen: dict[int, tuple[int, float]] = {}
        self._done: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds_adaptive-node-watchdog", daemon=True)

    def start(self) -> "NodeWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def name(self, node: int) -> str:
        """'node K (host, ranks a-b)'."""
        return f"node {node} ({self.hosts.get(node, '?')}, {_ranks_of(node, self.nproc)})"

    def _run(self) -> None:
        try:
            for k in range(self.nnodes):  # every key exists before the first multi_get (which would wait)
                self.store.add(_key("hb", k), 0)
                self.store.add(_key("done", k), 0)
        except Exception as exc:  # noqa: BLE001 - see below
            self.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        while not self._stop.is_set():
            try:
                self.store.add(_key("hb", self.node), 1)
                self._check_peers()
                if self.store.check([_key("abort")]):
                    self.remote_abort = self.store.get(_key("abort")).decode()
                self.last_ok = time.monotonic()
                self.error = None
            except Exception as exc:  # noqa: BLE001 - a closed or refused connection: node 0 is gone
                self.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self._stop.wait(self.interval)

    def _check_peers(self) -> None:
        now = time.monotonic()
        n = self.nnodes
        values = [int(v) for v in self.store.multi_get([_key("hb", k) for k in range(n)] +
                                                       [_key("done", k) for k in range(n)])]
        for k in range(n):
            beats, done = values[k], values[n + k]
            if k == self.node or k in self._done:
                continue
            if done:
                self._done.add(k)
                continue
            if beats and k not in self.hosts and self.store.check([_key("host", k)]):
                self.hosts[k] = self.store.get(_key("host", k)).decode()
            last = self._seen.get(k)
            if last is None or beats != last[0]:
                self._seen[k] = (beats, now)
            elif beats > 0 and now - last[1] > self.timeout:
                self.store.compare_set(_key("abort"), "", f"{self.name(k)} stopped responding: no heartbeat from "
                                       f"its launcher for {now - last[1]:.0f} s (node timeout {self.timeout:g} s); "
                                       "the node died or is cut off")

    def silent_nodes(self, seconds: float) -> list[int]:
        """Nodes not done whose heartbeat has not moved for ``seconds`` (after it moved once)."""
        now = time.monotonic()
        return [k for k, (beats, t) in sorted(self._seen.items())
                if k not in self._done and beats > 0 and now - t > seconds]

    def abort_message(self) -> Optional[str]:
        """Why the job must end: another launcher's message, or node 0 lost (None while all is well)."""
        if self.remote_abort:
            return self.remote_abort
        lost = time.monotonic() - self.last_ok
        if self.node != 0 and (self.error and lost > min(5.0, self.timeout) or lost > self.timeout):
            why = self.error or f"no answer for {lost:.0f} s"
            return (f"lost node 0 ({self.master}, {_ranks_of(0, self.nproc)}; its launcher holds the job's "
                    f"rendezvous store): {why}")
        return None


# --- the per-node launcher -------------------------------------------------------------------

def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


class NodeLauncher:
    """Starts ``nproc`` ranks of ``script`` on node ``node_rank`` of ``nnodes`` and watches them and the
    other nodes (see the module doc). :meth:`run` returns the node's exit status."""

    FAILURE_GRACE = 3.0
    """Seconds a rank's non-zero exit waits before this node reports it: a root cause elsewhere (a rank
    killed by a signal, a lost node) is reported instead of the collective errors it caused here."""
    KILL_GRACE = 3.0
    """Seconds the ranks get to end on their own once the job is aborted, before SIGKILL."""

    def __init__(self, script: list[str], *, nnodes: int, node_rank: int, nproc: int, master_addr: str,
                 master_port: int, node_timeout: float = DEFAULT_NODE_TIMEOUT, connect_timeout: float = 900.0,
                 python: str = sys.executable, log: Optional[Callable[[str], None]] = None) -> None:
        self.script, self.python = script, python
        self.nnodes, self.node, self.nproc = nnodes, node_rank, nproc
        self.master_addr, self.master_port = master_addr, master_port
        self.node_timeout, self.connect_timeout = node_timeout, connect_timeout
        self.log = log or (lambda msg: print(f"ds_adaptive node {node_rank}: {msg}", file=sys.stderr, flush=True))
        self.procs: list[subprocess.Popen] = []
        self.signals: list[int] = []
        self.host = socket.gethostname()
        self.store = None

    def rank_env(self, local_rank: int, base: Mapping[str, str]) -> dict:
        """What DeepSpeed's per-node launcher sets (plus torchrun's names), and the agent-store switch:
        every rank, rank 0 too, is a client of node 0's launcher's store."""
        env = dict(base)
        env.update(RANK=str(self.node * self.nproc + local_rank), LOCAL_RANK=str(local_rank),
                   WORLD_SIZE=str(self.nnodes * self.nproc), LOCAL_SIZE=str(self.nproc),
                   LOCAL_WORLD_SIZE=str(self.nproc), CROSS_RANK=str(self.node), CROSS_SIZE=str(self.nnodes),
                   GROUP_RANK=str(self.node), NODE_RANK=str(self.node), NNODES=str(self.nnodes),
                   MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port),
                   TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
        return env

    def _connect(self):
        """Node 0 opens the store on MASTER_PORT, the others connect to it (waiting for node 0 to start)."""
        from datetime import timedelta

        from torch.distributed import TCPStore

        timeout = timedelta(seconds=self.connect_timeout)
        try:
            if self.node == 0:
                return TCPStore(self.master_addr, self.master_port, is_master=True, wait_for_workers=False,
                                timeout=timeout)
            return TCPStore(self.master_addr, self.master_port, is_master=False, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - torch raises DistNetworkError / DistStoreError / RuntimeError
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if self.node == 0:
                raise RendezvousError(f"cannot open the job's rendezvous store on port {self.master_port} of this "
                                      f"node ({first}): is the port taken (another job)? Pick another MASTER_PORT "
                                      "on every node") from None
            raise RendezvousError(f"cannot reach node 0's rendezvous store at {self.master_addr}:{self.master_port} "
                                  f"within {self.connect_timeout:g} s ({first}): is node 0 running, MASTER_ADDR "
                                  "reachable from this node and the port open?") from None

    def _on_signal(self, signum, _frame) -> None:
        self.signals.append(signum)

    def _handle_signals(self, handled: int) -> int:
        """Under ds_adaptive/launch/supervise.py (train_wan.sh) the supervisor forwards stop signals to the ranks
        itself and this launcher only outlives them; alone, it forwards the first one to its ranks."""
        under_supervisor = bool(os.environ.get("DS_ADAPTIVE_SUPERVISOR_PID"))
        while handled < len(self.signals):
            signum = self.signals[handled]
            handled += 1
            if under_supervisor or handled > 1:
                continue
            for p in self.procs:
                if p.poll() is None:
                    p.send_signal(signum)
            self.log(f"{signal.Signals(signum).name}: forwarded to this node's ranks; they stop after the step "
                     "every rank agrees on")
        return handled

    def run(self) -> int:
        base_env = dict(os.environ)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # a closed store connection is our message, not c10d's
        self.store = self._connect()  # a stop signal meanwhile ends this process (default action): nothing to save
        self.store.set(_key("host", self.node), self.host)
        dog = NodeWatchdog(self.store, node=self.node, nnodes=self.nnodes, nproc=self.nproc,
                           master=f"{self.master_addr}:{self.master_port}", timeout=self.node_timeout).start()
        for s in STOP_SIGNALS:
            signal.signal(s, self._on_signal)
        for local in range(self.nproc):
            self.procs.append(subprocess.Popen([self.python, "-u", *self.script], env=self.rank_env(local, base_env)))
        self.log(f"{self.host}: started {_ranks_of(self.node, self.nproc)} of {self.nnodes * self.nproc} (pids "
                 f"{', '.join(str(p.pid) for p in self.procs)}); rendezvous {self.master_addr}:{self.master_port}")
        try:
            aborted, own_status = self._watch(dog)
        finally:
            self._kill_ranks()
        codes = [p.returncode for p in self.procs]
        if aborted:  # the failed rank's status on its node, EXIT_PEER_FAILED on the others
            code = own_status if own_status is not None else EXIT_PEER_FAILED
        else:
            code = _STOPPED if _STOPPED in codes else 0
        self._mark_done(code)
        if self.node == 0:
            missing = self._wait_for_peers(min(10.0, self.node_timeout) if aborted else self.node_timeout,
                                           skip=dog.silent_nodes(2.5 * dog.interval))
            if missing and not aborted:
                self.log(f"node(s) {', '.join(map(str, missing))} did not report their end within "
                         f"{self.node_timeout:g} s")
        dog.stop()
        return code

    def _watch(self, dog: NodeWatchdog) -> tuple[Optional[str], Optional[int]]:
        """Until every local rank has exited. Returns the message that ended the job (None: a normal end)
        and, when a rank of this node was its cause, that rank's exit status."""
        handled, failed_at, own_status = 0, None, None
        while True:
            handled = self._handle_signals(handled)
            codes = [p.poll() for p in self.procs]
            bad = [(i, c) for i, c in enumerate(codes) if c is not None and c not in _NORMAL]
            aborted = dog.abort_message()
            if aborted:
                break
            if bad:
                failed_at = failed_at or time.monotonic()
                i, c = min(bad, key=lambda ic: (ic[1] >= 0, ic[0]))  # a signal death first: the likely root cause
                if c < 0 or time.monotonic() - failed_at > self.FAILURE_GRACE:
                    mine = self._rank_failure(dog, i, c)
                    aborted = self._publish(dog, mine)
                    own_status = _status(c) if aborted == mine else None
                    break
            elif all(c is not None for c in codes):
                return None, None
            time.sleep(0.2)
        alive = [i for i, p in enumerate(self.procs) if p.poll() is None]
        ranks = [self.node * self.nproc + i for i in alive]
        self.log(f"{aborted}; ending the job" + (f": stopping this node's rank(s) {', '.join(map(str, ranks))}"
                                                 if ranks else ""))
        deadline = time.monotonic() + self.KILL_GRACE
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.1)
        return aborted, own_status

    def _rank_failure(self, dog: NodeWatchdog, local: int, code: int) -> str:
        msg = (f"node {self.node} ({self.host}) rank {self.node * self.nproc + local} (local rank {local}, pid "
               f"{self.procs[local].pid}) {_describe_exit(code)}")
        silent = dog.silent_nodes(2.5 * dog.interval) if code > 0 else []
        if silent:  # its collectives broke because a node vanished: name that node first
            return (f"{', '.join(dog.name(k) for k in silent)} stopped responding (no heartbeat for "
                    f"{2.5 * dog.interval:g}+ s) and {msg}")
        return msg

    def _publish(self, dog: NodeWatchdog, message: str) -> str:
        """The job's abort message: ours, unless another launcher's came first."""
        if dog.error is not None:
            return message
        try:
            return self.store.compare_set(_key("abort"), "", message).decode()
        except Exception:  # noqa: BLE001 - the store is gone
            return message

    def _mark_done(self, code: int) -> None:
        try:
            self.store.add(_key("done", self.node), code + 1)
        except Exception:  # noqa: BLE001 - node 0 is gone; nobody waits for this node
            pass

    def _wait_for_peers(self, timeout: float, skip: list[int]) -> list[int]:
        """Node 0 holds the store until every node (but the silent ones in ``skip``) said it is done, or
        ``timeout`` s; returns those that did not."""
        deadline = time.monotonic() + timeout
        missing = [k for k in range(1, self.nnodes) if k not in skip]
        while missing and time.monotonic() < deadline:
            missing = [k for k in missing if not self.store.add(_key("done", k), 0)]
            if missing:
                time.sleep(0.2)
        return missing

    def _kill_ranks(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
