# Builds h/kern.h: the backward's scans, the GPU-tested defaults (gdr_hrec6, gdr_bwd6, gdr_bwd8)
# and session 19's v10 ones (gdr_hrec10, gdr_bwd10), with the helpers they use (v6 fragments,
# the tile stores, gdr_fwd10's stage and loads), and
# h/fwd10.h: session 18's gdr_fwd10 with the v8 / v9 forward pieces it uses, and h/prep.h: the
# prep (gdr_prep7's template: prep8 / prep9 and their o / to / ow / tow variants), as host C++ (see main.cpp: one std::thread per CUDA thread, the warp
# collectives from the PTX fragment maps, as the h-bwd8 / h-ld8 emulators do). The inline asm of
# stmatrix and of the tile flush is replaced by emulated equivalents. Run from this folder:
#   python3 extract.py && g++ -std=c++20 -O2 -pthread -w main.cpp -o h/main && h/main
#   g++ -std=c++20 -O2 -pthread -w fwd10.cpp -o h/fwd10 && h/fwd10
#   g++ -std=c++20 -O2 -pthread -w prep.cpp -o h/prep && h/prep
#   g++ -std=c++20 -O2 -pthread -w grad10.cpp -o h/grad10 && h/grad10   (h/grad10.h: below)
import os, re
here = os.path.dirname(os.path.abspath(__file__))
src = open(os.path.join(here, '../../../crates/gdn/src/ops/gated_delta_rule/gated_delta_rule.cu')).read()
def cut(a, b):
    i = src.index(a); j = src.index(b, i); return src[i:j]
frags = cut('// S^T (16 x DK fp32 accumulator fragments) as bf16 A fragments', '// One chunk step of the chain for this warp: D^T')
store = cut('template <int DK>\n__device__ __forceinline__ void v6_store_state', '// One stage of gdr_hrec6')
# stmatrix: emulated in main.cpp (stsm_x4_t_emu)
i = store.index('__device__ __forceinline__ void stsm_x4_t(')
j = store.index('#endif\n}\n', i) + len('#endif\n}\n')
store = store[:i] + store[j:]
# the flush's 16-byte shared load and global store
store = re.sub(r'asm volatile\("ld\.shared\.v4\.u32 \{%0,%1,%2,%3\}, \[%4\];"\s*:[^;]*;',
               'std::memcpy(&v, (const char*)gdr_smem + row(R, hf), 16);', store)
store = re.sub(r'asm volatile\("st\.global\.v4\.b32 \[%0\], \{%1,%2,%3,%4\};"[^;]*;',
               'std::memcpy(d, &v, 16);', store)
assert 'asm' not in store, store
# the GPU-tested default scans too: gdr_hrec6 (v6_chain_step), gdr_bwd6 (with V6G and the
# row-masked scalings), gdr_bwd8 (its stage copies and v8g_dd)
chain6 = cut('// One chunk step of the chain for this warp: D^T', '// Forward, scan and output fused')
hrec6 = cut('// One stage of gdr_hrec6 (bytes', '// One stage of gdr_bwd6')
bwd6 = cut('// One stage of gdr_bwd6', '// gdr_grad6 (v6 backward, opt-in')
bwd8 = cut('// gdr_bwd8 (opt-in GDN_RULE_BWD_SCAN=v8)', '#define GDR_BWD8_ENTRY')
v10s = cut('template <int DK, int NC>\nstruct V10S', '// gdr_fwd9 on V10S stages')
v10b = cut('template <int DK, int NW>\nstruct V10R', '// gdr_hrec10{,b}_d{DK}_w{NW}')
os.makedirs(os.path.join(here, 'h'), exist_ok=True)
open(os.path.join(here, 'h/kern.h'), 'w').write(frags + chain6 + store + hrec6 + bwd6 + bwd8 + v10s + v10b)
# h/fwd10.h (fwd10.cpp): gdr_fwd10 with gdr_fwd8's chain pieces and output, gdr_fwd9's output
# staging, its own stage and chain step (pair_bar comes from the harness)
v8 = cut('// v8 forward (issue 13', '// Chain microbenchmark of v8')
v8 = re.sub(r'__device__ __forceinline__ void pair_bar\(int id\) \{[^\n]*\}\n', '', v8)
v9 = cut('// v9 forward (issue 13', '#define GDR_FWD9_ENTRY')
v10f = cut('template <int DK, int NC>\nstruct V10S', '// gdr_fwd10_*: PT hi + lo (LO)')
assert 'asm' not in v8 + v9 + v10f
v6 = cut('template <int DK, int NW>\nstruct V6 {', '// Issue one chunk')
# h/prep.h (prep.cpp): gdr_prep7 (prep8 / prep9 and the session-18 / 19 TIN / TOUT / TW variants)
geo = cut('struct ChunkGeo {', '// gam (cumsum of the chunk')
prep = cut('template <int DK>\nstruct P7Layout', '// Entries: gdr_prep7{,f}')
i = prep.index('__device__ __forceinline__ void stsm_x4(')
j = prep.index('#endif\n}\n', i) + len('#endif\n}\n')
prep = prep[:i] + prep[j:]  # stmatrix (not transposed): emulated in prep.cpp
assert 'asm' not in prep
open(os.path.join(here, 'h/prep.h'), 'w').write(geo + prep)
open(os.path.join(here, 'h/fwd10.h'), 'w').write(v6 + frags + store + v8 + v9 + v10f)
# h/grad10.h (grad10.cpp): gdr_grad10 (the wgmma gradient kernel, KB 1 / 2) with its row copies
# (sw_rows16), common.cuh's warp_sum and wgmma.cuh's layout and descriptor functions (the
# instruction wrappers, fence / commit / wait and the mma itself, are emulated in wgmma.h; the
# acp_ mbarrier / cp.async helpers, g7_ld2 and the L2 prefetch in grad10.cpp); the named
# barrier's bar.sync becomes named_bar_sync (grad10.cpp).
wgsrc = open(os.path.join(here, '../../../crates/gdn/src/ops/common/wgmma.cuh')).read()
cmsrc = open(os.path.join(here, '../../../crates/gdn/src/backend/kernels/common.cuh')).read()
wi = wgsrc.index('// Byte offset of bf16 element (r, c), c < 64, in an SW128 panel.')
wj = wgsrc.index('__device__ __forceinline__ void wg_fence()', wi)
wgl = wgsrc[wi:wj]
ci = cmsrc.index('__device__ __forceinline__ float warp_sum(float v)')
cj = cmsrc.index('// Block-wide sum', ci)
wsum = cmsrc[ci:cj]
rows16 = cut('template <typename TI>\n__device__ __forceinline__ void sw_rows16(', '// grad10 (issue 13')
g10 = cut('// grad10 (issue 13', '// gdr_grad10 (bf16 states). Persistent grid')
g10, nb = re.subn(r'asm volatile\("bar\.sync %0, 128;" ::"r"\(id\) : "memory"\);', 'named_bar_sync(id, 128);', g10)
assert nb == 1, nb
g10out = wgl + wsum + rows16 + g10
assert 'asm' not in g10out, [l for l in g10out.splitlines() if 'asm' in l]
open(os.path.join(here, 'h/grad10.h'), 'w').write(g10out)
