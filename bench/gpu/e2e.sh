#!/usr/bin/env bash
# End-to-end benchmark on one GPU node: AdaptiveLoad vs the equal-token baseline, four
# arms of real ZeRO-3 training (bench/training/e2e.py; method in docs/E2E.md). Run from anywhere:
#
#   bash bench/gpu/e2e.sh [bench/training/e2e.py args ...]          e.g. --num-gpus 2, --plan-only
#
# Through the device tool (4 x H200; carry the wheelhouse built by ../shared/gpu/wheelhouse.sh):
#   run(kind="nvidia-h200-x4", carry=[".whl"], timeout_s=560, command="bash bench/gpu/e2e.sh")
#
# Steps: install the offline wheelhouse (.whl/, when present: GPU nodes lack deepspeed/pydantic),
# build the fused LayerNorm-Modulate op ONCE (cached in TORCH_EXTENSIONS_DIR; every arm loads it
# from there), then bench/training/e2e.py with a deadline so that a slow node skips arms instead of running
# past the call's limit. If the op cannot be built, only the two reference-LN arms run.
# Outputs in $OUT (default bench/out/e2e): e2e.json, e2e.png, e2e.txt, e2e_logs.txt, build.log,
# pip.log; per-arm configs and full logs in $WORK (default /tmp/e2e_runs, outside $OUT).
# Knobs: OUT, WORK, WHEELS (wheel directory, default .whl; none: skip), TOTAL_S (the whole script's time budget, default 520 s: arms that would end
# later are skipped, a running one is stopped), DEADLINE_S (seconds for the arms; default what
# TOTAL_S leaves after install and build, minus 20 s for the report), PYTHON (default python3),
# TORCH_EXTENSIONS_DIR (default /tmp/torch_extensions).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out/e2e}
WORK=${WORK:-/tmp/e2e_runs}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
note() { echo "[e2e.sh $(date +%H:%M:%S) +$((SECONDS))s] $*"; }

source bench/gpu/bench_env.sh   # wheelhouse -> /tmp/site, PYTHONPATH, the GPU

ARMS=()
if [[ " $* " != *" --plan-only "* && " $* " != *" --device cpu "* && " $* " != *" --report-only "* ]]; then
  note "building the fused LayerNorm-Modulate op (once; TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR)"
  if timeout 300 "$PY" -m ds_adaptive.cli report --load >"$OUT/build.log" 2>&1; then
    note "fused op ready"
  else
    note "the fused op did not build or load (see build.log): running the reference-LN arms only"
    tail -n 20 "$OUT/build.log"
    [[ " $* " == *" --arms "* ]] || ARMS=(--arms baseline,dual_ref)
  fi
fi

DEADLINE=${DEADLINE_S:-$(( ${TOTAL_S:-520} - SECONDS - 20 ))}
(( DEADLINE < 1 )) && DEADLINE=1
note "bench/training/e2e.py (arms deadline ${DEADLINE} s)"
"$PY" bench/training/e2e.py --out "$OUT" --work-dir "$WORK" --deadline-s "$DEADLINE" ${ARMS[@]+"${ARMS[@]}"} "$@"
rc=$?
note "done (rc=$rc)"
exit $rc
