//! Position-independent caching on the GPU: [`GpuBackend`], the device backend of
//! the generic PIC engine [`Pic`] ([`GpuPicEngine`]), with its public pool of segment
//! entries and its private pool of running-state snapshots held in device memory.
//!
//! The request logic is the CPU engine's, written once in [`crate::pic::engine`]
//! (modes `FullRecompute`, `PrefixCache`, `NaiveAddition`, `Hypic { seam_width,
//! rope_fix }`; its module doc describes them): the same cache keys, per-segment
//! outcomes and token counts. The three GPU paths:
//!
//! * capture ([`Pic::build_entry`]): the segment prefilled alone from the
//!   zero state at positions `0..m`; per GDN layer the body pair over tokens
//!   `body_start..m` (`T_body [Hv,dk,dk]` and `S_body|0 = S_m − T_body·S_body_start`
//!   `[Hv,dk,dv]`, fp32; `T_body` from the chunked kernel in the same pass for
//!   `dk = dv = 128` and bodies of ≥ 16 tokens, else by the generic recurrence
//!   [`gdr_transition`]) and the segment's conv tail; per attention layer the body K
//!   (rotated to the in-segment positions `body_start..m`) and V, in `T`;
//! * compose: GDN layers `S ← T_body S + S_body|0` (cuBLAS, [`DensePair::apply_into`])
//!   or `S ← S + S_body|0` (naive addition), conv tail replaced by the segment's;
//!   attention layers append the body K re-rotated by `R(b)` (`b` the segment's new
//!   start; not rotated when `rope_fix` is off) and V at positions
//!   `b + body_start ..`;
//! * seam: the first `w` tokens run through the whole model at their new positions from
//!   the running state, before the body is composed. A run of consecutive cached
//!   segments goes through the model together, layer-major
//!   (`GpuModel::forward_spans`): per layer, each segment's seam window through the
//!   mixer, then its body composed into the layer state, then one FFN pass over all the
//!   seam windows — the same result as one segment after the other.
//!
//! Spill ([`Pic::enable_spill`]): entries evicted from device memory are
//! downloaded and encoded in the CPU blob formats (`pic::spill`, fp32 exact; bf16 KV
//! widened to fp32, which round-trips exactly), kept with the pool's XXH3 checksum,
//! and uploaded again on a hit after the checksum verifies (SGLang #39830). Decoding
//! needs the device: the engine binds it (a thread-local) around each pool lookup;
//! a blob decoded without it fails and is treated as damaged (a miss, recomputed).
use std::cell::RefCell;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::{CudaBlas, Gemm};
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::compile::PIC;
use super::model::{GpuLayerState, GpuModel, GpuState, LayerPair};
use super::transition::{DensePair, ScalarPair};
use super::{check_len, grid_for, ops, CudaError, CudaSlice, Elem, Gpu, Result, Scratch};
use crate::config::{MixerKind, ModelConfig};
use crate::engine::BackendInfo;
use crate::mixers::gated_deltanet::GdrDims;
use crate::model::Logits;
use crate::pic::engine::{EntryLayer, Pic, PicOutput, SegmentEntry, Snapshot};
use crate::pic::spill::Spill;
use crate::pic::{CacheEntry, PicBackend};

