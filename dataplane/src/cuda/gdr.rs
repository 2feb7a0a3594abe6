//! Gated delta rule on the GPU: one-token (or any-length) recurrent decode and the
//! chunked WY prefill from an initial state, optionally producing the segment's dense
//! transition `T_C`. CPU references: `mixers::gated_deltanet::{recurrent, chunked,
//! chunked_with_transition}`; kernels in `dataplane/kernels/gdr.cu`.
//!
//! Layouts (as the CPU backend and FLA): `q, k: [T, Hk, dk]` (q L2-normalised and scaled
//! by `dk^-0.5`, k L2-normalised), `v: [T, Hv, dv]`, `g, beta: [T, Hv]` fp32,
//! `state: [Hv, dk, dv]` fp32 K-major (initial → final, in place), `o: [T, Hv, dv]`,
//! `trans: [Hv, dk, dk]` fp32 row-major. q, k, v, o are `f32` or `bf16` ([`Elem`]).
//!
//! The chunked prefill has two implementations behind one contract ([`chunked`]):
//! fp32 SIMT kernels (`kernels/gdr.cu`; the f32 path, bit-for-bit unchanged, and the
//! reference) and, for bf16 inputs, tensor-core kernels (`kernels/gdr_tc.cu`:
//! `mma.sync` m16n8k16 with bf16 operands and fp32 accumulation, the state kept in fp32).
//! [`Workspace::force_path`] picks one explicitly (tests, benchmarks).
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::compile::{GDR, GDR_TC};
use super::{check_len, grid_for, CudaError, CudaSlice, Elem, Gpu, Result};
use crate::mixers::gated_deltanet::GdrDims;

/// Chunk length of the GPU prefill (fixed, as FLA's default).
pub const CHUNK: usize = 64;
/// The key and value head dims the chunked prefill is built for (Qwen3-Next/3.5, Kimi).
pub const PREFILL_DIM: usize = 128;

const LDX: usize = 2 * PREFILL_DIM + 1;
const LDT: usize = PREFILL_DIM + 4;
const SMEM_PREP: u32 = ((CHUNK * LDX + CHUNK * CHUNK + 3 * CHUNK) * 4) as u32;
const SMEM_STATE: u32 = ((2 * CHUNK * LDT + PREFILL_DIM * 32 + CHUNK * 32 + CHUNK) * 4) as u32;
const SMEM_OUT: u32 = ((2 * CHUNK * LDT + CHUNK * (CHUNK + 1) + CHUNK) * 4) as u32;

/// Key dims of the recurrent kernels ([`recurrent`], [`recurrent_rows`]).
pub const RECURRENT_DK: [usize; 3] = [64, 128, 256];

/// Errors unless `Hv` is a positive multiple of `Hk` (value head h reads key head
/// `h / (Hv/Hk)`).
fn check_heads(d: &GdrDims) -> Result<()> {
    if d.hk == 0 || !d.hv.is_multiple_of(d.hk) {
        return Err(CudaError::Shape(format!(
            "Hv {} must be a multiple of Hk {}",
            d.hv, d.hk
        )));
    }
    Ok(())
}

