//! Causal GQA attention prefill over KV placed at arbitrary positions — the seam case
//! of position-independent caching (queries of a recomputed window attend to cached
//! KV that was moved to new positions). CPU reference: `model::attention`.
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::compile::ATTN;
use super::{check_len, CudaError, CudaSlice, Elem, Gpu, Result};

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
    check_len("o", o, tq * nh * hd)?;
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
