//! Lightning attention on the GPU (the linear layers of Ring-linear-2.0,
//! `model_type: bailing_moe_linear`): the kernels of `dataplane/kernels/lightning.cu`
//! and their host wrappers. CPU reference: `mixers::lightning::{naive, chunk, layer}`.
//!
//! One layer over `t` tokens (`W = H·d`, `d` = head dim = `dk` = `dv`):
//!
//! 1. one GEMM `proj = x · [query_key_value | g_proj]ᵀ` (`[t, 4W]` in `T`, columns
//!    `q | k | v | gate`; [`LightningW::w_in`]);
//! 2. [`prep`]: optional SiLU on `q|k|v`, per-head RMSNorm of q and k (zero-centred
//!    weights, as the CPU model stores them), fp32 NeoX partial RoPE at the tokens'
//!    positions → q, k, v fp32 `[t, H, d]` (bf16 for [`chunked_tc`]);
//! 3. the recurrence `S_t = exp(g_h)·S_{t−1} + k_t v_tᵀ`, `o_t = scale·S_tᵀ q_t`
//!    (`scale = d^−½`) from the layer's state `[H, d, d]` fp32: [`recurrent`] (one
//!    thread per state column, token by token: the GPU reference, and decode) or
//!    [`chunked`] (chunks of [`CHUNK`] tokens: intra-chunk attention under the decay
//!    mask plus the inter-chunk state; spans of ≥ [`CHUNKED_MIN_TOKENS`] tokens), the
//!    same recurrence, tested against each other and the CPU `naive` / `chunk`;
//! 4. [`out`]: group RMSNorm `g_norm` over `group_norm_size` groups of the `W`
//!    channels, times `sigmoid(gate)` → `[t, W]` in `T`; then `dense`.
//!
//! PIC (`cuda::pic`): the body pair of `from..t` is the scalar `T = exp(g_h·(t − from))`
//! per head (host-computed, `mixers::lightning::chunk::transition`) and `S_body|0`
//! from a state-only [`chunked`] pass over the body from zero (as the CPU layer);
//! composing applies [`scalar_apply`] after moving the cached state to its new start
//! `b` with [`rotate_state`] (`R(b)` on the key axis).
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::compile::{LIGHTNING, LIGHTNING_TC};
use super::{cfg1, check_align16, check_len, dim_i32, shape_err, CudaSlice, Elem, Gpu, Result};
use crate::mixers::lightning::LightningDims;

/// Chunk length of [`chunked`] (`LT_C` in lightning.cu).
pub const CHUNK: usize = 32;
/// Value columns per block of [`chunked`] (`LT_BV` in lightning.cu).
const BV: usize = 32;
/// Spans of at least this many tokens take [`chunked`] (or, in a bf16 model with head
/// dim [`TC_DIM`], [`chunked_tc`]), shorter ones [`recurrent`] (the CPU layer's
/// `NAIVE_MAX`).
pub const CHUNKED_MIN_TOKENS: usize = crate::mixers::lightning::layer::NAIVE_MAX;

/// Lightning layer weights on the device.
pub struct LightningW<T> {
    /// `[4W, hidden]`: the `query_key_value` rows (q | k | v), then the `g_proj` rows.
    pub w_in: CudaSlice<T>,
    /// q RMSNorm weight `[d]` fp32, zero-centred.
    pub q_norm: CudaSlice<f32>,
    /// k RMSNorm weight `[d]` fp32, zero-centred.
    pub k_norm: CudaSlice<f32>,
    /// Group RMSNorm weight `[W]` fp32 (plain).
    pub g_norm: CudaSlice<f32>,
    /// Output projection `dense`, `[hidden, W]`.
    pub dense: CudaSlice<T>,
    /// Log decays `g_h = −slope_h·f_l`, `[H]` fp32.
    pub log_decay: CudaSlice<f32>,
    /// The same log decays on the host (for the scalar transitions of PIC pairs).
    pub log_decay_host: Vec<f32>,
}

/// The instantiation of `lt_prep_*` / `lt_out_*` for projections in `T` and q/k/v/o in
/// `O`: `{base}_f32`, `{base}_bf16` (fp32 `O`) or `{base}_bf16_bf16`.
fn kernel_name<T: Elem, O: Elem>(base: &str) -> Result<String> {
    match (T::SUFFIX, O::SUFFIX) {
        (t, "f32") => Ok(format!("{base}_{t}")),
        ("bf16", "bf16") => Ok(format!("{base}_bf16_bf16")),
        (t, o) => Err(shape_err(format!(
            "{base}: {o} q/k/v/o with a {t} projection (only fp32, or bf16 from bf16)"
        ))),
    }
}

