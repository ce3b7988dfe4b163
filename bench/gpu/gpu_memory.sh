#!/usr/bin/env bash
# Memory on one GPU: memory-aware activation checkpointing, fragmentation-safe budgets, H200
# profiles, MFU. Two purposes, one call each (device time is scarce):
#
#   PURPOSE=calibrate bash bench/gpu/gpu_memory.sh   # H200 profiles (1.3B at 2/4 blocks, 14B at 1/2 blocks,
#                                                 # both checkpointing modes + margin) + a 3-step smoke run
#   PURPOSE=arms STEPS=40 bash bench/gpu/gpu_memory.sh   # Wan 1.3B full depth, default mixed distribution:
#        adaptive (checkpointing auto), adaptive (every block checkpointed), baseline (auto)
#   PURPOSE=calibrate_fused bash bench/gpu/gpu_memory.sh   # the 1.3B profile (2/4 blocks, both
#        checkpointing modes) measured with the fused LayerNorm-modulate op (JIT-built inside the call) ->
#        $OUT/h200-wan2.1-1.3b-fused.json; compare its memory entries with the shipped (reference) profile
#   PURPOSE=baseline BASE_STEPS=3 bash bench/gpu/gpu_memory.sh   # zero3_baseline.json (0 OOM check)
#   PURPOSE=fused_arm ARM=auto|all NUM_SAMPLES=350 bash bench/gpu/gpu_memory.sh   # ONE arm of
#        the throughput comparison with the fused LayerNorm-modulate op (the default path), one whole epoch of
#        NUM_SAMPLES samples, metrics every step; the op is JIT-built first (TORCH_EXTENSIONS_DIR: set it outside
#        the carried tree so a warm machine reuses the build in the next call). One arm per call: both arms of
#        350 samples do not fit one 600 s call. CALIB14=1 then calibrates the 14B profile with the fused op
#        (1, 2 blocks) if the call has CALIB14_BUDGET (default 590) s left. $OUT: plan, arm tarball, report.
#   PURPOSE=long LONG_TIMEOUT=540 bash bench/gpu/gpu_memory.sh   # the longest run one call allows: the shipped
#        zero3_adaptive.json as is (fused op, gas auto, the default 10,000-sample mix, not a subset), --steps 200,
#        metrics every step; SIGTERM at LONG_TIMEOUT s: the trainer finishes the step and writes its summary.
#        Memory per micro-batch over a long stretch of the real distribution (OOM, fragmentation, prediction).
#   PURPOSE=throughput bash bench/gpu/gpu_memory.sh      # the throughput-optimal m_comp / gas auto:
#        adaptive auto vs adaptive all, each ONE WHOLE EPOCH of the same NUM_SAMPLES (default 250)
#        samples of the default mix (same samples in both arms), metrics every step; the report adds the
#        all-steps tokens/s and the fitted training-loop overheads. ARM_TIMEOUT (default 330 s) sends SIGTERM:
#        the trainer stops after the step and still writes its summary.
#
# Outputs in $OUT (default bench/out/memory): calibrate: h200-wan2.1-1.3b.json, h200-wan2.1-14b.json,
# calibrate.txt; arms: memory.json (summaries + predicted-vs-measured memory per micro-batch) and
# arms.txt. The arms of PURPOSE=arms/throughput/baseline use the torch LayerNorm-modulate reference
# (--no-fused-ln-modulate: no op build inside the call); PURPOSE=fused_arm runs the fused op (LN_FLAG). Profiles written by the calibrate call must be copied to
# ds_adaptive/planning/profiles/ before the arms call (profile: auto picks them on an H200).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out/memory}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
note() { echo "[gpu_memory.sh $(date +%H:%M:%S) +${SECONDS}s] $*"; }
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/tmp/pip.log 2>&1 || { note "wheel install failed"; tail /tmp/pip.log; }
fi
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
git_rev=${GIT_REV:-$(cat .gpu_rev 2>/dev/null || echo unknown)}   # .gpu_rev: written by whoever copies the tree (untracked)
note "commit $git_rev"

arm() {  # arm NAME CONFIG STEPS [trainer args...]
  local name=$1 cfg=$2 steps=$3; shift 3
  note "arm $name: $cfg, $steps steps, $*"
  timeout --kill-after=60 "${ARM_TIMEOUT:-200}" "$PY" -m ds_adaptive.cli.train --deepspeed_config "$cfg" --model wan2.1-1.3b \
    --steps "$steps" "${LN_FLAG:---no-fused-ln-modulate}" --log-dir "/tmp/runs/$name" "$@" >"/tmp/runs_$name.log" 2>&1
  local rc=$?
  grep -E "profile auto|PYTORCH_CUDA_ALLOC_CONF|OutOfMemory|out of memory|Error" "/tmp/runs_$name.log" | head -5
  tail -n 12 "/tmp/runs_$name.log"
  note "arm $name rc=$rc"
}