/// Left-multiplies `trans` by the gated-delta-rule transition of a span, any `dk`:
/// `trans[h] ← T_t ··· T_1 · trans[h]`, `T_t = exp(g_t)(I − β_t k_t k_tᵀ)` (set
/// `trans` to the identity first, [`super::gdr::set_identity`], to obtain `T_C`).
/// `k: [T, Hk, dk]` (L2-normalised, as the GDR kernels take it), `g, beta: [T, Hv]`
/// fp32, `trans: [Hv, dk, dk]` fp32 row-major. CPU reference: the `T_C` of
/// `mixers::gated_deltanet::chunked_with_transition` (the same recurrence as
/// `mixers::gated_deltanet::recurrent` with zero writes). One thread per column of `T`.
pub fn gdr_transition<T: Elem>(
    gpu: &Gpu,
    d: &GdrDims,
    k: &CudaSlice<T>,
    g: &CudaSlice<f32>,
    beta: &CudaSlice<f32>,
    trans: &mut CudaSlice<f32>,
) -> Result<()> {
    if d.hk == 0 || !d.hv.is_multiple_of(d.hk) {
        return Err(CudaError::Shape(format!(
            "Hv {} must be a multiple of Hk {}",
            d.hv, d.hk
        )));
    }
    check_len("k [T,Hk,dk]", k, d.t * d.hk * d.dk)?;
    check_len("g [T,Hv]", g, d.t * d.hv)?;
    check_len("beta [T,Hv]", beta, d.t * d.hv)?;
    check_len("trans [Hv,dk,dk]", trans, d.hv * d.dk * d.dk)?;
    if d.t == 0 || d.hv == 0 || d.dk == 0 {
        return Ok(());
    }
    if d.hv > 65_535 {
        return Err(CudaError::Shape(format!(
            "Hv {} too large for the grid",
            d.hv
        )));
    }
    let f = gpu.function(&PIC, &format!("pic_transition_{}", T::SUFFIX), 0)?;
    let block = 64u32;
    let cfg = LaunchConfig {
        grid_dim: (d.hv as u32, d.dk.div_ceil(block as usize) as u32, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    let dim = |n: &str, v: usize| {
        i32::try_from(v).map_err(|_| CudaError::Shape(format!("{n} = {v} does not fit i32")))
    };
    let (t, hk, hv, dk) = (
        dim("t", d.t)?,
        dim("Hk", d.hk)?,
        dim("Hv", d.hv)?,
        dim("dk", d.dk)?,
    );
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(k)
        .arg(g)
        .arg(beta)
        .arg(trans)
        .arg(&t)
        .arg(&hk)
        .arg(&hv)
        .arg(&dk);
    // SAFETY: matches `pic_transition_*` in pic.cu; lengths checked above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// `x ← a·x + b·y` over the first `n` elements (fp32).
pub fn axpby(
    gpu: &Gpu,
    x: &mut CudaSlice<f32>,
    y: &CudaSlice<f32>,
    a: f32,
    b: f32,
    n: usize,
) -> Result<()> {
    check_len("x", x, n)?;
    check_len("y", y, n)?;
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(&PIC, "pic_axpby_f32", 0)?;
    let nn = n as u64;
    let cfg = LaunchConfig {
        grid_dim: (grid_for(n, 256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(x).arg(y).arg(&a).arg(&b).arg(&nn);
    // SAFETY: matches `pic_axpby_f32`; lengths checked.
    unsafe { l.launch(cfg) }?;
    Ok(())
}

/// Device positions `[p0, p0 + n)` (`[n]` i64; one padding element when `n = 0`).
fn iota(gpu: &Gpu, p0: i64, n: usize) -> Result<CudaSlice<i64>> {
    let mut pos: CudaSlice<i64> = gpu.zeros(n)?;
    if n == 0 {
        return Ok(pos);
    }
    let ni = i32::try_from(n).map_err(|_| CudaError::Shape(format!("{n} positions")))?;
    let f = gpu.function(&PIC, "pic_iota_i64", 0)?;
    let cfg = LaunchConfig {
        grid_dim: (grid_for(n, 256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&mut pos).arg(&p0).arg(&ni);
    // SAFETY: matches `pic_iota_i64`; `pos` holds n elements.
    unsafe { l.launch(cfg) }?;
    Ok(pos)
}

fn download_prefix<T: Elem>(gpu: &Gpu, x: &CudaSlice<T>, n: usize) -> Result<Vec<f32>> {
    check_len("download", x, n)?;
    if n == 0 {
        return Ok(vec![]);
    }
    let v = gpu.stream().clone_dtoh(&x.slice(..n))?;
    gpu.sync()?;
    Ok(v.into_iter().map(Elem::to_f32).collect())
}

fn upload_elems<T: Elem>(gpu: &Gpu, v: &[f32]) -> Result<CudaSlice<T>> {
    if v.is_empty() {
        return gpu.zeros(1);
    }
    let e: Vec<T> = v.iter().map(|&x| T::from_f32(x)).collect();
    gpu.upload(&e)
}

/// Cached data of one layer of a [`GpuSegmentEntry`], in device memory.
pub enum GpuEntryLayer<T> {
    /// GDN layer: the body pair and the segment's conv tail.
    Linear {
        /// `T_body [Hv,dk,dk]`, `S_body|0 [Hv,dk,dv]`, fp32.
        pair: DensePair,
        /// Last `K−1` conv inputs of the segment, `[conv_dim, K−1]` fp32 (a buffer of
        /// at least `conv_len` elements).
        conv_tail: CudaSlice<f32>,
        /// Valid elements of `conv_tail`.
        conv_len: usize,
    },
    /// Lightning layer: the scalar body pair (`T_body [H]`, `S_body|0 [H, dk, dv]`
    /// with its keys at the in-segment positions; no conv tail).
    Lightning {
        /// The pair.
        pair: ScalarPair,
    },
    /// Attention layer: body K (rotated to in-segment positions `body_start..`) and V,
    /// `[rows, Hkv, hd]` each in `T` (buffers of one element when `rows = 0`).
    Full {
        /// Keys.
        k: CudaSlice<T>,
        /// Values.
        v: CudaSlice<T>,
        /// Body tokens (`len − body_start`).
        rows: usize,
        /// Elements per token, `Hkv · hd`.
        row: usize,
    },
}

/// One device buffer of a [`GpuSegmentEntry`] ([`GpuSegmentEntry::buffers`]).
pub enum EntryBuffer<'a, T> {
    /// An fp32 buffer (a transition pair's half, a conv tail).
    F32(cudarc::driver::CudaView<'a, f32>),
    /// A buffer in the element type (attention K or V).
    Elem(cudarc::driver::CudaView<'a, T>),
}

/// A public-pool entry on the device: one segment prefilled alone, body from
/// `body_start` (the GPU counterpart of [`SegmentEntry`]).
pub struct GpuSegmentEntry<T: Elem> {
    gpu: Arc<Gpu>,
    /// First body token (the seam width used to build it; 0 = the whole segment).
    pub body_start: usize,
    /// Segment length in tokens.
    pub len: usize,
    /// One entry per decoder layer.
    pub layers: Vec<GpuEntryLayer<T>>,
}

impl<T: Elem> GpuSegmentEntry<T> {
    /// Device bytes of the payload (fp32 pairs and conv tails, K/V in `T`).
    pub fn bytes(&self) -> usize {
        let es = std::mem::size_of::<T>();
        self.layers
            .iter()
            .map(|l| match l {
                GpuEntryLayer::Linear { pair, conv_len, .. } => {
                    4 * (pair.hv * pair.dk * (pair.dk + pair.dv) + conv_len)
                }
                GpuEntryLayer::Lightning { pair } => 4 * pair.h * (1 + pair.dk * pair.dv),
                GpuEntryLayer::Full { rows, row, .. } => 2 * es * rows * row,
            })
            .sum()
    }

    /// An entry from its parts (buffers already on `gpu`, shaped as the model's
    /// layers; see [`GpuEntryLayer`]).
    pub(crate) fn from_parts(
        gpu: Arc<Gpu>,
        body_start: usize,
        len: usize,
        layers: Vec<GpuEntryLayer<T>>,
    ) -> Self {
        GpuSegmentEntry {
            gpu,
            body_start,
            len,
            layers,
        }
    }

    /// The device whose memory holds the entry.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The entry's device buffers in a fixed order, each cut to its valid elements:
    /// per layer `T_body`, `S_body|0` and the conv tail of a linear layer (fp32), or
    /// K and V of an attention layer (`T`). The order the device checksum hashes
    /// them in ([`super::peer::entry_checksum`]).
    pub fn buffers(&self) -> Vec<EntryBuffer<'_, T>> {
        // Never past a buffer's end (they hold at least the valid elements).
        fn prefix<U>(b: &CudaSlice<U>, n: usize) -> cudarc::driver::CudaView<'_, U> {
            b.slice(..n.min(b.len()))
        }
        let mut out = Vec::with_capacity(3 * self.layers.len());
        for l in &self.layers {
            match l {
                GpuEntryLayer::Linear {
                    pair,
                    conv_tail,
                    conv_len,
                } => {
                    let n = pair.hv * pair.dk;
                    out.push(EntryBuffer::F32(prefix(&pair.t, n * pair.dk)));
                    out.push(EntryBuffer::F32(prefix(&pair.b, n * pair.dv)));
                    out.push(EntryBuffer::F32(prefix(conv_tail, *conv_len)));
                }
                GpuEntryLayer::Lightning { pair } => {
                    out.push(EntryBuffer::F32(prefix(&pair.t, pair.h)));
                    out.push(EntryBuffer::F32(prefix(
                        &pair.b,
                        pair.h * pair.dk * pair.dv,
                    )));
                }
                GpuEntryLayer::Full { k, v, rows, row } => {
                    out.push(EntryBuffer::Elem(prefix(k, rows * row)));
                    out.push(EntryBuffer::Elem(prefix(v, rows * row)));
                }
            }
        }
        out
    }

    /// A copy of the entry in the memory of `dst`, device to device: on the same
    /// device one copy per buffer, on another one `cuMemcpyPeerAsync` per buffer
    /// (direct over NVLink/PCIe where peer access is enabled, else staged through
    /// host memory by the driver). Waits for the copies to finish.
    ///
    /// Errors: allocation or copy failures on either device.
    pub fn copy_to(&self, dst: &Arc<Gpu>) -> Result<GpuSegmentEntry<T>> {
        fn copy<U: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
            dst: &Gpu,
            src: &CudaSlice<U>,
            n: usize,
        ) -> Result<CudaSlice<U>> {
            // Buffers of one element when empty, as the builds keep them.
            let n = n.max(1).min(src.len());
            let mut out = dst.zeros::<U>(n)?;
            if n > 0 {
                dst.stream().memcpy_dtod(&src.slice(..n), &mut out)?;
            }
            Ok(out)
        }
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            layers.push(match l {
                GpuEntryLayer::Linear {
                    pair,
                    conv_tail,
                    conv_len,
                } => GpuEntryLayer::Linear {
                    pair: DensePair {
                        hv: pair.hv,
                        dk: pair.dk,
                        dv: pair.dv,
                        t: copy(dst, &pair.t, pair.hv * pair.dk * pair.dk)?,
                        b: copy(dst, &pair.b, pair.hv * pair.dk * pair.dv)?,
                    },
                    conv_tail: copy(dst, conv_tail, *conv_len)?,
                    conv_len: *conv_len,
                },
                GpuEntryLayer::Lightning { pair } => GpuEntryLayer::Lightning {
                    pair: ScalarPair {
                        h: pair.h,
                        dk: pair.dk,
                        dv: pair.dv,
                        t: copy(dst, &pair.t, pair.h)?,
                        b: copy(dst, &pair.b, pair.h * pair.dk * pair.dv)?,
                    },
                },
                GpuEntryLayer::Full { k, v, rows, row } => GpuEntryLayer::Full {
                    k: copy(dst, k, rows * row)?,
                    v: copy(dst, v, rows * row)?,
                    rows: *rows,
                    row: *row,
                },
            });
        }
        dst.sync()?;
        Ok(GpuSegmentEntry {
            gpu: dst.clone(),
            body_start: self.body_start,
            len: self.len,
            layers,
        })
    }

    /// Fault injection for tests: flips the sign bit of the first element of the
    /// first buffer that has one ([`GpuSegmentEntry::buffers`] order); false when
    /// the entry has no element.
    ///
    /// Errors: driver failures.
    #[doc(hidden)]
    pub fn damage(&mut self) -> Result<bool> {
        let g = self.gpu.clone();
        for l in &mut self.layers {
            match l {
                GpuEntryLayer::Linear { pair, .. } if pair.hv * pair.dk > 0 => {
                    let mut x = g.download(&pair.t)?;
                    x[0] = -x[0];
                    g.stream().memcpy_htod(&x, &mut pair.t)?;
                    g.sync()?;
                    return Ok(true);
                }
                GpuEntryLayer::Lightning { pair } if pair.h > 0 => {
                    let mut x = g.download(&pair.t)?;
                    x[0] = -x[0];
                    g.stream().memcpy_htod(&x, &mut pair.t)?;
                    g.sync()?;
                    return Ok(true);
                }
                GpuEntryLayer::Full { k, rows, row, .. } if *rows * *row > 0 => {
                    let mut x = g.download(k)?;
                    x[0] = T::from_f32(-x[0].to_f32());
                    g.stream().memcpy_htod(&x, k)?;
                    g.sync()?;
                    return Ok(true);
                }
                _ => {}
            }
        }
        Ok(false)
    }

    /// Downloads into the CPU layout ([`SegmentEntry`]; K/V widened to fp32).
    pub fn to_host(&self) -> Result<SegmentEntry> {
        let g = &*self.gpu;
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            layers.push(match l {
                GpuEntryLayer::Linear {
                    pair,
                    conv_tail,
                    conv_len,
                } => EntryLayer::Linear {
                    pair: pair.download(g)?,
                    conv_tail: download_prefix(g, conv_tail, *conv_len)?,
                },
                GpuEntryLayer::Lightning { pair } => EntryLayer::Linear {
                    pair: pair.download(g)?,
                    conv_tail: vec![],
                },
                GpuEntryLayer::Full { k, v, rows, row } => EntryLayer::Full {
                    k: download_prefix(g, k, rows * row)?,
                    v: download_prefix(g, v, rows * row)?,
                },
            });
        }
        Ok(SegmentEntry {
            body_start: self.body_start,
            len: self.len,
            layers,
        })
    }

    /// Uploads a CPU entry after checking it against the model config (layer kinds,
    /// pair dims, conv tail length, K/V rows = `len − body_start`).
    pub fn from_host(gpu: &Arc<Gpu>, c: &ModelConfig, e: &SegmentEntry) -> Result<Self> {
        let bad = |m: String| Err(CudaError::Shape(format!("segment entry: {m}")));
        if e.layers.len() != c.num_layers {
            return bad(format!(
                "{} layers, the model has {}",
                e.layers.len(),
                c.num_layers
            ));
        }
        if e.body_start > e.len {
            return bad(format!(
                "body start {} past the length {}",
                e.body_start, e.len
            ));
        }
        let conv_len = c.conv_dim() * c.conv_kernel.saturating_sub(1);
        let (hv, dk, dv) = (c.linear_v_heads, c.linear_k_dim, c.linear_v_dim);
        let row = c.num_kv_heads * c.head_dim;
        let rows = e.len - e.body_start;
        let mut layers = Vec::with_capacity(e.layers.len());
        for (i, (l, kind)) in e.layers.iter().zip(&c.mixers).enumerate() {
            layers.push(match (l, kind) {
                (EntryLayer::Linear { pair, conv_tail }, MixerKind::Lightning) => {
                    if m_kind_ok(*kind, pair, (hv, dk, dv)).is_err() || !conv_tail.is_empty() {
                        return bad(format!(
                            "layer {i}: pair {:?} {:?}, conv tail {}",
                            pair.kind(),
                            pair.dims(),
                            conv_tail.len()
                        ));
                    }
                    GpuEntryLayer::Lightning {
                        pair: ScalarPair::upload(gpu, pair)?,
                    }
                }
                (EntryLayer::Linear { pair, conv_tail }, m) if m.is_linear() => {
                    // The pair must be of the form the layer's mixer builds (dense for
                    // Gated DeltaNet; `DensePair` holds dense pairs only).
                    if m.transition_kind() != Some(pair.kind()) || pair.dims() != (hv, dk, dv) {
                        return bad(format!(
                            "layer {i}: pair {:?} {:?}",
                            pair.kind(),
                            pair.dims()
                        ));
                    }
                    if conv_tail.len() != conv_len {
                        return bad(format!(
                            "layer {i}: conv tail {} (want {conv_len})",
                            conv_tail.len()
                        ));
                    }
                    GpuEntryLayer::Linear {
                        pair: DensePair::upload(gpu, pair)?,
                        conv_tail: if conv_len == 0 {
                            gpu.zeros(1)?
                        } else {
                            gpu.upload(conv_tail)?
                        },
                        conv_len,
                    }
                }
                (EntryLayer::Full { k, v }, MixerKind::Attention | MixerKind::Mla) => {
                    if k.len() != rows * row || v.len() != rows * row {
                        return bad(format!(
                            "layer {i}: K {} / V {} values, want {}",
                            k.len(),
                            v.len(),
                            rows * row
                        ));
                    }
                    GpuEntryLayer::Full {
                        k: upload_elems(gpu, k)?,
                        v: upload_elems(gpu, v)?,
                        rows,
                        row,
                    }
                }
                _ => return bad(format!("layer {i}: kind does not match the model")),
            });
        }
        gpu.sync()?;
        Ok(GpuSegmentEntry {
            gpu: gpu.clone(),
            body_start: e.body_start,
            len: e.len,
            layers,
        })
    }
}
/// Whether `pair` has the transition kind of mixer `m` and the dims `dims`.
fn m_kind_ok(
    m: MixerKind,
    pair: &crate::linear::transition::Pair,
    dims: (usize, usize, usize),
) -> std::result::Result<(), ()> {
    if m.transition_kind() == Some(pair.kind()) && pair.dims() == dims {
        Ok(())
    } else {
        Err(())
    }
}

/// Device and config bound for decoding spilled blobs on this thread.
struct SpillCtx {
    gpu: Arc<Gpu>,
    config: ModelConfig,
}

thread_local! {
    static SPILL_CTX: RefCell<Option<SpillCtx>> = const { RefCell::new(None) };
}

/// Binds `(gpu, config)` for spill decoding while `f` runs (restoring the previous
/// binding afterwards).
fn with_spill_ctx<R>(gpu: &Arc<Gpu>, c: &ModelConfig, f: impl FnOnce() -> R) -> R {
    let prev = SPILL_CTX.with(|x| {
        x.replace(Some(SpillCtx {
            gpu: gpu.clone(),
            config: c.clone(),
        }))
    });
    let r = f();
    SPILL_CTX.with(|x| *x.borrow_mut() = prev);
    r
}

fn spill_ctx<R>(
    f: impl FnOnce(&SpillCtx) -> std::result::Result<R, String>,
) -> std::result::Result<R, String> {
    SPILL_CTX.with(|x| match x.borrow().as_ref() {
        Some(c) => f(c),
        None => Err("no GPU bound for decoding a spilled GPU entry".into()),
    })
}

/// Encode = download into the CPU blob format; a download failure writes an empty
/// blob, which fails to decode (counted as damaged, then recomputed).
impl<T: Elem> Spill for GpuSegmentEntry<T> {
    fn encode(&self) -> Vec<u8> {
        self.to_host().map(|e| e.encode()).unwrap_or_default()
    }
    fn decode(bytes: &[u8]) -> std::result::Result<Self, String> {
        let e = SegmentEntry::decode(bytes)?;
        spill_ctx(|c| GpuSegmentEntry::from_host(&c.gpu, &c.config, &e).map_err(|x| x.to_string()))
    }
}

impl<T: Elem> Spill for Snapshot<GpuState<T>> {
    fn encode(&self) -> Vec<u8> {
        match self.state.to_host() {
            Ok(state) => Snapshot {
                state,
                logits: self.logits.clone(),
            }
            .encode(),
            Err(_) => vec![],
        }
    }
    fn decode(bytes: &[u8]) -> std::result::Result<Self, String> {
        let s = Snapshot::decode(bytes)?;
        spill_ctx(|c| {
            Ok(Snapshot {
                state: GpuState::from_host(&c.gpu, &c.config, &s.state)
                    .map_err(|x| x.to_string())?,
                logits: s.logits,
            })
        })
    }
}

impl<T: Elem> CacheEntry for GpuSegmentEntry<T> {
    fn body_start(&self) -> usize {
        self.body_start
    }
    fn bytes(&self) -> usize {
        GpuSegmentEntry::bytes(self)
    }
}

/// A private-pool snapshot on the device: the running state after a segment prefix.
pub type GpuSnapshot<T> = Snapshot<GpuState<T>>;

/// Result of [`Pic::run`] on the device.
pub type GpuPicOutput<T> = PicOutput<GpuState<T>>;

/// The PIC engine on the GPU: the generic engine ([`Pic`]) over [`GpuBackend`], its
/// public and private pools in device memory (see the module doc).
pub type GpuPicEngine<T> = Pic<GpuBackend<T>>;

fn lock<X>(m: &Mutex<X>) -> MutexGuard<'_, X> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn device_err(e: CudaError) -> crate::Error {
    e.into()
}

/// Whether the GPU backend runs several requests' prefill pieces as one batched
/// forward ([`GpuModel::prefill_many`]): only when the environment sets
/// `HYPIC_CUDA_BATCHED_PREFILL=1` (also `on`, `true`, `yes`; read once) until the
/// batched path has been checked on a GPU (`cuda_pic`
/// `batched_prefill_matches_each_alone`); otherwise one request after the other.
pub fn batched_prefill() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("HYPIC_CUDA_BATCHED_PREFILL").is_ok_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "on" | "true" | "yes"
            )
        })
    })
}

