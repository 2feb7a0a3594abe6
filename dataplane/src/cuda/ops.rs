//! Elementwise and row kernels: RMSNorm variants, partial RoPE (and re-rotation of
//! cached keys by `R(b − a)`), causal depthwise conv1d prefill and one-token update.
//! CPU references: `ops::rms_norm`, `ops::rms_norm_zero_centred`, the Gated DeltaNet layer
//! `mixers::gated_deltanet::layer` (its `gated_norm` and the conv of `inputs`),
//! `ops::Rope::apply`.
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::compile::{CONV, NORM, ROPE};
use super::{check_len, grid_for, CudaError, CudaSlice, Elem, Gpu, Result};

/// Which RMSNorm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// `w · x̂` (`ops::rms_norm`).
    Plain,
    /// `(1 + w) · x̂` (`Qwen3NextRMSNorm`, `ops::rms_norm_zero_centred`).
    ZeroCentred,
    /// `w · x̂ · silu(z)` (`Qwen3NextRMSNormGated`, norm before gate).
    Gated,
}

/// RMSNorm over `rows` rows of width `w.len()`: `y = f(x)` with `x̂ = x · rsqrt(mean(x²)
/// + eps)`. `x`, `y`: `[rows, d]` (y may be a distinct buffer only; use two buffers);
/// `z`: `[rows, d]`, required for [`NormKind::Gated`], ignored otherwise; `w`: `[d]` fp32.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm<T: Elem>(
    gpu: &Gpu,
    kind: NormKind,
    x: &CudaSlice<T>,
    z: Option<&CudaSlice<T>>,
    w: &CudaSlice<f32>,
    y: &mut CudaSlice<T>,
    rows: usize,
    eps: f32,
) -> Result<()> {
    let d = w.len();
    check_len("x", x, rows * d)?;
    check_len("y", y, rows * d)?;
    if rows == 0 || d == 0 {
        return Ok(());
    }
    let mode: i32 = match kind {
        NormKind::Plain => 0,
        NormKind::ZeroCentred => 1,
        NormKind::Gated => 2,
    };
    let f = gpu.function(&NORM, &format!("rmsnorm_{}", T::SUFFIX), 0)?;
    let block = if d <= 512 { 128 } else { 256 };
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    let di = d as i32;
    let null: u64 = 0;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x);
    match (kind, z) {
        (NormKind::Gated, Some(z)) => {
            check_len("z", z, rows * d)?;
            b.arg(z);
        }
        (NormKind::Gated, None) => return Err(CudaError::Shape("gated RMSNorm needs z".into())),
        _ => {
            b.arg(&null);
        }
    }
    b.arg(w).arg(y).arg(&di).arg(&eps).arg(&mode);
    // SAFETY: argument list matches `rmsnorm_*` in norm.cu; lengths checked above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// RoPE inverse frequencies `θ^(−2i/rot)`, `i < rot/2`, computed exactly as
/// `ops::Rope::new` (f64, then rounded to f32).
pub fn rope_inv_freq(rot: usize, theta: f64) -> Vec<f32> {
    (0..rot / 2)
        .map(|i| (1.0 / theta.powf((2 * i) as f64 / rot as f64)) as f32)
        .collect()
}

