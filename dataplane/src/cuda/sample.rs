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
//!   `Σ q ≥ ceil(top_p · Σ q)`, so the cut can differ from the CPU's fp32 running sum
//!   only when the boundary lies within rounding of `top_p`.
//! * The draw differs: the CPU walks the sorted CDF with one `StdRng` uniform per step;
//!   the GPU uses the Gumbel-max trick, `argmax_i (s_i + g_i)` over the kept set
//!   (evaluated as `argmax_i (l_i + T·g_i)`, the same order), with
//!   `g_i = −ln(−ln u_i)`, `u_i = ((h_i >> 11) + ½) · 2⁻⁵³`,
//!   `h_i = mix64(mix64(mix64(seed) ^ step) ^ i)` (SplitMix64 finaliser), in f64. Both
//!   draw from the same distribution (softmax of `s` restricted to the kept set), but
//!   not the same token for the same seed. The GPU draw is a deterministic function of
//!   (logits, parameters, seed, step), independent of the row's place in the batch and
//!   of thread timing (integer atomics only); [`reference()`] computes it on the CPU.
//!
//! Cost: greedy and plain temperature sampling read the row twice; top-k adds a 4-pass
//! radix select over the row (and 4 more only for ties at the k-th value), top-p another
//! 4 passes plus 2 for the mass.
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::compile::SAMPLE;
use super::{check_len, CudaError, CudaSlice, Gpu, Result};
use crate::sampling::SamplingParams;

/// Per-row sampling parameters of [`sample`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowSampling {
    /// Softmax temperature; `≤ 0` (or NaN) is greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = all; 1 = greedy).
    pub top_k: usize,
    /// Nucleus mass (`≥ 1` or NaN = off).
    pub top_p: f32,
    /// Seed of the sequence.
    pub seed: u64,
    /// Decode step (token index within the sequence); a new draw per step.
    pub step: u64,
}

impl RowSampling {
    /// From the OpenAI-style parameters of the CPU sampler; `fallback_seed` is used when
    /// `p.seed` is `None`. The logit processors of [`SamplingParams`] (penalties,
    /// `logit_bias`, `min_tokens`) are not applied by this sampler: the serving
    /// scheduler samples on the host with [`crate::sampling::Sampler`], which applies
    /// them, on both backends.
    pub fn new(p: &SamplingParams, fallback_seed: u64, step: u64) -> Self {
        RowSampling {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            seed: p.seed.unwrap_or(fallback_seed),
            step,
        }
    }
}

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

/// SplitMix64 finaliser (as `mix64` in sample.cu).
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The Gumbel noise of token `i` for `(seed, step)` (as `gumbel` in sample.cu).
pub fn gumbel(seed: u64, step: u64, i: u32) -> f64 {
    let h = mix64(mix64(mix64(seed) ^ step) ^ i as u64);
    let u = ((h >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
    -(-u.ln()).ln()
}

/// CPU computation of the GPU sampler's draw for one row (same candidate set, same
/// fixed-point top-p cut, same Gumbel noise). It can differ from the GPU only through
/// fp32 rounding (`exp`, the order of the sum `Z`), i.e. at a top-p boundary within
/// rounding or between two scores within an ulp.
pub fn reference(logits: &[f32], p: &RowSampling) -> u32 {
    // `temperature > 0` is false for NaN too: greedy, as the kernel.
    let greedy = p.temperature.is_nan() || p.temperature <= 0.0;
    if greedy || p.top_k == 1 {
        return crate::sampling::argmax(logits);
    }
    let t = p.temperature;
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, &v)| (i as u32, v))
        .collect();
    let m = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    if cand.is_empty() || !m.is_finite() {
        return crate::sampling::argmax(logits);
    }
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 && p.top_k < cand.len() {
        cand.truncate(p.top_k);
    }
    if p.top_p < 1.0 {
        let z: f32 = cand.iter().map(|c| ((c.1 - m) / t).exp()).sum();
        let q: Vec<u64> = cand
            .iter()
            .map(|c| {
                (((((c.1 - m) / t).exp() / z) as f64) * (1u64 << 40) as f64).round_ties_even()
                    as u64
            })
            .collect();
        let qtot: u64 = q.iter().sum();
        if qtot > 0 {
            let target = if p.top_p > 0.0 {
                ((p.top_p as f64) * qtot as f64).ceil() as u64
            } else {
                1
            }
            .clamp(1, qtot);
            let mut acc = 0u64;
            let mut keep = cand.len();
            for (i, &qi) in q.iter().enumerate() {
                acc += qi;
                if acc >= target {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
        }
    }
    let mut best = (f64::NEG_INFINITY, u32::MAX);
    for &(i, _) in &cand {
        let sc = logits[i as usize] as f64 + t as f64 * gumbel(p.seed, p.step, i);
        if sc > best.0 || (sc == best.0 && i < best.1) {
            best = (sc, i);
        }
    }
    if best.1 == u32::MAX {
        0
    } else {
        best.1
    }
}
