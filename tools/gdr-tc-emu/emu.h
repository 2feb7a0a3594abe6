// Host emulation of the CUDA features used by dataplane/kernels/gdr_tc.cu: every CUDA
// thread is an OS thread; __syncthreads is a block barrier; warp collectives (mma.sync
// m16n8k16 bf16, ldmatrix .x4 .trans, __shfl_up_sync) exchange operands through a
// per-warp slot table between two warp barriers, following the PTX ISA fragment layouts.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define HYPIC_HOST_EMU 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__

struct uint3 { unsigned x, y, z; };
struct uint4 { unsigned x, y, z, w; };
struct float2 { float x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
inline float2 make_float2(float a, float b) { return float2{a, b}; }
struct float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }

struct bf16 { uint16_t b; };
typedef bf16 __nv_bfloat16;
struct __nv_bfloat162 { bf16 x, y; };
inline uint16_t emu_f2bf(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
inline float emu_bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162{{emu_f2bf(a)}, {emu_f2bf(b)}}; }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return float2{emu_bf2f(v.x.b), emu_bf2f(v.y.b)}; }
inline float __bfloat162float(bf16 v) { return emu_bf2f(v.b); }
inline bf16 __float2bfloat16_rn(float f) { return bf16{emu_f2bf(f)}; }
using std::min;
using std::max;

struct EmuWarp {
    std::barrier<> bar{32};
    uint32_t slot[32][8];
    const void* ptr[32];
    float fslot[32];
};
struct EmuBlock {
    std::unique_ptr<std::barrier<>> bar;
    std::vector<std::unique_ptr<EmuWarp>> warps;
};
thread_local uint3 threadIdx, blockIdx;
thread_local EmuBlock* emu_block;
inline EmuWarp& emu_warp() { return *emu_block->warps[threadIdx.x >> 5]; }
inline void __syncthreads() { emu_block->bar->arrive_and_wait(); }
// All 32 lanes of the warp must call it (as the kernels do).
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp().bar.arrive_and_wait(); }

inline float __shfl_up_sync(unsigned, float v, int o) {
    EmuWarp& W = emu_warp();
    const int l = threadIdx.x & 31;
    W.fslot[l] = v;
    W.bar.arrive_and_wait();
    const float r = l >= o ? W.fslot[l - o] : v;
    W.bar.arrive_and_wait();
    return r;
}

inline float emu_half(uint32_t r, int hi) { return emu_bf2f((uint16_t)(hi ? r >> 16 : r & 0xffff)); }

// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 (PTX ISA fragment layouts for .bf16):
// A: a0..a7 (4 regs), row = g (+8 for regs 1, 3), col = 2q + (0,1) (+8 for regs 2, 3);
// B: b0..b3 (2 regs), k = 2q + (0,1) (+8 for reg 1), n = g; C: rows g / g+8, cols 2q + (0,1).
inline void tc_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    EmuWarp& W = emu_warp();
    const int l = threadIdx.x & 31;
    for (int i = 0; i < 4; ++i) W.slot[l][i] = a[i];
    W.slot[l][4] = b0;
    W.slot[l][5] = b1;
    W.bar.arrive_and_wait();
    auto A = [&](int r, int k) {
        const int reg = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
        return emu_half(W.slot[(r & 7) * 4 + ((k & 7) >> 1)][reg], k & 1);
    };
    auto B = [&](int k, int n) { return emu_half(W.slot[n * 4 + ((k & 7) >> 1)][4 + (k >= 8 ? 1 : 0)], k & 1); };
    const int g = l >> 2, q = l & 3;
    float out[4];
    for (int e = 0; e < 4; ++e) {
        const int r = g + 8 * (e >> 1), n = 2 * q + (e & 1);
        double s = 0;
        for (int k = 0; k < 16; ++k) s += (double)A(r, k) * (double)B(k, n);
        out[e] = (float)((double)c[e] + s);
    }
    W.bar.arrive_and_wait();
    for (int e = 0; e < 4; ++e) c[e] = out[e];
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: lane 8i + r gives the address of row r
// of matrix i; with .trans lane t receives in reg i the elements (row 2(t%4), col t/4)
// (low) and (row 2(t%4)+1, col t/4) (high) of matrix i.
inline void tc_ldsm_x4_trans(unsigned* f, const bf16* p) {
    EmuWarp& W = emu_warp();
    const int lane = threadIdx.x & 31;
    W.ptr[lane] = p;
    W.bar.arrive_and_wait();
    const int g = lane >> 2, q = lane & 3;
    for (int i = 0; i < 4; ++i) {
        const bf16* lo = (const bf16*)W.ptr[8 * i + 2 * q];
        const bf16* hi = (const bf16*)W.ptr[8 * i + 2 * q + 1];
        f[i] = (uint32_t)lo[g].b | ((uint32_t)hi[g].b << 16);
    }
    W.bar.arrive_and_wait();
}
// ldmatrix.sync.aligned.m8n8.x4.shared.b16 (no .trans): lane t receives in reg i the
// elements (row t/4, cols 2(t%4), 2(t%4)+1) of matrix i.
inline void tc_ldsm_x4(unsigned* f, const bf16* p) {
    EmuWarp& W = emu_warp();
    const int lane = threadIdx.x & 31;
    W.ptr[lane] = p;
    W.bar.arrive_and_wait();
    const int g = lane >> 2, q = lane & 3;
    for (int i = 0; i < 4; ++i) {
        const bf16* row = (const bf16*)W.ptr[8 * i + g];
        f[i] = (uint32_t)row[2 * q].b | ((uint32_t)row[2 * q + 1].b << 16);
    }
    W.bar.arrive_and_wait();
}
inline void tc_prefetch_l2(const void*) {}
// cp.async copies complete at once here (the ring's waits and barriers are no-ops for
// data, so this cannot catch a missing wait).
inline void tc_cp16(void* s, const void* g) { std::memcpy(s, g, 16); }
inline void tc_cp4(void* s, const void* g) { std::memcpy(s, g, 4); }
inline void tc_cp_commit() {}
template <int N>
inline void tc_cp_wait() {}

// Runs kernel f over grid (gx, gy) with `threads` threads per block, one block at a time.
inline void emu_launch(int gx, int gy, int threads, const std::function<void()>& f) {
    for (int by = 0; by < gy; ++by)
        for (int bx = 0; bx < gx; ++bx) {
            EmuBlock blk;
            blk.bar = std::make_unique<std::barrier<>>(threads);
            for (int w = 0; w < threads / 32; ++w) blk.warps.push_back(std::make_unique<EmuWarp>());
            std::vector<std::thread> ts;
            for (int t = 0; t < threads; ++t)
                ts.emplace_back([&, t] {
                    threadIdx = uint3{(unsigned)t, 0, 0};
                    blockIdx = uint3{(unsigned)bx, (unsigned)by, 0};
                    emu_block = &blk;
                    f();
                });
            for (auto& t : ts) t.join();
        }
}
