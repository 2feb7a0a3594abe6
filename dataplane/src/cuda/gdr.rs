//! Gated delta rule on the GPU: one-token (or any-length) recurrent decode and the
//! chunked WY prefill from an initial state, optionally producing the segment's dense
//! transition `T_C`. CPU references: `linear::gdr::{recurrent, chunked,
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
use crate::linear::gdr::GdrDims;

/// Chunk length of the GPU prefill (fixed, as FLA's default).
pub const CHUNK: usize = 64;
/// The key and value head dims the chunked prefill is built for (Qwen3-Next/3.5, Kimi).
pub const PREFILL_DIM: usize = 128;

const LDX: usize = 2 * PREFILL_DIM + 1;
const LDT: usize = PREFILL_DIM + 4;
const SMEM_PREP: u32 = ((CHUNK * LDX + CHUNK * CHUNK + 3 * CHUNK) * 4) as u32;
const SMEM_STATE: u32 = ((2 * CHUNK * LDT + PREFILL_DIM * 32 + CHUNK * 32 + CHUNK) * 4) as u32;
const SMEM_OUT: u32 = ((2 * CHUNK * LDT + CHUNK * (CHUNK + 1) + CHUNK) * 4) as u32;

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
    if d.hk == 0 || !d.hv.is_multiple_of(d.hk) {
        return Err(CudaError::Shape(format!(
            "Hv {} must be a multiple of Hk {}",
            d.hv, d.hk
        )));
    }
    check_len("q [T,Hk,dk]", q, d.t * d.hk * d.dk)?;
    check_len("k [T,Hk,dk]", k, d.t * d.hk * d.dk)?;
    check_len("v [T,Hv,dv]", v, d.t * d.hv * d.dv)?;
    check_len("g [T,Hv]", g, d.t * d.hv)?;
    check_len("beta [T,Hv]", beta, d.t * d.hv)?;
    check_len("state [Hv,dk,dv]", state, d.state_len())?;
    check_len("o [T,Hv,dv]", out, d.t * d.hv * d.dv)
}

/// Token-by-token recurrence (the decode kernel; any `T`, one token per step).
/// `dk` ∈ {64, 128, 256}, any `dv`. Same contract as `linear::gdr::recurrent`.
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
    if ![64, 128, 256].contains(&d.dk) {
        return Err(CudaError::Shape(format!(
            "recurrent GDR kernel: dk {} not in {{64, 128, 256}}",
            d.dk
        )));
    }
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

/// Which kernels [`chunked`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkedPath {
    /// fp32 SIMT kernels (`gdr_prep/state/output_{f32,bf16}` in `kernels/gdr.cu`): the
    /// path of f32 inputs; bf16 inputs are widened to fp32 on load.
    Simt,
    /// bf16 tensor-core kernels (`kernels/gdr_tc.cu`); bf16 inputs only.
    TensorCores,
}

/// Value columns per block of the tensor-core state kernel that are built (16 per warp):
/// 32 (2 warps; Hv·dv/32 blocks, 128 at Hv = 32) or 64 (4 warps; half the blocks, half
/// the L2 → shared-memory traffic for W and K̃, twice the shared-memory reads per SM).
pub const STATE_BV: [usize; 2] = [32, 64];
/// Default of [`Workspace::set_state_bv`].
pub const DEFAULT_STATE_BV: usize = 32;
/// State block width of the split state kernel (`gdr_state_tc_bf16_32s`,
/// [`Workspace::set_state_split`]).
pub const STATE_SPLIT_BV: usize = 32;
/// Versions of the tensor-core prep kernel (stage A) that are built: 1
/// `gdr_prep_tc_bf16` (72 KiB shared memory, 3 blocks per SM; M solved in fp32 SIMT),
/// 2 `gdr_prep_tc2_bf16` (53 KiB, ≤ 64 registers, 4 blocks per SM; M solved in place,
/// off-diagonal blocks on tensor cores with hi/lo-split bf16 operands). Same outputs up
/// to bf16 rounding of `M diag(·)`.
pub const PREP_KERNELS: [usize; 2] = [1, 2];
/// Default of [`Workspace::set_prep_kernel`].
pub const DEFAULT_PREP_KERNEL: usize = 2;
/// Versions of the tensor-core output kernel (stage C) that are built: 1
/// `gdr_output_tc_bf16` (128 registers, 2 blocks per SM; warp = 16 rows × 64 columns),
/// 2 `gdr_output_tc2_bf16` (≤ 64 registers, 4 blocks per SM; P once per block in shared
/// memory, warp = 64 rows × 16 columns). Same arithmetic, bit-identical outputs.
pub const OUTPUT_KERNELS: [usize; 2] = [1, 2];
/// Default of [`Workspace::set_output_kernel`].
pub const DEFAULT_OUTPUT_KERNEL: usize = 2;

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
///
/// A new workspace takes its defaults from the environment, for A/B runs of a built
/// binary: `HYPIC_GDR_KERNELS=simt` forces the SIMT kernels (anything else: automatic),
/// `HYPIC_GDR_STATE_BV=32|64` sets [`Workspace::set_state_bv`], `HYPIC_GDR_PREP=1|2`
/// [`Workspace::set_prep_kernel`], `HYPIC_GDR_OUTPUT=1|2` [`Workspace::set_output_kernel`],
/// `HYPIC_GDR_STATE_SPLIT=1` [`Workspace::set_state_split`].
pub struct Workspace {
    gcum: Option<CudaSlice<f32>>,
    w: Option<CudaSlice<f32>>,
    u: Option<CudaSlice<f32>>,
    hs: Option<CudaSlice<f32>>,
    kt: Option<CudaSlice<f32>>,
    force: Option<ChunkedPath>,
    state_bv: usize,
    prep: usize,
    output: usize,
    state_split: bool,
}

