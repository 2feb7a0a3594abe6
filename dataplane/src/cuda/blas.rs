//! Dense projections through cuBLAS: the `nn.Linear` of every layer.
//!
//! Row-major buffers in the layouts of the CPU backend (`ops::linear`): activations
//! `x: [t, inp]`, weights `w: [out, inp]` (HF `nn.Linear.weight`), result
//! `y: [t, out]`. fp32 uses SGEMM; bf16 uses `cublasGemmEx` with bf16 inputs and
//! outputs and fp32 accumulation (cudarc's `Gemm<bf16>`).
use cudarc::cublas::{sys::cublasOperation_t, Gemm, GemmConfig};

use super::{check_len, CudaSlice, Gpu, Result};

/// `y = x · wᵀ + beta · y`: `x: [t, inp]`, `w: [out, inp]`, `y: [t, out]`, all
/// row-major. Issued as the column-major product `yᵀ = w · xᵀ` (`w` read transposed).
///
/// Errors: [`super::CudaError::Shape`] when a buffer is shorter than its shape.
#[allow(clippy::too_many_arguments)]
pub fn linear<T>(
    gpu: &Gpu,
    x: &CudaSlice<T>,
    t: usize,
    inp: usize,
    w: &CudaSlice<T>,
    out: usize,
    y: &mut CudaSlice<T>,
    beta: T,
) -> Result<()>
where
    T: super::Elem,
    cudarc::cublas::CudaBlas: Gemm<T>,
{
    check_len("x", x, t * inp)?;
    check_len("w", w, out * inp)?;
    check_len("y", y, t * out)?;
    if t == 0 || out == 0 {
        return Ok(());
    }
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: out as i32,
        n: t as i32,
        k: inp as i32,
        alpha: T::from_f32(1.0),
        lda: inp as i32,
        ldb: inp as i32,
        beta,
        ldc: out as i32,
    };
    // SAFETY: lengths checked above; column-major view of the row-major buffers.
    unsafe { gpu.blas().gemm(cfg, w, x, y) }?;
    Ok(())
}
