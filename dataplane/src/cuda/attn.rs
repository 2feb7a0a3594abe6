//! Causal GQA attention prefill over KV placed at arbitrary positions — the seam case
//! of position-independent caching (queries of a recomputed window attend to cached
//! KV that was moved to new positions). CPU reference: `model::attention`.
//!
//! Three implementations of one contract: [`prefill`], a tiled SIMT kernel with fp32
//! online softmax (decode, seam windows, short spans; the reference on the device);
//! [`prefill_fast`], two cuBLAS strided-batched GEMMs around a masked row softmax
//! per query block (tensor cores for bf16 and f32); and [`prefill_flash`] (bf16 only), a
//! FlashAttention-2 kernel on tensor cores (`mma.sync` m16n8k16, fp32 online softmax,
//! K/V tiles streamed through shared memory, tiles skipped or left unmasked by their
//! position ranges). `GpuModel<bf16>` uses the flash kernel for spans of
//! ≥ `model::ATTN_FLASH_MIN_TQ` tokens, `GpuModel<f32>` the GEMM path for spans of
//! ≥ `model::ATTN_FAST_MIN_TQ`. Tests: `dataplane/tests/cuda_attn.rs`.
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::compile::{ATTN, FLASH, FLASH_WG};
use super::{check_len, CudaError, CudaSlice, Elem, Gpu, Result, Scratch};

/// Shape checks shared by [`prefill`] and [`prefill_fast`].
#[allow(clippy::too_many_arguments)]
fn check_args<T: Elem>(
    q: &CudaSlice<T>,
    q_pos: &CudaSlice<i64>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    kv_pos: &CudaSlice<i64>,
    o: &CudaSlice<T>,
    tq: usize,
    n_kv: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
) -> Result<()> {
    if nkv == 0 || !nh.is_multiple_of(nkv) {
        return Err(CudaError::Shape(format!(
            "heads {nh} not a multiple of kv heads {nkv}"
        )));
    }
    if ![64, 128, 256].contains(&hd) {
        return Err(CudaError::Shape(format!(
            "attention head_dim {hd} not in {{64, 128, 256}}"
        )));
    }
    check_len("q", q, tq * nh * hd)?;
    check_len("q_pos", q_pos, tq)?;
    check_len("k", k, n_kv * nkv * hd)?;
    check_len("v", v, n_kv * nkv * hd)?;
    check_len("kv_pos", kv_pos, n_kv)?;
    check_len("o", o, tq * nh * hd)
}

