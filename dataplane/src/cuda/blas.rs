//! Dense projections through cuBLAS: the `nn.Linear` of every layer.
//!
//! Row-major buffers in the layouts of the CPU backend (`ops::linear`): activations
//! `x: [t, inp]`, weights `w: [out, inp]` (HF `nn.Linear.weight`), result
//! `y: [t, out]`. fp32 uses SGEMM; bf16 uses `cublasGemmEx` with bf16 inputs and
//! outputs and fp32 accumulation (cudarc's `Gemm<bf16>`), except for at most
//! [`GEMV_MAX_ROWS`] rows (decode steps, seam windows), which take the warp-per-row
//! kernel of `kernels/gemv.cu`: the same math with the weight read once, and less host
//! time per call (gpu_bench's host-cost table: ~9 µs per cuBLAS call, ~4 µs per launch).
use cudarc::cublas::{sys::cublasOperation_t, Gemm, GemmConfig};
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::compile::GEMV;
use super::{check_len, CudaSlice, Gpu, Result};

/// Largest row count of a bf16 [`linear`] that takes the GEMV kernel instead of cuBLAS.
pub const GEMV_MAX_ROWS: usize = 8;

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
    if T::SUFFIX == "bf16"
        && t <= GEMV_MAX_ROWS
        && inp.is_multiple_of(8)
        && beta.to_f32() == 0.0
        && out <= i32::MAX as usize
        && inp <= i32::MAX as usize
    {
        return gemv(gpu, x, t, inp, w, out, y);
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

/// `y = x · wᵀ` for bf16 `x` (`[t, inp]`) and `w` (`[out, inp]`) with `t ≤ GEMV_MAX_ROWS`
/// rows and `inp % 8 == 0` (checked by the callers: [`linear`], and the MoE router and
/// shared expert in `moe::gemm_rm`): one warp per output row, fp32 accumulation; `y`
/// (`[t, out]`) in bf16 (`gemv_bf16`) or fp32 (`gemv_bf16_f32`).
pub(crate) fn gemv<T: super::Elem, O: super::Elem>(
    gpu: &Gpu,
    x: &CudaSlice<T>,
    t: usize,
    inp: usize,
    w: &CudaSlice<T>,
    out: usize,
    y: &mut CudaSlice<O>,
) -> Result<()> {
    let name = match O::SUFFIX {
        "bf16" => "gemv_bf16",
        _ => "gemv_bf16_f32",
    };
    let f = gpu.function(&GEMV, name, 0)?;
    let cfg = LaunchConfig {
        grid_dim: (out.div_ceil(8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (ti, ii, oi) = (t as i32, inp as i32, out as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x).arg(w).arg(y).arg(&ti).arg(&ii).arg(&oi);
    // SAFETY: matches `gemv_bf16` / `gemv_bf16_f32`; T is bf16 and O bf16 or f32 (checked
    // by the callers), lengths checked by them, 1 ≤ t ≤ 8, inp % 8 == 0 (16-byte loads
    // from cudaMalloc'd rows: every row start is a multiple of 16 bytes).
    unsafe { b.launch(cfg) }?;
    Ok(())
}
