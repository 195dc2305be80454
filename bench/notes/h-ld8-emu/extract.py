# Builds h/kern.h: gdr_fwd8 and gdr_fwd9 (the v8 and v9 sections of gated_delta_rule.cu, with
# the v6 helpers they use) as host C++ (see main.cpp). Run from this folder:
#   python3 extract.py && g++ -std=c++20 -O2 -pthread -w main.cpp -o h/main && h/main
import os, re
here = os.path.dirname(os.path.abspath(__file__))
src = open(os.path.join(here, '../../../crates/gdn/src/ops/gated_delta_rule/gated_delta_rule.cu')).read()
def cut(a, b):
    i = src.index(a); j = src.index(b, i); return src[i:j]
v6 = cut('template <int DK, int NW>\nstruct V6 {', '// Issue one chunk')
frags = cut('// S^T (16 x DK fp32 accumulator fragments) as bf16 A fragments', '// One chunk step of the chain for this warp: D^T')
v8 = cut('// v8 forward (issue 13', '// Chain microbenchmark of v8')
v9 = cut('// v9 forward (issue 13', '#define GDR_FWD9_ENTRY')
v8 = re.sub(r'__device__ __forceinline__ void pair_bar\(int id\) \{[^\n]*\}\n', '', v8)
os.makedirs(os.path.join(here, 'h'), exist_ok=True)
open(os.path.join(here, 'h/kern.h'), 'w').write(v6 + frags + v8 + v9)
