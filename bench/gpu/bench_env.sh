# Sourced by the bench launchers (bench/gpu/e2e.sh, bench/gpu/lora_preview.sh) after they set PY, OUT and note():
# installs the offline wheelhouse WHEELS (default .whl; WHEELS=none: use the installed packages) into /tmp/site
# and puts it and the repository on PYTHONPATH; then prints the GPU.
WHEELS=${WHEELS:-.whl}
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    >"$OUT/pip.log" 2>&1 || note "wheelhouse install failed (see pip.log)"
  export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
  export PATH=/tmp/site/bin:$PATH   # the wheels' scripts (the `deepspeed` launcher of launch/train_wan.sh)
else
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv,noheader
