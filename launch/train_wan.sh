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
#   HOSTFILE    DeepSpeed hostfile for multi-node runs (see launch/hostfile.example);
#               MASTER_ADDR / MASTER_PORT pick the rendezvous (default: the first host, 29500)
#   DS_CONFIG   ds_config json (default: zero3_adaptive.json on GPU, zero3_adaptive_14b.json for
#               MODEL=wan2.1-14b, cpu_tiny.json on CPU)
#   MODEL       tiny | wan2.1-1.3b | wan2.1-14b (default: wan2.1-1.3b on GPU, tiny on CPU)
#   STEPS       optimizer steps (default: 50 on GPU, 20 on CPU)
#   SP          Ulysses sequence-parallel degree (default 1)
#   GRAD_CKPT   activation checkpointing: auto (per micro-batch the fewest blocks that fit the memory
#               budget), 1/all (every block), 0/none; default: the config's sampler.checkpointing (auto)
#   PYTORCH_CUDA_ALLOC_CONF  default expandable_segments:True (changing micro-batch shapes fragment
#               the caching allocator); a value you set is kept
#   PYTHON      python interpreter (default: python)
#   DRY_RUN=1   print the deepspeed command instead of running it
#   STOP_TIMEOUT  seconds a run may take to stop after SIGTERM/SIGINT before it is killed
#               (default 0: wait; a second signal kills at once)
#   SAVE_DIR    checkpoint directory (default: checkpoints/$MODEL; empty = no checkpoints)
#   SAVE_INTERVAL  steps between checkpoints (default: 100 on GPU, 10 on CPU)
#   KEEP_CHECKPOINTS  complete checkpoints of this run kept in SAVE_DIR, older ones deleted (default 2; 0 = all;
#               the newest one saved after only finite steps is always kept)
#   RESUME=1    continue from the newest complete checkpoint in SAVE_DIR, if there is one
#   OVERWRITE=1 start a new run in a SAVE_DIR that holds an earlier run's checkpoints (they are deleted);
#               without RESUME=1 or OVERWRITE=1 that is an error naming them
#
# Signals: SIGTERM/SIGINT/SIGHUP to this script reach every rank (not only DeepSpeed's launcher);
# the ranks finish the current step, save a checkpoint into SAVE_DIR and exit 75 (EX_TEMPFAIL:
# resume with RESUME=1). SIGKILL of it kills the whole run (no orphan ranks). A rank killed by
# signal N stops the others and the run exits 128+N with one line saying how to resume. See
# ds_adaptive/supervise.py and ds_adaptive/preempt.py; exit codes in README "Signals, preemption and orphans".
# Extra arguments go to the trainer (ds-adaptive train --help lists them).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python}"

# The command that resumes this run, for the message after a rank dies: the knobs you set, RESUME=1, the args.
RESUME_HINT="RESUME=1"
for knob in NUM_GPUS NUM_PROCS HOSTFILE MASTER_ADDR MASTER_PORT DS_CONFIG MODEL STEPS SP GRAD_CKPT SAVE_DIR \
            SAVE_INTERVAL KEEP_CHECKPOINTS PYTHON STOP_TIMEOUT; do
  [[ -n "${!knob+x}" ]] && RESUME_HINT+=" $knob=$(printf '%q' "${!knob}")"
done
RESUME_HINT+=" bash $(printf '%q' "${BASH_SOURCE[0]}")"
for arg in "$@"; do [[ "$arg" != --overwrite ]] && RESUME_HINT+=" $(printf '%q' "$arg")"; done
export DS_ADAPTIVE_RESUME_HINT="$RESUME_HINT"

if [[ -z "${NUM_GPUS:-}" ]]; then
  NUM_GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
  GPUS_GIVEN=0
else
  GPUS_GIVEN=1
fi
if ! [[ "$NUM_GPUS" =~ ^[0-9]+$ ]]; then
  echo "train_wan.sh: NUM_GPUS must be a number of GPUs per node, got '$NUM_GPUS'" >&2
  exit 2
fi

LAUNCH=(deepspeed)
if [[ "$NUM_GPUS" == 0 ]]; then
  # CPU run: gloo, fp32; one thread per process so that 2 processes share 2 cores fairly.
  NPROC="${NUM_PROCS:-2}"
  DS_CONFIG="${DS_CONFIG:-$HERE/configs/cpu_tiny.json}"
  MODEL="${MODEL:-tiny}"
  STEPS="${STEPS:-20}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  LAUNCH+=(--num_gpus "$NPROC")
  WHERE="$NPROC CPU process(es)"
