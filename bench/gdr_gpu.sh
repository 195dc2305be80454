#!/bin/bash
# Device-machine run of the CUDA gated delta rule: every GPU test in its own process (a kernel
# fault cannot hide the other results), then the timing example. Build here first:
#   cargo test -p gdn --release --test gpu_rule --no-run && cargo build -p gdn --release --example bench_rule
#   mkdir -p .gpu/gdr && cp <gpu_rule test binary> .gpu/gdr/gpu_rule && cp target/release/examples/bench_rule .gpu/gdr/ && strip .gpu/gdr/*
# and carry .gpu/gdr. Logs go to $OUT/gdr_tests.log and $OUT/gdr_bench.log; the summary is printed last.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH
OUT=${OUT:-/tmp/gdr_out}; mkdir -p "$OUT" /tmp/gdr_logs
B=$(cd "$(dirname "$0")/.." && pwd)/.gpu/gdr
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
T=$B/gpu_rule
# first test alone: compiles the kernels (NVRTC + driver JIT) and fills both caches
timeout 200 $T --include-ignored --exact bad_inputs_are_errors --nocapture > /tmp/gdr_logs/0.log 2>&1; echo "bad_inputs_are_errors rc=$?" > /tmp/gdr_logs/rc.txt
$T --list --ignored 2>/dev/null | grep ': test' | sed 's/: test//' | grep -v bad_inputs_are_errors > /tmp/gdr_logs/list
xargs -P 6 -I{} sh -c "timeout 240 $T --include-ignored --exact {} --nocapture > /tmp/gdr_logs/{}.log 2>&1; echo {} rc=\$? >> /tmp/gdr_logs/rc.txt" < /tmp/gdr_logs/list
cat /tmp/gdr_logs/*.log > $OUT/gdr_tests.log
timeout 200 $B/bench_rule > $OUT/gdr_bench.log 2>&1; echo "bench rc=$?" >> /tmp/gdr_logs/rc.txt
echo "=== tests"; grep -hE "gdr-check|panicked|: .*>|unwritten|padding|differ" $OUT/gdr_tests.log | cut -c1-400
echo "=== rc"; cat /tmp/gdr_logs/rc.txt
echo "=== bench"; cat $OUT/gdr_bench.log | cut -c1-400
