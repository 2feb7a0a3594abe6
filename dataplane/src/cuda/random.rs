//! [`GpuModel::random`]: a model with deterministic random weights generated directly
//! on the device (kernel `dataplane/kernels/init.cu`), for benchmarks at real shapes
//! without a checkpoint and without a host copy of the weights (Qwen3.5-35B-A3B in
//! bf16 is about 70 GB). The generator, distributions, tensor ids and layouts are those
//! of [`crate::random`], so in fp32 every weight equals the CPU [`Model::random`] one
//! bit for bit; in bf16 it is that value rounded to nearest-even.
//!
//! [`Model::random`]: crate::model::Model::random
use std::sync::{Arc, Mutex};

use cudarc::cublas::{CudaBlas, Gemm};
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::compile::INIT;
use super::kimi::{KdaW, MlaW};
use super::lightning::LightningW;
use super::model::{check_config, AttnW, FfnPath, FfnW, GdnW, GpuModel, LayerW, MixerW, MlpW};
use super::{gdr, grid_for, moe, ops, CudaError, CudaSlice, Elem, Gpu, Result};
use crate::config::{MixerKind, ModelConfig};
use crate::random::{self as rnd, ParamCounts};

/// Device memory kept free beyond the weights for activations, workspaces and the
/// cuBLAS handle (bytes): 2 GiB.
pub const RANDOM_RESERVE_BYTES: usize = 2 << 30;

const BLOCK: u32 = 256;

fn launch_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid_for(n, BLOCK).min(65_535 * 4), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Uninitialised device buffer of `n` elements (at least one).
fn alloc<T: Elem>(gpu: &Gpu, n: usize) -> Result<CudaSlice<T>> {
    // SAFETY: every element is written by an init kernel before any read (callers
    // fill `0..n` completely).
    Ok(unsafe { gpu.stream().alloc::<T>(n.max(1)) }?)
}

/// Writes elements `0..n` of tensor `id` (symmetric uniform with bound `bound`) to
/// `out[off .. off + n]`.
fn fill_sym<T: Elem>(
    gpu: &Gpu,
    out: &mut CudaSlice<T>,
    off: usize,
    n: usize,
    seed: u64,
    id: u64,
    bound: f64,
) -> Result<()> {
    if off + n > out.len() {
        return Err(CudaError::Shape(format!(
            "random tensor {id}: {off} + {n} elements exceed the buffer of {}",
            out.len()
        )));
    }
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(&INIT, &format!("init_sym_{}", T::SUFFIX), 0)?;
    let (off, ni) = (off as i64, n as i64);
    let key = rnd::tensor_key(seed, id);
    let scale = rnd::sym_scale(bound);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(out).arg(&off).arg(&ni).arg(&key).arg(&scale);
    // SAFETY: matches `init_sym_*` in init.cu; off + n ≤ len checked above.
    unsafe { b.launch(launch_cfg(n)) }?;
    Ok(())
}

/// A new buffer holding tensor `id` of `n` elements with the linear-weight init.
fn lin<T: Elem>(
    gpu: &Gpu,
    n: usize,
    seed: u64,
    layer: Option<usize>,
    slot: u64,
) -> Result<CudaSlice<T>> {
    let mut x = alloc::<T>(gpu, n)?;
    fill_sym(
        gpu,
        &mut x,
        0,
        n,
        seed,
        rnd::tensor_id(layer, slot),
        rnd::linear_bound(),
    )?;
    Ok(x)
}

/// fp32 buffer of `n` copies of `v` (one element when `n` is 0).
fn constant(gpu: &Gpu, n: usize, v: f32) -> Result<CudaSlice<f32>> {
    if v == 0.0 {
        return gpu.zeros(n.max(1));
    }
    let mut x = alloc::<f32>(gpu, n)?;
    let f = gpu.function(&INIT, "fill_f32", 0)?;
    let ni = n.max(1) as i64;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&mut x).arg(&ni).arg(&v);
    // SAFETY: matches `fill_f32` in init.cu; x holds ni elements.
    unsafe { b.launch(launch_cfg(n.max(1))) }?;
    Ok(x)
}

/// A device buffer of `n` values of tensor id `id` (symmetric uniform with bound
/// `bound`, the [`crate::random`] generator; e.g. benchmark inputs that are never zeros).
pub fn random_buffer<T: Elem>(
    gpu: &Gpu,
    n: usize,
    seed: u64,
    id: u64,
    bound: f64,
) -> Result<CudaSlice<T>> {
    let mut x = alloc::<T>(gpu, n)?;
    fill_sym(gpu, &mut x, 0, n, seed, id, bound)?;
    Ok(x)
}

