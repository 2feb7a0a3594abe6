//! Whole-model forward on the GPU: [`GpuModel`] (all weights on the device in dtype
//! `T`, `f32` or `half::bf16`) and [`GpuState`] (per-layer device state of one
//! sequence). Same math as the CPU reference `model::Model::prefill` / `decode`:
//!
//! * per layer: zero-centred RMSNorm → mixer → residual add → zero-centred RMSNorm →
//!   FFN (dense SwiGLU or MoE) → residual add; then final norm and LM head (tied or not);
//! * GDN mixer: fused in-projection `[T, conv_dim + value_dim + 2·Hv]` (rows
//!   `q | k | v | z | b | a`), causal conv1d + SiLU over `q|k|v` with the cached tail,
//!   L2-normalised q (then scaled by `dk^-0.5`) and k, `g = −exp(A_log)·softplus(a +
//!   dt_bias)`, `β = sigmoid(b)`, gated delta rule from the recurrent state (the chunked
//!   kernel for `dk = dv = 128` and spans of ≥ 16 tokens, else the recurrent kernel for
//!   `dk ∈ {64, 128, 256}`, else a generic recurrence), gated RMSNorm with `z`, out proj;
//! * attention mixer: one fused `q|gate, k, v` projection, per-head q/k zero-centred
//!   RMSNorm, partial RoPE at the absolute positions, append to the KV cache, causal GQA
//!   attention over cached + new KV (for `head_dim ∈ {64, 128, 256}`: in bf16 the
//!   tensor-core flash kernel `attn::prefill_flash_wg_with` (wgmma + TMA, sm_90a) or
//!   `attn::prefill_flash` for spans of ≥ [`ATTN_FLASH_MIN_TQ`] tokens; otherwise the GEMM-based `attn::prefill_fast` for spans of
//!   ≥ [`ATTN_FAST_MIN_TQ`] tokens or over ≥ [`ATTN_FAST_MIN_KV`] cached keys, else the
//!   tuned tiled kernel; other head dims a generic one), sigmoid output gate, o proj;
//! * Lightning mixer (Ring-linear-2.0, [`super::lightning`]): one fused projection
//!   `[t, 4W]` (`query_key_value` rows then `g_proj` rows), q/k RMSNorm and fp32
//!   partial RoPE, the scalar-decay recurrence from the layer's state (per-token kernel
//!   below 16 tokens, chunked from 16, two-pass chunked from 256), group RMSNorm and
//!   sigmoid gate, `dense`; a family with plain RMSNorm keeps its norm weights
//!   zero-centred (`ModelConfig::norm_weight`), as on the CPU;
//! * FFN, two implementations ([`FfnPath`]): by default [`super::moe`] (MoE with device
//!   routing and grouped expert GEMMs, `moe::mlp_forward` for dense layers); or the
//!   host-routed glue path of this module, kept as an independent second
//!   implementation for cross-checking (router GEMM on the device, softmax/top-k on the
//!   host exactly as the CPU backend, per expert a row gather, SwiGLU MLP and weighted
//!   scatter-add on the device, plus the gated shared expert; slow: one host round trip
//!   per MoE layer).
//!
//! Activations and the residual stream are `[T, hidden]` row-major in `T`; norms,
//! gates, conv and recurrent state are fp32; KV caches are in `T` (so for bf16 a
//! host→device→host round trip of the KV rounds to bf16; everything else is exact).
//!
//! Entry points: [`GpuModel::prefill`] (any span from any state, logits none / last /
//! all), [`GpuModel::decode`], [`GpuModel::decode_batch`] (one step for several
//! sequences: batched GEMMs, batched state work where a mixer has it),
//! [`GpuModel::prefill_traced`]
//! (residual stream after every layer, for diagnosis), [`GpuState::from_host`] /
//! [`GpuState::to_host`] (the CPU `ModelState` layouts).
//!
//! The PIC cache build (body transitions of a span, `Model::layer_forward_capture*`)
//! is the crate-internal `prefill_capture`, used by [`super::pic`].
//!
//! The PIC engine's composition of cached segments runs layer-major through
//! `forward_spans` (one FFN pass per layer for all seam windows).
//!
//! `decode_batch` / `decode_sample` replay a CUDA graph of the whole step where every
//! layer has kernels that read the step's inputs from the device ([`super::graph`]);
//! other steps, prefill and `decode` launch kernel by kernel (bounded by the host's
//! launch cost); in `decode_batch`, Lightning, KDA, MLA and f32 attention layers are a
//! loop of single-sequence launches. Tests: `dataplane/tests/cuda_model.rs`,
//! `cuda_graph.rs`, `cuda_decode.rs`.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::cublas::{CudaBlas, Gemm};
use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};

use super::compile::MODEL;
use super::kimi::{kda_in_width, kda_width, mla_in_width, mla_mid_width, KdaW, MlaW};
use super::lightning::{self as lt, LightningW};
use super::ops::NormKind;
use super::transition::{DensePair, ScalarPair};
use super::{
    attn, blas, cfg1, check_len, dim_i32, gdr, moe, ops, shape_err, CudaError, CudaSlice, Elem,
    Gpu, Result, Scratch,
};
use crate::config::{MixerKind, ModelConfig};
use crate::mixers::gated_deltanet::layer::CHUNKED_MIN_TOKENS;
use crate::mixers::gated_deltanet::GdrDims;
use crate::mixers::lightning::LightningDims;
use crate::model::{Ffn, Logits, Mixer, Model};
use crate::state::{KvCache, LayerState, LinearState, ModelState};

/// Head dims of the tuned attention kernel ([`attn::prefill`]).
const ATTN_TUNED_HD: [usize; 3] = [64, 128, 256];
/// Query spans of at least this many tokens (tuned head dims) take the GEMM-based
/// [`attn::prefill_fast`]; shorter ones (decode, seam windows, short prompts) the tiled
/// [`attn::prefill`].
pub const ATTN_FAST_MIN_TQ: usize = 64;
/// Spans of any length over at least this many cached keys (decode steps and seam
/// windows late in a long prompt) also take [`attn::prefill_fast`]: the tiled kernel
/// runs one block per 16 queries and head, far too few blocks for a long KV
/// (measured on the H200 at the Qwen3.5-35B-A3B shape: a decode step at 16k context
/// 171 ms, HYPIC's 8-token seams ~80 ms per segment at 16 segments).
pub const ATTN_FAST_MIN_KV: usize = 512;
/// bf16 query spans of at least this many tokens (tuned head dims), and bf16 spans of
/// any length over at least [`ATTN_FAST_MIN_KV`] cached keys (decode and seam windows
/// late in a long prompt), take the tensor-core flash kernel [`attn::prefill_flash`];
/// short spans over a short cache keep the tiled [`attn::prefill`]. Measured on the
/// H200 (gpu-check 2026-11-30, 16/2 heads × 256, 16,384 cached keys): 1 / 8 / 64
/// queries take 0.127 / 0.129 / 0.140 ms with flash (split over the keys), 0.62 / 0.61 /
/// 0.72 ms with the cuBLAS path, 13.4–16.1 ms tiled; a 4k causal prefill 0.58 ms flash
/// against 1.70 ms cuBLAS. The f32 model never takes it. On sm_90a (Hopper), bf16
/// spans of at least this many tokens with head dim 128 or 256 take the wgmma kernel
/// [`attn::prefill_flash_wg_with`] with TMA loads and the lean consumer loop
/// ([`attn::FlashWgKernel::WarpSpecializedTmaLean`], 80-key tiles from
/// [`ATTN_WG_BC80_MIN_KV`] keys; the Basic wgmma kernel when tensor maps are
/// unavailable) instead (4k causal prefill 0.262 ms, 16k 3.246 ms against 0.58 / 8.3 ms
/// with `prefill_flash` and 0.261 / 3.539 ms with torch SDPA; gpu-check 2026-11-30 run
/// T); shorter spans keep `prefill_flash`, whose key splits suit a handful of queries
/// over a long cache.
pub const ATTN_FLASH_MIN_TQ: usize = 64;
/// Keys (cached plus new) from which the wgmma attention takes 128 × 80 tiles
/// ([`attn::FlashWgKernel::WarpSpecializedTmaLeanBc80`]) rather than 128 × 64: on the
/// H200 (causal, 16/2 heads × 256) 80-key tiles are faster at 16k keys and no better
/// at 4k (figures in benches/results/gpu-2026-11-30.md); the threshold sits between the two measured
/// lengths.
pub const ATTN_WG_BC80_MIN_KV: usize = 8192;
/// Most sequences in one decode step: the batched decode kernels put one sequence per
/// grid row (`gridDim.y` / `gridDim.z`).
pub const MAX_DECODE_BATCH: usize = 65_535;
/// Key dims of the tuned recurrent GDR kernel ([`gdr::recurrent`]).
const GDR_REC_DK: [usize; 3] = gdr::RECURRENT_DK;
/// Largest head dim of the generic attention kernel.
const ATTN_GENERIC_MAX_HD: usize = 1024;
/// Key tile of the generic attention kernel (`ATG_TILE` in model.cu).
const ATG_TILE: usize = 256;
/// L2-norm epsilon of q/k in the GDN and KDA (FLA `l2norm`, as `ops::l2_normalize`).
pub(crate) const L2_EPS: f32 = 1e-6;

/// The per-row inputs of the gated delta rule made by `gdn_prep_*` for `t` rows:
/// `q, k: [t, Hk, dk]`, `v, z: [t, value_dim]`, `gg` (log decay) and `beta`: `[t, Hv]`.
struct GdnPrep<T: Elem> {
    q: Scratch<T>,
    k: Scratch<T>,
    v: Scratch<T>,
    z: Scratch<T>,
    gg: Scratch<f32>,
    beta: Scratch<f32>,
}

/// Gated DeltaNet weights on the device.
pub(crate) struct GdnW<T> {
    /// `[conv_dim + value_dim + 2·Hv, hidden]`, rows `q | k | v | z | b | a`.
    pub(crate) w_in: CudaSlice<T>,
    /// `[conv_dim, K]` fp32.
    pub(crate) conv: CudaSlice<f32>,
    /// `−exp(A_log)`, `[Hv]` fp32.
    pub(crate) neg_a: CudaSlice<f32>,
    /// `[Hv]` fp32.
    pub(crate) dt_bias: CudaSlice<f32>,
    /// Gated RMSNorm weight `[dv]` fp32.
    pub(crate) norm: CudaSlice<f32>,
    /// `[hidden, value_dim]`.
    pub(crate) out: CudaSlice<T>,
}

/// Gated attention weights on the device.
pub(crate) struct AttnW<T> {
    /// Fused `[qw + 2·Hkv·hd, hidden]`: rows of `q_proj` (per head `q | gate` when
    /// gated), then `k_proj`, then `v_proj`.
    pub(crate) qkv: CudaSlice<T>,
    /// `[hidden, H·hd]`.
    pub(crate) o: CudaSlice<T>,
    /// `[hd]` fp32 (zero-centred).
    pub(crate) q_norm: CudaSlice<f32>,
    /// `[hd]` fp32 (zero-centred).
    pub(crate) k_norm: CudaSlice<f32>,
}

/// SwiGLU MLP weights on the device.
pub(crate) struct MlpW<T> {
    /// `[2I, hidden]`, gate rows then up rows.
    pub(crate) gate_up: CudaSlice<T>,
    /// `[hidden, I]`.
    pub(crate) down: CudaSlice<T>,
    pub(crate) inter: usize,
}

/// Which implementation runs the FFN blocks (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FfnPath {
    /// [`super::moe::moe_forward`] (device routing, grouped GEMMs) for MoE layers and
    /// [`super::moe::mlp_forward`] for dense ones.
    #[default]
    Fused,
    /// The glue kernels of `kernels/model.cu`: host-routed MoE and a cuBLAS + SwiGLU
    /// dense MLP. A second, independent implementation for diagnosis.
    HostRouted,
}

/// MoE weights on the device for [`FfnPath::HostRouted`].
pub(crate) struct MoeW<T> {
    /// `[E, hidden]`.
    pub(crate) router: CudaSlice<T>,
    pub(crate) experts: Vec<MlpW<T>>,
    /// Shared expert and its gate `[1, hidden]`.
    pub(crate) shared: Option<(MlpW<T>, CudaSlice<T>)>,
    /// Shared expert added without a gate (Ring-linear, Kimi-Linear).
    pub(crate) shared_plain: Option<MlpW<T>>,
    /// Selection bias `[E]` of a biased router (host copy: this path routes on the host).
    pub(crate) bias: Option<Vec<f32>>,
}

/// Device weights of one layer's token mixer (one variant per [`MixerKind`]).
pub(crate) enum MixerW<T> {
    GatedDeltaNet(GdnW<T>),
    Attention(AttnW<T>),
    Lightning(LightningW<T>),
    /// Kimi Delta Attention (`super::kimi`).
    Kda(KdaW<T>),
    /// Latent attention without RoPE (`super::kimi`).
    Mla(MlaW<T>),
}

/// The PIC body pair of one linear layer from a capturing prefill, in the storage
/// form of the layer's transition family.
pub(crate) enum LayerPair {
    /// Gated DeltaNet and KDA: dense `T_body [Hv, dk, dk]`.
    Dense(DensePair),
    /// Lightning: scalar `T_body [H]`.
    Scalar(ScalarPair),
}

pub(crate) enum FfnW<T> {
    Dense(MlpW<T>),
    /// [`FfnPath::HostRouted`].
    Moe(MoeW<T>),
    /// [`FfnPath::Fused`].
    MoeFused(moe::MoeWeights<T>),
}

pub(crate) struct LayerW<T> {
    pub(crate) input_norm: CudaSlice<f32>,
    pub(crate) post_norm: CudaSlice<f32>,
    pub(crate) mixer: MixerW<T>,
    pub(crate) ffn: FfnW<T>,
}

/// A hybrid model with every weight on one device, in element type `T` (projections,
/// embedding, LM head) and fp32 (norm weights, conv weights, `A`, `dt_bias`).
pub struct GpuModel<T: Elem> {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) config: ModelConfig,
    /// `[vocab, hidden]`.
    pub(crate) embed: CudaSlice<T>,
    /// `[hidden]` fp32.
    pub(crate) final_norm: CudaSlice<f32>,
    /// `[vocab, hidden]`; `None` when tied to the embedding.
    pub(crate) lm_head: Option<CudaSlice<T>>,
    pub(crate) layers: Vec<LayerW<T>>,
    /// RoPE inverse frequencies `[rotary_dim/2]` (None when rotary_dim = 0).
    pub(crate) inv_freq: Option<CudaSlice<f32>>,
    pub(crate) gdr_ws: Mutex<gdr::Workspace>,
    pub(crate) moe_ws: Mutex<moe::MoeWorkspace>,
    pub(crate) ffn_path: FfnPath,
    /// CUDA graphs of the decode step ([`super::graph`]).
    pub(crate) graphs: super::graph::DecodeGraphs,
}

/// Residual stream snapshots of one layer (host copies, fp32, `[T, hidden]`), from
/// [`GpuModel::prefill_traced`].
#[derive(Clone, Debug, Default)]
pub struct LayerTrace {
    /// After the mixer's residual add (before the FFN).
    pub after_mixer: Vec<f32>,
    /// After the whole layer (the next layer's input).
    pub after_layer: Vec<f32>,
}

/// Everything [`GpuModel::prefill_traced`] records.
#[derive(Clone, Debug, Default)]
pub struct ForwardTrace {
    /// The embedded tokens `[T, hidden]`.
    pub embed: Vec<f32>,
    /// One entry per decoder layer.
    pub layers: Vec<LayerTrace>,
}

/// Device buffers of a KV cache, shared by the [`GpuKv`]s that hold a prefix of it.
struct KvBuf<T> {
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    pos: CudaSlice<i64>,
    /// Capacity in tokens.
    cap: usize,
    /// Rows written so far by any holder: a holder whose `len` equals `tip` may append
    /// in place (it claims the rows by moving `tip`); any other must copy first.
    tip: AtomicUsize,
}

/// KV cache of one full-attention layer on the device, with capacity growth
/// (doubling). Rows `[cap, Hkv, hd]` in `T`, the first `len` valid; positions `[cap]`
/// i64, absolute positions of the cached tokens (any order, any values).
///
/// Copy-on-write sharing: [`GpuState::try_clone`] (the prefix cache's snapshots, the
/// PIC engine's private pool) shares the buffers instead of copying them — a clone
/// holds `len` and reads only rows below it. Appends go in place when this holder is at
/// the buffer's tip (nobody wrote past its `len`), else into a fresh copy of its rows,
/// so the rows another holder reads are never overwritten.
pub struct GpuKv<T> {
    buf: Arc<KvBuf<T>>,
    pub(crate) len: usize,
    /// Rows `len..claimed` of `buf` are reserved for this holder (it moved the tip
    /// past them and has not written them yet); `claimed ≥ len`. A second claim of
    /// rows it already holds (a graph step falling back to the eager one) is then
    /// free, not a copy.
    claimed: usize,
    /// Elements per cached token: `Hkv · hd`.
    pub(crate) row: usize,
}

impl<T: Elem> GpuKv<T> {
    fn with_capacity(gpu: &Gpu, row: usize, cap: usize) -> Result<Self> {
        Self::from_bufs(
            gpu.zeros(cap * row)?,
            gpu.zeros(cap * row)?,
            gpu.zeros(cap)?,
            row,
            cap,
        )
    }

    /// As [`GpuKv::with_capacity`] without zero-filling: only rows below `len` are
    /// ever read (the attention kernels take `len`), so copies that fill them need no
    /// memset first ([`Gpu::scratch`]; poisoned in the GPU tests).
    fn uninit(gpu: &Gpu, row: usize, cap: usize) -> Result<Self> {
        Self::from_bufs(
            gpu.scratch(cap * row)?.into_slice(),
            gpu.scratch(cap * row)?.into_slice(),
            gpu.scratch(cap)?.into_slice(),
            row,
            cap,
        )
    }

    fn from_bufs(
        k: CudaSlice<T>,
        v: CudaSlice<T>,
        pos: CudaSlice<i64>,
        row: usize,
        cap: usize,
    ) -> Result<Self> {
        Ok(GpuKv {
            buf: Arc::new(KvBuf {
                k,
                v,
                pos,
                cap,
                tip: AtomicUsize::new(0),
            }),
            len: 0,
            claimed: 0,
            row,
        })
    }

    /// Cached keys `[cap, Hkv, hd]` (rows below [`GpuKv::len`] valid).
    pub(crate) fn k(&self) -> &CudaSlice<T> {
        &self.buf.k
    }

    /// Cached values `[cap, Hkv, hd]` (rows below [`GpuKv::len`] valid).
    pub(crate) fn v(&self) -> &CudaSlice<T> {
        &self.buf.v
    }

    /// Positions of the cached tokens `[cap]` i64 (the first [`GpuKv::len`] valid).
    pub(crate) fn pos(&self) -> &CudaSlice<i64> {
        &self.buf.pos
    }

    /// Number of cached tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Capacity in tokens.
    pub fn capacity(&self) -> usize {
        self.buf.cap
    }

