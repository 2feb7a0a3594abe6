// Hopper (sm_90a) flash attention for bf16 on warpgroup tensor cores (wgmma), the
// FlashAttention-3 scheme (J. Shah, G. Bikshandi, Y. Zhang, V. Thakkar, P. Ramani, T. Dao,
// 2024, "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision",
// intra-warpgroup overlap of softmax and the two GEMMs) written for this layout;
// attn::prefill_flash_wg in cuda/attn.rs. Same contract as attn_flash_bf16_* (flash.cu):
//   q: [tq, nh, HD] bf16, q_pos: [tq] i64; k, v: [n_kv, nkv, HD] bf16, kv_pos: [n_kv] i64 in
//   any order with any values; o: [tq, nh, HD] bf16. Query i of head h attends to key j of kv
//   head h / (nh / nkv) iff kv_pos[j] <= q_pos[i]; scale HD^-0.5; a query that sees no key
//   gets zeros.
// Masking, tile skipping and split KV are flash.cu's: the key tile summaries come from
// flash.cu's attn_flash_tiles / attn_flash_tiles_suffix with bc = 64, the splits are merged
// by flash.cu's attn_flash_combine_bf16 (same workspace layout).
//
// CTA = 128 queries of one head = 2 warpgroups (256 threads); warpgroup w owns query rows
// 64w..64w+63, warp x of it rows 16x..16x+15 of those. Key/value tiles of BC = 64 keys. All
// threads load (cp.async, 16 bytes) into the 128-byte-swizzled layout below; per tile i
// (the visible tiles in order; stage = i % 2 for K, V and key positions):
//   issue  S(i+1) = Q K(i+1)ᵀ      HD/16 × wgmma m64n64k16, A and B from shared memory
//   issue  O += P(i) V(i)          BC/16 × wgmma m64n{HD}k16, A = P(i) from registers
//   wait ≤ 1 group (S(i+1) done)   softmax of S(i+1) (mask, row max, exp2, row sums) while
//                                  P V runs on the tensor cores
//   wait 0 groups                  O *= 2^(m_old − m_new); P(i+1) = bf16(exp'd S(i+1))
//   loads of V(i+1) and K(i+2) (issued at the top of the iteration) land; barrier.
// Online softmax in fp32 in the log2 domain as in flash.cu; O /= row sums at the end.
//
// Hardware facts used (sources: PTX ISA 8.x/9.0, "Asynchronous Warpgroup Level Matrix
// Multiply-Accumulate Instructions" (wgmma), sections "Matrix Descriptor Format", "Shared
// Memory Matrix Layout" / "Strides" with the swizzling modes, "Register Fragments" for
// m64nNk16; cross-checked against CUTLASS cute/arch/mma_sm90_desc.hpp (GmmaDescriptor bit
// fields) and cute/atom/mma_traits_sm90_gmma.hpp (canonical layouts of make_gmma_desc,
// CLayout_64xN / ALayout_64x16)):
// * Instruction forms: wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16
//     d, a-desc, b-desc, scale-d, imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b;
//     d, {a0..a3}, b-desc, scale-d, imm-scale-a, imm-scale-b, imm-trans-b;
//   scale-d is a predicate (false: d = A·B); trans = 0 means K-major ("row" A, "col" B),
//   trans-b = 1 means B is MN-major (N contiguous). All 128 threads of the warpgroup execute
//   it; wgmma.fence before the first wgmma and whenever d or a registers were touched by
//   other instructions; wgmma.commit_group closes a group; wgmma.wait_group N waits until
//   at most N groups are pending (accumulators / register A must not be touched before).
// * Matrix descriptor (64 bits): [0,14) start address >> 4; [16,30) leading-dimension byte
//   offset (LBO) >> 4; [32,46) stride-dimension byte offset (SBO) >> 4; [49,52) base offset
//   (0 here: every swizzle atom starts on a 1024-byte boundary); [62,64) swizzle mode:
//   0 none, 1 128-byte, 2 64-byte, 3 32-byte.
// * 128-byte swizzle: a shared address's 16-byte chunk bits [4,7) are XORed with bits
//   [7,10) (the row within an 8-row × 128-byte = 1024-byte atom): element (r, c) of a
//   region of 64-element (128-byte) rows lives at r·128 + ((c/8) ^ (r%8))·16 + (c%8)·2.
// * K-major operand with 128-byte swizzle (Q as A, K as B): rows of 64 elements (one
//   128-byte row per M/N index), 8-row groups SBO = 1024 bytes apart; LBO unused (1). A
//   k16 step inside the 64-element atom advances the start address by 32 bytes (the swizzle
//   is applied to the final address). Each 64-column block of HD is its own region.
// * MN-major B with 128-byte swizzle (V, trans-b = 1): per K index (key) a 128-byte row of
//   64 N elements (d); the 8 keys of a core group are consecutive rows (1024-byte atom);
//   LBO = byte distance between 64-element N blocks (here BC·128), SBO = byte distance
//   between 8-key groups (1024). A k16 step advances the start by 16·128 bytes.
// * Accumulator fragment of m64nN (f32): thread t of the warpgroup, warp x = t/32,
//   g = (t%32)/4, c = t%4: d[i] = D[16x + g + 8·((i/2)%2)][8·(i/4) + 2c + (i%2)], i.e. per
//   n8 column block the m16n8 C fragment of mma.sync (flash.cu's layout).
// * Register A fragment of m64nNk16 (bf16): a0 = A[16x+g][2c..2c+1], a1 = A[16x+g+8][2c..],
//   a2 = A[16x+g][2c+8..], a3 = A[16x+g+8][2c+8..] (lower column in the low half): the
//   m16n8k16 A fragment, so P packs from the S accumulators exactly as in flash.cu.
// * cp.async writes shared memory through the generic proxy, wgmma reads it through the
//   async proxy: each thread runs fence.proxy.async.shared::cta after its copies landed and
//   before the barrier that precedes the wgmma reading them.
//
// Shared memory (dynamic; the kernel rounds its base up to 1024 bytes, NCB = HD / 64):
//   sQ [NCB][128 rows][128 B] | sK [2][NCB][64][128 B] | sV [2][NCB][64][128 B] |
//   sQP [128] i64 | sKP [2][64] i64 | sRed [16] i64
// = 1024 + NCB·(128 + 4·64)·128 + (128 + 128 + 16)·8 bytes (attn.rs: flash_wg_smem_bytes):
// 199 808 for HD 256, 101 504 for HD 128.
//
// Instances attn_flash_wg_bf16_{256,128}; grid (ceil(tq / 128)·nh, nsplit), block 256.
// The warp-specialised kernels attn_flash_wg3tmal_bf16_{256,128} (64-key tiles) and
// attn_flash_wg3tmalb80_bf16_{256,128} (80-key tiles) (block 384: a producer warpgroup that
// loads K / V by TMA onto mbarriers, two ping-pong consumer warpgroups) follow the first
// kernel and reuse its primitives, descriptors and fragment code.
// The module compiles to nothing for targets without wgmma (sm_90a only; compile::ALL
// builds every module for the device, attn.rs refuses other devices before looking up a
// kernel). The host emulator defines FW_HOST_EMULATOR.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(FW_HOST_EMULATOR)
#define FW_BR 128
#define FW_BC 64
#define FW_THREADS 256
#define FW_I64_MAX 0x7fffffffffffffffLL
#define FW_I64_MIN (-0x7fffffffffffffffLL - 1)

