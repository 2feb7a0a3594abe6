//! CPU primitives of the reference backend. All tensors are row-major fp32 slices.
use rayon::prelude::*;

/// `y[T, out] = x[T, in] · wᵀ` where `w` is a PyTorch `nn.Linear` weight `[out, in]`.
///
/// Multithreaded through the `gemm` crate (rayon). Panics if lengths disagree with
/// `t`, `inp`, `out` (internal invariant).
pub fn linear(x: &[f32], t: usize, inp: usize, w: &[f32], out: usize) -> Vec<f32> {
    assert_eq!(x.len(), t * inp, "linear: x must be [T, in]");
    assert_eq!(w.len(), out * inp, "linear: w must be [out, in]");
    let mut y = vec![0f32; t * out];
    if t == 0 || out == 0 {
        return y;
    }
    if inp == 0 {
        return y;
    }
    if t == 1 {
        gemv(x, inp, w, &mut y);
        return y;
    }
    let par = if t * inp * out >= 1 << 18 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: all pointers come from slices of exactly the sizes given to gemm, with
    // strides (column stride, row stride) matching row-major layouts.
    unsafe {
        gemm::gemm(
            t,
            out,
            inp,
            y.as_mut_ptr(),
            1,
            out as isize,
            false,
            x.as_ptr(),
            1,
            inp as isize,
            w.as_ptr(),
            inp as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
    y
}

/// Matrix-vector product `y[out] = w[out, in] · x[in]` (decode: one token).
///
/// Memory-bound on real models (every weight is read once per token), so rows are
/// split across the rayon pool in chunks of whole 4-row groups, with enough chunks to
/// balance the threads but not so many that scheduling costs show; small products run
/// on the calling thread. Each chunk uses the AVX2+FMA kernel when the CPU has it
/// (runtime detection), else a portable one.
fn gemv(x: &[f32], inp: usize, w: &[f32], y: &mut [f32]) {
    let out = y.len();
    // Below ~128 KiB of weights a rayon hand-off costs more than it saves.
    if out * inp < 1 << 15 {
        gemv_rows(x, inp, w, y);
        return;
    }
    let threads = rayon::current_num_threads().max(1);
    // ~4 chunks per thread, at least 16 rows and at least ~64 KiB of weights each.
    let min_rows = (16usize).max((1 << 14) / inp.max(1));
    let rows = out.div_ceil(4 * threads).max(min_rows).div_ceil(4) * 4;
    y.par_chunks_mut(rows).enumerate().for_each(|(c, ys)| {
        let r0 = c * rows;
        gemv_rows(x, inp, &w[r0 * inp..(r0 + ys.len()) * inp], ys);
    });
}

/// `ys[r] = w[r, :] · x` for the rows of `w` (`[ys.len(), inp]`), on this thread.
#[inline]
fn gemv_rows(x: &[f32], inp: usize, w: &[f32], ys: &mut [f32]) {
    debug_assert_eq!(w.len(), ys.len() * inp);
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma() {
            // SAFETY: the CPU supports AVX2 and FMA (checked above); slice bounds are
            // checked inside.
            unsafe { x86::gemv_rows_avx2(x, inp, w, ys) };
            return;
        }
    }
    for (r, yv) in ys.iter_mut().enumerate() {
        *yv = dot_portable(&w[r * inp..(r + 1) * inp], x);
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn has_avx2_fma() -> bool {
    // std caches the CPUID result; this is two relaxed atomic loads.
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Horizontal sum of the 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    /// Dot product, 4 × 8-lane FMA accumulators.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (u, ac) in acc.iter_mut().enumerate() {
                let va = _mm256_loadu_ps(pa.add(i + 8 * u));
                let vb = _mm256_loadu_ps(pb.add(i + 8 * u));
                *ac = _mm256_fmadd_ps(va, vb, *ac);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i)),
                _mm256_loadu_ps(pb.add(i)),
                acc[0],
            );
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = hsum(v);
        while i < n {
            s += *pa.add(i) * *pb.add(i);
            i += 1;
        }
        s
    }

    /// `ys[r] = w[r, :] · x`: four rows at a time share each load of `x`, two 8-lane
    /// accumulators per row.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gemv_rows_avx2(x: &[f32], inp: usize, w: &[f32], ys: &mut [f32]) {
        let rows = ys.len();
        assert!(
            x.len() >= inp && w.len() >= rows * inp,
            "gemv: slices too short"
        );
        let px = x.as_ptr();
        let mut r = 0;
        while r + 4 <= rows {
            let p = [
                w.as_ptr().add(r * inp),
                w.as_ptr().add((r + 1) * inp),
                w.as_ptr().add((r + 2) * inp),
                w.as_ptr().add((r + 3) * inp),
            ];
            let mut a0 = [_mm256_setzero_ps(); 4];
            let mut a1 = [_mm256_setzero_ps(); 4];
            let mut k = 0;
            while k + 16 <= inp {
                let x0 = _mm256_loadu_ps(px.add(k));
                let x1 = _mm256_loadu_ps(px.add(k + 8));
                for j in 0..4 {
                    a0[j] = _mm256_fmadd_ps(_mm256_loadu_ps(p[j].add(k)), x0, a0[j]);
                    a1[j] = _mm256_fmadd_ps(_mm256_loadu_ps(p[j].add(k + 8)), x1, a1[j]);
                }
                k += 16;
            }
            if k + 8 <= inp {
                let x0 = _mm256_loadu_ps(px.add(k));
                for j in 0..4 {
                    a0[j] = _mm256_fmadd_ps(_mm256_loadu_ps(p[j].add(k)), x0, a0[j]);
                }
                k += 8;
            }
            for j in 0..4 {
                let mut s = hsum(_mm256_add_ps(a0[j], a1[j]));
                for kk in k..inp {
                    s += *p[j].add(kk) * *px.add(kk);
                }
                ys[r + j] = s;
            }
            r += 4;
        }
        while r < rows {
            ys[r] = dot_avx2(&w[r * inp..(r + 1) * inp], &x[..inp]);
            r += 1;
        }
    }
}

