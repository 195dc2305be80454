#!/usr/bin/env bash
# On the device machine: hardware counters (ncu, clocks left alone) for the layer's own kernels
# (prep, conv, gated norm, rule, ...) in one forward + backward of `gdn bench` on one shape.
#   usage: GPU_DIR=.gpu-X OUT=... bash scripts/ncu-layer.sh [SHAPE] [KERNEL_REGEX] [COUNT]
# Writes $OUT/ncu-SHAPE.csv (one row per kernel launch, the metrics below plus the warp-state
# section) and prints a short table. GEMMs (cuBLASLt) are left out by the default regex.
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export GDN_KERNEL_CACHE=/tmp/gdn-kernels
OUT=${OUT:-/tmp/gdn-out}
mkdir -p "$OUT"
g=${GPU_DIR:-.gpu}
shape=${1:-1x32768}
regex=${2:-'^(prep|gn_|gdr_|conv1d|l2norm|gates|emb|ce_|swiglu|add|adamw|cast|take|concat)'}
count=${3:-60}
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__block_size,launch__shared_mem_per_block_dynamic,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum
timeout "${NCU_TIMEOUT:-400}" "$ncu" --clock-control none --metrics "$metrics" --section WarpStateStats \
    -k "regex:$regex" -c "$count" --csv --page raw \
    "$g/gdn" bench --device cuda --shape "$shape" --reps 1 --warmup 0 \
    > "$OUT/ncu-$shape.csv" 2> "$OUT/ncu-$shape.err"
echo "ncu rc=$?"
tail -3 "$OUT/ncu-$shape.err"
python3 - "$OUT/ncu-$shape.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
hdr_i = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
hdr = rows[hdr_i]; data = rows[hdr_i + 2:]
col = {n: hdr.index(n) for n in hdr}
def g(r, n):
    return r[col[n]] if n in col else "?"
print(f"{'kernel':28} {'us':>9} {'rdMB':>8} {'wrMB':>8} {'dram%':>6} {'sm%':>6} {'tc%':>6} {'occ%':>6} {'regs':>4} grid/block")
for r in data:
    try:
        us = float(g(r, "gpu__time_duration.sum")) / 1e3
        rd = float(g(r, "dram__bytes_read.sum")) / 1e6
        wr = float(g(r, "dram__bytes_write.sum")) / 1e6
    except ValueError:
        continue
    print(f"{g(r,'Kernel Name')[:28]:28} {us:9.1f} {rd:8.1f} {wr:8.1f} {g(r,'dram__throughput.avg.pct_of_peak_sustained_elapsed')[:6]:>6} {g(r,'sm__throughput.avg.pct_of_peak_sustained_elapsed')[:6]:>6} {g(r,'sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active')[:6]:>6} {g(r,'sm__warps_active.avg.pct_of_peak_sustained_active')[:6]:>6} {g(r,'launch__registers_per_thread'):>4} {g(r,'launch__grid_size')}/{g(r,'launch__block_size')}")
PY