/// `o = softmax(q kᵀ · hd^-0.5, masked to kv_pos ≤ q_pos) v` per query and head.
///
/// * `q`: `[tq, nh, hd]`, `q_pos`: `[tq]` i64;
/// * `k`, `v`: `[n_kv, nkv, hd]`, `kv_pos`: `[n_kv]` i64 (any order, any values);
/// * `o`: `[tq, nh, hd]`; a query that sees no key gets zeros.
///
/// `nh` a multiple of `nkv` (query head h reads kv head `h / (nh/nkv)`),
/// `hd` ∈ {64, 128, 256}. fp32 accumulation and softmax; `T` is `f32` or `bf16`.
#[allow(clippy::too_many_arguments)]
pub fn prefill<T: Elem>(
    gpu: &Gpu,
    q: &CudaSlice<T>,
    q_pos: &CudaSlice<i64>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    kv_pos: &CudaSlice<i64>,
    o: &mut CudaSlice<T>,
    tq: usize,
    n_kv: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
) -> Result<()> {
    check_args(q, q_pos, k, v, kv_pos, o, tq, n_kv, nh, nkv, hd)?;
    if tq == 0 || nh == 0 {
        return Ok(());
    }
    const AQ: usize = 16;
    const AK: usize = 32;
    let smem = ((AQ * hd + AK * (hd + 4) + AK * hd) * 4) as u32;
    let f = gpu.function(&ATTN, &format!("attn_prefill_{}_{hd}", T::SUFFIX), smem)?;
    let cfg = LaunchConfig {
        grid_dim: (tq.div_ceil(AQ) as u32, nh as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem,
    };
    let scale = (hd as f32).powf(-0.5);
    let (a, b_, c, e) = (tq as i32, n_kv as i32, nh as i32, nkv as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(q)
        .arg(k)
        .arg(v)
        .arg(q_pos)
        .arg(kv_pos)
        .arg(o)
        .arg(&a)
        .arg(&b_)
        .arg(&c)
        .arg(&e)
        .arg(&scale);
    // SAFETY: matches `attn_prefill_*` in attn.cu; lengths checked above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Default workspace budget of [`prefill_fast`]: 256 MiB.
pub const FAST_WORKSPACE_BYTES: usize = 256 << 20;
/// Fewest query rows per block of [`prefill_fast`] (the workspace grows past the
/// budget rather than going below this).
const FAST_MIN_QB: usize = 16;
/// Most query rows per block of [`prefill_fast`]: smaller blocks let each block stop
/// at its last visible key (causal prefill: `(B + 1) / 2B` of the full score work
/// for `B` blocks), larger ones make bigger GEMMs.
pub const FAST_MAX_QB: usize = 1024;
/// Threads per row of `attn_softmax_*` (`ASM_THREADS` in attn.cu).
const SOFTMAX_THREADS: u32 = 256;

/// Query rows per block and the workspace bytes [`prefill_fast_with`] uses for `tq`
/// queries over `n_kv` keys with `nkv` kv heads, element size `elem` bytes, within
/// `budget` bytes: `bytes = nkv · qb · ld · (4 + elem)` with `ld = n_kv` rounded up
/// to a multiple of 8 (fp32 scores `S` plus probabilities `P` in the element type).
/// `qb` is `min(tq, FAST_MAX_QB)` when that fits, else the largest multiple of 16
/// that fits (at least 16, even when 16 rows exceed the budget).
pub fn fast_plan(tq: usize, n_kv: usize, nkv: usize, elem: usize, budget: usize) -> (usize, usize) {
    let ld = n_kv.next_multiple_of(8);
    let per_row = (nkv * ld * (4 + elem)).max(1);
    let fit = budget / per_row;
    let qb = if fit >= tq.min(FAST_MAX_QB) {
        tq.min(FAST_MAX_QB)
    } else {
        (fit / FAST_MIN_QB * FAST_MIN_QB).max(FAST_MIN_QB).min(tq)
    };
    (qb, qb * per_row)
}

fn cuda_type<T: Elem>() -> cudaDataType {
    if T::SUFFIX == "bf16" {
        cudaDataType::CUDA_R_16BF
    } else {
        cudaDataType::CUDA_R_32F
    }
}

fn i32_dim(what: &str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| CudaError::Shape(format!("{what} = {x} exceeds i32")))
}

/// One column-major operand of [`gemm_sb`]: device address, type, leading dim, batch
/// stride (elements).
struct Opnd {
    ptr: u64,
    ty: cudaDataType,
    ld: i32,
    stride: i64,
}

/// `C[b] = alpha · op(A[b]) · B[b]` (`beta = 0`, so `C` is never read) for `b < batch`
/// through `cublasGemmStridedBatchedEx` with fp32 compute.
#[allow(clippy::too_many_arguments)]
fn gemm_sb(
    gpu: &Gpu,
    transa: cublasOperation_t,
    m: i32,
    n: i32,
    k: i32,
    alpha: f32,
    a: &Opnd,
    b: &Opnd,
    c: &Opnd,
    batch: i32,
) -> Result<()> {
    let beta = 0f32;
    // SAFETY: the caller derives every address, leading dim and stride from buffers
    // whose lengths it checked; the handle is bound to the stream all buffers use.
    unsafe {
        cudarc::cublas::result::gemm_strided_batched_ex(
            *gpu.blas().handle(),
            transa,
            cublasOperation_t::CUBLAS_OP_N,
            m,
            n,
            k,
            (&alpha) as *const f32 as *const _,
            a.ptr as *const _,
            a.ty,
            a.ld,
            a.stride,
            b.ptr as *const _,
            b.ty,
            b.ld,
            b.stride,
            (&beta) as *const f32 as *const _,
            c.ptr as *mut _,
            c.ty,
            c.ld,
            c.stride,
            batch,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }?;
    Ok(())
}

/// Same contract as [`prefill`] (shapes, layouts, masking, zeros for a query that sees
/// no key), computed with cuBLAS GEMMs on tensor cores for bf16; meant for long query
/// spans (prefill), where it is several times faster than the tiled SIMT kernel.
/// Workspace budget [`FAST_WORKSPACE_BYTES`]; see [`prefill_fast_with`].
#[allow(clippy::too_many_arguments)]
pub fn prefill_fast<T: Elem>(
    gpu: &Gpu,
    q: &CudaSlice<T>,
    q_pos: &CudaSlice<i64>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    kv_pos: &CudaSlice<i64>,
    o: &mut CudaSlice<T>,
    tq: usize,
    n_kv: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
) -> Result<()> {
    prefill_fast_with(
        gpu,
        q,
        q_pos,
        k,
        v,
        kv_pos,
        o,
        tq,
        n_kv,
        nh,
        nkv,
        hd,
        FAST_WORKSPACE_BYTES,
    )
}

/// [`prefill_fast`] with an explicit workspace budget (bytes; tests use a small one to
/// cross query-block boundaries).
///
/// Queries are processed in blocks of `qb` rows ([`fast_plan`]); for each block and
/// each member `i < nh/nkv` of the GQA groups (query head `h = kh·(nh/nkv) + i` of kv
/// head `kh`), batched over the `nkv` kv heads:
///
/// 1. `S[kh] = hd^-0.5 · Q_h · K_khᵀ` (`[qb, n_kv]` fp32, row stride `ld`), one
///    strided-batched GEMM (T inputs, fp32 out) reading `q: [tq, nh, hd]` and
///    `k: [n_kv, nkv, hd]` in place through their leading dims (no gather);
/// 2. `P = softmax(S)` over the keys with `kv_pos ≤ q_pos` (`attn_softmax_*`, fp32,
///    P stored as T; a row that sees no key is all zeros);
/// 3. `O_h = P · V_kh` (GEMM, fp32 accumulation) written straight into
///    `o: [tq, nh, hd]` (leading dim `nh·hd`).
///
/// Each block stops at its key limit `lim = 1 + max{j : kv_pos[j] ≤ max q_pos of the
/// block}` (`attn_block_limits`, downloaded once per call: one device→host sync):
/// keys past it are masked for every query of the block, so dropping them is exact
/// for arbitrary positions; for a causal prefill at positions 0..T it skips the
/// blocks above the diagonal. `lim = 0` (no query of the block sees anything) runs
/// with one key, which the softmax masks: zeros.
///
/// Workspace: `S` (fp32) and `P` (T) of `nkv · qb · ld` elements each,
/// `ld = n_kv` rounded up to 8 — `nkv · qb · ld · (4 + size_of::<T>())` bytes, at most
/// `budget` unless even 16 query rows exceed it; plus `4 · ceil(tq / qb)` bytes of
/// block limits.
#[allow(clippy::too_many_arguments)]
pub fn prefill_fast_with<T: Elem>(
    gpu: &Gpu,
    q: &CudaSlice<T>,
    q_pos: &CudaSlice<i64>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    kv_pos: &CudaSlice<i64>,
    o: &mut CudaSlice<T>,
    tq: usize,
    n_kv: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    budget: usize,
) -> Result<()> {
    check_args(q, q_pos, k, v, kv_pos, o, tq, n_kv, nh, nkv, hd)?;
    if tq == 0 || nh == 0 {
        return Ok(());
    }
    if n_kv == 0 {
        // No key at all: every query gets zeros (the tiled kernel writes them).
        return prefill(gpu, q, q_pos, k, v, kv_pos, o, tq, n_kv, nh, nkv, hd);
    }
    let es = std::mem::size_of::<T>();
    let (qb, _) = fast_plan(tq, n_kv, nkv, es, budget);
    let ld = n_kv.next_multiple_of(8);
    let g = nh / nkv;
    // Everything cuBLAS and the softmax kernel see as int.
    let (m_kv, hd_i, ld_i) = (
        i32_dim("n_kv", n_kv)?,
        i32_dim("hd", hd)?,
        i32_dim("ld", ld)?,
    );
    let (ldq, ldk) = (i32_dim("nh·hd", nh * hd)?, i32_dim("nkv·hd", nkv * hd)?);
    let batch = i32_dim("nkv", nkv)?;
    i32_dim("tq", tq)?;
    i32_dim("rows", nkv * qb)?;
    let stream = gpu.stream();
    let nblocks = tq.div_ceil(qb);
    let lims: Vec<i32> = {
        let mut lim = gpu.zeros::<i32>(nblocks)?;
        let fl = gpu.function(&ATTN, "attn_block_limits", 0)?;
        let (tq_i, qb_i) = (tq as i32, qb as i32);
        let cfg = LaunchConfig {
            grid_dim: (nblocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&fl);
        b.arg(q_pos)
            .arg(kv_pos)
            .arg(&tq_i)
            .arg(&m_kv)
            .arg(&qb_i)
            .arg(&mut lim);
        // SAFETY: matches `attn_block_limits`; q_pos ≥ tq, kv_pos ≥ n_kv, lim ≥ nblocks.
        unsafe { b.launch(cfg) }?;
        gpu.download(&lim)?
    };
    // SAFETY: fully written by the score GEMM (beta = 0) / the softmax before any read;
    // only columns < n_kv of rows < nkv·qb are ever read.
    let mut s = unsafe { stream.alloc::<f32>(nkv * qb * ld) }?;
    let mut p = unsafe { stream.alloc::<T>(nkv * qb * ld) }?;
    let f = gpu.function(&ATTN, &format!("attn_softmax_{}", T::SUFFIX), 0)?;
    let scale = (hd as f32).powf(-0.5);
    let (qp, _rq) = q.device_ptr(stream);
    let (kp, _rk) = k.device_ptr(stream);
    let (vp, _rv) = v.device_ptr(stream);
    let (op, _ro) = o.device_ptr_mut(stream);
    let (sp, _rs) = s.device_ptr_mut(stream);
    let (pp, _rp) = p.device_ptr_mut(stream);
    let (ty, f32t) = (cuda_type::<T>(), cudaDataType::CUDA_R_32F);
    for (blk_i, &lim) in lims.iter().enumerate().take(nblocks) {
        let q0 = blk_i * qb;
        let nq = qb.min(tq - q0);
        let (nq_i, q0_i) = (nq as i32, q0 as i32);
        // Keys 0..nk of this block (lim ∈ 0..=n_kv; ≥ 1 so that the GEMMs are never
        // empty: a block that sees nothing scores key 0 and masks it).
        let nk = (lim.max(1) as usize).min(n_kv) as i32;
        let blk = (nq * ld) as i64;
        for i in 0..g {
            // First query row of head i (kv head 0) in this block; + kh·g·hd per batch.
            let qo = ((q0 * nh + i) * hd * es) as u64;
            // 1. S[kh]ᵀ (col-major n_kv × nq) = K_kh (n_kv × hd) · Q_hᵀ (hd × nq).
            gemm_sb(
                gpu,
                cublasOperation_t::CUBLAS_OP_T,
                nk,
                nq_i,
                hd_i,
                scale,
                &Opnd {
                    ptr: kp,
                    ty,
                    ld: ldk,
                    stride: hd as i64,
                },
                &Opnd {
                    ptr: qp + qo,
                    ty,
                    ld: ldq,
                    stride: (g * hd) as i64,
                },
                &Opnd {
                    ptr: sp,
                    ty: f32t,
                    ld: ld_i,
                    stride: blk,
                },
                batch,
            )?;
            // 2. Row softmax with the position mask.
            let cfg = LaunchConfig {
                grid_dim: ((nkv * nq) as u32, 1, 1),
                block_dim: (SOFTMAX_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = stream.launch_builder(&f);
            b.arg(&sp)
                .arg(&pp)
                .arg(q_pos)
                .arg(kv_pos)
                .arg(&nq_i)
                .arg(&q0_i)
                .arg(&nk)
                .arg(&ld_i);
            // SAFETY: matches `attn_softmax_*` (device addresses passed as u64);
            // s, p: nkv·qb·ld ≥ nkv·nq·ld elements; q_pos ≥ q0 + nq; kv_pos ≥ nk.
            unsafe { b.launch(cfg) }?;
            // 3. O_hᵀ (col-major hd × nq, ld nh·hd) = V_khᵀ (hd × n_kv) · P[kh]ᵀ (n_kv × nq).
            gemm_sb(
                gpu,
                cublasOperation_t::CUBLAS_OP_N,
                hd_i,
                nq_i,
                nk,
                1.0,
                &Opnd {
                    ptr: vp,
                    ty,
                    ld: ldk,
                    stride: hd as i64,
                },
                &Opnd {
                    ptr: pp,
                    ty,
                    ld: ld_i,
                    stride: blk,
                },
                &Opnd {
                    ptr: op + qo,
                    ty,
                    ld: ldq,
                    stride: (g * hd) as i64,
                },
                batch,
            )?;
        }
    }
    Ok(())
}

/// Tile shape of a flash kernel instance: `br` query rows per CTA (`br / 16` warps of
/// 16 rows, `2·br` threads) × `bc` keys per shared-memory tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashTiles {
    /// Query rows per CTA (128 or 64).
    pub br: usize,
    /// Keys per tile (64 or 32).
    pub bc: usize,
}

/// The tile shapes compiled in flash.cu for head dim `hd` (instances
/// `attn_flash_bf16_{hd}_{br}x{bc}`), the default ([`flash_tiles`]) first.
pub fn flash_variants(hd: usize) -> &'static [FlashTiles] {
    const T128_64: FlashTiles = FlashTiles { br: 128, bc: 64 };
    match hd {
        64 => &[T128_64],
        128 => &[T128_64, FlashTiles { br: 64, bc: 64 }],
        256 => &[
            T128_64,
            FlashTiles { br: 64, bc: 32 },
            FlashTiles { br: 128, bc: 32 },
        ],
        _ => &[],
    }
}

/// Default tile shape of [`prefill_flash`] for head dim `hd`: 128 queries (8 warps) ×
/// 64 keys, FlashAttention-2's choice for these head dims (`gpu_bench` times the other
/// instances beside it).
pub fn flash_tiles(hd: usize) -> FlashTiles {
    flash_variants(hd)
        .first()
        .copied()
        .unwrap_or(FlashTiles { br: 128, bc: 64 })
}

/// Options of [`prefill_flash_with`]; the default is what [`prefill_flash`] does.
#[derive(Clone, Copy, Debug, Default)]
pub struct FlashOpts {
    /// Key splits per (query tile, head): `None` lets [`flash_plan`] choose; `Some(n)` is
    /// clamped to `1..=FLASH_MAX_SPLIT` (tests cross split boundaries with it).
    pub split: Option<usize>,
    /// Tile shape, one of [`flash_variants`]`(hd)`; `None`: [`flash_tiles`]`(hd)`.
    pub tiles: Option<FlashTiles>,
}

/// Threads of the key-tile suffix-minimum kernel (`FA_TILE_THREADS`).
const FLASH_TILE_THREADS: u32 = 1024;
/// Most key splits per (query tile, head) (`FA_MAX_SPLIT`).
pub const FLASH_MAX_SPLIT: usize = 64;
/// Fewest key tiles per split: below this the merge costs more than the split gains.
const FLASH_MIN_TILES_PER_SPLIT: usize = 8;

/// Dynamic shared memory of the flash kernel for head dim `hd` and tile shape `t`, bytes:
/// query and key positions (`br + 2·bc` i64), `2·br/16` i64 of reduction space, then the
/// Q tile and two stages of K and V tiles in bf16 with rows padded to `hd + 8`
/// elements: `(br + 2·bc + br/8)·8 + (br + 4·bc)·(hd + 8)·2` (204 928 for hd 256 and
/// 128 × 64 tiles).
pub fn flash_smem_bytes(hd: usize, t: FlashTiles) -> usize {
    (t.br + 2 * t.bc + 2 * (t.br / 16)) * 8 + (t.br + 4 * t.bc) * (hd + 8) * 2
}

/// Key splits [`prefill_flash`] uses for `tq` queries over `n_kv` keys with `nh` heads
/// of dim `hd` and tile shape `t`, on a device of `sms` multiprocessors, within a
/// workspace of `budget` bytes: 1 (no split) when the `ceil(tq / br)·nh` CTAs fill at
/// least half the device; otherwise enough splits for about two CTAs per
/// multiprocessor, at most [`FLASH_MAX_SPLIT`], at least 8 key tiles per split, and a
/// workspace (`nsplit · tq · nh · (hd + 2) · 4` bytes: fp32 partial outputs, maxima and
/// sums) within `budget`.
pub fn flash_plan(
    tq: usize,
    n_kv: usize,
    nh: usize,
    hd: usize,
    t: FlashTiles,
    sms: usize,
    budget: usize,
) -> usize {
    let ctas = tq.div_ceil(t.br) * nh;
    let ntk = n_kv.div_ceil(t.bc);
    if ctas == 0 || 2 * ctas >= sms {
        return 1;
    }
    let per_split = (tq * nh * (hd + 2) * 4).max(1);
    (2 * sms)
        .div_ceil(ctas)
        .min(ntk / FLASH_MIN_TILES_PER_SPLIT)
        .min(FLASH_MAX_SPLIT)
        .min(budget / per_split)
        .max(1)
}

/// Same contract as [`prefill`] (shapes, layouts, position masking, zeros for a query
/// that sees no key), bf16 only, on tensor cores: FlashAttention-2 (T. Dao, 2023,
/// "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning",
/// Algorithm 1) in our own kernel, `kernels/flash.cu`:
///
/// * one CTA of 8 warps per 128 queries of one head (each warp 16 rows; other tile
///   shapes through [`prefill_flash_with`]); key/value tiles of 64 keys stream through
///   shared memory by `cp.async` in two stages (the next tile loads while the current
///   one is used);
/// * per tile `S = Q Kᵀ` and `O += P V` by `mma.sync.m16n8k16` (bf16 inputs, fp32
///   accumulators; fragments by `ldmatrix`, V by `ldmatrix.trans`), the softmax online
///   in fp32 in the log2 domain (scores times `hd^-0.5 · log2 e`, `exp2`), `P` rounded
///   to bf16 for the second product, `O` divided by the row sums at the end;
/// * masking by positions: two small kernels reduce `kv_pos` per key tile to its (min,
///   max) and the suffix minimum of the minima; a CTA skips the tiles no query of its tile can see
///   (min key position > max query position), runs the tiles every query sees in full
///   (max key position ≤ min query position) without a mask, and masks the others per
///   element. A causal prefill at positions 0..T therefore skips every tile above the
///   diagonal and masks only the diagonal ones;
/// * CTAs ordered heads fastest (the `nh / nkv` heads of one kv head run side by side
///   and share its K/V tiles through L2), query tiles from the last to the first (for a
///   causal prefill, the longest first);
/// * when the grid would leave most of the device idle (a short span over a long
///   cache) the key tiles are split over up to [`FLASH_MAX_SPLIT`] CTAs per query tile
///   ([`flash_plan`]), each writing fp32 partial results, merged by a second kernel.
///
/// `T` must be `half::bf16`: `f32` is a [`CudaError::Shape`] error (use [`prefill`] or
/// [`prefill_fast`]); `hd` ∈ {64, 128, 256}. Needs [`flash_smem_bytes`] of shared
/// memory per block (H100/H200: every instance; else [`CudaError::Unavailable`]).
/// Workspace: `3·ceil(n_kv / bc)` i64 of tile summaries, plus with splits
/// `nsplit · tq · nh · (hd + 2)` fp32 (at most [`FAST_WORKSPACE_BYTES`]).
#[allow(clippy::too_many_arguments)]
pub fn prefill_flash<T: Elem>(
    gpu: &Gpu,
    q: &CudaSlice<T>,
    q_pos: &CudaSlice<i64>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    kv_pos: &CudaSlice<i64>,
    o: &mut CudaSlice<T>,
    tq: usize,
    n_kv: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
) -> Result<()> {
    prefill_flash_with(
        gpu,
        q,
        q_pos,
        k,
        v,
        kv_pos,
        o,
        tq,
        n_kv,
        nh,
        nkv,
        hd,
        FlashOpts::default(),
    )
}

/// [`prefill_flash`] with explicit [`FlashOpts`]: the number of key splits (tests) and
/// the tile shape (benchmarks).
#[allow(clippy::too_many_arguments)]
pub fn prefill_flash_with<T: Elem>(
    gpu: &Gpu,
    q: &CudaSlice<T>,
    q_pos: &CudaSlice<i64>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    kv_pos: &CudaSlice<i64>,
    o: &mut CudaSlice<T>,
    tq: usize,
    n_kv: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    opts: FlashOpts,
) -> Result<()> {
    if T::SUFFIX != "bf16" {
        return Err(CudaError::Shape(format!(
            "attn::prefill_flash takes bf16 only, got {} (use attn::prefill or attn::prefill_fast)",
            T::SUFFIX
        )));
    }
    check_args(q, q_pos, k, v, kv_pos, o, tq, n_kv, nh, nkv, hd)?;
    if tq == 0 || nh == 0 {
        return Ok(());
    }
    let tl = opts.tiles.unwrap_or_else(|| flash_tiles(hd));
    if !flash_variants(hd).contains(&tl) {
        return Err(CudaError::Shape(format!(
            "attn::prefill_flash has no {}×{} instance for head_dim {hd} (have {:?})",
            tl.br,
            tl.bc,
            flash_variants(hd)
        )));
    }
    let ctx = gpu.context();
    let smem = flash_smem_bytes(hd, tl);
    let optin = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
        as usize;
    if smem > optin {
        return Err(CudaError::Unavailable(format!(
            "attn::prefill_flash for head_dim {hd} ({}×{} tiles) needs {smem} bytes of shared \
             memory per block, the device allows {optin}",
            tl.br, tl.bc
        )));
    }
    let sms = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
    let nsplit = match opts.split {
        Some(n) => n.clamp(1, FLASH_MAX_SPLIT),
        None => flash_plan(tq, n_kv, nh, hd, tl, sms, FAST_WORKSPACE_BYTES),
    };
    let nqt = tq.div_ceil(tl.br);
    let (tq_i, nkv_len_i) = (i32_dim("tq", tq)?, i32_dim("n_kv", n_kv)?);
    let (nh_i, nkvh_i) = (i32_dim("nh", nh)?, i32_dim("nkv", nkv)?);
    let grid_x = u32::try_from(nqt * nh)
        .map_err(|_| CudaError::Shape(format!("{nqt} query tiles × {nh} heads exceed u32")))?;
    let rows = tq * nh;
    let stream = gpu.stream();
    // Key tile summaries: [3][ntk] i64 (min, max, suffix min of the minima).
    let tiles = flash_tile_summaries(gpu, kv_pos, n_kv, tl.bc)?;
    // Split partials: wo [nsplit][tq·nh][hd] fp32, wml [nsplit][tq·nh][2] fp32.
    // SAFETY: every (split, row) of both is written by the main kernel before the merge
    // reads it.
    let mut ws = if nsplit > 1 {
        Some((
            unsafe { stream.alloc::<f32>(nsplit * rows * hd) }?,
            unsafe { stream.alloc::<f32>(nsplit * rows * 2) }?,
        ))
    } else {
        None
    };
    let (mut wo_p, mut wml_p) = (0u64, 0u64);
    let _ws_guards = ws.as_mut().map(|(a, b)| {
        let (pa, ga) = a.device_ptr_mut(stream);
        let (pb, gb) = b.device_ptr_mut(stream);
        (wo_p, wml_p) = (pa, pb);
        (ga, gb)
    });
    let scale_log2 = (hd as f32).powf(-0.5) * std::f32::consts::LOG2_E;
    let name = format!("attn_flash_bf16_{hd}_{}x{}", tl.br, tl.bc);
    let f = gpu.function(&FLASH, &name, smem as u32)?;
    let cfg = LaunchConfig {
        grid_dim: (grid_x, nsplit as u32, 1),
        block_dim: (2 * tl.br as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    {
        let mut b = stream.launch_builder(&f);
        b.arg(q)
            .arg(k)
            .arg(v)
            .arg(q_pos)
            .arg(kv_pos)
            .arg(&tiles)
            .arg(&mut *o)
            .arg(&wo_p)
            .arg(&wml_p)
            .arg(&tq_i)
            .arg(&nkv_len_i)
            .arg(&nh_i)
            .arg(&nkvh_i)
            .arg(&scale_log2);
        // SAFETY: matches `attn_flash_bf16_{hd}_{br}x{bc}` (workspace addresses as u64, 0
        // when unused: the kernel writes them only when gridDim.y > 1); lengths checked
        // by check_args, tiles and workspace sized above.
        unsafe { b.launch(cfg) }?;
    }
    if nsplit > 1 {
        flash_merge_splits(gpu, wo_p, wml_p, o, rows, hd, nsplit)?;
    }
    // The workspace is freed (stream-ordered) after the merge has been queued.
    Ok(())
}

/// Key-tile summaries of `kv_pos` (`[n_kv]` i64) for tiles of `bc` keys, as flash.cu's
/// `attn_flash_tiles` / `attn_flash_tiles_suffix` write them: `[3][ceil(n_kv / bc)]` i64
/// (per tile the minimum and maximum position, then the suffix minimum of the minima over
/// the following tiles), read by the flash kernels to skip or unmask whole tiles. A
/// buffer of 3 elements, never read, when `n_kv = 0`.
fn flash_tile_summaries(
    gpu: &Gpu,
    kv_pos: &CudaSlice<i64>,
    n_kv: usize,
    bc: usize,
) -> Result<Scratch<i64>> {
    let ntk = n_kv.div_ceil(bc);
    let stream = gpu.stream();
    // Fully written by attn_flash_tiles before any kernel reads it (and never read when
    // ntk = 0).
    let mut tiles = gpu.scratch::<i64>(3 * ntk.max(1))?;
    if ntk > 0 {
        let (nkv_len_i, bc_i) = (i32_dim("n_kv", n_kv)?, bc as i32);
        let f = gpu.function(&FLASH, "attn_flash_tiles", 0)?;
        let cfg = LaunchConfig {
            grid_dim: (ntk.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&f);
        b.arg(kv_pos).arg(&nkv_len_i).arg(&bc_i).arg(&mut tiles);
        // SAFETY: matches `attn_flash_tiles`; kv_pos ≥ n_kv, tiles ≥ 3·ceil(n_kv/bc).
        unsafe { b.launch(cfg) }?;
        let f = gpu.function(&FLASH, "attn_flash_tiles_suffix", 0)?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (FLASH_TILE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let ntk_i = ntk as i32;
        let mut b = stream.launch_builder(&f);
        b.arg(&ntk_i).arg(&mut tiles);
        // SAFETY: matches `attn_flash_tiles_suffix`; tiles ≥ 3·ntk, minima written above.
        unsafe { b.launch(cfg) }?;
    }
    Ok(tiles)
}

/// Merges the `nsplit` key-split partials of a flash kernel into `o` (`[rows, hd]`
/// bf16, `rows = tq·nh`): `wo` (`[nsplit][rows][hd]` fp32 unnormalised outputs) and `wml`
/// (`[nsplit][rows][2]` fp32 row maxima in the log2 domain and row sums), given as device
/// addresses (flash.cu's `attn_flash_combine_bf16`).
fn flash_merge_splits<T: Elem>(
    gpu: &Gpu,
    wo_p: u64,
    wml_p: u64,
    o: &mut CudaSlice<T>,
    rows: usize,
    hd: usize,
    nsplit: usize,
) -> Result<()> {
    let rows_u =
        u32::try_from(rows).map_err(|_| CudaError::Shape(format!("tq·nh = {rows} exceeds u32")))?;
    let f = gpu.function(&FLASH, "attn_flash_combine_bf16", 0)?;
    let cfg = LaunchConfig {
        grid_dim: (rows_u, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rows_i, hd_i, ns_i) = (i32_dim("tq·nh", rows)?, hd as i32, nsplit as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&wo_p)
        .arg(&wml_p)
        .arg(o)
        .arg(&rows_i)
        .arg(&hd_i)
        .arg(&ns_i);
    // SAFETY: matches `attn_flash_combine_bf16`; the callers allocate wo, wml with
    // nsplit·rows·hd and nsplit·rows·2 floats, and o holds rows·hd elements (check_args).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Head dims compiled in `kernels/flash_wg.cu` (instances `attn_flash_wg_bf16_{hd}`).
pub const FLASH_WG_HEAD_DIMS: [usize; 2] = [128, 256];

/// Query rows per CTA of the wgmma kernel (two warpgroups of 64 rows).
const FLASH_WG_BR: usize = 128;
/// Keys per tile of the wgmma kernel (the tile summaries of flash.cu are built for it).
const FLASH_WG_BC: usize = 64;

/// Dynamic shared memory of the wgmma flash kernel for head dim `hd`, bytes: 1024 of
/// alignment slack (the 128-byte-swizzle atoms must start on 1024-byte boundaries), the
/// Q tile (128 rows) and two stages of K and V tiles (64 keys) in bf16, then the query
/// and key positions and reduction space (i64): `1024 + (hd/64)·(128 + 4·64)·128 +
/// (128 + 2·64 + 16)·8` (199 808 for hd 256, 101 504 for hd 128).
pub fn flash_wg_smem_bytes(hd: usize) -> usize {
    1024 + (hd / 64) * (FLASH_WG_BR + 4 * FLASH_WG_BC) * 128
        + (FLASH_WG_BR + 2 * FLASH_WG_BC + 16) * 8
}

/// K/V ring stages of the warp-specialised wgmma kernel (`FW3_STAGES`): 2 at head dim
/// 256 (Q and two K/V stages take 192 KiB of the 227 KiB), 3 at 128.
pub fn flash_wg3_stages(hd: usize) -> usize {
    if hd == 256 {
        2
    } else {
        3
    }
}

/// Dynamic shared memory of the warp-specialised wgmma kernels (`attn_flash_wg3tmal*`) for
/// key tiles of `bc` keys (64, or 80 for [`FlashWgKernel::WarpSpecializedTmaLeanBc80`]), bytes:
/// 1024 of alignment slack, the Q tile (128 rows), `S` = [`flash_wg3_stages`] stages of K
/// and V tiles in bf16, then key positions, reduction space and 16 mbarriers:
/// `1024 + (hd/64)·(128 + 2·S·bc)·128 + (S·bc + 48)·8` (hd 256: 199 040 for bc 64,
/// 232 064 for bc 80; hd 128: 134 016, 158 976).
pub fn flash_wg3_smem_bytes(hd: usize, bc: usize) -> usize {
    let s = flash_wg3_stages(hd);
    1024 + (hd / 64) * (FLASH_WG_BR + 2 * s * bc) * 128 + (s * bc + 48) * 8
}

/// Which kernel of `kernels/flash_wg.cu` [`prefill_flash_wg_with`] runs (same contract,
/// arguments, tiles and split plan). `GpuModel` runs the two warp-specialised kernels and
/// falls back to [`FlashWgKernel::Basic`] where the driver cannot build tensor maps; the
/// other variants that were measured beside them (cp.async producer, no ping-pong, TMA
/// without the lean loop) were retired.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FlashWgKernel {
    /// `attn_flash_wg_bf16_{hd}`: two warpgroups (256 threads) that both load (cp.async,
    /// two K/V stages, a block barrier per key tile) and compute.
    #[default]
    Basic,
    /// `attn_flash_wg3tmal_bf16_{hd}`: FlashAttention-3 warp specialisation (384 threads),
    /// 64-key tiles: a producer warpgroup (`setmaxnreg` 24) loads Q by cp.async and a ring
    /// of K/V stages ([`flash_wg3_stages`]) by TMA (one producer thread issues
    /// `cp.async.bulk.tensor.2d` boxes of 64 keys × 64 elements, 128-byte swizzle, over
    /// tensor maps built on the host with `cuTensorMapEncodeTiled` ([`encode_kv_map`]),
    /// completing on the stage's mbarrier through `mbarrier.arrive.expect_tx`); two consumer
    /// warpgroups (`setmaxnreg` 240) run the wgmma loop without block barriers, ping-pong
    /// scheduled by named barriers (one's softmax under the other's GEMMs). The consumers
    /// count their visible key tiles once (a warp vote per 32 tile summaries) and read no
    /// global memory in the loop: the producer publishes each K stage's tile index and
    /// largest key position in shared memory (the index by its releasing `expect_tx`
    /// arrival, the position by a cp.async its asynchronous arrival covers); the softmax
    /// folds the scale into the exponent's FMA (`2^(s·c − m·c)`, FA3).
    WarpSpecializedTmaLean,
    /// `attn_flash_wg3tmalb80_bf16_{hd}`: [`FlashWgKernel::WarpSpecializedTmaLean`] with key
    /// tiles of 80 (FlashAttention-3's tile at head dim 256: less shared-memory traffic per
    /// FLOP in `S = Q Kᵀ`, per-tile costs over more keys; boxes of 80 rows, tile summaries
    /// and split plan for 128 × 80).
    WarpSpecializedTmaLeanBc80,
}

impl FlashWgKernel {
    /// Keys per tile of the kernel (64, or 80 for [`FlashWgKernel::WarpSpecializedTmaLeanBc80`]).
    pub fn key_tile(self) -> usize {
        match self {
            FlashWgKernel::WarpSpecializedTmaLeanBc80 => 80,
            _ => FLASH_WG_BC,
        }
    }

    /// The kernel's name in `kernels/flash_wg.cu` without the `_bf16_{hd}` suffix.
    pub fn name_prefix(self) -> &'static str {
        match self {
            FlashWgKernel::Basic => "attn_flash_wg",
            FlashWgKernel::WarpSpecializedTmaLean => "attn_flash_wg3tmal",
            FlashWgKernel::WarpSpecializedTmaLeanBc80 => "attn_flash_wg3tmalb80",
        }
    }

    /// Whether the kernel takes the tensor maps of K and V ([`encode_kv_map`]).
    pub fn uses_tma(self) -> bool {
        self != FlashWgKernel::Basic
    }
}

/// A `CUtensorMap` (128 opaque bytes, 64-byte aligned; CUDA 13's header aligns it to 128)
/// passed by value as a kernel argument (`const __grid_constant__ FwTmap` in flash_wg.cu).
#[repr(C, align(128))]
#[derive(Clone, Copy, Debug)]
pub struct TensorMapArg(pub [u64; 16]);

// SAFETY: plain bytes with the size of CUtensorMap; the kernel parameter has that type.
unsafe impl cudarc::driver::DeviceRepr for TensorMapArg {}

/// Tensor map of a bf16 K or V buffer `[n_kv, nkv, hd]` at device address `ptr` for
/// the TMA kernels (`attn_flash_wg3tmal*_*`): the 2-D view `[n_kv rows][nkv·hd elements]`
/// (row stride `nkv·hd·2` bytes), boxes of 64 elements (128 bytes) × `bc` rows (the key
/// tile, 64 or 80: [`FlashWgKernel::key_tile`]) with
/// `CU_TENSOR_MAP_SWIZZLE_128B` (the 128-byte swizzle the wgmma descriptors expect),
/// interleave none, element strides 1, L2 promotion 256 B, out-of-bound fill none (rows
/// past `n_kv` land as zeros; the kernel masks them by position anyway). `n_kv = 0` gives
/// a zeroed map (the kernel issues no copy without a key tile). Errors: an unsupported
/// shape, a driver without `cuTensorMapEncodeTiled`, or the driver rejecting the
/// parameters → [`CudaError`] (never a panic).
pub fn encode_kv_map(
    ptr: u64,
    n_kv: usize,
    nkv: usize,
    hd: usize,
    bc: usize,
) -> Result<TensorMapArg> {
    use cudarc::driver::sys;
    let mut m = TensorMapArg([0; 16]);
    if n_kv == 0 {
        return Ok(m);
    }
    let row = nkv * hd;
    if !ptr.is_multiple_of(16)
        || !(row * 2).is_multiple_of(16)
        || !hd.is_multiple_of(64)
        || !(1..=256).contains(&bc)
    {
        return Err(CudaError::Shape(format!(
            "attn: TMA map needs a 16-byte aligned buffer and rows of a multiple of 16 bytes \
             and 1 to 256 rows per box (address {ptr:#x}, {nkv} kv heads × {hd}, {bc} rows)"
        )));
    }
    if n_kv as u64 > 1u64 << 32 || (row * 2) as u64 >= 1u64 << 40 {
        return Err(CudaError::Shape(format!(
            "attn: n_kv = {n_kv} too large for a tensor map"
        )));
    }
    let dims = [row as u64, n_kv as u64];
    let strides = [(row * 2) as u64];
    let boxd = [64u32, bc as u32];
    let estr = [1u32, 1u32];
    let mp = &mut m as *mut TensorMapArg as *mut sys::CUtensorMap;
    // The symbol is resolved on first use; cudarc panics if the driver lacks it.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: mp points to 128 writable bytes aligned to 128; the arrays hold rank (2)
        // dims, box sizes and element strides and rank − 1 strides; ptr is a device
        // address of n_kv·nkv·hd bf16 elements (checked by the caller).
        unsafe {
            sys::cuTensorMapEncodeTiled(
                mp,
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                2,
                ptr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxd.as_ptr(),
                estr.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
    }));
    match r {
        Ok(sys::CUresult::CUDA_SUCCESS) => Ok(m),
        Ok(e) => Err(CudaError::Driver(format!(
            "cuTensorMapEncodeTiled ({n_kv} × {row} bf16, box 64 × {bc}, 128-byte swizzle): {e:?}"
        ))),
        Err(_) => Err(CudaError::Unavailable(
            "the CUDA driver has no cuTensorMapEncodeTiled (TMA needs CUDA 12 and sm_90)".into(),
        )),
    }
}

/// Options of [`prefill_flash_wg_with`]; the default is what [`prefill_flash_wg`] does.
#[derive(Clone, Copy, Debug, Default)]
pub struct FlashWgOpts {
    /// Key splits per (query tile, head): `None` lets [`flash_plan`] choose; `Some(n)` is
    /// clamped to `1..=FLASH_MAX_SPLIT` (tests cross split boundaries with it).
    pub split: Option<usize>,
    /// The kernel (default [`FlashWgKernel::Basic`]).
    pub kernel: FlashWgKernel,
}

/// Same contract as [`prefill`] and [`prefill_flash`] (shapes, layouts, position
/// masking, zeros for a query that sees no key), bf16 only, on Hopper's warpgroup tensor
/// cores: our kernel `kernels/flash_wg.cu`, the FlashAttention-3 scheme (J. Shah et al.,
/// 2024, "FlashAttention-3: Fast and Accurate Attention with Asynchrony and
/// Low-precision": `wgmma` with shared-memory descriptors, softmax overlapped with the
/// asynchronous GEMMs inside each warpgroup) without warp specialisation (the default
/// [`FlashWgKernel::Basic`]; [`prefill_flash_wg_with`] with
/// [`FlashWgKernel::WarpSpecializedTmaLean`] runs the warp-specialised kernel: producer
/// warpgroup loading by TMA, mbarrier ring, `setmaxnreg`, ping-pong consumers):
///
/// * `q`: `[tq, nh, hd]`, `q_pos`: `[tq]` i64; `k`, `v`: `[n_kv, nkv, hd]`, `kv_pos`:
///   `[n_kv]` i64 (any order, any values); `o`: `[tq, nh, hd]`; `nh` a multiple of `nkv`;
///   `hd` ∈ [`FLASH_WG_HEAD_DIMS`];
/// * one CTA of two warpgroups per 128 queries of one head; key/value tiles of 64 keys
///   stream through shared memory (`cp.async`, 128-byte swizzle, two stages); per tile
///   `S = Q Kᵀ` by `wgmma.m64n64k16` (A and B from shared memory) and `O += P V` by
///   `wgmma.m64n{hd}k16` (P from registers, V MN-major); the scores of tile i + 1 are
///   computed while `P V` of tile i runs;
/// * masking, tile skipping and key splits are [`prefill_flash`]'s (flash.cu's tile
///   summary kernels for 64-key tiles and its split merge; [`flash_plan`] for 128 × 64).
///
/// Errors: `T` not bf16 or `hd` not in [`FLASH_WG_HEAD_DIMS`] → [`CudaError::Shape`]; a
/// device other than sm_90 (H100 / H200) → [`CudaError::Unavailable`]. Workspace as
/// [`prefill_flash`]. Tests: `flash_wg_*` in `dataplane/tests/cuda_attn.rs`; CPU check of
/// the kernel: `tools/kernel-emu/run.sh wg`.
#[allow(clippy::too_many_arguments)]
pub fn prefill_flash_wg<T: Elem>(
    gpu: &Gpu,
    q: &CudaSlice<T>,
    q_pos: &CudaSlice<i64>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    kv_pos: &CudaSlice<i64>,
    o: &mut CudaSlice<T>,
    tq: usize,
    n_kv: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
) -> Result<()> {
    let opts = FlashWgOpts::default();
    prefill_flash_wg_with(gpu, q, q_pos, k, v, kv_pos, o, tq, n_kv, nh, nkv, hd, opts)
}

/// [`prefill_flash_wg`] with options: the number of key splits (`None`: [`flash_plan`];
/// `Some(n)` clamped to `1..=FLASH_MAX_SPLIT`; tests cross split boundaries with it) and
/// the kernel ([`FlashWgKernel`]; `GpuModel` runs the warp-specialised ones, tests
/// `flash_wg3tmal*` check them).
#[allow(clippy::too_many_arguments)]
pub fn prefill_flash_wg_with<T: Elem>(
    gpu: &Gpu,
    q: &CudaSlice<T>,
    q_pos: &CudaSlice<i64>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    kv_pos: &CudaSlice<i64>,
    o: &mut CudaSlice<T>,
    tq: usize,
    n_kv: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    opts: FlashWgOpts,
) -> Result<()> {
    let split = opts.split;
    if T::SUFFIX != "bf16" {
        return Err(CudaError::Shape(format!(
            "attn::prefill_flash_wg takes bf16 only, got {} (use attn::prefill or attn::prefill_fast)",
            T::SUFFIX
        )));
    }
    if !FLASH_WG_HEAD_DIMS.contains(&hd) {
        return Err(CudaError::Shape(format!(
            "attn::prefill_flash_wg supports head_dim {FLASH_WG_HEAD_DIMS:?}, got {hd} (use \
             attn::prefill_flash)"
        )));
    }
    check_args(q, q_pos, k, v, kv_pos, o, tq, n_kv, nh, nkv, hd)?;
    if gpu.arch() != "sm_90a" {
        return Err(CudaError::Unavailable(format!(
            "attn::prefill_flash_wg needs an sm_90 device (wgmma), this one is {} ({})",
            gpu.name(),
            gpu.arch()
        )));
    }
    if tq == 0 || nh == 0 {
        return Ok(());
    }
    let tl = FlashTiles {
        br: FLASH_WG_BR,
        bc: opts.kernel.key_tile(),
    };
    let ctx = gpu.context();
    let (smem, threads) = match opts.kernel {
        FlashWgKernel::Basic => (flash_wg_smem_bytes(hd), 256u32),
        _ => (flash_wg3_smem_bytes(hd, tl.bc), 384u32),
    };
    let prefix = opts.kernel.name_prefix();
    let optin = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
        as usize;
    if smem > optin {
        return Err(CudaError::Unavailable(format!(
            "attn::prefill_flash_wg for head_dim {hd} needs {smem} bytes of shared memory per \
             block, the device allows {optin}"
        )));
    }
    let sms = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
    let nsplit = match split {
        Some(n) => n.clamp(1, FLASH_MAX_SPLIT),
        None => flash_plan(tq, n_kv, nh, hd, tl, sms, FAST_WORKSPACE_BYTES),
    };
    let nqt = tq.div_ceil(tl.br);
    let (tq_i, nkv_len_i) = (i32_dim("tq", tq)?, i32_dim("n_kv", n_kv)?);
    let (nh_i, nkvh_i) = (i32_dim("nh", nh)?, i32_dim("nkv", nkv)?);
    let grid_x = u32::try_from(nqt * nh)
        .map_err(|_| CudaError::Shape(format!("{nqt} query tiles × {nh} heads exceed u32")))?;
    let rows = tq * nh;
    let stream = gpu.stream();
    // Key tile summaries for 64-key tiles: [3][ntk] i64 (flash.cu's kernels).
    let tiles = flash_tile_summaries(gpu, kv_pos, n_kv, tl.bc)?;
    // Split partials: wo [nsplit][tq·nh][hd] fp32, wml [nsplit][tq·nh][2] fp32.
    // SAFETY: every (split, row) of both is written by the main kernel before the merge
    // reads it.
    let mut ws = if nsplit > 1 {
        Some((
            unsafe { stream.alloc::<f32>(nsplit * rows * hd) }?,
            unsafe { stream.alloc::<f32>(nsplit * rows * 2) }?,
        ))
    } else {
        None
    };
    let (mut wo_p, mut wml_p) = (0u64, 0u64);
    let _ws_guards = ws.as_mut().map(|(a, b)| {
        let (pa, ga) = a.device_ptr_mut(stream);
        let (pb, gb) = b.device_ptr_mut(stream);
        (wo_p, wml_p) = (pa, pb);
        (ga, gb)
    });
    let scale_log2 = (hd as f32).powf(-0.5) * std::f32::consts::LOG2_E;
    let name = format!("{prefix}_bf16_{hd}");
    let f = gpu.function(&FLASH_WG, &name, smem as u32)?;
    // Tensor maps of K and V (attn_flash_wg3tmal*_* only).
    let tma = opts.kernel.uses_tma();
    let (mk, mv) = if tma {
        let (kp, _kg) = k.device_ptr(stream);
        let (vp, _vg) = v.device_ptr(stream);
        (
            encode_kv_map(kp, n_kv, nkv, hd, tl.bc)?,
            encode_kv_map(vp, n_kv, nkv, hd, tl.bc)?,
        )
    } else {
        (TensorMapArg([0; 16]), TensorMapArg([0; 16]))
    };
    let cfg = LaunchConfig {
        grid_dim: (grid_x, nsplit as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    {
        let mut b = stream.launch_builder(&f);
        b.arg(q)
            .arg(k)
            .arg(v)
            .arg(q_pos)
            .arg(kv_pos)
            .arg(&tiles)
            .arg(&mut *o)
            .arg(&wo_p)
            .arg(&wml_p)
            .arg(&tq_i)
            .arg(&nkv_len_i)
            .arg(&nh_i)
            .arg(&nkvh_i)
            .arg(&scale_log2);
        if tma {
            b.arg(&mk).arg(&mv);
        }
        // SAFETY: matches `attn_flash_wg_bf16_{hd}` / `attn_flash_wg3tmal*_bf16_{hd}` (block
        // 256 / 384 threads, their launch bounds; the argument list of the flash.cu
        // instances; workspace addresses as u64, 0 when unused: written only when
        // gridDim.y > 1); lengths checked by check_args, tiles and workspace sized above;
        // `attn_flash_wg3tmal*_*` take the two tensor maps (by value, 128 bytes each) of k
        // and v, which outlive the launch's reads in stream order like k and v themselves.
        unsafe { b.launch(cfg) }?;
    }
    if nsplit > 1 {
        flash_merge_splits(gpu, wo_p, wml_p, o, rows, hd, nsplit)?;
    }
    Ok(())
}

/// Head dims of the decode kernel (`attn_decode_bf16_{hd}` in `kernels/attn.cu`).
pub const DECODE_HEAD_DIMS: [usize; 2] = [128, 256];
/// Fewest keys per split of the decode kernel's own plan ([`decode`] with `split: None`).
pub const DECODE_KEYS_PER_SPLIT: usize = 64;
/// Most key splits of the decode kernel's own plan (the merge reads every split's row:
/// more splits shorten each warp's key loop but lengthen the merge).
pub const DECODE_PLAN_MAX_SPLIT: usize = 128;
/// Most key splits of the decode kernel.
pub const DECODE_MAX_SPLIT: usize = 1024;
/// Most query heads per kv head of the decode kernel (one warp each; its launch bound of
/// 256 threads leaves each thread the registers for eight K and V rows in flight).
pub const DECODE_MAX_GROUP: usize = 8;

/// Attention of one query token (decode) over `n_kv` cached keys at any positions,
/// split over the keys ("flash-decoding", `kernels/attn.cu`: `attn_decode_bf16_{hd}` then
/// `attn_decode_combine_bf16`): the same contract as [`prefill`] with `tq = 1`.
///
/// * `q`: `[1, nh, hd]`, `q_pos`: `[1]` i64; `k`, `v`: `[n_kv, nkv, hd]`, `kv_pos`:
///   `[n_kv]` i64 (key j visible iff `kv_pos[j] ≤ q_pos[0]`); `o`: `[1, nh, hd]` (zeros
///   when no key is visible).
/// * `split`: key ranges per kv head (`None`: at least [`DECODE_KEYS_PER_SPLIT`] keys
///   each, at most [`DECODE_PLAN_MAX_SPLIT`] ranges; given: clamped to
///   `1..=`[`DECODE_MAX_SPLIT`]); one block per (kv head, range) whose warps are the
///   group's query heads, so each K/V row is read from memory once per group.
///
/// Workspace: `nsplit·nh·(hd + 2)` floats (scratch). bf16 only, `hd` ∈
/// [`DECODE_HEAD_DIMS`], `nh / nkv ≤` [`DECODE_MAX_GROUP`]; otherwise [`CudaError::Shape`]
/// (never a panic).
#[allow(clippy::too_many_arguments)]
pub fn decode<T: Elem>(
    gpu: &Gpu,
    q: &CudaSlice<T>,
    q_pos: &CudaSlice<i64>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    kv_pos: &CudaSlice<i64>,
    o: &mut CudaSlice<T>,
    n_kv: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    split: Option<usize>,
) -> Result<()> {
    check_decode_kernel::<T>("attn::decode", nh, nkv, hd)?;
    check_args(q, q_pos, k, v, kv_pos, o, 1, n_kv, nh, nkv, hd)?;
    let group = nh / nkv;
    if nh == 0 {
        return Ok(());
    }
    let nsplit = split
        .unwrap_or_else(|| decode_plan(n_kv))
        .clamp(1, DECODE_MAX_SPLIT);
    let mut wo = gpu.scratch::<f32>(nsplit * nh * hd)?;
    let mut wml = gpu.scratch::<f32>(nsplit * nh * 2)?;
    let (n_i, nh_i, nkv_i) = (i32_dim("n_kv", n_kv)?, nh as i32, nkv as i32);
    let scale_log2 = (hd as f32).powf(-0.5) * std::f32::consts::LOG2_E;
    let stream = gpu.stream();
    let f = gpu.function(&ATTN, &format!("attn_decode_bf16_{hd}"), 0)?;
    let cfg = LaunchConfig {
        grid_dim: (nkv as u32, nsplit as u32, 1),
        block_dim: (32 * group as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&f);
    b.arg(q)
        .arg(q_pos)
        .arg(k)
        .arg(v)
        .arg(kv_pos)
        .arg(&mut wo)
        .arg(&mut wml)
        .arg(&n_i)
        .arg(&nh_i)
        .arg(&nkv_i)
        .arg(&scale_log2);
    // SAFETY: matches `attn_decode_bf16_{hd}` (block 32·G ≤ 256 threads); lengths checked
    // by check_args (q: nh·hd, k/v: n_kv·nkv·hd, kv_pos: n_kv, q_pos: 1); wo/wml sized for
    // nsplit·nh rows, every (split, head) row written by its warp.
    unsafe { b.launch(cfg) }?;
    let f = gpu.function(&ATTN, "attn_decode_combine_bf16", 0)?;
    let cfg = LaunchConfig {
        grid_dim: (nh as u32, 1, 1),
        block_dim: (hd as u32, 1, 1),
        shared_mem_bytes: (nsplit * 4) as u32,
    };
    let (hd_i, ns_i) = (hd as i32, nsplit as i32);
    let mut b = stream.launch_builder(&f);
    b.arg(&wo).arg(&wml).arg(o).arg(&nh_i).arg(&hd_i).arg(&ns_i);
    // SAFETY: matches `attn_decode_combine_bf16`; wo/wml written above for nsplit·nh rows,
    // o holds nh·hd elements; nsplit floats of dynamic shared memory (≤ 4 KiB).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// [`decode`] (its own split plan, `split: None`) with the key count read from the
/// device: `n_kv_dev` holds one i32, the number of valid keys `n` (`1 ≤ n ≤ cap`),
/// written before the launch runs. The grid is sized for `cap` keys (the cache's
/// capacity): ranges `0..plan(n)` do the work of [`decode`] for `n` keys (the same
/// ranges, the same arithmetic, so the same bits), the blocks of later ranges exit, and
/// the merge reads only the first `plan(n)` ranges. One launch therefore serves every
/// length up to `cap`, as a CUDA graph replaying the decode step needs.
///
/// * `q`, `q_pos`, `o` as [`decode`]; `k`, `v`: `[cap, nkv, hd]`, `kv_pos`: `[cap]`.
///
/// Workspace: `plan(cap)·nh·(hd + 2)` floats (scratch). Errors: as [`decode`], with
/// `cap` in place of `n_kv` for the buffer lengths.
#[allow(clippy::too_many_arguments)]
pub fn decode_dev<T: Elem>(
    gpu: &Gpu,
    q: &CudaSlice<T>,
    q_pos: &CudaSlice<i64>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    kv_pos: &CudaSlice<i64>,
    o: &mut CudaSlice<T>,
    n_kv_dev: &cudarc::driver::CudaView<'_, i32>,
    cap: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
) -> Result<()> {
    check_decode_kernel::<T>("attn::decode_dev", nh, nkv, hd)?;
    check_args(q, q_pos, k, v, kv_pos, o, 1, cap, nh, nkv, hd)?;
    let group = nh / nkv;
    if nh == 0 || cap == 0 || n_kv_dev.is_empty() {
        return Err(CudaError::Shape(
            "attn::decode_dev: empty cache or counter".into(),
        ));
    }
    i32_dim("cap", cap)?;
    let nsplit = decode_plan(cap);
    let mut wo = gpu.scratch::<f32>(nsplit * nh * hd)?;
    let mut wml = gpu.scratch::<f32>(nsplit * nh * 2)?;
    let (nh_i, nkv_i) = (nh as i32, nkv as i32);
    let scale_log2 = (hd as f32).powf(-0.5) * std::f32::consts::LOG2_E;
    let stream = gpu.stream();
    let f = gpu.function(&ATTN, &format!("attn_decode_dev_bf16_{hd}"), 0)?;
    let cfg = LaunchConfig {
        grid_dim: (nkv as u32, nsplit as u32, 1),
        block_dim: (32 * group as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&f);
    b.arg(q)
        .arg(q_pos)
        .arg(k)
        .arg(v)
        .arg(kv_pos)
        .arg(&mut wo)
        .arg(&mut wml)
        .arg(n_kv_dev)
        .arg(&nh_i)
        .arg(&nkv_i)
        .arg(&scale_log2);
    // SAFETY: matches `attn_decode_dev_bf16_{hd}`; buffers checked for `cap` keys and the
    // kernel reads keys below n ≤ cap (the caller's contract); wo/wml hold plan(cap) ≥
    // plan(n) ranges, each range below plan(n) written by its warps before the merge.
    unsafe { b.launch(cfg) }?;
    let f = gpu.function(&ATTN, "attn_decode_combine_dev_bf16", 0)?;
    let cfg = LaunchConfig {
        grid_dim: (nh as u32, 1, 1),
        block_dim: (hd as u32, 1, 1),
        shared_mem_bytes: (DECODE_PLAN_MAX_SPLIT * 4) as u32,
    };
    let hd_i = hd as i32;
    let mut b = stream.launch_builder(&f);
    b.arg(&wo)
        .arg(&wml)
        .arg(o)
        .arg(&nh_i)
        .arg(&hd_i)
        .arg(n_kv_dev);
    // SAFETY: matches `attn_decode_combine_dev_bf16`; it reads plan(n) ≤ nsplit ranges of
    // wo/wml, o holds nh·hd elements; shared memory for the most ranges a plan has.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// [`prefill`] with the key count read from the device (`n_kv_dev`: one i32, `n ≤ cap`):
/// the same blocks and arithmetic as [`prefill`] over `n` keys, the grid independent of
/// `n` (so a recorded launch serves every length). `k`, `v`: `[cap, nkv, hd]`,
/// `kv_pos`: `[cap]`; other arguments and errors as [`prefill`].
#[allow(clippy::too_many_arguments)]
pub fn prefill_dev<T: Elem>(
    gpu: &Gpu,
    q: &CudaSlice<T>,
    q_pos: &CudaSlice<i64>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    kv_pos: &CudaSlice<i64>,
    o: &mut CudaSlice<T>,
    tq: usize,
    n_kv_dev: &cudarc::driver::CudaView<'_, i32>,
    cap: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
) -> Result<()> {
    check_args(q, q_pos, k, v, kv_pos, o, tq, cap, nh, nkv, hd)?;
    if n_kv_dev.is_empty() {
        return Err(CudaError::Shape("attn::prefill_dev: empty counter".into()));
    }
    if tq == 0 || nh == 0 {
        return Ok(());
    }
    const AQ: usize = 16;
    const AK: usize = 32;
    let smem = ((AQ * hd + AK * (hd + 4) + AK * hd) * 4) as u32;
    let f = gpu.function(&ATTN, &format!("attn_prefill_dev_{}_{hd}", T::SUFFIX), smem)?;
    let cfg = LaunchConfig {
        grid_dim: (tq.div_ceil(AQ) as u32, nh as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem,
    };
    let scale = (hd as f32).powf(-0.5);
    let (a, c, e) = (tq as i32, nh as i32, nkv as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(q)
        .arg(k)
        .arg(v)
        .arg(q_pos)
        .arg(kv_pos)
        .arg(o)
        .arg(&a)
        .arg(n_kv_dev)
        .arg(&c)
        .arg(&e)
        .arg(&scale);
    // SAFETY: matches `attn_prefill_dev_*` in attn.cu; lengths checked above for `cap`
    // keys, the kernel reads keys below n ≤ cap (the caller's contract).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Appends one row to a KV cache at row `n − 1`, `n` read from the device
/// (`n_kv_dev`: one i32, `1 ≤ n ≤ cap`, the length after the append): `k`, `v`:
/// `[row]` → `kc`, `vc`: `[cap, row]`; `pos`: `[1]` → `pc`: `[cap]`.
///
/// Errors: [`CudaError::Shape`] when a buffer is shorter than its shape.
#[allow(clippy::too_many_arguments)]
pub fn kv_append_dev<T: Elem>(
    gpu: &Gpu,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    pos: &CudaSlice<i64>,
    kc: &CudaSlice<T>,
    vc: &CudaSlice<T>,
    pc: &CudaSlice<i64>,
    n_kv_dev: &cudarc::driver::CudaView<'_, i32>,
    cap: usize,
    row: usize,
) -> Result<()> {
    check_len("k", k, row)?;
    check_len("v", v, row)?;
    check_len("pos", pos, 1)?;
    check_len("k cache", kc, cap * row)?;
    check_len("v cache", vc, cap * row)?;
    check_len("pos cache", pc, cap)?;
    if n_kv_dev.is_empty() || row == 0 {
        return Err(CudaError::Shape(
            "kv_append_dev: empty counter or row".into(),
        ));
    }
    let ri = i32_dim("row", row)?;
    let f = gpu.function(&ATTN, &format!("kv_append_dev_{}", T::SUFFIX), 0)?;
    let cfg = LaunchConfig {
        grid_dim: (row.div_ceil(256).min(64) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(k)
        .arg(v)
        .arg(pos)
        .arg(kc)
        .arg(vc)
        .arg(pc)
        .arg(n_kv_dev)
        .arg(&ri);
    // SAFETY: matches `kv_append_dev_*`; the caches hold `cap` rows (checked) and the
    // kernel writes row n − 1 < cap (the caller's contract); the sources hold one row.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// What the split-key decode kernels take: bf16, `hd` in [`DECODE_HEAD_DIMS`], `nh` a
/// multiple of `nkv > 0` with at most [`DECODE_MAX_GROUP`] query heads per kv head.
/// Errors: [`CudaError::Shape`] naming `what` and the offending shape.
pub(crate) fn check_decode_kernel<T: Elem>(
    what: &str,
    nh: usize,
    nkv: usize,
    hd: usize,
) -> Result<()> {
    if T::SUFFIX != "bf16" || !DECODE_HEAD_DIMS.contains(&hd) {
        return Err(CudaError::Shape(format!(
            "{what} takes bf16 with head_dim in {DECODE_HEAD_DIMS:?}, got {} × {hd}",
            T::SUFFIX
        )));
    }
    if nkv == 0 || !nh.is_multiple_of(nkv) || nh / nkv > DECODE_MAX_GROUP {
        return Err(CudaError::Shape(format!(
            "{what} needs nh a multiple of nkv with at most {DECODE_MAX_GROUP} query heads \
             per kv head, got {nh} / {nkv}"
        )));
    }
    Ok(())
}

/// Splits per sequence of [`decode_rows`]'s workspace for caches of up to `n` keys:
/// the plan of [`decode`] / [`decode_dev`] for `n` (at least 1, at most
/// [`DECODE_PLAN_MAX_SPLIT`]).
pub fn decode_plan(n: usize) -> usize {
    n.div_ceil(DECODE_KEYS_PER_SPLIT)
        .clamp(1, DECODE_PLAN_MAX_SPLIT)
}

/// Checks of a `[3, B]` KV address table and a `[B]` length vector.
fn check_rows_table(
    what: &str,
    tbl: &cudarc::driver::CudaView<'_, u64>,
    n_kv: &cudarc::driver::CudaView<'_, i32>,
    bsz: usize,
) -> Result<()> {
    if tbl.len() < 3 * bsz || n_kv.len() < bsz {
        return Err(CudaError::Shape(format!(
            "{what}: {} table entries and {} lengths for {bsz} sequences (need {} and {bsz})",
            tbl.len(),
            n_kv.len(),
            3 * bsz
        )));
    }
    if bsz > 65_535 {
        return Err(CudaError::Shape(format!(
            "{what}: {bsz} sequences over the grid's 65 535"
        )));
    }
    Ok(())
}

/// [`kv_append_dev`] for one decode token of each of `bsz` sequences whose KV caches
/// live in separate buffers, in one launch (`kv_append_rows_*` in attn.cu): row `b` of
/// `k`, `v` (`[B, row]`) and `pos` (`[B]`) goes to row `n_kv[b] − 1` of sequence `b`'s
/// caches, found in `tbl` (`[3, B]` u64: the B key-cache, the B value-cache, then the B
/// position-cache device addresses).
///
/// Errors: `k`, `v` shorter than `bsz·row`, `pos` than `bsz`, a table shorter than
/// `3·bsz` or lengths than `bsz`; `bsz` over 65 535; `row == 0`.
///
/// # Safety
/// For every `b < bsz`, `tbl`'s three entries must be live device buffers of this
/// device holding at least `n_kv[b]` rows (`[n, row]` of `T`, `[n]` i64), `n_kv[b] ≥ 1`
/// when the launch runs, the caches of different sequences disjoint, none overlapping
/// the inputs, none freed before the launch completes.
#[allow(clippy::too_many_arguments)]
pub unsafe fn kv_append_rows<T: Elem>(
    gpu: &Gpu,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    pos: &CudaSlice<i64>,
    tbl: &cudarc::driver::CudaView<'_, u64>,
    n_kv: &cudarc::driver::CudaView<'_, i32>,
    bsz: usize,
    row: usize,
) -> Result<()> {
    check_len("k [B, row]", k, bsz * row)?;
    check_len("v [B, row]", v, bsz * row)?;
    check_len("pos [B]", pos, bsz)?;
    check_rows_table("kv_append_rows", tbl, n_kv, bsz)?;
    if bsz == 0 {
        return Ok(());
    }
    if row == 0 {
        return Err(CudaError::Shape("kv_append_rows: empty row".into()));
    }
    let (ri, bi) = (i32_dim("row", row)?, bsz as i32);
    let f = gpu.function(&ATTN, &format!("kv_append_rows_{}", T::SUFFIX), 0)?;
    let cfg = LaunchConfig {
        grid_dim: (row.div_ceil(256).min(64) as u32, bsz as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(k)
        .arg(v)
        .arg(pos)
        .arg(tbl)
        .arg(n_kv)
        .arg(&ri)
        .arg(&bi);
    // SAFETY: matches `kv_append_rows_*`; the sources are checked above, the caches and
    // lengths are the caller's contract.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// [`decode_dev`] for one query token of each of `bsz` sequences, each over its own KV
/// cache, in two launches (`attn_decode_rows_bf16_{hd}` then
/// `attn_decode_combine_rows_bf16`): row `b` of `q` (`[B, nh, hd]`, position
/// `q_pos[b]`) attends to the first `n_kv[b]` keys of the caches at `tbl`'s entries `b`
/// (`[3, B]` u64 as [`kv_append_rows`]; keys `[n, nkv, hd]`, positions `[n]`) and writes
/// row `b` of `o` (`[B, nh, hd]`). Each row is exactly [`decode`] over `n_kv[b]` keys.
///
/// `splits` (the grid's ranges per sequence) must be at least [`decode_plan`]`(n_kv[b])`
/// for every `b`, and `total` (the workspace's ranges) at least their sum: the
/// sequences' ranges are packed, each taking its own plan's, so a batch of mixed
/// lengths needs what its sequences need one by one. Sizing both from the caches'
/// capacities (the plan grows with the length) lets one recorded launch serve every
/// length up to them.
///
/// Workspace: `total·nh·(hd + 2)` floats (scratch). Errors: as [`decode`]; a table
/// shorter than `3·bsz` or a length vector shorter than `bsz`; `bsz` over 65 535;
/// `splits` outside `1..=`[`DECODE_PLAN_MAX_SPLIT`]; `total` under `bsz` or over i32.
///
/// # Safety
/// For every `b < bsz`, `tbl`'s entries must be live device buffers of this device
/// holding at least `n_kv[b]` keys, and when the launches run `1 ≤ n_kv[b]`,
/// `decode_plan(n_kv[b]) ≤ splits` and `Σ_b decode_plan(n_kv[b]) ≤ total` (the kernels
/// trap otherwise); none freed before the launches complete.
#[allow(clippy::too_many_arguments)]
pub unsafe fn decode_rows<T: Elem>(
    gpu: &Gpu,
    q: &CudaSlice<T>,
    q_pos: &CudaSlice<i64>,
    tbl: &cudarc::driver::CudaView<'_, u64>,
    n_kv: &cudarc::driver::CudaView<'_, i32>,
    o: &mut CudaSlice<T>,
    bsz: usize,
    (splits, total): (usize, usize),
    nh: usize,
    nkv: usize,
    hd: usize,
) -> Result<()> {
    check_decode_kernel::<T>("attn::decode_rows", nh, nkv, hd)?;
    if !(1..=DECODE_PLAN_MAX_SPLIT).contains(&splits) {
        return Err(CudaError::Shape(format!(
            "attn::decode_rows: {splits} splits outside 1..={DECODE_PLAN_MAX_SPLIT}"
        )));
    }
    check_len("q [B, nh, hd]", q, bsz * nh * hd)?;
    check_len("q_pos [B]", q_pos, bsz)?;
    check_len("o [B, nh, hd]", o, bsz * nh * hd)?;
    check_rows_table("attn::decode_rows", tbl, n_kv, bsz)?;
    if bsz == 0 || nh == 0 {
        return Ok(());
    }
    if total < bsz {
        return Err(CudaError::Shape(format!(
            "attn::decode_rows: a workspace of {total} ranges for {bsz} sequences"
        )));
    }
    let total_i = i32_dim("workspace ranges", total)?;
    let mut wo = gpu.scratch::<f32>(total * nh * hd)?;
    let mut wml = gpu.scratch::<f32>(total * nh * 2)?;
    let (nh_i, nkv_i, bsz_i) = (nh as i32, nkv as i32, bsz as i32);
    let scale_log2 = (hd as f32).powf(-0.5) * std::f32::consts::LOG2_E;
    let stream = gpu.stream();
    let f = gpu.function(&ATTN, &format!("attn_decode_rows_bf16_{hd}"), 0)?;
    let cfg = LaunchConfig {
        grid_dim: (nkv as u32, splits as u32, bsz as u32),
        block_dim: (32 * (nh / nkv) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&f);
    b.arg(q)
        .arg(q_pos)
        .arg(tbl)
        .arg(n_kv)
        .arg(&mut wo)
        .arg(&mut wml)
        .arg(&nh_i)
        .arg(&nkv_i)
        .arg(&scale_log2)
        .arg(&bsz_i)
        .arg(&total_i);
    // SAFETY: matches `attn_decode_rows_bf16_{hd}` (block 32·G ≤ 256 threads); q, q_pos
    // checked for bsz rows, wo/wml hold total·nh rows; the caches and lengths are the
    // caller's contract (plan(n_kv[b]) ≤ splits, their sum ≤ total; trapped otherwise).
    unsafe { b.launch(cfg) }?;
    let f = gpu.function(&ATTN, "attn_decode_combine_rows_bf16", 0)?;
    let cfg = LaunchConfig {
        grid_dim: (nh as u32, bsz as u32, 1),
        block_dim: (hd as u32, 1, 1),
        shared_mem_bytes: (DECODE_PLAN_MAX_SPLIT * 4) as u32,
    };
    let hd_i = hd as i32;
    let mut b = stream.launch_builder(&f);
    b.arg(&wo)
        .arg(&wml)
        .arg(o)
        .arg(&nh_i)
        .arg(&hd_i)
        .arg(n_kv)
        .arg(&total_i);
    // SAFETY: matches `attn_decode_combine_rows_bf16`; it reads sequence b's plan(n_kv[b])
    // ranges of wo/wml at its packed offset (within total, trapped otherwise), o holds
    // bsz·nh·hd elements; shared memory for the most ranges a plan has.
    unsafe { b.launch(cfg) }?;
    Ok(())
}
