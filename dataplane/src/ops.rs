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
        // Matrix-vector product: split output rows across threads.
        y.par_chunks_mut(256).enumerate().for_each(|(c, ys)| {
            for (r, yv) in ys.iter_mut().enumerate() {
                let row = &w[(c * 256 + r) * inp..(c * 256 + r + 1) * inp];
                *yv = dot(row, x);
            }
        });
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

/// Dot product with four accumulators (auto-vectorised).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
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
