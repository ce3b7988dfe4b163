#!/usr/bin/env bash
# Issue 18 (third round) GPU call: one command on one H200 through the device tool, from the repository
# copy (.gpu/<name>): build the op, its GPU tests, host time, the forward probe sweep, the benchmark table
# with the Wan block, and the default job with / without the op (TRAIN_STEPS steps each). Everything
# under $RES; one archive ($OUT/issue18c.tgz) comes back (the device tool returns a limited number of files).
#   run(carry=[".gpu/<name>", ".whl"], command="... cd .gpu/<name> && GIT_COMMIT=<sha> bash bench/gpu_op18c.sh")
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${RES:-/tmp/res18c}
mkdir -p "$RES"
export PROBE_BIN=${PROBE_BIN:-bench/ln_modulate_probe.bin} PROBE_CASES=${PROBE_CASES:-1,2,5} PROBE_FWD_ONLY=1
export TEST_ARGS=${TEST_ARGS:---ignore=tests/gpu/test_sparse_gpu.py}
export BENCH_ARGS=${BENCH_ARGS:---quick --no-host --compile-cases 0 --cases 0,1,2,3,4,5,7}
export TRAIN_STEPS=${TRAIN_STEPS:-3}
# under the device tool's 600 s per command: stop the steps in time for the archive below
STEPS=${STEPS:-env build tests host probe bench train} OUT="$RES" timeout "${CALL_LIMIT:-565}" bash bench/gpu_check.sh
if [ -n "${OUT:-}" ]; then
  (cd "$RES" && find . -maxdepth 3 \( -name '*.log' -o -name '*.json' -o -name '*.txt' -o -name '*.png' \) -size -20M \
    | tar czf "$OUT/issue18c.tgz" -T -)
fi
