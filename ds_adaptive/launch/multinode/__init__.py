"""Multi-node runs without ssh: the rendezvous from SLURM's or Kubernetes' variables, a per-node launcher, a node watchdog.

    python -m ds_adaptive.launch.multinode env        # shell assignments for launch/train_wan.sh (see below)
    python -m ds_adaptive.launch.multinode launch --nnodes 2 --node-rank 1 --nproc-per-node 8 \\
        --master-addr node-001 --master-port 29500 [--node-timeout 60] -- launch/train_wan.py [trainer args]

Three ways a multi-node job starts (docs/MULTINODE.md):

* ``deepspeed --hostfile`` over ssh/pdsh (DeepSpeed's runner; not this module);
* one launcher per node, started by the cluster (Kubernetes PyTorchJob / JobSet, or by hand):
  ``NNODES``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (or the operators' ``PET_NNODES``,
  ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, ``JOB_COMPLETION_INDEX``);
* SLURM: ``srun`` starts one task per node (this launcher) or one per GPU (each task is a rank);
  the rendezvous comes from ``SLURM_STEP_NODELIST`` (its first host), ``SLURM_NODEID``,
  ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS`` and ``SLURM_JOB_ID`` (a port derived from it).

:func:`rendezvous_from_env` turns the variables into a :class:`Rendezvous` (one clear error naming
the variable otherwise); ``env`` prints it for the shell launcher.

The per-node launcher (:class:`NodeLauncher`) starts this node's ranks the way DeepSpeed's per-node
launcher does (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE``, ``CROSS_RANK``, ...), but:

* it never kills the ranks on a stop signal: ``launch/train_wan.sh`` runs it under
  ``ds_adaptive/launch/supervise.py``, which forwards SIGTERM / SIGINT / SIGHUP / SIGUSR1 to the ranks;
  the ranks agree on the step to stop after (an all_reduce over every node), save, exit 75;
* node 0's launcher hosts the job's TCP store on ``MASTER_PORT`` (the ranks use it as clients,
  torchrun's ``TORCHELASTIC_USE_AGENT_STORE``), so the store outlives any rank;
* through that store the launchers watch each other (:class:`NodeWatchdog`): a rank that dies, a
  node whose launcher stops beating (``--node-timeout`` s), or a lost node 0 ends every node's
  ranks within seconds, or ``--node-timeout`` s for a silent node, with one message naming the node
  (index and host) and the rank. NCCL / gloo would otherwise wait for their own timeouts (30 min).

Exit status of ``launch``: the ranks' (0, or 75 after a stop); a failed rank's status (128+N for
signal N) on its node, :data:`EXIT_PEER_FAILED` on the others; 2 for bad arguments.

Modules: ``rendezvous`` (the variables -> :class:`Rendezvous`), ``launcher`` (:class:`NodeLauncher`,
:class:`NodeWatchdog`), ``__main__`` (the command line). Standard library only at import (torch's
``TCPStore`` is imported when a launcher starts).
"""
from ds_adaptive.launch.multinode.launcher import DEFAULT_NODE_TIMEOUT, EXIT_PEER_FAILED, NodeLauncher, NodeWatchdog
from ds_adaptive.launch.multinode.rendezvous import (ENV_REPEAT_SIGNAL, SLURM_PORT_BASE, SLURM_PORT_SPAN, Rendezvous, RendezvousError,
                         expand_hostlist, rendezvous_from_env, slurm_hostnames, slurm_port, tasks_on_node)

__all__ = ["Rendezvous", "RendezvousError", "expand_hostlist", "slurm_hostnames", "tasks_on_node", "slurm_port",
           "rendezvous_from_env", "NodeLauncher", "NodeWatchdog", "EXIT_PEER_FAILED", "DEFAULT_NODE_TIMEOUT",
           "ENV_REPEAT_SIGNAL", "SLURM_PORT_BASE", "SLURM_PORT_SPAN"]