case "${PURPOSE:-calibrate}" in
calibrate)
  note "calibrate wan2.1-1.3b (layers 2,4; with and without checkpointing)"
  "$PY" -m ds_adaptive.cli calibrate --model wan2.1-1.3b --sp 1 --out "$OUT/h200-wan2.1-1.3b.json" \
    --name h200-wan2.1-1.3b 2>&1 | tee "$OUT/calibrate.txt"
  note "calibrate wan2.1-14b (layers 1,2: 40 blocks extrapolated; warmup 1, iters 3)"
  "$PY" -m ds_adaptive.cli calibrate --model wan2.1-14b --sp 1 --layers 1,2 --warmup 1 --iters 3 \
    --out "$OUT/h200-wan2.1-14b.json" --name h200-wan2.1-14b 2>&1 | tee -a "$OUT/calibrate.txt"
  cp "$OUT"/h200-wan2.1-*.json ds_adaptive/planning/profiles/ 2>/dev/null
  mkdir -p /tmp/runs
  ARM_TIMEOUT=150 arm smoke launch/configs/zero3_adaptive.json "${SMOKE_STEPS:-3}" --grad-ckpt auto
  "$PY" bench/training/memory_report.py --runs /tmp/runs --out "$OUT/smoke.json" 2>&1 | tee -a "$OUT/calibrate.txt"
  ;;
calibrate_fused)
  note "calibrate wan2.1-1.3b with the fused LayerNorm-modulate op (layers 2,4; both checkpointing modes)"
  "$PY" -m ds_adaptive.cli calibrate --model wan2.1-1.3b --sp 1 --ln-modulate fused \
    --out "$OUT/h200-wan2.1-1.3b-fused.json" --name h200-wan2.1-1.3b 2>&1 | tee "$OUT/calibrate_fused.txt"
  ;;
arms)
  mkdir -p /tmp/runs
  S=${STEPS:-40}
  arm adaptive_auto launch/configs/zero3_adaptive.json "$S" --grad-ckpt auto
  arm adaptive_all launch/configs/zero3_adaptive.json "$S" --grad-ckpt all
  arm baseline_auto launch/configs/zero3_baseline.json "$S" --grad-ckpt auto
  "$PY" bench/training/memory_report.py --runs /tmp/runs --out "$OUT/memory.json" --commit "$git_rev" 2>&1 | tee "$OUT/arms.txt"
  ;;
throughput)
  mkdir -p /tmp/runs
  N=${NUM_SAMPLES:-250}
  CFG=/tmp/zero3_adaptive_interval1.json   # the shipped config, metrics every step
  "$PY" -c "import json; c = json.load(open('launch/configs/zero3_adaptive.json')); c['adaptive_load']['metrics']['interval'] = 1; json.dump(c, open('$CFG', 'w'))"
  "$PY" bench/planner/memory_plan.py --num-samples "$N" --steps 1 --configs "$CFG" --out "$OUT/memory_plan.json"
  # one whole epoch per arm: the plan's steps (the trainer forms the same plan on this GPU)
  read -r SA SL < <("$PY" -c "import json; r = json.load(open('$OUT/memory_plan.json'))['rows']; print(*[x['steps'] for x in r if x['epoch']])")
  note "epoch steps: auto $SA, all $SL"
  ARM_TIMEOUT=${ARM_TIMEOUT:-330} arm adaptive_auto "$CFG" "$SA" --grad-ckpt auto --num-samples "$N"
  ARM_TIMEOUT=${ARM_TIMEOUT:-330} arm adaptive_all "$CFG" "$SL" --grad-ckpt all --num-samples "$N"
  tar czf "$OUT/arms.tar.gz" -C /tmp runs $(cd /tmp && ls runs_*.log)   # logs, summaries, jsonl (few files come back)
  "$PY" bench/training/memory_report.py --runs /tmp/runs --out "$OUT/memory.json" --commit "$git_rev" 2>&1 | tee "$OUT/arms.txt"
  ;;
