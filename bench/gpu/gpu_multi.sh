#!/usr/bin/env bash
# Multi-GPU node (2-4 GPUs): build the fused op once, its GPU tests, Ulysses SP=2 vs SP=1 loss over
# 50 steps (bench/training/sp_loss.py, needs 3 GPUs) and Ulysses step time / memory per GPU at 75,600 tokens
# (bench/training/ulysses_gpu.py). Leaves at most 8 files in $OUT (default bench/out/gpu_multi). Run next,
# on the same warm machine, `bash bench/gpu/e2e.sh`: it reuses the op build (same TORCH_EXTENSIONS_DIR).
#   run(kind="nvidia-h200-x4", carry=[".whl"], timeout_s=600, command="bash bench/gpu/gpu_multi.sh")
# Knobs: STEPS (subset of "build tests sp_loss ulysses"), ULYSSES_ARGS, SP_LOSS_ARGS.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out/gpu_multi}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/tmp/pip.log 2>&1
  export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
else
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
NGPU=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
STEPS=${STEPS:-build tests sp_loss ulysses}
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T), limit ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@"; local rc=$?; echo "=== $name rc=$rc in $((SECONDS - t0)) s"; }
for s in $STEPS; do case $s in
  build)   step build 200 bash -c "python3 -m ds_adaptive.cli report --load > $OUT/build.log 2>&1; rc=\$?; tail -5 $OUT/build.log; exit \$rc" ;;
  tests)   step tests 150 bash -c "python3 -m pytest tests/gpu -q -x -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; rc=\$?; tail -4 $OUT/gpu_tests.log; exit \$rc" ;;
  sp_loss) if (( NGPU >= 3 )); then
             step sp_loss 220 python3 bench/training/sp_loss.py --steps 50 --layers 4 --out /tmp/sp_loss ${SP_LOSS_ARGS:-}
             cp /tmp/sp_loss/sp_loss.json /tmp/sp_loss/sp_loss.png "$OUT/" 2>/dev/null
           else echo "sp_loss: needs 3 GPUs, have $NGPU"; fi ;;
  ulysses) step ulysses 270 bash -c "torchrun --standalone --nproc_per_node $NGPU bench/training/ulysses_gpu.py --out $OUT/ulysses.json ${ULYSSES_ARGS:-} 2>&1 | tee $OUT/ulysses.log | grep -vE '^\[|Warning|warn' | tail -40" ;;
esac; done
ls -la "$OUT"
