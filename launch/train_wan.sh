#!/usr/bin/env bash
# Train Wan 2.1 with DeepSpeed + AdaptiveLoad. With no argument it runs the embedded default on
# this machine:
#   - GPUs:   every local GPU, Wan 2.1 1.3B shape, ZeRO-3, bf16, synthetic mixed image+video
#             latents (launch/configs/zero3_adaptive.json), 50 steps;
#   - no GPU: 2 CPU processes (gloo), the tiny model, fp32, 20 steps, a small-resolution shape
#             mix (launch/configs/cpu_tiny.json): a few minutes on 2 cores.
#
#   bash launch/train_wan.sh [extra trainer args ...]    e.g. --save ckpt --save-interval 50
#
# Environment knobs:
#   NUM_GPUS    GPUs per node (default: all visible GPUs; 0 = the CPU run)
#   NUM_PROCS   processes of the CPU run (default 2)
#   HOSTFILE    DeepSpeed hostfile for multi-node runs over ssh (see launch/hostfile.example);
#               MASTER_ADDR / MASTER_PORT pick the rendezvous (default: the first host, 29500)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT
#               multi-node without ssh: run this script once on every node (Kubernetes, by hand) with
#               the node count, this node's index 0..NNODES-1 and node 0's address and port (default
#               29500); Kubeflow's PET_NNODES / PET_NODE_RANK / PET_MASTER_ADDR / PET_MASTER_PORT and an
#               Indexed Job's JOB_COMPLETION_INDEX are read too. Under SLURM (srun, one task per node or
#               one per GPU; launch/slurm/train_wan.sbatch) they come from SLURM's variables.
#   LAUNCH_MODE auto (default) | deepspeed | node | slurm: force how the job starts
#   NODE_TIMEOUT  seconds without a heartbeat from a node before every node stops (default 60)
#   DS_CONFIG   ds_config json (default: zero3_adaptive.json on GPU, zero3_adaptive_14b.json for
#               MODEL=wan2.1-14b, zero3_adaptive_ti2v5b.json for MODEL=wan2.2-ti2v-5b, cpu_tiny.json on CPU)
#   MODEL       a registered model (`ds-adaptive train --help`): tiny | wan2.1-1.3b | wan2.1-14b |
#               wan2.2-ti2v-5b | wan2.2-t2v-a14b-high | wan2.2-t2v-a14b-low | tiny-ti2v | ... (default:
#               wan2.1-1.3b on GPU, tiny on CPU); the A14B experts train one per run, on their noise range
#   STEPS       optimizer steps (default: 50 on GPU, 20 on CPU)
#   SP          Ulysses sequence-parallel degree (default: the ds_config's sequence_parallel_size, else 1)
#   GLOBAL_BATCH samples per optimizer step over all data-parallel ranks (overrides the ds_config's
#               adaptive_load.sampler.global_batch; set it for your cluster size, and the LR with it)
#   GRAD_CKPT   activation checkpointing: auto (per micro-batch the fewest blocks that fit the memory
#               budget), 1/all (every block), 0/none; default: the config's recompute.blocks (auto)
#   PYTORCH_CUDA_ALLOC_CONF  default expandable_segments:True (changing micro-batch shapes fragment
#               the caching allocator); a value you set is kept
#   PYTHON      python interpreter (default: python)
#   DRY_RUN=1   check the launch (config, topology, every trainer argument, the data's shapes) without GPUs,
#               print the command and exit (0: it can launch, 2: the problems it names)
#   STOP_TIMEOUT  seconds a run may take to stop after SIGTERM/SIGINT before it is killed
#               (default 0: wait; a second signal kills at once)
#   SAVE_DIR    checkpoint directory (default: a fresh checkpoints/$MODEL/run-<date>-<time> per launch, and with
#               RESUME=1 the newest of those; per-node launches: checkpoints/$MODEL; empty = no checkpoints)
#   SAVE_INTERVAL  steps between checkpoints (default: 100 on GPU, 10 on CPU)
#   KEEP_CHECKPOINTS  complete checkpoints of this run kept in SAVE_DIR, older ones deleted (default 2; 0 = all;
#               the newest one saved after only finite steps is always kept)
#   RESUME=1    continue from the newest complete checkpoint in SAVE_DIR, if there is one (default 1
#               under SLURM: a requeued job resumes); multi-node: SAVE_DIR on a filesystem every node sees
#   OVERWRITE=1 start a new run in a SAVE_DIR that holds an earlier run's checkpoints (they are deleted);
#               without RESUME=1 or OVERWRITE=1 that is an error naming them; RESUME=1 OVERWRITE=1 is an error
#   DS_ADAPTIVE_WATCHDOG_S  seconds without a heartbeat from a rank before the job is stopped (default 120;
#               0 = off; exit 124). Exit codes and what to do: docs/RELIABILITY.md
#
# Signals: SIGTERM/SIGINT/SIGHUP/SIGUSR1 to this script reach every rank (not only DeepSpeed's launcher);
# multi-node without ssh: a signal to any one node's launcher stops every node after the same step;
# the ranks finish the current step, save a checkpoint into SAVE_DIR and exit 75 (EX_TEMPFAIL:
# resume with RESUME=1). SIGKILL of it kills the whole run (no orphan ranks). A rank killed by
# signal N stops the others and the run exits 128+N with one line saying how to resume. See
# ds_adaptive/launch/supervise.py and ds_adaptive/training/preempt.py; exit codes in docs/LAUNCH.md.
# Extra arguments go to the trainer (ds-adaptive train --help lists them); an unknown one is an error.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python}"

