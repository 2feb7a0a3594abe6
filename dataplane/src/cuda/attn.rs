//! Causal GQA attention prefill over KV placed at arbitrary positions — the seam case
//! of position-independent caching (queries of a recomputed window attend to cached
//! KV that was moved to new positions). CPU reference: `model::attention`.
//!
//! Two implementations of one contract: [`prefill`], a tiled SIMT kernel with fp32
//! online softmax (decode, seam windows, short spans; the reference on the device),
//! and [`prefill_fast`], two cuBLAS strided-batched GEMMs around a masked row softmax
//! per query block (tensor cores for bf16; `GpuModel` uses it for spans of
//! ≥ `model::ATTN_FAST_MIN_TQ` tokens). Tests: `dataplane/tests/cuda_attn.rs`.
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::compile::ATTN;
use super::{check_len, CudaError, CudaSlice, Elem, Gpu, Result};

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
