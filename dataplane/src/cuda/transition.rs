//! Segment pairs on the GPU. Scalar pairs (Lightning): [`ScalarPair`], `T_C` one value
//! per head. Dense (Gated DeltaNet / KDA) segment pairs: apply `S ← T S + B` and
//! compose `(T_B, B_B) ∘ (T_A, B_A) = (T_B T_A, T_B B_A + B_B)`, batched over value
//! heads with one cuBLAS fp32 strided-batched GEMM per product. CPU reference:
//! `linear::transition::Pair::{apply, compose}`.
//!
//! Layouts: `T: [Hv, dk, dk]` row-major (`T[h][i][j]` multiplies state row j into
//! row i), `B = S_{C|0}` and states: `[Hv, dk, dv]` K-major. All fp32.
use cudarc::cublas::{sys::cublasOperation_t, Gemm, GemmConfig, StridedBatchedConfig};

use super::{check_len, CudaError, CudaSlice, Gpu, Result};
use crate::linear::transition::{Pair, TransitionKind};

/// A dense pair `(T_C, S_{C|0})` in device memory.
pub struct DensePair {
    /// Value heads.
    pub hv: usize,
    /// Key head dim.
    pub dk: usize,
    /// Value head dim.
    pub dv: usize,
    /// `T_C`: `[Hv, dk, dk]`.
    pub t: CudaSlice<f32>,
    /// `S_{C|0}`: `[Hv, dk, dv]`.
    pub b: CudaSlice<f32>,
}

impl DensePair {
    /// Uploads a CPU pair (must be [`TransitionKind::Dense`]).
    pub fn upload(gpu: &Gpu, p: &Pair) -> Result<DensePair> {
        if p.kind() != TransitionKind::Dense {
            return Err(CudaError::Shape(format!(
                "DensePair needs a dense pair, got {:?}",
                p.kind()
            )));
        }
        let (hv, dk, dv) = p.dims();
        Ok(DensePair {
            hv,
            dk,
            dv,
            t: gpu.upload(p.t())?,
            b: gpu.upload(p.b())?,
        })
    }

    /// Downloads into a CPU pair.
    pub fn download(&self, gpu: &Gpu) -> Result<Pair> {
        let t = gpu.download(&self.t)?;
        let b = gpu.download(&self.b)?;
        Pair::from_parts(
            TransitionKind::Dense,
            self.hv,
            self.dk,
            self.dv,
            t[..self.hv * self.dk * self.dk].to_vec(),
            b[..self.hv * self.dk * self.dv].to_vec(),
        )
        .map_err(|e| CudaError::Shape(e.to_string()))
    }

    /// `self ∘ earlier` (segment `earlier` then `self`) into a new pair.
    pub fn compose(&self, gpu: &Gpu, earlier: &DensePair) -> Result<DensePair> {
        if (self.hv, self.dk, self.dv) != (earlier.hv, earlier.dk, earlier.dv) {
            return Err(CudaError::Shape("compose: pair dims differ".into()));
        }
        let mut t = gpu.zeros::<f32>(self.hv * self.dk * self.dk)?;
        let mut b = gpu.stream().clone_dtod(&self.b)?;
        compose_dense(
            gpu, self.hv, self.dk, self.dv, &self.t, &earlier.t, &earlier.b, &mut t, &mut b,
        )?;
        Ok(DensePair {
            hv: self.hv,
            dk: self.dk,
            dv: self.dv,
            t,
            b,
        })
    }

    /// `out ← T state + B` (`state`, `out`: `[Hv, dk, dv]`, distinct buffers).
    pub fn apply_into(
        &self,
        gpu: &Gpu,
        state: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check_len("out", out, self.hv * self.dk * self.dv)?;
        gpu.stream().memcpy_dtod(&self.b, out)?;
        batched_matmul(
            gpu, self.hv, self.dk, self.dv, self.dk, &self.t, state, out, 1.0,
        )
    }
}

