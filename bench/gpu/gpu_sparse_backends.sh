#!/usr/bin/env bash
# Sparse-attention backends on one GPU: the Triton kernels' GPU tests, then bench/kernels/sparse_backends.py (tile sweep
# -> table, every backend vs cuDNN dense on one table, first call of a new S). Results under $OUT.
#   STEPS="tests bench" (default)   OUT=<dir>   BENCH_ARGS="--quick" (a subset)   GIT_COMMIT=<sha>
# Budget on one H200: tests ~1-1.5 min (Triton compiles ~20 kernel variants), bench 79 s at 6eceb6a (all backends);
# BENCH_ARGS="--backends triton": the sweep + ours + cuDNN only (~50 s; flex does not change between our runs).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out/gpu_sparse_backends}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}   # this checkout, for the processes its steps start (tests/conftest.py checks it)
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_sparse}
STEPS=${STEPS:-tests bench}
rc=0
for s in $STEPS; do
  echo "=== $s ($(date -u +%T))"
  case $s in
    tests) timeout ${T_TESTS:-240} python -m pytest tests/gpu/test_sparse_triton_gpu.py -q -x -p no:cacheprovider \
             2>&1 | tee "$OUT/tests_triton.txt" || rc=1 ;;
    bench) timeout ${T_BENCH:-280} python bench/kernels/sparse_backends.py --out "$OUT/sparse_backends.json" \
             --table-out "$OUT/triton_configs.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/sparse_backends.txt" || rc=1 ;;
  esac
done
echo "=== done rc=$rc ($(date -u +%T))"
exit $rc
