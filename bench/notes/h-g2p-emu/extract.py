# Builds h/kern.h: g2c_prep (the fp32 chunk prep) and g2c_prep8 (the tensor-core one) from
# gdn2_rule.cu as host C++, each CUDA thread a std::thread, __syncthreads a std::barrier, mma.sync
# m16n8k8 TF32 a scalar model of its fragment layouts (the shims of ../h-g2b-emu/extract.py).
# Run from this folder: python3 extract.py && g++ -std=c++20 -O2 -pthread -w main.cpp -o h/main
# && h/main
import os
here = os.path.dirname(os.path.abspath(__file__))
src = open(os.path.join(here, '../../../crates/gdn/src/ops/gdn2_rule/gdn2_rule.cu')).read()
prep = src[src.index('// Workspace geometry of one (chunk, value head)'):src.index('// Shared memory of g2c_prep (floats)')]
p8 = src[src.index('// g2c_prep8 (issue 17'):src.index('#define G2C8_ENTRIES(')]
pre = open(os.path.join(here, '../h-g2b-emu/extract.py')).read()
pre = pre[pre.index("pre = r'''") + len("pre = r'''"):pre.index("'''\nbody = body.replace")]
pre += r'''
struct float2 { float x, y; };
struct uint2 { unsigned x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline unsigned tf32u(float x) { return __float_as_uint(to_tf32(x)); }
typedef unsigned short bf16_t;
'''
body = prep + p8
body = body.replace('extern __shared__ __align__(16) float g2c_sm[];', 'float* g2c_sm = g2c_sm_store;')
os.makedirs(os.path.join(here, 'h'), exist_ok=True)
open(os.path.join(here, 'h/kern.h'), 'w').write(pre + body)