/// The device model as a PIC backend.
pub struct GpuBackend<T: Elem> {
    model: Arc<GpuModel<T>>,
    /// Serialises the device work issued through the [`crate::engine::Engine`]
    /// interface (the scheduler's prefill and decode, the server's segment
    /// prefetch), which come from different threads.
    serial: Mutex<()>,
    /// Whether [`PicBackend::decode_sample`] draws on the device (else every row
    /// returns its logits, the host path): `HYPIC_DEVICE_SAMPLING=0` turns it off.
    device_sampling: bool,
}

impl<T: Elem> Pic<GpuBackend<T>>
where
    CudaBlas: Gemm<T>,
{
    /// Engine over `model` (identified by `model_id` in cache keys, as the CPU
    /// engine) with LRU pools of the given device byte capacities.
    pub fn new(
        model: Arc<GpuModel<T>>,
        model_id: &str,
        public_bytes: usize,
        private_bytes: usize,
    ) -> Self {
        let backend = GpuBackend {
            model,
            serial: Mutex::new(()),
            device_sampling: std::env::var("HYPIC_DEVICE_SAMPLING").map_or(true, |v| v != "0"),
        };
        Pic::with_backend(backend, model_id, public_bytes, private_bytes)
    }

    /// The device model.
    pub fn model(&self) -> &Arc<GpuModel<T>> {
        &self.backend.model
    }

    /// Turns device sampling in [`crate::engine::Engine::decode_sample`] on (the
    /// default, unless `HYPIC_DEVICE_SAMPLING=0`) or off (every row's logits go to
    /// the host, which samples them).
    pub fn set_device_sampling(&mut self, on: bool) {
        self.backend.device_sampling = on;
    }
}