__device__ __forceinline__ i64 fw_min64(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ i64 fw_max64(i64 a, i64 b) { return a > b ? a : b; }

// <device-primitives> (PTX; the host emulator in tools/kernel-emu replaces this block)
__device__ __forceinline__ unsigned fw_smem_u32(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16 bytes global → shared, bypassing L1; ok = false writes 16 zero bytes (src not read).
__device__ __forceinline__ void fw_cp_async16(unsigned dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void fw_cp_async8(unsigned dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void fw_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

__device__ __forceinline__ void fw_cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Makes this thread's generic-proxy writes to shared memory visible to the async proxy
// (wgmma operand reads) once a barrier has ordered them.
__device__ __forceinline__ void fw_fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void fw_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void fw_wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Wait until at most N committed wgmma groups of this warpgroup are pending. The
// accumulators are listed as operands so that the compiler does not move their uses above
// the wait.
template <int N, int NR>
__device__ __forceinline__ void fw_wgmma_wait(float* r) {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#pragma unroll
    for (int i = 0; i < NR; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// 2^x (ex2.approx: 2 ulp; -inf → +0).
__device__ __forceinline__ float fw_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ unsigned fw_pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}

// d (64×64 fp32) = (scale_d ? d : 0) + A · B: A 64×16 and B 16×64 (stored N×K) both K-major
// in shared memory (descriptors da, db), trans-a = trans-b = 0.
__device__ __forceinline__ void fw_wgmma_ss_n64(float* d, unsigned long long da, unsigned long long db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(scale_d));
}

// d (64×80 fp32) = (scale_d ? d : 0) + A · B, as fw_wgmma_ss_n64 with N = 80 (80-key tiles).
__device__ __forceinline__ void fw_wgmma_ss_n80(float* d, unsigned long long da, unsigned long long db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, %40, %41, p, 1, 1, 0, 0;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
        : "l"(da), "l"(db), "r"(scale_d));
}

// d (64×256 fp32) += A · B: A 64×16 bf16 from registers a[4], B 16×256 MN-major in shared
// memory (descriptor db, trans-b = 1).
__device__ __forceinline__ void fw_wgmma_rs_n256(float* d, const unsigned* a, unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// d (64×128 fp32) += A · B: A 64×16 bf16 from registers a[4], B 16×128 MN-major in shared
// memory (descriptor db, trans-b = 1).
__device__ __forceinline__ void fw_wgmma_rs_n128(float* d, const unsigned* a, unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// ---- warp-specialised kernels (attn_flash_wg3tmal*_*) ----
// 8 bytes global → shared (cp.async.ca), ok = false writes 8 zero bytes (src not read).
__device__ __forceinline__ void fw_cp_async8z(unsigned dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 8 : 0)
                 : "memory");
}

// mbarrier (PTX ISA "Parallel Synchronization and Communication Instructions: mbarrier"): a
// 64-bit object in shared memory with an expected arrival count, a pending count and a
// phase; the phase completes when the pending count reaches zero (then it is reset to the
// expected count and the phase number advances).
__device__ __forceinline__ void fw_mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes the mbarrier initialisations visible (CUTLASS fence_barrier_init), before the
// barrier that publishes them to the other threads.
__device__ __forceinline__ void fw_mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arrive (release semantics, CTA scope) on the current phase.
__device__ __forceinline__ void fw_mbar_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}

// Blocks until the phase of parity `parity` has completed: try_wait.parity succeeds iff the
// parity of the current (incomplete) phase differs from `parity` (so on a fresh barrier,
// parity 1 succeeds at once: the "phase before the first" counts as completed). Acquire
// semantics (CTA scope) by default.
__device__ __forceinline__ void fw_mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred p;\nFW_WAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@p bra FW_DONE;\n"
        "bra FW_WAIT;\nFW_DONE:\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// Asynchronous arrive-on `bar` once every cp.async this thread issued before has completed;
// .noinc: the arrival counts against the barrier's expected count (init count includes it).
__device__ __forceinline__ void fw_cp_mbar_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Named barriers 1..15 (0 is __syncthreads): bar.sync waits until `count` threads (a
// multiple of 32) have arrived, bar.arrive arrives without waiting.
__device__ __forceinline__ void fw_bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void fw_bar_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Per-thread register budget of the executing warpgroup (all its warps execute the same
// one): .dec returns registers to the CTA's pool, .inc blocks until the pool has them.
template <int N>
__device__ __forceinline__ void fw_setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void fw_setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// ---- TMA (attn_flash_wg3tmal*_*) ----
// A CUtensorMap (CUDA driver API: 128 opaque bytes, 64-byte aligned), encoded on the host
// by cuTensorMapEncodeTiled (attn.rs: encode_kv_map) and passed by value as a
// __grid_constant__ kernel parameter; its generic address is the TMA operand.
struct alignas(64) FwTmap {
    unsigned long long opaque[16];
};

// mbarrier.arrive.expect_tx: raises the transaction count of the current phase by `bytes`,
// then arrives (one arrival of the expected count). The phase completes when both the
// pending arrivals and the transaction count are zero.
__device__ __forceinline__ void fw_mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Tensor copy of one box (tensor map `map`, box origin (c0, c1) = (innermost element,
// row)) global → shared at `dst` (the swizzle of the map applied by the copy engine;
// elements outside the tensor are zero-filled); completes `bytes of the box` transactions
// on mbarrier `bar` when it lands. Writes through the async proxy.
__device__ __forceinline__ void fw_tma_load_2d(unsigned dst, const FwTmap* map, int c0, int c1, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
        "[%4];\n" ::"r"(dst),
        "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

// Brings the tensor map into the descriptor cache ahead of the first copy.
__device__ __forceinline__ void fw_tma_prefetch(const FwTmap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"((unsigned long long)map) : "memory");
}
// </device-primitives>

// Shared-memory matrix descriptor with 128-byte swizzle (mode 1 in bits 62-63), base
// offset 0; addr, lbo, sbo in bytes (multiples of 16).
__device__ __forceinline__ unsigned long long fw_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3ffffu) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3fffu) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3fffu) << 32) | (1ull << 62);
}

// Byte offset of element (r, c) (c a multiple of 8) of a swizzled operand region of
// `rows` rows: 64-column block c / 64 is its own [rows][128 B] region, 16-byte chunk
// (c / 8) % 8 of row r at chunk position ((c / 8) % 8) ^ (r % 8).
__device__ __forceinline__ unsigned fw_swz(int rows, int r, int c) {
    return (unsigned)((c >> 6) * rows * 128 + r * 128 + ((((c >> 3) & 7) ^ (r & 7)) << 4));
}

// First tile in [j, je) that some query of the CTA can see (tmin ≤ qmax), or je (flash.cu's
// fa_next_tile; uniform over the block, no barrier needed).
__device__ __forceinline__ int fw_next_tile(const i64* tmin, const i64* smin, int j, int je, i64 qmax,
                                            int lane) {
    while (j < je) {
        if (smin[j] > qmax) return je;
        const int jj = j + lane;
        const unsigned hit = __ballot_sync(0xffffffffu, jj < je && tmin[jj] <= qmax);
        if (hit) return j + __ffs((int)hit) - 1;
        j += 32;
    }
    return je;
}

// Number of tiles in [j, je) that some query of the CTA can see (the tiles fw_next_tile
// walks; a warp vote per 32 tiles, uniform over the block).
__device__ __forceinline__ int fw_count_tiles(const i64* tmin, const i64* smin, int j, int je, i64 qmax,
                                              int lane) {
    int n = 0;
    while (j < je) {
        if (smin[j] > qmax) break;
        const int jj = j + lane;
        n += __popc(__ballot_sync(0xffffffffu, jj < je && tmin[jj] <= qmax));
        j += 32;
    }
    return n;
}

// The end of a flash_wg kernel, per consumer thread (its accumulator rows g0 and g0 + 8 of
// the CTA's query tile, columns 2·(lane & 3) + 8n): the row sums over the four lanes of each
// row, then with one split the normalised bf16 output o, else the unnormalised fp32 partial
// wo and (m, l) per row in wml for flash.cu's merge (m in the log2 domain), as flash.cu does.
template <int HD>
__device__ __forceinline__ void fw_epilogue(const float (&acc)[HD / 8][4], float m0, float m1, float l0, float l1,
                                            int g0, int lane, int h, int tq, int nh, int nsplit, bf16* o, float* wo,
                                            float* wml) {
    constexpr int NT = HD / 8;
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const int g1 = g0 + 8;
    const int col = 2 * (lane & 3);
    if (nsplit == 1) {
        const float i0 = l0 > 0.f ? 1.f / l0 : 0.f, i1 = l1 > 0.f ? 1.f / l1 : 0.f;
        if (g0 < tq) {
            bf16* d = o + ((size_t)g0 * nh + h) * HD + col;
#pragma unroll
            for (int n = 0; n < NT; ++n)
                *reinterpret_cast<__nv_bfloat162*>(d + n * 8) =
                    __floats2bfloat162_rn(acc[n][0] * i0, acc[n][1] * i0);
        }
        if (g1 < tq) {
            bf16* d = o + ((size_t)g1 * nh + h) * HD + col;
#pragma unroll
            for (int n = 0; n < NT; ++n)
                *reinterpret_cast<__nv_bfloat162*>(d + n * 8) =
                    __floats2bfloat162_rn(acc[n][2] * i1, acc[n][3] * i1);
        }
    } else {
        const size_t rows = (size_t)tq * nh;
        const size_t sp = (size_t)blockIdx.y * rows;
        if (g0 < tq) {
            const size_t r = sp + (size_t)g0 * nh + h;
            float* d = wo + r * HD + col;
#pragma unroll
            for (int n = 0; n < NT; ++n)
                *reinterpret_cast<float2*>(d + n * 8) = make_float2(acc[n][0], acc[n][1]);
            if ((lane & 3) == 0) *reinterpret_cast<float2*>(wml + r * 2) = make_float2(m0, l0);
        }
        if (g1 < tq) {
            const size_t r = sp + (size_t)g1 * nh + h;
            float* d = wo + r * HD + col;
#pragma unroll
            for (int n = 0; n < NT; ++n)
                *reinterpret_cast<float2*>(d + n * 8) = make_float2(acc[n][2], acc[n][3]);
            if ((lane & 3) == 0) *reinterpret_cast<float2*>(wml + r * 2) = make_float2(m1, l1);
        }
    }
}

template <int HD> struct FwPv;
template <> struct FwPv<256> {
    static __device__ __forceinline__ void mma(float* d, const unsigned* a, unsigned long long db) {
        fw_wgmma_rs_n256(d, a, db);
    }
};
template <> struct FwPv<128> {
    static __device__ __forceinline__ void mma(float* d, const unsigned* a, unsigned long long db) {
        fw_wgmma_rs_n128(d, a, db);
    }
};

// S = Q Kᵀ k-step for key tiles of BC = 64 or 80 (the warp-specialised kernel).
template <int BC> struct FwS;
template <> struct FwS<64> {
    static __device__ __forceinline__ void mma(float* d, unsigned long long da, unsigned long long db, int sd) {
        fw_wgmma_ss_n64(d, da, db, sd);
    }
};
template <> struct FwS<80> {
    static __device__ __forceinline__ void mma(float* d, unsigned long long da, unsigned long long db, int sd) {
        fw_wgmma_ss_n80(d, da, db, sd);
    }
};

// grid (ceil(tq / 128) · nh, nsplit), block 256; blockIdx.x → (query tile, head) and the
// split outputs exactly as attn_flash_impl in flash.cu (tiles: attn_flash_tiles with bc 64).
template <int HD>
__device__ __forceinline__ void attn_flash_wg_impl(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                   const bf16* __restrict__ v, const i64* __restrict__ q_pos,
                                                   const i64* __restrict__ kv_pos, const i64* __restrict__ tiles,
                                                   bf16* __restrict__ o, float* __restrict__ wo,
                                                   float* __restrict__ wml, int tq, int n_kv, int nh, int nkv,
                                                   float scale_log2) {
    constexpr int BR = FW_BR, BC = FW_BC, THREADS = FW_THREADS;
    constexpr int NCB = HD / 64;          // 64-column (128-byte) blocks of a row
    constexpr int QBYTES = NCB * BR * 128;
    constexpr int TBYTES = NCB * BC * 128;  // one K or V stage
    constexpr int NT = HD / 8;            // n8 column blocks of O
    constexpr int ST = BC / 8;            // n8 key blocks of S
    constexpr int W = THREADS / 32;
    static_assert(HD == 128 || HD == 256, "head dim");
    static_assert((BR * HD / 8) % THREADS == 0 && (BC * HD / 8) % THREADS == 0, "loader shape");
    extern __shared__ __align__(1024) unsigned char fw_smem[];
    unsigned char* base = fw_smem + ((1024u - (fw_smem_u32(fw_smem) & 1023u)) & 1023u);
    unsigned char* sQ = base;
    unsigned char* sK = sQ + QBYTES;
    unsigned char* sV = sK + 2 * TBYTES;
    i64* sQP = reinterpret_cast<i64*>(sV + 2 * TBYTES);
    i64* sKP = sQP + BR;
    i64* sRed = sKP + 2 * BC;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = tid >> 7;
    const int nqt = (tq + BR - 1) / BR;
    const int qt = nqt - 1 - (int)(blockIdx.x / (unsigned)nh);
    const int h = (int)(blockIdx.x % (unsigned)nh);
    const int kh = h / (nh / nkv);
    const int q0 = qt * BR;
    const int ntk = (n_kv + BC - 1) / BC;
    const int nsplit = gridDim.y;
    const int per = (ntk + nsplit - 1) / nsplit;
    const int jb = min(ntk, (int)blockIdx.y * per), je = min(ntk, jb + per);
    const i64* tmin = tiles;
    const i64* tmax = tiles + ntk;
    const i64* smin = tiles + 2 * ntk;

    // Query positions (rows past tq: I64_MIN) and their min / max over the real rows.
    i64 mn = FW_I64_MAX, mx = FW_I64_MIN;
    if (tid < BR) {
        const bool ok = q0 + tid < tq;
        const i64 p = ok ? q_pos[q0 + tid] : FW_I64_MIN;
        sQP[tid] = p;
        if (ok) {
            mn = p;
            mx = p;
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        mn = fw_min64(mn, __shfl_xor_sync(0xffffffffu, mn, off));
        mx = fw_max64(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    }
    if (lane == 0) {
        sRed[warp] = mn;
        sRed[W + warp] = mx;
    }
    __syncthreads();
    i64 qmin = sRed[0], qmax = sRed[W];
#pragma unroll
    for (int w = 1; w < W; ++w) {
        qmin = fw_min64(qmin, sRed[w]);
        qmax = fw_max64(qmax, sRed[W + w]);
    }
    const int row0 = warp * 16 + (lane >> 2);  // this thread's accumulator rows row0, row0 + 8
    const i64 qp0 = sQP[row0], qp1 = sQP[row0 + 8];

    // Loaders: chunk i of a [rows][HD] tile = row (i / 8) % rows, column 8·(i % 8) +
    // 64·(i / (8·rows)): a warp writes 4 consecutive rows of one column block (512
    // contiguous bytes of shared memory) and reads 4 × 128 contiguous bytes.
    const unsigned sQa = fw_smem_u32(sQ), sKa = fw_smem_u32(sK), sVa = fw_smem_u32(sV);
#pragma unroll
    for (int i = 0; i < BR * HD / 8 / THREADS; ++i) {
        const int c = tid + i * THREADS;
        const int r = (c >> 3) % BR, col = (c & 7) * 8 + (c / (8 * BR)) * 64;
        const bool ok = q0 + r < tq;
        const bf16* src = q + (ok ? ((size_t)(q0 + r) * nh + h) * HD + col : 0);
        fw_cp_async16(sQa + fw_swz(BR, r, col), src, ok);
    }
    auto load_tile = [&](const bf16* g, unsigned dst, int j) {
        const int j0 = j * BC;
#pragma unroll
        for (int i = 0; i < BC * HD / 8 / THREADS; ++i) {
            const int c = tid + i * THREADS;
            const int r = (c >> 3) % BC, col = (c & 7) * 8 + (c / (8 * BC)) * 64;
            const bool ok = j0 + r < n_kv;
            const size_t off = ok ? ((size_t)(j0 + r) * nkv + kh) * HD + col : 0;
            fw_cp_async16(dst + fw_swz(BC, r, col), g + off, ok);
        }
    };
    auto load_k = [&](int j, int st) {  // K tile j and its key positions → stage st
        load_tile(k, sKa + st * TBYTES, j);
        const int j0 = j * BC;
        if (tid < BC) {
            i64* d = sKP + st * BC + tid;
            if (j0 + tid < n_kv)
                fw_cp_async8(fw_smem_u32(d), kv_pos + j0 + tid);
            else
                *d = FW_I64_MAX;
        }
    };
    auto load_v = [&](int j, int st) { load_tile(v, sVa + st * TBYTES, j); };

    float s[ST][4];
    float acc[NT][4];
    unsigned p[BC / 16][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
    for (int n = 0; n < BC / 16; ++n) p[n][0] = p[n][1] = p[n][2] = p[n][3] = 0u;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

    // S = Q K(stage)ᵀ for this warpgroup's 64 rows: HD / 16 wgmma k-steps, one group.
    auto issue_s = [&](int st) {
        const unsigned qa = sQa + wg * 64 * 128, ka = sKa + st * TBYTES;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            const unsigned kc = (kk & 3) * 32;
            fw_wgmma_ss_n64(&s[0][0], fw_desc(qa + (kk >> 2) * BR * 128 + kc, 16, 1024),
                            fw_desc(ka + (kk >> 2) * BC * 128 + kc, 16, 1024), kk > 0);
        }
        fw_wgmma_commit();
    };
    // O += P V(stage): BC / 16 k-steps of 16 keys, one group.
    auto issue_pv = [&](int st) {
        const unsigned va = sVa + st * TBYTES;
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
            FwPv<HD>::mma(&acc[0][0], p[kk], fw_desc(va + kk * 16 * 128, BC * 128, 1024));
        fw_wgmma_commit();
    };
    // Online softmax of S for key tile j (positions in stage st): scale to the log2 domain,
    // mask unless fully visible, new row maxima; S becomes 2^(S − m); returns the
    // correction factors of the old O and row sums in c0, c1.
    auto softmax = [&](int j, int st, float& c0, float& c1) {
        const int nvalid = n_kv - j * BC;
        const bool full = nvalid >= BC && tmax[j] <= qmin;
        const i64* kp = sKP + st * BC;
#pragma unroll
        for (int n = 0; n < ST; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] *= scale_log2;
            if (!full) {
                const int c = n * 8 + 2 * (lane & 3);
                const i64 p0 = kp[c], p1 = kp[c + 1];
                const bool v0 = c < nvalid, v1 = c + 1 < nvalid;
                if (!v0 || p0 > qp0) s[n][0] = NEG_INF;
                if (!v1 || p1 > qp0) s[n][1] = NEG_INF;
                if (!v0 || p0 > qp1) s[n][2] = NEG_INF;
                if (!v1 || p1 > qp1) s[n][3] = NEG_INF;
            }
        }
        float r0 = NEG_INF, r1 = NEG_INF;
#pragma unroll
        for (int n = 0; n < ST; ++n) {
            r0 = fmaxf(r0, fmaxf(s[n][0], s[n][1]));
            r1 = fmaxf(r1, fmaxf(s[n][2], s[n][3]));
        }
        r0 = fmaxf(r0, __shfl_xor_sync(0xffffffffu, r0, 1));
        r0 = fmaxf(r0, __shfl_xor_sync(0xffffffffu, r0, 2));
        r1 = fmaxf(r1, __shfl_xor_sync(0xffffffffu, r1, 1));
        r1 = fmaxf(r1, __shfl_xor_sync(0xffffffffu, r1, 2));
        const float n0 = fmaxf(m0, r0), n1 = fmaxf(m1, r1);
        const float b0 = n0 == NEG_INF ? 0.f : n0, b1 = n1 == NEG_INF ? 0.f : n1;
        c0 = fw_exp2(m0 - b0);
        c1 = fw_exp2(m1 - b1);
        m0 = n0;
        m1 = n1;
        float ls0 = 0.f, ls1 = 0.f;
#pragma unroll
        for (int n = 0; n < ST; ++n) {
            s[n][0] = fw_exp2(s[n][0] - b0);
            s[n][1] = fw_exp2(s[n][1] - b0);
            s[n][2] = fw_exp2(s[n][2] - b1);
            s[n][3] = fw_exp2(s[n][3] - b1);
            ls0 += s[n][0] + s[n][1];
            ls1 += s[n][2] + s[n][3];
        }
        l0 = l0 * c0 + ls0;
        l1 = l1 * c1 + ls1;
    };
    // P (bf16 A fragments, 16 keys per k-step) from the exponentiated S accumulators.
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            p[kk][0] = fw_pack(s[2 * kk][0], s[2 * kk][1]);
            p[kk][1] = fw_pack(s[2 * kk][2], s[2 * kk][3]);
            p[kk][2] = fw_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            p[kk][3] = fw_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
    };

    // Prologue: Q, K(j0) → stage 0, V(j0) → stage 0, K(j1) → stage 1; S(j0) and P(j0).
    int j = fw_next_tile(tmin, smin, jb, je, qmax, lane);
    int jn = j < je ? fw_next_tile(tmin, smin, j + 1, je, qmax, lane) : je;
    if (j < je) {
        load_k(j, 0);
        load_v(j, 0);
    }
    if (jn < je) load_k(jn, 1);
    fw_cp_commit();
    fw_cp_wait_all();
    fw_fence_proxy_async();
    __syncthreads();
    // The wgmma below run unconditionally (a stage that holds no tile gives scores that are
    // never used): a wgmma on a path the compiler cannot prove warpgroup-uniform makes ptxas
    // serialise every wgmma of the kernel (C7520).
    fw_wgmma_fence();
    issue_s(0);
    fw_wgmma_wait<0, ST * 4>(&s[0][0]);
    if (j < je) {
        float c0, c1;
        softmax(j, 0, c0, c1);
        pack_p();
    }
    int i = 0;
    while (j < je) {
        const int jnn = jn < je ? fw_next_tile(tmin, smin, jn + 1, je, qmax, lane) : je;
        // Stage (i + 1) % 2 of V held V(i − 1) (its P V finished last iteration); stage i % 2
        // of K held K(i) (S(i) finished last iteration).
        if (jn < je) load_v(jn, (i + 1) & 1);
        if (jnn < je) load_k(jnn, i & 1);
        fw_cp_commit();
        fw_wgmma_fence();
        issue_s((i + 1) & 1);  // for the last tile: scores of a stale stage, unused
        issue_pv(i & 1);
        fw_wgmma_wait<1, ST * 4>(&s[0][0]);  // S(i+1) done, P V(i) may still run
        float c0 = 1.f, c1 = 1.f;
        if (jn < je) softmax(jn, (i + 1) & 1, c0, c1);
        fw_wgmma_wait<0, NT * 4>(&acc[0][0]);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            acc[n][0] *= c0;
            acc[n][1] *= c0;
            acc[n][2] *= c1;
            acc[n][3] *= c1;
        }
        pack_p();
        fw_cp_wait_all();
        fw_fence_proxy_async();
        __syncthreads();  // loads landed for everyone; the stages read this iteration are free
        j = jn;
        jn = jnn;
        ++i;
    }

    // Row sums, then the output as in flash.cu.
    fw_epilogue<HD>(acc, m0, m1, l0, l1, q0 + row0, lane, h, tq, nh, nsplit, o, wo, wml);
}

#define ATTN_FLASH_WG(HD)                                                                             \
    extern "C" __global__ void __launch_bounds__(FW_THREADS, 1) attn_flash_wg_bf16_##HD(              \
        const bf16* q, const bf16* k, const bf16* v, const i64* q_pos, const i64* kv_pos,             \
        const i64* tiles, bf16* o, float* wo, float* wml, int tq, int n_kv, int nh, int nkv,          \
        float scale_log2) {                                                                           \
        attn_flash_wg_impl<HD>(q, k, v, q_pos, kv_pos, tiles, o, wo, wml, tq, n_kv, nh, nkv,          \
                               scale_log2);                                                           \
    }