    /// Device bytes charged to this holder: the whole buffers when it is their only
    /// holder, else its own rows (`len`), so that snapshots sharing one buffer with the
    /// live state are not each charged its full capacity.
    fn bytes(&self) -> usize {
        let rows = if Arc::strong_count(&self.buf) == 1 {
            self.buf.cap
        } else {
            self.len
        };
        (2 * std::mem::size_of::<T>() * self.row + 8) * rows
    }

    /// A holder of the same buffers and the same `len` (no device copy; see the type's
    /// docs for how later appends keep both views intact).
    fn share(&self) -> Self {
        GpuKv {
            buf: self.buf.clone(),
            len: self.len,
            // The rows this holder reserved stay its own: the new holder's appends
            // copy first.
            claimed: self.len,
            row: self.row,
        }
    }

    /// Makes rows `len..need` writable by this holder: in place when the buffer has
    /// the room and this holder is at its tip (claimed by moving the tip to `need`),
    /// else into new buffers (capacity doubling) holding a copy of rows `..len`.
    fn claim(&mut self, gpu: &Gpu, need: usize) -> Result<()> {
        if need <= self.claimed {
            // Reserved by this holder's earlier claim (claimed ≤ cap).
            return Ok(());
        }
        if need <= self.buf.cap {
            if let Some(b) = Arc::get_mut(&mut self.buf) {
                // Sole holder: rows past `len` are nobody's.
                b.tip.store(need, Ordering::Release);
                self.claimed = need;
                return Ok(());
            }
        }
        if need <= self.buf.cap
            && self
                .buf
                .tip
                .compare_exchange(
                    self.claimed.max(self.len),
                    need,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
        {
            self.claimed = need;
            return Ok(());
        }
        let grow = if need > self.buf.cap {
            2 * self.buf.cap
        } else {
            self.buf.cap
        };
        let cap = need.max(grow).max(16);
        let mut fresh = Self::uninit(gpu, self.row, cap)?;
        let n = self.len * self.row;
        if self.len > 0 {
            let b = Arc::get_mut(&mut fresh.buf)
                .ok_or_else(|| shape_err("fresh KV buffer shared".into()))?;
            let s = gpu.stream();
            s.memcpy_dtod(&self.buf.k.slice(..n), &mut b.k.slice_mut(..n))?;
            s.memcpy_dtod(&self.buf.v.slice(..n), &mut b.v.slice_mut(..n))?;
            s.memcpy_dtod(
                &self.buf.pos.slice(..self.len),
                &mut b.pos.slice_mut(..self.len),
            )?;
        }
        fresh.buf.tip.store(need, Ordering::Release);
        self.buf = fresh.buf;
        self.claimed = need;
        Ok(())
    }

    /// Appends `t` tokens: `k`, `v` `[t, Hkv, hd]`, `pos` `[t]`.
    pub(crate) fn append(
        &mut self,
        gpu: &Gpu,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        pos: &CudaSlice<i64>,
        t: usize,
    ) -> Result<()> {
        check_len("span k", k, t * self.row)?;
        check_len("span v", v, t * self.row)?;
        check_len("span positions", pos, t)?;
        if t == 0 {
            return Ok(());
        }
        self.claim(gpu, self.len + t)?;
        let es = std::mem::size_of::<T>();
        let (a, n) = (self.len * self.row, t * self.row);
        let s = gpu.stream();
        let (src_k, _rk) = k.device_ptr(s);
        let (src_v, _rv) = v.device_ptr(s);
        let (src_p, _rp) = pos.device_ptr(s);
        let (dst_k, _wk) = self.buf.k.device_ptr(s);
        let (dst_v, _wv) = self.buf.v.device_ptr(s);
        let (dst_p, _wp) = self.buf.pos.device_ptr(s);
        // SAFETY: `claim` reserved rows `len..len + t` of the buffers for this holder
        // (capacity checked there): no other holder reads them (each reads below its
        // own len ≤ the old tip) and no other holder writes them (the tip moved past
        // them). Sources hold t rows (checked above). All on the one stream.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst_k + (a * es) as u64,
                src_k,
                n * es,
                s.cu_stream(),
            )?;
            cudarc::driver::result::memcpy_dtod_async(
                dst_v + (a * es) as u64,
                src_v,
                n * es,
                s.cu_stream(),
            )?;
            cudarc::driver::result::memcpy_dtod_async(
                dst_p + (self.len * 8) as u64,
                src_p,
                t * 8,
                s.cu_stream(),
            )?;
        }
        self.len += t;
        Ok(())
    }

    /// Makes row `len` writable by this holder ([`GpuKv::claim`] of one more row: in
    /// place, or into new buffers), before a decode step that appends it with
    /// [`GpuKv::append_dev`]: the buffers a CUDA graph of the step refers to are then
    /// those the step writes.
    pub(crate) fn claim_next(&mut self, gpu: &Gpu) -> Result<()> {
        self.claim(gpu, self.len + 1)
    }

    /// Counts the row claimed by [`GpuKv::claim_next`] as appended, after a batched
    /// append wrote it ([`attn::kv_append_rows`]).
    ///
    /// Errors: this holder has not claimed row `len` (the caller claims first).
    pub(crate) fn appended_claimed(&mut self) -> Result<()> {
        if self.len + 1 > self.claimed {
            return Err(shape_err("batched KV append without a claimed row".into()));
        }
        self.len += 1;
        Ok(())
    }

    /// `(k, v, pos, capacity)` of the buffers (device addresses): what a CUDA graph
    /// recorded over this cache depends on.
    pub(crate) fn key(&self, gpu: &Gpu) -> [u64; 4] {
        let s = gpu.stream();
        let (k, _a) = self.buf.k.device_ptr(s);
        let (v, _b) = self.buf.v.device_ptr(s);
        let (p, _c) = self.buf.pos.device_ptr(s);
        [k, v, p, self.buf.cap as u64]
    }

    /// Appends one row (`k`, `v`: `[Hkv, hd]`, `pos`: `[1]`) at the row index
    /// `n_kv_dev − 1` read from the device ([`attn::kv_append_dev`]), after
    /// [`GpuKv::claim_next`]; `n_kv_dev` must hold `len + 1` when the copy runs.
    ///
    /// Errors: no row was claimed (`len + 1 >` the claimed rows), or short buffers.
    pub(crate) fn append_dev(
        &mut self,
        gpu: &Gpu,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        pos: &CudaSlice<i64>,
        n_kv_dev: &cudarc::driver::CudaView<'_, i32>,
    ) -> Result<()> {
        if self.len + 1 > self.claimed {
            return Err(shape_err("append_dev without a claimed row".into()));
        }
        attn::kv_append_dev(
            gpu,
            k,
            v,
            pos,
            &self.buf.k,
            &self.buf.v,
            &self.buf.pos,
            n_kv_dev,
            self.buf.cap,
            self.row,
        )?;
        self.len += 1;
        Ok(())
    }

    /// Uploads `n` host rows into a fresh cache (capacity `n` rounded up to 16).
    fn from_host_rows(gpu: &Gpu, row: usize, kv: &KvCache) -> Result<Self> {
        let n = kv.positions.len();
        let mut g = Self::with_capacity(gpu, row, n.div_ceil(16) * 16)?;
        if n > 0 {
            let b = Arc::get_mut(&mut g.buf)
                .ok_or_else(|| shape_err("fresh KV buffer shared".into()))?;
            let st = gpu.stream();
            st.memcpy_htod(&to_elems::<T>(&kv.k), &mut b.k.slice_mut(..n * row))?;
            st.memcpy_htod(&to_elems::<T>(&kv.v), &mut b.v.slice_mut(..n * row))?;
            st.memcpy_htod(&kv.positions, &mut b.pos.slice_mut(..n))?;
            b.tip.store(n, Ordering::Release);
            g.len = n;
            g.claimed = n;
        }
        Ok(g)
    }
}

/// Device state of one decoder layer.
pub enum GpuLayerState<T> {
    /// Linear-attention layer (Gated DeltaNet, Lightning): conv tail
    /// `[conv_dim, K−1]` fp32 (oldest first; empty for Lightning, which has no conv)
    /// and recurrent state `[Hv, dk, dv]` fp32 K-major — the CPU `LinearState`
    /// layouts.
    Linear {
        /// Conv tail `[conv_dim, K−1]`.
        conv: CudaSlice<f32>,
        /// Recurrent state `[Hv, dk, dv]`.
        recurrent: CudaSlice<f32>,
    },
    /// Full-attention layer: KV cache.
    Full(GpuKv<T>),
}

impl<T: Elem> GpuLayerState<T> {
    /// A copy of this layer's state as [`GpuState::try_clone`] takes it: conv tail and
    /// recurrent state in new buffers, the KV cache shared copy-on-write.
    pub(crate) fn try_clone_on(&self, gpu: &Gpu) -> Result<Self> {
        let s = gpu.stream();
        Ok(match self {
            GpuLayerState::Linear { conv, recurrent } => GpuLayerState::Linear {
                conv: s.clone_dtod(conv)?,
                recurrent: s.clone_dtod(recurrent)?,
            },
            GpuLayerState::Full(kv) => GpuLayerState::Full(kv.share()),
        })
    }
}

/// Whole-model device state of one sequence (the GPU counterpart of [`ModelState`]).
pub struct GpuState<T: Elem> {
    gpu: Arc<Gpu>,
    /// Conv tail and recurrent-state lengths of a linear layer (device buffers of
    /// zero-length tensors hold one padding element; `to_host` returns these lengths).
    conv_len: usize,
    rec_len: usize,
    /// One entry per decoder layer.
    pub layers: Vec<GpuLayerState<T>>,
    /// Absolute position the next token gets.
    pub next_position: i64,
}

/// Prefixes an error's message with where it happened, keeping its kind. Kernel
/// faults are asynchronous: without [`GpuModel::prefill_traced`] (which waits after
/// every mixer and FFN) a fault may be reported by a later stage.
fn context(e: CudaError, at: &str) -> CudaError {
    match e {
        CudaError::Unavailable(m) => CudaError::Unavailable(format!("{at}: {m}")),
        CudaError::Driver(m) => CudaError::Driver(format!("{at}: {m}")),
        CudaError::Nvrtc(m) => CudaError::Nvrtc(format!("{at}: {m}")),
        CudaError::Cublas(m) => CudaError::Cublas(format!("{at}: {m}")),
        CudaError::Shape(m) => CudaError::Shape(format!("{at}: {m}")),
    }
}

/// Checks a host state against the config (the same rules as `Model::check_state`).
fn check_host_state(c: &ModelConfig, s: &ModelState) -> Result<()> {
    if s.layers.len() != c.num_layers {
        return Err(shape_err(format!(
            "state has {} layers, the model has {}",
            s.layers.len(),
            c.num_layers
        )));
    }
    let conv_len = c.conv_dim() * c.conv_kernel.saturating_sub(1);
    let rec_len = c.linear_v_heads * c.linear_k_dim * c.linear_v_dim;
    let row = c.num_kv_heads * c.head_dim;
    for (i, (l, k)) in s.layers.iter().zip(&c.mixers).enumerate() {
        match (l, k) {
            (
                LayerState::Linear(ls),
                MixerKind::GatedDeltaNet | MixerKind::Lightning | MixerKind::Kda,
            ) => {
                if ls.conv.len() != conv_len || ls.recurrent.len() != rec_len {
                    return Err(shape_err(format!(
                        "layer {i} (linear): conv {} (want {conv_len}), recurrent {} (want {rec_len})",
                        ls.conv.len(),
                        ls.recurrent.len()
                    )));
                }
            }
            (LayerState::Full(kv), MixerKind::Attention | MixerKind::Mla) => {
                let n = kv.positions.len();
                if kv.k.len() != n * row || kv.v.len() != n * row {
                    return Err(shape_err(format!(
                        "layer {i} (attention): {n} positions but k {} / v {} elements (want {})",
                        kv.k.len(),
                        kv.v.len(),
                        n * row
                    )));
                }
            }
            _ => {
                return Err(shape_err(format!(
                    "layer {i}: state kind does not match the model's layer kind {k:?}"
                )))
            }
        }
    }
    Ok(())
}

fn to_elems<T: Elem>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

/// Uploads `v` (converted to `T`); an empty slice gives a one-element zero buffer.
fn up<T: Elem>(gpu: &Gpu, v: &[f32]) -> Result<CudaSlice<T>> {
    if v.is_empty() {
        return gpu.zeros(1);
    }
    gpu.upload(&to_elems::<T>(v))
}

fn up_f32(gpu: &Gpu, v: &[f32]) -> Result<CudaSlice<f32>> {
    if v.is_empty() {
        return gpu.zeros(1);
    }
    gpu.upload(v)
}

/// Checks a host weight's length before upload.
fn want(name: &str, v: &[f32], n: usize) -> Result<()> {
    if v.len() != n {
        return Err(shape_err(format!(
            "weight `{name}` holds {} elements, the config needs {n}",
            v.len()
        )));
    }
    Ok(())
}

fn download_f32<T: Elem>(gpu: &Gpu, x: &CudaSlice<T>, n: usize) -> Result<Vec<f32>> {
    check_len("download", x, n)?;
    if n == 0 {
        return Ok(vec![]);
    }
    let v = gpu.stream().clone_dtoh(&x.slice(..n))?;
    gpu.sync()?;
    Ok(v.into_iter().map(Elem::to_f32).collect())
}

impl<T: Elem> GpuState<T> {
    /// Fresh state: zero conv tails and recurrent states, empty KV (capacity 0 until
    /// the first append), next position 0.
    pub fn new(gpu: &Arc<Gpu>, c: &ModelConfig) -> Result<Self> {
        let conv_len = c.conv_dim() * c.conv_kernel.saturating_sub(1);
        let rec_len = c.linear_v_heads * c.linear_k_dim * c.linear_v_dim;
        let row = c.num_kv_heads * c.head_dim;
        let mut layers = Vec::with_capacity(c.num_layers);
        for k in &c.mixers {
            layers.push(match k {
                MixerKind::GatedDeltaNet | MixerKind::Lightning | MixerKind::Kda => {
                    GpuLayerState::Linear {
                        conv: gpu.zeros(conv_len)?,
                        recurrent: gpu.zeros(rec_len)?,
                    }
                }
                MixerKind::Attention | MixerKind::Mla => {
                    GpuLayerState::Full(GpuKv::with_capacity(gpu, row, 0)?)
                }
            });
        }
        Ok(GpuState {
            gpu: gpu.clone(),
            conv_len,
            rec_len,
            layers,
            next_position: 0,
        })
    }

    /// Uploads a host state (CPU layouts, see [`crate::state`]); KV capacity is the
    /// cached length rounded up to a multiple of 16.
    ///
    /// Errors: [`CudaError::Shape`] when `s` does not match the config.
    pub fn from_host(gpu: &Arc<Gpu>, c: &ModelConfig, s: &ModelState) -> Result<Self> {
        check_host_state(c, s)?;
        let conv_len = c.conv_dim() * c.conv_kernel.saturating_sub(1);
        let rec_len = c.linear_v_heads * c.linear_k_dim * c.linear_v_dim;
        let row = c.num_kv_heads * c.head_dim;
        let mut layers = Vec::with_capacity(s.layers.len());
        for l in &s.layers {
            layers.push(match l {
                LayerState::Linear(ls) => GpuLayerState::Linear {
                    conv: up_f32(gpu, &ls.conv)?,
                    recurrent: up_f32(gpu, &ls.recurrent)?,
                },
                LayerState::Full(kv) => GpuLayerState::Full(GpuKv::from_host_rows(gpu, row, kv)?),
            });
        }
        gpu.sync()?;
        Ok(GpuState {
            gpu: gpu.clone(),
            conv_len,
            rec_len,
            layers,
            next_position: s.next_position,
        })
    }

    /// Downloads the state into the CPU layouts (waits for the stream). Exact for
    /// fp32; for bf16 the KV values are the bf16 ones widened to fp32.
    pub fn to_host(&self) -> Result<ModelState> {
        let gpu = &self.gpu;
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            layers.push(match l {
                GpuLayerState::Linear { conv, recurrent } => LayerState::Linear(LinearState {
                    conv: download_f32(gpu, conv, self.conv_len)?,
                    recurrent: download_f32(gpu, recurrent, self.rec_len)?,
                }),
                GpuLayerState::Full(kv) => {
                    let n = kv.len;
                    let positions = if n == 0 {
                        vec![]
                    } else {
                        let p = gpu.stream().clone_dtoh(&kv.pos().slice(..n))?;
                        gpu.sync()?;
                        p
                    };
                    LayerState::Full(KvCache {
                        k: download_f32(gpu, kv.k(), n * kv.row)?,
                        v: download_f32(gpu, kv.v(), n * kv.row)?,
                        positions,
                    })
                }
            });
        }
        Ok(ModelState {
            layers,
            next_position: self.next_position,
        })
    }

    /// A copy of this state: conv tails and recurrent states in new device buffers,
    /// KV caches shared copy-on-write ([`GpuKv`]: no device copy now; the first append
    /// to either side that would overwrite rows the other reads copies them). Issued
    /// on the stream; no host round trip.
    pub fn try_clone(&self) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| l.try_clone_on(&self.gpu))
            .collect::<Result<Vec<_>>>()?;
        Ok(self.with_layers(layers, self.next_position))
    }

    /// A state of the same model and device made of `layers` (e.g. per-layer copies
    /// taken with [`GpuLayerState::try_clone_on`] during a layer-major forward).
    pub(crate) fn with_layers(&self, layers: Vec<GpuLayerState<T>>, next_position: i64) -> Self {
        GpuState {
            gpu: self.gpu.clone(),
            conv_len: self.conv_len,
            rec_len: self.rec_len,
            layers,
            next_position,
        }
    }

    /// The device this state lives on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Device bytes held by this state (capacity, not just the used part; a KV buffer
    /// shared with other states ([`GpuState::try_clone`]) counts only this state's rows).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                GpuLayerState::Linear { conv, recurrent } => 4 * (conv.len() + recurrent.len()),
                GpuLayerState::Full(kv) => kv.bytes(),
            })
            .sum()
    }
}