impl Default for Workspace {
    fn default() -> Self {
        let force = match std::env::var("HYPIC_GDR_KERNELS").as_deref() {
            Ok("simt") => Some(ChunkedPath::Simt),
            _ => None,
        };
        let state_bv = std::env::var("HYPIC_GDR_STATE_BV")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|b| STATE_BV.contains(b))
            .unwrap_or(DEFAULT_STATE_BV);
        let prep = std::env::var("HYPIC_GDR_PREP")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|p| PREP_KERNELS.contains(p))
            .unwrap_or(DEFAULT_PREP_KERNEL);
        let output = std::env::var("HYPIC_GDR_OUTPUT")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|p| OUTPUT_KERNELS.contains(p))
            .unwrap_or(DEFAULT_OUTPUT_KERNEL);
        let state_split = std::env::var("HYPIC_GDR_STATE_SPLIT").as_deref() == Ok("1");
        Workspace {
            gcum: None,
            w: None,
            u: None,
            hs: None,
            kt: None,
            force,
            state_bv,
            prep,
            output,
            state_split,
        }
    }
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
    /// SIMT for f32). f32 inputs always run on the SIMT kernels.
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

    /// Value columns per block of the tensor-core state kernel, one of [`STATE_BV`].
    pub fn set_state_bv(&mut self, bv: usize) -> Result<()> {
        if !STATE_BV.contains(&bv) {
            return Err(CudaError::Shape(format!(
                "state kernel block of {bv} value columns: built for {STATE_BV:?}"
            )));
        }
        self.state_bv = bv;
        Ok(())
    }

    /// Value columns per block of the tensor-core state kernel.
    pub fn state_bv(&self) -> usize {
        self.state_bv
    }

    /// Version of the tensor-core prep kernel, one of [`PREP_KERNELS`].
    pub fn set_prep_kernel(&mut self, version: usize) -> Result<()> {
        if !PREP_KERNELS.contains(&version) {
            return Err(CudaError::Shape(format!(
                "GDR prep kernel version {version}: built are {PREP_KERNELS:?}"
            )));
        }
        self.prep = version;
        Ok(())
    }

    /// Version of the tensor-core prep kernel.
    pub fn prep_kernel(&self) -> usize {
        self.prep
    }

    /// Version of the tensor-core output kernel, one of [`OUTPUT_KERNELS`].
    pub fn set_output_kernel(&mut self, version: usize) -> Result<()> {
        if !OUTPUT_KERNELS.contains(&version) {
            return Err(CudaError::Shape(format!(
                "GDR output kernel version {version}: built are {OUTPUT_KERNELS:?}"
            )));
        }
        self.output = version;
        Ok(())
    }

    /// Version of the tensor-core output kernel.
    pub fn output_kernel(&self) -> usize {
        self.output
    }

    /// With state block width [`STATE_SPLIT_BV`]: run `gdr_state_tc_bf16_32s` (4 warps
    /// per block, each 16 state columns × half the state rows: half the mma per warp and
    /// chunk, two more barriers) instead of `gdr_state_tc_bf16_32` (2 warps). No effect
    /// with other widths. Default off (`HYPIC_GDR_STATE_SPLIT=1` turns it on).
    pub fn set_state_split(&mut self, split: bool) {
        self.state_split = split;
    }

    /// Whether the state kernel runs split ([`Workspace::set_state_split`]) — true only
    /// when set and the width is [`STATE_SPLIT_BV`].
    pub fn state_split(&self) -> bool {
        self.state_split && self.state_bv == STATE_SPLIT_BV
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
/// as `linear::gdr::chunked_with_transition` does. `T_C` is computed as extra column
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
/// bf16 output rounding alone; `T_C` ~1e-2 at T = 4096).
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
const TC_ALD: usize = CHUNK + 8;
const SMEM_PREP_TC: u32 = (2 * CHUNK * TC_LD * 2
    + 2 * CHUNK * TC_ALD * 2
    + CHUNK * (CHUNK + 1) * 4
    + 3 * 256 * 4
    + 3 * CHUNK * 4) as u32;
/// fp32 row stride of L / M in `gdr_prep_tc2_bf16` (TC_MLD).
const TC_MLD: usize = CHUNK + 8;
const SMEM_PREP2_TC: u32 = (2 * CHUNK * TC_LD * 2 + CHUNK * TC_MLD * 4 + 3 * CHUNK * 4) as u32;
/// Ring stages of the tensor-core state kernel (TC_STAGES).
const TC_STAGES: usize = 3;
/// Shared memory of `gdr_state_tc_bf16_{bv}`: TC_STAGES · TC_STAGE_U4(bv/16) · 16 bytes.
fn smem_state_tc(bv: usize) -> u32 {
    (TC_STAGES * (2048 + bv / 16 * 128 + 1) * 16) as u32
}
const SMEM_OUT_TC: u32 = (2 * CHUNK * TC_LD * 2 + CHUNK * 4) as u32;
/// Bytes of one fragment-tiled 64×128 bf16 matrix, as f32 elements.
const TILE_F32: usize = CHUNK * PREFILL_DIM / 2;

/// The tensor-core path of [`chunked`] (bf16 `T` only; shapes checked by the caller).
/// Three launches: `gdr_prep_tc{,2}_bf16` (grid NT×Hv, version 2 Hv×NT; 256 threads;
/// [`Workspace::set_prep_kernel`]), `gdr_state_tc_bf16_{BV}[s]` (grid Hv×(dv [+ dk])/BV,
/// 2·BV threads, split 4·BV), `gdr_output_tc{,2}_bf16` (as prep; 256 threads;
/// [`Workspace::set_output_kernel`]).
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
    let tiles = nt * d.hv;
    Workspace::ensure(gpu, &mut ws.gcum, tiles * CHUNK)?;
    Workspace::ensure(gpu, &mut ws.w, tiles * TILE_F32)?;
    Workspace::ensure(gpu, &mut ws.kt, tiles * TILE_F32)?;
    Workspace::ensure(gpu, &mut ws.u, tiles * TILE_F32)?;
    Workspace::ensure(gpu, &mut ws.hs, tiles * 2 * TILE_F32)?;
    let (bv, split) = (ws.state_bv, ws.state_split());
    // Version 2 of prep / output puts the chunks on grid y (at most 65535: T ≤ 4.19M);
    // longer sequences run version 1.
    let (prep, output) = if nt > 65_535 {
        (1, 1)
    } else {
        (ws.prep, ws.output)
    };
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
    // A: per chunk G, W, K̃ᵀ, Uᵀ (both versions: same arguments and outputs).
    // Grids: version 1 (NT, Hv), version 2 (Hv, NT) (value heads fastest).
    let (name, smem, grid) = match prep {
        1 => (
            "gdr_prep_tc_bf16",
            SMEM_PREP_TC,
            (nt as u32, d.hv as u32, 1),
        ),
        _ => (
            "gdr_prep_tc2_bf16",
            SMEM_PREP2_TC,
            (d.hv as u32, nt as u32, 1),
        ),
    };
    let f = gpu.function(&GDR_TC, name, smem)?;
    let cfg = LaunchConfig {
        grid_dim: grid,
        block_dim: (256, 1, 1),
        shared_mem_bytes: smem,
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
    // SAFETY: matches `gdr_prep_tc_bf16` / `gdr_prep_tc2_bf16`; T is bf16 (path
    // selection), buffers sized above.
    unsafe { b.launch(cfg) }?;
    mark(1)?;
    // B: sequential over chunks.
    let ncols = d.dv + if trans.is_some() { d.dk } else { 0 };
    let smem = smem_state_tc(bv);
    let (name, threads) = if split {
        (format!("gdr_state_tc_bf16_{bv}s"), 4 * bv)
    } else {
        (format!("gdr_state_tc_bf16_{bv}"), 2 * bv)
    };
    let f = gpu.function(&GDR_TC, &name, smem)?;
    let cfg = LaunchConfig {
        grid_dim: (d.hv as u32, (ncols / bv) as u32, 1),
        block_dim: (threads as u32, 1, 1),
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
    // SAFETY: matches `gdr_state_tc_bf16_*` (`_32s`: same arguments and ring); buffers
    // sized above.
    unsafe { b.launch(cfg) }?;
    mark(2)?;
    // C: outputs (both versions: same arguments, shared memory and output).
    // Grids: version 1 (NT, Hv), version 2 (Hv, NT) (value heads fastest).
    let (name, grid) = match output {
        1 => ("gdr_output_tc_bf16", (nt as u32, d.hv as u32, 1)),
        _ => ("gdr_output_tc2_bf16", (d.hv as u32, nt as u32, 1)),
    };
    let f = gpu.function(&GDR_TC, name, SMEM_OUT_TC)?;
    let cfg = LaunchConfig {
        grid_dim: grid,
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
    // SAFETY: matches `gdr_output_tc_bf16` / `gdr_output_tc2_bf16`; buffers sized above.
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
        ws.set_state_bv(DEFAULT_STATE_BV).unwrap();
        assert_eq!(ws.path::<half::bf16>(), ChunkedPath::TensorCores);
        assert_eq!(ws.path::<f32>(), ChunkedPath::Simt);
        ws.force_path(Some(ChunkedPath::Simt));
        assert_eq!(ws.path::<half::bf16>(), ChunkedPath::Simt);
        // f32 inputs have no tensor-core kernels.
        ws.force_path(Some(ChunkedPath::TensorCores));
        assert_eq!(ws.path::<f32>(), ChunkedPath::Simt);
        assert_eq!(ws.state_bv(), DEFAULT_STATE_BV);
        ws.set_state_bv(64).unwrap();
        assert_eq!(ws.state_bv(), 64);
        assert!(ws.set_state_bv(48).is_err());
        assert_eq!(ws.state_bv(), 64);
        ws.set_prep_kernel(1).unwrap();
        assert_eq!(ws.prep_kernel(), 1);
        assert!(ws.set_prep_kernel(3).is_err());
        assert_eq!(ws.prep_kernel(), 1);
        assert!(PREP_KERNELS.contains(&DEFAULT_PREP_KERNEL));
        ws.set_output_kernel(1).unwrap();
        assert_eq!(ws.output_kernel(), 1);
        assert!(ws.set_output_kernel(0).is_err());
        assert_eq!(ws.output_kernel(), 1);
        assert!(OUTPUT_KERNELS.contains(&DEFAULT_OUTPUT_KERNEL));
        ws.set_state_split(true);
        assert!(!ws.state_split()); // BV 64
        ws.set_state_bv(STATE_SPLIT_BV).unwrap();
        assert!(ws.state_split());
    }

    #[test]
    fn tensor_core_shared_memory_sizes() {
        // TC_PREP_SMEM, TC_OUT_SMEM and the state kernel's ring of kernels/gdr_tc.cu,
        // all within the 227 KiB a block may use on H100/H200.
        assert_eq!(SMEM_PREP_TC, 73_728);
        // gdr_prep_tc2_bf16: four blocks per SM (its ≤ 64 registers allow them too).
        assert_eq!(SMEM_PREP2_TC, 54_016);
        assert!(4 * (SMEM_PREP2_TC as usize + 1024) <= 228 * 1024);
        assert_eq!(SMEM_OUT_TC, 35_072); // both output kernels
        assert_eq!(smem_state_tc(32), 3 * 2305 * 16);
        assert_eq!(smem_state_tc(64), 3 * 2561 * 16);
        assert!(STATE_BV.iter().all(|&b| smem_state_tc(b) <= 227 * 1024));
        // BV = 32: two blocks per SM (228 KiB per SM, 1 KiB reserved per block), so the
        // 256 blocks of Hv = 32 with T_C run in one wave on 132 SMs.
        assert!(2 * (smem_state_tc(32) as usize + 1024) <= 228 * 1024);
        assert_eq!(TILE_F32 * 4, 16 * 1024);
    }
}
