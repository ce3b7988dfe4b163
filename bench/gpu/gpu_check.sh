#!/usr/bin/env bash
# One script for a GPU node: install the offline wheelhouse, build the fused op once, run the
# GPU tests and the benchmarks. Results go to $OUT (default bench/out/gpu_check); the last lines
# of stdout are a short summary. Run from the repository root:
#
#   GIT_COMMIT=<sha> OUT=/some/dir bash bench/gpu/gpu_check.sh
#
# Through the device tool (carry the wheelhouse built by ../shared/gpu/wheelhouse.sh):
#   run(kind="nvidia-h100-x1", carry=[".whl"], timeout_s=600,
#       command="GIT_COMMIT=<sha> BENCH_ARGS='--tune --no-block' PYTHONUNBUFFERED=1 bash bench/gpu/gpu_check.sh")
#
# Opt-in steps (STEPS=...): mfu (bench/kernels/block_profile.py, MFU_ARGS), pertoken (per-token GPU tests +
# bench/kernels/ln_modulate_per_token.py), firstuse (the default job twice with an empty profile cache:
# FIRSTUSE_STEPS), levers (bench/training/mfu_levers.py A/B: LEVERS_GAS, LEVERS_STEPS, LEVERS_RUN = arms to train in this
# call, LEVERS_ARMS = arms to report, LEVERS_M_COMP = the pinned budget per micro-batch in ms, default 9700 at gas 1:
# it must hold the costliest sample alone; two arms of 13 steps ~5.5 min; the prepared dir is kept). trainprofile: where the
# default job's step goes (bench/training/train_step_profile.py). calfusion: this GPU's 1.3B profile calibrated with block
# fusion and shipped as its block_fusion_variants entry (the json comes back in $OUT; CALFUSION_ARGS: more calibrate
# arguments, e.g. --accept-poor-fit where only its memory terms are used). keepattn: recompute.attention keep vs recompute,
# one epoch of KEEPATTN_SAMPLES (default 40) long-video samples per arm (bench/training/checkpoint_attention_ab.py, ~8 min).
# setab: the shipped job vs AB_SET config overrides, same samples (bench/training/train_step_profile.py, ~4 min).
# attn: SDPA backends per shape of the default mix, self- and cross-attention (bench/kernels/attention_backends.py, ~1 min).
# sparseab: dense vs sparse attention in the trainer on one pinned plan, full depth, per mix of SPARSEAB_MIXES (default
# "default long"; SPARSEAB_ARGS; ~9 min per mix on one H100).
# Environment knobs: STEPS (space-separated subset of: env build tests bench train ...; default
# env build tests bench; host = host time per call (isolated fwd+bwd and per op in a chain of 32) with a
# torch.profiler table;
# train = the default job with and without the fused op, TRAIN_STEPS steps each, each arm planning with its own
# calibration; train_same = the same two arms on one pinned plan, bench/training/ln_modulate_e2e.py; ti2v = Wan 2.2 TI2V-5B:
# its default job, TI2V_STEPS steps (default 11), planned with the shipped profile of this GPU (calibrated into
# ds_adaptive/planning/profiles/<gpu>-wan2.2-ti2v-5b.json first when none ships, or TI2V_CALIBRATE=1): tokens/s, MFU, peak
# memory in $OUT/ti2v_run; defaultjob = the shipped default job (bench/gpu/default_job.sh: DEFAULTJOB_STEPS, default 22;
# DEFAULTJOB_ARMS="shipped features" adds EMA + validation); lora = LoRA vs full fine-tuning in steady state
# (bench/gpu/lora_preview.sh, LORA_ARGS); TOTAL_S = the whole script's budget in seconds (a step that would run past it
# gets what is left, one with under MIN_STEP_S (90) left is skipped),
# BENCH_ARGS (extra args for bench/kernels/ln_modulate.py, e.g. "--quick --tune"; --tune also times both
# kernel generations per case and prints the recommended DS_ADAPTIVE_LN_MODULATE_KERNELS),
# STEP_LIMIT (seconds each step may run, instead of its own limit), TEST_ARGS (for pytest), PREBUILD=1 (also
# build the op through setup.py build_ext --inplace and load that), DS_ADAPTIVE_LN_MODULATE_KERNELS (kernel
# generation policy, e.g. "v1" to run everything on the previous kernels; the GPU tests run both generations
# explicitly either way).
# Other engineers: add a step as a function do_NAME below (export -f it, give it a LIMIT) and
# append NAME to STEPS_ALL.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# In the (git-ignored) repository folder: a later call on the same warm machine reuses the build,
# so the steps can be split over calls (STEPS="env build tests", then STEPS="bench").
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
STEPS_ALL="env build tests bench"
STEPS=${STEPS:-$STEPS_ALL}
declare -A STATUS
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

note() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$SUMMARY"; }

run_step() {  # run_step NAME TIMEOUT_S FUNCTION  (output to $OUT/NAME.log and stdout)
  local name=$1 limit=$2 fn=$3
  local t0=$SECONDS
  note "step $name: start (limit ${limit}s)"
  timeout "$limit" bash -c "$fn" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  STATUS[$name]="rc=$rc $((SECONDS - t0))s"
  note "step $name: rc=$rc in $((SECONDS - t0)) s"
  return "$rc"
}

# --- python environment: the node has torch/triton/nvcc but no deepspeed/pydantic ------------
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/pip.log" 2>&1 || note "wheelhouse install failed (see pip.log)"
  export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
  export PATH=/tmp/site/bin:$PATH   # the wheels' scripts (the `deepspeed` launcher of launch/train_wan.sh)
else
  note "no .whl wheelhouse: using the installed packages"
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi

# Each step is a shell function do_NAME (exported, run under `timeout` by run_step).
do_env() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
  nvcc --version | tail -1
  echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-unset} CUDA_HOME=${CUDA_HOME:-unset} TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR"
  echo "DS_ADAPTIVE_LN_MODULATE_KERNELS=${DS_ADAPTIVE_LN_MODULATE_KERNELS:-unset (compiled-in defaults)}"
  python3 -c 'import deepspeed; print("deepspeed", deepspeed.__version__)'
}
do_build() {  # the op, once: prebuilt through setup.py (PREBUILD=1) or JIT through DeepSpeed's builder
  if [ "${PREBUILD:-0}" = "1" ]; then
    DS_BUILD_LN_MODULATE=1 python3 setup.py build_ext --inplace || return 1
  fi
  # `ds-adaptive report --load` loads (JIT-builds) the op, smoke-tests it and prints DeepSpeed's op report
  python3 -m ds_adaptive.cli report --load --ds-report
}
do_tests() {
  # --durations: on a cold machine (no Inductor / triton cache) the suite took > 240 s at 734091f; name the slow ones
  python3 -m pytest tests/gpu -q -ra --maxfail=25 -p no:cacheprovider --durations=15 ${TEST_ARGS:-}
}
do_bench() {
  python3 bench/kernels/ln_modulate.py --out "$OUT/ln_modulate.json" ${BENCH_ARGS:-}
}
do_host() {  # host time per call (isolated and in a chain), torch.profiler table
  python3 bench/kernels/ln_modulate.py --host-only --out "$OUT/ln_modulate_host.json"
}
do_train() {  # the default job's tokens/s with and without the fused op (TRAIN_STEPS steps each)
  [ -d /tmp/site/bin ] && export PATH=/tmp/site/bin:$PATH  # the deepspeed launcher of the wheelhouse
  for mode in fused-ln-modulate no-fused-ln-modulate; do
    echo "== train --$mode"
    STEPS=${TRAIN_STEPS:-8} bash launch/train_wan.sh --$mode --log-dir "$OUT/train_$mode" 2>&1 \
      | grep -E "tokens/s|tok/s|run summary|peak memory|loss  |Error|error" | tail -14
  done
}
do_train_same() {  # the default job with and without the op on the SAME plan (bench/training/ln_modulate_e2e.py): both
  # arms plan with the H200 profile's reference entries, so they train identical micro-batches; one epoch of
  # TRAIN_SAMPLES (default 150) samples of the default mix, TRAIN_SAME_STEPS (default 7 = that epoch) steps
  local d="$OUT/train_same" w=/tmp/train_same arm flag
  rm -rf "$w"; mkdir -p "$d"
  python3 bench/training/ln_modulate_e2e.py prepare --dir "$w" || return 1
  for arm in op ref; do
    flag=$([ "$arm" = op ] && echo --fused-ln-modulate || echo --no-fused-ln-modulate)
    echo "== arm $arm ($flag)"
    python3 -m ds_adaptive.cli.train --deepspeed_config "$w/config.json" --model wan2.1-1.3b --grad-ckpt auto $flag \
      --steps "${TRAIN_SAME_STEPS:-7}" --num-samples "${TRAIN_SAMPLES:-150}" --log-dir "$w/runs/$arm" >"$d/$arm.log" 2>&1 \
      || { tail -n 30 "$d/$arm.log"; return 1; }
    tail -n 4 "$d/$arm.log"
    for f in summary.json metrics.jsonl memory.jsonl; do cp "$w/runs/$arm/$f" "$d/${arm}_$f" 2>/dev/null; done
  done
  python3 bench/training/ln_modulate_e2e.py report --runs "$w/runs" --out "$OUT/train_same_report.json" | tee "$d/report.txt"
  # one archive: the device tool returns only a few files per call (at 6e36d50 the 10 files of this step did not
  # come back and the report survived only in stdout)
  tar czf "$OUT/train_same.tgz" -C "$OUT" train_same && rm -rf "$d"
}
do_ti2v() {  # Wan 2.2 TI2V-5B: its default job planned with this GPU's shipped profile (calibrated first when the
  # package ships none for this GPU, or TI2V_CALIBRATE=1); one GPU: an H200 (the 5B model's parameters, gradients and
  # Adam state are ~75 GiB)
  [ -d /tmp/site/bin ] && export PATH=/tmp/site/bin:$PATH
  local key prof
  key=$(python3 -c 'from ds_adaptive.planning.devices import detect_device_name, gpu_spec; s = gpu_spec(detect_device_name()); print(s.key if s else "gpu")') || return 1
  prof=ds_adaptive/planning/profiles/$key-wan2.2-ti2v-5b.json
  if [ ! -f "$prof" ] || [ "${TI2V_CALIBRATE:-0}" = "1" ]; then
    python3 -m ds_adaptive.cli calibrate --model wan2.2-ti2v-5b --out "$prof" 2>&1 | tail -n 30 || return 1
    cp "$prof" "$OUT/" || return 1
  fi
  MODEL=wan2.2-ti2v-5b STEPS=${TI2V_STEPS:-11} SAVE_DIR= bash launch/train_wan.sh --log-dir "$OUT/ti2v_run" \
    >"$OUT/ti2v_train.log" 2>&1
  local rc=$?
  grep -E "profile auto|gradient_accumulation|Error|error" "$OUT/ti2v_train.log" | tail -8
  sed -n '/run summary/,$p' "$OUT/ti2v_train.log" | head -20
  return "$rc"
}
do_defaultjob() {  # the shipped default job, DEFAULTJOB_STEPS (default 22) steps, and with DEFAULTJOB_ARMS="shipped
  # features" the same with EMA + validation (bench/gpu/default_job.sh, in $OUT/default_job)
  WHEELS=none OUT="$OUT/default_job" STEPS=${DEFAULTJOB_STEPS:-22} ARMS=${DEFAULTJOB_ARMS:-shipped} \
    ARM_LIMIT=${DEFAULTJOB_ARM_LIMIT:-900} bash bench/gpu/default_job.sh
}
do_lora() {  # LoRA vs full fine-tuning of the 1.3B default job in steady state (bench/gpu/lora_preview.sh, in $OUT/lora):
  # LORA_ARGS, default 11 steps per arm at a global batch of 16 samples, one preview after the last step
  WHEELS=none OUT="$OUT/lora" TOTAL_S=${LORA_TOTAL_S:-420} bash bench/gpu/lora_preview.sh \
    ${LORA_ARGS:---steps 11 --global-batch 16 --preview-at 11}
}
# --- opt-in steps (not in STEPS_ALL) ------------------------------------------------------------
do_mfu() {  # one Wan block traced at 3 sizes + A/B of adaptive_load.block_fusion (bench/kernels/block_profile.py)
  python3 bench/kernels/block_profile.py --out "$OUT/block_profile.json" ${MFU_ARGS:-} && \
    tar czf "$OUT/block_traces.tgz" -C "$OUT" $(cd "$OUT" && ls block_trace_*.json) && rm -f "$OUT"/block_trace_*.json
}
do_pertoken() {  # per-token LN-modulate: its GPU tests (~530 cases, every test id naming per_token) + fwd+bwd vs
  # floor: the op (leaves), a step through the [B, S, 6, D] table, chunk()'s backward alone (split)
  python3 -m pytest tests/gpu/test_ln_modulate_gpu.py -q -ra --maxfail=10 -p no:cacheprovider -k "per_token" \
    ${TEST_ARGS:-} 2>&1 | tail -n 25
  local rc=${PIPESTATUS[0]}
  python3 bench/kernels/ln_modulate_per_token.py --out "$OUT/ln_modulate_per_token.json" || return 1
  return "$rc"
}
do_firstuse() {  # the default job twice with profile auto and an empty cache: the first calibrates, the second reads
  export DS_ADAPTIVE_CACHE_DIR="$OUT/profile_cache"
  rm -rf "$DS_ADAPTIVE_CACHE_DIR"
  for run in 1 2; do
    STEPS=${FIRSTUSE_STEPS:-6} SAVE_DIR= bash launch/train_wan.sh --num-samples "${TRAIN_SAMPLES:-400}" \
      --log-dir "$OUT/firstuse$run" >"$OUT/firstuse$run.log" 2>&1 || { tail -n 30 "$OUT/firstuse$run.log"; return 1; }
    grep -E "calibrat|profile:|gradient_accumulation_steps auto|tokens/s|MFU|peak" "$OUT/firstuse$run.log" | tail -n 12
  done
  ls -l "$DS_ADAPTIVE_CACHE_DIR"/profiles
}
do_levers() {  # trainer A/B of block fusion and ZeRO-3 settings on one pinned plan (bench/training/mfu_levers.py)
  local w="$OUT/levers"
  [ -f "$w/config.json" ] && [ -n "${LEVERS_RUN:-}" ] && echo "levers: re-preparing $w (same pinned plan)"
  python3 bench/training/mfu_levers.py prepare --dir "$w" --gas "${LEVERS_GAS:-1}" --steps "${LEVERS_STEPS:-13}" --m-comp "${LEVERS_M_COMP:-9700}" \
    --num-samples "${TRAIN_SAMPLES:-2000}" | while read -r cmd; do
      case "$cmd" in *ds_adaptive.cli.train*) arm=${cmd##*/}
        case ",${LEVERS_RUN:-ref,fusion,zero}," in *",$arm,"*) ;; *) continue;; esac   # arms to run in this call
        echo "arm $arm"; eval "$cmd" </dev/null >"$w/$arm.log" 2>&1 || tail -n 20 "$w/$arm.log";; esac
    done
  python3 bench/training/mfu_levers.py report --runs "$w/runs" --arms "${LEVERS_ARMS:-${LEVERS_RUN:-ref,fusion,zero}}" \
    --out "$OUT/levers.json"
}
do_keepattn() {  # recompute.attention keep vs recompute: one epoch of the same samples per arm (long-video
  # mix by default: where the plan checkpoints blocks; KEEPATTN_ARGS e.g. "--m-comp 10000 --gas 1 --shapes ''")
  local w="$OUT/keepattn"
  python3 bench/training/checkpoint_attention_ab.py prepare --dir "$w" --num-samples "${KEEPATTN_SAMPLES:-40}" --shapes long \
    ${KEEPATTN_ARGS:-} | while read -r cmd; do
      arm=${cmd##*/}; echo "arm $arm"; eval "$cmd" </dev/null >"$w/$arm.log" 2>&1 || tail -n 20 "$w/$arm.log"
    done
  python3 bench/training/checkpoint_attention_ab.py report --runs "$w/runs" --out "$OUT/checkpoint_attention_ab.json"
}
do_attn() {  # SDPA backends (cuDNN / flash / memory-efficient) per shape of the default mix, self and cross
  python3 bench/kernels/attention_backends.py --out "$OUT/attention_backends.json"
}
do_trainprofile() {  # where the default job's step goes: synchronised segments + a profiled step
  python3 bench/training/train_step_profile.py --out "$OUT/trainprofile" ${TRAINPROFILE_ARGS:-} || return 1
  tar czf "$OUT/trainprofile.tgz" -C "$OUT" trainprofile && rm -rf "$OUT/trainprofile"   # the device returns 8 files
}
do_setab() {  # the shipped job vs the same job with AB_SET (space-separated KEY=JSON config overrides) and AB_ENV: the same
  # samples, AB_WARM untouched warm steps (their walls are the A/B) then a kernels-only profiled step, per arm
  local arm sets=()
  for kv in ${AB_SET:-}; do sets+=(--set "$kv"); done   # AB_ENV: VAR=VALUE ... for the changed arm
  for arm in shipped changed; do
    env $([ "$arm" = changed ] && echo "${AB_ENV:-}") python3 bench/training/train_step_profile.py --out "$OUT/setab/$arm" --warm "${AB_WARM:-4}" --timed 0 --profiled 1 --kernels-only \
      $([ "$arm" = changed ] && echo "${sets[@]}") 2>&1 | grep -E "^(warm|profiled) |profiled:|^\| [0-9]|peak" || return 1
  done
  tar czf "$OUT/setab.tgz" -C "$OUT" setab && rm -rf "$OUT/setab"
}
do_sparseab() {  # dense vs sparse attention in the trainer on one pinned plan (bench/training/sparse_train_ab.py), one
  # call per mix in SPARSEAB_MIXES (default "default long"), both arms in one process: $OUT/sparse_ab/<mix>.json / .txt
  set -o pipefail
  mkdir -p "$OUT/sparse_ab"
  local mix rc=0
  for mix in ${SPARSEAB_MIXES:-default long}; do
    python3 bench/training/sparse_train_ab.py --mixes "$mix" --out "$OUT/sparse_ab/$mix.json" \
      ${SPARSEAB_ARGS:---arms dense sparse --backend triton --layers 30 --m-comp 9700 --num-samples 300 --fused-ln} \
      2>&1 | tee "$OUT/sparse_ab/$mix.txt" || rc=1
  done
  return $rc
}
do_calfusion() {  # the shipped 1.3B profile of this GPU calibrated with block fusion (CALFUSION_MODE, default regions)
  # on the fused LayerNorm-modulate path, shipped into the profile json as block_fusion_variants.<mode>; the json comes
  # back in $OUT (copy it to ds_adaptive/planning/profiles/ and commit; then run the default job in the next call)
  local key prof mode=${CALFUSION_MODE:-regions}
  key=$(python3 -c 'from ds_adaptive.planning.devices import detect_device_name, gpu_spec; s = gpu_spec(detect_device_name()); print(s.key if s else "gpu")') || return 1
  prof=ds_adaptive/planning/profiles/$key-wan2.1-1.3b.json
  [ -f "$prof" ] || { echo "calfusion: no shipped profile $prof"; return 1; }
  python3 -m ds_adaptive.cli calibrate --model wan2.1-1.3b --sp 1 --ln-modulate fused --block-fusion "$mode" \
    --out "$OUT/cal_fusion_$mode.json" --name "$key-wan2.1-1.3b" ${CALFUSION_ARGS:-} 2>&1 | tail -n 40 || return 1
  python3 -m ds_adaptive.cli.autocalibrate ship "$OUT/cal_fusion_$mode.json" "$prof" --replace || return 1
  cp "$prof" "$OUT/" && python3 - "$prof" "$mode" <<'PY'
import sys
from ds_adaptive.planning.cost import load_profile
base = load_profile(sys.argv[1])
fused, note = base.for_block_fusion(sys.argv[2])
print(note)
comp = base.raw["block_fusion_variants"][sys.argv[2]]["compute"]   # the calibration's (used with its own overheads only)
print(f"block_full KiB/token: eager {base.block_full_gib[1] * 2**20:.1f}, {sys.argv[2]} {fused.block_full_gib[1] * 2**20:.1f} "
      f"({fused.block_full_gib[1] / base.block_full_gib[1]:.3f}x); calibrated ms at 1 x 32,760 tokens: "
      f"{comp['c0_ms'] + comp['a_ms_per_token'] * 32760 + comp['b_ms_per_token2'] * 32760**2:.0f} vs the profile's "
      f"{base.c0_ms + base.a_ms_per_token * 32760 + base.b_ms_per_token2 * 32760**2:.0f}")
PY
}
export -f do_env do_build do_tests do_bench do_host do_train do_train_same do_ti2v do_defaultjob do_lora do_mfu \
  do_pertoken do_firstuse do_levers do_keepattn do_trainprofile do_calfusion do_attn do_setab do_sparseab
export OUT
declare -A LIMIT=([env]=60 [build]=300 [tests]=480 [bench]=420 [train]=400 [host]=240 [train_same]=400
                  [ti2v]=560 [defaultjob]=960 [lora]=$(( ${LORA_TOTAL_S:-420} + 30 )) [mfu]=300 [pertoken]=240 [firstuse]=560 [levers]=560 [keepattn]=560 [trainprofile]=300
                  [calfusion]=400 [attn]=200 [setab]=560 [sparseab]=1200)

for s in $STEPS; do
  limit=${STEP_LIMIT:-${LIMIT[$s]:-300}}
  if [ -n "${TOTAL_S:-}" ]; then   # the whole script's budget: a late step gets what is left, or is skipped
    left=$(( TOTAL_S - SECONDS ))
    if (( left < ${MIN_STEP_S:-90} )); then
      STATUS[$s]="skipped: ${left}s of TOTAL_S=${TOTAL_S} left"; note "step $s: ${STATUS[$s]}"; continue
    fi
    (( limit > left )) && limit=$left
  fi
  run_step "$s" "$limit" "do_$s" || true
done

echo
note "summary:"
for s in $STEPS; do note "  $s: ${STATUS[$s]:-not run}"; done
if [ -f "$OUT/bench.log" ]; then
  echo
  sed -n '/^LayerNorm-Modulate, /,$p' "$OUT/bench.log"
fi
if [ -f "$OUT/tests.log" ]; then
  echo
  tail -n 15 "$OUT/tests.log"
fi