# --- multi-node without ssh (ds_adaptive/launch/multinode/) -------------------------------------------
# LAUNCH_MODE=deepspeed: single node or HOSTFILE (DeepSpeed's launcher); node: this script is this node's
# launcher (NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT, Kubernetes' or SLURM's variables); task: SLURM
# started one task per GPU and this one is a rank (RANK / LOCAL_RANK / WORLD_SIZE from SLURM_*).
MULTINODE=(env "PYTHONPATH=$HERE/..${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m ds_adaptive.launch.multinode)
RDZV="$("${MULTINODE[@]}" env)" || exit 2
eval "$RDZV"

# The command that resumes this run, for the message after a rank dies: the knobs you set, RESUME=1, the args.
RESUME_HINT="RESUME=1"
for knob in NUM_GPUS NUM_PROCS HOSTFILE MASTER_ADDR MASTER_PORT DS_CONFIG MODEL STEPS SP GLOBAL_BATCH GRAD_CKPT SAVE_DIR \
            SAVE_INTERVAL KEEP_CHECKPOINTS PYTHON STOP_TIMEOUT; do
  [[ -n "${!knob+x}" ]] && RESUME_HINT+=" $knob=$(printf '%q' "${!knob}")"
done
RESUME_HINT+=" bash $(printf '%q' "${BASH_SOURCE[0]}")"
for arg in "$@"; do [[ "$arg" != --overwrite ]] && RESUME_HINT+=" $(printf '%q' "$arg")"; done
export DS_ADAPTIVE_RESUME_HINT="$RESUME_HINT"

if [[ -z "${NUM_GPUS:-}" && -n "${HOSTFILE:-}" ]]; then
  NUM_GPUS=1  # the hostfile's slots say how many GPUs each node has (this node may have none: a login node)
  GPUS_GIVEN=0
elif [[ -z "${NUM_GPUS:-}" ]]; then
  if compgen -G "/dev/nvidia[0-9]*" > /dev/null || [[ -e /dev/kfd || -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    NUM_GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
  else
    NUM_GPUS=0  # no GPU device node (NVIDIA or ROCm): a CPU machine, without a second of importing torch to say so
  fi
  GPUS_GIVEN=0
else
  GPUS_GIVEN=1
fi
if ! [[ "$NUM_GPUS" =~ ^[0-9]+$ ]]; then
  echo "train_wan.sh: NUM_GPUS must be a number of GPUs per node, got '$NUM_GPUS'" >&2
  exit 2
fi

if [[ "$GPUS_GIVEN" == 1 && "$NUM_GPUS" != 0 && "${DRY_RUN:-0}" != 1 && -z "${HOSTFILE:-}" \
      && "$LAUNCH_MODE" == deepspeed ]]; then  # a GPU launch on this machine: it must have the GPUs
  HAVE="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
  if (( HAVE < NUM_GPUS )); then
    echo "train_wan.sh: NUM_GPUS=$NUM_GPUS but this machine has $HAVE GPU(s): unset NUM_GPUS (or NUM_GPUS=0) for" \
         "the CPU run, or check a GPU launch from here with DRY_RUN=1" >&2
    exit 2
  fi
fi

LAUNCH=(deepspeed)
if [[ "$NUM_GPUS" == 0 ]]; then
  # CPU run: gloo, fp32; one thread per process so that 2 processes share 2 cores fairly.
  NPROC="${NUM_PROCS:-2}"
  if ! [[ "$NPROC" =~ ^[0-9]+$ ]] || (( NPROC < 1 )); then
    echo "train_wan.sh: NUM_PROCS must be a number of CPU processes >= 1, got '$NPROC'; e.g. NUM_PROCS=2" >&2
    exit 2
  fi
  DS_CONFIG="${DS_CONFIG:-$HERE/configs/cpu_tiny.json}"
  MODEL="${MODEL:-tiny}"
  STEPS="${STEPS:-20}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"  # DeepSpeed's own "no GPU detected" warning says nothing new here
  LAUNCH+=(--num_gpus "$NPROC")
  WHERE="$NPROC CPU process(es)"
else
  MODEL="${MODEL:-wan2.1-1.3b}"
  case "$MODEL" in  # the 14B config plans with the 14B calibration
    wan2.1-14b) DS_CONFIG="${DS_CONFIG:-$HERE/configs/zero3_adaptive_14b.json}" ;;
    wan2.2-ti2v-5b) DS_CONFIG="${DS_CONFIG:-$HERE/configs/zero3_adaptive_ti2v5b.json}" ;;
    *) DS_CONFIG="${DS_CONFIG:-$HERE/configs/zero3_adaptive.json}" ;;
  esac
  STEPS="${STEPS:-50}"
  if [[ -n "${HOSTFILE:-}" ]]; then
    if [[ ! -f "$HOSTFILE" ]]; then
      echo "train_wan.sh: HOSTFILE=$HOSTFILE does not exist (see launch/hostfile.example)" >&2
      exit 2
    fi
    LAUNCH+=(--hostfile "$HOSTFILE")
    [[ "$GPUS_GIVEN" == 1 ]] && LAUNCH+=(--num_gpus "$NUM_GPUS")
    [[ -n "${MASTER_ADDR:-}" ]] && LAUNCH+=(--master_addr "$MASTER_ADDR")
    WHERE="the hosts of $HOSTFILE"
  else
    LAUNCH+=(--num_gpus "$NUM_GPUS")
    WHERE="$NUM_GPUS GPU(s)"
  fi
