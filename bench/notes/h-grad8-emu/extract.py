# Builds h/kern.h: gdr_grad7 and gdr_grad8 (their sections of gated_delta_rule.cu) with the v6
# helpers and common.cuh's reductions they use, as host C++ (each CUDA thread a std::thread;
# __syncthreads and the warp collectives std::barriers: the h-fwd8 / h-bwd8 emulators' scheme,
# see main.cpp). The asm statements become their host meaning: the L2 prefetches nothing,
# g8_tid threadIdx.x, g8_opq the identity. Run from this folder:
#   python3 extract.py && g++ -std=c++20 -O2 -pthread -w main.cpp -o h/main && h/main
import os, re
here = os.path.dirname(os.path.abspath(__file__))
root = os.path.join(here, '../../../crates/gdn/src')
src = open(os.path.join(root, 'ops/gated_delta_rule/gated_delta_rule.cu')).read()
common = open(os.path.join(root, 'backend/kernels/common.cuh')).read()
def cut(s, a, b):
    i = s.index(a); j = s.index(b, i); return s[i:j]
red = cut(common, '// Storage loads/stores', '__device__ __forceinline__ float sigmoidf_')
gam = cut(src, '// gam (cumsum of the chunk', '// -------')
g6 = cut(src, 'template <int DK, int DV>\nstruct G6', 'template <typename TQ, int DK, int DV>\n__device__ void gdr_grad6(')
g7 = cut(src, 'template <int DK, int DV>\nstruct G7', '// gdr_grad7 (bf16 states; TQ:')
g8 = cut(src, 'template <int DK, int DV>\nstruct G8', '// gdr_grad8 (bf16 states; TQ:')
out = red + gam + g6 + g7 + g8
out = re.sub(r'asm volatile\("prefetch\.global\.L2 \[%0\];" ::"l"\([^;]*\);', '(void)0;', out)
out = out.replace('asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));', 't = threadIdx.x;')
out = out.replace('asm volatile("" : "+l"(p));', '')
assert 'asm volatile' not in out and 'asm(' not in out
os.makedirs(os.path.join(here, 'h'), exist_ok=True)
open(os.path.join(here, 'h/kern.h'), 'w').write(out)
