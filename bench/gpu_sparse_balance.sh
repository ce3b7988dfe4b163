#!/usr/bin/env bash
# GPU node (issue 15): `ds-adaptive calibrate --sparse` (block-sparse kernel cost vs density) and the
# head-placement timing (per-rank attention time within an SP group of 4, identity vs balanced).
# Outputs (sparse profile json, head-placement json, log) go to $OUT (default bench/out/gpu_sparse_balance).
#   run(carry=[".gpu/issue15", ".whl"], command="cd .gpu/issue15 && bash bench/gpu_sparse_balance.sh")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out/gpu_sparse_balance}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
WHL=${WHL:-../../.whl}
if ls "$WHL"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl >"$OUT/pip.log" 2>&1
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
GPU=$(python3 -c 'import torch; n=torch.cuda.get_device_name(0); print("h100" if "H100" in n else "h200" if "H200" in n else "gpu")')
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T), limit ${limit}s): $*"; local t0=$SECONDS
  timeout "$limit" "$@"; echo "=== $name rc=$? in $((SECONDS - t0)) s"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
step calibrate_sparse 200 python3 -m ds_adaptive.cli calibrate --sparse --profile h100-wan2.1-1.3b \
  --seq-lens 32768,16384 --out "$OUT/${GPU}-wan2.1-1.3b-sparse.json"
step heads 200 python3 bench/sparse_heads_gpu.py --densities synthetic --layers 30 --heads 12 --sp 4 \
  --seq-len 32768 --out "$OUT/sparse_heads_${GPU}.json"
ls -la "$OUT"
