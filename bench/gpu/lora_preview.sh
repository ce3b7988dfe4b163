#!/usr/bin/env bash
# LoRA vs full fine-tuning on the 1.3B default job, each with a 480p preview of 5 Euler steps inside the run
# (bench/training/lora_preview.py; one GPU, ~3-4 min). Run from anywhere:
#
#   bash bench/gpu/lora_preview.sh [bench/training/lora_preview.py args ...]
#
# Through the device tool (one H200; carry a wheelhouse with peft and its dependencies, see below):
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=300, command="bash bench/gpu/lora_preview.sh")
# Wheelhouse (on the CPU machine, from the project root):
#   EXTRA_WHEELS="peft==0.21.2 transformers==5.24.0 huggingface_hub==2.4.0 tokenizers==0.23.3 accelerate==1.15.0 \
#     safetensors regex pyyaml psutil packaging tqdm filelock fsspec hf-xet httpx2 httpcore2 h11 anyio idna click \
#     typer rich shellingham pygments markdown-it-py mdurl annotated-doc truststore" bash ../shared/gpu/wheelhouse.sh
#
# Outputs in $OUT (default bench/out/lora_preview): lora_preview.json, lora_preview.txt, build.log, pip.log, and
# each arm's log.txt; the arms' logs and previews stay in $WORK (default /tmp/lora_preview_runs).
# Knobs: OUT, WORK, WHEELS (default .whl; none: skip), TOTAL_S (whole script, default 240), PYTHON, BUILD_S (time
# to load or JIT-build the fused op, default 45 s: a warm TORCH_EXTENSIONS_DIR loads in seconds; when it does not
# load in time both arms run the reference LayerNorm path, the profile's matching variant plans them).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out/lora_preview}
WORK=${WORK:-/tmp/lora_preview_runs}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
note() { echo "[lora_preview.sh $(date +%H:%M:%S) +$((SECONDS))s] $*"; }

source bench/gpu/bench_env.sh   # wheelhouse -> /tmp/site, PYTHONPATH, the GPU
"$PY" -c "import peft" 2>/dev/null || { note "peft is not importable: build the wheelhouse with EXTRA_WHEELS (see the header)"; exit 2; }

FUSED=()
note "loading the fused LayerNorm-Modulate op (cached in $TORCH_EXTENSIONS_DIR; up to ${BUILD_S:-45} s)"
if timeout "${BUILD_S:-45}" "$PY" -m ds_adaptive.cli report --load >"$OUT/build.log" 2>&1; then
  note "fused op ready"
else
  note "the fused op did not load in time (see build.log): both arms run the reference LayerNorm path"
  FUSED=(--no-fused)
fi
DEADLINE=$(( ${TOTAL_S:-240} - SECONDS - 10 ))
(( DEADLINE < 60 )) && DEADLINE=60
"$PY" bench/training/lora_preview.py --out "$OUT/lora_preview.json" --work-dir "$WORK" --deadline-s "$DEADLINE" \
  ${FUSED[@]+"${FUSED[@]}"} "$@" | tee "$OUT/lora_preview.txt"
rc=${PIPESTATUS[0]}
for a in "$WORK"/*/; do [ -f "$a/log.txt" ] && cp "$a/log.txt" "$OUT/$(basename "$a")_log.txt"; done
note "done (rc=$rc)"
exit $rc
