#!/usr/bin/env bash
# On the device machine, after `bash scripts/gpu-build.sh DIR` here (it copies every
# examples/bench_*.rs binary, bench_decode among them, into DIR): the decode benchmarks of
# issue 14, ours next to FLA's on the same shapes, logs under $OUT. About 1-3 minutes (FLA's
# first call compiles its Triton kernel).
#   usage: GPU_DIR=.gpu bash scripts/decode-bench.sh     (carry DIR, and .whl for FLA)
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export GDN_KERNEL_CACHE=${GDN_KERNEL_CACHE:-/tmp/gdn-kernels}
OUT=${OUT:-/tmp/gdn-out}
mkdir -p "$OUT"
g=${GPU_DIR:-.gpu}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 200 "$g/bench_decode" > "$OUT/bench_decode.log" 2>&1
echo "bench_decode: rc=$?"
grep -v '^json:' "$OUT/bench_decode.log"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    PYTHONUNBUFFERED=1 timeout 240 python3 bench/fla_decode.py --out "$OUT/fla_decode.json" > "$OUT/fla_decode.log" 2>&1
    echo "fla_decode: rc=$?"
    grep -v '^{' "$OUT/fla_decode.log" | tail -8
else
    echo "fla_decode: skipped (no .whl/ with FLA's wheels)"
fi