fn mlp<T: Elem>(
    gpu: &Gpu,
    h: usize,
    inter: usize,
    seed: u64,
    l: usize,
    gu: u64,
    dn: u64,
) -> Result<MlpW<T>> {
    Ok(MlpW {
        gate_up: lin(gpu, 2 * inter * h, seed, Some(l), gu)?,
        down: lin(gpu, h * inter, seed, Some(l), dn)?,
        inter,
    })
}

/// Checks the MoE part of a config against the fused MoE kernels' limits.
pub(crate) fn check_moe_config(c: &ModelConfig) -> Result<()> {
    if c.layer_is_moe.iter().any(|&m| m) {
        let (e, k) = (c.num_experts, c.experts_per_tok);
        if e == 0 || e > moe::MAX_EXPERTS || k == 0 || k > e.min(moe::MAX_TOP_K) {
            return Err(CudaError::Shape(format!(
                "MoE with {e} experts, top-{k} (supported: 1..={} experts, top-k ≤ min(E, {}))",
                moe::MAX_EXPERTS,
                moe::MAX_TOP_K
            )));
        }
        if c.moe_intermediate_size == 0 {
            return Err(CudaError::Shape("moe_intermediate_size must be > 0".into()));
        }
    }
    Ok(())
}

pub(crate) fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

