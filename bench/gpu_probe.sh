#!/usr/bin/env bash
# Kernel-configuration probe of the fused LayerNorm-Modulate op on a GPU node (benchmark only):
# builds bench/ln_modulate_probe.cu with nvcc (seconds; no torch extension build), times every
# variant under both L2 flushes, reads hardware counters of the per-token kernels with ncu (ours
# and torch.compile's), and saves inductor's generated code. Needs only torch, triton, nvcc, ncu.
#
#   run(kind="nvidia-h100-x1", timeout_s=600, command="bash bench/gpu_probe.sh")
#
# Outputs in $OUT (default bench/out/probe): probe.json / probe.log (timings), ncu_*.csv,
# inductor_*.py (generated code), build.log (ptxas resources).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out/probe}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ARCH=${ARCH:-"-gencode=arch=compute_90a,code=sm_90a"}
METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__block_size,launch__registers_per_thread,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,smsp__cycles_active.avg

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv | tee "$OUT/env.txt"
t0=$SECONDS
nvcc -O3 -std=c++17 $ARCH -Icsrc/ln_modulate -Xptxas -v bench/ln_modulate_probe.cu -o /tmp/lnm_probe \
  >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "probe built in $((SECONDS - t0)) s"

if [ "${SKIP_TIMING:-0}" != "1" ]; then
  timeout 240 /tmp/lnm_probe "$OUT/probe.json" | tee "$OUT/probe.log"
fi

if [ "${SKIP_NCU:-0}" != "1" ] && command -v ncu >/dev/null; then
  timeout 150 ncu --clock-control none --profile-from-start off --metrics "$METRICS" --csv \
    /tmp/lnm_probe "$OUT/probe_once.json" once >"$OUT/ncu_probe.csv" 2>"$OUT/ncu_probe.err"
  echo "ncu probe rc=$? ($(grep -c ln_mod "$OUT/ncu_probe.csv") rows)"
fi

for layout in token sample; do
  extra=""; [ "$layout" = sample ] && extra="--per-sample --B 16 --S 1560"
  timeout 180 python3 bench/ln_modulate_inductor.py $extra --time --code "$OUT/inductor_$layout.py" \
    2>&1 | grep -v Warning | tail -5 | tee -a "$OUT/inductor_times.txt"
  if [ "${SKIP_NCU:-0}" != "1" ] && command -v ncu >/dev/null; then
    timeout 150 ncu --clock-control none --profile-from-start off --metrics "$METRICS" --csv \
      python3 bench/ln_modulate_inductor.py $extra >"$OUT/ncu_inductor_$layout.csv" 2>"$OUT/ncu_inductor_$layout.err"
    echo "ncu inductor $layout rc=$?"
  fi
done

# memory instructions of inductor's kernels (PTX in its cache): cache hints, vector widths
find /tmp/torchinductor_* -name "*.ptx" 2>/dev/null | while read -r f; do
  echo "== $f"; grep -E "^\.visible \.entry|ld\.global|st\.global|createpolicy|cp\.async" "$f" | sed 's/^[ \t]*//' | sort | uniq -c | sort -rn | head -40
done > "$OUT/inductor_ptx_memops.txt"

# short summary: ncu per kernel (name, time, DRAM read/write MB, DRAM %, warps active %)
python3 - "$OUT" <<'EOF'
import csv, sys, glob, os, collections
out = sys.argv[1]
for f in sorted(glob.glob(os.path.join(out, "ncu_*.csv"))):
    rows = []
    with open(f) as fh:
        lines = [l for l in fh if l.startswith('"')]
    if not lines:
        print(f"{os.path.basename(f)}: no rows"); continue
    rd = csv.DictReader(lines)
    k = collections.OrderedDict()
    for r in rd:
        key = (r["ID"], r["Kernel Name"][:60])
        k.setdefault(key, {})[r["Metric Name"]] = (r["Metric Value"] + " " + r.get("Metric Unit", "")).strip()
    print(f"== {os.path.basename(f)}")
    for (i, name), m in k.items():
        g = lambda n: m.get(n, "?")
        print(f"  {i:>3} {name:<60} t={g('gpu__time_duration.sum')} rd={g('dram__bytes_read.sum')} "
              f"wr={g('dram__bytes_write.sum')} dram%={g('dram__throughput.avg.pct_of_peak_sustained_elapsed')} "
              f"warps%={g('sm__warps_active.avg.pct_of_peak_sustained_active')} grid={g('launch__grid_size')} "
              f"blk={g('launch__block_size')} regs={g('launch__registers_per_thread')}")
EOF
