#!/usr/bin/env bash
# Sparse attention on one GPU: GPU tests, kernel figures (kernel-options sweep -> table, selection
# overhead, trace), end-to-end Wan 1.3B with the measured table. Results under $OUT.
#   STEPS="tests kernel e2e" (default; "quality": the dense vs sparse training run, ~8 min per seed;
#   "ab": bench/training/sparse_train_ab.py, ~8 min)
#   GIT_COMMIT=<sha> OUT=<dir> [SWEEP=0: no table written, e2e uses the shipped
#   ds_adaptive/attention/kernel_options.json] bash bench/gpu/gpu_sparse.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out/gpu_sparse}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}   # this checkout, for the processes its steps start (tests/conftest.py checks it)
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_sparse}
STEPS=${STEPS:-tests kernel e2e}
TABLE="$OUT/kernel_options.json"
rc=0
for s in $STEPS; do
  echo "=== $s ($(date -u +%T))"
  case $s in
    tests)  timeout ${T_TESTS:-360} python -m pytest tests/gpu/test_sparse_gpu.py -q -x -p no:cacheprovider 2>&1 | tee "$OUT/tests.txt" || rc=1 ;;
    kernel) tout=""; [ "${SWEEP:-1}" = 1 ] && tout="--table-out $TABLE"
            timeout ${T_KERNEL:-330} python bench/kernels/sparse_kernel.py --out "$OUT/sparse_kernel.json" $tout \
              --trace "$OUT/trace_select.json" ${KERNEL_ARGS:-} 2>&1 | tee "$OUT/kernel.txt" || rc=1 ;;
    e2e)    tab=""; [ -f "$TABLE" ] && tab="--kernel-table $TABLE"
            timeout ${T_E2E:-420} python bench/kernels/sparse_e2e.py --out "$OUT/sparse_e2e.json" $tab ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.txt" || rc=1 ;;
    ab)     timeout ${T_AB:-590} python bench/training/sparse_train_ab.py --out "$OUT/sparse_train_ab.json" ${AB_ARGS:-} 2>&1 | tee "$OUT/ab.txt" || rc=1 ;;
    quality) timeout ${T_QUALITY:-530} python bench/training/sparse_quality.py --out "$OUT/sparse_quality.json" --runs-dir /tmp/sparse_quality_runs ${QUALITY_ARGS:-} 2>&1 | tee "$OUT/quality.txt" || rc=1 ;;
  esac
done
echo "=== done rc=$rc ($(date -u +%T))"
exit $rc