impl<T: Elem> GpuBackend<T>
where
    CudaBlas: Gemm<T>,
{
    /// Prefills `tokens` alone on the device (fresh state, positions from 0) and
    /// keeps, per layer, the body `[body_start, m)` (clamped to `m`): GDN layers' pair
    /// and conv tail, attention layers' K/V. The device counterpart of
    /// `PicEngine::build_entry`.
    ///
    /// Errors: empty span, a token outside the vocabulary; driver errors.
    fn build_one(&self, tokens: &[u32], body_start: usize) -> Result<GpuSegmentEntry<T>> {
        let model = &self.model;
        let c = model.config();
        let gpu = model.gpu();
        let m = tokens.len();
        let from = body_start.min(m);
        let mut st = model.new_state()?;
        let pairs = model.prefill_capture(tokens, &mut st, from)?;
        if pairs.len() != st.layers.len() {
            return Err(CudaError::Shape(format!(
                "capture returned {} layers for {}",
                pairs.len(),
                st.layers.len()
            )));
        }
        let conv_len = c.conv_dim() * c.conv_kernel.saturating_sub(1);
        let rows = m - from;
        let s = gpu.stream();
        let mut layers = Vec::with_capacity(pairs.len());
        for (i, (ls, p)) in st.layers.into_iter().zip(pairs).enumerate() {
            layers.push(match (ls, p) {
                (GpuLayerState::Linear { conv, .. }, Some(LayerPair::Dense(pair))) => {
                    GpuEntryLayer::Linear {
                        pair,
                        conv_tail: conv,
                        conv_len,
                    }
                }
                (GpuLayerState::Linear { .. }, Some(LayerPair::Scalar(pair))) => {
                    GpuEntryLayer::Lightning { pair }
                }
                (GpuLayerState::Full(kv), None) => {
                    let row = kv.row;
                    let (k, v) = if rows == 0 {
                        (gpu.zeros(1)?, gpu.zeros(1)?)
                    } else {
                        (
                            s.clone_dtod(&kv.k().slice(from * row..m * row))?,
                            s.clone_dtod(&kv.v().slice(from * row..m * row))?,
                        )
                    };
                    GpuEntryLayer::Full { k, v, rows, row }
                }
                _ => {
                    return Err(CudaError::Shape(format!(
                        "layer {i}: capture returned no cache data"
                    )))
                }
            });
        }
        Ok(GpuSegmentEntry {
            gpu: gpu.clone(),
            body_start: from,
            len: m,
            layers,
        })
    }

    /// Composes one layer of a cached segment into the running layer state `ls`: GDN
    /// `S ← T_body S + S_body|0` (or `S + S_body|0`, `naive`) and the segment's conv
    /// tail; attention: the body K re-rotated by `R(b)` (`b` the segment's new start;
    /// not when `rope_fix` is off or `b = 0`) and V appended at positions `body_pos ..`.
    #[allow(clippy::too_many_arguments)]
    fn compose_layer(
        &self,
        i: usize,
        ls: &mut GpuLayerState<T>,
        el: &GpuEntryLayer<T>,
        body_pos: i64,
        b: i64,
        naive: bool,
        rope_fix: bool,
    ) -> Result<()> {
        let model = &self.model;
        let c = model.config();
        let gpu = model.gpu();
        let (nkv, hd) = (c.num_kv_heads, c.head_dim);
        let s = gpu.stream();
        match (ls, el, c.mixers[i]) {
            (
                GpuLayerState::Linear { conv, recurrent },
                GpuEntryLayer::Linear {
                    pair,
                    conv_tail,
                    conv_len,
                },
                m,
            ) if m.is_linear() => {
                let n = pair.hv * pair.dk * pair.dv;
                if naive {
                    axpby(gpu, recurrent, &pair.b, 1.0, 1.0, n)?;
                } else {
                    // Fully written by apply_into (B copied in, then T·S added).
                    let mut out: Scratch<f32> = gpu.scratch(n)?;
                    pair.apply_into(gpu, recurrent, &mut out)?;
                    *recurrent = out.into_slice();
                }
                check_len("conv tail", conv_tail, *conv_len)?;
                if conv.len() == conv_tail.len() {
                    s.memcpy_dtod(conv_tail, conv)?;
                } else {
                    *conv = s.clone_dtod(conv_tail)?;
                }
            }
            (
                GpuLayerState::Linear { recurrent, .. },
                GpuEntryLayer::Lightning { pair },
                MixerKind::Lightning,
            ) => {
                // Lightning keys carry RoPE: the body, cached with its keys at
                // positions from 0, moves to `b` by R(b) on its key axis (the CPU
                // backend's compose; also under naive addition).
                let per = pair.dk * pair.dv;
                let mut body = s.clone_dtod(&pair.b)?;
                if rope_fix && b != 0 {
                    if let Some(inv) = model.inv_freq() {
                        super::lightning::rotate_state(
                            gpu, &mut body, pair.h, pair.dk, pair.dv, b, inv,
                        )?;
                    }
                }
                super::lightning::scalar_apply(gpu, recurrent, &pair.t, &body, pair.h, per, naive)?;
            }
            (
                GpuLayerState::Full(kv),
                GpuEntryLayer::Full { k, v, rows, row },
                // MLA (NoPE): no inverse frequencies, so its latent rows are appended
                // as cached.
                MixerKind::Attention | MixerKind::Mla,
            ) => {
                let (rows, row) = (*rows, *row);
                if rows == 0 {
                    return Ok(());
                }
                let mut kr = s.clone_dtod(&k.slice(..rows * row))?;
                if rope_fix && b != 0 {
                    if let Some(inv) = model.inv_freq() {
                        ops::rope(gpu, &mut kr, None, b, inv, rows, nkv, hd)?;
                    }
                }
                let pos = iota(gpu, body_pos, rows)?;
                kv.append(gpu, &kr, v, &pos, rows)?;
            }
            _ => {
                return Err(CudaError::Shape(format!(
                    "layer {i}: cache entry does not match the model"
                )))
            }
        }
        Ok(())
    }
}

