# Builds h/kern.h: gdr_fwd8 / gdr_chain8 (the v8 section of gated_delta_rule.cu, with the v6
# helpers it uses) as host C++: each CUDA thread a std::thread, __syncthreads / the pair's named
# barrier / the warp collectives (ldmatrix, mma.sync) std::barriers (see main.cpp). Run from
# this folder: python3 extract.py && g++ -std=c++20 -O2 -pthread -w main.cpp -o h/main && h/main
import os, re
here = os.path.dirname(os.path.abspath(__file__))
src = open(os.path.join(here, '../../../crates/gdn/src/ops/gated_delta_rule/gated_delta_rule.cu')).read()
def cut(a, b):
    i = src.index(a); j = src.index(b, i); return src[i:j]
v6 = cut('template <int DK, int NW>\nstruct V6 {', '// Issue one chunk')
frags = cut('// S^T (16 x DK fp32 accumulator fragments) as bf16 A fragments', '// One chunk step of the chain for this warp: D^T')
v8 = cut('// v8 forward (issue 13', '#define GDR_HREC8_ENTRY')
v6r = cut('template <int DK, int NW>\nstruct V6R {', 'template <int DK, int NW>\n__device__ __forceinline__ void v6r_load_stage')
store = cut('template <int DK>\n__device__ __forceinline__ void v6_store_state', '// One stage of gdr_hrec6')
v8 = re.sub(r'__device__ __forceinline__ void pair_bar\(int id\) \{[^\n]*\}\n', '', v8)
os.makedirs(os.path.join(here, 'h'), exist_ok=True)
open(os.path.join(here, 'h/kern.h'), 'w').write(v6 + v6r + frags + store + v8)