fi
[[ -n "${MASTER_PORT:-}" && "$LAUNCH_MODE" == deepspeed ]] && LAUNCH+=(--master_port "$MASTER_PORT")
if [[ "$LAUNCH_MODE" != deepspeed ]]; then  # multi-node without ssh: our per-node launcher, or this task is a rank
  if [[ -n "${HOSTFILE:-}" ]]; then
    echo "train_wan.sh: HOSTFILE is for DeepSpeed's ssh launch from one node; with NNODES/NODE_RANK (or under" \
         "SLURM) every node runs this script itself: unset HOSTFILE, or the per-node variables" >&2
    exit 2
  fi
  PER_NODE="${NPROC:-$NUM_GPUS}"
  if [[ "$LAUNCH_MODE" == task ]]; then
    LAUNCH=("$PY" -u)
    PER_NODE="$LOCAL_SIZE"
    WHERE="rank $RANK of $WORLD_SIZE (SLURM task $SLURM_PROCID, node $NODE_RANK of $NNODES)"
  else
    LAUNCH=("${MULTINODE[@]}" launch --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$PER_NODE"
            --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --)
    WHERE="node $NODE_RANK of $NNODES ($(hostname)), $PER_NODE rank(s) per node, rendezvous $MASTER_ADDR:$MASTER_PORT"
  fi
  # a requeued SLURM job continues from its newest checkpoint (unless checkpoints are off: SAVE_DIR=)
  [[ "${DS_ADAPTIVE_SCHEDULER:-}" == slurm && "${SAVE_DIR-default}" != "" ]] && RESUME="${RESUME:-1}"
