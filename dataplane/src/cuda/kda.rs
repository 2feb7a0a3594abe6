//! Kimi Delta Attention recurrences on the device (`kernels/kda.cu`), the GPU
//! counterparts of `mixers::kda::{naive, chunk}`:
//!
//! * [`recurrent`]: token by token, one thread per state column (the GPU reference,
//!   and the decode step);
//! * [`chunked`]: the chunked WY prefill with per-channel decays, one block per value
//!   head, which also left-multiplies a transition buffer by the span's `T_C` in the
//!   same pass (the PIC cache build).
//!
//! Both take the layouts of `mixers::kda` ([`GdrDims`]): `q, k [T, Hk, dk]` in `T`
//! (L2-normalised, q scaled by `dk^-½`), `v [T, Hv, dv]` in `T`, per-channel log
//! decays `g [T, Hv, dk]` fp32 (≤ 0), `beta [T, Hv]` fp32, state `[Hv, dk, dv]` fp32
//! K-major (advanced in place), output `[T, Hv, dv]` in `T`. Value head `h` reads key
//! head `h / (Hv/Hk)`. Tests: `dataplane/tests/cuda_kimi.rs` (each kernel against the
//! CPU `naive`/`chunk` and against each other).
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::compile::KDA;
use super::{check_len, dim_i32, shape_err, CudaSlice, Elem, Gpu, Result, Scratch};
use crate::mixers::gated_deltanet::GdrDims;

/// Tokens per chunk of [`chunked`] (the CPU's `mixers::kda::KDA_CHUNK`).
pub const CHUNK: usize = crate::mixers::kda::KDA_CHUNK;

/// Spans of at least this many tokens take [`chunked`] in the forward; shorter ones
/// (decode, seam windows) [`recurrent`] (the CPU layer's `NAIVE_MAX`).
pub const CHUNKED_MIN_TOKENS: usize = crate::mixers::kda::layer::NAIVE_MAX;

#[allow(clippy::too_many_arguments)]
fn check<T: Elem>(
    d: &GdrDims,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    g: &CudaSlice<f32>,
    beta: &CudaSlice<f32>,
    state: &CudaSlice<f32>,
    out: &CudaSlice<T>,
) -> Result<()> {
    if d.hk == 0 || !d.hv.is_multiple_of(d.hk) {
        return Err(shape_err(format!(
            "KDA: Hv {} must be a multiple of Hk {}",
            d.hv, d.hk
        )));
    }
    check_len("q [T,Hk,dk]", q, d.t * d.hk * d.dk)?;
    check_len("k [T,Hk,dk]", k, d.t * d.hk * d.dk)?;
    check_len("v [T,Hv,dv]", v, d.t * d.hv * d.dv)?;
    check_len("g [T,Hv,dk]", g, d.t * d.hv * d.dk)?;
    check_len("beta [T,Hv]", beta, d.t * d.hv)?;
    check_len("state [Hv,dk,dv]", state, d.hv * d.dk * d.dv)?;
    check_len("o [T,Hv,dv]", out, d.t * d.hv * d.dv)
}

/// KDA token by token from `state` (advanced in place); writes `out`. The operation
/// order of `mixers::kda::naive::recurrent`. State in global memory: meant for decode
/// steps, short spans and as the reference of [`chunked`].
///
/// Errors: [`CudaError::Shape`] when a buffer is shorter than `d` needs or `Hv` is not
/// a multiple of `Hk`; driver errors.
#[allow(clippy::too_many_arguments)]
pub fn recurrent<T: Elem>(
    gpu: &Gpu,
    d: &GdrDims,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    g: &CudaSlice<f32>,
    beta: &CudaSlice<f32>,
    state: &mut CudaSlice<f32>,
    out: &mut CudaSlice<T>,
) -> Result<()> {
    check(d, q, k, v, g, beta, state, out)?;
    super::model::launch_recurrence(
        gpu,
        &KDA,
        &format!("kda_recurrent_{}", T::SUFFIX),
        d,
        [q, k, v],
        g,
        beta,
        state,
        out,
    )
}

/// Floats of workspace per head of [`chunked`] (`kda_ws_per_head` in kda.cu).
fn ws_per_head(chunk: usize, dk: usize, dv: usize, with_trans: bool) -> usize {
    2 * chunk * dk + 2 * chunk * chunk + chunk * dv + if with_trans { 2 * dk * dk } else { 0 }
}

/// Chunked KDA (WY form, chunks of `chunk` tokens, [`CHUNK`] in the forward) from
/// `state` (advanced in place); writes `out`. When `trans` (`[Hv, dk, dk]` fp32) is
/// given it is left-multiplied by the span's transition `T_C` in the same pass (pass
/// the identity to get `T_C`). Same contract as [`recurrent`]; the CPU counterpart is
/// `mixers::kda::chunk::chunked_with_transition` (which also flushes entries below
/// 2⁻⁴⁰; this kernel does not).
///
/// Errors: as [`recurrent`]; `chunk` = 0; a `trans` shorter than `[Hv, dk, dk]`.
#[allow(clippy::too_many_arguments)]
pub fn chunked<T: Elem>(
    gpu: &Gpu,
    d: &GdrDims,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    g: &CudaSlice<f32>,
    beta: &CudaSlice<f32>,
    state: &mut CudaSlice<f32>,
    out: &mut CudaSlice<T>,
    trans: Option<&mut CudaSlice<f32>>,
    chunk: usize,
) -> Result<()> {
    check(d, q, k, v, g, beta, state, out)?;
    if chunk == 0 {
        return Err(shape_err("KDA chunk must be > 0".into()));
    }
    if let Some(tr) = &trans {
        check_len("transition [Hv,dk,dk]", tr, d.hv * d.dk * d.dk)?;
    }
    if d.t == 0 || d.hv == 0 {
        return Ok(());
    }
    let chunk = chunk.min(d.t);
    let ws: Scratch<f32> = gpu.scratch(d.hv * ws_per_head(chunk, d.dk, d.dv, trans.is_some()))?;
    let f = gpu.function(&KDA, &format!("kda_chunked_{}", T::SUFFIX), 0)?;
    let cfg = LaunchConfig {
        grid_dim: (d.hv as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (t, hk, hv, dk, dv, ch) = (
        dim_i32("t", d.t)?,
        dim_i32("Hk", d.hk)?,
        dim_i32("Hv", d.hv)?,
        dim_i32("dk", d.dk)?,
        dim_i32("dv", d.dv)?,
        dim_i32("chunk", chunk)?,
    );
    let null: u64 = 0;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(q).arg(k).arg(v).arg(g).arg(beta).arg(state).arg(out);
    match trans {
        Some(tr) => b.arg(tr),
        None => b.arg(&null),
    };
    b.arg(&ws)
        .arg(&t)
        .arg(&hk)
        .arg(&hv)
        .arg(&dk)
        .arg(&dv)
        .arg(&ch);
    // SAFETY: matches `kda_chunked_*`; inputs checked above; trans is [Hv, dk, dk] or
    // null; ws holds Hv · kda_ws_per_head(chunk, dk, dv, trans) floats (same formula).
    unsafe { b.launch(cfg) }?;
    Ok(())
}