ATTN_FLASH_WG(256)
ATTN_FLASH_WG(128)
// ============================================================================================
// Warp-specialised kernels attn_flash_wg3tmal_bf16_{256,128} (64-key tiles) and
// attn_flash_wg3tmalb80_bf16_{256,128} (80-key tiles) (attn::prefill_flash_wg_with with
// FlashWgKernel::WarpSpecializedTmaLean / WarpSpecializedTmaLeanBc80): the FlashAttention-3
// schedule (Shah et al. 2024, §3.1 "producer-consumer asynchrony through warp-specialization
// and pingpong scheduling", §3.2 intra-warpgroup overlap) on the same layouts, descriptors
// and fragments as the kernel above. Same contract, arguments and grid plus two kernel
// parameters, the tensor maps of K and V (attn.rs: encode_kv_map); block = 3 warpgroups
// (384 threads):
// * warpgroup 0, the producer: setmaxnreg.dec to FW3_REG_LOAD registers; loads Q once by
//   cp.async (the whole warpgroup, the swizzled loader above, completing on the Q mbarrier
//   by cp.async.mbarrier.arrive.noinc: expected count 128), then producer warp 0 alone runs
//   the tile loop: the visible K and V tiles (BC keys) in the order the consumers use them,
//   K(0), K(1), V(0), K(2), V(1), ..., into a ring of FW3_STAGES(HD) stages (3 at HD 128;
//   2 at HD 256, where Q and two K/V stages already take 192 KiB (BC 64) or 224 KiB (BC 80)
//   of the 227 KiB). Per K tile its 32 lanes copy the key positions (cp.async +
//   cp.async.mbarrier.arrive.noinc: 32 arrivals) and lane 0 publishes the tile's facts (its
//   index, and its largest key position by a cp.async its asynchronous arrival covers), runs
//   mbarrier.arrive.expect_tx(TBYTES) and issues NCB boxes of 64 elements × BC keys
//   (cp.async.bulk.tensor.2d ... .mbarrier::complete_tx::bytes) at (kh·HD + 64·cb, j·BC) of
//   the [n_kv][nkv·HD] view into region cb of the stage (K full count 33); V tiles the same
//   without positions (V full count 1). Before refilling a stage it waits on the stage's
//   "empty" mbarrier (expected count 256: every consumer thread arrives once its wgmma
//   reading the stage retired). Phase parities: tile t of a ring of S stages is the
//   (t / S)-th use of stage t % S: consumers wait "full" with parity (t / S) & 1, the
//   producer waits "empty" with parity ((t / S) & 1) ^ 1 (fresh barrier: parity 1 passes
//   at once).
// * warpgroups 1 and 2, the consumers (query rows 0..63 and 64..127): setmaxnreg.inc to
//   FW3_REG_MMA registers; they count their visible key tiles once (a warp vote per 32 tile
//   summaries) and read no global memory in the loop (the tile facts come from the
//   producer through shared memory); the loop of the kernel above without __syncthreads and
//   without loads: wait full K(i+1) / V(i), issue S(i+1) = Q K(i+1)ᵀ and O += P(i) V(i),
//   softmax of S(i+1) while P V runs (the scale folded into the exponent's FMA,
//   2^(s·c − m·c), as FA3 does), rescale, pack P(i+1); "empty" arrivals after the
//   wait_group that retires the reading wgmma (K: after the softmax, which also reads the
//   key positions and facts of the stage).
// * ping-pong (FA3 §3.1): named barrier 1 + w gates the wgmma issue of consumer w (256
//   threads: its own 128 bar.sync + the other's 128 bar.arrive); after issuing, consumer w
//   arrives on the other's barrier, so the GEMMs of one warpgroup queue behind the other's
//   and one warpgroup's softmax / rescale runs while the other's GEMMs occupy the tensor
//   cores. Consumer 1 opens consumer 0's first turn; its last arrival is skipped (both run
//   the same tile list, so every arrival is matched by a sync).
// Registers: 128·(FW3_REG_LOAD + 2·FW3_REG_MMA) ≤ 65536; the launch bound (384, 1) gives
// 168 per thread at entry (65536 / 384 rounded down to 8), and 24 + 2·240 = 3·168.
// ptxas allocates each setmaxnreg region within its count (checked with NVRTC 13: at 200
// the HD-256 consumer spills and ptxas serialises its wgmma (C7512); at 240 no spills);
// the launch bound's minimum of 1 CTA per SM pins the entry count (without it ptxas drops
// setmaxnreg, C7508).
// Hardware facts used here (PTX ISA 8.x/9.0: "mbarrier" (init, arrive, try_wait.parity,
// phase completion, expected / pending counts; expect-tx / tx-count: a phase completes when
// the pending arrivals and the tx-count are both zero), "cp.async.mbarrier.arrive" (.noinc:
// the asynchronous arrival is not pre-counted, so the expected count includes it; triggered
// when all prior cp.async of the thread completed), "bar.sync / bar.arrive" (named
// barriers 0..15, thread count a multiple of the warp size), "setmaxnreg" (24..256 in
// steps of 8, same value in all warps of a warpgroup, per-CTA pool, .inc blocks until
// available), "Memory Consistency Model: proxies" (cp.async writes are generic-proxy
// writes; wgmma operand reads are async-proxy reads; a fence.proxy.async orders them once
// the writes are visible to the fencing thread, here through the mbarrier acquire),
// "Tensors" (tiled mode, bounding box, swizzle modes; "Out of Bounds Access": box elements
// outside the tensor are filled with zeros in the default fill mode, the driver's
// CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE (the other mode, NAN_REQUEST_ZERO_FMA, fills NaN)),
// "cp.async.bulk.tensor" (writes through the async proxy; complete_tx of the box's bytes on
// the mbarrier, OOB elements included); CUDA driver API cuTensorMapEncodeTiled (64-byte
// aligned map, global address 16-byte aligned, strides multiples of 16 < 2^40, box sizes
// ≤ 256, inner box ≤ 128 bytes with CU_TENSOR_MAP_SWIZZLE_128B); FA3 paper §3.1 (warp
// specialisation with setmaxnreg, ping-pong with named barriers), §3.2 (intra-warpgroup
// overlap); CUTLASS's PipelineAsync / cpasync_barrier_arrive_noinc for the
// cp.async-with-mbarrier pattern and its producer start phase 1, SM90_TMA_LOAD_2D /
// ClusterTransactionBarrier::arrive_and_expect_tx for the same instruction forms,
// __grid_constant__ tensor-map parameters). The copy engine's 128-byte swizzle is a function
// of the shared address bits (16-byte chunk bits [4,7) ^= [7,10)), the one the wgmma
// descriptors read; stages start on 1024-byte boundaries. The consumers need no
// fence.proxy.async for the TMA data (async proxy on both sides): the mbarrier wait orders
// it; the Q tile (cp.async) is fenced once in the prologue.
// Shared memory (base rounded up to 1024): sQ [NCB][128][128 B] | sK [S][NCB][BC][128 B] |
// sV [S][NCB][BC][128 B] | sKP [S][BC] i64 | sRed [32] i64 (with the tile facts) |
// mbarriers [16] = 1024 + NCB·(128 + 2·S·BC)·128 + (S·BC + 48)·8 bytes (attn.rs:
// flash_wg3_smem_bytes): HD 256 (S 2): 199 040 (BC 64), 232 064 (BC 80, of the 232 448 an
// H100 / H200 CTA may have); HD 128 (S 3): 134 016 (BC 64), 158 976 (BC 80). The query
// positions are read from global memory (no room for them at BC 80).
#define FW3_THREADS 384
#define FW3_REG_LOAD 24
#define FW3_REG_MMA 240
#define FW3_STAGES(HD) ((HD) == 256 ? 2 : 3)

