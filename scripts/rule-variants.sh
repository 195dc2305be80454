#!/usr/bin/env bash
# Issue 13, stage A, on the device machine, after `scripts/gpu-build.sh [DIR]` built the binaries
# here (carry DIR; GPU_DIR=DIR if it is not .gpu). In order, everything logged under $OUT:
#   1. test-gpu_rule        every rule GPU test (the v6 forward is the default; v6 forward's own
#                           tests: both load paths, 2 and 3 stages; the v6 backward's: every
#                           piece vs f64, bitwise, fallback; gdr_grad7's: vs f64 beside
#                           gdr_grad6, bitwise, vs gdr_grad6, fallback), then the bf16 tests
#                           again with GDN_RULE_BWD=v6 (gdr_grad6 + gdr_reduce_qk, the old
#                           default, through cuda::backward)
#   2. bench_rule bwd       v5 vs the v6 backward pieces (both, each alone, every CTA width) and
#                           v7 (gdr_grad7 instead of gdr_grad6, no gdr_reduce_qk) at B1
#                           T32768 16/32 and B8 T4096 16/16: backward ms, peak memory, per-kernel
#                           times, gradients vs v5
#   3. bench_rule           the fwd and fwd+bwd table (v6 forward), with the default backward (v6
#                           with gdr_grad7) and with GDN_RULE_BWD=v6 (gdr_grad6), per-kernel times
# (`bench_rule chain` and `bench_rule variants`, the v6 forward's measurements, are in
# bench/NOTES.md; not run here. The bf16 tests with GDN_RULE_FWD=v5 run the old forward.)
# The first process compiles the kernels (NVRTC, cached in $GDN_KERNEL_CACHE for the others).
# Expected device time: ~1.5 min of compilation, ~1.5 min of tests, ~1 min of benchmarks.
# Optional: RULE_EXTRA=1 also runs the bf16 tests with GDN_RULE_FWD=v5 and `bench_rule variants`.
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
step test-gpu_rule 300 "$g/test-gpu_rule" --include-ignored --test-threads=1 --nocapture
grep -E "gdr-check (v6|v7|chain6|default)|^test |panicked|test result" "$OUT/test-gpu_rule.log" | cut -c1-400
step test-gpu_rule-env-bwd-v6 200 env GDN_RULE_BWD=v6 "$g/test-gpu_rule" --include-ignored --test-threads=1 --nocapture bf16 two_runs
grep -E "gdr-check bf16|gdr-check bitwise|^test |panicked|test result" "$OUT/test-gpu_rule-env-bwd-v6.log" | cut -c1-300
step rule-bwd 200 "$g/bench_rule" bwd
grep -E "^bench-bwd" "$OUT/rule-bwd.log" | cut -c1-700
tail -3 "$OUT/rule-bwd.log" | grep -vE "^bench-bwd"
step rule-table 150 "$g/bench_rule"
grep -E "^bench-rule" "$OUT/rule-table.log" | cut -c1-900
step rule-table-bwd-v6 150 env GDN_RULE_BWD=v6 "$g/bench_rule"
grep -E "^bench-rule" "$OUT/rule-table-bwd-v6.log" | cut -c1-900
if [ "${RULE_EXTRA:-0}" = 1 ]; then
    step test-gpu_rule-env-fwd-v5 200 env GDN_RULE_FWD=v5 "$g/test-gpu_rule" --include-ignored --test-threads=1 --nocapture bf16 two_runs
    grep -E "gdr-check bf16|gdr-check bitwise|^test |panicked|test result" "$OUT/test-gpu_rule-env-fwd-v5.log" | cut -c1-300
    step rule-variants 200 "$g/bench_rule" variants
    grep -E "^bench-variants" "$OUT/rule-variants.log" | cut -c1-400
fi
echo "================ summary"
printf '%s' "$table"
