#!/usr/bin/env bash
# On the device machine: run every GPU test (ignored on CI) and the GPU benchmarks built by
# scripts/gpu-build.sh, write full logs under $OUT, and print a short table last.
#   usage: bash scripts/gpu-check.sh [tests|bench|all]   (default all)
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export GDN_KERNEL_CACHE=/tmp/gdn-kernels
OUT=${OUT:-/tmp/gdn-out}
mkdir -p "$OUT"
what=${1:-all}
# The build to run (scripts/gpu-build.sh DIR); .gpu unless GPU_DIR says otherwise.
g=${GPU_DIR:-.gpu}
table=""
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "$what" = all ] || [ "$what" = tests ]; then
    for t in $g/test-*; do
        name=$(basename "$t")
        start=$(date +%s%N)
        "$t" --include-ignored --test-threads=1 --nocapture > "$OUT/$name.log" 2>&1
        rc=$?
        ms=$((($(date +%s%N) - start) / 1000000))
        res=$(grep -E "^test result" "$OUT/$name.log" | tail -1)
        table+=$(printf '%-22s rc=%-3s %7d ms  %s' "$name" "$rc" "$ms" "$res")$'\n'
        grep -E "panicked|FAILED" "$OUT/$name.log" | head -5
    done
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
    if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    fi
    # gdn bench on the default shapes (1x32768, 4x8192); with FLA's wheels, FLA's layer and rule
    # on the same shapes first, and the ratio ours/FLA per row. FLA's first run on a fresh machine
    # spends minutes compiling and autotuning its Triton kernels (over 200 s seen on the H200).
    fla=()
    if [ -d .whl ] && [ -f $g/fla_layer_json.py ]; then
        PYTHONUNBUFFERED=1 timeout 420 python3 $g/fla_layer_json.py --out "$OUT/fla_layer.json" 1x32768 4x8192 > "$OUT/fla_layer.log" 2>&1
        rc=$?
        table+="fla_layer_json: rc=$rc"$'\n'
        tail -5 "$OUT/fla_layer.log"
        if [ $rc -eq 0 ]; then fla=(--fla-json "$OUT/fla_layer.json"); fi
    fi
    timeout 300 $g/gdn bench --device cuda --shape 1x32768 --shape 4x8192 --json "$OUT/gdn_bench.json" "${fla[@]}" > "$OUT/gdn_bench.log" 2> "$OUT/gdn_bench.err"
    table+="gdn bench: rc=$?"$'\n'
    cat "$OUT/gdn_bench.log"; tail -5 "$OUT/gdn_bench.err"
    for b in $g/bench_*; do
        [ -x "$b" ] || continue
        "$b" > "$OUT/$(basename "$b").log" 2>&1
        table+="$(basename "$b"): rc=$?"$'\n'
        tail -25 "$OUT/$(basename "$b").log"
    done
    if [ -d .whl ]; then
        PYTHONUNBUFFERED=1 python3 $g/fla_anchor.py > "$OUT/fla_anchor.log" 2>&1
        table+="fla_anchor: rc=$?"$'\n'
        tail -15 "$OUT/fla_anchor.log"
    fi
fi
echo "================ summary"
printf '%s' "$table"