/// Step 2 of the layer: from `proj` (`[t, ld]` in `T`, columns `q | k | v` of `H·d`
/// each from column 0) to `q, k, v` (`[t, H, d]` in `O`: fp32, or bf16 from a bf16
/// `proj` for [`chunked_tc`]): SiLU when `silu`, RMSNorm of each q and k head
/// (`x̂·(1 + w)`, `q_norm`, `k_norm`: `[d]`), NeoX RoPE of the first
/// `2·inv_freq.len()` dims at `pos` (`[t]` i64; no RoPE when `inv_freq` is `None`),
/// computed in fp32 and rounded once to `O`.
///
/// Errors: [`CudaError::Shape`] for short buffers, rotary dims over `d`, or bf16
/// outputs from an fp32 `proj`.
#[allow(clippy::too_many_arguments)]
pub fn prep<T: Elem, O: Elem>(
    gpu: &Gpu,
    proj: &CudaSlice<T>,
    t: usize,
    ld: usize,
    q_norm: &CudaSlice<f32>,
    k_norm: &CudaSlice<f32>,
    pos: &CudaSlice<i64>,
    inv_freq: Option<&CudaSlice<f32>>,
    silu: bool,
    h: usize,
    d: usize,
    eps: f32,
    q: &mut CudaSlice<O>,
    k: &mut CudaSlice<O>,
    v: &mut CudaSlice<O>,
) -> Result<()> {
    let w = h * d;
    let name = kernel_name::<T, O>("lt_prep")?;
    if ld < 3 * w {
        return Err(shape_err(format!(
            "projection width {ld} < 3·H·d = {}",
            3 * w
        )));
    }
    check_len("proj [t, ld]", proj, t * ld)?;
    check_len("q_norm [d]", q_norm, d)?;
    check_len("k_norm [d]", k_norm, d)?;
    check_len("positions [t]", pos, t)?;
    for (n, x) in [("q", &*q), ("k", &*k), ("v", &*v)] {
        check_len(&format!("{n} [t, H, d]"), x, t * w)?;
    }
    let rot = inv_freq.map_or(0, |f| 2 * f.len());
    if rot > d {
        return Err(shape_err(format!("rotary dims {rot} > head dim {d}")));
    }
    if t == 0 || w == 0 {
        return Ok(());
    }
    let f = gpu.function(&LIGHTNING, &name, 0)?;
    let cfg = LaunchConfig {
        grid_dim: (dim_i32("t", t)? as u32, dim_i32("3·H", 3 * h)? as u32, 1),
        block_dim: (if d <= 64 { 32 } else { 128 }, 1, 1),
        shared_mem_bytes: ((d + 32) * 4) as u32,
    };
    let (ldi, roti, si, hi, di) = (
        dim_i32("ld", ld)?,
        rot as i32,
        i32::from(silu),
        dim_i32("H", h)?,
        dim_i32("d", d)?,
    );
    let null: u64 = 0;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(proj).arg(&ldi).arg(q_norm).arg(k_norm).arg(pos);
    match inv_freq {
        Some(inv) => b.arg(inv),
        None => b.arg(&null),
    };
    b.arg(&roti)
        .arg(&si)
        .arg(q)
        .arg(k)
        .arg(v)
        .arg(&hi)
        .arg(&di)
        .arg(&eps);
    // SAFETY: matches `lt_prep_*`; proj [t, ld] with ld ≥ 3W, q/k/v [t, H, d], norms
    // [d], pos [t] checked above; inv_freq [rot/2] (null only with rot = 0); shared
    // memory (d + 32) floats as the kernel uses.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

fn check_rec<E>(
    d: &LightningDims,
    q: &CudaSlice<E>,
    k: &CudaSlice<E>,
    v: &CudaSlice<E>,
    log_decay: &CudaSlice<f32>,
    state: &CudaSlice<f32>,
) -> Result<()> {
    check_len("q [T, H, dk]", q, d.t * d.h * d.dk)?;
    check_len("k [T, H, dk]", k, d.t * d.h * d.dk)?;
    check_len("v [T, H, dv]", v, d.t * d.h * d.dv)?;
    check_len("log decay [H]", log_decay, d.h)?;
    check_len("state [H, dk, dv]", state, d.h * d.dk * d.dv)?;
    if d.h > 65_535 {
        return Err(shape_err(format!("{} heads: too many for the grid", d.h)));
    }
    Ok(())
}

/// The token-by-token recurrence (the reference; decode): from `state` (`[H, dk, dv]`
/// fp32, advanced in place) over `q, k` (`[T, H, dk]`), `v` (`[T, H, dv]`) with
/// `log_decay` (`[H]`): `S_t = exp(g_h) S_{t−1} + k_t v_tᵀ`, `o_t = scale·S_tᵀ q_t`
/// into `o` (`[T, H, dv]` fp32). The CPU `mixers::lightning::naive::recurrent` with
/// the same roundings (no fused multiply-adds).
///
/// Errors: [`CudaError::Shape`] for short buffers.
#[allow(clippy::too_many_arguments)]
pub fn recurrent(
    gpu: &Gpu,
    d: &LightningDims,
    q: &CudaSlice<f32>,
    k: &CudaSlice<f32>,
    v: &CudaSlice<f32>,
    log_decay: &CudaSlice<f32>,
    scale: f32,
    state: &mut CudaSlice<f32>,
    o: &mut CudaSlice<f32>,
) -> Result<()> {
    check_rec(d, q, k, v, log_decay, state)?;
    check_len("o [T, H, dv]", o, d.t * d.h * d.dv)?;
    if d.t == 0 || d.h == 0 || d.dv == 0 {
        return Ok(());
    }
    let f = gpu.function(&LIGHTNING, "lt_recurrent", 0)?;
    let block = 64usize;
    let cfg = LaunchConfig {
        grid_dim: (d.h as u32, d.dv.div_ceil(block) as u32, 1),
        block_dim: (block as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (ti, hi, dki, dvi) = (
        dim_i32("t", d.t)?,
        dim_i32("H", d.h)?,
        dim_i32("dk", d.dk)?,
        dim_i32("dv", d.dv)?,
    );
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(q)
        .arg(k)
        .arg(v)
        .arg(log_decay)
        .arg(&scale)
        .arg(state)
        .arg(o)
        .arg(&ti)
        .arg(&hi)
        .arg(&dki)
        .arg(&dvi);
    // SAFETY: matches `lt_recurrent`; lengths checked above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Largest key dim of [`chunked`] (its tiles hold whole key rows in shared memory).
pub const MAX_CHUNK_DK: usize = 256;

/// Dynamic shared memory of `lt_chunk` for key dim `dk`, bytes.
fn chunk_smem(dk: usize) -> usize {
    4 * (2 * CHUNK * (dk + 1) + CHUNK * BV + CHUNK * CHUNK + dk * BV + CHUNK + 1)
}

/// The chunked prefill: the same contract as [`recurrent`] (chunks of [`CHUNK`]
/// tokens; decay powers from double precision, rounded once, as the CPU
/// `mixers::lightning::chunk::chunked`). With `o = None` a state-only pass (the
/// `S_body|0` of a PIC body pair). One block per head and 32 value columns; the
/// chunks run in order.
///
/// Errors: [`CudaError::Shape`] for short buffers or a key dim whose tiles exceed the
/// device's shared memory.
#[allow(clippy::too_many_arguments)]
pub fn chunked(
    gpu: &Gpu,
    d: &LightningDims,
    q: &CudaSlice<f32>,
    k: &CudaSlice<f32>,
    v: &CudaSlice<f32>,
    log_decay: &CudaSlice<f32>,
    scale: f32,
    state: &mut CudaSlice<f32>,
    o: Option<&mut CudaSlice<f32>>,
) -> Result<()> {
    check_rec(d, q, k, v, log_decay, state)?;
    if let Some(o) = &o {
        check_len("o [T, H, dv]", o, d.t * d.h * d.dv)?;
    }
    if d.t == 0 || d.h == 0 || d.dv == 0 {
        return Ok(());
    }
    if d.dk > MAX_CHUNK_DK {
        return Err(shape_err(format!(
            "key dim {} over {MAX_CHUNK_DK} (the chunked kernel's shared-memory tiles)",
            d.dk
        )));
    }
    let smem = chunk_smem(d.dk);
    // The function's limit is raised once, for the largest key dim.
    let f = gpu.function(&LIGHTNING, "lt_chunk", chunk_smem(MAX_CHUNK_DK) as u32)?;
    let cfg = LaunchConfig {
        grid_dim: (d.h as u32, d.dv.div_ceil(BV) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (ti, hi, dki, dvi) = (
        dim_i32("t", d.t)?,
        dim_i32("H", d.h)?,
        dim_i32("dk", d.dk)?,
        dim_i32("dv", d.dv)?,
    );
    let null: u64 = 0;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(q).arg(k).arg(v).arg(log_decay).arg(&scale).arg(state);
    match o {
        Some(o) => b.arg(o),
        None => b.arg(&null),
    };
    b.arg(&ti).arg(&hi).arg(&dki).arg(&dvi);
    // SAFETY: matches `lt_chunk`; lengths checked above; dynamic shared memory as
    // `chunk_smem` (the kernel's layout), opted into by `Gpu::function`.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Tokens per slab of [`chunked_two_pass`]: the chunk-start states of one slab are held
/// at once (`SLAB / CHUNK · H · dk · dv` fp32 of scratch).
pub const SLAB: usize = 2048;
/// Spans of at least this many tokens take [`chunked_two_pass`] in [`span`].
pub const TWO_PASS_MIN_TOKENS: usize = 256;

/// The chunked prefill in two launches per slab of [`SLAB`] tokens, the same contract,
/// math and roundings as [`chunked`] (its reference): `lt_chunk_states` runs the
/// slab's chunks in order per head and value tile and stores each chunk's starting
/// state; `lt_chunk_out` then computes every chunk's outputs in parallel from it.
///
/// Errors: as [`chunked`].
#[allow(clippy::too_many_arguments)]
pub fn chunked_two_pass(
    gpu: &Gpu,
    d: &LightningDims,
    q: &CudaSlice<f32>,
    k: &CudaSlice<f32>,
    v: &CudaSlice<f32>,
    log_decay: &CudaSlice<f32>,
    scale: f32,
    state: &mut CudaSlice<f32>,
    o: &mut CudaSlice<f32>,
) -> Result<()> {
    check_rec(d, q, k, v, log_decay, state)?;
    check_len("o [T, H, dv]", o, d.t * d.h * d.dv)?;
    if d.t == 0 || d.h == 0 || d.dv == 0 {
        return Ok(());
    }
    if d.dk > MAX_CHUNK_DK {
        return Err(shape_err(format!(
            "key dim {} over {MAX_CHUNK_DK} (the chunked kernel's shared-memory tiles)",
            d.dk
        )));
    }
    let smem = chunk_smem(d.dk) as u32;
    let fs = gpu.function(
        &LIGHTNING,
        "lt_chunk_states",
        chunk_smem(MAX_CHUNK_DK) as u32,
    )?;
    let fo = gpu.function(&LIGHTNING, "lt_chunk_out", chunk_smem(MAX_CHUNK_DK) as u32)?;
    let (h, dk, dv) = (d.h, d.dk, d.dv);
    let per = h * dk * dv;
    let mut hs: super::Scratch<f32> = gpu.scratch(SLAB.min(d.t).div_ceil(CHUNK) * per)?;
    let (hi, dki, dvi) = (dim_i32("H", h)?, dim_i32("dk", dk)?, dim_i32("dv", dv)?);
    let tiles = dv.div_ceil(BV) as u32;
    let (wk, wv) = (h * dk, h * dv);
    let mut a = 0;
    while a < d.t {
        let n = SLAB.min(d.t - a);
        let nch = n.div_ceil(CHUNK);
        let ni = dim_i32("slab", n)?;
        let qs = q.slice(a * wk..(a + n) * wk);
        let ks = k.slice(a * wk..(a + n) * wk);
        let vs = v.slice(a * wv..(a + n) * wv);
        let mut b = gpu.stream().launch_builder(&fs);
        b.arg(&ks)
            .arg(&vs)
            .arg(log_decay)
            .arg(&mut *state)
            .arg(&mut *hs)
            .arg(&ni)
            .arg(&hi)
            .arg(&dki)
            .arg(&dvi);
        let cfg = LaunchConfig {
            grid_dim: (h as u32, tiles, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem,
        };
        // SAFETY: matches `lt_chunk_states`; k, v views of n rows, state [H, dk, dv]
        // (checked), hs holds ceil(n / CHUNK) chunk states; shared memory as lt_chunk.
        unsafe { b.launch(cfg) }?;
        let mut os = o.slice_mut(a * wv..(a + n) * wv);
        let mut b = gpu.stream().launch_builder(&fo);
        b.arg(&qs)
            .arg(&ks)
            .arg(&vs)
            .arg(log_decay)
            .arg(&scale)
            .arg(&*hs)
            .arg(&mut os)
            .arg(&ni)
            .arg(&hi)
            .arg(&dki)
            .arg(&dvi);
        let cfg = LaunchConfig {
            grid_dim: (nch as u32, h as u32, tiles),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem,
        };
        // SAFETY: matches `lt_chunk_out`; q, k, v, o views of n rows, hs the slab's
        // chunk states written by the launch above (same stream).
        unsafe { b.launch(cfg) }?;
        a += n;
    }
    Ok(())
}

/// Whether bf16 models run their Lightning prefill on tensor cores ([`chunked_tc`]):
/// yes unless the environment sets `HYPIC_CUDA_LIGHTNING_TC=0` (read once), which
/// keeps the fp32 kernels ([`span`]) for A/B runs (also `off`, `false`, `no`; `=fused` and
/// `=two-pass` pick a [`TcForm`], see [`tc_form`]).
pub fn tensor_cores_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("HYPIC_CUDA_LIGHTNING_TC").map_or(true, |v| {
            !matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "0" | "off" | "false" | "no"
            )
        })
    })
}

/// Head dim of [`chunked_tc`] (`LTC_D` in lightning_tc.cu): `dk = dv = 128`.
pub const TC_DIM: usize = 128;
/// Value columns per block of [`chunked_tc`] (`LTC_BV`).
const TC_BV: usize = 16;
/// Dynamic shared memory of `lt_chunk_tc_bf16`, bytes (`LTC_SMEM`: per pipeline stage
/// 64-token q and k tiles of 136 bf16 per row and a v tile of 24; two bf16 state
/// copies of 24 per row; 65 fp32 decay powers).
const TC_SMEM: usize = (TC_STAGES * (2 * 64 * 136 + 64 * 24) + 2 * 128 * 24) * 2 + 65 * 4;
/// Pipeline stages of the chunk loop (`LTC_ST`: two, the form measured on the GPU;
/// the host emulator also checks three).
const TC_STAGES: usize = 2;
/// `LTC_PRE_SMEM`: `TC_SMEM` rounded up to 16 bytes, then one stage's score fragments
/// per pipeline stage.
const TC_PRE_SMEM: usize = TC_SMEM.div_ceil(16) * 16 + TC_STAGES * 512 * 16;
/// `LTC_SCORES_SMEM`: one q and one k tile, the decay powers.
const TC_SCORES_SMEM: usize = 2 * 64 * 136 * 2 + 65 * 4;
/// Tokens per step of the two-pass form's state pass and per block of its output pass
/// (`LTC_CB`): the stored states are those at multiples of it.
const TC_STEP: usize = 128;
/// Pipeline stages of `lt_states_tc_bf16` (`LTC_SST`).
const TC_STATE_STAGES: usize = 3;
/// `LTC_STATES_SMEM`: per stage a 128-token k tile of 136 bf16 per row and a v tile of
/// 24; 129 fp32 decay powers.
const TC_STATES_SMEM: usize = TC_STATE_STAGES * TC_STEP * (136 + 24) * 2 + (TC_STEP + 1) * 4;
/// `LTC_OUT_SMEM`: the q, k, v and state tiles of 128 rows of 136 bf16, the decay powers.
const TC_OUT_SMEM: usize = 4 * TC_STEP * 136 * 2 + (TC_STEP + 1) * 4;

/// The chunked prefill on tensor cores (`lt_chunk_tc_bf16`, kernels/lightning_tc.cu):
/// the contract of [`chunked`] with bf16 `q, k` (`[T, H, 128]`), `v` and `o`
/// (`[T, H, 128]`), fp32 `log_decay` (`[H]`) and state (`[H, 128, 128]`, advanced in
/// place). Chunks of 64 tokens, products on tensor cores with fp32 accumulation; `P`,
/// the bf16 copy of the chunk-initial state and the decayed values are rounded to
/// bf16 (relative error of a bf16 rounding against the fp64 recurrence, checked by
/// `tools/kernel-emu/run.sh lightning-tc`). With `o = None` a state-only pass (the
/// `S_body|0` of a PIC body pair); `q` is then not read. The sequential part (the chunk
/// loop, or the two-pass form's state pass) runs one block per head and 16 value
/// columns; see [`TcForm`] for the forms.
///
/// Errors: [`CudaError::Shape`] unless `T` is bf16 and `dk = dv = 128`, for short
/// buffers, q, k, v, o not starting at a multiple of 16 bytes (the kernel copies q,
/// k, v with 16-byte `cp.async` and stores o in bf16 pairs), or more than 65 535 heads.
#[allow(clippy::too_many_arguments)]
pub fn chunked_tc<T: Elem>(
    gpu: &Gpu,
    d: &LightningDims,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    log_decay: &CudaSlice<f32>,
    scale: f32,
    state: &mut CudaSlice<f32>,
    o: Option<&mut CudaSlice<T>>,
) -> Result<()> {
    chunked_tc_with(tc_form(), gpu, d, q, k, v, log_decay, scale, state, o)
}

/// How [`chunked_tc`] runs its kernels. `Fused` and `Split` give the same results bit
/// for bit; `TwoPass` rounds the chunk-initial state to bf16 every 128 tokens instead of
/// every 64 (errors of the same size against the recurrence).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcForm {
    /// Per slab of [`TC_SLAB`] tokens, `lt_states_tc_bf16` runs the state recurrence alone
    /// (one block per head and 16 value columns, steps of 128 tokens in order) and stores
    /// the bf16 state before each step; then `lt_out_tc_bf16` computes every 128-token
    /// block's output at once from those states (one block per block and head). A
    /// state-only pass is the first launch alone, storing nothing.
    TwoPass,
    /// One launch (`lt_chunk_tc_bf16`): each block computes its chunks' scores `QKᵀ`
    /// itself, inside the sequential chunk loop.
    Fused,
    /// Per slab of [`TC_SLAB`] tokens, `lt_scores_tc_bf16` computes every chunk's scores
    /// at once (one block per chunk and head), then `lt_chunk_pre_tc_bf16` runs the
    /// chunk loop on them; state-only passes take [`TcForm::Fused`] (no scores).
    Split,
}

/// Tokens per slab of [`TcForm::Split`] and [`TcForm::TwoPass`]: the scratch holds one
/// slab's scores (`H · TC_SLAB/64 · 8 KiB`) or states (`H · TC_SLAB/128 · 32 KiB`).
pub const TC_SLAB: usize = 8192;

/// The form [`chunked_tc`] takes: [`TcForm::Split`] (the form timed on a GPU so far)
/// unless the environment sets `HYPIC_CUDA_LIGHTNING_TC=fused` or `=two-pass` (read
/// once).
pub fn tc_form() -> TcForm {
    static F: std::sync::OnceLock<TcForm> = std::sync::OnceLock::new();
    *F.get_or_init(|| {
        match std::env::var("HYPIC_CUDA_LIGHTNING_TC").map(|v| v.trim().to_ascii_lowercase()) {
            Ok(v) if v == "fused" => TcForm::Fused,
            Ok(v) if v == "two-pass" || v == "twopass" => TcForm::TwoPass,
            _ => TcForm::Split,
        }
    })
}

/// [`chunked_tc`] in a chosen [`TcForm`] (the benchmark times both).
///
/// Errors: as [`chunked_tc`].
#[allow(clippy::too_many_arguments)]
pub fn chunked_tc_with<T: Elem>(
    form: TcForm,
    gpu: &Gpu,
    d: &LightningDims,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    log_decay: &CudaSlice<f32>,
    scale: f32,
    state: &mut CudaSlice<f32>,
    o: Option<&mut CudaSlice<T>>,
) -> Result<()> {
    if T::SUFFIX != "bf16" || d.dk != TC_DIM || d.dv != TC_DIM {
        return Err(shape_err(format!(
            "tensor-core Lightning prefill needs bf16 and dk = dv = {TC_DIM} (got {}, dk {}, dv {})",
            T::SUFFIX,
            d.dk,
            d.dv
        )));
    }
    check_rec(d, q, k, v, log_decay, state)?;
    if let Some(o) = &o {
        check_len("o [T, H, dv]", o, d.t * d.h * d.dv)?;
    }
    if d.t == 0 || d.h == 0 {
        return Ok(());
    }
    for (n, x) in [("q", q), ("k", k), ("v", v)] {
        check_align16(gpu, n, x)?;
    }
    if let Some(o) = &o {
        // Stored as bf16 pairs; rows of 256 bytes keep a 16-byte start aligned.
        check_align16(gpu, "o", o)?;
    }
    let hi = dim_i32("H", d.h)?;
    let grid_loop = (d.h as u32, (TC_DIM / TC_BV) as u32, 1);
    if form == TcForm::TwoPass {
        return two_pass_tc(gpu, d, q, k, v, log_decay, scale, state, o);
    }
    let o = match (form, o) {
        (TcForm::Split, Some(o)) => o,
        (_, o) => {
            let f = gpu.function(&LIGHTNING_TC, "lt_chunk_tc_bf16", TC_SMEM as u32)?;
            let cfg = LaunchConfig {
                grid_dim: grid_loop,
                block_dim: (128, 1, 1),
                shared_mem_bytes: TC_SMEM as u32,
            };
            let ti = dim_i32("t", d.t)?;
            let null: u64 = 0;
            let mut b = gpu.stream().launch_builder(&f);
            b.arg(q).arg(k).arg(v).arg(log_decay).arg(&scale).arg(state);
            match o {
                Some(o) => b.arg(o),
                None => b.arg(&null),
            };
            b.arg(&ti).arg(&hi);
            // SAFETY: matches `lt_chunk_tc_bf16`; T is bf16 (checked), q/k/v/o [T, H,
            // 128], state [H, 128, 128] checked above; q, k, v 16-byte aligned (checked;
            // their rows are 256 bytes); dynamic shared memory as LTC_SMEM, opted into
            // by `Gpu::function`.
            unsafe { b.launch(cfg) }?;
            return Ok(());
        }
    };
    let fs = gpu.function(&LIGHTNING_TC, "lt_scores_tc_bf16", TC_SCORES_SMEM as u32)?;
    let fl = gpu.function(&LIGHTNING_TC, "lt_chunk_pre_tc_bf16", TC_PRE_SMEM as u32)?;
    let slab_chunks = d.t.min(TC_SLAB).div_ceil(64);
    let mut pf: super::Scratch<u32> = gpu.scratch(d.h * slab_chunks * 2048)?;
    let w = d.h * TC_DIM;
    let mut a = 0usize;
    while a < d.t {
        let n = TC_SLAB.min(d.t - a);
        let ti = dim_i32("slab", n)?;
        // Slab starts are multiples of TC_SLAB rows of 256 bytes: still 16-byte aligned.
        let (qs, ks, vs) = (
            q.slice(a * w..(a + n) * w),
            k.slice(a * w..(a + n) * w),
            v.slice(a * w..(a + n) * w),
        );
        let mut os = o.slice_mut(a * w..(a + n) * w);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(64) as u32, d.h as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: TC_SCORES_SMEM as u32,
        };
        let mut b = gpu.stream().launch_builder(&fs);
        b.arg(&qs)
            .arg(&ks)
            .arg(log_decay)
            .arg(&scale)
            .arg(&mut *pf)
            .arg(&ti)
            .arg(&hi);
        // SAFETY: matches `lt_scores_tc_bf16`; q, k views of n rows (checked lengths,
        // aligned), pf holds H · ceil(n / 64) · 512 uint4; H ≤ 65 535 (grid y, checked
        // by the launch).
        unsafe { b.launch(cfg) }?;
        let cfg = LaunchConfig {
            grid_dim: grid_loop,
            block_dim: (128, 1, 1),
            shared_mem_bytes: TC_PRE_SMEM as u32,
        };
        let mut b = gpu.stream().launch_builder(&fl);
        b.arg(&qs)
            .arg(&ks)
            .arg(&vs)
            .arg(&*pf)
            .arg(log_decay)
            .arg(&scale)
            .arg(&mut *state)
            .arg(&mut os)
            .arg(&ti)
            .arg(&hi);
        // SAFETY: matches `lt_chunk_pre_tc_bf16`; the slab's n-row views of the
        // length-checked q, k, v, o, the scores written
        // by the launch above (same stream), state [H, 128, 128]; shared memory as
        // LTC_PRE_SMEM.
        unsafe { b.launch(cfg) }?;
        a += n;
    }
    Ok(())
}

/// [`TcForm::TwoPass`] of [`chunked_tc_with`] (arguments checked there).
#[allow(clippy::too_many_arguments)]
fn two_pass_tc<T: Elem>(
    gpu: &Gpu,
    d: &LightningDims,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    log_decay: &CudaSlice<f32>,
    scale: f32,
    state: &mut CudaSlice<f32>,
    o: Option<&mut CudaSlice<T>>,
) -> Result<()> {
    let hi = dim_i32("H", d.h)?;
    let fs = gpu.function(&LIGHTNING_TC, "lt_states_tc_bf16", TC_STATES_SMEM as u32)?;
    let cfg_states = LaunchConfig {
        grid_dim: (d.h as u32, (TC_DIM / TC_BV) as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: TC_STATES_SMEM as u32,
    };
    let Some(o) = o else {
        let ti = dim_i32("t", d.t)?;
        let null: u64 = 0;
        let mut b = gpu.stream().launch_builder(&fs);
        b.arg(k)
            .arg(v)
            .arg(log_decay)
            .arg(&mut *state)
            .arg(&null)
            .arg(&ti)
            .arg(&hi);
        // SAFETY: matches `lt_states_tc_bf16`; k, v [T, H, 128] bf16 (checked lengths,
        // 16-byte aligned), state [H, 128, 128]; hs null (nothing stored); dynamic shared
        // memory as LTC_STATES_SMEM, opted into by `Gpu::function`.
        unsafe { b.launch(cfg_states) }?;
        return Ok(());
    };
    let fo = gpu.function(&LIGHTNING_TC, "lt_out_tc_bf16", TC_OUT_SMEM as u32)?;
    let slab_steps = d.t.min(TC_SLAB).div_ceil(TC_STEP);
    let mut hs: super::Scratch<T> = gpu.scratch(d.h * slab_steps * TC_DIM * TC_DIM)?;
    let w = d.h * TC_DIM;
    let mut a = 0usize;
    while a < d.t {
        let n = TC_SLAB.min(d.t - a);
        let ti = dim_i32("slab", n)?;
        // Slab starts are multiples of TC_SLAB rows of 256 bytes: still 16-byte aligned.
        let (qs, ks, vs) = (
            q.slice(a * w..(a + n) * w),
            k.slice(a * w..(a + n) * w),
            v.slice(a * w..(a + n) * w),
        );
        let mut os = o.slice_mut(a * w..(a + n) * w);
        let mut b = gpu.stream().launch_builder(&fs);
        b.arg(&ks)
            .arg(&vs)
            .arg(log_decay)
            .arg(&mut *state)
            .arg(&mut *hs)
            .arg(&ti)
            .arg(&hi);
        // SAFETY: matches `lt_states_tc_bf16`; the slab's n-row views of the checked k,
        // v; hs holds H · ceil(n / 128) states of 128 × 128 bf16 (a fresh allocation is
        // 256-byte aligned); shared memory as LTC_STATES_SMEM.
        unsafe { b.launch(cfg_states) }?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(TC_STEP) as u32, d.h as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: TC_OUT_SMEM as u32,
        };
        let mut b = gpu.stream().launch_builder(&fo);
        b.arg(&qs)
            .arg(&ks)
            .arg(&vs)
            .arg(&*hs)
            .arg(log_decay)
            .arg(&scale)
            .arg(&mut os)
            .arg(&ti)
            .arg(&hi);
        // SAFETY: matches `lt_out_tc_bf16`; the slab's n-row views of q, k, v, o, the
        // states written by the launch above (same stream); grid y = H ≤ 65 535 (checked
        // by the launch); shared memory as LTC_OUT_SMEM.
        unsafe { b.launch(cfg) }?;
        a += n;
    }
    Ok(())
}

/// [`recurrent`] for short spans, [`chunked`] from [`CHUNKED_MIN_TOKENS`] tokens and
/// [`chunked_two_pass`] from [`TWO_PASS_MIN_TOKENS`] (the CPU layer's choice of the
/// token loop below 16 tokens).
#[allow(clippy::too_many_arguments)]
pub fn span(
    gpu: &Gpu,
    d: &LightningDims,
    q: &CudaSlice<f32>,
    k: &CudaSlice<f32>,
    v: &CudaSlice<f32>,
    log_decay: &CudaSlice<f32>,
    scale: f32,
    state: &mut CudaSlice<f32>,
    o: &mut CudaSlice<f32>,
) -> Result<()> {
    if d.t >= TWO_PASS_MIN_TOKENS && d.dk <= MAX_CHUNK_DK {
        chunked_two_pass(gpu, d, q, k, v, log_decay, scale, state, o)
    } else if d.t >= CHUNKED_MIN_TOKENS && d.dk <= MAX_CHUNK_DK {
        chunked(gpu, d, q, k, v, log_decay, scale, state, Some(o))
    } else {
        recurrent(gpu, d, q, k, v, log_decay, scale, state, o)
    }
}

/// Step 4 of the layer: `y = g_norm · o / rms_group(o) · sigmoid(gate)` per token and
/// group (`groups` contiguous groups of the `w` channels, RMS with `eps`). `o`:
/// `[t, w]` in `O` (fp32, or bf16 with a bf16 `proj`); the gate logits are columns `gate_col..gate_col + w` of `proj`
/// (`[t, ld]` in `T`); `g_norm`: `[w]`; `y`: `[t, w]` in `T`.
///
/// Errors: [`CudaError::Shape`] for short buffers, `groups` not dividing `w`, or a bf16
/// `o` with an fp32 `proj`.
#[allow(clippy::too_many_arguments)]
pub fn out<T: Elem, O: Elem>(
    gpu: &Gpu,
    o: &CudaSlice<O>,
    proj: &CudaSlice<T>,
    ld: usize,
    gate_col: usize,
    g_norm: &CudaSlice<f32>,
    y: &mut CudaSlice<T>,
    t: usize,
    w: usize,
    groups: usize,
    eps: f32,
) -> Result<()> {
    let name = kernel_name::<T, O>("lt_out")?;
    if groups == 0 || !w.is_multiple_of(groups) || gate_col + w > ld {
        return Err(shape_err(format!(
            "group norm: {groups} groups of {w} channels, gate columns {gate_col}.. of {ld}"
        )));
    }
    check_len("o [t, W]", o, t * w)?;
    check_len("proj [t, ld]", proj, t * ld)?;
    check_len("g_norm [W]", g_norm, w)?;
    check_len("y [t, W]", y, t * w)?;
    if t == 0 || w == 0 {
        return Ok(());
    }
    let f = gpu.function(&LIGHTNING, &name, 0)?;
    let cfg = LaunchConfig {
        grid_dim: (
            dim_i32("t", t)? as u32,
            dim_i32("groups", groups)? as u32,
            1,
        ),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let (ldi, gci, wi, gi) = (
        dim_i32("ld", ld)?,
        dim_i32("gate column", gate_col)?,
        dim_i32("W", w)?,
        dim_i32("groups", groups)?,
    );
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(o)
        .arg(proj)
        .arg(&ldi)
        .arg(&gci)
        .arg(g_norm)
        .arg(y)
        .arg(&wi)
        .arg(&gi)
        .arg(&eps);
    // SAFETY: matches `lt_out_*`; lengths and the gate columns checked above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Moves a Lightning state (`[H, dk, dv]` fp32, in place) whose keys sit at positions
/// `p` to `p + b`: RoPE `R(b)` on the key axis (the first `2·inv_freq.len()` rows of
/// every head, NeoX pairing). CPU reference: `mixers::lightning::rotate_state`.
///
/// Errors: [`CudaError::Shape`] for a short state or rotary dims over `dk`.
pub fn rotate_state(
    gpu: &Gpu,
    state: &mut CudaSlice<f32>,
    h: usize,
    dk: usize,
    dv: usize,
    b: i64,
    inv_freq: &CudaSlice<f32>,
) -> Result<()> {
    check_len("state [H, dk, dv]", state, h * dk * dv)?;
    let rot = 2 * inv_freq.len();
    if rot > dk {
        return Err(shape_err(format!("rotary dims {rot} > key dim {dk}")));
    }
    let n = h * (rot / 2) * dv;
    if b == 0 || n == 0 {
        return Ok(());
    }
    let f = gpu.function(&LIGHTNING, "lt_rotate_state", 0)?;
    let (hi, dki, dvi, ri) = (
        dim_i32("H", h)?,
        dim_i32("dk", dk)?,
        dim_i32("dv", dv)?,
        rot as i32,
    );
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(state)
        .arg(&hi)
        .arg(&dki)
        .arg(&dvi)
        .arg(&b)
        .arg(inv_freq)
        .arg(&ri);
    // SAFETY: matches `lt_rotate_state`; state [H, dk, dv] checked, rot ≤ dk.
    unsafe { l.launch(cfg1(n)) }?;
    Ok(())
}

/// `S ← T_h·S + B` per head (`naive`: `S ← S + B`). `state`, `b`: `[H, per_head]`
/// fp32; `trans`: `[H]`. CPU reference: `linear::transition::Pair::apply` (scalar).
///
/// Errors: [`CudaError::Shape`] for short buffers.
pub fn scalar_apply(
    gpu: &Gpu,
    state: &mut CudaSlice<f32>,
    trans: &CudaSlice<f32>,
    b: &CudaSlice<f32>,
    h: usize,
    per_head: usize,
    naive: bool,
) -> Result<()> {
    let n = h * per_head;
    check_len("state", state, n)?;
    check_len("B", b, n)?;
    check_len("T [H]", trans, h)?;
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(&LIGHTNING, "lt_scalar_apply", 0)?;
    let (hi, ph, ni) = (dim_i32("H", h)?, per_head as i64, i32::from(naive));
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(state).arg(trans).arg(b).arg(&hi).arg(&ph).arg(&ni);
    // SAFETY: matches `lt_scalar_apply`; lengths checked above.
    unsafe { l.launch(cfg1(n)) }?;
    Ok(())
}

/// The scalar transitions `exp(g_h·len)` of a span of `len` tokens (`[H]`, as the CPU
/// `mixers::lightning::chunk::transition`).
pub fn transition_host(log_decay: &[f32], len: usize) -> Vec<f32> {
    crate::mixers::lightning::chunk::transition(log_decay, len)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host's shared-memory sizes follow the kernel's tile macros: the pipeline
    /// depth and tile shapes in lightning_tc.cu are those `TC_STAGES`, `TC_SMEM` and
    /// `TC_PRE_SMEM` are computed from, and the largest fits a block (no device needed).
    #[test]
    fn tensor_core_shared_memory_follows_the_kernel() {
        let src = super::super::compile::LIGHTNING_TC.text;
        assert!(
            src.contains(&format!("#define LTC_ST {TC_STAGES}\n")),
            "LTC_ST in kernels/lightning_tc.cu differs from TC_STAGES = {TC_STAGES}"
        );
        for (name, v) in [
            ("LTC_C", 64),
            ("LTC_D", TC_DIM),
            ("LTC_BV", TC_BV),
            ("LTC_LDQ", 136),
            ("LTC_LDV", 24),
        ] {
            assert!(
                src.contains(&format!("#define {name} {v} ")),
                "{name} in kernels/lightning_tc.cu differs from {v}"
            );
        }
        assert!(
            src.contains(&format!("#define LTC_SST {TC_STATE_STAGES}\n")),
            "LTC_SST in kernels/lightning_tc.cu differs from TC_STATE_STAGES = {TC_STATE_STAGES}"
        );
        assert!(
            src.contains(&format!("#define LTC_CB {TC_STEP}\n")),
            "LTC_CB in kernels/lightning_tc.cu differs from TC_STEP = {TC_STEP}"
        );
        for bytes in [TC_PRE_SMEM, TC_STATES_SMEM, TC_OUT_SMEM] {
            assert!(
                bytes <= 227 * 1024,
                "{bytes} bytes: over the 227 KiB a block may use"
            );
        }
    }
}
