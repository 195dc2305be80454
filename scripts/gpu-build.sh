#!/usr/bin/env bash
# Build, here (no GPU needed), everything the GPU check runs, into the git-ignored .gpu/ folder
# (or the folder given as the first argument, e.g. .gpu-branch to carry two builds in one call):
# the GPU test executables (every crates/gdn/tests/gpu_*.rs), the `gdn` binary and the GPU
# benchmarks. Then, on the device machine:
#   bash scripts/gpu-check.sh      (carry .gpu, and .whl for the FLA anchor; GPU_DIR=.gpu-x for another)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.gpu}
mkdir -p "$dest"
rm -f "$dest"/test-* "$dest"/gdn "$dest"/bench_* "$dest"/gdn2_rule_io
json=$(cargo test --release -p gdn --no-run --message-format=json 2>/dev/null)
for f in crates/gdn/tests/gpu_*.rs; do
    t=$(basename "$f" .rs)
    exe=$(echo "$json" | grep "\"name\":\"$t\"" | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -1)
    if [ -n "$exe" ]; then cp "$exe" "$dest/test-$t"; fi
done
cargo build --release -p gdn-cli
cp target/release/gdn "$dest/gdn"
if ls crates/gdn/examples/bench_*.rs >/dev/null 2>&1; then
    for f in crates/gdn/examples/bench_*.rs; do
        n=$(basename "$f" .rs)
        cargo build --release -p gdn --example "$n"
        cp "target/release/examples/$n" "$dest/$n"
    done
fi
# The GDN2 rule on safetensors inputs (bench/gdn2_accuracy.py, FLA's accuracy beside ours).
cargo build --release -p gdn --example gdn2_rule_io
cp target/release/examples/gdn2_rule_io "$dest/gdn2_rule_io"
cp bench/gdn2_accuracy.py "$dest"/
strip "$dest"/test-* "$dest"/gdn "$dest"/bench_* "$dest"/gdn2_rule_io 2>/dev/null || true
# Every kernel compiled here for the H200 (sm_90a) with NVRTC from .ci/cuda (as .ci/run installs
# it), PTX and CUBIN, packed as kcache.tgz: scripts/device-steps.sh unpacks it into the kernel cache there, so no
# device time goes to NVRTC (the cache key holds the source, options and NVRTC's version).
if [ -f .ci/cuda/nvidia/cu13/lib/libnvrtc.so.13 ]; then
    # a persistent cache here (only changed modules compile again); the archive holds just the
    # files of the current sources
    kc="$PWD/target/gpu-kcache"
    list=$(mktemp)
    LD_LIBRARY_PATH="$PWD/.ci/cuda/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        GDN_KERNEL_CACHE="$kc/kcache" "$dest/gdn" kernels --arch sm_90a > "$list"
    tail -1 "$list"
    # each module's PTX and, beside it, the CUBIN NVRTC assembled (loaded without the driver's JIT)
    grep -o '[^/ ]*\.ptx$' "$list" | sort -u | while read -r f; do
        echo "kcache/$f"
        c="${f%.ptx}.cubin"
        if [ -f "$kc/kcache/$c" ]; then echo "kcache/$c"; fi
    done > "$list.files"
    tar -czf "$dest/kcache.tgz" -C "$kc" -T "$list.files"
    rm -f "$list" "$list.files"
else
    echo "no NVRTC in .ci/cuda: kernels will compile on the device (see .ci/run to install it)"
fi
cp /work/shared/bench/fla_anchor.py "$dest"/ 2>/dev/null || cp ../shared/bench/fla_anchor.py "$dest"/ 2>/dev/null || true
cp bench/fla_layer_json.py "$dest"/
du -sh "$dest"
ls "$dest"
