//! Next-token selection on the GPU: greedy [`argmax`] and a seeded temperature / top-k /
//! top-p sampler ([`sample`]). Kernels: `dataplane/kernels/sample.cu`, one block per row
//! of `logits: [rows, vocab]` fp32.
//!
//! # Relation to the CPU [`Sampler`](crate::sampling::Sampler)
//!
//! * Greedy (`temperature ≤ 0`, NaN temperature, or `top_k == 1`): identical to
//!   [`crate::sampling::argmax`] (largest logit, lowest index on ties, NaN never chosen,
//!   0 when nothing is above −inf).
//! * Otherwise both keep the same candidate set: finite logits `l_i` (the scaled
//!   `s_i = l_i / T` order the same way for `T > 0`; it is never formed, since at a tiny
//!   `T` it would round the gaps between logits away),
//!   ordered by (`l` descending by `f32::total_cmp`, index ascending), the first `top_k`
//!   (0 = all), then the shortest prefix whose renormalised probability mass reaches
//!   `top_p` (only when `top_p < 1`; `top_p ≤ 0` keeps one token). The GPU measures that
//!   mass in fixed point, `q_i = rint(exp((l_i − m) / T) / Z · 2⁴⁰)` (`m` the largest `l`, `Z`
//!   the fp32 sum over the top-k set) and keeps the shortest prefix with
//!   `Σ q ≥ ceil(top_p · Σ q)`, as the CPU draw does.
//! * The draw is the CPU sampler's ([`crate::sampling::draw`]): the Gumbel-max trick,
//!   `argmax_i (s_i + g_i)` over the kept set
//!   (evaluated as `argmax_i (l_i + T·g_i)`, the same order), with
//!   `g_i = −ln(−ln u_i)`, `u_i = ((h_i >> 11) + ½) · 2⁻⁵³`,
//!   `h_i = mix64(mix64(mix64(seed) ^ step) ^ i)` (SplitMix64 finaliser), in f64, so
//!   a seed gives the same token on both backends (`step`: the number of tokens the
//!   sequence sampled before). The GPU draw is a deterministic function of
//!   (logits, parameters, seed, step), independent of the row's place in the batch and
//!   of thread timing (integer atomics only); [`reference()`] computes it on the CPU.
//!
//! Cost: greedy and plain temperature sampling read the row twice; top-k adds a 4-pass
//! radix select over the row (and 4 more only for ties at the k-th value), top-p another
//! 4 passes plus 2 for the mass.
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::compile::SAMPLE;
use super::{check_len, grid_for, CudaError, CudaSlice, Elem, Gpu, Result};

/// Per-row sampling parameters of [`sample`] (the parameters of the CPU draw
/// [`crate::sampling::draw`]).
pub use crate::sampling::DrawParams as RowSampling;
/// The hash and noise of the draw (shared with the CPU sampler).
pub use crate::sampling::{gumbel, mix64};

fn check_dims(logits: &CudaSlice<f32>, rows: usize, vocab: usize) -> Result<()> {
    if vocab == 0 || vocab > i32::MAX as usize {
        return Err(CudaError::Shape(format!(
            "vocab {vocab} (supported: 1..={})",
            i32::MAX
        )));
    }
    if rows > i32::MAX as usize {
        return Err(CudaError::Shape(format!("{rows} rows")));
    }
    check_len("logits [rows,vocab]", logits, rows * vocab)
}