fi

if [[ ! -f "$DS_CONFIG" ]]; then
  echo "train_wan.sh: DS_CONFIG=$DS_CONFIG does not exist; pick one of $HERE/configs/*.json" >&2
  exit 2
fi

# --sp only when SP is set: otherwise the trainer takes the ds_config's sequence_parallel_size (else 1)
TRAINER=(--deepspeed_config "$DS_CONFIG" --model "$MODEL" --steps "$STEPS")
[[ -n "${SP:-}" ]] && TRAINER+=(--sp "$SP")
[[ -n "${GLOBAL_BATCH:-}" ]] && TRAINER+=(--global-batch "$GLOBAL_BATCH")
case "${GRAD_CKPT:-}" in
  "") CKPT="" ;;
  1|all) CKPT=all ;;
  0|none) CKPT=none ;;
  auto) CKPT=auto ;;
  *) echo "train_wan.sh: GRAD_CKPT must be auto, all (1) or none (0), got '$GRAD_CKPT'" >&2; exit 2 ;;
esac
[[ -n "$CKPT" ]] && TRAINER+=(--grad-ckpt "$CKPT")
if [[ "$NUM_GPUS" == 0 ]]; then
  :  # the CUDA allocator's setting means nothing to the CPU run
elif [[ -z "${PYTORCH_CUDA_ALLOC_CONF+x}" ]]; then
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  echo "train_wan.sh: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (fragmentation-safe; set it to override)"
else
  echo "train_wan.sh: PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF (yours, kept)"
fi
# Periodic checkpoints are on by default: a preempted or killed run loses at most SAVE_INTERVAL steps.
# Without SAVE_DIR a launch from one node saves into a fresh run directory, checkpoints/$MODEL/run-<date>-<time>
# (so the command can be run again and again), and RESUME=1 continues the newest of them that has a checkpoint.
# A per-node launch (NNODES / SLURM) keeps checkpoints/$MODEL: every node must name the same directory.
if [[ -z "${SAVE_DIR+x}" && "$LAUNCH_MODE" == deepspeed ]]; then
  RUNS="checkpoints/$MODEL"
  # the newest run directory with a complete checkpoint (its completeness marker): partial saves do not count
  LAST="$(ls -d "$RUNS"/run-*/global_step*/ds_adaptive_complete.json 2>/dev/null | sort | tail -n 1 || true)"
  LAST="${LAST%/*}"
  if [[ "${RESUME:-0}" == 1 && -n "$LAST" ]]; then
    SAVE_DIR="$(dirname "$LAST")"
  elif [[ "${RESUME:-0}" == 1 ]] && ls -d "$RUNS"/global_step* >/dev/null 2>&1; then
    SAVE_DIR="$RUNS"  # checkpoints of a run saved straight into the base directory
  else
    SAVE_DIR="$RUNS/run-$(date +%Y%m%d-%H%M%S)"
    n=1
    while [[ -e "$SAVE_DIR" ]]; do SAVE_DIR="$RUNS/run-$(date +%Y%m%d-%H%M%S)-$n"; n=$((n + 1)); done
  fi
  DS_ADAPTIVE_RESUME_HINT="${DS_ADAPTIVE_RESUME_HINT/#RESUME=1/RESUME=1 SAVE_DIR=$(printf '%q' "$SAVE_DIR")}"
  export DS_ADAPTIVE_RESUME_HINT
