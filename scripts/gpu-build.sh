#!/usr/bin/env bash
# Build, here (no GPU needed), everything the GPU check runs, into the git-ignored .gpu/ folder:
# the GPU test executables, the `gdn` binary and the GPU benchmarks. Then, on the device machine:
#   bash scripts/gpu-check.sh      (carry .gpu, and .whl for the FLA anchor)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
rm -f .gpu/test-* .gpu/gdn .gpu/bench_*
json=$(cargo test --release -p gdn --no-run --message-format=json 2>/dev/null)
for t in gpu_smoke gpu_ops gpu_rule gpu_rule2 gpu_layer; do
    exe=$(echo "$json" | grep "\"name\":\"$t\"" | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -1)
    if [ -n "$exe" ]; then cp "$exe" ".gpu/test-$t"; fi
done
cargo build --release -p gdn-cli
cp target/release/gdn .gpu/gdn
if ls crates/gdn/examples/bench_*.rs >/dev/null 2>&1; then
    for f in crates/gdn/examples/bench_*.rs; do
        n=$(basename "$f" .rs)
        cargo build --release -p gdn --example "$n"
        cp "target/release/examples/$n" ".gpu/$n"
    done
fi
strip .gpu/test-* .gpu/gdn .gpu/bench_* 2>/dev/null || true
cp /work/shared/bench/fla_anchor.py .gpu/ 2>/dev/null || cp ../shared/bench/fla_anchor.py .gpu/ 2>/dev/null || true
cp bench/fla_layer_json.py .gpu/
du -sh .gpu
ls .gpu