/// Greedy token per row into a device buffer `out: [rows]` (no host sync).
pub fn argmax_into(
    gpu: &Gpu,
    logits: &CudaSlice<f32>,
    rows: usize,
    vocab: usize,
    out: &mut CudaSlice<u32>,
) -> Result<()> {
    check_dims(logits, rows, vocab)?;
    check_len("out [rows]", out, rows)?;
    if rows == 0 {
        return Ok(());
    }
    let f = gpu.function(&SAMPLE, "argmax_rows", 0)?;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    let v = vocab as i32;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(logits).arg(&v).arg(out);
    // SAFETY: matches `argmax_rows` in sample.cu; lengths checked above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Greedy token per row of `logits: [rows, vocab]`: index of the largest logit, lowest
/// index on ties (as [`crate::sampling::argmax`]). Waits for the stream.
pub fn argmax(gpu: &Gpu, logits: &CudaSlice<f32>, rows: usize, vocab: usize) -> Result<Vec<u32>> {
    if rows == 0 {
        check_dims(logits, rows, vocab)?;
        return Ok(Vec::new());
    }
    let mut out = gpu.zeros::<u32>(rows)?;
    argmax_into(gpu, logits, rows, vocab, &mut out)?;
    Ok(gpu.download(&out)?[..rows].to_vec())
}

/// Seeded sampling, one token per row into a device buffer `out: [rows]`; `params[r]`
/// applies to row `r` (see the module docs for the exact definition). Uploads the
/// parameters (5 small copies); no host sync.
pub fn sample_into(
    gpu: &Gpu,
    logits: &CudaSlice<f32>,
    rows: usize,
    vocab: usize,
    params: &[RowSampling],
    out: &mut CudaSlice<u32>,
) -> Result<()> {
    check_dims(logits, rows, vocab)?;
    check_len("out [rows]", out, rows)?;
    if params.len() != rows {
        return Err(CudaError::Shape(format!(
            "{} sampling parameter rows for {rows} logit rows",
            params.len()
        )));
    }
    if rows == 0 {
        return Ok(());
    }
    let temps: Vec<f32> = params.iter().map(|p| p.temperature).collect();
    let topk: Vec<i32> = params
        .iter()
        .map(|p| p.top_k.min(i32::MAX as usize) as i32)
        .collect();
    let topp: Vec<f32> = params.iter().map(|p| p.top_p).collect();
    let seeds: Vec<u64> = params.iter().map(|p| p.seed).collect();
    let steps: Vec<u64> = params.iter().map(|p| p.step).collect();
    let (d_t, d_k, d_p, d_s, d_st) = (
        gpu.upload(&temps)?,
        gpu.upload(&topk)?,
        gpu.upload(&topp)?,
        gpu.upload(&seeds)?,
        gpu.upload(&steps)?,
    );
    let f = gpu.function(&SAMPLE, "sample_rows", 0)?;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    let v = vocab as i32;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(logits)
        .arg(&v)
        .arg(&d_t)
        .arg(&d_k)
        .arg(&d_p)
        .arg(&d_s)
        .arg(&d_st)
        .arg(out);
    // SAFETY: matches `sample_rows` in sample.cu; every parameter array holds `rows`.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Seeded sampling of one token per row (see the module docs). Waits for the stream.
pub fn sample(
    gpu: &Gpu,
    logits: &CudaSlice<f32>,
    rows: usize,
    vocab: usize,
    params: &[RowSampling],
) -> Result<Vec<u32>> {
    let mut out = gpu.zeros::<u32>(rows.max(1))?;
    sample_into(gpu, logits, rows, vocab, params, &mut out)?;
    if rows == 0 {
        return Ok(Vec::new());
    }
    Ok(gpu.download(&out)?[..rows].to_vec())
}

/// CPU computation of the GPU sampler's draw for one row: the CPU sampler's own
/// [`crate::sampling::draw`] (same candidate set, same fixed-point top-p cut, same
/// Gumbel noise). It can differ from the GPU only through fp32 rounding (`exp`, the
/// order of the sum `Z`), i.e. at a top-p boundary within rounding or between two
/// scores within an ulp.
pub fn reference(logits: &[f32], p: &RowSampling) -> u32 {
    crate::sampling::draw(logits, p)
}

/// Widens `x: [n]` (`T` = f32 or bf16) into a fresh fp32 buffer `[n]`, exactly (bf16 →
/// f32 is exact), so that logits kept in the model's type can be sampled by [`sample_into`]
/// with the values the host would see after its download.
pub fn widen_f32<T: Elem>(gpu: &Gpu, x: &CudaSlice<T>, n: usize) -> Result<CudaSlice<f32>> {
    check_len("x [n]", x, n)?;
    // SAFETY: every element is written by the kernel below before any read.
    let mut out = unsafe { gpu.stream().alloc::<f32>(n.max(1)) }?;
    if n == 0 {
        return Ok(out);
    }
    let f = gpu.function(&SAMPLE, &format!("widen_{}_f32", T::SUFFIX), 0)?;
    let cfg = LaunchConfig {
        grid_dim: (grid_for(n, 256).min(65535), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let n64 = n as i64;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x).arg(&mut out).arg(&n64);
    // SAFETY: matches `widen_*_f32` in sample.cu; x holds n elements, out n.
    unsafe { b.launch(cfg) }?;
    Ok(out)
}