template <int HD, int BC>
__device__ __forceinline__ void attn_flash_wg3_impl(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                    const bf16* __restrict__ v, const i64* __restrict__ q_pos,
                                                    const i64* __restrict__ kv_pos, const i64* __restrict__ tiles,
                                                    bf16* __restrict__ o, float* __restrict__ wo,
                                                    float* __restrict__ wml, int tq, int n_kv, int nh, int nkv,
                                                    float scale_log2, const FwTmap* tmk, const FwTmap* tmv) {
    constexpr int BR = FW_BR, THREADS = FW3_THREADS, S = FW3_STAGES(HD);
    constexpr int NCB = HD / 64;
    constexpr int QBYTES = NCB * BR * 128;
    constexpr int TBYTES = NCB * BC * 128;  // one K or V stage
    constexpr int NT = HD / 8;
    constexpr int ST = BC / 8;
    constexpr int W = THREADS / 32;
    constexpr int PT = 128;  // producer threads
    static_assert(HD == 128 || HD == 256, "head dim");
    static_assert(BC == 64 || BC == 80, "key tile");  // regions of BC·128 bytes: whole 1024-byte atoms
    static_assert((BR * HD / 8) % PT == 0 && (BC * HD / 8) % PT == 0, "loader shape");
    static_assert(PT * (FW3_REG_LOAD + 2 * FW3_REG_MMA) <= 65536, "register pool");
    static_assert(2 * W + 2 * S <= 32, "tile facts share sRed");
    extern __shared__ __align__(1024) unsigned char fw_smem[];
    unsigned char* base = fw_smem + ((1024u - (fw_smem_u32(fw_smem) & 1023u)) & 1023u);
    unsigned char* sQ = base;
    unsigned char* sK = sQ + QBYTES;
    unsigned char* sV = sK + S * TBYTES;
    i64* sKP = reinterpret_cast<i64*>(sV + S * TBYTES);
    i64* sRed = sKP + S * BC;
    unsigned long long* sBar = reinterpret_cast<unsigned long long*>(sRed + 32);
    // Per K stage st, the tile facts in sRed[2W + 2st ..]: the tile's largest key position
    // (tmax[j], copied by cp.async) and its index j.
    i64* sFact = sRed + 2 * W;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = tid >> 7;
    const int nqt = (tq + BR - 1) / BR;
    const int qt = nqt - 1 - (int)(blockIdx.x / (unsigned)nh);
    const int h = (int)(blockIdx.x % (unsigned)nh);
    const int kh = h / (nh / nkv);
    const int q0 = qt * BR;
    const int ntk = (n_kv + BC - 1) / BC;
    const int nsplit = gridDim.y;
    const int per = (ntk + nsplit - 1) / nsplit;
    const int jb = min(ntk, (int)blockIdx.y * per), je = min(ntk, jb + per);
    const i64* tmin = tiles;
    const i64* tmax = tiles + ntk;
    const i64* smin = tiles + 2 * ntk;
    // mbarrier addresses: Q full; K full / V full / K empty / V empty per stage.
    const unsigned bar0 = fw_smem_u32(sBar);
    auto bar_q = [&]() { return bar0; };
    auto bar_kf = [&](int st) { return bar0 + 8u * (1 + st); };
    auto bar_vf = [&](int st) { return bar0 + 8u * (1 + S + st); };
    auto bar_ke = [&](int st) { return bar0 + 8u * (1 + 2 * S + st); };
    auto bar_ve = [&](int st) { return bar0 + 8u * (1 + 3 * S + st); };

    if (tid == 0) {
        fw_mbar_init(bar_q(), PT);
        for (int st = 0; st < S; ++st) {
            // K full = 32 cp.async arrivals (key positions, producer warp 0) + the
            // expect_tx arrival; V full = the expect_tx arrival.
            fw_mbar_init(bar_kf(st), 33);
            fw_mbar_init(bar_vf(st), 1);
            fw_mbar_init(bar_ke(st), THREADS - PT);
            fw_mbar_init(bar_ve(st), THREADS - PT);
        }
        fw_mbar_init_fence();
    }
    // Query positions (rows past tq: I64_MIN) and their min / max over the real rows.
    i64 mn = FW_I64_MAX, mx = FW_I64_MIN;
    if (tid < BR) {
        const bool ok = q0 + tid < tq;
        const i64 p = ok ? q_pos[q0 + tid] : FW_I64_MIN;
        if (ok) {
            mn = p;
            mx = p;
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        mn = fw_min64(mn, __shfl_xor_sync(0xffffffffu, mn, off));
        mx = fw_max64(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    }
    if (lane == 0) {
        sRed[warp] = mn;
        sRed[W + warp] = mx;
    }
    __syncthreads();  // the only block-wide barrier: positions, reductions, mbarrier inits
    i64 qmax = sRed[W];
#pragma unroll
    for (int w = 1; w < W; ++w) qmax = fw_max64(qmax, sRed[W + w]);
    const unsigned sQa = fw_smem_u32(sQ), sKa = fw_smem_u32(sK), sVa = fw_smem_u32(sV);

    if (wg == 0) {
        // ---------------- producer ----------------
        fw_setmaxnreg_dec<FW3_REG_LOAD>();
        const int pt = tid;
#pragma unroll 4
        for (int i = 0; i < BR * HD / 8 / PT; ++i) {
            const int c = pt + i * PT;
            const int r = (c >> 3) % BR, col = (c & 7) * 8 + (c / (8 * BR)) * 64;
            const bool ok = q0 + r < tq;
            const bf16* src = q + (ok ? ((size_t)(q0 + r) * nh + h) * HD + col : 0);
            fw_cp_async16(sQa + fw_swz(BR, r, col), src, ok);
        }
        fw_cp_mbar_arrive(bar_q());
        // One warp runs the loop (the tile search is warp-wide); lane 0 issues the boxes.
        if (warp != 0) {
            fw_cp_commit();
            fw_cp_wait_all();
            return;
        }
        // Tile j into stage st: NCB boxes of 64 columns × BC keys (8 KiB at BC 64), the
        // box of column block cb at (kh·HD + 64·cb, j·BC) of the [n_kv][nkv·HD] view,
        // landing as the [BC][128 B] swizzled region cb of the stage.
        auto tma_tile = [&](const FwTmap* map, unsigned dst, unsigned bar, int j) {
            fw_mbar_expect_tx(bar, TBYTES);
#pragma unroll
            for (int cb = 0; cb < NCB; ++cb) fw_tma_load_2d(dst + cb * BC * 128, map, kh * HD + cb * 64, j * BC, bar);
        };
        auto load_kp = [&](int st, int j) {
            if (lane == 0) {
                // j: published by lane 0's expect_tx arrival below (release; the
                // consumers' wait on the stage acquires); tmax[j]: a cp.async that lane
                // 0's asynchronous arrival covers, like the key positions.
                sFact[2 * st + 1] = j;
                fw_cp_async8z(fw_smem_u32(sFact + 2 * st), tmax + j, true);
            }
            for (int r = lane; r < BC; r += 32) {
                const bool ok = j * BC + r < n_kv;
                fw_cp_async8z(fw_smem_u32(sKP + st * BC + r), kv_pos + (ok ? j * BC + r : 0), ok);
            }
            fw_cp_mbar_arrive(bar_kf(st));
            if (lane == 0) tma_tile(tmk, sKa + st * TBYTES, bar_kf(st), j);
        };
        int j = fw_next_tile(tmin, smin, jb, je, qmax, lane);
        int t = 0, sk = 0, sv = 0;
        if (j < je) {  // (no tile, e.g. n_kv = 0: the maps may be dummies, never touched)
            if (lane == 0) {
                fw_tma_prefetch(tmk);
                fw_tma_prefetch(tmv);
            }
            fw_mbar_wait(bar_ke(0), 1);
            load_kp(0, j);
        }
        while (j < je) {
            const int jn = fw_next_tile(tmin, smin, j + 1, je, qmax, lane);
            if (jn < je) {
                sk = sk + 1 == S ? 0 : sk + 1;
                fw_mbar_wait(bar_ke(sk), (((t + 1) / S) & 1) ^ 1);
                load_kp(sk, jn);
            }
            fw_mbar_wait(bar_ve(sv), ((t / S) & 1) ^ 1);
            if (lane == 0) tma_tile(tmv, sVa + sv * TBYTES, bar_vf(sv), j);
            sv = sv + 1 == S ? 0 : sv + 1;
            j = jn;
            ++t;
        }
        // Not needed for the mbarriers (they track the copies); the producer just does not
        // exit with copies in flight (wait_group only covers committed groups).
        fw_cp_commit();
        fw_cp_wait_all();
        return;
    }

    // ---------------- consumers ----------------
    fw_setmaxnreg_inc<FW3_REG_MMA>();
    const int ct = tid - PT, cwarp = ct >> 5, wgc = ct >> 7;
    i64 qmin = sRed[0];
#pragma unroll
    for (int w = 1; w < W; ++w) qmin = fw_min64(qmin, sRed[w]);
    const int row0 = cwarp * 16 + (lane >> 2);  // this thread's accumulator rows row0, row0 + 8
    // This thread's query positions (rows past tq: I64_MIN, they see nothing), from global
    // memory (no shared copy: 128 × 80 tiles at HD 256 leave no room for it).
    const i64 qp0 = q0 + row0 < tq ? q_pos[q0 + row0] : FW_I64_MIN;
    const i64 qp1 = q0 + row0 + 8 < tq ? q_pos[q0 + row0 + 8] : FW_I64_MIN;

    float s[ST][4];
    float acc[NT][4];
    unsigned p[BC / 16][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
    for (int n = 0; n < BC / 16; ++n) p[n][0] = p[n][1] = p[n][2] = p[n][3] = 0u;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

    auto issue_s = [&](int st) {
        const unsigned qa = sQa + wgc * 64 * 128, ka = sKa + st * TBYTES;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            const unsigned kc = (kk & 3) * 32;
            FwS<BC>::mma(&s[0][0], fw_desc(qa + (kk >> 2) * BR * 128 + kc, 16, 1024),
                         fw_desc(ka + (kk >> 2) * BC * 128 + kc, 16, 1024), kk > 0);
        }
        fw_wgmma_commit();
    };
    auto issue_pv = [&](int st) {
        const unsigned va = sVa + st * TBYTES;
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
            FwPv<HD>::mma(&acc[0][0], p[kk], fw_desc(va + kk * 16 * 128, BC * 128, 1024));
        fw_wgmma_commit();
    };
    // Scores of one tile → probabilities (in s), running max / sum; c0, c1: the factors
    // that rescale the accumulator rows. `nvalid`: keys of the tile inside n_kv (may exceed
    // BC); `full`: every key of the tile is visible to every query row of the CTA (no
    // masking). s and m stay in the raw score domain; the scale is folded into the
    // exponent's FMA: 2^(s·scale − m·scale), as FA3 does.
    auto softmax = [&](int nvalid, bool full, int st, float& c0, float& c1) {
        const i64* kp = sKP + st * BC;
#pragma unroll
        for (int n = 0; n < ST; ++n) {
            if (!full) {
                const int c = n * 8 + 2 * (lane & 3);
                const i64 p0 = kp[c], p1 = kp[c + 1];
                const bool v0 = c < nvalid, v1 = c + 1 < nvalid;
                if (!v0 || p0 > qp0) s[n][0] = NEG_INF;
                if (!v1 || p1 > qp0) s[n][1] = NEG_INF;
                if (!v0 || p0 > qp1) s[n][2] = NEG_INF;
                if (!v1 || p1 > qp1) s[n][3] = NEG_INF;
            }
        }
        float r0 = NEG_INF, r1 = NEG_INF;
#pragma unroll
        for (int n = 0; n < ST; ++n) {
            r0 = fmaxf(r0, fmaxf(s[n][0], s[n][1]));
            r1 = fmaxf(r1, fmaxf(s[n][2], s[n][3]));
        }
        r0 = fmaxf(r0, __shfl_xor_sync(0xffffffffu, r0, 1));
        r0 = fmaxf(r0, __shfl_xor_sync(0xffffffffu, r0, 2));
        r1 = fmaxf(r1, __shfl_xor_sync(0xffffffffu, r1, 1));
        r1 = fmaxf(r1, __shfl_xor_sync(0xffffffffu, r1, 2));
        const float n0 = fmaxf(m0, r0), n1 = fmaxf(m1, r1);
        const float b0 = n0 == NEG_INF ? 0.f : n0, b1 = n1 == NEG_INF ? 0.f : n1;
        float ls0 = 0.f, ls1 = 0.f;
        // −inf (masked score, or an empty running max) stays −inf → 2^−inf = 0.
        const float nb0 = -b0 * scale_log2, nb1 = -b1 * scale_log2;
        c0 = fw_exp2(fmaf(m0, scale_log2, nb0));
        c1 = fw_exp2(fmaf(m1, scale_log2, nb1));
#pragma unroll
        for (int n = 0; n < ST; ++n) {
            s[n][0] = fw_exp2(fmaf(s[n][0], scale_log2, nb0));
            s[n][1] = fw_exp2(fmaf(s[n][1], scale_log2, nb0));
            s[n][2] = fw_exp2(fmaf(s[n][2], scale_log2, nb1));
            s[n][3] = fw_exp2(fmaf(s[n][3], scale_log2, nb1));
            ls0 += s[n][0] + s[n][1];
            ls1 += s[n][2] + s[n][3];
        }
        m0 = n0;
        m1 = n1;
        l0 = l0 * c0 + ls0;
        l1 = l1 * c1 + ls1;
    };
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            p[kk][0] = fw_pack(s[2 * kk][0], s[2 * kk][1]);
            p[kk][1] = fw_pack(s[2 * kk][2], s[2 * kk][3]);
            p[kk][2] = fw_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            p[kk][3] = fw_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
    };

    // The CTA's visible tiles, counted once (the loop reads no global memory; the producer
    // publishes each K stage's tile facts in sFact). The count comes from warp votes, so the
    // loop is provably warpgroup-uniform (ptxas C7520 otherwise).
    const int nvis = fw_count_tiles(tmin, smin, jb, je, qmax, lane);
    bool have = nvis > 0;       // tile t exists
    bool have_next = nvis > 1;  // tile t + 1 exists
    // Valid keys and "no masking" of the tile held in K stage st.
    auto facts = [&](int st, int& nvalid, bool& full) {
        nvalid = n_kv - (int)sFact[2 * st + 1] * BC;
        full = nvalid >= BC && sFact[2 * st] <= qmin;
    };

    // Prologue: Q, K(0) → S(0), P(0).
    fw_mbar_wait(bar_q(), 0);
    if (have) fw_mbar_wait(bar_kf(0), 0);
    fw_fence_proxy_async();
    // wgmma unconditionally (see the kernel above: C7520); without a tile the scores of the
    // unwritten stage are never used.
    fw_wgmma_fence();
    issue_s(0);
    fw_wgmma_wait<0, ST * 4>(&s[0][0]);
    if (have) {
        int nv;
        bool fl;
        facts(0, nv, fl);
        float c0, c1;
        softmax(nv, fl, 0, c0, c1);
        fw_mbar_arrive(bar_ke(0));
        pack_p();
        if (wgc == 1) fw_bar_arrive(1, 2 * PT);  // consumer 0 issues first
    }
    int t = 0, sk = S > 1 ? 1 : 0, sv = 0;  // stages of K(t + 1) and V(t)
    while (have) {
        if (have_next) fw_mbar_wait(bar_kf(sk), ((t + 1) / S) & 1);
        fw_mbar_wait(bar_vf(sv), (t / S) & 1);
        // TMA writes through the async proxy, as wgmma reads: no proxy fence.
        fw_bar_sync(1 + wgc, 2 * PT);  // my turn at the tensor cores
        fw_wgmma_fence();
        issue_s(sk);  // for the last tile: scores of a stale stage, unused
        issue_pv(sv);
        if (wgc == 0 || have_next) fw_bar_arrive(2 - wgc, 2 * PT);  // the other's turn
        fw_wgmma_wait<1, ST * 4>(&s[0][0]);  // S(t+1) done, P V(t) may still run
        float c0 = 1.f, c1 = 1.f;
        if (have_next) {
            int nv;
            bool fl;
            facts(sk, nv, fl);
            softmax(nv, fl, sk, c0, c1);
            fw_mbar_arrive(bar_ke(sk));  // K(t+1), its positions and facts no longer read
        }
        fw_wgmma_wait<0, NT * 4>(&acc[0][0]);
        fw_mbar_arrive(bar_ve(sv));  // V(t) no longer read
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            acc[n][0] *= c0;
            acc[n][1] *= c0;
            acc[n][2] *= c1;
            acc[n][3] *= c1;
        }
        pack_p();
        sk = sk + 1 == S ? 0 : sk + 1;
        sv = sv + 1 == S ? 0 : sv + 1;
        ++t;
        have = t < nvis;
        have_next = t + 1 < nvis;
    }
    // m is in the raw score domain; the split merge takes it in log2 units.
    fw_epilogue<HD>(acc, m0 * scale_log2, m1 * scale_log2, l0, l1, q0 + row0, lane, h, tq, nh, nsplit, o, wo,
                    wml);
}

