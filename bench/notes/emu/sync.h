// The synchronous model (main.cpp, prep.cpp): cp.async an immediate copy, the CTA and warp-pair
// barriers std::barriers, a CTA's threads run to completion before the next CTA starts.
#pragma once
inline void cp_async16_s(unsigned dst, const void* src, unsigned n) {
    if (n) std::memcpy((char*)gdr_smem + dst, src, 16); else std::memset((char*)gdr_smem + dst, 0, 16);
}
inline void cp_async16(void* dst, const void* src, bool valid) {
    if (valid) std::memcpy(dst, src, 16); else std::memset(dst, 0, 16);
}
inline void cp_async_commit() {}
inline void cp_async_wait_all() {}
template <int N> inline void cp_async_wait_group() {}
std::barrier<>* g_block; std::barrier<>* g_pair[8];
inline void __syncthreads() { g_block->arrive_and_wait(); }
inline void pair_bar(int id) { g_pair[id]->arrive_and_wait(); }

template <class F> void launch(int grid, int nt, F f) {
    for (int b = 0; b < grid; ++b) {
        std::barrier<> blk(nt); g_block = &blk;
        std::vector<std::barrier<>*> pb, wb;
        for (int i = 0; i < (nt + 63) / 64; ++i) { pb.push_back(new std::barrier<>(64)); g_pair[1 + i] = pb.back(); }
        for (int i = 0; i < nt / 32; ++i) { wb.push_back(new std::barrier<>(32)); g_warp[i] = wb.back(); }
        std::vector<std::thread> th;
        for (int t = 0; t < nt; ++t) th.emplace_back([&, t, b] { threadIdx.x = t; blockIdx.x = b; f(); });
        for (auto& x : th) x.join();
        for (auto* x : pb) delete x; for (auto* x : wb) delete x;
    }
}

