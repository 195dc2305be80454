#!/usr/bin/env bash
# Issue 13, stage A, on the device machine, after `scripts/gpu-build.sh [DIR]` built the binaries
# here (carry DIR; GPU_DIR=DIR if it is not .gpu). In order, everything logged under $OUT:
#   1. bench_rule chain     the scan's latency floor: v6's chain kernel (one CTA, 512 dependent
#                           chunk steps, 1/2/4/8 warps) and one CTA of the v5 / v6 scans, us/step
#   2. bench_rule variants  v5 vs v6 forward (every v6 CTA width, cp.async and bulk copies) at B1 T32768 16/32 and
#                           B8 T4096 16/16: CUDA events, medians, per-kernel times, o v6 vs v5
#   3. test-gpu_rule        every rule GPU test (v6's own: both load paths, 2 and 3 stages), then
#                           the bf16 tests again with GDN_RULE_FWD=v6b (bulk-copy loads)
# The first process compiles the kernels (NVRTC, cached in $GDN_KERNEL_CACHE for the others).
# Expected device time: ~1 min of compilation, ~1 min of benchmarks, ~1.5 min of tests.
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export GDN_KERNEL_CACHE=${GDN_KERNEL_CACHE:-/tmp/gdn-kernels}
OUT=${OUT:-/tmp/gdn-out}
mkdir -p "$OUT"
g=${GPU_DIR:-.gpu}
table=""
step() { # name, timeout seconds, command...
    local name=$1 limit=$2
    shift 2
    local start rc ms
    start=$(date +%s%N)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    ms=$((($(date +%s%N) - start) / 1000000))
    table+=$(printf '%-26s rc=%-3s %7d ms' "$name" "$rc" "$ms")$'\n'
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
step rule-chain 240 "$g/bench_rule" chain
grep -E "^bench-chain" "$OUT/rule-chain.log"
tail -3 "$OUT/rule-chain.log" | grep -vE "^bench-chain"
step rule-variants 240 "$g/bench_rule" variants
grep -E "^bench-variants" "$OUT/rule-variants.log" | cut -c1-400
tail -3 "$OUT/rule-variants.log" | grep -vE "^bench-variants"
step test-gpu_rule 300 "$g/test-gpu_rule" --include-ignored --test-threads=1 --nocapture
grep -E "gdr-check (v6|chain6)|^test |panicked|test result" "$OUT/test-gpu_rule.log" | cut -c1-300
step test-gpu_rule-env-v6b 240 env GDN_RULE_FWD=v6b "$g/test-gpu_rule" --include-ignored --test-threads=1 --nocapture bf16 two_runs
grep -E "gdr-check bf16|^test |panicked|test result" "$OUT/test-gpu_rule-env-v6b.log" | cut -c1-300
echo "================ summary"
printf '%s' "$table"