else
  MODEL="${MODEL:-wan2.1-1.3b}"
  if [[ "$MODEL" == wan2.1-14b ]]; then  # the 14B config plans with the 14B calibration
    DS_CONFIG="${DS_CONFIG:-$HERE/configs/zero3_adaptive_14b.json}"
  else
    DS_CONFIG="${DS_CONFIG:-$HERE/configs/zero3_adaptive.json}"
  fi
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
[[ -n "${MASTER_PORT:-}" ]] && LAUNCH+=(--master_port "$MASTER_PORT")

if [[ ! -f "$DS_CONFIG" ]]; then
  echo "train_wan.sh: DS_CONFIG=$DS_CONFIG does not exist; pick one of $HERE/configs/*.json" >&2
  exit 2
fi

CMD=("${LAUNCH[@]}" "$HERE/train_wan.py" --deepspeed_config "$DS_CONFIG" --model "$MODEL" --steps "$STEPS"
     --sp "${SP:-1}")
case "${GRAD_CKPT:-}" in
  "") CKPT="" ;;
  1|all) CKPT=all ;;
  0|none) CKPT=none ;;
  auto) CKPT=auto ;;
  *) echo "train_wan.sh: GRAD_CKPT must be auto, all (1) or none (0), got '$GRAD_CKPT'" >&2; exit 2 ;;
esac
[[ -n "$CKPT" ]] && CMD+=(--grad-ckpt "$CKPT")
if [[ "$NUM_GPUS" == 0 ]]; then
  :  # the CUDA allocator's setting means nothing to the CPU run
elif [[ -z "${PYTORCH_CUDA_ALLOC_CONF+x}" ]]; then
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  echo "train_wan.sh: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (fragmentation-safe; set it to override)"
else
  echo "train_wan.sh: PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF (yours, kept)"
fi
# Periodic checkpoints are on by default: a preempted or killed run loses at most SAVE_INTERVAL steps.
SAVE_DIR="${SAVE_DIR-checkpoints/$MODEL}"
if [[ -n "$SAVE_DIR" ]]; then
  if [[ "$NUM_GPUS" == 0 ]]; then DEFAULT_INTERVAL=10; else DEFAULT_INTERVAL=100; fi
  CMD+=(--save "$SAVE_DIR" --save-interval "${SAVE_INTERVAL:-$DEFAULT_INTERVAL}"
        --keep-checkpoints "${KEEP_CHECKPOINTS:-2}")
  if [[ "${RESUME:-0}" == 1 && -d "$SAVE_DIR" ]] && ls -d "$SAVE_DIR"/global_step* >/dev/null 2>&1; then
    CMD+=(--resume "$SAVE_DIR")
  elif [[ "${OVERWRITE:-0}" == 1 ]]; then
    CMD+=(--overwrite)
  fi
elif [[ "${RESUME:-0}" == 1 ]]; then
  echo "train_wan.sh: RESUME=1 needs SAVE_DIR (the directory to resume from)" >&2
  exit 2
fi
CMD+=("$@")
echo "train_wan.sh: $MODEL on $WHERE, $STEPS steps, config $DS_CONFIG"
echo "+ ${CMD[*]}"
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  # check config + topology without GPUs (report on stderr; exit 1 names what is wrong)
  DRY=("$PY" -m ds_adaptive.cli dry-run --deepspeed_config "$DS_CONFIG" --model "$MODEL" --sp "${SP:-1}")
  if [[ "$NUM_GPUS" == 0 ]]; then
    DRY+=(--world "$NPROC" --device cpu)
  elif [[ -n "${HOSTFILE:-}" ]]; then
    DRY+=(--hostfile "$HOSTFILE")
    [[ "$GPUS_GIVEN" == 1 ]] && DRY+=(--num-gpus "$NUM_GPUS")
  else
    DRY+=(--num-gpus "$NUM_GPUS")
  fi
  [[ -n "$CKPT" ]] && DRY+=(-- --grad-ckpt "$CKPT")
  "${DRY[@]}" >&2
  exit $?
fi
# The supervisor forwards SIGTERM/SIGINT to every rank and leaves no orphan process behind, even
# when it is SIGKILLed itself (ds_adaptive/supervise.py). STOP_TIMEOUT=S kills a run that has not
# stopped S seconds after the first signal (default: wait; a second signal kills at once). It also
# holds the rendezvous port (a busy default 29500 is replaced by a free one; a busy MASTER_PORT is
# an error), stops every rank when one dies, and removes DeepSpeed's /dev/shm buffers at the end.
exec "$PY" "$HERE/../ds_adaptive/supervise.py" -- "${CMD[@]}"
