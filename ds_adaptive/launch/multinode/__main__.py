"""``python -m ds_adaptive.launch.multinode env | launch ...``: the command line of ``ds_adaptive.launch.multinode``."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from ds_adaptive.launch.multinode.launcher import DEFAULT_NODE_TIMEOUT, NodeLauncher
from ds_adaptive.launch.multinode.rendezvous import RendezvousError, rendezvous_from_env


def _launch(argv: list[str]) -> int:
    if "--" not in argv:
        print("multinode launch: give the training script after '--'", file=sys.stderr)
        return 2
    i = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m ds_adaptive.launch.multinode launch",
                                 usage="%(prog)s --nnodes N --node-rank R --nproc-per-node P --master-addr A "
                                       "--master-port PORT [--node-timeout S] -- SCRIPT [ARGS ...]")
    ap.add_argument("--nnodes", type=int, required=True, help="nodes of the job")
    ap.add_argument("--node-rank", type=int, required=True, help="this node's index, 0..nnodes-1")
    ap.add_argument("--nproc-per-node", type=int, required=True, help="ranks on each node (GPUs)")
    ap.add_argument("--master-addr", required=True, help="node 0's address, reachable from every node")
    ap.add_argument("--master-port", type=int, required=True, help="node 0's rendezvous port (its launcher's store)")
    ap.add_argument("--node-timeout", type=float, default=float(os.environ.get("NODE_TIMEOUT") or DEFAULT_NODE_TIMEOUT),
                    help="seconds without a heartbeat before a node counts as lost (default: $NODE_TIMEOUT, else "
                         f"{DEFAULT_NODE_TIMEOUT:g})")
    ap.add_argument("--connect-timeout", type=float, default=900.0,
                    help="seconds a node waits for node 0's store at start-up (default 900)")
    args = ap.parse_args(argv[:i])
    script = argv[i + 1:]
    if not script:
        ap.error("no training script after '--'")
    problems = [msg for ok, msg in (
        (args.nnodes >= 1, f"--nnodes must be >= 1, got {args.nnodes}"),
        (0 <= args.node_rank < args.nnodes, f"--node-rank must be 0..{args.nnodes - 1}, got {args.node_rank}"),
        (args.nproc_per_node >= 1, f"--nproc-per-node must be >= 1, got {args.nproc_per_node}"),
        (1 <= args.master_port <= 65535, f"--master-port must be a TCP port, got {args.master_port}"),
        (args.node_timeout > 0, f"--node-timeout must be > 0, got {args.node_timeout}")) if not ok]
    if problems:
        ap.error(problems[0])
    launcher = NodeLauncher(script, nnodes=args.nnodes, node_rank=args.node_rank, nproc=args.nproc_per_node,
                            master_addr=args.master_addr, master_port=args.master_port,
                            node_timeout=args.node_timeout, connect_timeout=args.connect_timeout)
    try:
        return launcher.run()
    except RendezvousError as exc:
        launcher.log(f"error: {exc}")
        return 1


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["env"]:
        try:
            rdzv = rendezvous_from_env()
        except RendezvousError as exc:
            print(f"train_wan.sh: {exc}", file=sys.stderr)
            return 2
        print(rdzv.shell(), end="")
        if rdzv.mode != "deepspeed":
            print(f"train_wan.sh: {rdzv.scheduler}: {rdzv.describe()}", file=sys.stderr)
        return 0
    if argv[:1] == ["launch"]:
        return _launch(argv[1:])
    print("usage: python -m ds_adaptive.launch.multinode env | launch ... -- SCRIPT [ARGS]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
