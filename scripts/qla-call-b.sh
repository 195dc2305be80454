#!/usr/bin/env bash
# FlashQLA 0.1.3 beside our rule on one warm H200 (second of two calls; GPU.md: the first call
# installed the tilelang wheel into /tmp/qsite). Carry .gpu6 (bench_rule + kcache.tgz) and
# .gpu-qla2 (the other FlashQLA wheels + qla_anchor.py). Ours before and after FlashQLA's run.
# QLA_DIR names another folder of wheels + qla_anchor.py (when the first call installed the rest).
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/gdn-out}; mkdir -p "$OUT"
Q=${QLA_DIR:-.gpu-qla2}
python3 -m pip install -q --no-index --no-deps --target /tmp/qsite "$Q"/*.whl
export GDN_KERNEL_CACHE=/tmp/gdn-kernels
mkdir -p $GDN_KERNEL_CACHE && tar -xf "$(ls .gpu6/kcache.t*z | head -1)" -C $GDN_KERNEL_CACHE --strip-components=1
# QLA_TIMEOUT: FlashQLA's share of the call (TileLang compiles each of the four shapes at first
# use, 1.5-2 minutes each: 400 s reached only two shapes on 2026-12-04 17:41); ONE_RUN=1 runs ours
# once, before it, to leave FlashQLA more of the call.
.gpu6/bench_rule > "$OUT/ours1.log" 2>&1
PATH=/usr/local/cuda-13.0/bin:$PATH PYTHONPATH=/tmp/qsite PYTHONUNBUFFERED=1 timeout "${QLA_TIMEOUT:-400}" python3 "$Q"/qla_anchor.py > "$OUT/qla.log" 2>&1
echo "qla rc=$?"
[ "${ONE_RUN:-0}" = 1 ] || .gpu6/bench_rule > "$OUT/ours2.log" 2>&1
tail -8 "$OUT/qla.log"; grep "^bench-rule |" "$OUT"/ours*.log