/// Partial NeoX RoPE in place on `x`: `[n_tok, n_heads, head_dim]`, rotating the first
/// `2·inv_freq.len()` dims of each head to position `pos[t] + pos_offset`.
/// `pos`: `[n_tok]` i64, or `None` for "every token at `pos_offset`" — re-rotating
/// cached keys from position a to b is `pos = None, pos_offset = b − a`.
/// `inv_freq`: `[rot/2]` fp32 from [`rope_inv_freq`].
#[allow(clippy::too_many_arguments)]
pub fn rope<T: Elem>(
    gpu: &Gpu,
    x: &mut CudaSlice<T>,
    pos: Option<&CudaSlice<i64>>,
    pos_offset: i64,
    inv_freq: &CudaSlice<f32>,
    n_tok: usize,
    n_heads: usize,
    head_dim: usize,
) -> Result<()> {
    let rot = 2 * inv_freq.len();
    if rot > head_dim {
        return Err(CudaError::Shape(format!(
            "rotary dims {rot} > head_dim {head_dim}"
        )));
    }
    check_len("x", x, n_tok * n_heads * head_dim)?;
    if let Some(p) = pos {
        check_len("pos", p, n_tok)?;
    }
    let total = n_tok * n_heads * rot / 2;
    if total == 0 {
        return Ok(());
    }
    let f = gpu.function(&ROPE, &format!("rope_{}", T::SUFFIX), 0)?;
    let cfg = LaunchConfig {
        grid_dim: (grid_for(total, 256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (nt, nh, hd, r) = (n_tok as i32, n_heads as i32, head_dim as i32, rot as i32);
    let null: u64 = 0;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x);
    match pos {
        Some(p) => b.arg(p),
        None => b.arg(&null),
    };
    b.arg(&pos_offset)
        .arg(inv_freq)
        .arg(&nt)
        .arg(&nh)
        .arg(&hd)
        .arg(&r);
    // SAFETY: argument list matches `rope_*` in rope.cu; lengths checked above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Causal depthwise conv1d over `t_len` tokens with a cached tail, then the tail update.
///
/// * `x`: `[t_len, x_stride]`, channel `c` of token `t` at `x[t·x_stride + c]`, `c < C`;
/// * `w`: `[C, K]` fp32 (K ≤ 17); `tail`: `[C, K−1]` fp32, the previous K−1 inputs of
///   each channel, oldest first — updated to the last K−1 inputs;
/// * `y`: `[t_len, C]` = `silu(conv)` when `silu`, else the raw conv.
#[allow(clippy::too_many_arguments)]
pub fn conv1d_prefill<T: Elem>(
    gpu: &Gpu,
    x: &CudaSlice<T>,
    x_stride: usize,
    w: &CudaSlice<f32>,
    tail: &mut CudaSlice<f32>,
    y: &mut CudaSlice<T>,
    t_len: usize,
    c: usize,
    k: usize,
    silu: bool,
) -> Result<()> {
    if k == 0 || k > 17 || x_stride < c {
        return Err(CudaError::Shape(format!(
            "conv1d: K = {k} (1..=17), x_stride {x_stride} ≥ C {c}"
        )));
    }
    if t_len > 0 {
        check_len("x", x, (t_len - 1) * x_stride + c)?;
    }
    check_len("w", w, c * k)?;
    check_len("tail", tail, c * (k - 1))?;
    check_len("y", y, t_len * c)?;
    if t_len == 0 || c == 0 {
        return Ok(());
    }
    let (xs, tl, ci, ki, si) = (
        x_stride as i32,
        t_len as i32,
        c as i32,
        k as i32,
        silu as i32,
    );
    let f = gpu.function(&CONV, &format!("conv1d_prefill_{}", T::SUFFIX), 0)?;
    let cfg = LaunchConfig {
        grid_dim: (grid_for(t_len * c, 256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x)
        .arg(&xs)
        .arg(w)
        .arg(&*tail)
        .arg(y)
        .arg(&tl)
        .arg(&ci)
        .arg(&ki)
        .arg(&si);
    // SAFETY: matches `conv1d_prefill_*` in conv.cu; lengths checked above.
    unsafe { b.launch(cfg) }?;
    let f = gpu.function(&CONV, &format!("conv1d_tail_{}", T::SUFFIX), 0)?;
    let cfg = LaunchConfig {
        grid_dim: (c.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x).arg(&xs).arg(tail).arg(&tl).arg(&ci).arg(&ki);
    // SAFETY: matches `conv1d_tail_*`; issued after the prefill on the same stream.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// [`conv1d_update`] for one token of each of `b` sequences whose tails live in
/// separate buffers, in one launch (`conv1d_update_rows_*` in conv.cu): row `i` reads
/// `x[i·x_stride ..][..C]`, updates the tail at device address `tails[i]` (`[C, K−1]`
/// fp32) and writes `y[i·C ..][..C]`. Each row is exactly [`conv1d_update`]'s arithmetic.
///
/// # Safety
/// Each of the first `b` entries of `tails` must be the address of a live fp32 device
/// buffer of at least `C·(K−1)` elements on this device, no two the same, none
/// overlapping `x` or `y`, and none freed before the launch completes.
#[allow(clippy::too_many_arguments)]
pub unsafe fn conv1d_update_rows<T: Elem>(
    gpu: &Gpu,
    x: &CudaSlice<T>,
    x_stride: usize,
    w: &CudaSlice<f32>,
    tails: &cudarc::driver::CudaView<'_, u64>,
    y: &mut CudaSlice<T>,
    b: usize,
    c: usize,
    k: usize,
    silu: bool,
) -> Result<()> {
    if k == 0 {
        return Err(CudaError::Shape("conv1d: K = 0".into()));
    }
    if x_stride < c {
        return Err(CudaError::Shape(format!(
            "conv1d rows: x stride {x_stride} < C {c}"
        )));
    }
    if b == 0 || c == 0 {
        return Ok(());
    }
    check_len("x", x, (b - 1) * x_stride + c)?;
    check_len("w", w, c * k)?;
    if tails.len() < b {
        return Err(CudaError::Shape(format!(
            "conv1d rows: {} tail addresses for {b} rows",
            tails.len()
        )));
    }
    check_len("y", y, b * c)?;
    if b > 65_535 {
        return Err(CudaError::Shape(format!(
            "conv1d rows: {b} rows over the grid's 65 535"
        )));
    }
    let dims = [x_stride, c, k, b].map(|v| i32::try_from(v).ok());
    let [Some(xs), Some(ci), Some(ki), Some(_)] = dims else {
        return Err(CudaError::Shape(
            "conv1d rows: a dimension exceeds i32".into(),
        ));
    };
    let si = silu as i32;
    let f = gpu.function(&CONV, &format!("conv1d_update_rows_{}", T::SUFFIX), 0)?;
    let cfg = LaunchConfig {
        grid_dim: (c.div_ceil(256) as u32, b as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(x)
        .arg(&xs)
        .arg(w)
        .arg(tails)
        .arg(y)
        .arg(&ci)
        .arg(&ki)
        .arg(&si);
    // SAFETY: matches `conv1d_update_rows_*` in conv.cu; lengths checked above, the
    // tail addresses are the caller's contract.
    unsafe { l.launch(cfg) }?;
    Ok(())
}

/// One-token conv1d update (decode): `x`: `[C]` (first C entries used), `w`: `[C, K]`,
/// `tail`: `[C, K−1]` (shifted left, `x` appended), `y`: `[C]`.
#[allow(clippy::too_many_arguments)]
pub fn conv1d_update<T: Elem>(
    gpu: &Gpu,
    x: &CudaSlice<T>,
    w: &CudaSlice<f32>,
    tail: &mut CudaSlice<f32>,
    y: &mut CudaSlice<T>,
    c: usize,
    k: usize,
    silu: bool,
) -> Result<()> {
    if k == 0 {
        return Err(CudaError::Shape("conv1d: K = 0".into()));
    }
    check_len("x", x, c)?;
    check_len("w", w, c * k)?;
    check_len("tail", tail, c * (k - 1))?;
    check_len("y", y, c)?;
    if c == 0 {
        return Ok(());
    }
    let (ci, ki, si) = (c as i32, k as i32, silu as i32);
    let f = gpu.function(&CONV, &format!("conv1d_update_{}", T::SUFFIX), 0)?;
    let cfg = LaunchConfig {
        grid_dim: (c.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x).arg(w).arg(tail).arg(y).arg(&ci).arg(&ki).arg(&si);
    // SAFETY: matches `conv1d_update_*` in conv.cu; lengths checked above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}
