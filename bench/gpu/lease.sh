#!/usr/bin/env bash
# A GPU job longer than one device-tool call (10 minutes), run over several back-to-back calls on one warm machine.
# `start` launches the command in its own process session (setsid: it outlives the call that started it), then
# waits like `wait`; `wait` waits until the command ends or WAIT_S (default 570) seconds pass, then packs the job's
# folder ($BG, default /tmp/lease: the log, the exit status and whatever the command wrote under $BG/out) into one
# archive, $OUT/lease.tgz (the tool returns only a few files per call), and prints the log's tail. Call `wait` again
# at once after a call returns: a machine left idle for its warm period is given back and the job ends with it.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600,
#       command="bash bench/gpu/lease.sh start env OUT=/tmp/lease/out STEPS='env build tests' bash bench/gpu/gpu_check.sh")
#   run(timeout_s=600, command="bash bench/gpu/lease.sh wait")        (until it prints "done")
# Exit status: the command's once it has ended, 99 while it still runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
BG=${BG:-/tmp/lease}
OUT=${OUT:-bench/out/lease}
export BG BG_RC="$BG/rc"
mode=${1:-}
shift || true
case $mode in
  start)
    [ $# -gt 0 ] || { echo "lease.sh start: name the command to run"; exit 2; }
    rm -rf "$BG"; mkdir -p "$BG/out"
    date +%s > "$BG/started"
    setsid nohup bash -c '"$@"; echo $? > "$BG_RC"' lease "$@" > "$BG/log" 2>&1 < /dev/null &
    ;;
  wait) [ -d "$BG" ] || { echo "lease.sh wait: no job in $BG (the machine was given back?)"; exit 2; } ;;
  *) echo "usage: lease.sh start CMD... | lease.sh wait"; exit 2 ;;
esac
deadline=$(( SECONDS + ${WAIT_S:-570} ))
while [ ! -f "$BG/rc" ] && (( SECONDS < deadline )); do sleep 5; done
mkdir -p "$OUT"
tar czf "$OUT/lease.tgz" -C "$BG" . 2>/dev/null
tail -n "${TAIL:-60}" "$BG/log"
elapsed=$(( $(date +%s) - $(cat "$BG/started") ))
if [ -f "$BG/rc" ]; then
  echo "[lease] done: rc=$(cat "$BG/rc") after ${elapsed}s"
  exit "$(cat "$BG/rc")"
fi
echo "[lease] still running after ${elapsed}s: call 'bash bench/gpu/lease.sh wait' again now"
exit 99