/// Errors unless `dk` ∈ [`RECURRENT_DK`].
fn check_recurrent_dk(d: &GdrDims) -> Result<()> {
    if !RECURRENT_DK.contains(&d.dk) {
        return Err(CudaError::Shape(format!(
            "recurrent GDR kernel: dk {} not in {RECURRENT_DK:?}",
            d.dk
        )));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn check_inputs<T: Elem>(
    d: &GdrDims,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    g: &CudaSlice<f32>,
    beta: &CudaSlice<f32>,
    state: &CudaSlice<f32>,
    out: &CudaSlice<T>,
) -> Result<()> {
    check_heads(d)?;
    check_len("q [T,Hk,dk]", q, d.t * d.hk * d.dk)?;
    check_len("k [T,Hk,dk]", k, d.t * d.hk * d.dk)?;
    check_len("v [T,Hv,dv]", v, d.t * d.hv * d.dv)?;
    check_len("g [T,Hv]", g, d.t * d.hv)?;
    check_len("beta [T,Hv]", beta, d.t * d.hv)?;
    check_len("state [Hv,dk,dv]", state, d.state_len())?;
    check_len("o [T,Hv,dv]", out, d.t * d.hv * d.dv)
}

/// Token-by-token recurrence (the decode kernel; any `T`, one token per step).
/// `dk` ∈ {64, 128, 256}, any `dv`. Same contract as `mixers::gated_deltanet::recurrent`.
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
    check_inputs(d, q, k, v, g, beta, state, out)?;
    check_recurrent_dk(d)?;
    if d.t == 0 || d.hv == 0 || d.dv == 0 {
        return Ok(());
    }
    let f = gpu.function(&GDR, &format!("gdr_recurrent_{}_{}", T::SUFFIX, d.dk), 0)?;
    let cfg = LaunchConfig {
        grid_dim: (d.hv as u32, d.dv.div_ceil(32) as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let (t, hk, hv, dv) = (d.t as i32, d.hk as i32, d.hv as i32, d.dv as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(q)
        .arg(k)
        .arg(v)
        .arg(g)
        .arg(beta)
        .arg(state)
        .arg(out)
        .arg(&t)
        .arg(&hk)
        .arg(&hv)
        .arg(&dv);
    // SAFETY: matches `gdr_recurrent_*` in gdr.cu; lengths checked above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// [`recurrent`] for one decode token of each of `d.t` sequences whose states live in
/// separate buffers, in one launch (`gdr_recurrent_rows_*` in gdr.cu): row `i` of `q, k`
/// (`[t, Hk, dk]`), `v` (`[t, Hv, dv]`), `g, beta` (`[t, Hv]`) advances the state at
/// device address `states[i]` (`[Hv, dk, dv]` fp32) and writes row `i` of `out`
/// (`[t, Hv, dv]`). Each row is exactly [`recurrent`] with one token.
///
/// # Safety
/// Each of the first `d.t` entries of `states` must be the address of a live fp32
/// device buffer of at least `Hv·dk·dv` elements on this device, no two the same, none
/// overlapping the inputs or `out`, and none freed before the launch completes.
#[allow(clippy::too_many_arguments)]
pub unsafe fn recurrent_rows<T: Elem>(
    gpu: &Gpu,
    d: &GdrDims,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    g: &CudaSlice<f32>,
    beta: &CudaSlice<f32>,
    states: &cudarc::driver::CudaView<'_, u64>,
    out: &mut CudaSlice<T>,
) -> Result<()> {
    check_heads(d)?;
    check_recurrent_dk(d)?;
    check_len("q [B,Hk,dk]", q, d.t * d.hk * d.dk)?;
    check_len("k [B,Hk,dk]", k, d.t * d.hk * d.dk)?;
    check_len("v [B,Hv,dv]", v, d.t * d.hv * d.dv)?;
    check_len("g [B,Hv]", g, d.t * d.hv)?;
    check_len("beta [B,Hv]", beta, d.t * d.hv)?;
    if states.len() < d.t {
        return Err(CudaError::Shape(format!(
            "{} state addresses for {} rows",
            states.len(),
            d.t
        )));
    }
    check_len("o [B,Hv,dv]", out, d.t * d.hv * d.dv)?;
    if d.t == 0 || d.hv == 0 || d.dv == 0 {
        return Ok(());
    }
    if d.t > 65_535 {
        return Err(CudaError::Shape(format!(
            "{} rows over the grid's 65 535",
            d.t
        )));
    }
    let f = gpu.function(
        &GDR,
        &format!("gdr_recurrent_rows_{}_{}", T::SUFFIX, d.dk),
        0,
    )?;
    let cfg = LaunchConfig {
        grid_dim: (d.hv as u32, d.dv.div_ceil(32) as u32, d.t as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let (hk, hv, dv) = (d.hk as i32, d.hv as i32, d.dv as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(q)
        .arg(k)
        .arg(v)
        .arg(g)
        .arg(beta)
        .arg(states)
        .arg(out)
        .arg(&hk)
        .arg(&hv)
        .arg(&dv);
    // SAFETY: matches `gdr_recurrent_rows_*` in gdr.cu; lengths checked above, the state
    // addresses are the caller's contract.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Which kernels [`chunked`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkedPath {
    /// fp32 SIMT kernels (`gdr_prep/state/output_{f32,bf16}` in `kernels/gdr.cu`): the
    /// path of f32 inputs; bf16 inputs are widened to fp32 on load.
    Simt,
    /// bf16 tensor-core kernels (`kernels/gdr_tc.cu`); bf16 inputs only.
    TensorCores,
}

/// Value columns per block of the tensor-core state kernel `gdr_state_tc_bf16_32`
/// (16 per warp: 2 warps; Hv·dv/32 blocks, 128 at Hv = 32).
const STATE_BV: usize = 32;
/// Most chunks of the tensor-core prefill: `gdr_prep_tc2_bf16` and `gdr_output_tc2_bf16`
/// put the chunks on grid y (T ≤ 65 535 · [`CHUNK`] = 4 194 240 tokens per call).
pub const TC_MAX_CHUNKS: usize = 65_535;

/// Scratch of the chunked prefill, reusable across calls (grows as needed), and the
/// choice of kernels.
///
/// SIMT path: `gcum [Hv, T]`, `W [Hv, T, dk]`, `U [Hv, T, dv]` (then `Ũ`),
/// `Hs [NT, Hv, dk, dv]` chunk-initial states, all fp32 —
/// `4·Hv·T·(1 + dk + dv) + 4·NT·Hv·dk·dv` bytes (1.6 GiB at T = 32k, Hv = 32,
/// dk = dv = 128).
///
/// Tensor-core path (layouts in `kernels/gdr_tc.cu`): `gcum [Hv, NT·64]` fp32 and, per
/// (head, chunk), bf16 fragment tiles of W (16 KiB), K̃ᵀ (16 KiB), Uᵀ then Ũᵀ (16 KiB)
/// and the chunk-initial state (32 KiB) — `Hv·NT·(80 KiB + 256 B)` (1.25 GiB at
/// T = 32k, Hv = 32). The buffers are typed `f32` but hold these bytes.
#[derive(Default)]
pub struct Workspace {
    gcum: Option<CudaSlice<f32>>,
    w: Option<CudaSlice<f32>>,
    u: Option<CudaSlice<f32>>,
    hs: Option<CudaSlice<f32>>,
    kt: Option<CudaSlice<f32>>,
    force: Option<ChunkedPath>,
}

impl Workspace {
    /// An empty workspace (allocated on first use).
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes currently allocated.
    pub fn bytes(&self) -> usize {
        [&self.gcum, &self.w, &self.u, &self.hs, &self.kt]
            .iter()
            .map(|b| b.as_ref().map_or(0, |b| b.len() * 4))
            .sum()
    }

    /// Forces the kernels of [`chunked`] (`None`: automatic — tensor cores for bf16,
    /// SIMT for f32; tests compare the two paths on bf16 inputs with it). f32 inputs
    /// always run on the SIMT kernels.
    pub fn force_path(&mut self, path: Option<ChunkedPath>) {
        self.force = path;
    }

    /// The kernels [`chunked`] runs for element type `T` with this workspace.
    pub fn path<T: Elem>(&self) -> ChunkedPath {
        if T::SUFFIX == "bf16" {
            self.force.unwrap_or(ChunkedPath::TensorCores)
        } else {
            ChunkedPath::Simt
        }
    }

    fn ensure(gpu: &Gpu, slot: &mut Option<CudaSlice<f32>>, n: usize) -> Result<()> {
        if slot.as_ref().is_none_or(|b| b.len() < n) {
            *slot = None;
            // SAFETY: every element the kernels read is written first in the same call.
            *slot = Some(unsafe { gpu.stream().alloc::<f32>(n.max(1)) }?);
        }
        Ok(())
    }
}

/// Sets `trans` (`[hv, dk, dk]`) to `hv` identity matrices.
pub fn set_identity(gpu: &Gpu, trans: &mut CudaSlice<f32>, hv: usize, dk: usize) -> Result<()> {
    check_len("trans [Hv,dk,dk]", trans, hv * dk * dk)?;
    let n = hv * dk * dk;
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(&GDR, "set_identity", 0)?;
    let cfg = LaunchConfig {
        grid_dim: (grid_for(n, 256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (h, k) = (hv as i32, dk as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(trans).arg(&h).arg(&k);
    // SAFETY: matches `set_identity` in gdr.cu; length checked.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Chunked WY prefill (chunk 64) from the initial `state` (updated in place to the
/// final state), writing `out`. Requires `dk = dv = 128` ([`PREFILL_DIM`]).
///
/// `trans`: when given (`[Hv, dk, dk]`), it is left-multiplied by this segment's
/// transition: `trans ← T_C · trans`. Set it to the identity first
/// ([`set_identity`], or use [`chunked_with_transition`]) to obtain `T_C` itself,
/// as `mixers::gated_deltanet::chunked_with_transition` does. `T_C` is computed as extra column
/// blocks of the sequential state kernel (a state with zero writes), so it adds
/// `dk/dv` of that kernel's work and nothing to the other two.
///
/// Three launches on [`Gpu::stream`]: prep (grid NT×Hv), the sequential state stage
/// (grid Hv × column blocks of the state [and of `trans`]), output (grid NT×Hv). The
/// kernels are chosen by [`Workspace::path`]: f32 inputs run the fp32 SIMT kernels of
/// kernels/gdr.cu; bf16 inputs run the tensor-core kernels of kernels/gdr_tc.cu
/// (bf16 operands, fp32 accumulation and fp32 state, `T_C` included), whose results
/// differ from the fp32 kernels by bf16 rounding of intermediates (relative L2 error
/// 2–5e-3 on output and state up to T = 4096 in the host emulation, against ~1e-3 of
/// bf16 output rounding alone; `T_C` ~1e-2 at T = 4096). The tensor-core path takes at
/// most [`TC_MAX_CHUNKS`] chunks per call ([`CudaError::Shape`] beyond).
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
    ws: &mut Workspace,
) -> Result<()> {
    chunked_impl(gpu, d, q, k, v, g, beta, state, out, trans, ws, None)
}

/// [`chunked`] timed per stage with CUDA events: returns the milliseconds of
/// (A `gdr_prep`, B `gdr_state`, C `gdr_output`). Waits for the stream. For
/// benchmarks (profiling the sequential stage against the parallel ones).
#[allow(clippy::too_many_arguments)]
pub fn chunked_stage_ms<T: Elem>(
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
    ws: &mut Workspace,
) -> Result<[f32; 3]> {
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let ctx = gpu.context();
    let mut ev = [
        ctx.new_event(flags)?,
        ctx.new_event(flags)?,
        ctx.new_event(flags)?,
        ctx.new_event(flags)?,
    ];
    chunked_impl(
        gpu,
        d,
        q,
        k,
        v,
        g,
        beta,
        state,
        out,
        trans,
        ws,
        Some(&mut ev),
    )?;
    ev[3].synchronize()?;
    Ok([
        ev[0].elapsed_ms(&ev[1])?,
        ev[1].elapsed_ms(&ev[2])?,
        ev[2].elapsed_ms(&ev[3])?,
    ])
}

#[allow(clippy::too_many_arguments)]
fn chunked_impl<T: Elem>(
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
    ws: &mut Workspace,
    mut marks: Option<&mut [cudarc::driver::CudaEvent; 4]>,
) -> Result<()> {
    check_inputs(d, q, k, v, g, beta, state, out)?;
    if d.dk != PREFILL_DIM || d.dv != PREFILL_DIM {
        return Err(CudaError::Shape(format!(
            "chunked GDR prefill is built for dk = dv = {PREFILL_DIM}, got dk {} dv {}",
            d.dk, d.dv
        )));
    }
    if let Some(t) = trans.as_deref() {
        check_len("trans [Hv,dk,dk]", t, d.hv * d.dk * d.dk)?;
    }
    if d.t == 0 || d.hv == 0 {
        return Ok(());
    }
    if ws.path::<T>() == ChunkedPath::TensorCores {
        return chunked_tc(gpu, d, q, k, v, g, beta, state, out, trans, ws, marks);
    }
    let nt = d.t.div_ceil(CHUNK);
    Workspace::ensure(gpu, &mut ws.gcum, d.hv * d.t)?;
    Workspace::ensure(gpu, &mut ws.w, d.hv * d.t * d.dk)?;
    Workspace::ensure(gpu, &mut ws.u, d.hv * d.t * d.dv)?;
    Workspace::ensure(gpu, &mut ws.hs, nt * d.hv * d.dk * d.dv)?;
    let (gcum, w, u, hs) = (
        ws.gcum.as_mut().expect("allocated"),
        ws.w.as_mut().expect("allocated"),
        ws.u.as_mut().expect("allocated"),
        ws.hs.as_mut().expect("allocated"),
    );
    let (t, hk, hv) = (d.t as i32, d.hk as i32, d.hv as i32);
    let sfx = T::SUFFIX;
    let mut mark = |i: usize| -> Result<()> {
        if let Some(m) = marks.as_deref_mut() {
            m[i].record(gpu.stream())?;
        }
        Ok(())
    };
    mark(0)?;
    // A: intra-chunk WY factors.
    let f = gpu.function(&GDR, &format!("gdr_prep_{sfx}"), SMEM_PREP)?;
    let cfg = LaunchConfig {
        grid_dim: (nt as u32, d.hv as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: SMEM_PREP,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(k)
        .arg(v)
        .arg(g)
        .arg(beta)
        .arg(&mut *gcum)
        .arg(&mut *w)
        .arg(&mut *u)
        .arg(&t)
        .arg(&hk)
        .arg(&hv);
    // SAFETY: matches `gdr_prep_*`; buffers sized above.
    unsafe { b.launch(cfg) }?;
    mark(1)?;
    // B: sequential over chunks.
    let nvb = d.dv / 32 + if trans.is_some() { d.dk / 32 } else { 0 };
    let f = gpu.function(&GDR, &format!("gdr_state_{sfx}"), SMEM_STATE)?;
    let cfg = LaunchConfig {
        grid_dim: (d.hv as u32, nvb as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: SMEM_STATE,
    };
    let null: u64 = 0;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(k).arg(&*gcum).arg(&*w).arg(&mut *u).arg(state);
    match trans {
        Some(tr) => b.arg(tr),
        None => b.arg(&null),
    };
    b.arg(&mut *hs).arg(&t).arg(&hk).arg(&hv);
    // SAFETY: matches `gdr_state_*`; buffers sized above.
    unsafe { b.launch(cfg) }?;
    mark(2)?;
    // C: outputs.
    let f = gpu.function(&GDR, &format!("gdr_output_{sfx}"), SMEM_OUT)?;
    let cfg = LaunchConfig {
        grid_dim: (nt as u32, d.hv as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: SMEM_OUT,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(q)
        .arg(k)
        .arg(&*gcum)
        .arg(&*u)
        .arg(&*hs)
        .arg(out)
        .arg(&t)
        .arg(&hk)
        .arg(&hv);
    // SAFETY: matches `gdr_output_*`; buffers sized above.
    unsafe { b.launch(cfg) }?;
    mark(3)?;
    Ok(())
}

// Dynamic shared memory of the tensor-core kernels (TC_*_SMEM in gdr_tc.cu).
const TC_LD: usize = PREFILL_DIM + 8;
/// fp32 row stride of L / M in `gdr_prep_tc2_bf16` (TC_MLD).
const TC_MLD: usize = CHUNK + 8;
const SMEM_PREP2_TC: u32 = (2 * CHUNK * TC_LD * 2 + CHUNK * TC_MLD * 4 + 3 * CHUNK * 4) as u32;
/// Ring stages of the tensor-core state kernel (TC_STAGES).
const TC_STAGES: usize = 3;
/// Shared memory of the state kernel for `bv` value columns per block: TC_STAGES ·
/// TC_STAGE_U4(bv/16) · 16 bytes.
fn smem_state_tc(bv: usize) -> u32 {
    (TC_STAGES * (2048 + bv / 16 * 128 + 1) * 16) as u32
}
const SMEM_OUT_TC: u32 = (2 * CHUNK * TC_LD * 2 + CHUNK * 4) as u32;
/// Bytes of one fragment-tiled 64×128 bf16 matrix, as f32 elements.
const TILE_F32: usize = CHUNK * PREFILL_DIM / 2;

/// The tensor-core path of [`chunked`] (bf16 `T` only; shapes checked by the caller).
/// Three launches: `gdr_prep_tc2_bf16` (grid Hv×NT, 256 threads), `gdr_state_tc_bf16_32`
/// (grid Hv×(dv [+ dk])/32, 64 threads), `gdr_output_tc2_bf16` (as prep). More than
/// [`TC_MAX_CHUNKS`] chunks → [`CudaError::Shape`].
#[allow(clippy::too_many_arguments)]
fn chunked_tc<T: Elem>(
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
    ws: &mut Workspace,
    mut marks: Option<&mut [cudarc::driver::CudaEvent; 4]>,
) -> Result<()> {
    debug_assert_eq!(T::SUFFIX, "bf16");
    let nt = d.t.div_ceil(CHUNK);
    if nt > TC_MAX_CHUNKS {
        return Err(CudaError::Shape(format!(
            "GDR tensor-core prefill: T = {} is {nt} chunks of {CHUNK}, at most {TC_MAX_CHUNKS} \
             per call (split the span)",
            d.t
        )));
    }
    let tiles = nt * d.hv;
    Workspace::ensure(gpu, &mut ws.gcum, tiles * CHUNK)?;
    Workspace::ensure(gpu, &mut ws.w, tiles * TILE_F32)?;
    Workspace::ensure(gpu, &mut ws.kt, tiles * TILE_F32)?;
    Workspace::ensure(gpu, &mut ws.u, tiles * TILE_F32)?;
    Workspace::ensure(gpu, &mut ws.hs, tiles * 2 * TILE_F32)?;
    let (gcum, w, kt, u, hs) = (
        ws.gcum.as_mut().expect("allocated"),
        ws.w.as_mut().expect("allocated"),
        ws.kt.as_mut().expect("allocated"),
        ws.u.as_mut().expect("allocated"),
        ws.hs.as_mut().expect("allocated"),
    );
    let (t, hk, hv) = (d.t as i32, d.hk as i32, d.hv as i32);
    let mut mark = |i: usize| -> Result<()> {
        if let Some(m) = marks.as_deref_mut() {
            m[i].record(gpu.stream())?;
        }
        Ok(())
    };
    mark(0)?;
    // A: per chunk G, W, K̃ᵀ, Uᵀ; grid (Hv, NT) (value heads fastest).
    let f = gpu.function(&GDR_TC, "gdr_prep_tc2_bf16", SMEM_PREP2_TC)?;
    let cfg = LaunchConfig {
        grid_dim: (d.hv as u32, nt as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: SMEM_PREP2_TC,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(k)
        .arg(v)
        .arg(g)
        .arg(beta)
        .arg(&mut *gcum)
        .arg(&mut *w)
        .arg(&mut *kt)
        .arg(&mut *u)
        .arg(&t)
        .arg(&hk)
        .arg(&hv);
    // SAFETY: matches `gdr_prep_tc2_bf16`; T is bf16 (path selection), buffers sized
    // above, nt ≤ 65 535 (grid y).
    unsafe { b.launch(cfg) }?;
    mark(1)?;
    // B: sequential over chunks.
    let ncols = d.dv + if trans.is_some() { d.dk } else { 0 };
    let smem = smem_state_tc(STATE_BV);
    let f = gpu.function(&GDR_TC, "gdr_state_tc_bf16_32", smem)?;
    let cfg = LaunchConfig {
        grid_dim: (d.hv as u32, (ncols / STATE_BV) as u32, 1),
        block_dim: (2 * STATE_BV as u32, 1, 1),
        shared_mem_bytes: smem,
    };
    let null: u64 = 0;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&*w).arg(&*kt).arg(&mut *u).arg(&*gcum).arg(state);
    match trans {
        Some(tr) => b.arg(tr),
        None => b.arg(&null),
    };
    b.arg(&mut *hs).arg(&t);
    // SAFETY: matches `gdr_state_tc_bf16_32`; buffers sized above.
    unsafe { b.launch(cfg) }?;
    mark(2)?;
    // C: outputs; grid (Hv, NT) (value heads fastest).
    let f = gpu.function(&GDR_TC, "gdr_output_tc2_bf16", SMEM_OUT_TC)?;
    let cfg = LaunchConfig {
        grid_dim: (d.hv as u32, nt as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: SMEM_OUT_TC,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(q)
        .arg(k)
        .arg(&*gcum)
        .arg(&*u)
        .arg(&*hs)
        .arg(out)
        .arg(&t)
        .arg(&hk)
        .arg(&hv);
    // SAFETY: matches `gdr_output_tc2_bf16`; buffers sized above, nt ≤ 65 535 (grid y).
    unsafe { b.launch(cfg) }?;
    mark(3)?;
    Ok(())
}

/// [`chunked`] that also returns the segment transition `T_C` in `trans`
/// (`[Hv, dk, dk]`, overwritten): `S_final = T_C S_initial + S_{C|0}`.
#[allow(clippy::too_many_arguments)]
pub fn chunked_with_transition<T: Elem>(
    gpu: &Gpu,
    d: &GdrDims,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    g: &CudaSlice<f32>,
    beta: &CudaSlice<f32>,
    state: &mut CudaSlice<f32>,
    out: &mut CudaSlice<T>,
    trans: &mut CudaSlice<f32>,
    ws: &mut Workspace,
) -> Result<()> {
    set_identity(gpu, trans, d.hv, d.dk)?;
    chunked(gpu, d, q, k, v, g, beta, state, out, Some(trans), ws)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_selected_by_element_type() {
        let mut ws = Workspace::new();
        ws.force_path(None);
        assert_eq!(ws.path::<half::bf16>(), ChunkedPath::TensorCores);
        assert_eq!(ws.path::<f32>(), ChunkedPath::Simt);
        ws.force_path(Some(ChunkedPath::Simt));
        assert_eq!(ws.path::<half::bf16>(), ChunkedPath::Simt);
        // f32 inputs have no tensor-core kernels.
        ws.force_path(Some(ChunkedPath::TensorCores));
        assert_eq!(ws.path::<f32>(), ChunkedPath::Simt);
    }

    #[test]
    fn tensor_core_shared_memory_sizes() {
        // TC_PREP2_SMEM, TC_OUT_SMEM and the state kernel's ring of kernels/gdr_tc.cu,
        // all within the 227 KiB a block may use on H100/H200.
        // gdr_prep_tc2_bf16: four blocks per SM (its ≤ 64 registers allow them too).
        assert_eq!(SMEM_PREP2_TC, 54_016);
        assert!(4 * (SMEM_PREP2_TC as usize + 1024) <= 228 * 1024);
        assert_eq!(SMEM_OUT_TC, 35_072);
        assert_eq!(smem_state_tc(STATE_BV), 3 * 2305 * 16);
        // BV = 32: two blocks per SM (228 KiB per SM, 1 KiB reserved per block), so the
        // 256 blocks of Hv = 32 with T_C run in one wave on 132 SMs.
        assert!(2 * (smem_state_tc(32) as usize + 1024) <= 228 * 1024);
        assert_eq!(TILE_F32 * 4, 16 * 1024);
    }
}
