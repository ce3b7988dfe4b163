#!/usr/bin/env bash
# At scale: one (config, arm, seed) run of bench/training/scale.py's plan per device command, then the
# summary over everything under $OUT. Method: docs/E2E.md "At scale".
#
#   bash bench/gpu/scale.sh plan [--num-gpus 8]          # commands, predicted time and gain (any machine; nothing runs)
#   bash bench/gpu/scale.sh wan1.3b adaptive 0           # one run on all GPUs of this node -> $OUT/wan1.3b/seed0/adaptive
#   bash bench/gpu/scale.sh summary                      # table over seeds (also printed after every run)
#
# Through the device tool (8 x H200; carry the wheelhouse):
#   run(kind="nvidia-h200-x8", carry=[".whl"], timeout_s=600, command="bash bench/gpu/scale.sh wan1.3b baseline 0")
# Knobs: OUT (default bench/out/scale), NUM_GPUS (default: all visible), GPU_PROFILES (h200 default: the
# shipped H200 profiles; h100), PROFILE (one calibrated profile json for every arm, overrides GPU_PROFILES), TOTAL_S (default 590: bench/gpu/e2e.sh skips
# or stops an arm that would end later), and bench/gpu/e2e.sh's WORK, WHEELS, TORCH_EXTENSIONS_DIR.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out/scale}
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD:${PYTHONPATH:-} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
case "${1:-}" in
  plan) shift; exec "$PY" bench/training/scale.py plan --out "$OUT" "$@" ;;
  summary) exec "$PY" bench/training/scale.py summary --out "$OUT" ;;
  "") echo "usage: bash bench/gpu/scale.sh plan | summary | CONFIG ARM SEED" >&2; exit 2 ;;
esac
CONFIG=$1 ARM=${2:?arm} SEED=${3:?seed}
NGPU=${NUM_GPUS:-$(nvidia-smi -L | wc -l)}
RUN_OUT=$OUT/$CONFIG/seed$SEED/$ARM
mkdir -p "$RUN_OUT"
ARGS=$("$PY" bench/training/scale.py args "$CONFIG" --arm "$ARM" --seed "$SEED" --num-gpus "$NGPU" --out "$RUN_OUT" \
       --gpu "${GPU_PROFILES:-h200}" ${PROFILE:+--profile "$PROFILE"}) || exit 2
# bench/gpu/e2e.sh: wheelhouse, one fused-op build, then bench/training/e2e.py with a deadline; --out comes from ARGS
# (the last --out wins in argparse).
OUT=$RUN_OUT WORK=${WORK:-/tmp/scale_runs/$CONFIG-$SEED} TOTAL_S=${TOTAL_S:-590} bash bench/gpu/e2e.sh $ARGS
rc=$?
"$PY" bench/training/scale.py summary --out "$OUT" || true
exit $rc