// attn_flash_wg3tmal_bf16_{HD} (64-key tiles) and attn_flash_wg3tmalb80_bf16_{HD} (80-key
// tiles: FA3's choice at head dim 256: the S = Q Kᵀ wgmma m64n80 reads 4.5 KiB of shared
// memory per 40 tensor-core cycles instead of 4 KiB per 32, and the per-tile costs spread
// over 25% more keys; tile summaries with bc = 80). The last two arguments are the tensor
// maps of K and V (attn.rs: encode_kv_map).
#define ATTN_FLASH_WG3TMAL(NAME, HD, BC)                                                               \
    extern "C" __global__ void __launch_bounds__(FW3_THREADS, 1) NAME##_bf16_##HD(                     \
        const bf16* q, const bf16* k, const bf16* v, const i64* q_pos, const i64* kv_pos,             \
        const i64* tiles, bf16* o, float* wo, float* wml, int tq, int n_kv, int nh, int nkv,          \
        float scale_log2, const __grid_constant__ FwTmap tmk, const __grid_constant__ FwTmap tmv) {   \
        attn_flash_wg3_impl<HD, BC>(q, k, v, q_pos, kv_pos, tiles, o, wo, wml, tq, n_kv, nh, nkv,      \
                                    scale_log2, &tmk, &tmv);                                          \
    }
ATTN_FLASH_WG3TMAL(attn_flash_wg3tmal, 256, 64)
ATTN_FLASH_WG3TMAL(attn_flash_wg3tmal, 128, 64)
ATTN_FLASH_WG3TMAL(attn_flash_wg3tmalb80, 256, 80)
ATTN_FLASH_WG3TMAL(attn_flash_wg3tmalb80, 128, 80)
#endif  // sm_90a
