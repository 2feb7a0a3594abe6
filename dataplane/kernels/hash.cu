// Device checksum of shipped cache entries (dataplane/src/cuda/peer.rs). CPU
// reference: dataplane/src/parallel/checksum.rs (`word_sum`, `buffer_hash`), which
// defines the hash; the two must agree bit for bit (dataplane/tests/cuda_parallel.rs).
//
// A buffer of n bytes is read as words w_i, i < ceil(n / 4): the little-endian u32
// of bytes 4i .. 4i+3, missing bytes of the last word taken as 0. Each word gives
// the term mix64((i · K1) ^ (seed · K2) ^ w_i) (wrapping u64 products), and the
// kernel adds the terms into *out modulo 2^64. Integer addition is associative and
// commutative, so the sum does not depend on the grid or on the order of the
// atomics. The host finishes with mix64(sum ^ n). mix64 is a bijection, so a change
// of any one word always changes the sum.

#define HASH_K1 0x9E3779B97F4A7C15ull
#define HASH_K2 0xC2B2AE3D27D4EB4Full

__device__ __forceinline__ unsigned long long hash_mix64(unsigned long long z) {
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ull;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBull;
    z ^= z >> 31;
    return z;
}

// out[0] += Σ_i term_i over the words of p[0 .. n) (see above). Any grid; blockDim.x
// a multiple of 32 and at most 1024. `out` must be zeroed before the first launch.
extern "C" __global__ void hash_word_sum(const unsigned char* p, unsigned long long n,
                                         unsigned long long seed, unsigned long long* out) {
    const unsigned long long words = (n + 3) / 4;
    const unsigned long long full = n / 4;
    const bool aligned = (((unsigned long long)p) & 3ull) == 0;
    const unsigned long long s = seed * HASH_K2;
    unsigned long long acc = 0;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < words;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned int w = 0;
        if (i < full && aligned) {
            w = ((const unsigned int*)p)[i];
        } else {
            for (int b = 0; b < 4; ++b) {
                const unsigned long long at = 4 * i + b;
                if (at < n) w |= ((unsigned int)p[at]) << (8 * b);
            }
        }
        acc += hash_mix64((i * HASH_K1) ^ s ^ (unsigned long long)w);
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    __shared__ unsigned long long warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        acc = lane < nw ? warp_sums[lane] : 0ull;
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
        if (lane == 0 && acc != 0ull) atomicAdd(out, acc);
    }
}
