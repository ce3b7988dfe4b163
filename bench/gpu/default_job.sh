#!/usr/bin/env bash
# The shipped default job on one GPU node, the way users run it (`bash launch/train_wan.sh`), and the same job with
# the run features on (EMA + validation, one config change): tokens/s, MFU, peak memory, OOMs and samples per
# optimizer step against the config's sampler.global_batch, from each run's summary.json. Run from the repository
# root (through the device tool: carry the wheelhouse of ../shared/gpu/wheelhouse.sh):
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="OUT=$OUT bash bench/gpu/default_job.sh")
# Knobs: STEPS (default 22), ARMS (default "shipped features"), OUT (default bench/out/default_job).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out/default_job}
PY=python3
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
note() { echo "[default_job $(date +%H:%M:%S)] $*"; }
source bench/gpu/bench_env.sh
STEPS=${STEPS:-22}
BASE=launch/configs/zero3_adaptive.json
for arm in ${ARMS:-shipped features}; do
  cfg=$BASE
  if [[ $arm == features ]]; then   # EMA of every weight + validation on a held-out split, every 10 steps
    cfg=$OUT/features.json
    "$PY" - "$BASE" "$cfg" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["adaptive_load"]["ema"] = {"decay": 0.999}
c["adaptive_load"]["validation"] = {"samples": 32, "every": 10}
json.dump(c, open(sys.argv[2], "w"), indent=2)
PY
  fi
  note "arm $arm: $STEPS steps, $cfg"
  STEPS=$STEPS DS_CONFIG=$cfg SAVE_DIR= timeout ${ARM_LIMIT:-270} bash launch/train_wan.sh --log-dir "$OUT/$arm" \
    > "$OUT/$arm.log" 2>&1
  note "arm $arm: exit $?"
  grep -E "tokens/s|MFU|peak|OOM|samples per|global batch|validation" "$OUT/$arm.log" | tail -14
done
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1]); rows = {}
for arm in ("shipped", "features"):
    p = out / arm / "summary.json"
    if p.exists():
        s = json.loads(p.read_text()); rows[arm] = s
        keys = ("steps", "tokens_per_s", "mfu", "peak_mem_gib", "peak_mem_frac", "samples_per_step", "tokens_per_step",
                "global_batch", "gradient_accumulation_steps", "nonfinite_steps", "validation_loss", "validation_loss_ema")
        print(arm, {k: s.get(k) for k in keys})
json.dump(rows, open(out / "default_job.json", "w"), indent=1, default=str)
PY
