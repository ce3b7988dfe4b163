set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
mkdir -p $OUT/bfk
timeout 280 python3 bench/block_fusion_kernels.py --out $OUT/bfk/block_fusion_kernels.json 2>&1 | grep -v Warning | tail -40
timeout 200 python3 -m pytest tests/gpu/test_qk_norm_rope_gpu.py tests/gpu/test_fusion_gpu.py -q -x -p no:cacheprovider 2>&1 | tail -15
ls -la $OUT/bfk
