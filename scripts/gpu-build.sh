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
rm -f "$dest"/test-* "$dest"/gdn "$dest"/bench_*
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
strip "$dest"/test-* "$dest"/gdn "$dest"/bench_* 2>/dev/null || true
cp /work/shared/bench/fla_anchor.py "$dest"/ 2>/dev/null || cp ../shared/bench/fla_anchor.py "$dest"/ 2>/dev/null || true
cp bench/fla_layer_json.py "$dest"/
du -sh "$dest"
ls "$dest"