/// `c[h] = a[h] · b[h] + beta · c[h]` for `h < batch`, row-major `a: [m, k]`,
/// `b: [k, n]`, `c: [m, n]`, fp32 (cuBLAS SGEMM strided batched; the row-major
/// product is issued as the column-major `cᵀ = bᵀ aᵀ`).
#[allow(clippy::too_many_arguments)]
pub fn batched_matmul(
    gpu: &Gpu,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: &CudaSlice<f32>,
    b: &CudaSlice<f32>,
    c: &mut CudaSlice<f32>,
    beta: f32,
) -> Result<()> {
    check_len("a", a, batch * m * k)?;
    check_len("b", b, batch * k * n)?;
    check_len("c", c, batch * m * n)?;
    if batch == 0 || m == 0 || n == 0 {
        return Ok(());
    }
    let cfg = StridedBatchedConfig {
        gemm: GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_N,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: n as i32,
            n: m as i32,
            k: k as i32,
            alpha: 1.0f32,
            lda: n as i32,
            ldb: k as i32,
            beta,
            ldc: n as i32,
        },
        batch_size: batch as i32,
        stride_a: (k * n) as i64,
        stride_b: (m * k) as i64,
        stride_c: (m * n) as i64,
    };
    // SAFETY: lengths checked above; column-major view of row-major buffers.
    unsafe { gpu.blas().gemm_strided_batched(cfg, b, a, c) }?;
    Ok(())
}

/// Dense compose on raw buffers: `t_out = t_later · t_earlier`,
/// `b_out ← t_later · b_earlier + b_out` (pass `b_out` holding `b_later`).
#[allow(clippy::too_many_arguments)]
pub fn compose_dense(
    gpu: &Gpu,
    hv: usize,
    dk: usize,
    dv: usize,
    t_later: &CudaSlice<f32>,
    t_earlier: &CudaSlice<f32>,
    b_earlier: &CudaSlice<f32>,
    t_out: &mut CudaSlice<f32>,
    b_out: &mut CudaSlice<f32>,
) -> Result<()> {
    batched_matmul(gpu, hv, dk, dk, dk, t_later, t_earlier, t_out, 0.0)?;
    batched_matmul(gpu, hv, dk, dv, dk, t_later, b_earlier, b_out, 1.0)
}

/// A scalar pair `(T_C [H], S_{C|0} [H, dk, dv])` in device memory, fp32: the PIC
/// pair of a Lightning layer (transition family `Scalar`: `T_C = exp(g_h·len)`).
/// Applied with [`super::lightning::scalar_apply`].
pub struct ScalarPair {
    /// Heads.
    pub h: usize,
    /// Key head dim.
    pub dk: usize,
    /// Value head dim.
    pub dv: usize,
    /// `T_C`: `[H]`.
    pub t: CudaSlice<f32>,
    /// `S_{C|0}`: `[H, dk, dv]`.
    pub b: CudaSlice<f32>,
}

impl ScalarPair {
    /// Uploads a CPU pair (must be [`TransitionKind::Scalar`]).
    ///
    /// Errors: [`CudaError::Shape`] for another kind; driver errors.
    pub fn upload(gpu: &Gpu, p: &Pair) -> Result<ScalarPair> {
        if p.kind() != TransitionKind::Scalar {
            return Err(CudaError::Shape(format!(
                "ScalarPair needs a scalar pair, got {:?}",
                p.kind()
            )));
        }
        let (h, dk, dv) = p.dims();
        let up = |v: &[f32]| -> Result<CudaSlice<f32>> {
            if v.is_empty() {
                gpu.zeros(1)
            } else {
                gpu.upload(v)
            }
        };
        Ok(ScalarPair {
            h,
            dk,
            dv,
            t: up(p.t())?,
            b: up(p.b())?,
        })
    }

    /// Downloads into a CPU pair.
    ///
    /// Errors: driver errors; a buffer shorter than the dims.
    pub fn download(&self, gpu: &Gpu) -> Result<Pair> {
        let t = gpu.download(&self.t)?;
        let b = gpu.download(&self.b)?;
        let (nt, nb) = (self.h, self.h * self.dk * self.dv);
        if t.len() < nt || b.len() < nb {
            return Err(CudaError::Shape("scalar pair buffers too short".into()));
        }
        Pair::from_parts(
            TransitionKind::Scalar,
            self.h,
            self.dk,
            self.dv,
            t[..nt].to_vec(),
            b[..nb].to_vec(),
        )
        .map_err(|e| CudaError::Shape(e.to_string()))
    }
}
