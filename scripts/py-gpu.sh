#!/usr/bin/env bash
# On the device machine (PyTorch installed, no internet): install the gdn wheel built here
# (cd crates/gdn-py && maturin build --release -> target/wheels/gdn-*-abi3-*.whl; carry
# target/wheels, or set GDN_WHEEL) and FLA's wheels (.whl/), then run the Python GPU tests
# (gradcheck in float64 on CPU tensors, CUDA results vs the Rust API, no copies, streams) and
# the FLA parity harness. Logs under $OUT.
#   usage: bash scripts/py-gpu.sh [tests|parity|all]   (default all)
# From the lead's machine: build here `(cd crates/gdn-py && maturin build --release)`, then on the
# device: `bash scripts/py-gpu.sh all` with carry = target/wheels, .whl and .gpu (.gpu/gdn is the
# Rust API the CUDA layer test compares with; without it that one test is skipped), timeout 600:
# FLA's first run spends minutes compiling its Triton kernels.
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export GDN_KERNEL_CACHE=${GDN_KERNEL_CACHE:-/tmp/gdn-kernels}
OUT=${OUT:-/tmp/gdn-out}
mkdir -p "$OUT"
what=${1:-all}
wheel=${GDN_WHEEL:-$(ls -t target/wheels/gdn-*-abi3-*.whl .whl/gdn-*-abi3-*.whl 2>/dev/null | head -1)}
if [ -z "$wheel" ]; then
    echo "py-gpu: no gdn wheel (build it with: cd crates/gdn-py && maturin build --release)" >&2
    exit 2
fi
SITE=/tmp/gdn-pysite
rm -rf "$SITE"
python3 -m pip install -q --no-index --no-deps --target "$SITE" "$wheel" || exit 2
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl
fi
export PYTHONPATH="$SITE:$PWD/crates/gdn-py/tests${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, gdn; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'gdn', gdn.__file__)"
rc=0
if [ "$what" = all ] || [ "$what" = tests ]; then
    python3 -m unittest -v test_core test_torch_gpu 2>&1 | tee "$OUT/py-tests.log" | tail -40
    rc=${PIPESTATUS[0]}
fi
if [ "$what" = all ] || [ "$what" = parity ]; then
    PYTHONUNBUFFERED=1 timeout 480 python3 bench/parity_fla.py 2>&1 | tee "$OUT/parity_fla.log" | tail -30
    prc=${PIPESTATUS[0]}
    [ $prc -ne 0 ] && rc=$prc
fi
exit $rc