fused_arm)   # one arm with the fused op (see the header)
  mkdir -p /tmp/runs
  N=${NUM_SAMPLES:-350}
  A=${ARM:?ARM must be auto or all}
  CFG=/tmp/zero3_adaptive_interval1.json   # the shipped config (fused_ln_modulate true), metrics every step
  "$PY" -c "import json; c = json.load(open('launch/configs/zero3_adaptive.json')); c['adaptive_load']['metrics']['interval'] = 1; json.dump(c, open('$CFG', 'w'))"
  note "build/load the fused LayerNorm-modulate op (TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-default})"
  "$PY" -m ds_adaptive.cli report --load 2>&1 | tail -n 6
  note "op ready"
  "$PY" bench/planner/memory_plan.py --num-samples "$N" --steps 1 --configs "$CFG" --out "$OUT/memory_plan.json"
  read -r SA SL < <("$PY" -c "import json; r = json.load(open('$OUT/memory_plan.json'))['rows']; print(*[x['steps'] for x in r if x['epoch']])")
  S=$([ "$A" = auto ] && echo "$SA" || echo "$SL")
  note "epoch steps: auto $SA, all $SL; running $A: $S steps"
  LN_FLAG=--fused-ln-modulate ARM_TIMEOUT=${ARM_TIMEOUT:-500} arm "adaptive_$A" "$CFG" "$S" --grad-ckpt "$A" --num-samples "$N"
  tar czf "$OUT/arm_$A.tar.gz" -C /tmp "runs/adaptive_$A" "runs_adaptive_$A.log"
  "$PY" bench/training/memory_report.py --runs /tmp/runs --out "$OUT/memory_$A.json" --commit "$git_rev" 2>&1 | tee "$OUT/arm_$A.txt"
  left=$(( ${CALIB14_BUDGET:-590} - SECONDS ))
  if [ "${CALIB14:-0}" = 1 ] && [ "$left" -gt 60 ]; then
    note "calibrate wan2.1-14b with the fused op (layers 1,2; warmup 1, iters 3), ${left} s left"
    timeout "$left" "$PY" -m ds_adaptive.cli calibrate --model wan2.1-14b --sp 1 --layers 1,2 --warmup 1 --iters 3 \
      --ln-modulate fused --out "$OUT/h200-wan2.1-14b-fused.json" --name h200-wan2.1-14b 2>&1 | tee "$OUT/calibrate14_fused.txt"
  elif [ "${CALIB14:-0}" = 1 ]; then
    note "14B calibration skipped: ${left} s left"
  fi
  ;;
long)   # the shipped default config for as long as one call allows (see the header)
  mkdir -p /tmp/runs
  CFG=/tmp/zero3_adaptive_interval1.json   # the shipped config, metrics every step
  "$PY" -c "import json; c = json.load(open('launch/configs/zero3_adaptive.json')); c['adaptive_load']['metrics']['interval'] = 1; json.dump(c, open('$CFG', 'w'))"
  note "build/load the fused LayerNorm-modulate op (TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-default})"
  "$PY" -m ds_adaptive.cli report --load 2>&1 | tail -n 6
  left=$(( ${LONG_TIMEOUT:-540} - SECONDS ))
  note "op ready; training until step ${LONG_STEPS:-200} or SIGTERM in ${left} s"
  LN_FLAG=--fused-ln-modulate ARM_TIMEOUT=$left arm long_auto "$CFG" "${LONG_STEPS:-200}" --grad-ckpt auto
  tar czf "$OUT/long.tar.gz" -C /tmp runs/long_auto runs_long_auto.log
  "$PY" bench/training/memory_report.py --runs /tmp/runs --out "$OUT/memory_long.json" --commit "$git_rev" 2>&1 | tee "$OUT/long.txt"
  ;;
baseline)   # the README's baseline command's config (zero3_baseline.json, its default checkpointing), BASE_STEPS steps
  mkdir -p /tmp/runs
  ARM_TIMEOUT=${ARM_TIMEOUT:-240} arm baseline_auto launch/configs/zero3_baseline.json "${BASE_STEPS:-3}"
  tar czf "$OUT/arms.tar.gz" -C /tmp runs $(cd /tmp && ls runs_*.log)
  "$PY" bench/training/memory_report.py --runs /tmp/runs --out "$OUT/memory.json" --commit "$git_rev" 2>&1 | tee "$OUT/arms.txt"
  ;;
*) echo "PURPOSE must be calibrate, calibrate_fused, arms, throughput, fused_arm, long or baseline" >&2; exit 2 ;;
esac
note done
