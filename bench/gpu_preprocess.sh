#!/usr/bin/env bash
# One device call: preprocess throughput (bench/preprocess.py) on an H200. Run from the synced tree:
#   rsync -a --delete --exclude .git /work/wt/issue17/ /work/main/.gpu/issue17/
#   carry [".gpu/issue17", ".gpu/issue17-whl", ".whl"]; command: bash .gpu/issue17/bench/gpu_preprocess.sh
# .gpu/issue17-whl holds the wheels the GPU image lacks: av (PyAV, bundles FFmpeg), ftfy, wcwidth.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl .gpu/issue17-whl/*.whl || exit 1
cd .gpu/issue17 || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/log.txt"
git_rev=$(cat .commit 2>/dev/null || echo unknown); echo "commit $git_rev" | tee -a "$OUT/log.txt"
python3 bench/preprocess.py --out-json "$OUT/preprocess_bench.json" --clips-480 12 --clips-720 8 --workers 8 \
    2>&1 | grep -v "it/s\]" | tee -a "$OUT/log.txt"
