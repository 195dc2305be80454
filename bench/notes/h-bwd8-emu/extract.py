# Builds h/kern.h: gdr_bwd8 (the gdr_bwd8 section of gated_delta_rule.cu) and gdr_bwd6 with the
# v6 helpers they use, as host C++ (each CUDA thread a std::thread; __syncthreads, the pair's
# named barrier and the warp collectives std::barriers: the h-fwd8 emulator's scheme, see
# main.cpp). Run from this folder:
#   python3 extract.py && g++ -std=c++20 -O2 -pthread -w main.cpp -o h/main && h/main
import os
here = os.path.dirname(os.path.abspath(__file__))
src = open(os.path.join(here, '../../../crates/gdn/src/ops/gated_delta_rule/gated_delta_rule.cu')).read()
def cut(a, b):
    i = src.index(a); j = src.index(b, i); return src[i:j]
frags = cut('// S^T (16 x DK fp32 accumulator fragments) as bf16 A fragments', '// One chunk step of the chain for this warp: D^T')
store = cut('template <int DK>\n__device__ __forceinline__ void v6_store_state', '// One stage of gdr_hrec6')
bwd6 = cut('// One stage of gdr_bwd6', '// gdr_grad6 (v6 backward, opt-in')
bwd8 = cut('// gdr_bwd8 (opt-in GDN_RULE_BWD_SCAN=v8)', '#define GDR_BWD8_ENTRY')
os.makedirs(os.path.join(here, 'h'), exist_ok=True)
open(os.path.join(here, 'h/kern.h'), 'w').write(frags + store + bwd6 + bwd8)