impl<T: Elem> PicBackend for GpuBackend<T>
where
    CudaBlas: Gemm<T>,
{
    type State = GpuState<T>;
    type Entry = GpuSegmentEntry<T>;

    fn config(&self) -> &ModelConfig {
        self.model.config()
    }
    fn info(&self) -> BackendInfo {
        let g = self.model.gpu();
        BackendInfo {
            device: "cuda".into(),
            dtype: T::SUFFIX.into(),
            describe: format!("cuda:0 {} ({}) {}", g.name(), g.arch(), T::SUFFIX),
        }
    }
    fn kv_elem_bytes(&self) -> usize {
        std::mem::size_of::<T>()
    }
    fn new_state(&self) -> crate::Result<GpuState<T>> {
        self.model.new_state().map_err(device_err)
    }
    fn clone_state(&self, state: &GpuState<T>) -> crate::Result<GpuState<T>> {
        state.try_clone().map_err(device_err)
    }
    /// [`GpuModel::weights_digest`]; a failed device read gives 0 (the
    /// configuration alone then names the model, and entries whose payload does not
    /// fit are still refused when decoded).
    fn weights_digest(&self) -> u128 {
        self.model.weights_digest().unwrap_or(0)
    }
    fn state_bytes(state: &GpuState<T>) -> usize {
        state.bytes()
    }
    fn recurrent_bytes(state: &GpuState<T>) -> usize {
        state
            .layers
            .iter()
            .map(|l| match l {
                GpuLayerState::Linear { conv, recurrent } => 4 * (conv.len() + recurrent.len()),
                GpuLayerState::Full(_) => 0,
            })
            .sum()
    }
    fn prefill(
        &self,
        tokens: &[u32],
        state: &mut GpuState<T>,
        last: bool,
    ) -> crate::Result<Vec<f32>> {
        let logits = if last { Logits::Last } else { Logits::None };
        self.model
            .prefill(tokens, state, logits)
            .map_err(device_err)
    }
    fn batches_prefills(&self) -> bool {
        batched_prefill()
    }

    /// One batched forward ([`GpuModel::prefill_many`]) when [`batched_prefill`] says
    /// so, else the items one after the other.
    fn prefill_many(
        &self,
        items: &mut [(&[u32], &mut GpuState<T>, bool)],
    ) -> crate::Result<Vec<Vec<f32>>> {
        if !batched_prefill() {
            return items
                .iter_mut()
                .map(|(tokens, state, last)| self.prefill(tokens, state, *last))
                .collect();
        }
        self.model.prefill_many(items).map_err(device_err)
    }
    /// One device prefill per wanted body start (unwanted ones are not built).
    fn build_entries(
        &self,
        tokens: &[u32],
        body_starts: &[usize],
        wanted: &[bool],
    ) -> crate::Result<Vec<Option<GpuSegmentEntry<T>>>> {
        body_starts
            .iter()
            .zip(wanted)
            .map(|(&b, &w)| {
                w.then(|| self.build_one(tokens, b))
                    .transpose()
                    .map_err(device_err)
            })
            .collect()
    }
    /// Places cached segments one after the other after the running `state` (segment
    /// k at `b_k = state.next_position + Σ_{j<k} len_j`): per layer, segment k's seam
    /// window `tokens[..body_start]` runs through the layer's mixer at its new positions
    /// from the running layer state, then the body is composed into that state (or
    /// added, `naive`) and its (re-rotated) KV appended; the FFN runs once per layer over
    /// all seam windows ([`GpuModel::forward_spans`]). The same result per segment as
    /// recomputing each seam through the whole model and then composing its body, one
    /// segment after the other.
    ///
    /// Also returns `(k, state after segment k)` for the last `keep` segments of the run
    /// (the private pool's entries): per layer, a copy taken right after the segment's
    /// body is composed (KV shared copy-on-write).
    fn compose_run(
        &self,
        run: &[(&[u32], &GpuSegmentEntry<T>)],
        state: &mut GpuState<T>,
        naive: bool,
        rope_fix: bool,
        keep: usize,
    ) -> crate::Result<Vec<(usize, GpuState<T>)>> {
        let model = &self.model;
        let gpu = model.gpu();
        let nl = state.layers.len();
        let entries: Vec<&GpuSegmentEntry<T>> = run.iter().map(|&(_, e)| e).collect();
        let mut starts = Vec::with_capacity(entries.len());
        let mut b = state.next_position;
        for &(tokens, e) in run {
            if e.len != tokens.len() || e.body_start > e.len || e.layers.len() != nl {
                return Err(CudaError::Shape(format!(
                    "cache entry ({} tokens, body from {}, {} layers) does not match the \
                     segment ({} tokens) or the state ({nl} layers)",
                    e.len,
                    e.body_start,
                    e.layers.len(),
                    tokens.len(),
                ))
                .into());
            }
            starts.push(b);
            b += e.len as i64;
        }
        let spans: Vec<(&[u32], i64)> = run
            .iter()
            .zip(&starts)
            .map(|(&(tokens, e), &b)| (&tokens[..e.body_start], b))
            .collect();
        let first_kept = entries.len() - keep.min(entries.len());
        let mut snap_layers: Vec<Vec<GpuLayerState<T>>> = (first_kept..entries.len())
            .map(|_| Vec::with_capacity(nl))
            .collect();
        model.forward_spans(&spans, state, |l, k, ls| {
            let e = entries[k];
            self.compose_layer(
                l,
                ls,
                &e.layers[l],
                starts[k] + e.body_start as i64,
                starts[k],
                naive,
                rope_fix,
            )?;
            if k >= first_kept {
                snap_layers[k - first_kept].push(ls.try_clone_on(gpu)?);
            }
            Ok(())
        })?;
        state.next_position = b;
        Ok(snap_layers
            .into_iter()
            .enumerate()
            .map(|(s, layers)| {
                let k = first_kept + s;
                (
                    k,
                    state.with_layers(layers, starts[k] + entries[k].len as i64),
                )
            })
            .collect())
    }
    fn decode_batch(
        &self,
        tokens: &[u32],
        states: &mut [&mut GpuState<T>],
    ) -> crate::Result<Vec<Vec<f32>>> {
        self.model.decode_batch(tokens, states).map_err(device_err)
    }
    fn decode_sample(
        &self,
        tokens: &[u32],
        states: &mut [&mut GpuState<T>],
        draws: &[Option<crate::sampling::DrawParams>],
    ) -> crate::Result<Vec<crate::engine::Decoded>> {
        if !self.device_sampling {
            let _ = draws;
            return Ok(self
                .decode_batch(tokens, states)?
                .into_iter()
                .map(crate::engine::Decoded::Logits)
                .collect());
        }
        self.model
            .decode_sample(tokens, states, draws)
            .map_err(device_err)
    }
    /// Binds the device and config for decoding spilled blobs (a thread-local)
    /// around the lookup.
    fn decoding<R>(&self, f: impl FnOnce() -> R) -> R {
        with_spill_ctx(self.model.gpu(), self.model.config(), f)
    }
    fn exclusive(&self) -> Option<MutexGuard<'_, ()>> {
        Some(lock(&self.serial))
    }
}
