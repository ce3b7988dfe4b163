#!/usr/bin/env bash
# GPU node: calibrate the cost/memory profiles of Wan 1.3B and 14B on this GPU and check that
# the calibrated model predicts real fwd+bwd time (Pearson r, bench/planner/cost_fit.py).
# Outputs (profiles, cost_fit json/png, log) go to $OUT (default bench/out/gpu_profile).
#   run(kind="nvidia-h100-x1", carry=[".whl"], command="bash bench/gpu/gpu_profile.sh")
# Knobs: STEPS (subset of "cal13 cal14 fit"), FIT_ARGS (extra args for bench/planner/cost_fit.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out/gpu_profile}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1
  export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
else
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
GPU=$(python3 -c 'import torch; n=torch.cuda.get_device_name(0); print("h100" if "H100" in n else "h200" if "H200" in n else "gpu")')
STEPS=${STEPS:-cal13 cal14 fit}
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T), limit ${limit}s): $*"; local t0=$SECONDS
  timeout "$limit" "$@"; echo "=== $name rc=$? in $((SECONDS - t0)) s"; }
for s in $STEPS; do case $s in
  cal13) step cal13 200 ds-adaptive calibrate --model wan2.1-1.3b --sp 1 --device cuda --layers 2,4 \
           --name $GPU-wan2.1-1.3b --out "$OUT/$GPU-wan2.1-1.3b.json" ;;
  cal14) step cal14 240 ds-adaptive calibrate --model wan2.1-14b --sp 1 --device cuda --layers 1,2 \
           --name $GPU-wan2.1-14b --out "$OUT/$GPU-wan2.1-14b.json" ;;
  fit)   P=$OUT/$GPU-wan2.1-1.3b.json; [ -f "$P" ] || P=ds_adaptive/planning/profiles/h100-wan2.1-1.3b.json
         step fit 240 python3 bench/planner/cost_fit.py --model wan2.1-1.3b --layers 4 --profile "$P" \
           --batches 24 --iters 2 --out "$OUT/cost_fit_${GPU}_1.3b" ${FIT_ARGS:-} ;;
esac; done
ls -la "$OUT"