/// Dot product (AVX2+FMA when the CPU has it, else eight auto-vectorised lanes).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma() {
            // SAFETY: AVX2 and FMA are available (checked above).
            return unsafe { x86::dot_avx2(a, b) };
        }
    }
    dot_portable(a, b)
}

/// Portable dot product with eight accumulators (auto-vectorised).
#[inline]
fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let n = a.len().min(b.len());
    let chunks = n / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..n {
        s += a[i] * b[i];
    }
    s
}

/// Zero-centred RMSNorm (`Qwen3NextRMSNorm`): `x · rsqrt(mean(x²) + eps) · (1 + w)` over
/// rows of width `w.len()`, in place.
pub fn rms_norm_zero_centred(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for row in x.chunks_exact_mut(d) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for (v, wi) in row.iter_mut().zip(w) {
            *v = *v * r * (1.0 + wi);
        }
    }
}

/// Plain RMSNorm (`w · x · rsqrt(mean(x²) + eps)`) over rows of width `w.len()`, in place.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for row in x.chunks_exact_mut(d) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for (v, wi) in row.iter_mut().zip(w) {
            *v = *v * r * wi;
        }
    }
}

/// SiLU `x·σ(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Logistic sigmoid.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Softplus with PyTorch's default threshold (returns `x` for `x > 20`).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// L2-normalises rows of width `d` in place: `x · rsqrt(Σx² + eps)` (FLA `l2norm`, eps 1e-6).
pub fn l2_normalize(x: &mut [f32], d: usize, eps: f32) {
    for row in x.chunks_exact_mut(d) {
        let s = row.iter().map(|v| v * v).sum::<f32>();
        let r = 1.0 / (s + eps).sqrt();
        row.iter_mut().for_each(|v| *v *= r);
    }
}

/// In-place softmax of one row.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    x.iter_mut().for_each(|v| *v /= s);
}

/// Rotary embedding tables for partial NeoX-style RoPE.
///
/// `inv_freq[i] = θ^(−2i/rot)` for `i < rot/2` (HF `default` rope init).
#[derive(Clone, Debug)]
pub struct Rope {
    /// Rotary dims per head (even).
    pub rot: usize,
    inv_freq: Vec<f32>,
}

impl Rope {
    /// Tables for `rot` rotary dims and base `theta`.
    pub fn new(rot: usize, theta: f64) -> Self {
        let inv_freq = (0..rot / 2)
            .map(|i| (1.0 / theta.powf((2 * i) as f64 / rot as f64)) as f32)
            .collect();
        Rope { rot, inv_freq }
    }

    /// Rotates the first `rot` dims of every head vector in `x` (`[n_heads, head_dim]`
    /// for one token) to absolute position `pos` (may be negative for re-rotation by
    /// a relative offset: `R(b−a)`; angles compose additively).
    ///
    /// NeoX `rotate_half`: with `x1 = x[..rot/2]`, `x2 = x[rot/2..rot]`:
    /// `x1' = x1·cos − x2·sin`, `x2' = x2·cos + x1·sin`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: i64) {
        let half = self.rot / 2;
        let (cos, sin): (Vec<f32>, Vec<f32>) = self
            .inv_freq
            .iter()
            .map(|f| {
                // Same fp32 product as HF (position · inv_freq in fp32).
                let a = (pos as f32) * f;
                (a.cos(), a.sin())
            })
            .unzip();
        for head in x.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let x1 = head[i];
                let x2 = head[i + half];
                head[i] = x1 * cos[i] - x2 * sin[i];
                head[i + half] = x2 * cos[i] + x1 * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// `linear` for one token (the SIMD matrix-vector path, serial and split across
    /// threads) and `dot` against float64 sums, over ragged sizes.
    #[test]
    fn gemv_and_dot_match_f64() {
        for &(inp, out) in &[
            (1, 1),
            (7, 3),
            (8, 4),
            (15, 5),
            (16, 9),
            (33, 17),
            (64, 256),
            (100, 1000),
            (1024, 257),
            (130, 4099),
        ] {
            let x = pseudo(inp, inp as u64);
            let w = pseudo(inp * out, out as u64 + 7);
            let y = linear(&x, 1, inp, &w, out);
            let mut worst = 0f64;
            for r in 0..out {
                let row = &w[r * inp..(r + 1) * inp];
                let exact: f64 = row.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                let scale: f64 = row
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                worst = worst.max((y[r] as f64 - exact).abs() / scale.max(1e-30));
                let d = dot(row, &x) as f64;
                assert!(
                    (d - exact).abs() <= 1e-5 * scale.max(1e-30),
                    "dot inp={inp}"
                );
            }
            assert!(worst <= 1e-5, "gemv inp={inp} out={out}: rel err {worst}");
            // One token through linear equals the same row of a two-token product.
            let x2: Vec<f32> = x.iter().chain(x.iter()).copied().collect();
            let y2 = linear(&x2, 2, inp, &w, out);
            for r in 0..out {
                let tol = 1e-5 * (y[r].abs() + 1.0);
                assert!((y2[r] - y[r]).abs() <= tol && (y2[out + r] - y[r]).abs() <= tol);
            }
        }
    }
}