fi
SAVE_DIR="${SAVE_DIR-checkpoints/$MODEL}"
if [[ -n "$SAVE_DIR" ]]; then
  if [[ "$NUM_GPUS" == 0 ]]; then DEFAULT_INTERVAL=10; else DEFAULT_INTERVAL=100; fi
  TRAINER+=(--save "$SAVE_DIR" --save-interval "${SAVE_INTERVAL:-$DEFAULT_INTERVAL}"
            --keep-checkpoints "${KEEP_CHECKPOINTS:-2}")
  if [[ "${RESUME:-0}" == 1 && "${OVERWRITE:-0}" == 1 ]]; then
    echo "train_wan.sh: RESUME=1 continues the run in SAVE_DIR=$SAVE_DIR and OVERWRITE=1 deletes it to start a new" \
         "one: give one of them" >&2
    exit 2
  fi
  # RESUME=1 resumes when SAVE_DIR holds a complete checkpoint (one with its completeness marker); partial
  # ones (an interrupted save) never block it: the run starts from step 1 (or --init-from) and says so
  if [[ "${RESUME:-0}" == 1 && -d "$SAVE_DIR" ]] && ls "$SAVE_DIR"/global_step*/ds_adaptive_complete.json >/dev/null 2>&1; then
    TRAINER+=(--resume "$SAVE_DIR")
  elif [[ "${OVERWRITE:-0}" == 1 ]]; then
    TRAINER+=(--overwrite)
  elif [[ "${RESUME:-0}" == 1 && -d "$SAVE_DIR" ]]; then
    echo "train_wan.sh: RESUME=1: no complete checkpoint in $SAVE_DIR yet: starting from step 1"
  fi
elif [[ "${RESUME:-0}" == 1 ]]; then
  echo "train_wan.sh: RESUME=1 needs SAVE_DIR (the directory to resume from)" >&2
  exit 2
fi
TRAINER+=("$@")
CMD=("${LAUNCH[@]}" "$HERE/train_wan.py" "${TRAINER[@]}")
echo "train_wan.sh: $MODEL on $WHERE, $STEPS steps, config $DS_CONFIG"
echo "+ ${CMD[*]}"
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  # check config + topology without GPUs (report on stderr; exit 2 names what is wrong, as `config --check` and the run)
  DRY=("$PY" -m ds_adaptive.cli dry-run --deepspeed_config "$DS_CONFIG" --model "$MODEL")
  if [[ "$LAUNCH_MODE" != deepspeed ]]; then  # nodes x ranks per node: SP groups must stay inside a node
    DRY+=(--num-gpus "$PER_NODE" --num-nodes "$NNODES" --launcher node --node-rank "$NODE_RANK"
          --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
    [[ "$NUM_GPUS" == 0 ]] && DRY+=(--device cpu)
  elif [[ "$NUM_GPUS" == 0 ]]; then
    DRY+=(--world "$NPROC" --device cpu)
  elif [[ -n "${HOSTFILE:-}" ]]; then
    DRY+=(--hostfile "$HOSTFILE")
    [[ "$GPUS_GIVEN" == 1 ]] && DRY+=(--num-gpus "$NUM_GPUS")
  else
    DRY+=(--num-gpus "$NUM_GPUS")
  fi
  # every trainer argument goes through the trainer's own parser and checks (an unknown flag is an error)
  DRY+=(-- "${TRAINER[@]:4}")  # from --steps on (the dry run has the config and the model)
  set +e
  "${DRY[@]}" >&2
  rc=$?
  set -e
  exit $rc
fi
if [[ "$LAUNCH_MODE" == task ]]; then
  exec "${CMD[@]}"  # one SLURM task per GPU: srun owns the tasks and signals each rank itself
fi
# The supervisor forwards SIGTERM/SIGINT to every rank and leaves no orphan process behind, even
# when it is SIGKILLed itself (ds_adaptive/launch/supervise.py). STOP_TIMEOUT=S kills a run that has not
# stopped S seconds after the first signal (default: wait; a second signal kills at once). It also
# holds the rendezvous port (a busy default 29500 is replaced by a free one; a busy MASTER_PORT is
# an error), stops every rank when one dies, and removes DeepSpeed's /dev/shm buffers at the end.
exec env "PYTHONPATH=$HERE/..${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m ds_adaptive.launch.supervise -- "${CMD[@]}"
