//! Kimi Delta Attention recurrences on the device (`kernels/kda.cu`), the GPU
//! counterparts of `mixers::kda::{naive, chunk}`:
//!
//! * [`recurrent`]: token by token, one thread per state column (the GPU reference,
//!   and the decode step);
//! * [`chunked`]: the chunked WY prefill with per-channel decays, one block per value
//!   head, which also left-multiplies a transition buffer by the span's `T_C` in the
//!   same pass (the PIC cache build);
//! * [`chunked_tc`]: the chunked prefill on tensor cores (`kernels/kda_tc.cu`) for bf16
//!   inputs with `dk = dv = 128`, three launches per call (no transition).
//!
//! All take the layouts of `mixers::kda` ([`GdrDims`]): `q, k [T, Hk, dk]` in `T`
//! (L2-normalised, q scaled by `dk^-½`), `v [T, Hv, dv]` in `T`, per-channel log
//! decays `g [T, Hv, dk]` fp32 (≤ 0), `beta [T, Hv]` fp32, state `[Hv, dk, dv]` fp32
//! K-major (advanced in place), output `[T, Hv, dv]` in `T`. Value head `h` reads key
//! head `h / (Hv/Hk)`. Tests: `dataplane/tests/cuda_kimi.rs` (each kernel against the
//! CPU `naive`/`chunk` and against each other).
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::compile::{KDA, KDA_TC};
use super::{check_align16, check_len, dim_i32, shape_err, CudaSlice, Elem, Gpu, Result, Scratch};
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

/// Head size of [`chunked_tc`] (`dk = dv`, `KT_D` in kda_tc.cu).
pub const TC_DIM: usize = 128;
/// Most chunks of [`chunked_tc`]: its prep and output kernels put the chunks on grid y
/// (T ≤ 65 535 · [`CHUNK`] tokens per call).
pub const TC_MAX_CHUNKS: usize = 65_535;
/// Tokens per launch group of [`chunked_tc`]: its scratch holds one slab's chunks
/// (`Hv · TC_SLAB/64 · 80.5 KiB`).
pub const TC_SLAB: usize = 4096;
/// Value columns per block of `kda_state_tc_bf16` (2 warps of 16; grid Hv × 4).
const TC_STATE_BV: usize = 32;
// Dynamic shared memory of the three kernels (KT_PREP_SMEM, KT_STATE_SMEM, KT_OUT_SMEM
// in kda_tc.cu): bf16 64×136 staging tiles, the fp32 64×136 G tile, the fp32 64×72 L / M
// tile and β; the 3-stage ring of W | K̃ᵀ | Uᵀ slice | e^{G_last} (uint4 units); P bf16
// 64×72.
const TC_LD: usize = TC_DIM + 8;
const TC_CH: usize = 64;
const SMEM_PREP_TC: u32 =
    (2 * TC_CH * TC_LD * 2 + TC_CH * TC_LD * 4 + TC_CH * (TC_CH + 8) * 4 + TC_CH * 4) as u32;
const SMEM_STATE_TC: u32 = (3 * (2048 + TC_STATE_BV / 16 * 128 + 32) * 16) as u32;
const SMEM_OUT_TC: u32 =
    (2 * TC_CH * TC_LD * 2 + TC_CH * TC_LD * 4 + TC_CH * (TC_CH + 8) * 2) as u32;
/// f32 elements of one fragment-tiled 64×128 bf16 matrix (16 KiB).
const TILE_F32: usize = TC_CH * TC_DIM / 2;

/// Whether the forward runs its KDA spans on [`chunked_tc`] where it applies (bf16,
/// `dk = dv = 128`, spans of ≥ [`CHUNKED_MIN_TOKENS`] tokens without a transition): on
/// unless the environment sets `HYPIC_CUDA_KDA_TC=0` (or `off`, `false`, `no`; then
/// [`chunked`]). Read once.
pub fn tc_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("HYPIC_CUDA_KDA_TC").map_or(true, |v| {
            !matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "0" | "off" | "false" | "no"
            )
        })
    })
}

/// Whether [`chunked_tc`] takes these dimensions and element type (bf16, `dk = dv =`
/// [`TC_DIM`], at most [`TC_MAX_CHUNKS`] chunks).
pub fn tc_applies<T: Elem>(d: &GdrDims) -> bool {
    T::SUFFIX == "bf16" && d.dk == TC_DIM && d.dv == TC_DIM && d.t.div_ceil(TC_CH) <= TC_MAX_CHUNKS
}