impl<T: Elem> GpuModel<T>
where
    CudaBlas: Gemm<T>,
{
    /// Uploads every weight of `model` to `gpu`, converted to `T`, with the default
    /// FFN implementation ([`FfnPath::Fused`]).
    ///
    /// Errors: [`CudaError::Shape`] for a configuration the kernels do not support
    /// (heads not divisible, conv kernel > 17, rotary dims > head_dim, head_dim >
    /// 1024, more than `moe::MAX_EXPERTS` experts or top-k over `moe::MAX_TOP_K`) or a
    /// weight whose length does not match the config; driver errors.
    pub fn upload(gpu: Arc<Gpu>, model: &Model) -> Result<Self> {
        Self::upload_with(gpu, model, FfnPath::Fused)
    }

    /// [`GpuModel::upload`] with an explicit FFN implementation.
    pub fn upload_with(gpu: Arc<Gpu>, model: &Model, ffn_path: FfnPath) -> Result<Self> {
        let c = model.config.clone();
        check_config(&c)?;
        let g = &*gpu;
        let h = c.hidden_size;
        want("embed_tokens", &model.embed, c.vocab_size * h)?;
        want("norm", &model.final_norm, h)?;
        let embed = up::<T>(g, &model.embed)?;
        let final_norm = up_f32(g, &model.final_norm)?;
        let lm_head = match &model.lm_head {
            Some(w) => {
                want("lm_head", w, c.vocab_size * h)?;
                Some(up::<T>(g, w)?)
            }
            None => None,
        };
        if model.layers.len() != c.num_layers {
            return Err(shape_err(format!(
                "model holds {} layers, config says {}",
                model.layers.len(),
                c.num_layers
            )));
        }
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let qw = nh * hd * if c.attn_output_gate { 2 } else { 1 };
        let (hv, dv) = (c.linear_v_heads, c.linear_v_dim);
        let n_in = c.conv_dim() + c.value_dim() + 2 * hv;
        let mut layers = Vec::with_capacity(c.num_layers);
        for (i, l) in model.layers.iter().enumerate() {
            want(&format!("layers.{i}.input_layernorm"), &l.input_norm, h)?;
            want(
                &format!("layers.{i}.post_attention_layernorm"),
                &l.post_norm,
                h,
            )?;
            let mixer = match (&l.mixer, c.mixers[i]) {
                (Mixer::GatedDeltaNet(w), MixerKind::GatedDeltaNet) => {
                    let p = format!("layers.{i}.linear_attn");
                    want(&format!("{p}.in_proj"), &w.w_in, n_in * h)?;
                    want(
                        &format!("{p}.conv1d"),
                        &w.conv,
                        c.conv_dim() * c.conv_kernel,
                    )?;
                    want(&format!("{p}.A_log"), &w.neg_a, hv)?;
                    want(&format!("{p}.dt_bias"), &w.dt_bias, hv)?;
                    want(&format!("{p}.norm"), &w.norm, dv)?;
                    want(&format!("{p}.out_proj"), &w.out, h * c.value_dim())?;
                    MixerW::GatedDeltaNet(GdnW {
                        w_in: up::<T>(g, &w.w_in)?,
                        conv: up_f32(g, &w.conv)?,
                        neg_a: up_f32(g, &w.neg_a)?,
                        dt_bias: up_f32(g, &w.dt_bias)?,
                        norm: up_f32(g, &w.norm)?,
                        out: up::<T>(g, &w.out)?,
                    })
                }
                (Mixer::Lightning(w), MixerKind::Lightning) => {
                    MixerW::Lightning(up_lightning(g, &c, w, i)?)
                }
                (Mixer::Kda(w), MixerKind::Kda) => {
                    let p = format!("layers.{i}.self_attn");
                    let (wd, d, nh) = (kda_width(&c), c.linear_k_dim, c.linear_v_heads);
                    want(&format!("{p}.in_proj"), &w.w_in, kda_in_width(&c) * h)?;
                    want(&format!("{p}.f_b_proj"), &w.f_b, wd * d)?;
                    want(&format!("{p}.g_b_proj"), &w.g_b, wd * d)?;
                    want(&format!("{p}.conv1d"), &w.conv, 3 * wd * c.conv_kernel)?;
                    want(&format!("{p}.A_log"), &w.neg_a, nh)?;
                    want(&format!("{p}.dt_bias"), &w.dt_bias, wd)?;
                    want(&format!("{p}.o_norm"), &w.o_norm, d)?;
                    want(&format!("{p}.o_proj"), &w.o_proj, h * wd)?;
                    MixerW::Kda(KdaW {
                        w_in: up::<T>(g, &w.w_in)?,
                        f_b: up::<T>(g, &w.f_b)?,
                        g_b: up::<T>(g, &w.g_b)?,
                        conv: up_f32(g, &w.conv)?,
                        neg_a: up_f32(g, &w.neg_a)?,
                        dt_bias: up_f32(g, &w.dt_bias)?,
                        o_norm: up_f32(g, &w.o_norm)?,
                        o_proj: up::<T>(g, &w.o_proj)?,
                    })
                }
                (Mixer::Mla(w), MixerKind::Mla) => {
                    let p = format!("layers.{i}.self_attn");
                    let m = c.mla;
                    let (r, nope, vd) = (m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim);
                    want(&format!("{p}.q_proj"), &w.q, nh * m.qk_head_dim() * h)?;
                    want(&format!("{p}.kv_a_proj_with_mqa"), &w.kv_a, m.row() * h)?;
                    want(&format!("{p}.kv_a_layernorm"), &w.kv_norm, r)?;
                    want(&format!("{p}.kv_b_proj (keys)"), &w.w_uk, nh * nope * r)?;
                    want(&format!("{p}.kv_b_proj (values)"), &w.w_uv, nh * vd * r)?;
                    want(&format!("{p}.o_proj"), &w.o, h * mla_mid_width(&c))?;
                    let mut fused = Vec::with_capacity(mla_in_width(&c) * h);
                    fused.extend_from_slice(&w.q);
                    fused.extend_from_slice(&w.kv_a);
                    MixerW::Mla(MlaW {
                        w_in: up::<T>(g, &fused)?,
                        kv_norm: up_f32(g, &w.kv_norm)?,
                        w_uk: up::<T>(g, &w.w_uk)?,
                        w_uv: up::<T>(g, &w.w_uv)?,
                        o: up::<T>(g, &w.o)?,
                    })
                }
                (Mixer::Attention(w), MixerKind::Attention) => {
                    let p = format!("layers.{i}.self_attn");
                    want(&format!("{p}.q_proj"), &w.q, qw * h)?;
                    want(&format!("{p}.k_proj"), &w.k, nkv * hd * h)?;
                    want(&format!("{p}.v_proj"), &w.v, nkv * hd * h)?;
                    want(&format!("{p}.o_proj"), &w.o, h * nh * hd)?;
                    want(&format!("{p}.q_norm"), &w.q_norm, hd)?;
                    want(&format!("{p}.k_norm"), &w.k_norm, hd)?;
                    let mut fused = Vec::with_capacity(w.q.len() + w.k.len() + w.v.len());
                    fused.extend_from_slice(&w.q);
                    fused.extend_from_slice(&w.k);
                    fused.extend_from_slice(&w.v);
                    MixerW::Attention(AttnW {
                        qkv: up::<T>(g, &fused)?,
                        o: up::<T>(g, &w.o)?,
                        q_norm: up_f32(g, &w.q_norm)?,
                        k_norm: up_f32(g, &w.k_norm)?,
                    })
                }
                _ => {
                    return Err(shape_err(format!(
                        "layer {i}: mixer weights do not match the config's layer kind"
                    )))
                }
            };
            let ffn = match &l.ffn {
                Ffn::Dense(m) => FfnW::Dense(up_mlp(g, m, h, &format!("layers.{i}.mlp"))?),
                Ffn::Moe(m) => {
                    let e = c.num_experts;
                    if m.experts.len() != e || c.experts_per_tok == 0 || c.experts_per_tok > e {
                        return Err(shape_err(format!(
                            "layer {i}: {} experts loaded, config has {e} with top-{}",
                            m.experts.len(),
                            c.experts_per_tok
                        )));
                    }
                    want(&format!("layers.{i}.mlp.gate"), &m.router, e * h)?;
                    if ffn_path == FfnPath::Fused {
                        let gu: Vec<&[f32]> = m.experts.iter().map(|x| &x.gate_up[..]).collect();
                        let dn: Vec<&[f32]> = m.experts.iter().map(|x| &x.down[..]).collect();
                        let inter = m.experts.first().map_or(0, |x| x.inter);
                        if m.experts.iter().any(|x| x.inter != inter) {
                            return Err(shape_err(format!(
                                "layer {i}: experts of different widths"
                            )));
                        }
                        let shared = match (&m.shared, &m.shared_plain) {
                            (Some((sm, gate)), _) => Some(moe::SharedExpertHost {
                                gate_up: &sm.gate_up[..],
                                down: &sm.down[..],
                                gate: Some(&gate[..]),
                            }),
                            (None, Some(sm)) => Some(moe::SharedExpertHost {
                                gate_up: &sm.gate_up[..],
                                down: &sm.down[..],
                                gate: None,
                            }),
                            (None, None) => None,
                        };
                        let shared_inter = match (&m.shared, &m.shared_plain) {
                            (Some((sm, _)), _) | (None, Some(sm)) => sm.inter,
                            (None, None) => 0,
                        };
                        let w = moe::MoeWeights::<T>::upload_with_router(
                            g,
                            &m.router,
                            &c.router,
                            m.bias.as_deref(),
                            &gu,
                            &dn,
                            shared,
                            h,
                            inter,
                            shared_inter,
                            c.experts_per_tok,
                            c.norm_topk_prob,
                        )
                        .map_err(|e| match e {
                            CudaError::Shape(m) => shape_err(format!("layer {i} MoE: {m}")),
                            other => other,
                        })?;
                        layers.push(LayerW {
                            input_norm: up_f32(g, &l.input_norm)?,
                            post_norm: up_f32(g, &l.post_norm)?,
                            mixer,
                            ffn: FfnW::MoeFused(w),
                        });
                        continue;
                    }
                    let experts = m
                        .experts
                        .iter()
                        .enumerate()
                        .map(|(j, x)| up_mlp(g, x, h, &format!("layers.{i}.mlp.experts.{j}")))
                        .collect::<Result<Vec<_>>>()?;
                    let shared = match &m.shared {
                        Some((sm, gate)) => {
                            want(&format!("layers.{i}.mlp.shared_expert_gate"), gate, h)?;
                            Some((
                                up_mlp(g, sm, h, &format!("layers.{i}.mlp.shared_expert"))?,
                                up::<T>(g, gate)?,
                            ))
                        }
                        None => None,
                    };
                    let shared_plain = match &m.shared_plain {
                        Some(sm) => {
                            Some(up_mlp(g, sm, h, &format!("layers.{i}.mlp.shared_experts"))?)
                        }
                        None => None,
                    };
                    if let Some(b) = &m.bias {
                        want(&format!("layers.{i}.mlp.gate bias"), b, e)?;
                    }
                    FfnW::Moe(MoeW {
                        router: up::<T>(g, &m.router)?,
                        experts,
                        shared,
                        shared_plain,
                        bias: m.bias.clone(),
                    })
                }
            };
            layers.push(LayerW {
                input_norm: up_f32(g, &l.input_norm)?,
                post_norm: up_f32(g, &l.post_norm)?,
                mixer,
                ffn,
            });
        }
        let inv_freq = if c.rotary_dim >= 2 {
            Some(up_f32(g, &ops::rope_inv_freq(c.rotary_dim, c.rope_theta))?)
        } else {
            None
        };
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
            ffn_path,
        })
    }

    /// The FFN implementation this model was uploaded with.
    pub fn ffn_path(&self) -> FfnPath {
        self.ffn_path
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// XXH3-128 of the first 64 Ki values of the embedding and of the final norm,
    /// read back as f32, with the backend (`cuda`) and element type (`f32`, `bf16`)
    /// mixed in: two checkpoints of one shape differ, and so do the entries of one
    /// checkpoint in two element types or on the CPU and the GPU (their entries are
    /// not bit-identical, so a combiner must not compose one as the other).
    ///
    /// Errors: a failed device read.
    pub fn weights_digest(&self) -> Result<u128> {
        let n = self.embed.len().min(1 << 16);
        let embed = download_f32(&self.gpu, &self.embed, n)?;
        let norm = self.gpu.download(&self.final_norm)?;
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for x in embed.iter().chain(&norm) {
            h.update(&x.to_le_bytes());
        }
        h.update(b"cuda");
        h.update(T::SUFFIX.as_bytes());
        Ok(h.digest128())
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// RoPE inverse frequencies `[rotary_dim/2]` on the device (`None`: no RoPE).
    pub(crate) fn inv_freq(&self) -> Option<&CudaSlice<f32>> {
        self.inv_freq.as_ref()
    }
    /// Embedding rows of `tokens` (ids checked by the caller): `[len, hidden]` in `T`.
    ///
    /// Errors: a dimension beyond `i32`, or a driver failure.
    fn embed_tokens(&self, tokens: &[u32]) -> Result<Scratch<T>> {
        let tok_d = self.gpu.upload(tokens)?;
        self.embed_from(&tok_d, tokens.len())
    }

    /// [`GpuModel::embed_tokens`] of `n` token ids already on the device (`tok_d: [n]`,
    /// each below the vocabulary size: the caller checks).
    pub(crate) fn embed_from(&self, tok_d: &CudaSlice<u32>, n: usize) -> Result<Scratch<T>> {
        let g = &*self.gpu;
        let h = self.config.hidden_size;
        check_len("token ids", tok_d, n)?;
        let mut x: Scratch<T> = g.scratch(n * h)?;
        let f = g.function(&MODEL, &format!("embed_gather_{}", T::SUFFIX), 0)?;
        let (ni, hi, vi) = (
            dim_i32("tokens", n)?,
            dim_i32("hidden", h)?,
            dim_i32("vocab", self.config.vocab_size)?,
        );
        let mut b = g.stream().launch_builder(&f);
        b.arg(&self.embed)
            .arg(tok_d)
            .arg(&mut x)
            .arg(&ni)
            .arg(&hi)
            .arg(&vi);
        // SAFETY: matches `embed_gather_*` in model.cu; sizes from the config.
        unsafe { b.launch(cfg1(n * h)) }?;
        Ok(x)
    }

    /// Fresh device state for a new sequence (see [`GpuState::new`]).
    pub fn new_state(&self) -> Result<GpuState<T>> {
        GpuState::new(&self.gpu, &self.config)
    }

    /// Uploads a host state for this model (see [`GpuState::from_host`]).
    pub fn state_from_host(&self, s: &ModelState) -> Result<GpuState<T>> {
        GpuState::from_host(&self.gpu, &self.config, s)
    }

    /// Prefills `tokens` from `state` (advanced in place) at positions
    /// `state.next_position ..`. Returns host logits `[rows, vocab]` fp32, rows 0, 1
    /// or T per `logits`.
    ///
    /// Errors (before any state change): empty span, a token ≥ vocab, a state that
    /// does not match the model or lives on another device. A driver error during the
    /// forward leaves the state partly advanced.
    pub fn prefill(
        &self,
        tokens: &[u32],
        state: &mut GpuState<T>,
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let x = self.forward(tokens, state, None, None)?;
        self.logits_of(&x, tokens.len(), logits)
    }

    /// PIC cache build: [`GpuModel::prefill`] (no logits) that also returns, per
    /// decoder layer, the body pair of linear layers over tokens `from..` of the span
    /// (`T_body [Hv,dk,dk]`, `S_body|0 = S_end − T_body·S_from [Hv,dk,dv]`, fp32) and
    /// `None` for attention layers (their span K/V is in the state's KV cache). The
    /// same decomposition as `Model::layer_forward_capture_many` with one body start;
    /// `from` is clamped to the span length (body of zero tokens: identity, zero).
    pub(crate) fn prefill_capture(
        &self,
        tokens: &[u32],
        state: &mut GpuState<T>,
        from: usize,
    ) -> Result<Vec<Option<LayerPair>>> {
        let mut pairs = Vec::with_capacity(self.config.num_layers);
        self.forward(tokens, state, None, Some((from, &mut pairs)))?;
        Ok(pairs)
    }

    /// [`GpuModel::prefill`] that also records the residual stream after the
    /// embedding, after every mixer and after every layer (host copies; slow, for
    /// diagnosis).
    pub fn prefill_traced(
        &self,
        tokens: &[u32],
        state: &mut GpuState<T>,
        logits: Logits,
        trace: &mut ForwardTrace,
    ) -> Result<Vec<f32>> {
        let x = self.forward(tokens, state, Some(trace), None)?;
        self.logits_of(&x, tokens.len(), logits)
    }

    /// One-token decode: returns the next-token logits `[vocab]`.
    pub fn decode(&self, token: u32, state: &mut GpuState<T>) -> Result<Vec<f32>> {
        self.prefill(&[token], state, Logits::Last)
    }

    /// Final norm and LM head over rows of the residual stream `x` (`[t, hidden]`).
    fn logits_of(&self, x: &CudaSlice<T>, t: usize, which: Logits) -> Result<Vec<f32>> {
        let c = &self.config;
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        let (row0, rows) = match which {
            Logits::None => return Ok(vec![]),
            Logits::Last => (t - 1, 1),
            Logits::All => (0, t),
        };
        check_len("residual", x, t * h)?;
        let g = &*self.gpu;
        let xs = g
            .stream()
            .clone_dtod(&x.slice(row0 * h..(row0 + rows) * h))?;
        let mut hn: Scratch<T> = g.scratch(rows * h)?;
        ops::rms_norm(
            g,
            NormKind::ZeroCentred,
            &xs,
            None,
            &self.final_norm,
            &mut hn,
            rows,
            c.rms_norm_eps,
        )?;
        let w = self.lm_head.as_ref().unwrap_or(&self.embed);
        let mut out: Scratch<T> = g.scratch(rows * vocab)?;
        blas::linear(g, &hn, rows, h, w, vocab, &mut out, T::from_f32(0.0))?;
        download_f32(g, &out, rows * vocab)
    }

    /// Logits of every row of the residual `x: [rows, hidden]`, left on the device
    /// (`[rows, vocab]` in `T`): the same kernels and roundings as
    /// [`GpuModel::logits_of`] with [`Logits::All`].
    pub(crate) fn logits_device(&self, x: &CudaSlice<T>, rows: usize) -> Result<Scratch<T>> {
        let c = &self.config;
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        check_len("residual", x, rows * h)?;
        let g = &*self.gpu;
        let mut hn: Scratch<T> = g.scratch(rows * h)?;
        ops::rms_norm(
            g,
            NormKind::ZeroCentred,
            x,
            None,
            &self.final_norm,
            &mut hn,
            rows,
            c.rms_norm_eps,
        )?;
        let w = self.lm_head.as_ref().unwrap_or(&self.embed);
        let mut out: Scratch<T> = g.scratch(rows * vocab)?;
        blas::linear(g, &hn, rows, h, w, vocab, &mut out, T::from_f32(0.0))?;
        Ok(out)
    }

    pub(crate) fn check_inputs(&self, tokens: &[u32], state: &GpuState<T>) -> Result<()> {
        let c = &self.config;
        if tokens.is_empty() {
            return Err(shape_err("empty span: at least one token is needed".into()));
        }
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(shape_err(format!(
                "token id {t} is outside the vocabulary ({})",
                c.vocab_size
            )));
        }
        if !Arc::ptr_eq(&state.gpu, &self.gpu) {
            return Err(shape_err("the state lives on another Gpu handle".into()));
        }
        if state.layers.len() != c.num_layers {
            return Err(shape_err(format!(
                "state has {} layers, model has {}",
                state.layers.len(),
                c.num_layers
            )));
        }
        let conv_len = c.conv_dim() * c.conv_kernel.saturating_sub(1);
        let rec_len = c.linear_v_heads * c.linear_k_dim * c.linear_v_dim;
        let row = c.num_kv_heads * c.head_dim;
        for (i, (l, k)) in state.layers.iter().zip(&c.mixers).enumerate() {
            match (l, k) {
                (
                    GpuLayerState::Linear { conv, recurrent },
                    MixerKind::GatedDeltaNet | MixerKind::Lightning | MixerKind::Kda,
                ) => {
                    check_len(&format!("layer {i} conv tail"), conv, conv_len)?;
                    check_len(&format!("layer {i} recurrent state"), recurrent, rec_len)?;
                }
                (GpuLayerState::Full(kv), MixerKind::Attention | MixerKind::Mla) => {
                    if kv.row != row {
                        return Err(shape_err(format!(
                            "layer {i}: KV row width {} but the model needs {row}",
                            kv.row
                        )));
                    }
                }
                _ => {
                    return Err(shape_err(format!(
                        "layer {i}: state kind does not match the layer kind {k:?}"
                    )))
                }
            }
        }
        Ok(())
    }

    /// Runs every layer over `tokens`, returning the final residual stream `[t, h]`.
    fn forward(
        &self,
        tokens: &[u32],
        state: &mut GpuState<T>,
        mut trace: Option<&mut ForwardTrace>,
        mut capture: Option<(usize, &mut Vec<Option<LayerPair>>)>,
    ) -> Result<Scratch<T>> {
        self.check_inputs(tokens, state)?;
        let c = &self.config;
        let g = &*self.gpu;
        let (t, h) = (tokens.len(), c.hidden_size);
        let positions: Vec<i64> = (0..t as i64).map(|i| state.next_position + i).collect();
        let pos_d = g.upload(&positions)?;
        let mut x = self.embed_tokens(tokens)?;
        if let Some(tr) = trace.as_deref_mut() {
            tr.embed = download_f32(g, &x, t * h)?;
            tr.layers.clear();
        }
        let mut r: Scratch<T> = g.scratch(t * h)?;
        if let Some(l0) = self.layers.first() {
            ops::rms_norm(
                g,
                NormKind::ZeroCentred,
                &x,
                None,
                &l0.input_norm,
                &mut r,
                t,
                c.rms_norm_eps,
            )?;
        }
        // `r` holds layer i's input norm of `x` at the top of each iteration: each residual
        // add is fused with the norm that follows it (`add_rmsnorm_*`).
        for (i, (lw, ls)) in self.layers.iter().zip(state.layers.iter_mut()).enumerate() {
            let mut pair = None;
            let mut scalar = None;
            let body_from = capture.as_ref().map(|c| c.0);
            let mixed = match (&lw.mixer, ls) {
                (MixerW::GatedDeltaNet(w), GpuLayerState::Linear { conv, recurrent }) => self
                    .gdn(w, &r, t, conv, recurrent, body_from.map(|f| (f, &mut pair)))
                    .map_err(|e| context(e, &format!("layer {i} GDN mixer")))?,
                (MixerW::Lightning(w), GpuLayerState::Linear { recurrent, .. }) => self
                    .lightning(
                        w,
                        &r,
                        t,
                        &pos_d,
                        recurrent,
                        body_from.map(|f| (f, &mut scalar)),
                    )
                    .map_err(|e| context(e, &format!("layer {i} Lightning mixer")))?,
                (MixerW::Attention(w), GpuLayerState::Full(kv)) => self
                    .attention(w, &r, t, &pos_d, kv)
                    .map_err(|e| context(e, &format!("layer {i} attention mixer")))?,
                (MixerW::Kda(w), GpuLayerState::Linear { conv, recurrent }) => self
                    .kda(w, &r, t, conv, recurrent, body_from.map(|f| (f, &mut pair)))
                    .map_err(|e| context(e, &format!("layer {i} KDA mixer")))?,
                (MixerW::Mla(w), GpuLayerState::Full(kv)) => self
                    .mla(w, &r, t, &pos_d, kv)
                    .map_err(|e| context(e, &format!("layer {i} MLA mixer")))?,
                _ => {
                    return Err(shape_err(format!(
                        "layer {i}: state kind does not match the layer"
                    )))
                }
            };
            if let Some((_, pairs)) = capture.as_mut() {
                pairs.push(pair.map(LayerPair::Dense).or(scalar.map(LayerPair::Scalar)));
            }
            self.add_norm(&mut x, &mixed, &lw.post_norm, &mut r, t)?;
            let after_mixer = match trace.as_deref() {
                Some(_) => download_f32(g, &x, t * h)
                    .map_err(|e| context(e, &format!("layer {i} after the mixer")))?,
                None => vec![],
            };
            let f = self
                .ffn(&lw.ffn, &r, t)
                .map_err(|e| context(e, &format!("layer {i} FFN")))?;
            match self.layers.get(i + 1) {
                Some(next) => self.add_norm(&mut x, &f, &next.input_norm, &mut r, t)?,
                None => self.add_inplace(&mut x, &f, t * h)?,
            }
            if let Some(tr) = trace.as_deref_mut() {
                tr.layers.push(LayerTrace {
                    after_mixer,
                    after_layer: download_f32(g, &x, t * h)
                        .map_err(|e| context(e, &format!("layer {i} after the FFN")))?,
                });
            }
        }
        state.next_position += t as i64;
        Ok(x)
    }

    /// Layer-major forward of spans that follow each other in one sequence, each
    /// followed by a per-layer hook: for every layer, span i's mixer runs from the
    /// layer state (`state.layers[l]`) at positions `spans[i].1 ..`, then
    /// `after_mixer(l, i, layer state)` runs (the PIC engine composes segment i's cached
    /// body there, so span i + 1 sees it); the norms and the FFN then run once over the
    /// rows of all spans together (one MoE pass: each expert's weights are read once
    /// per layer instead of once per span), and so do the mixers' input and output
    /// projections (two GEMMs per layer instead of two per span; only the stateful
    /// middle — conv, gated delta rule, KV append and attention — runs per span). The
    /// same math per row as running the spans one after the other through
    /// [`GpuModel::prefill`] with the hooks in between; only the batched GEMM shapes
    /// differ. Empty spans run no mixer (their hooks still run); `state.next_position`
    /// is left to the caller. No logits.
    ///
    /// Errors: a token ≥ vocab, a state that does not match; hook errors.
    pub(crate) fn forward_spans(
        &self,
        spans: &[(&[u32], i64)],
        state: &mut GpuState<T>,
        mut after_mixer: impl FnMut(usize, usize, &mut GpuLayerState<T>) -> Result<()>,
    ) -> Result<()> {
        let spans: Vec<(&[u32], i64, usize)> = spans.iter().map(|&(t, p)| (t, p, 0)).collect();
        self.forward_spans_multi(&spans, &mut [state], |l, i, ls| after_mixer(l, i, ls))?;
        Ok(())
    }

    /// [`GpuModel::forward_spans`] over several sequences: `spans[i] = (tokens, first
    /// position, sequence)` runs from `states[sequence]`, so the spans of several
    /// requests share one batched pass (norms, FFN / MoE and the mixers' projections
    /// over all rows; each span's stateful middle on its own sequence's layer state,
    /// in span order). Returns the final residual stream `[Σ T_i, hidden]` (before the
    /// final norm; `None` when no span has tokens), rows in span order.
    /// `next_position` of every state is left to the caller.
    ///
    /// Errors: a sequence index past `states`, a token ≥ vocab, a state that does not
    /// match or lives on another device (before any state changes); hook errors.
    pub(crate) fn forward_spans_multi(
        &self,
        spans: &[(&[u32], i64, usize)],
        states: &mut [&mut GpuState<T>],
        mut after_mixer: impl FnMut(usize, usize, &mut GpuLayerState<T>) -> Result<()>,
    ) -> Result<Option<Scratch<T>>> {
        let c = &self.config;
        let g = &*self.gpu;
        let h = c.hidden_size;
        for state in states.iter() {
            if state.layers.len() != self.layers.len() {
                return Err(shape_err(format!(
                    "state has {} layers, the model {}",
                    state.layers.len(),
                    self.layers.len()
                )));
            }
            if !Arc::ptr_eq(&state.gpu, &self.gpu) {
                return Err(shape_err("the state lives on another Gpu handle".into()));
            }
        }
        for &(tokens, _, seq) in spans {
            let Some(state) = states.get(seq) else {
                return Err(shape_err(format!(
                    "span of sequence {seq}, but {} states",
                    states.len()
                )));
            };
            if !tokens.is_empty() {
                self.check_inputs(tokens, state)?;
            }
        }
        let rows: usize = spans.iter().map(|s| s.0.len()).sum();
        if rows == 0 {
            for l in 0..self.layers.len() {
                for (i, s) in spans.iter().enumerate() {
                    after_mixer(l, i, &mut states[s.2].layers[l])?;
                }
            }
            return Ok(None);
        }
        let tokens: Vec<u32> = spans.iter().flat_map(|s| s.0.iter().copied()).collect();
        let positions: Vec<i64> = spans
            .iter()
            .flat_map(|&(t, p0, _)| (0..t.len() as i64).map(move |j| p0 + j))
            .collect();
        let offsets: Vec<usize> = spans
            .iter()
            .scan(0usize, |o, s| {
                let a = *o;
                *o += s.0.len();
                Some(a)
            })
            .collect();
        let single = spans.iter().filter(|s| !s.0.is_empty()).count() == 1;
        let pos_d = g.upload(&positions)?;
        // Per-span positions for the attention layers (uploaded once, not per layer).
        let span_pos: Vec<Option<CudaSlice<i64>>> = if single {
            vec![]
        } else {
            spans
                .iter()
                .zip(&offsets)
                .map(|(&(t, _, _), &a)| {
                    (!t.is_empty())
                        .then(|| g.upload(&positions[a..a + t.len()]))
                        .transpose()
                })
                .collect::<Result<_>>()?
        };
        let zero = T::from_f32(0.0);
        let st = g.stream();
        let mut x = self.embed_tokens(&tokens)?;
        let mut r: Scratch<T> = g.scratch(rows * h)?;
        if let Some(l0) = self.layers.first() {
            ops::rms_norm(
                g,
                NormKind::ZeroCentred,
                &x,
                None,
                &l0.input_norm,
                &mut r,
                rows,
                c.rms_norm_eps,
            )?;
        }
        for (l, lw) in self.layers.iter().enumerate() {
            let mut mixed: Scratch<T> = g.scratch(rows * h)?;
            if single {
                for (i, &(span, _, seq)) in spans.iter().enumerate() {
                    let t = span.len();
                    let ls = &mut states[seq].layers[l];
                    if t > 0 {
                        mixed = match (&lw.mixer, &mut *ls) {
                            (
                                MixerW::GatedDeltaNet(w),
                                GpuLayerState::Linear { conv, recurrent },
                            ) => self
                                .gdn(w, &r, t, conv, recurrent, None)
                                .map_err(|e| context(e, &format!("layer {l} GDN mixer")))?,
                            (MixerW::Attention(w), GpuLayerState::Full(kv)) => self
                                .attention(w, &r, t, &pos_d, kv)
                                .map_err(|e| context(e, &format!("layer {l} attention mixer")))?,
                            (MixerW::Lightning(w), GpuLayerState::Linear { recurrent, .. }) => self
                                .lightning(w, &r, t, &pos_d, recurrent, None)
                                .map_err(|e| context(e, &format!("layer {l} Lightning mixer")))?,
                            (MixerW::Kda(w), GpuLayerState::Linear { conv, recurrent }) => self
                                .kda(w, &r, t, conv, recurrent, None)
                                .map_err(|e| context(e, &format!("layer {l} KDA mixer")))?,
                            (MixerW::Mla(w), GpuLayerState::Full(kv)) => self
                                .mla(w, &r, t, &pos_d, kv)
                                .map_err(|e| context(e, &format!("layer {l} MLA mixer")))?,
                            _ => {
                                return Err(shape_err(format!(
                                    "layer {l}: state kind does not match the layer"
                                )))
                            }
                        };
                    }
                    after_mixer(l, i, ls)?;
                }
            } else {
                // Input projection over all rows; per span the stateful middle on its
                // rows (copied out), its output copied into `mid`; one output projection.
                let (w_in, n_in, w_out, n_mid) = match &lw.mixer {
                    MixerW::GatedDeltaNet(w) => (
                        &w.w_in,
                        c.conv_dim() + c.value_dim() + 2 * c.linear_v_heads,
                        &w.out,
                        c.value_dim(),
                    ),
                    MixerW::Attention(w) => (
                        &w.qkv,
                        self.attn_qkv_width(),
                        &w.o,
                        c.num_heads * c.head_dim,
                    ),
                    MixerW::Lightning(w) => {
                        (&w.w_in, 4 * self.lt_width(), &w.dense, self.lt_width())
                    }
                    MixerW::Kda(w) => (&w.w_in, kda_in_width(c), &w.o_proj, kda_width(c)),
                    MixerW::Mla(w) => (&w.w_in, mla_in_width(c), &w.o, mla_mid_width(c)),
                };
                let mut proj: Scratch<T> = g.scratch(rows * n_in)?;
                blas::linear(g, &r, rows, h, w_in, n_in, &mut proj, zero)?;
                let mut mid: Scratch<T> = g.scratch(rows * n_mid)?;
                for (i, &(span, _, seq)) in spans.iter().enumerate() {
                    let t = span.len();
                    let ls = &mut states[seq].layers[l];
                    if t > 0 {
                        let a = offsets[i];
                        let pj = g.scratch_copy(&proj.slice(a * n_in..(a + t) * n_in))?;
                        let m = match (&lw.mixer, &mut *ls, &span_pos[i]) {
                            (
                                MixerW::GatedDeltaNet(w),
                                GpuLayerState::Linear { conv, recurrent },
                                _,
                            ) => self
                                .gdn_core(w, &pj, t, conv, recurrent, None)
                                .map_err(|e| context(e, &format!("layer {l} GDN mixer")))?,
                            (MixerW::Attention(w), GpuLayerState::Full(kv), Some(pi)) => self
                                .attn_core(w, &pj, t, pi, kv)
                                .map_err(|e| context(e, &format!("layer {l} attention mixer")))?,
                            (
                                MixerW::Lightning(w),
                                GpuLayerState::Linear { recurrent, .. },
                                Some(pi),
                            ) => self
                                .lightning_core(w, &pj, t, pi, recurrent, None)
                                .map_err(|e| context(e, &format!("layer {l} Lightning mixer")))?,
                            (MixerW::Kda(w), GpuLayerState::Linear { conv, recurrent }, _) => self
                                .kda_core(w, &pj, t, conv, recurrent, None)
                                .map_err(|e| context(e, &format!("layer {l} KDA mixer")))?,
                            (MixerW::Mla(w), GpuLayerState::Full(kv), Some(pi)) => self
                                .mla_core(w, &pj, t, pi, kv)
                                .map_err(|e| context(e, &format!("layer {l} MLA mixer")))?,
                            _ => {
                                return Err(shape_err(format!(
                                    "layer {l}: state kind does not match the layer"
                                )))
                            }
                        };
                        st.memcpy_dtod(
                            &m.slice(..t * n_mid),
                            &mut mid.slice_mut(a * n_mid..(a + t) * n_mid),
                        )?;
                    }
                    after_mixer(l, i, ls)?;
                }
                blas::linear(g, &mid, rows, n_mid, w_out, h, &mut mixed, zero)?;
            }
            self.add_norm(&mut x, &mixed, &lw.post_norm, &mut r, rows)?;
            let f = self
                .ffn(&lw.ffn, &r, rows)
                .map_err(|e| context(e, &format!("layer {l} FFN")))?;
            match self.layers.get(l + 1) {
                Some(next) => self.add_norm(&mut x, &f, &next.input_norm, &mut r, rows)?,
                None => self.add_inplace(&mut x, &f, rows * h)?,
            }
        }
        Ok(Some(x))
    }

    /// Prefills several sequences' spans in one batched pass
    /// ([`GpuModel::forward_spans_multi`]): `items[i] = (tokens, state, want logits)`,
    /// each span at its state's `next_position ..`, which advances by its length.
    /// Returns per item the last token's host logits `[vocab]` fp32 when asked, else
    /// empty. The same math per row as [`GpuModel::prefill`] of each item alone, to
    /// the rounding of the batched GEMM shapes.
    ///
    /// Errors: as [`GpuModel::prefill`] for any item (before any state change); a
    /// driver error leaves states partly advanced.
    pub fn prefill_many(
        &self,
        items: &mut [(&[u32], &mut GpuState<T>, bool)],
    ) -> Result<Vec<Vec<f32>>> {
        let spans: Vec<(&[u32], i64, usize)> = items
            .iter()
            .enumerate()
            .map(|(i, it)| (it.0, it.1.next_position, i))
            .collect();
        for (i, it) in items.iter().enumerate() {
            if it.0.is_empty() {
                return Err(shape_err(format!("span {i} of a batched prefill is empty")));
            }
        }
        let x = {
            let mut states: Vec<&mut GpuState<T>> = items.iter_mut().map(|it| &mut *it.1).collect();
            self.forward_spans_multi(&spans, &mut states, |_, _, _| Ok(()))?
        };
        let h = self.config.hidden_size;
        let mut row = 0usize;
        let mut out = Vec::with_capacity(items.len());
        for it in items.iter_mut() {
            let t = it.0.len();
            row += t;
            it.1.next_position += t as i64;
            out.push(match (&x, it.2) {
                (Some(x), true) => {
                    let last = self.gpu.scratch_copy(&x.slice((row - 1) * h..row * h))?;
                    self.logits_of(&last, 1, Logits::Last)?
                }
                _ => vec![],
            });
        }
        Ok(out)
    }

    /// The FFN of one layer over `r` (`[t, h]`, normed) → `[t, h]`.
    fn ffn(&self, f: &FfnW<T>, r: &CudaSlice<T>, t: usize) -> Result<Scratch<T>> {
        self.ffn_with(f, r, t, None)
    }

    /// [`GpuModel::ffn`] with the MoE workspace `ws` instead of the model's own (the
    /// buffers a captured decode graph refers to).
    fn ffn_with(
        &self,
        f: &FfnW<T>,
        r: &CudaSlice<T>,
        t: usize,
        ws: Option<&mut moe::MoeWorkspace>,
    ) -> Result<Scratch<T>> {
        let g = &*self.gpu;
        let h = self.config.hidden_size;
        Ok(match f {
            FfnW::Dense(m) if self.ffn_path == FfnPath::Fused => {
                let mut o: Scratch<T> = g.scratch(t * h)?;
                moe::mlp_forward(g, &m.gate_up, &m.down, r, t, h, m.inter, &mut o)?;
                o
            }
            FfnW::Dense(m) => self.mlp(m, r, t)?,
            FfnW::Moe(m) => self.moe(m, r, t)?,
            FfnW::MoeFused(w) => {
                let mut o: Scratch<T> = g.scratch(t * h)?;
                match ws {
                    Some(ws) => moe::moe_forward(g, w, r, t, ws, &mut o)?,
                    None => {
                        let mut ws = self.moe_ws.lock().unwrap_or_else(|e| e.into_inner());
                        moe::moe_forward(g, w, r, t, &mut ws, &mut o)?;
                    }
                }
                o
            }
        })
    }

    /// One decode step for a batch of sequences: `tokens[b]` is appended to
    /// `states[b]`. The embedding, norms, projections, FFN and LM head run as one
    /// `[B, ·]` pass; the Gated DeltaNet layers and (bf16) the attention layers run
    /// their state work for all sequences at once, each on its own state through a
    /// device address table ([`GpuModel::set_gdn_rows`], [`GpuModel::set_attn_rows`]),
    /// the other mixers sequence by sequence. Returns `[B][vocab]` logits, the same
    /// arithmetic as `B` calls of [`GpuModel::decode`].
    ///
    /// Errors (before any state changes): `tokens.len() != states.len()`, more than
    /// [`MAX_DECODE_BATCH`] sequences, and as [`GpuModel::prefill`] for any sequence.
    pub fn decode_batch(
        &self,
        tokens: &[u32],
        states: &mut [&mut GpuState<T>],
    ) -> Result<Vec<Vec<f32>>> {
        if tokens.is_empty() {
            self.decode_hidden(tokens, states, None)?;
            return Ok(vec![]);
        }
        if let Some(rows) = self.graph_decode(tokens, states, None)? {
            return Ok(rows
                .into_iter()
                .map(|r| match r {
                    crate::engine::Decoded::Logits(l) => l,
                    crate::engine::Decoded::Token(_) => unreachable!("no draws asked"),
                })
                .collect());
        }
        let x = self.decode_hidden(tokens, states, None)?;
        let logits = self.logits_of(&x, tokens.len(), Logits::All)?;
        Ok(logits
            .chunks_exact(self.config.vocab_size)
            .map(|l| l.to_vec())
            .collect())
    }

    /// [`GpuModel::decode_batch`] with the next token of every row with
    /// `draws[b] = Some(p)` drawn on the device ([`super::sample::sample_into`], the
    /// draw of [`crate::sampling::draw`] on the logits as the host would receive
    /// them), so that only its token id is copied to the host; a `None` row gets its
    /// logits `[vocab]` as from `decode_batch`. Greedy rows use
    /// [`super::sample::argmax_into`].
    ///
    /// Errors: as [`GpuModel::decode_batch`]; [`CudaError::Shape`] when
    /// `draws.len() != tokens.len()`.
    pub fn decode_sample(
        &self,
        tokens: &[u32],
        states: &mut [&mut GpuState<T>],
        draws: &[Option<crate::sampling::DrawParams>],
    ) -> Result<Vec<crate::engine::Decoded>> {
        use crate::engine::Decoded;
        if draws.len() != tokens.len() {
            return Err(shape_err(format!(
                "{} draw rows for {} tokens",
                draws.len(),
                tokens.len()
            )));
        }
        if tokens.is_empty() {
            self.decode_hidden(tokens, states, None)?;
            return Ok(vec![]);
        }
        if draws.iter().all(Option::is_none) {
            return Ok(self
                .decode_batch(tokens, states)?
                .into_iter()
                .map(Decoded::Logits)
                .collect());
        }
        if let Some(rows) = self.graph_decode(tokens, states, Some(draws))? {
            return Ok(rows);
        }
        let (bsz, vocab) = (tokens.len(), self.config.vocab_size);
        let x = self.decode_hidden(tokens, states, None)?;
        let logits = self.logits_device(&x, bsz)?;
        let g = &*self.gpu;
        let wide = super::sample::widen_f32(g, &logits, bsz * vocab)?;
        let mut ids = g.zeros::<u32>(bsz)?;
        if draws.iter().flatten().all(|p| p.is_greedy()) {
            super::sample::argmax_into(g, &wide, bsz, vocab, &mut ids)?;
        } else {
            // Host-path rows are drawn greedily too (cheap) and their result unused.
            let params: Vec<crate::sampling::DrawParams> = draws
                .iter()
                .map(|d| {
                    d.unwrap_or(crate::sampling::DrawParams {
                        temperature: 0.0,
                        top_k: 0,
                        top_p: 1.0,
                        seed: 0,
                        step: 0,
                    })
                })
                .collect();
            super::sample::sample_into(g, &wide, bsz, vocab, &params, &mut ids)?;
        }
        let mut rows: Vec<Option<Vec<T>>> = Vec::with_capacity(bsz);
        for (b, d) in draws.iter().enumerate() {
            rows.push(match d {
                Some(_) => None,
                None => Some(
                    g.stream()
                        .clone_dtoh(&logits.slice(b * vocab..(b + 1) * vocab))?,
                ),
            });
        }
        let ids = g.download(&ids)?;
        Ok(rows
            .into_iter()
            .enumerate()
            .map(|(b, row)| match row {
                None => Decoded::Token(ids[b]),
                Some(l) => Decoded::Logits(l.into_iter().map(Elem::to_f32).collect()),
            })
            .collect())
    }

    /// The decode step of [`GpuModel::decode_batch`] up to the final residual
    /// `x: [B, hidden]` (states advanced); the LM head is left to the caller.
    ///
    /// With `dev` (the CUDA-graph form, [`super::graph`]): token ids, positions and KV
    /// lengths come from device buffers instead of the host, every KV cache was
    /// claimed for one more row beforehand ([`GpuKv::claim_next`]), attention takes the
    /// kernels that read the length from the device, and the MoE layers use `dev`'s
    /// workspace; the caller checked that every layer has such kernels
    /// (`graph::graphable`). The same kernels otherwise, in the same order; the eager
    /// step with batched attention claims its KV rows itself.
    ///
    /// Errors (before any state changes): token and state counts differ, more than
    /// [`MAX_DECODE_BATCH`] sequences, or as [`GpuModel::prefill`] for any sequence.
    pub(crate) fn decode_hidden(
        &self,
        tokens: &[u32],
        states: &mut [&mut GpuState<T>],
        mut dev: Option<&mut super::graph::DevStep<'_>>,
    ) -> Result<Scratch<T>> {
        if tokens.len() != states.len() {
            return Err(shape_err(format!(
                "{} tokens for {} states",
                tokens.len(),
                states.len()
            )));
        }
        if tokens.is_empty() {
            return self.gpu.scratch(0);
        }
        if tokens.len() > MAX_DECODE_BATCH {
            return Err(shape_err(format!(
                "a decode step of {} sequences (at most {MAX_DECODE_BATCH})",
                tokens.len()
            )));
        }
        for (tk, s) in tokens.iter().zip(states.iter()) {
            self.check_inputs(std::slice::from_ref(tk), s)?;
        }
        let c = &self.config;
        let g = &*self.gpu;
        let (bsz, h) = (tokens.len(), c.hidden_size);
        let pos_up;
        let pos_d: &CudaSlice<i64> = match dev.as_deref() {
            Some(d) => d.pos,
            None => {
                let positions: Vec<i64> = states.iter().map(|s| s.next_position).collect();
                pos_up = g.upload(&positions)?;
                &pos_up
            }
        };
        let mut x = match dev.as_deref() {
            Some(d) => self.embed_from(d.tokens, bsz)?,
            None => self.embed_tokens(tokens)?,
        };
        let mut attn_slot = 0usize;
        // The GDN layers run batched, reading each row's conv tail and recurrent state
        // through a device address table (`gdn_state_table`): the graph's input buffer
        // holds it, the eager step uploads it here.
        let gdn_up;
        let gdn_tbl: Option<&CudaSlice<u64>> = match dev.as_deref() {
            Some(d) => d.gdn_states,
            None => match self.gdn_state_table(states)? {
                Some(t) => {
                    gdn_up = g.upload(&t)?;
                    Some(&gdn_up)
                }
                None => None,
            },
        };
        let mut gdn_slot = 0usize;
        // The attention layers run batched likewise (bf16 decode kernel): every KV
        // row of the step is claimed first, so the address table (`attn_state_table`)
        // names the buffers the step writes; the graph's input buffer holds the table
        // and the lengths, the eager step uploads them here.
        let attn_up;
        let attn_rows: Option<(&CudaSlice<u64>, &CudaSlice<i32>)> = match dev.as_deref() {
            Some(d) => d.attn_states.map(|t| (t, d.kv_len)),
            None if self.attn_rows_ok() => {
                for s in states.iter_mut() {
                    for (l, lw) in s.layers.iter_mut().zip(&self.layers) {
                        if let (GpuLayerState::Full(kv), MixerW::Attention(_)) = (l, &lw.mixer) {
                            kv.claim_next(g)?;
                        }
                    }
                }
                let (tbl, lens) = self.attn_state_table(states)?;
                attn_up = (g.upload(&tbl)?, g.upload(&lens)?);
                Some((&attn_up.0, &attn_up.1))
            }
            None => None,
        };
        let zero = T::from_f32(0.0);
        let st = g.stream();
        let mut r: Scratch<T> = g.scratch(bsz * h)?;
        if let Some(l0) = self.layers.first() {
            ops::rms_norm(
                g,
                NormKind::ZeroCentred,
                &x,
                None,
                &l0.input_norm,
                &mut r,
                bsz,
                c.rms_norm_eps,
            )?;
        }
        for (i, lw) in self.layers.iter().enumerate() {
            let mixed = match &lw.mixer {
                MixerW::GatedDeltaNet(w) => {
                    let n_in = c.conv_dim() + c.value_dim() + 2 * c.linear_v_heads;
                    let vd = c.value_dim();
                    let mut proj: Scratch<T> = g.scratch(bsz * n_in)?;
                    blas::linear(g, &r, bsz, h, &w.w_in, n_in, &mut proj, zero)?;
                    let normed = match gdn_tbl {
                        Some(tbl) => {
                            let at = gdn_slot * 2 * bsz;
                            check_len("GDN state table", tbl, at + 2 * bsz)?;
                            let (tails, recs) =
                                (tbl.slice(at..at + bsz), tbl.slice(at + bsz..at + 2 * bsz));
                            // SAFETY: the table holds this layer's conv tails and recurrent
                            // states of `states`, row by row (`gdn_state_table`), all
                            // borrowed mutably by this call; distinct states own distinct
                            // buffers.
                            unsafe { self.gdn_core_rows(w, &proj, bsz, &tails, &recs)? }
                        }
                        None => {
                            let mut normed: Scratch<T> = g.scratch(bsz * vd)?;
                            for (j, s) in states.iter_mut().enumerate() {
                                let GpuLayerState::Linear { conv, recurrent } = &mut s.layers[i]
                                else {
                                    return Err(shape_err(format!("layer {i}: state kind")));
                                };
                                let pj = g.scratch_copy(&proj.slice(j * n_in..(j + 1) * n_in))?;
                                let nj = self.gdn_core(w, &pj, 1, conv, recurrent, None)?;
                                st.memcpy_dtod(
                                    &nj.slice(..vd),
                                    &mut normed.slice_mut(j * vd..(j + 1) * vd),
                                )?;
                            }
                            normed
                        }
                    };
                    gdn_slot += 1;
                    let mut out: Scratch<T> = g.scratch(bsz * h)?;
                    blas::linear(g, &normed, bsz, vd, &w.out, h, &mut out, zero)?;
                    out
                }
                MixerW::Attention(w) => {
                    let fw = self.attn_qkv_width();
                    let ow = c.num_heads * c.head_dim;
                    let mut qkv: Scratch<T> = g.scratch(bsz * fw)?;
                    blas::linear(g, &r, bsz, h, &w.qkv, fw, &mut qkv, zero)?;
                    let mut o: Scratch<T> = g.scratch(bsz * ow)?;
                    if let Some((tbl, lens)) = attn_rows {
                        let at = attn_slot * 3 * bsz;
                        check_len("attention state table", tbl, at + 3 * bsz)?;
                        check_len("KV lengths", lens, (attn_slot + 1) * bsz)?;
                        let (tbl, lens) = (
                            tbl.slice(at..at + 3 * bsz),
                            lens.slice(attn_slot * bsz..(attn_slot + 1) * bsz),
                        );
                        // The grid's splits and the packed workspace: enough for every
                        // row's length (the graph's for any length up to the capacities
                        // it is keyed by).
                        let (mut splits, mut total) = (1, 0);
                        for s in states.iter() {
                            let GpuLayerState::Full(kv) = &s.layers[i] else {
                                return Err(shape_err(format!("layer {i}: state kind")));
                            };
                            let n = if dev.is_some() {
                                kv.capacity()
                            } else {
                                kv.len() + 1
                            };
                            splits = splits.max(attn::decode_plan(n));
                            total += attn::decode_plan(n);
                        }
                        let (q, gate, k, v) = self.attn_prep(w, &qkv, bsz, pos_d)?;
                        // SAFETY: the table holds this layer's KV buffers of `states`, row
                        // by row (`attn_state_table`), each claimed for row `len` before
                        // the step (`claim_next`: the row is this holder's alone, the
                        // buffer holds it), and `lens` holds `len + 1`; all borrowed
                        // mutably by this call.
                        unsafe {
                            attn::kv_append_rows(
                                g,
                                &k,
                                &v,
                                pos_d,
                                &tbl,
                                &lens,
                                bsz,
                                c.num_kv_heads * c.head_dim,
                            )?
                        };
                        // SAFETY: as above; each length is at most the capacity `splits`
                        // and `total` were planned for.
                        unsafe {
                            attn::decode_rows(
                                g,
                                &q,
                                pos_d,
                                &tbl,
                                &lens,
                                &mut o,
                                bsz,
                                (splits, total),
                                c.num_heads,
                                c.num_kv_heads,
                                c.head_dim,
                            )?
                        };
                        if c.attn_output_gate {
                            self.gate_mul(&mut o, &gate, bsz * ow)?;
                        }
                        // The appended rows count once the layer's work is queued (a
                        // failure before leaves them past `len`, in claimed rows).
                        for s in states.iter_mut() {
                            let GpuLayerState::Full(kv) = &mut s.layers[i] else {
                                return Err(shape_err(format!("layer {i}: state kind")));
                            };
                            kv.appended_claimed()?;
                        }
                    } else {
                        for (j, s) in states.iter_mut().enumerate() {
                            let GpuLayerState::Full(kv) = &mut s.layers[i] else {
                                return Err(shape_err(format!("layer {i}: state kind")));
                            };
                            let qj = g.scratch_copy(&qkv.slice(j * fw..(j + 1) * fw))?;
                            let pj = g.scratch_copy(&pos_d.slice(j..j + 1))?;
                            let oj = match dev.as_deref() {
                                Some(d) => {
                                    let at = attn_slot * bsz + j;
                                    self.attn_core_dev(
                                        w,
                                        &qj,
                                        &pj,
                                        kv,
                                        &d.kv_len.slice(at..at + 1),
                                    )?
                                }
                                None => self.attn_core(w, &qj, 1, &pj, kv)?,
                            };
                            st.memcpy_dtod(
                                &oj.slice(..ow),
                                &mut o.slice_mut(j * ow..(j + 1) * ow),
                            )?;
                        }
                    }
                    attn_slot += 1;
                    let mut out: Scratch<T> = g.scratch(bsz * h)?;
                    blas::linear(g, &o, bsz, ow, &w.o, h, &mut out, zero)?;
                    out
                }
                MixerW::Lightning(w) => {
                    let wd = self.lt_width();
                    let mut proj: Scratch<T> = g.scratch(bsz * 4 * wd)?;
                    blas::linear(g, &r, bsz, h, &w.w_in, 4 * wd, &mut proj, zero)?;
                    let mut y: Scratch<T> = g.scratch(bsz * wd)?;
                    for (j, s) in states.iter_mut().enumerate() {
                        let GpuLayerState::Linear { recurrent, .. } = &mut s.layers[i] else {
                            return Err(shape_err(format!("layer {i}: state kind")));
                        };
                        let pj = g.scratch_copy(&proj.slice(j * 4 * wd..(j + 1) * 4 * wd))?;
                        let posj = g.scratch_copy(&pos_d.slice(j..j + 1))?;
                        let yj = self.lightning_core(w, &pj, 1, &posj, recurrent, None)?;
                        st.memcpy_dtod(&yj.slice(..wd), &mut y.slice_mut(j * wd..(j + 1) * wd))?;
                    }
                    let mut out: Scratch<T> = g.scratch(bsz * h)?;
                    blas::linear(g, &y, bsz, wd, &w.dense, h, &mut out, zero)?;
                    out
                }
                MixerW::Kda(w) => {
                    let (n_in, wd) = (kda_in_width(c), kda_width(c));
                    let mut proj: Scratch<T> = g.scratch(bsz * n_in)?;
                    blas::linear(g, &r, bsz, h, &w.w_in, n_in, &mut proj, zero)?;
                    let mut core: Scratch<T> = g.scratch(bsz * wd)?;
                    for (j, s) in states.iter_mut().enumerate() {
                        let GpuLayerState::Linear { conv, recurrent } = &mut s.layers[i] else {
                            return Err(shape_err(format!("layer {i}: state kind")));
                        };
                        let pj = g.scratch_copy(&proj.slice(j * n_in..(j + 1) * n_in))?;
                        let cj = self.kda_core(w, &pj, 1, conv, recurrent, None)?;
                        st.memcpy_dtod(&cj.slice(..wd), &mut core.slice_mut(j * wd..(j + 1) * wd))?;
                    }
                    let mut out: Scratch<T> = g.scratch(bsz * h)?;
                    blas::linear(g, &core, bsz, wd, &w.o_proj, h, &mut out, zero)?;
                    out
                }
                MixerW::Mla(w) => {
                    let (n_in, ow) = (mla_in_width(c), mla_mid_width(c));
                    let mut proj: Scratch<T> = g.scratch(bsz * n_in)?;
                    blas::linear(g, &r, bsz, h, &w.w_in, n_in, &mut proj, zero)?;
                    let mut o: Scratch<T> = g.scratch(bsz * ow)?;
                    for (j, s) in states.iter_mut().enumerate() {
                        let GpuLayerState::Full(kv) = &mut s.layers[i] else {
                            return Err(shape_err(format!("layer {i}: state kind")));
                        };
                        let pj = g.scratch_copy(&proj.slice(j * n_in..(j + 1) * n_in))?;
                        let posj = g.scratch_copy(&pos_d.slice(j..j + 1))?;
                        let oj = self.mla_core(w, &pj, 1, &posj, kv)?;
                        st.memcpy_dtod(&oj.slice(..ow), &mut o.slice_mut(j * ow..(j + 1) * ow))?;
                    }
                    let mut out: Scratch<T> = g.scratch(bsz * h)?;
                    blas::linear(g, &o, bsz, ow, &w.o, h, &mut out, zero)?;
                    out
                }
            };
            self.add_norm(&mut x, &mixed, &lw.post_norm, &mut r, bsz)?;
            let f = self.ffn_with(&lw.ffn, &r, bsz, dev.as_deref_mut().map(|d| &mut *d.moe_ws))?;
            match self.layers.get(i + 1) {
                Some(next) => self.add_norm(&mut x, &f, &next.input_norm, &mut r, bsz)?,
                None => self.add_inplace(&mut x, &f, bsz * h)?,
            }
        }
        for s in states.iter_mut() {
            s.next_position += 1;
        }
        Ok(x)
    }

    /// `x += y`, then `r = ZeroCentred-RMSNorm(x; w)`, over `rows` rows of width
    /// `hidden` (`x, y, r: [rows, hidden]`, `w: [hidden]` fp32): [`GpuModel::add_inplace`]
    /// and [`ops::rms_norm`] in one launch (`add_rmsnorm_*` in model.cu), same roundings.
    fn add_norm(
        &self,
        x: &mut CudaSlice<T>,
        y: &CudaSlice<T>,
        w: &CudaSlice<f32>,
        r: &mut CudaSlice<T>,
        rows: usize,
    ) -> Result<()> {
        let d = w.len();
        check_len("x", x, rows * d)?;
        check_len("y", y, rows * d)?;
        check_len("r", r, rows * d)?;
        if rows == 0 || d == 0 {
            return Ok(());
        }
        let g = &*self.gpu;
        let f = g.function(&MODEL, &format!("add_rmsnorm_{}", T::SUFFIX), 0)?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            // rmsnorm_*'s block size for d (ops::rms_norm): the same reduction order.
            block_dim: (if d <= 512 { 128 } else { 256 }, 1, 1),
            shared_mem_bytes: 0,
        };
        let (di, eps) = (dim_i32("hidden", d)?, self.config.rms_norm_eps);
        let mut b = g.stream().launch_builder(&f);
        b.arg(x).arg(y).arg(w).arg(r).arg(&di).arg(&eps);
        // SAFETY: matches `add_rmsnorm_*`; x, y, r: [rows, d] checked, w: [d].
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn add_inplace(&self, x: &mut CudaSlice<T>, y: &CudaSlice<T>, n: usize) -> Result<()> {
        check_len("x", x, n)?;
        check_len("y", y, n)?;
        let g = &*self.gpu;
        let f = g.function(&MODEL, &format!("add_inplace_{}", T::SUFFIX), 0)?;
        let nn = n as u64;
        let mut b = g.stream().launch_builder(&f);
        b.arg(x).arg(y).arg(&nn);
        // SAFETY: matches `add_inplace_*`; lengths checked.
        unsafe { b.launch(cfg1(n)) }?;
        Ok(())
    }

    /// Gated DeltaNet mixer over `r` (`[t, h]`, normed), advancing the conv tail and
    /// the recurrent state. Returns the mixer output `[t, h]`.
    fn gdn(
        &self,
        w: &GdnW<T>,
        r: &CudaSlice<T>,
        t: usize,
        conv_tail: &mut CudaSlice<f32>,
        rec: &mut CudaSlice<f32>,
        capture: Option<(usize, &mut Option<DensePair>)>,
    ) -> Result<Scratch<T>> {
        let c = &self.config;
        let g = &*self.gpu;
        let h = c.hidden_size;
        let n_in = c.conv_dim() + c.value_dim() + 2 * c.linear_v_heads;
        let zero = T::from_f32(0.0);
        let mut proj: Scratch<T> = g.scratch(t * n_in)?;
        blas::linear(g, r, t, h, &w.w_in, n_in, &mut proj, zero)?;
        let normed = self.gdn_core(w, &proj, t, conv_tail, rec, capture)?;
        let mut out: Scratch<T> = g.scratch(t * h)?;
        blas::linear(g, &normed, t, c.value_dim(), &w.out, h, &mut out, zero)?;
        Ok(out)
    }

    /// The GDN between its two projections: from `proj` (`[t, n_in]`, the fused
    /// in-projection) to the gated-normed core output `[t, value_dim]` (before
    /// `out_proj`), advancing the conv tail and the recurrent state.
    fn gdn_core(
        &self,
        w: &GdnW<T>,
        proj: &CudaSlice<T>,
        t: usize,
        conv_tail: &mut CudaSlice<f32>,
        rec: &mut CudaSlice<f32>,
        capture: Option<(usize, &mut Option<DensePair>)>,
    ) -> Result<Scratch<T>> {
        let c = &self.config;
        let g = &*self.gpu;
        let (hk, hv, dk, dv) = (
            c.linear_k_heads,
            c.linear_v_heads,
            c.linear_k_dim,
            c.linear_v_dim,
        );
        let (vd, cd) = (c.value_dim(), c.conv_dim());
        let n_in = cd + vd + 2 * hv;
        let kk = c.conv_kernel;
        check_len("GDN projection [t, n_in]", proj, t * n_in)?;
        let mut mixed: Scratch<T> = g.scratch(t * cd)?;
        if t == 1 {
            ops::conv1d_update(g, proj, &w.conv, conv_tail, &mut mixed, cd, kk, true)?;
        } else {
            ops::conv1d_prefill(
                g, proj, n_in, &w.conv, conv_tail, &mut mixed, t, cd, kk, true,
            )?;
        }
        let GdnPrep {
            q,
            k,
            v,
            z,
            gg,
            beta,
        } = self.gdn_prep(w, &mixed, proj, t)?;
        let d = GdrDims { t, hk, hv, dk, dv };
        let mut core: Scratch<T> = g.scratch(t * vd)?;
        match capture {
            None => self.gdr_span(&d, &q, &k, &v, &gg, &beta, rec, &mut core, None)?,
            Some((from, out)) => {
                *out = Some(self.gdr_capture(&d, from, &q, &k, &v, &gg, &beta, rec, &mut core)?);
            }
        }
        let mut normed: Scratch<T> = g.scratch(t * vd)?;
        ops::rms_norm(
            g,
            NormKind::Gated,
            &core,
            Some(&z),
            &w.norm,
            &mut normed,
            t * hv,
            c.rms_norm_eps,
        )?;
        Ok(normed)
    }

    /// [`GpuModel::gdn_core`] for one decode token of each of `b` sequences, each row
    /// with the same kernels and arithmetic as a one-token `gdn_core` of its own, in
    /// four launches whatever `b`: the conv update and the recurrence read each row's
    /// conv tail and recurrent state through the device address tables `tails` and
    /// `recs` (`[b]` each, [`GpuModel::gdn_state_table`]). `proj`: `[b, n_in]`; returns
    /// `[b, value_dim]`. Only for `dk` ∈ [`GDR_REC_DK`] (the recurrent kernel's).
    ///
    /// # Safety
    /// `tails[i]` and `recs[i]` must be the live conv tail (`[conv_dim, K−1]` fp32)
    /// and recurrent state (`[Hv, dk, dv]` fp32) of this layer for row `i`, all distinct.
    unsafe fn gdn_core_rows(
        &self,
        w: &GdnW<T>,
        proj: &CudaSlice<T>,
        b: usize,
        tails: &cudarc::driver::CudaView<'_, u64>,
        recs: &cudarc::driver::CudaView<'_, u64>,
    ) -> Result<Scratch<T>> {
        let c = &self.config;
        let g = &*self.gpu;
        let (hk, hv, dk, dv) = (
            c.linear_k_heads,
            c.linear_v_heads,
            c.linear_k_dim,
            c.linear_v_dim,
        );
        let (vd, cd) = (c.value_dim(), c.conv_dim());
        let n_in = cd + vd + 2 * hv;
        let mut mixed: Scratch<T> = g.scratch(b * cd)?;
        // SAFETY: the tail addresses are this function's contract.
        unsafe {
            ops::conv1d_update_rows(
                g,
                proj,
                n_in,
                &w.conv,
                tails,
                &mut mixed,
                b,
                cd,
                c.conv_kernel,
                true,
            )?
        };
        let GdnPrep {
            q,
            k,
            v,
            z,
            gg,
            beta,
        } = self.gdn_prep(w, &mixed, proj, b)?;
        let d = GdrDims {
            t: b,
            hk,
            hv,
            dk,
            dv,
        };
        let mut core: Scratch<T> = g.scratch(b * vd)?;
        // SAFETY: the state addresses are this function's contract.
        unsafe { gdr::recurrent_rows(g, &d, &q, &k, &v, &gg, &beta, recs, &mut core)? };
        let mut normed: Scratch<T> = g.scratch(b * vd)?;
        ops::rms_norm(
            g,
            NormKind::Gated,
            &core,
            Some(&z),
            &w.norm,
            &mut normed,
            b * hv,
            c.rms_norm_eps,
        )?;
        Ok(normed)
    }

    /// Device addresses of the conv tails and recurrent states of every Gated DeltaNet
    /// layer for a batch of `B` states, as the table the batched decode step reads:
    /// `[n_gdn, 2, B]` u64 (per GDN layer in layer order: the B conv-tail addresses,
    /// then the B recurrent-state addresses). `None` when the model has no GDN layer
    /// or its `dk` has no recurrent kernel (the decode step then goes sequence by
    /// sequence). Errors: a state whose layer kinds do not match the model's.
    pub(crate) fn gdn_state_table(&self, states: &[&mut GpuState<T>]) -> Result<Option<Vec<u64>>> {
        if !self.gdn_rows_ok() {
            return Ok(None);
        }
        let st = self.gpu.stream();
        let bsz = states.len();
        let mut table = Vec::new();
        for (i, lw) in self.layers.iter().enumerate() {
            if !matches!(lw.mixer, MixerW::GatedDeltaNet(_)) {
                continue;
            }
            let at = table.len();
            table.resize(at + 2 * bsz, 0u64);
            for (j, s) in states.iter().enumerate() {
                let GpuLayerState::Linear { conv, recurrent } = &s.layers[i] else {
                    return Err(shape_err(format!("layer {i}: state kind")));
                };
                table[at + j] = conv.device_ptr(st).0;
                table[at + bsz + j] = recurrent.device_ptr(st).0;
            }
        }
        Ok(Some(table))
    }

    /// The KV caches of every attention layer for a batch of `B` states, as the batched
    /// decode step reads them ([`attn::kv_append_rows`], [`attn::decode_rows`]): the
    /// address table `[n_attn, 3, B]` u64 (per attention layer in layer order: the B
    /// key-cache, the B value-cache, then the B position-cache addresses) and the
    /// lengths after the step's append `[n_attn, B]` i32 (`len + 1`). Call after
    /// [`GpuKv::claim_next`] of every such cache (the addresses are then the buffers
    /// the step writes). Errors: a state whose layer kinds do not match the model's, a
    /// length over i32.
    pub(crate) fn attn_state_table(
        &self,
        states: &[&mut GpuState<T>],
    ) -> Result<(Vec<u64>, Vec<i32>)> {
        let g = &*self.gpu;
        let bsz = states.len();
        let (mut table, mut lens) = (Vec::new(), Vec::new());
        for (i, lw) in self.layers.iter().enumerate() {
            if !matches!(lw.mixer, MixerW::Attention(_)) {
                continue;
            }
            let (at, al) = (table.len(), lens.len());
            table.resize(at + 3 * bsz, 0u64);
            lens.resize(al + bsz, 0i32);
            for (j, s) in states.iter().enumerate() {
                let GpuLayerState::Full(kv) = &s.layers[i] else {
                    return Err(shape_err(format!("layer {i}: state kind")));
                };
                let [k, v, p, _cap] = kv.key(g);
                table[at + j] = k;
                table[at + bsz + j] = v;
                table[at + 2 * bsz + j] = p;
                lens[al + j] = i32::try_from(kv.len() + 1)
                    .map_err(|_| shape_err("KV length exceeds i32".into()))?;
            }
        }
        Ok((table, lens))
    }

    /// Entries of [`GpuModel::attn_state_table`]'s address table for a batch of `bsz`
    /// (0 when the attention layers do not run batched).
    pub(crate) fn attn_table_words(&self, bsz: usize) -> usize {
        if !self.attn_rows_ok() {
            return 0;
        }
        let n = self
            .layers
            .iter()
            .filter(|l| matches!(l.mixer, MixerW::Attention(_)))
            .count();
        n * 3 * bsz
    }

    /// Whether the decode step runs its attention layers batched
    /// ([`attn::kv_append_rows`], [`attn::decode_rows`]): bf16, head dims and grouping
    /// the decode kernel takes, an attention layer, and the model's switch
    /// ([`GpuModel::set_attn_rows`]) on — by default unless `HYPIC_CUDA_ATTN_ROWS=0`
    /// (`0` keeps the sequence-by-sequence step, for comparisons).
    pub(crate) fn attn_rows_ok(&self) -> bool {
        let c = &self.config;
        self.graphs.attn_rows.on("HYPIC_CUDA_ATTN_ROWS")
            && attn::check_decode_kernel::<T>("", c.num_heads, c.num_kv_heads, c.head_dim).is_ok()
            && self
                .layers
                .iter()
                .any(|l| matches!(l.mixer, MixerW::Attention(_)))
    }

    /// Whether a batched decode step of this model runs its attention layers for all
    /// sequences at once (see [`GpuModel::set_attn_rows`]): the switch is on, the model
    /// is bf16 with an attention layer the decode kernel takes.
    pub fn attn_rows_active(&self) -> bool {
        self.attn_rows_ok()
    }

    /// Whether a batched decode step of this model runs its Gated DeltaNet layers for
    /// all sequences at once (see [`GpuModel::set_gdn_rows`]).
    pub fn gdn_rows_active(&self) -> bool {
        self.gdn_rows_ok()
    }

    /// Entries of [`GpuModel::gdn_state_table`] for a batch of `bsz` (0 when the GDN
    /// layers do not run batched).
    pub(crate) fn gdn_table_words(&self, bsz: usize) -> usize {
        if !self.gdn_rows_ok() {
            return 0;
        }
        let n = self
            .layers
            .iter()
            .filter(|l| matches!(l.mixer, MixerW::GatedDeltaNet(_)))
            .count();
        n * 2 * bsz
    }

    /// Whether the decode step runs its GDN layers batched ([`GpuModel::gdn_core_rows`]):
    /// the model has a GDN layer, its `dk` has the recurrent kernel, and the model's
    /// switch ([`GpuModel::set_gdn_rows`]) is on — by default unless
    /// `HYPIC_CUDA_GDN_ROWS=0` (`0` keeps the sequence-by-sequence step, for
    /// comparisons).
    pub(crate) fn gdn_rows_ok(&self) -> bool {
        self.graphs.gdn_rows.on("HYPIC_CUDA_GDN_ROWS")
            && GDR_REC_DK.contains(&self.config.linear_k_dim)
            && self
                .layers
                .iter()
                .any(|l| matches!(l.mixer, MixerW::GatedDeltaNet(_)))
    }

    /// q, k (L2-normalised per head, q also scaled by `dk^−½`), v, z and the gates
    /// g, β of `t` rows (tokens of one span, or one token of each of `t` sequences:
    /// the kernel reads nothing across rows) in one launch (`gdn_prep_*`: gdn_qk's
    /// blocks plus one block per row for the rest). `mixed`: the conv output
    /// `[t, conv_dim]`; `proj`: the input projection `[t, n_in]`.
    fn gdn_prep(
        &self,
        w: &GdnW<T>,
        mixed: &CudaSlice<T>,
        proj: &CudaSlice<T>,
        t: usize,
    ) -> Result<GdnPrep<T>> {
        let c = &self.config;
        let g = &*self.gpu;
        let (hk, hv, dk) = (c.linear_k_heads, c.linear_v_heads, c.linear_k_dim);
        let (kd, vd, cd) = (c.key_dim(), c.value_dim(), c.conv_dim());
        let n_in = cd + vd + 2 * hv;
        check_len("GDN conv output [t, conv_dim]", mixed, t * cd)?;
        check_len("GDN projection [t, n_in]", proj, t * n_in)?;
        let mut q: Scratch<T> = g.scratch(t * kd)?;
        let mut k: Scratch<T> = g.scratch(t * kd)?;
        let mut v: Scratch<T> = g.scratch(t * vd)?;
        let mut z: Scratch<T> = g.scratch(t * vd)?;
        let mut gg: Scratch<f32> = g.scratch(t * hv)?;
        let mut beta: Scratch<f32> = g.scratch(t * hv)?;
        {
            let f = g.function(&MODEL, &format!("gdn_prep_{}", T::SUFFIX), 0)?;
            let (hki, dki, cdi, ni, vdi, hvi) = (
                dim_i32("Hk", hk)?,
                dim_i32("dk", dk)?,
                dim_i32("conv_dim", cd)?,
                dim_i32("n_in", n_in)?,
                dim_i32("value_dim", vd)?,
                dim_i32("Hv", hv)?,
            );
            if cd < 2 * kd + vd {
                return Err(shape_err(format!(
                    "conv_dim {cd} < 2·key_dim + value_dim = {}",
                    2 * kd + vd
                )));
            }
            let scale = (dk as f32).powf(-0.5);
            let eps = L2_EPS;
            // v/z copy blocks: one element per thread for one token (64 at most; a few
            // when the launch has many tokens anyway).
            let threads = if dk <= 32 { 32 } else { 128 };
            let nvz = if t <= 8 {
                vd.div_ceil(threads).clamp(1, 64)
            } else {
                2
            };
            let cfg = LaunchConfig {
                grid_dim: (dim_i32("t", t)? as u32, (2 * hk + nvz) as u32, 1),
                block_dim: (threads as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = g.stream().launch_builder(&f);
            b.arg(mixed)
                .arg(proj)
                .arg(&mut q)
                .arg(&mut k)
                .arg(&mut v)
                .arg(&mut z)
                .arg(&mut gg)
                .arg(&mut beta)
                .arg(&w.neg_a)
                .arg(&w.dt_bias)
                .arg(&hki)
                .arg(&dki)
                .arg(&cdi)
                .arg(&ni)
                .arg(&vdi)
                .arg(&hvi)
                .arg(&scale)
                .arg(&eps);
            // SAFETY: matches `gdn_prep_*`; mixed: [t, cd] with cd ≥ 2·kd + vd (checked),
            // proj: [t, n_in] (checked), n_in = cd + vd + 2·hv; q, k: [t, hk, dk];
            // v, z: [t, vd]; gg, beta: [t, hv]; neg_a, dt_bias: [hv].
            unsafe { b.launch(cfg) }?;
        }
        Ok(GdnPrep {
            q,
            k,
            v,
            z,
            gg,
            beta,
        })
    }

    /// The gated delta rule over a whole span from `rec` (advanced in place), with the
    /// kernel the forward uses for its shape (chunked for `dk = dv = 128` and spans of
    /// ≥ 16 tokens, else recurrent for `dk ∈ {64, 128, 256}`, else generic). `trans`
    /// (`[Hv, dk, dk]`): when given, left-multiplied by the span's transition (in the
    /// same pass by the chunked kernel, else by the generic recurrence of `pic.cu`).
    #[allow(clippy::too_many_arguments)]
    fn gdr_span(
        &self,
        d: &GdrDims,
        q: &CudaSlice<T>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        gg: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        rec: &mut CudaSlice<f32>,
        core: &mut CudaSlice<T>,
        trans: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        let g = &*self.gpu;
        let (dk, dv) = (d.dk, d.dv);
        if dk == gdr::PREFILL_DIM && dv == gdr::PREFILL_DIM && d.t >= CHUNKED_MIN_TOKENS {
            let mut ws = self.gdr_ws.lock().unwrap_or_else(|e| e.into_inner());
            return gdr::chunked(g, d, q, k, v, gg, beta, rec, core, trans, &mut ws);
        }
        if let Some(tr) = trans {
            super::pic::gdr_transition(g, d, k, gg, beta, tr)?;
        }
        if GDR_REC_DK.contains(&dk) {
            gdr::recurrent(g, d, q, k, v, gg, beta, rec, core)
        } else {
            gdr_generic(g, d, q, k, v, gg, beta, rec, core)
        }
    }

    /// [`GpuModel::gdr_span`] split at `from` (clamped to `d.t`): the seam `0..from`
    /// from `rec`, then the body `from..` with its transition; returns the body pair
    /// `(T_body, S_end − T_body·S_from)` as the CPU `mixers::gated_deltanet::layer::with_body_pair` does.
    #[allow(clippy::too_many_arguments)]
    fn gdr_capture(
        &self,
        d: &GdrDims,
        from: usize,
        q: &CudaSlice<T>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        gg: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        rec: &mut CudaSlice<f32>,
        core: &mut CudaSlice<T>,
    ) -> Result<DensePair> {
        let g = &*self.gpu;
        let s = g.stream();
        let (t, hk, hv, dk, dv) = (d.t, d.hk, d.hv, d.dk, d.dv);
        let from = from.min(t);
        let (qk, vv) = (hk * dk, hv * dv);
        // Row ranges of every input as new buffers.
        let part = |a: usize, b: usize| -> Result<_> {
            Ok((
                s.clone_dtod(&q.slice(a * qk..b * qk))?,
                s.clone_dtod(&k.slice(a * qk..b * qk))?,
                s.clone_dtod(&v.slice(a * vv..b * vv))?,
                s.clone_dtod(&gg.slice(a * hv..b * hv))?,
                s.clone_dtod(&beta.slice(a * hv..b * hv))?,
            ))
        };
        if from > 0 {
            let (q0, k0, v0, g0, b0) = part(0, from)?;
            let mut o0: CudaSlice<T> = g.zeros(from * vv)?;
            let d0 = GdrDims { t: from, ..*d };
            self.gdr_span(&d0, &q0, &k0, &v0, &g0, &b0, rec, &mut o0, None)?;
            s.memcpy_dtod(&o0.slice(..from * vv), &mut core.slice_mut(..from * vv))?;
        }
        let s_from = s.clone_dtod(rec)?;
        let mut tr: CudaSlice<f32> = g.zeros(hv * dk * dk)?;
        gdr::set_identity(g, &mut tr, hv, dk)?;
        if from < t {
            let (q1, k1, v1, g1, b1) = part(from, t)?;
            let mut o1: CudaSlice<T> = g.zeros((t - from) * vv)?;
            let d1 = GdrDims { t: t - from, ..*d };
            self.gdr_span(&d1, &q1, &k1, &v1, &g1, &b1, rec, &mut o1, Some(&mut tr))?;
            s.memcpy_dtod(
                &o1.slice(..(t - from) * vv),
                &mut core.slice_mut(from * vv..t * vv),
            )?;
        }
        // B = S_end − T·S_from.
        let n = hv * dk * dv;
        let mut b: CudaSlice<f32> = g.zeros(n)?;
        super::transition::batched_matmul(g, hv, dk, dv, dk, &tr, &s_from, &mut b, 0.0)?;
        super::pic::axpby(g, &mut b, rec, -1.0, 1.0, n)?;
        Ok(DensePair {
            hv,
            dk,
            dv,
            t: tr,
            b,
        })
    }

    /// Width `H·d` of a Lightning layer's q, k, v and output.
    fn lt_width(&self) -> usize {
        self.config.linear_v_heads * self.config.linear_k_dim
    }

    /// Lightning mixer over `r` (`[t, h]`, normed) at positions `pos` (`[t]`),
    /// advancing the recurrent state `rec`; with `capture`, also the body pair of
    /// tokens `from..t`. Returns the mixer output `[t, h]`.
    fn lightning(
        &self,
        w: &LightningW<T>,
        r: &CudaSlice<T>,
        t: usize,
        pos: &CudaSlice<i64>,
        rec: &mut CudaSlice<f32>,
        capture: Option<(usize, &mut Option<ScalarPair>)>,
    ) -> Result<Scratch<T>> {
        let c = &self.config;
        let g = &*self.gpu;
        let (h, wd) = (c.hidden_size, self.lt_width());
        let zero = T::from_f32(0.0);
        let mut proj: Scratch<T> = g.scratch(t * 4 * wd)?;
        blas::linear(g, r, t, h, &w.w_in, 4 * wd, &mut proj, zero)?;
        let y = self.lightning_core(w, &proj, t, pos, rec, capture)?;
        let mut out: Scratch<T> = g.scratch(t * h)?;
        blas::linear(g, &y, t, wd, &w.dense, h, &mut out, zero)?;
        Ok(out)
    }

    /// The Lightning layer between its projections: from `proj` (`[t, 4W]`: q | k | v
    /// | gate logits) to the gated, group-normed output `[t, W]` (before `dense`),
    /// advancing `rec` (`[H, d, d]` fp32). With `capture = (from, out)`, `out` gets the
    /// body pair of `from..t` (clamped): `exp(g_h·(t − from))` and the state of a
    /// state-only chunked pass over the body from zero (as the CPU
    /// `mixers::lightning::layer::mix`). bf16 models with head dim [`lt::TC_DIM`] run
    /// spans of at least [`lt::CHUNKED_MIN_TOKENS`] tokens on tensor cores
    /// ([`lt::chunked_tc`], q/k/v/o in bf16) unless [`lt::tensor_cores_enabled`] says
    /// no; everything else takes the fp32 kernels.
    fn lightning_core(
        &self,
        w: &LightningW<T>,
        proj: &CudaSlice<T>,
        t: usize,
        pos: &CudaSlice<i64>,
        rec: &mut CudaSlice<f32>,
        capture: Option<(usize, &mut Option<ScalarPair>)>,
    ) -> Result<Scratch<T>> {
        let c = &self.config;
        let g = &*self.gpu;
        let d = c.linear_k_dim;
        check_len(
            "Lightning projection [t, 4W]",
            proj,
            t * 4 * c.linear_v_heads * d,
        )?;
        let (ld, scale) = (&w.log_decay, (d as f32).powf(-0.5));
        if T::SUFFIX == "bf16"
            && d == lt::TC_DIM
            && t >= lt::CHUNKED_MIN_TOKENS
            && lt::tensor_cores_enabled()
        {
            return self.lightning_mix::<T>(
                w,
                proj,
                t,
                pos,
                rec,
                capture,
                |b, _, k, v, s| lt::chunked_tc(g, b, k, k, v, ld, scale, s, None),
                |dims, q, k, v, s, o| lt::chunked_tc(g, dims, q, k, v, ld, scale, s, Some(o)),
            );
        }
        self.lightning_mix::<f32>(
            w,
            proj,
            t,
            pos,
            rec,
            capture,
            |b, q, k, v, s| {
                if d <= lt::MAX_CHUNK_DK {
                    lt::chunked(g, b, q, k, v, ld, scale, s, None)
                } else {
                    let mut ob: CudaSlice<f32> = g.zeros(b.t * b.h * b.dv)?;
                    lt::recurrent(g, b, q, k, v, ld, scale, s, &mut ob)
                }
            },
            |dims, q, k, v, s, o| lt::span(g, dims, q, k, v, ld, scale, s, o),
        )
    }

    /// [`Self::lightning_core`] with q, k, v and the recurrence output in `O`:
    /// `prep` → (on capture) `body_pass` over copies of the body rows from a zero
    /// state → `span` from `rec` → group norm and gate.
    #[allow(clippy::too_many_arguments)]
    fn lightning_mix<O: Elem>(
        &self,
        w: &LightningW<T>,
        proj: &CudaSlice<T>,
        t: usize,
        pos: &CudaSlice<i64>,
        rec: &mut CudaSlice<f32>,
        capture: Option<(usize, &mut Option<ScalarPair>)>,
        body_pass: impl Fn(
            &LightningDims,
            &CudaSlice<O>,
            &CudaSlice<O>,
            &CudaSlice<O>,
            &mut CudaSlice<f32>,
        ) -> Result<()>,
        span: impl Fn(
            &LightningDims,
            &CudaSlice<O>,
            &CudaSlice<O>,
            &CudaSlice<O>,
            &mut CudaSlice<f32>,
            &mut CudaSlice<O>,
        ) -> Result<()>,
    ) -> Result<Scratch<T>> {
        let c = &self.config;
        let g = &*self.gpu;
        let (nh, d) = (c.linear_v_heads, c.linear_k_dim);
        let wd = nh * d;
        let mut q: Scratch<O> = g.scratch(t * wd)?;
        let mut k: Scratch<O> = g.scratch(t * wd)?;
        let mut v: Scratch<O> = g.scratch(t * wd)?;
        lt::prep(
            g,
            proj,
            t,
            4 * wd,
            &w.q_norm,
            &w.k_norm,
            pos,
            self.inv_freq.as_ref(),
            c.lightning.silu,
            nh,
            d,
            c.rms_norm_eps,
            &mut q,
            &mut k,
            &mut v,
        )?;
        let dims = LightningDims {
            t,
            h: nh,
            dk: d,
            dv: d,
        };
        if let Some((from, out)) = capture {
            let from = from.min(t);
            let n = t - from;
            let mut b: CudaSlice<f32> = g.zeros(nh * d * d)?;
            if n > 0 {
                let s = g.stream();
                let qb = s.clone_dtod(&q.slice(from * wd..t * wd))?;
                let kb = s.clone_dtod(&k.slice(from * wd..t * wd))?;
                let vb = s.clone_dtod(&v.slice(from * wd..t * wd))?;
                body_pass(&LightningDims { t: n, ..dims }, &qb, &kb, &vb, &mut b)?;
            }
            *out = Some(ScalarPair {
                h: nh,
                dk: d,
                dv: d,
                t: g.upload(&lt::transition_host(&w.log_decay_host, n))?,
                b,
            });
        }
        let mut o: Scratch<O> = g.scratch(t * wd)?;
        span(&dims, &q, &k, &v, rec, &mut o)?;
        let mut y: Scratch<T> = g.scratch(t * wd)?;
        lt::out(
            g,
            &o,
            proj,
            4 * wd,
            3 * wd,
            &w.g_norm,
            &mut y,
            t,
            wd,
            c.lightning.group_norm_size,
            c.rms_norm_eps,
        )?;
        Ok(y)
    }

    /// Width of the fused attention projection: `qw + 2·Hkv·hd`.
    fn attn_qkv_width(&self) -> usize {
        let c = &self.config;
        let qw = c.num_heads * c.head_dim * if c.attn_output_gate { 2 } else { 1 };
        qw + 2 * c.num_kv_heads * c.head_dim
    }

    /// Gated attention mixer over `r` (`[t, h]`, normed) at positions `pos` (`[t]`),
    /// appending the span's K/V to `kv`. Returns the mixer output `[t, h]`.
    fn attention(
        &self,
        w: &AttnW<T>,
        r: &CudaSlice<T>,
        t: usize,
        pos: &CudaSlice<i64>,
        kv: &mut GpuKv<T>,
    ) -> Result<Scratch<T>> {
        let c = &self.config;
        let g = &*self.gpu;
        let h = c.hidden_size;
        let fw = self.attn_qkv_width();
        let zero = T::from_f32(0.0);
        let mut qkv: Scratch<T> = g.scratch(t * fw)?;
        blas::linear(g, r, t, h, &w.qkv, fw, &mut qkv, zero)?;
        let o = self.attn_core(w, &qkv, t, pos, kv)?;
        let mut out: Scratch<T> = g.scratch(t * h)?;
        blas::linear(g, &o, t, c.num_heads * c.head_dim, &w.o, h, &mut out, zero)?;
        Ok(out)
    }

    /// Attention between its projections: from the fused `qkv` (`[t, qw + 2·Hkv·hd]`)
    /// to the gated attention output `[t, H·hd]` (before `o_proj`), appending the
    /// span's K/V (positions `pos`, `[t]`) to `kv`.
    fn attn_core(
        &self,
        w: &AttnW<T>,
        qkv: &CudaSlice<T>,
        t: usize,
        pos: &CudaSlice<i64>,
        kv: &mut GpuKv<T>,
    ) -> Result<Scratch<T>> {
        let c = &self.config;
        let g = &*self.gpu;
        let (nh, hd) = (c.num_heads, c.head_dim);
        let gated = c.attn_output_gate;
        let (q, gate, k, v) = self.attn_prep(w, qkv, t, pos)?;
        kv.append(g, &k, &v, pos, t)?;
        let mut o: Scratch<T> = g.scratch(t * nh * hd)?;
        self.attn_over_cache(&q, pos, kv, &mut o, t)?;
        if gated {
            self.gate_mul(&mut o, &gate, t * nh * hd)?;
        }
        Ok(o)
    }

    /// Split of the fused `qkv` (`[t, qw + 2·Hkv·hd]`) into `q` and the output `gate`
    /// (`[t, H, hd]`; `gate` one element when not gated) and `k`, `v` (`[t, Hkv, hd]`),
    /// with q/k zero-centred RMSNorm and q/k RoPE at positions `pos` (`[t]`): one launch.
    #[allow(clippy::type_complexity)]
    pub(crate) fn attn_prep(
        &self,
        w: &AttnW<T>,
        qkv: &CudaSlice<T>,
        t: usize,
        pos: &CudaSlice<i64>,
    ) -> Result<(Scratch<T>, Scratch<T>, Scratch<T>, Scratch<T>)> {
        let c = &self.config;
        let g = &*self.gpu;
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let gated = c.attn_output_gate;
        let kw = nkv * hd;
        let fw = self.attn_qkv_width();
        check_len("attention projection [t, qkv]", qkv, t * fw)?;
        check_len("positions", pos, t)?;
        // Split, q/k zero-centred RMSNorm and q/k RoPE in one launch (`attn_prep_*`).
        let mut q: Scratch<T> = g.scratch(t * nh * hd)?;
        let mut gate: Scratch<T> = g.scratch(if gated { t * nh * hd } else { 1 })?;
        let mut k: Scratch<T> = g.scratch(t * kw)?;
        let mut v: Scratch<T> = g.scratch(t * kw)?;
        {
            check_len("q_norm", &w.q_norm, hd)?;
            check_len("k_norm", &w.k_norm, hd)?;
            let rot = self.inv_freq.as_ref().map_or(0, |f| 2 * f.len());
            if rot > hd {
                return Err(shape_err(format!("rotary dims {rot} > head_dim {hd}")));
            }
            let f = g.function(&MODEL, &format!("attn_prep_{}", T::SUFFIX), 0)?;
            let (roti, nhi, nkvi, hdi, gi) = (
                rot as i32,
                dim_i32("heads", nh)?,
                dim_i32("kv heads", nkv)?,
                dim_i32("head_dim", hd)?,
                gated as i32,
            );
            let eps = c.rms_norm_eps;
            let cfg = LaunchConfig {
                grid_dim: (dim_i32("t", t)? as u32, (nh + 2 * nkv) as u32, 1),
                // rmsnorm_*'s block size for hd (the same reduction order).
                block_dim: (if hd <= 512 { 128 } else { 256 }, 1, 1),
                shared_mem_bytes: ((hd + 32) * 4) as u32,
            };
            let null: u64 = 0;
            let mut b = g.stream().launch_builder(&f);
            b.arg(qkv).arg(&w.q_norm).arg(&w.k_norm).arg(pos);
            match &self.inv_freq {
                Some(inv) => b.arg(inv),
                None => b.arg(&null),
            };
            b.arg(&roti)
                .arg(&mut q)
                .arg(&mut gate)
                .arg(&mut k)
                .arg(&mut v)
                .arg(&nhi)
                .arg(&nkvi)
                .arg(&hdi)
                .arg(&gi)
                .arg(&eps);
            // SAFETY: matches `attn_prep_*`; qkv: [t, fw] and pos: [t] checked above;
            // q, gate: [t, nh, hd] (gate unused when not gated); k, v: [t, nkv, hd];
            // q_norm, k_norm: [hd]; inv_freq: [rot/2] (null only with rot = 0).
            unsafe { b.launch(cfg) }?;
        }
        Ok((q, gate, k, v))
    }

    /// The attention kernel over `kv` (already holding the span's rows) for the span's
    /// queries `q` (`[t, H, hd]`, positions `pos`) into `o` (`[t, H, hd]`), chosen by
    /// dtype, span length, cache length and head dims (see the module docs).
    fn attn_over_cache(
        &self,
        q: &CudaSlice<T>,
        pos: &CudaSlice<i64>,
        kv: &GpuKv<T>,
        o: &mut CudaSlice<T>,
        t: usize,
    ) -> Result<()> {
        let c = &self.config;
        let g = &*self.gpu;
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        if T::SUFFIX == "bf16"
            && t == 1
            && attn::DECODE_HEAD_DIMS.contains(&hd)
            && nh / nkv <= attn::DECODE_MAX_GROUP
        {
            // One token (decode): the split-key decode kernel.
            attn::decode(
                g,
                q,
                pos,
                kv.k(),
                kv.v(),
                kv.pos(),
                o,
                kv.len,
                nh,
                nkv,
                hd,
                None,
            )?;
        } else if T::SUFFIX == "bf16"
            && t >= ATTN_FLASH_MIN_TQ
            && attn::FLASH_WG_HEAD_DIMS.contains(&hd)
            && g.arch() == "sm_90a"
        {
            // TMA loads with the lean consumer loop (the fastest measured), 80-key tiles
            // from ATTN_WG_BC80_MIN_KV keys; the Basic wgmma kernel where the driver cannot
            // build tensor maps.
            let run = |o: &mut CudaSlice<T>, kernel| {
                attn::prefill_flash_wg_with(
                    g,
                    q,
                    pos,
                    kv.k(),
                    kv.v(),
                    kv.pos(),
                    o,
                    t,
                    kv.len,
                    nh,
                    nkv,
                    hd,
                    attn::FlashWgOpts {
                        split: None,
                        kernel,
                    },
                )
            };
            let kernel = if kv.len >= ATTN_WG_BC80_MIN_KV {
                attn::FlashWgKernel::WarpSpecializedTmaLeanBc80
            } else {
                attn::FlashWgKernel::WarpSpecializedTmaLean
            };
            match run(o, kernel) {
                Err(CudaError::Unavailable(_)) => run(o, attn::FlashWgKernel::Basic)?,
                r => r?,
            }
        } else if T::SUFFIX == "bf16"
            && ATTN_TUNED_HD.contains(&hd)
            && (t >= ATTN_FLASH_MIN_TQ || kv.len >= ATTN_FAST_MIN_KV)
        {
            attn::prefill_flash(
                g,
                q,
                pos,
                kv.k(),
                kv.v(),
                kv.pos(),
                o,
                t,
                kv.len,
                nh,
                nkv,
                hd,
            )?;
        } else if ATTN_TUNED_HD.contains(&hd)
            && (t >= ATTN_FAST_MIN_TQ || kv.len >= ATTN_FAST_MIN_KV)
        {
            attn::prefill_fast(
                g,
                q,
                pos,
                kv.k(),
                kv.v(),
                kv.pos(),
                o,
                t,
                kv.len,
                nh,
                nkv,
                hd,
            )?;
        } else if ATTN_TUNED_HD.contains(&hd) {
            attn::prefill(
                g,
                q,
                pos,
                kv.k(),
                kv.v(),
                kv.pos(),
                o,
                t,
                kv.len,
                nh,
                nkv,
                hd,
            )?;
        } else {
            attn_generic(
                g,
                q,
                pos,
                kv.k(),
                kv.v(),
                kv.pos(),
                o,
                t,
                kv.len,
                nh,
                nkv,
                hd,
            )?;
        }
        Ok(())
    }

    /// `o *= sigmoid(gate)` over `n` elements (the attention output gate).
    pub(crate) fn gate_mul(
        &self,
        o: &mut CudaSlice<T>,
        gate: &CudaSlice<T>,
        n: usize,
    ) -> Result<()> {
        check_len("o", o, n)?;
        check_len("gate", gate, n)?;
        let g = &*self.gpu;
        let f = g.function(&MODEL, &format!("mul_sigmoid_{}", T::SUFFIX), 0)?;
        let nn = n as u64;
        let mut b = g.stream().launch_builder(&f);
        b.arg(o).arg(gate).arg(&nn);
        // SAFETY: matches `mul_sigmoid_*`; o and gate: [n] (checked).
        unsafe { b.launch(cfg1(n)) }?;
        Ok(())
    }

    /// Dense SwiGLU MLP: `down(silu(gate(x)) · up(x))`, `x: [rows, h]` → `[rows, h]`.
    fn mlp(&self, m: &MlpW<T>, x: &CudaSlice<T>, rows: usize) -> Result<Scratch<T>> {
        let g = &*self.gpu;
        let h = self.config.hidden_size;
        let i = m.inter;
        let zero = T::from_f32(0.0);
        let mut gu: Scratch<T> = g.scratch(rows * 2 * i)?;
        blas::linear(g, x, rows, h, &m.gate_up, 2 * i, &mut gu, zero)?;
        let mut act: Scratch<T> = g.scratch(rows * i)?;
        {
            let f = g.function(&MODEL, &format!("swiglu_{}", T::SUFFIX), 0)?;
            let (ri, ii) = (dim_i32("rows", rows)?, dim_i32("intermediate", i)?);
            let mut b = g.stream().launch_builder(&f);
            b.arg(&gu).arg(&mut act).arg(&ri).arg(&ii);
            // SAFETY: matches `swiglu_*`; gu: [rows, 2i], act: [rows, i].
            unsafe { b.launch(cfg1(rows * i)) }?;
        }
        let mut out: Scratch<T> = g.scratch(rows * h)?;
        blas::linear(g, &act, rows, i, &m.down, h, &mut out, zero)?;
        Ok(out)
    }

    /// MoE FFN, host-routed ([`FfnPath::HostRouted`], see the module docs): router logits on the
    /// device, softmax/top-k on the host exactly as the CPU backend, per-expert row
    /// gather → SwiGLU → weighted scatter-add on the device, then the gated shared
    /// expert. `x: [t, h]` → `[t, h]`.
    fn moe(&self, m: &MoeW<T>, x: &CudaSlice<T>, t: usize) -> Result<Scratch<T>> {
        let c = &self.config;
        let g = &*self.gpu;
        let h = c.hidden_size;
        let e = c.num_experts;
        let zero = T::from_f32(0.0);
        let mut lg: CudaSlice<T> = g.zeros(t * e)?;
        blas::linear(g, x, t, h, &m.router, e, &mut lg, zero)?;
        let logits = download_f32(g, &lg, t * e)?;
        let mut per_expert: Vec<(Vec<i32>, Vec<f32>)> = vec![(vec![], vec![]); e];
        for ti in 0..t {
            // The CPU backend's rule (`router::RouterConfig::route`: softmax top-k, or
            // sigmoid with selection bias and grouped top-k), so the choices are its own.
            for (j, wgt) in c.router.route(
                &logits[ti * e..(ti + 1) * e],
                m.bias.as_deref(),
                c.experts_per_tok.min(e),
                c.norm_topk_prob,
            ) {
                per_expert[j].0.push(ti as i32);
                per_expert[j].1.push(wgt);
            }
        }
        let mut out: Scratch<T> = g.scratch_zeroed(t * h)?;
        let hi = dim_i32("hidden", h)?;
        for (j, (rows, wgts)) in per_expert.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let n = rows.len();
            let ni = n as i32;
            let rows_d = g.upload(rows)?;
            let w_d = g.upload(wgts)?;
            let mut xe: CudaSlice<T> = g.zeros(n * h)?;
            {
                let f = g.function(&MODEL, &format!("gather_rows_{}", T::SUFFIX), 0)?;
                let mut b = g.stream().launch_builder(&f);
                b.arg(x).arg(&rows_d).arg(&mut xe).arg(&ni).arg(&hi);
                // SAFETY: matches `gather_rows_*`; rows < t, xe: [n, h].
                unsafe { b.launch(cfg1(n * h)) }?;
            }
            let y = self.mlp(&m.experts[j], &xe, n)?;
            let f = g.function(&MODEL, &format!("scatter_add_rows_{}", T::SUFFIX), 0)?;
            let mut b = g.stream().launch_builder(&f);
            b.arg(&mut out)
                .arg(&rows_d)
                .arg(&w_d)
                .arg(&y)
                .arg(&ni)
                .arg(&hi);
            // SAFETY: matches `scatter_add_rows_*`; rows distinct and < t.
            unsafe { b.launch(cfg1(n * h)) }?;
        }
        if let Some((sm, gate_w)) = &m.shared {
            let y = self.mlp(sm, x, t)?;
            let mut gl: CudaSlice<T> = g.zeros(t)?;
            blas::linear(g, x, t, h, gate_w, 1, &mut gl, zero)?;
            let f = g.function(&MODEL, &format!("add_gated_rows_{}", T::SUFFIX), 0)?;
            let ti = dim_i32("t", t)?;
            let mut b = g.stream().launch_builder(&f);
            b.arg(&mut out).arg(&gl).arg(&y).arg(&ti).arg(&hi);
            // SAFETY: matches `add_gated_rows_*`; out, y: [t, h], gl: [t].
            unsafe { b.launch(cfg1(t * h)) }?;
        }
        if let Some(sm) = &m.shared_plain {
            let y = self.mlp(sm, x, t)?;
            self.add_inplace(&mut out, &y, t * h)?;
        }
        Ok(out)
    }
}

fn up_mlp<T: Elem>(g: &Gpu, m: &crate::model::Mlp, h: usize, name: &str) -> Result<MlpW<T>> {
    want(&format!("{name}.gate_up"), &m.gate_up, 2 * m.inter * h)?;
    want(&format!("{name}.down_proj"), &m.down, h * m.inter)?;
    Ok(MlpW {
        gate_up: up::<T>(g, &m.gate_up)?,
        down: up::<T>(g, &m.down)?,
        inter: m.inter,
    })
}

/// Uploads a CPU Lightning layer (`layer` `i`): `query_key_value` and `g_proj` fused into
/// one `[4W, hidden]` projection, norms, `dense`, log decays.
fn up_lightning<T: Elem>(
    g: &Gpu,
    c: &ModelConfig,
    w: &crate::model::LightningWeights,
    i: usize,
) -> Result<LightningW<T>> {
    let (h, d, nh) = (c.hidden_size, c.linear_k_dim, c.linear_v_heads);
    let wd = nh * d;
    let p = format!("layers.{i}.attention");
    want(&format!("{p}.query_key_value"), &w.qkv, 3 * wd * h)?;
    want(&format!("{p}.g_proj"), &w.g_proj, wd * h)?;
    want(&format!("{p}.query_layernorm"), &w.q_norm, d)?;
    want(&format!("{p}.key_layernorm"), &w.k_norm, d)?;
    want(&format!("{p}.g_norm"), &w.g_norm, wd)?;
    want(&format!("{p}.dense"), &w.dense, h * wd)?;
    want(&format!("{p} log decays"), &w.log_decay, nh)?;
    let mut fused = Vec::with_capacity(4 * wd * h);
    fused.extend_from_slice(&w.qkv);
    fused.extend_from_slice(&w.g_proj);
    Ok(LightningW {
        w_in: up::<T>(g, &fused)?,
        q_norm: up_f32(g, &w.q_norm)?,
        k_norm: up_f32(g, &w.k_norm)?,
        g_norm: up_f32(g, &w.g_norm)?,
        dense: up::<T>(g, &w.dense)?,
        log_decay: up_f32(g, &w.log_decay)?,
        log_decay_host: w.log_decay.clone(),
    })
}

/// Configuration limits of the GPU forward.
pub(crate) fn check_config(c: &ModelConfig) -> Result<()> {
    let bad = |m: String| Err(shape_err(m));
    if c.mixers.len() != c.num_layers || c.layer_is_moe.len() != c.num_layers {
        return bad(format!(
            "config lists {} layer kinds / {} MoE flags for {} layers",
            c.mixers.len(),
            c.layer_is_moe.len(),
            c.num_layers
        ));
    }
    if c.hidden_size == 0 || c.vocab_size == 0 {
        return bad("hidden_size and vocab_size must be > 0".into());
    }
    if c.attn_output_gate && c.attn_proj == crate::config::AttnProjLayout::FusedQkv {
        return bad(format!(
            "model_type {}: a fused query_key_value with an output gate is not supported",
            c.model_type
        ));
    }
    if c.num_experts > 0 {
        if let Err((k, m)) = c.router.check(c.num_experts, c.experts_per_tok) {
            return bad(format!("model_type {}: router `{k}`: {m}", c.model_type));
        }
        if c.router.n_group > moe::MAX_GROUPS {
            return bad(format!(
                "model_type {}: {} expert groups (the device router takes up to {})",
                c.model_type,
                c.router.n_group,
                moe::MAX_GROUPS
            ));
        }
    }
    if c.mixers.contains(&MixerKind::Lightning) {
        let (nh, d) = (c.linear_v_heads, c.linear_k_dim);
        if nh == 0 || d == 0 || c.linear_v_dim != d || c.linear_k_heads != nh {
            return bad(format!(
                "Lightning layers need equal key/value heads and dims (heads {}/{nh}, dims {d}/{})",
                c.linear_k_heads, c.linear_v_dim
            ));
        }
        let groups = c.lightning.group_norm_size;
        if groups == 0 || !(nh * d).is_multiple_of(groups) {
            return bad(format!(
                "Lightning group_norm_size {groups} must divide H·d = {}",
                nh * d
            ));
        }
        if c.rotary_dim > d || !c.rotary_dim.is_multiple_of(2) {
            return bad(format!(
                "rotary dims {} must be even and ≤ the Lightning head dim {d}",
                c.rotary_dim
            ));
        }
        if c.conv_dim() * c.conv_kernel.saturating_sub(1) != 0 {
            return bad("Lightning layers have no conv: conv_kernel must be 1".into());
        }
    }
    if c.mixers.contains(&MixerKind::Kda)
        && (c.linear_k_heads != c.linear_v_heads || c.linear_k_dim != c.linear_v_dim)
    {
        return bad("KDA layers need as many key as value heads and dk = dv".into());
    }
    let has_full = c
        .mixers
        .iter()
        .any(|m| matches!(m, MixerKind::Attention | MixerKind::Mla));
    let has_linear = c
        .mixers
        .iter()
        .any(|m| matches!(m, MixerKind::GatedDeltaNet | MixerKind::Kda));
    if has_full {
        if c.num_kv_heads == 0 || !c.num_heads.is_multiple_of(c.num_kv_heads) {
            return bad(format!(
                "attention heads {} not a multiple of kv heads {}",
                c.num_heads, c.num_kv_heads
            ));
        }
        if c.head_dim == 0 || c.head_dim > ATTN_GENERIC_MAX_HD {
            return bad(format!(
                "head_dim {} not in 1..={ATTN_GENERIC_MAX_HD}",
                c.head_dim
            ));
        }
        if c.rotary_dim > c.head_dim || !c.rotary_dim.is_multiple_of(2) {
            return bad(format!(
                "rotary dims {} must be even and ≤ head_dim {}",
                c.rotary_dim, c.head_dim
            ));
        }
    }
    if has_linear {
        if c.linear_k_heads == 0 || !c.linear_v_heads.is_multiple_of(c.linear_k_heads) {
            return bad(format!(
                "GDN value heads {} not a multiple of key heads {}",
                c.linear_v_heads, c.linear_k_heads
            ));
        }
        if c.conv_kernel == 0 || c.conv_kernel > 17 {
            return bad(format!("conv kernel {} not in 1..=17", c.conv_kernel));
        }
        if c.linear_k_dim == 0 || c.linear_v_dim == 0 {
            return bad("GDN head dims must be > 0".into());
        }
    }
    Ok(())
}

/// Generic gated delta rule recurrence (any `dk`, `dv`; `gdr_generic_*` in model.cu),
/// same contract as [`gdr::recurrent`]. Slow (state in global memory); used for head
/// dims the tuned kernels are not built for.
#[allow(clippy::too_many_arguments)]
pub fn gdr_generic<T: Elem>(
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
    if d.hk == 0 || !d.hv.is_multiple_of(d.hk) {
        return Err(shape_err(format!(
            "Hv {} must be a multiple of Hk {}",
            d.hv, d.hk
        )));
    }
    check_len("q [T,Hk,dk]", q, d.t * d.hk * d.dk)?;
    check_len("k [T,Hk,dk]", k, d.t * d.hk * d.dk)?;
    check_len("v [T,Hv,dv]", v, d.t * d.hv * d.dv)?;
    check_len("g [T,Hv]", g, d.t * d.hv)?;
    check_len("beta [T,Hv]", beta, d.t * d.hv)?;
    check_len("state [Hv,dk,dv]", state, d.hv * d.dk * d.dv)?;
    check_len("o [T,Hv,dv]", out, d.t * d.hv * d.dv)?;
    launch_recurrence(
        gpu,
        &MODEL,
        &format!("gdr_generic_{}", T::SUFFIX),
        d,
        [q, k, v],
        g,
        beta,
        state,
        out,
    )
}

/// Launches a per-token recurrence kernel of the `gdr_generic_*` argument list
/// (`q, k, v, g, beta, state, out, T, Hk, Hv, dk, dv`; grid `(Hv, ⌈dv/64⌉)`, 64 threads):
/// the gated delta rule (`g: [T, Hv]`) and KDA (`g: [T, Hv, dk]`,
/// `kda_recurrent_*`). The caller checks the buffer lengths for its kernel; nothing is
/// launched for an empty span.
///
/// Errors: a dimension over `i32`; driver errors.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_recurrence<T: Elem>(
    gpu: &Gpu,
    src: &super::compile::KernelSource,
    name: &str,
    d: &GdrDims,
    [q, k, v]: [&CudaSlice<T>; 3],
    g: &CudaSlice<f32>,
    beta: &CudaSlice<f32>,
    state: &mut CudaSlice<f32>,
    out: &mut CudaSlice<T>,
) -> Result<()> {
    if d.t == 0 || d.hv == 0 || d.dv == 0 {
        return Ok(());
    }
    let f = gpu.function(src, name, 0)?;
    let block = 64u32;
    let cfg = LaunchConfig {
        grid_dim: (d.hv as u32, d.dv.div_ceil(block as usize) as u32, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    let (t, hk, hv, dk, dv) = (
        dim_i32("t", d.t)?,
        dim_i32("Hk", d.hk)?,
        dim_i32("Hv", d.hv)?,
        dim_i32("dk", d.dk)?,
        dim_i32("dv", d.dv)?,
    );
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
        .arg(&dk)
        .arg(&dv);
    // SAFETY: `name` takes this argument list; the caller checked the lengths.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Generic causal GQA attention (any `hd` ≤ 1024; `attn_generic_*` in model.cu), same
/// contract as [`attn::prefill`]: `q: [tq, nh, hd]`, `k, v: [n_kv, nkv, hd]`,
/// `q_pos: [tq]`, `kv_pos: [n_kv]`, `o: [tq, nh, hd]`. One block per (query, head).
#[allow(clippy::too_many_arguments)]
pub fn attn_generic<T: Elem>(
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
        return Err(shape_err(format!(
            "heads {nh} not a multiple of kv heads {nkv}"
        )));
    }
    if hd == 0 || hd > ATTN_GENERIC_MAX_HD {
        return Err(shape_err(format!(
            "head_dim {hd} not in 1..={ATTN_GENERIC_MAX_HD}"
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
    if tq > 65_535 * 32 || nh > 65_535 {
        return Err(shape_err(format!(
            "generic attention grid ({tq}, {nh}) too large"
        )));
    }
    let f = gpu.function(&MODEL, &format!("attn_generic_{}", T::SUFFIX), 0)?;
    let smem = ((2 * hd + ATG_TILE + 32) * 4) as u32;
    let cfg = LaunchConfig {
        grid_dim: (tq as u32, nh as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem,
    };
    let scale = (hd as f32).powf(-0.5);
    let (n, a, b_, e) = (
        dim_i32("n_kv", n_kv)?,
        dim_i32("heads", nh)?,
        dim_i32("kv heads", nkv)?,
        dim_i32("head_dim", hd)?,
    );
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(q)
        .arg(k)
        .arg(v)
        .arg(q_pos)
        .arg(kv_pos)
        .arg(o)
        .arg(&n)
        .arg(&a)
        .arg(&b_)
        .arg(&e)
        .arg(&scale);
    // SAFETY: matches `attn_generic_*`; lengths checked above; smem as the kernel needs.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(name: &str) -> ModelConfig {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(name);
        ModelConfig::from_dir(&dir).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// The Ring-linear and Kimi-Linear shapes (the golden fixtures and the published
    /// Ring-mini / Ring-flash / Kimi-Linear-48B configs) pass the GPU's configuration
    /// check and the MoE limits. No device needed.
    #[test]
    fn ring_and_kimi_pass_the_gpu_check() {
        for name in [
            "tests/fixtures/golden/bailing_moe_linear",
            "../benches/configs/ring_mini_linear_2_0",
            "../benches/configs/ring_flash_linear_2_0",
            "tests/fixtures/golden/kimi_linear",
            "../benches/configs/kimi_linear_48b_a3b",
        ] {
            let c = config(name);
            check_config(&c).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(super::super::random::check_moe_config(&c).is_ok(), "{name}");
        }
    }

    /// KV rows claimed for a decode step: a second claim of the same row by its holder
    /// (a graph step falling back to the eager one) keeps the buffers; a holder sharing
    /// the buffers copies before it writes; a holder that claimed nothing cannot count
    /// a batched append. Needs a CUDA device (prints `skipped: …` without one).
    #[test]
    fn kv_claims_are_per_holder() {
        let gpu = match Gpu::new(0) {
            Ok(g) => g,
            Err(e) => {
                println!("skipped: no usable CUDA device ({e})");
                return;
            }
        };
        let g = &*gpu;
        let row = 4usize;
        let mut a = GpuKv::<f32>::with_capacity(g, row, 16).unwrap();
        let k = g.upload(&vec![1f32; 2 * row]).unwrap();
        let pos = g.upload(&[0i64, 1]).unwrap();
        a.append(g, &k, &k, &pos, 2).unwrap();
        let snapshot = a.share();
        a.claim_next(g).unwrap();
        let key = a.key(g);
        a.claim_next(g).unwrap();
        assert_eq!(
            a.key(g),
            key,
            "a second claim of the same row copied the cache"
        );
        a.appended_claimed().unwrap();
        assert_eq!((a.len(), a.key(g)), (3, key));
        // The snapshot's buffer tip moved past its len: its own claim copies.
        let mut b = snapshot.share();
        b.claim_next(g).unwrap();
        assert_ne!(
            b.key(g)[0],
            key[0],
            "a shared holder wrote into another's rows"
        );
        b.appended_claimed().unwrap();
        // No claim of its own: refused (before, another holder's tip let it pass).
        let mut c = snapshot.share();
        assert!(c.appended_claimed().is_err());
    }
}
