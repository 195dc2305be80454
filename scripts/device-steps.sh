#!/usr/bin/env bash
# On the device machine: run a list of steps in one call and log each under $OUT.
#   STEPS=file BUDGET=seconds GPU_DIR=.gpu bash scripts/device-steps.sh
# STEPS holds lines `name|timeout_s|shell command` (blank lines and `#` comments skipped); the
# command runs from the repository root with $G set to the GPU build (scripts/gpu-build.sh DIR).
# A step is skipped when fewer than its timeout seconds remain of BUDGET, so the call ends
# before the device tool's per-call limit with every finished step's log intact.
# Each step's full log goes into $OUT/logs.tgz (NAME.log; the device tool brings back only a few
# files per call, so one archive); $OUT/summary.txt has rc, seconds and the test-result lines of
# every step, and is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export GDN_KERNEL_CACHE=${GDN_KERNEL_CACHE:-/tmp/gdn-kernels}
export G=${GPU_DIR:-.gpu}
OUT=${OUT:-/tmp/gdn-out}
mkdir -p "$OUT"
# Kernels compiled ahead by scripts/gpu-build.sh, if carried.
if [ -f "$G/kcache.tgz" ]; then
    mkdir -p "$GDN_KERNEL_CACHE" && tar -xzf "$G/kcache.tgz" -C "$GDN_KERNEL_CACHE" --strip-components=1
fi
logs=$(mktemp -d)
budget=${BUDGET:-560}
start=$(date +%s)
summary="$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > "$summary" 2>&1
while IFS='|' read -r name limit cmd; do
    case "$name" in ''|'#'*) continue ;; esac
    left=$((budget - ($(date +%s) - start)))
    if [ "$left" -lt "$limit" ]; then
        echo "$name: skipped ($left s left of the budget, step needs $limit)" >> "$summary"
        continue
    fi
    t0=$(date +%s)
    OUT=$logs timeout "$limit" bash -c "$cmd" > "$logs/$name.log" 2>&1
    rc=$?
    {
        echo "$name: rc=$rc $(($(date +%s) - t0)) s"
        grep -E "^test result|panicked|FAILED|^failures:" "$logs/$name.log" | head -8
    } >> "$summary"
    tar -czf "$OUT/logs.tgz" -C "$logs" .
done < "${STEPS:?STEPS names the steps file}"
cat "$summary"
