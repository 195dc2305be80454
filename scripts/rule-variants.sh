#!/usr/bin/env bash
# Issue 13 (and 17), on the device machine, after `scripts/gpu-build.sh [DIR]` built the binaries
# here (carry DIR; GPU_DIR=DIR if it is not .gpu). In order, everything logged under $OUT:
#   1. test-gpu_rule        every rule GPU test with the defaults (since 2026-12-02: prep7, the
#                           v6 forward with the lean loads, v6 backward with gdr_grad7),
#                           including prep7's and grad7's own tests (vs f64, bitwise, selection,
#                           fallback) and the old prep's (prep_v6_forward_backward_match_f64)
#   2. the bf16 tests again with GDN_RULE_PREP=v6 (the old prep, l2norm2 + prep6 + qk6, through
#      cuda::forward / backward) and with GDN_RULE_BWD=v6 (gdr_grad6 + gdr_reduce_qk)
#   3. bench_rule prep      v6's prep vs gdr_prep7 / gdr_prep7f at B1 T32768 16/32 and B8 T4096
#                           16/16: prep alone, v6 forward, v6 backward, per-kernel times
#   4. bench_rule bwd       v5 vs the v6 backward pieces and grad6 vs grad7 (every CTA width):
#                           backward ms, peak memory, per-kernel times, gradients vs v5
#   5. bench_rule           the fwd and fwd+bwd table with the defaults, then with the old
#                           defaults (GDN_RULE_PREP=v6 GDN_RULE_FWD=v6), GDN_RULE_PREP=v6 and
#                           GDN_RULE_BWD=v6
#   6. bench_rule2          GDN2: chunked vs token recurrence (and FLA's chunk_gdn2 figures)
# (`bench_rule chain` and `bench_rule variants`, the v6 forward's measurements, are in
# bench/NOTES.md; RULE_EXTRA=1 also runs them and the bf16 tests with GDN_RULE_FWD=v5.)
# The first process compiles the kernels (NVRTC, cached in $GDN_KERNEL_CACHE for the others).
# Expected device time: ~1.5 min of compilation, ~3 min of tests, ~2 min of benchmarks.
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
grep -E "gdr-check (v6|v7|chain6|default|prep)|^test |panicked|test result" "$OUT/test-gpu_rule.log" | cut -c1-400
for env in GDN_RULE_PREP=v6 GDN_RULE_BWD=v6; do
    step "test-gpu_rule-$env" 200 env "$env" "$g/test-gpu_rule" --include-ignored --test-threads=1 --nocapture bf16 two_runs
    grep -E "gdr-check bf16|gdr-check bitwise|^test |panicked|test result" "$OUT/test-gpu_rule-$env.log" | cut -c1-300
done
step rule-prep 200 "$g/bench_rule" prep
grep -E "^bench-prep" "$OUT/rule-prep.log" | cut -c1-700
step rule-bwd 200 "$g/bench_rule" bwd
grep -E "^bench-bwd" "$OUT/rule-bwd.log" | cut -c1-700
tail -3 "$OUT/rule-bwd.log" | grep -vE "^bench-bwd"
step rule-table 150 "$g/bench_rule"
grep -E "^bench-rule" "$OUT/rule-table.log" | cut -c1-900
for env in "GDN_RULE_PREP=v6 GDN_RULE_FWD=v6" GDN_RULE_PREP=v6 GDN_RULE_BWD=v6; do
    n=${env// /_}
    # shellcheck disable=SC2086 # $env holds one or two assignments
    step "rule-table-$n" 150 env $env "$g/bench_rule"
    grep -E "^bench-rule" "$OUT/rule-table-$n.log" | cut -c1-900
done
if [ -x "$g/bench_rule2" ]; then
    step rule2 150 "$g/bench_rule2"
    grep -E "^bench-rule2" "$OUT/rule2.log" | cut -c1-400
fi
if [ "${RULE_EXTRA:-0}" = 1 ]; then
    step test-gpu_rule-env-fwd-v5 200 env GDN_RULE_FWD=v5 "$g/test-gpu_rule" --include-ignored --test-threads=1 --nocapture bf16 two_runs
    grep -E "gdr-check bf16|gdr-check bitwise|^test |panicked|test result" "$OUT/test-gpu_rule-env-fwd-v5.log" | cut -c1-300
    step rule-variants 200 "$g/bench_rule" variants
    grep -E "^bench-variants" "$OUT/rule-variants.log" | cut -c1-400
    step rule-chain 200 "$g/bench_rule" chain
    grep -E "^bench-chain" "$OUT/rule-chain.log" | cut -c1-400
fi
echo "================ summary"
printf '%s' "$table"