impl<T: Elem> GpuModel<T>
where
    CudaBlas: Gemm<T>,
{
    /// A model of shape `config` with deterministic random weights from `seed`,
    /// generated on `gpu` (see [`crate::random`] for the exact generator; in fp32 the
    /// weights equal [`crate::model::Model::random`]`(config, seed)` bit for bit). FFN
    /// path [`FfnPath::Fused`].
    ///
    /// Errors: [`CudaError::Shape`] for a configuration the kernels do not support
    /// (as [`GpuModel::upload`]); [`CudaError::Unavailable`] when the weights
    /// ([`ParamCounts::bytes`]) plus [`RANDOM_RESERVE_BYTES`] exceed the free device
    /// memory (the message gives both); driver errors.
    pub fn random(gpu: Arc<Gpu>, config: ModelConfig, seed: u64) -> Result<Self> {
        let c = config;
        check_config(&c)?;
        check_moe_config(&c)?;
        let need = ParamCounts::of(&c).bytes(std::mem::size_of::<T>());
        let (free, total) = gpu.context().mem_get_info()?;
        if need + RANDOM_RESERVE_BYTES > free {
            return Err(CudaError::Unavailable(format!(
                "random {} weights need {:.2} GiB (+ {:.1} GiB reserve) but {} has only {:.2} GiB free of {:.2} GiB",
                std::any::type_name::<T>(),
                gib(need),
                gib(RANDOM_RESERVE_BYTES),
                gpu.name(),
                gib(free),
                gib(total)
            )));
        }
        let g = &*gpu;
        let h = c.hidden_size;
        let embed = lin::<T>(g, c.vocab_size * h, seed, None, rnd::SLOT_EMBED)?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(lin::<T>(
                g,
                c.vocab_size * h,
                seed,
                None,
                rnd::SLOT_LM_HEAD,
            )?)
        };
        let (nh, nkv, hd, hv) = (c.num_heads, c.num_kv_heads, c.head_dim, c.linear_v_heads);
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let mixer = match c.mixers[l] {
                MixerKind::GatedDeltaNet => {
                    let n_in = c.conv_dim() + c.value_dim() + 2 * hv;
                    let nconv = c.conv_dim() * c.conv_kernel;
                    let mut conv = alloc::<f32>(g, nconv)?;
                    fill_sym(
                        g,
                        &mut conv,
                        0,
                        nconv,
                        seed,
                        rnd::tensor_id(Some(l), rnd::SLOT_GDN_CONV),
                        rnd::conv_bound(c.conv_kernel),
                    )?;
                    let mut neg_a = alloc::<f32>(g, hv)?;
                    let f = g.function(&INIT, "init_neg_a_f32", 0)?;
                    let key = rnd::tensor_key(seed, rnd::tensor_id(Some(l), rnd::SLOT_GDN_A));
                    let n = hv as i64;
                    let mut b = g.stream().launch_builder(&f);
                    b.arg(&mut neg_a).arg(&n).arg(&key);
                    // SAFETY: matches `init_neg_a_f32`; neg_a holds max(hv, 1) ≥ n elements.
                    unsafe { b.launch(launch_cfg(hv.max(1))) }?;
                    MixerW::GatedDeltaNet(GdnW {
                        w_in: lin(g, n_in * h, seed, Some(l), rnd::SLOT_GDN_IN)?,
                        conv,
                        neg_a,
                        dt_bias: constant(g, hv, 1.0)?,
                        norm: constant(g, c.linear_v_dim, 1.0)?,
                        out: lin(g, h * c.value_dim(), seed, Some(l), rnd::SLOT_GDN_OUT)?,
                    })
                }
                MixerKind::Lightning => {
                    // Fused rows query_key_value | g_proj, each its own tensor id (as
                    // the CPU model).
                    let wd = c.linear_v_heads * c.linear_k_dim;
                    let mut w_in = alloc::<T>(g, 4 * wd * h)?;
                    let lb = rnd::linear_bound();
                    let id = |s| rnd::tensor_id(Some(l), s);
                    fill_sym(
                        g,
                        &mut w_in,
                        0,
                        3 * wd * h,
                        seed,
                        id(rnd::SLOT_LIGHTNING_QKV),
                        lb,
                    )?;
                    fill_sym(
                        g,
                        &mut w_in,
                        3 * wd * h,
                        wd * h,
                        seed,
                        id(rnd::SLOT_LIGHTNING_G),
                        lb,
                    )?;
                    let log_decay = crate::mixers::lightning::layer::layer_log_decay(&c, l);
                    MixerW::Lightning(LightningW {
                        w_in,
                        q_norm: constant(g, c.linear_k_dim, 0.0)?,
                        k_norm: constant(g, c.linear_k_dim, 0.0)?,
                        g_norm: constant(g, wd, 1.0)?,
                        dense: lin(g, h * wd, seed, Some(l), rnd::SLOT_LIGHTNING_DENSE)?,
                        log_decay: g.upload(&log_decay)?,
                        log_decay_host: log_decay,
                    })
                }
                MixerKind::Kda => {
                    // As `Model::random`: one tensor id per weight (the merged
                    // in-projection is one tensor there too).
                    let (d, nkh) = (c.linear_k_dim, c.linear_v_heads);
                    let wd = nkh * c.linear_v_dim;
                    let n_in = 3 * wd + 2 * d + nkh;
                    let nconv = 3 * wd * c.conv_kernel;
                    let mut conv = alloc::<f32>(g, nconv)?;
                    fill_sym(
                        g,
                        &mut conv,
                        0,
                        nconv,
                        seed,
                        rnd::tensor_id(Some(l), rnd::SLOT_KDA_CONV),
                        rnd::conv_bound(c.conv_kernel),
                    )?;
                    let mut neg_a = alloc::<f32>(g, nkh)?;
                    let f = g.function(&INIT, "init_neg_a_f32", 0)?;
                    let key = rnd::tensor_key(seed, rnd::tensor_id(Some(l), rnd::SLOT_KDA_A));
                    let n = nkh as i64;
                    let mut b = g.stream().launch_builder(&f);
                    b.arg(&mut neg_a).arg(&n).arg(&key);
                    // SAFETY: matches `init_neg_a_f32`; neg_a holds max(nkh, 1) ≥ n elements.
                    unsafe { b.launch(launch_cfg(nkh.max(1))) }?;
                    MixerW::Kda(KdaW {
                        w_in: lin(g, n_in * h, seed, Some(l), rnd::SLOT_KDA_IN)?,
                        f_b: lin(g, wd * d, seed, Some(l), rnd::SLOT_KDA_FB)?,
                        g_b: lin(g, wd * d, seed, Some(l), rnd::SLOT_KDA_GB)?,
                        conv,
                        neg_a,
                        dt_bias: constant(g, wd, 1.0)?,
                        o_norm: constant(g, d, 1.0)?,
                        o_proj: lin(g, h * wd, seed, Some(l), rnd::SLOT_KDA_O)?,
                    })
                }
                MixerKind::Mla => {
                    // q_proj | kv_a_proj_with_mqa in one buffer (their own tensor ids),
                    // kv_b_proj generated whole and split per head into the key and
                    // value expansions (as `Model::random`).
                    let m = c.mla;
                    let (r, nope, vd) = (m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim);
                    let qw = nh * m.qk_head_dim();
                    let lb = rnd::linear_bound();
                    let id = |s| rnd::tensor_id(Some(l), s);
                    let mut w_in = alloc::<T>(g, (qw + m.row()) * h)?;
                    fill_sym(g, &mut w_in, 0, qw * h, seed, id(rnd::SLOT_MLA_Q), lb)?;
                    fill_sym(
                        g,
                        &mut w_in,
                        qw * h,
                        m.row() * h,
                        seed,
                        id(rnd::SLOT_MLA_KV_A),
                        lb,
                    )?;
                    let kv_b: CudaSlice<T> =
                        lin(g, nh * (nope + vd) * r, seed, Some(l), rnd::SLOT_MLA_KV_B)?;
                    let mut w_uk = alloc::<T>(g, nh * nope * r)?;
                    let mut w_uv = alloc::<T>(g, nh * vd * r)?;
                    let st = g.stream();
                    for hd_ in 0..nh {
                        let a = hd_ * (nope + vd) * r;
                        st.memcpy_dtod(
                            &kv_b.slice(a..a + nope * r),
                            &mut w_uk.slice_mut(hd_ * nope * r..(hd_ + 1) * nope * r),
                        )?;
                        st.memcpy_dtod(
                            &kv_b.slice(a + nope * r..a + (nope + vd) * r),
                            &mut w_uv.slice_mut(hd_ * vd * r..(hd_ + 1) * vd * r),
                        )?;
                    }
                    MixerW::Mla(MlaW {
                        w_in,
                        kv_norm: constant(g, r, 1.0)?,
                        w_uk,
                        w_uv,
                        o: lin(g, h * nh * vd, seed, Some(l), rnd::SLOT_MLA_O)?,
                    })
                }
                MixerKind::Attention => {
                    // Fused rows q | k | v: one tensor id each for the split layout, one
                    // for a stored `query_key_value` (as the CPU model).
                    let qw = nh * hd * if c.attn_output_gate { 2 } else { 1 };
                    let kvw = nkv * hd;
                    let mut qkv = alloc::<T>(g, (qw + 2 * kvw) * h)?;
                    let lb = rnd::linear_bound();
                    let id = |s| rnd::tensor_id(Some(l), s);
                    if c.attn_proj == crate::config::AttnProjLayout::FusedQkv {
                        // One stored `query_key_value` tensor (as the CPU model).
                        fill_sym(
                            g,
                            &mut qkv,
                            0,
                            (qw + 2 * kvw) * h,
                            seed,
                            id(rnd::SLOT_ATTN_QKV),
                            lb,
                        )?;
                    } else {
                        fill_sym(g, &mut qkv, 0, qw * h, seed, id(rnd::SLOT_ATTN_Q), lb)?;
                        fill_sym(g, &mut qkv, qw * h, kvw * h, seed, id(rnd::SLOT_ATTN_K), lb)?;
                        fill_sym(
                            g,
                            &mut qkv,
                            (qw + kvw) * h,
                            kvw * h,
                            seed,
                            id(rnd::SLOT_ATTN_V),
                            lb,
                        )?;
                    }
                    MixerW::Attention(AttnW {
                        qkv,
                        o: lin(g, h * nh * hd, seed, Some(l), rnd::SLOT_ATTN_O)?,
                        q_norm: constant(g, hd, 0.0)?,
                        k_norm: constant(g, hd, 0.0)?,
                    })
                }
            };
            let ffn = if c.layer_is_moe[l] {
                let (e, i, si) = (
                    c.num_experts,
                    c.moe_intermediate_size,
                    c.shared_expert_intermediate_size,
                );
                // Router rows [E, H], plus the shared-expert gate as row E.
                let gated = c.names.shared_expert_gate.is_some();
                let rows = e + usize::from(si > 0 && gated);
                let mut router = alloc::<T>(g, rows * h)?;
                let lb = rnd::linear_bound();
                let id = |s| rnd::tensor_id(Some(l), s);
                fill_sym(g, &mut router, 0, e * h, seed, id(rnd::SLOT_MOE_ROUTER), lb)?;
                let shared = if si > 0 {
                    if gated {
                        fill_sym(
                            g,
                            &mut router,
                            e * h,
                            h,
                            seed,
                            id(rnd::SLOT_SHARED_GATE),
                            lb,
                        )?;
                    }
                    Some((
                        lin(g, 2 * si * h, seed, Some(l), rnd::SLOT_SHARED_GATE_UP)?,
                        lin(g, h * si, seed, Some(l), rnd::SLOT_SHARED_DOWN)?,
                    ))
                } else {
                    None
                };
                FfnW::MoeFused(moe::MoeWeights {
                    hidden: h,
                    inter: i,
                    shared_inter: si,
                    num_experts: e,
                    top_k: c.experts_per_tok,
                    norm_topk_prob: c.norm_topk_prob,
                    router,
                    gate_up: lin(g, e * 2 * i * h, seed, Some(l), rnd::SLOT_MOE_GATE_UP)?,
                    down: lin(g, e * h * i, seed, Some(l), rnd::SLOT_MOE_DOWN)?,
                    shared,
                    shared_gated: gated,
                    // HF initialises the selection bias to zeros (as `Model::random`).
                    rule: moe::DeviceRouter::needed(&c.router)
                        .then(|| {
                            let bias = c.router.selection_bias.map(|_| vec![0f32; e]);
                            moe::DeviceRouter::upload(
                                g,
                                &c.router,
                                bias.as_deref(),
                                e,
                                c.experts_per_tok,
                            )
                        })
                        .transpose()?,
                })
            } else {
                FfnW::Dense(mlp(
                    g,
                    h,
                    c.intermediate_size,
                    seed,
                    l,
                    rnd::SLOT_MLP_GATE_UP,
                    rnd::SLOT_MLP_DOWN,
                )?)
            };
            layers.push(LayerW {
                input_norm: constant(g, h, 0.0)?,
                post_norm: constant(g, h, 0.0)?,
                mixer,
                ffn,
            });
        }
        let inv_freq = if c.rotary_dim >= 2 {
            Some(g.upload(&ops::rope_inv_freq(c.rotary_dim, c.rope_theta))?)
        } else {
            None
        };
        let final_norm = constant(g, h, 0.0)?;
        gpu.sync()?;
        Ok(GpuModel {
            gpu,
            config: c,
            embed,
            final_norm,
            lm_head,
            layers,
            inv_freq,
            gdr_ws: Mutex::new(gdr::Workspace::new()),
            moe_ws: Mutex::new(moe::MoeWorkspace::new()),
            graphs: super::graph::DecodeGraphs::default(),
            ffn_path: FfnPath::Fused,
        })
    }

    /// Downloads the embedding table `[vocab, hidden]` (for tests; waits for the
    /// stream).
    pub fn embedding_to_host(&self) -> Result<Vec<T>> {
        self.gpu.download(&self.embed)
    }

    /// Device bytes of the weights (every buffer this model owns, excluding the
    /// workspaces).
    pub fn weight_bytes(&self) -> usize {
        fn b<U>(x: &CudaSlice<U>) -> usize {
            x.len() * std::mem::size_of::<U>()
        }
        let mut n = b(&self.embed) + b(&self.final_norm) + self.lm_head.as_ref().map_or(0, b);
        n += self.inv_freq.as_ref().map_or(0, b);
        for l in &self.layers {
            n += b(&l.input_norm) + b(&l.post_norm);
            n += match &l.mixer {
                MixerW::GatedDeltaNet(w) => {
                    b(&w.w_in) + b(&w.conv) + b(&w.neg_a) + b(&w.dt_bias) + b(&w.norm) + b(&w.out)
                }
                MixerW::Attention(w) => b(&w.qkv) + b(&w.o) + b(&w.q_norm) + b(&w.k_norm),
                MixerW::Lightning(w) => {
                    b(&w.w_in)
                        + b(&w.q_norm)
                        + b(&w.k_norm)
                        + b(&w.g_norm)
                        + b(&w.dense)
                        + b(&w.log_decay)
                }
                MixerW::Kda(w) => {
                    b(&w.w_in)
                        + b(&w.f_b)
                        + b(&w.g_b)
                        + b(&w.conv)
                        + b(&w.neg_a)
                        + b(&w.dt_bias)
                        + b(&w.o_norm)
                        + b(&w.o_proj)
                }
                MixerW::Mla(w) => b(&w.w_in) + b(&w.kv_norm) + b(&w.w_uk) + b(&w.w_uv) + b(&w.o),
            };
            let mb = |m: &MlpW<T>| b(&m.gate_up) + b(&m.down);
            n += match &l.ffn {
                FfnW::Dense(m) => mb(m),
                FfnW::Moe(m) => {
                    b(&m.router)
                        + m.experts.iter().map(mb).sum::<usize>()
                        + m.shared.as_ref().map_or(0, |(s, g)| mb(s) + b(g))
                        + m.shared_plain.as_ref().map_or(0, mb)
                }
                FfnW::MoeFused(m) => {
                    b(&m.router)
                        + b(&m.gate_up)
                        + b(&m.down)
                        + m.shared.as_ref().map_or(0, |(x, y)| b(x) + b(y))
                        + m.rule.as_ref().and_then(|r| r.bias.as_ref()).map_or(0, b)
                }
            };
        }
        n
    }
}