/// Chunked KDA on tensor cores (`kernels/kda_tc.cu`) from `state` (advanced in place);
/// writes `out`. Same contract and layouts as [`chunked`] without a transition: `q, k
/// [T, Hk, 128]` bf16 (L2-normalised, q scaled by `128^-½`), `v [T, Hv, 128]` bf16,
/// per-channel natural-log decays `g [T, Hv, 128]` fp32 (≤ 0), `beta [T, Hv]` fp32,
/// state `[Hv, 128, 128]` fp32 K-major, `out [T, Hv, 128]` bf16; value head `h` reads
/// key head `h / (Hv/Hk)`. bf16 operands with fp32 accumulation and an fp32 state: the
/// output and the final state agree with the fp64 recurrence to bf16 noise (relative L2
/// error a few 10⁻³ in the host emulation, `tools/kernel-emu/run.sh kda-tc`).
///
/// Three launches on chunks of 64 tokens: `kda_prep_tc_bf16` (grid Hv × NT, 256
/// threads), `kda_state_tc_bf16` (grid Hv × 4, 64 threads; sequential over the chunks)
/// and `kda_output_tc_bf16` (as prep), per slab of [`TC_SLAB`] tokens. Scratch from
/// [`Gpu::scratch`]: per (head, chunk of a slab) 80 KiB of bf16 fragment tiles (W, K̃ᵀ,
/// Uᵀ/Ũᵀ, the chunk-initial state) and 512 B of decays — at most
/// `Hv·TC_SLAB/64·80.5 KiB`. q, k, v and g must start at multiples of 16 bytes (16-byte
/// `cp.async` copies).
///
/// Errors: [`CudaError::Shape`] when `T` is not bf16, `dk` or `dv` is not 128, the span
/// has more than [`TC_MAX_CHUNKS`] chunks, a buffer is shorter than `d` needs, q/k/v/g/out
/// are not 16-byte aligned, or `Hv` is not a multiple of `Hk`; driver errors.
///
/// [`CudaError::Shape`]: super::CudaError::Shape
#[allow(clippy::too_many_arguments)]
pub fn chunked_tc<T: Elem>(
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
    if T::SUFFIX != "bf16" || d.dk != TC_DIM || d.dv != TC_DIM {
        return Err(shape_err(format!(
            "KDA tensor-core prefill: bf16 with dk = dv = {TC_DIM} only (got {}, dk {}, dv {})",
            T::SUFFIX,
            d.dk,
            d.dv
        )));
    }
    let nt = d.t.div_ceil(TC_CH);
    if nt > TC_MAX_CHUNKS {
        return Err(shape_err(format!(
            "KDA tensor-core prefill: T = {} is {nt} chunks of {TC_CH}, at most {TC_MAX_CHUNKS} \
             per call",
            d.t
        )));
    }
    if d.t == 0 || d.hv == 0 {
        return Ok(());
    }
    for (n, x) in [("q", q), ("k", k), ("v", v)] {
        check_align16(gpu, n, x)?;
    }
    check_align16(gpu, "g", g)?;
    check_align16(gpu, "out", out)?;
    // Slabs of at most TC_SLAB tokens bound the scratch; the state advances in place
    // from slab to slab (the same result as one call over the span).
    let slab_chunks = nt.min(TC_SLAB / TC_CH);
    let tiles = slab_chunks * d.hv;
    let mut w: Scratch<f32> = gpu.scratch(tiles * TILE_F32)?;
    let mut kt: Scratch<f32> = gpu.scratch(tiles * TILE_F32)?;
    let mut u: Scratch<f32> = gpu.scratch(tiles * TILE_F32)?;
    let mut hs: Scratch<f32> = gpu.scratch(tiles * 2 * TILE_F32)?;
    let mut dl: Scratch<f32> = gpu.scratch(tiles * TC_DIM)?;
    let (hk, hv) = (dim_i32("Hk", d.hk)?, dim_i32("Hv", d.hv)?);
    let fp = gpu.function(&KDA_TC, "kda_prep_tc_bf16", SMEM_PREP_TC)?;
    let fs = gpu.function(&KDA_TC, "kda_state_tc_bf16", SMEM_STATE_TC)?;
    let fo = gpu.function(&KDA_TC, "kda_output_tc_bf16", SMEM_OUT_TC)?;
    let (wk, wv) = (d.hk * TC_DIM, d.hv * TC_DIM);
    let mut a = 0usize;
    while a < d.t {
        let n = TC_SLAB.min(d.t - a);
        let nts = n.div_ceil(TC_CH);
        let t = dim_i32("slab", n)?;
        // Slab views start at a multiple of TC_SLAB rows: still 16-byte aligned.
        let (qs, ks) = (q.slice(a * wk..(a + n) * wk), k.slice(a * wk..(a + n) * wk));
        let vs = v.slice(a * wv..(a + n) * wv);
        let gs = g.slice(a * wv..(a + n) * wv);
        let bs = beta.slice(a * d.hv..(a + n) * d.hv);
        let mut os = out.slice_mut(a * wv..(a + n) * wv);
        // Prep: W, K̃ᵀ, Uᵀ, e^{G_last} per (head, chunk); grid (Hv, NT), value heads fastest.
        let cfg = LaunchConfig {
            grid_dim: (d.hv as u32, nts as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: SMEM_PREP_TC,
        };
        let mut b = gpu.stream().launch_builder(&fp);
        b.arg(&ks)
            .arg(&vs)
            .arg(&gs)
            .arg(&bs)
            .arg(&mut *w)
            .arg(&mut *kt)
            .arg(&mut *u)
            .arg(&mut *dl)
            .arg(&t)
            .arg(&hk)
            .arg(&hv);
        // SAFETY: matches `kda_prep_tc_bf16`; T is bf16 and dk = dv = 128 (checked
        // above), the slab views hold n rows of inputs checked by `check`, scratch sized
        // for slab_chunks ≥ nts chunks per head as kda_tc.cu lays it out, nts ≤ 65 535
        // (grid y).
        unsafe { b.launch(cfg) }?;
        // State: sequential over the chunks; Ũ over U, snapshots into hs.
        let cfg = LaunchConfig {
            grid_dim: (d.hv as u32, (TC_DIM / TC_STATE_BV) as u32, 1),
            block_dim: (2 * TC_STATE_BV as u32, 1, 1),
            shared_mem_bytes: SMEM_STATE_TC,
        };
        let mut b = gpu.stream().launch_builder(&fs);
        b.arg(&*w)
            .arg(&*kt)
            .arg(&mut *u)
            .arg(&*dl)
            .arg(&mut *state)
            .arg(&mut *hs)
            .arg(&t);
        // SAFETY: matches `kda_state_tc_bf16`; buffers sized above, state [Hv, 128, 128].
        unsafe { b.launch(cfg) }?;
        // Output: grid (Hv, NT), value heads fastest.
        let cfg = LaunchConfig {
            grid_dim: (d.hv as u32, nts as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: SMEM_OUT_TC,
        };
        let mut b = gpu.stream().launch_builder(&fo);
        b.arg(&qs)
            .arg(&ks)
            .arg(&gs)
            .arg(&*u)
            .arg(&*hs)
            .arg(&mut os)
            .arg(&t)
            .arg(&hk)
            .arg(&hv);
        // SAFETY: matches `kda_output_tc_bf16`; buffers sized above, nts ≤ 65 535.
        unsafe { b.launch(cfg) }?;
        a += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_core_shared_memory_sizes() {
        // KT_PREP_SMEM, KT_STATE_SMEM, KT_OUT_SMEM of kernels/kda_tc.cu; prep and output
        // two blocks per SM (228 KiB per SM, 1 KiB reserved per block), the state kernel
        // within the 227 KiB a block may use.
        assert_eq!(SMEM_PREP_TC, 88_320);
        assert_eq!(SMEM_STATE_TC, 3 * 2336 * 16);
        assert_eq!(SMEM_OUT_TC, 78_848);
        assert!(2 * (SMEM_PREP_TC as usize + 1024) <= 228 * 1024);
        assert!(2 * (SMEM_OUT_TC as usize + 1024) <= 228 * 1024);
        assert!(SMEM_STATE_TC as usize <= 227 * 1024);
        assert_eq!(TILE_F32 * 4, 16 * 1024);
    }
}
