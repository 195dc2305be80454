# Builds h/kern.h: g2c_prep8 (with its bf16 outputs, g2c_prep8h) and g2f_fwd8 (the fused GDN2
# forward) from gdn2_rule.cu as host C++: each CUDA thread a std::thread, __syncthreads a
# std::barrier, cp.async a memcpy (waits and commits no-ops: a chunk's stage is complete when it is
# issued, and the pipeline's stage reuse is still exercised: a stage overwritten too early shows as
# wrong results), mma.sync m16n8k16 bf16 and ldmatrix x4 scalar models of their fragment layouts
# (exchanged through per-warp buffers between warp barriers), mma.sync m16n8k8 TF32 from
# ../h-g2b-emu. Run from this folder:
#   python3 extract.py && g++ -std=c++20 -O2 -pthread -w main.cpp -o h/main && h/main
import os
here = os.path.dirname(os.path.abspath(__file__))
src = open(os.path.join(here, '../../../crates/gdn/src/ops/gdn2_rule/gdn2_rule.cu')).read()
p8 = src[src.index('// g2c_prep8 (issue 17'):src.index('#define G2C8_ENTRIES(')]
# bf16 stores of prep8 (inline PTX): replaced by host shims below.
p8 = p8[:p8.index('// Stores of prep8')] + p8[p8.index('// A fragment (16 x 8, row-major at p'):]
f8 = src[src.index('// g2f_fwd8 (issue 17'):src.index('// g2f_fwd8_d{DK}_w{NW}: two stages')]
f8 = f8[:f8.index('__device__ __forceinline__ unsigned g2f_pack')] + f8[f8.index('// One pipeline stage of g2f_fwd8'):]
pre = open(os.path.join(here, '../h-g2b-emu/extract.py')).read()
pre = pre[pre.index("pre = r'''") + len("pre = r'''"):pre.index("'''\nbody = body.replace")]
pre = pre.replace('float g2c_sm_store[70000]', 'float g2c_sm_store[60000]')
# h-g2b-emu's prelude now holds every primitive this emulator needs too (its bf16, ldmatrix and
# mma.sync m16n8k16 models, cp.async, named barriers, prep8's stores: added for GDN2's backward
# v4 / v5, h-g2g4); nothing of its own is added.
body = p8 + f8
body = body.replace('extern __shared__ __align__(16) float g2c_sm[];', 'float* g2c_sm = g2c_sm_store;')
os.makedirs(os.path.join(here, 'h'), exist_ok=True)
open(os.path.join(here, 'h/kern.h'), 'w').write(pre + body)
