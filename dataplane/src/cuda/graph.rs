//! CUDA graphs of the decode step: [`GpuModel::decode_batch`] and
//! [`GpuModel::decode_sample`] replay a recorded graph of the whole step (embedding, every
//! layer, final norm, LM head and the device draw) instead of launching its kernels one
//! by one from the host.
//!
//! # What a graph depends on
//!
//! A graph records kernel launches with their arguments, so everything that changes
//! from step to step is read from device memory that the graph owns:
//!
//! * per-step inputs in one buffer written by one host→device copy (from pinned memory)
//!   before each launch: token ids `[B]` u32, positions `[B]` i64, KV lengths after the
//!   step's append `[attention layers, B]` i32, and the draw parameters (temperature,
//!   top-k, top-p, seed, step; `[B]` each), the address table of the Gated
//!   DeltaNet layers' conv tails and recurrent states that the batched GDN kernels read
//!   (`GpuModel::gdn_state_table`) and that of the attention layers' KV caches that the
//!   batched KV append and decode attention read (`GpuModel::attn_state_table`) — see
//!   [`Layout`];
//! * attention reads its key count from that buffer: the KV append writes row
//!   `n − 1` ([`super::attn::kv_append_rows`] for the batch, or
//!   [`super::attn::kv_append_dev`] per sequence), bf16 decode attention is
//!   [`super::attn::decode_rows`] / [`super::attn::decode_dev`] (workspace sized for
//!   the caches' capacities, the split plan of [`super::attn::decode`] computed on the
//!   device) and the tiled kernel is [`super::attn::prefill_dev`] — the same
//!   arithmetic as the kernels the eager step launches, so a replay gives the eager
//!   step's logits and tokens bit for bit;
//! * the buffers of the states (conv tails, recurrent states, KV caches) are baked into
//!   the graph: graphs are keyed by their device addresses (and KV capacities), the
//!   batch size and the draw mode ([`Key`]). A KV cache that grows moves to new
//!   buffers, so the next step records a new graph; a sequence that joins or leaves the
//!   batch changes the key likewise. A graph replayed for a state that reuses the
//!   buffers of a dropped one is correct: it refers to nothing else of the old state;
//! * scratch buffers ([`super::Scratch`]) used inside a capture stay with the graph
//!   ([`super::scratch::CaptureKeep`]) until it is evicted; the MoE layers use a
//!   workspace of the graph's own; cuBLAS has a fixed workspace ([`super::Gpu`]).
//!
//! Steps that have no such kernels run eagerly (the reference path, unchanged): models
//! with mixers other than Gated DeltaNet and gated attention (their decode kernels have
//! not been checked for values read on the host), f32
//! attention over ≥ `model::ATTN_FAST_MIN_KV` keys (cuBLAS GEMMs sized by the length),
//! bf16 attention that takes the flash kernel (head dims outside
//! [`super::attn::DECODE_HEAD_DIMS`] over long caches), the generic attention kernel,
//! the host-routed MoE ([`super::model::FfnPath::HostRouted`]) and a forced per-expert
//! MoE GEMM (both copy to the host inside the step).
//!
//! # Life of a key
//!
//! The first step with a key runs the device-input kernels eagerly (a warm-up: loads
//! the kernels and sizes the MoE workspace); the second records the graph (stream
//! capture in relaxed mode, nothing executes) and launches it; later steps write the
//! inputs and launch. At most [`MAX_GRAPHS`] graphs per model are kept (least recently
//! used evicted; eviction waits for the stream and gives the scratch buffers back). A
//! capture that fails is logged once (stderr) and its key runs eagerly from then on.
//!
//! Switches: `HYPIC_CUDA_GRAPHS=0` (read when the device is opened) turns graphs off
//! and keeps the legacy default stream; [`GpuModel::set_cuda_graphs`] turns them off or
//! on for one model. While a capture is open the device must not be used by another
//! thread (the engine serialises its device work).
use std::collections::{HashMap, HashSet};
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{
    CudaGraph, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice, PushKernelArg,
};

use super::model::{AttnW, FfnW, GpuKv, GpuLayerState, GpuModel, GpuState, MixerW};
use super::scratch::{CaptureKeep, ScratchCache};
use super::{attn, check_len, grid_for, moe, CudaError, CudaSlice, Elem, Result, Scratch};
use crate::engine::Decoded;
use crate::sampling::DrawParams;

/// Most instantiated decode graphs kept per model.
pub const MAX_GRAPHS: usize = 8;
/// Most keys remembered as warmed up (seen once, not yet recorded) per model.
const MAX_PENDING: usize = 16;
/// Most keys remembered as failed per model.
const MAX_FAILED: usize = 64;

/// Per-step device inputs of the graph form of the decode step
/// ([`GpuModel::decode_hidden`] with `dev`): views into the step's input buffer and the
/// MoE workspace the step uses.
pub(crate) struct DevStep<'a> {
    /// Token ids `[B]`.
    pub(crate) tokens: &'a CudaSlice<u32>,
    /// Positions `[B]`.
    pub(crate) pos: &'a CudaSlice<i64>,
    /// KV lengths after the append, `[attention layers, B]` (layer-major).
    pub(crate) kv_len: &'a CudaSlice<i32>,
    /// The GDN layers' state address table (`GpuModel::gdn_state_table`), when the
    /// step runs them batched.
    pub(crate) gdn_states: Option<&'a CudaSlice<u64>>,
    /// The attention layers' KV address table (`GpuModel::attn_state_table`), when the
    /// step runs them batched; their lengths are `kv_len`.
    pub(crate) attn_states: Option<&'a CudaSlice<u64>>,
    /// MoE workspace of the graph.
    pub(crate) moe_ws: &'a mut moe::MoeWorkspace,
}

/// Counters of a model's decode graphs ([`GpuModel::cuda_graph_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GraphStats {
    /// Steps run by replaying a recorded graph (the capture's own launch not counted).
    pub replays: u64,
    /// Graphs recorded.
    pub captures: u64,
    /// Warm-up steps (device-input kernels launched eagerly, before a capture).
    pub warmups: u64,
    /// Steps that ran on the eager path (graphs off, a step without device-input
    /// kernels, or a failed key).
    pub eager: u64,
    /// Captures that failed (each key then runs eagerly).
    pub failures: u64,
    /// Graphs evicted from the cache.
    pub evictions: u64,
    /// Graphs held now.
    pub held: u64,
    /// Scratch bytes the held graphs keep.
    pub kept_bytes: u64,
    /// Host seconds of the last replayed step from the call to the graph launch
    /// returning (checks, key, input copy, launch), before the results are read.
    pub last_host_s: f64,
}

/// What the step ends with: host logits, greedy ids, or sampled ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Mode {
    Logits,
    Greedy,
    Sample,
}

/// What a recorded graph depends on (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    bsz: usize,
    mode: Mode,
    /// Per sequence, per layer: conv and recurrent-state addresses, or the KV cache's
    /// `(k, v, pos, capacity)`.
    bufs: Vec<u64>,
}

/// Byte offsets of the per-step inputs in the input buffer (each 16-byte aligned).
#[derive(Clone, Copy, Debug)]
struct Layout {
    bsz: usize,
    n_attn: usize,
    /// u64 entries of the GDN state address table (`[GDN layers, 2, B]`; 0 when the
    /// step does not run its GDN layers batched).
    gdn_words: usize,
    /// u64 entries of the attention layers' KV address table (`[attention layers, 3,
    /// B]`; 0 when the step does not run its attention layers batched).
    attn_words: usize,
    tokens: usize,
    pos: usize,
    kv_len: usize,
    temp: usize,
    topk: usize,
    topp: usize,
    seed: usize,
    step: usize,
    gdn: usize,
    attn: usize,
    bytes: usize,
}

impl Layout {
    fn new(bsz: usize, n_attn: usize, gdn_words: usize, attn_words: usize) -> Self {
        let mut at = 0usize;
        let mut take = |bytes: usize| {
            let o = at;
            at = (at + bytes.max(1)).next_multiple_of(16);
            o
        };
        let tokens = take(4 * bsz);
        let pos = take(8 * bsz);
        let kv_len = take(4 * bsz * n_attn.max(1));
        let temp = take(4 * bsz);
        let topk = take(4 * bsz);
        let topp = take(4 * bsz);
        let seed = take(8 * bsz);
        let step = take(8 * bsz);
        let gdn = take(8 * gdn_words);
        let attn = take(8 * attn_words);
        Layout {
            bsz,
            n_attn,
            gdn_words,
            attn_words,
            tokens,
            pos,
            kv_len,
            temp,
            topk,
            topp,
            seed,
            step,
            gdn,
            attn,
            bytes: at,
        }
    }
}

/// A typed view of part of a device buffer owned elsewhere (never freed through it;
/// dropping it releases only its handle on the stream).
struct View<T>(ManuallyDrop<CudaSlice<T>>);

impl<T> View<T> {
    /// # Safety
    /// `ptr .. ptr + len·size_of::<T>()` must lie in a live device allocation of
    /// `stream`'s context that outlives the view, aligned for `T`.
    unsafe fn new(stream: &Arc<CudaStream>, ptr: u64, len: usize) -> Self {
        // SAFETY: the caller's contract; the slice is never dropped (ManuallyDrop).
        View(ManuallyDrop::new(unsafe {
            stream.upgrade_device_ptr::<T>(ptr, len)
        }))
    }
}

impl<T> Drop for View<T> {
    fn drop(&mut self) {
        // SAFETY: taken once, here. `leak` releases the slice's handles (its stream) and
        // frees nothing: the memory belongs to the buffer the view was made from.
        let s = unsafe { ManuallyDrop::take(&mut self.0) };
        let _ = s.leak();
    }
}

impl<T> std::ops::Deref for View<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.0
    }
}

/// The input buffers of one key: pinned host staging and its device copy, plus the
/// MoE workspace its steps use.
struct Prepared {
    layout: Layout,
    host: PinnedHostSlice<u8>,
    dev: CudaSlice<u8>,
    moe_ws: moe::MoeWorkspace,
}

/// A recorded graph with what it refers to.
struct Entry {
    key: Key,
    graph: GraphHandle,
    prep: Prepared,
    keep: Option<CaptureKeep>,
    /// Logits `[B, vocab]` in `T` (device address, elements).
    logits: (u64, usize),
    /// Token ids `[B]` (device address), for the draw modes.
    ids: Option<u64>,
    stream: Arc<CudaStream>,
    cache: Arc<ScratchCache>,
}

/// The instantiated graph; only touched under the [`DecodeGraphs`] lock.
struct GraphHandle(ManuallyDrop<CudaGraph>);

// SAFETY: the graph and its exec are used only while the owning `DecodeGraphs` mutex is
// held (one thread at a time), which is what the driver asks of graph objects.
unsafe impl Send for GraphHandle {}
// SAFETY: as above.
unsafe impl Sync for GraphHandle {}

impl Drop for Entry {
    fn drop(&mut self) {
        // The graph may still run: wait, then destroy it and give its buffers back.
        let _ = self.stream.synchronize();
        // SAFETY: taken once, here; not used afterwards.
        drop(unsafe { ManuallyDrop::take(&mut self.graph.0) });
        if let Some(k) = self.keep.take() {
            self.cache.release(k);
        }
    }
}

#[derive(Default)]
struct Inner {
    /// `Some` once set by [`GpuModel::set_cuda_graphs`]; else the environment decides.
    enabled: Option<bool>,
    /// Least recently used first.
    entries: Vec<Entry>,
    pending: HashMap<Key, Prepared>,
    failed: HashSet<Key>,
    logged: bool,
    stats: GraphStats,
}

/// The decode graphs of one [`GpuModel`] (see the module docs).
#[derive(Default)]
pub struct DecodeGraphs {
    inner: Mutex<Inner>,
    /// The model's batched-GDN switch ([`GpuModel::set_gdn_rows`],
    /// `HYPIC_CUDA_GDN_ROWS`). Outside `inner`: the decode step reads it while a graph is
    /// being recorded under that lock.
    pub(crate) gdn_rows: RowsSwitch,
    /// The model's batched-attention switch ([`GpuModel::set_attn_rows`],
    /// `HYPIC_CUDA_ATTN_ROWS`), as `gdn_rows`.
    pub(crate) attn_rows: RowsSwitch,
}

/// A per-model switch of a batched decode path: on or off once set
/// ([`RowsSwitch::set`]), else as its environment variable says (read on first use;
/// any value but `0` or unset means on).
#[derive(Default)]
pub(crate) struct RowsSwitch {
    /// 0 = not set, 1 = on, 2 = off.
    state: std::sync::atomic::AtomicU8,
    env: std::sync::OnceLock<bool>,
}

impl RowsSwitch {
    fn set(&self, on: bool) {
        self.state
            .store(if on { 1 } else { 2 }, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the path is on; `var` is the switch's environment variable.
    pub(crate) fn on(&self, var: &str) -> bool {
        match self.state.load(std::sync::atomic::Ordering::Relaxed) {
            1 => true,
            2 => false,
            _ => *self
                .env
                .get_or_init(|| std::env::var(var).map_or(true, |v| v.trim() != "0")),
        }
    }
}

impl DecodeGraphs {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<T: Elem> GpuModel<T>
where
    cudarc::cublas::CudaBlas: cudarc::cublas::Gemm<T>,
{
    /// Turns the decode graphs of this model on or off (default: on unless
    /// `HYPIC_CUDA_GRAPHS=0`). Turning them off drops every recorded graph.
    pub fn set_cuda_graphs(&self, on: bool) {
        let old = {
            let mut g = self.graphs.lock();
            g.enabled = Some(on);
            if on {
                Vec::new()
            } else {
                g.pending.clear();
                std::mem::take(&mut g.entries)
            }
        };
        drop(old);
    }

    /// Runs the Gated DeltaNet layers of a batched decode step batched (`true`, the
    /// default unless `HYPIC_CUDA_GDN_ROWS=0`) or sequence by sequence (`false`, the
    /// reference the batched kernels are compared with). Drops every recorded graph
    /// (their input layouts differ).
    pub fn set_gdn_rows(&self, on: bool) {
        self.graphs.gdn_rows.set(on);
        self.drop_recorded();
    }

    /// Runs the attention layers of a batched bf16 decode step batched (`true`, the
    /// default unless `HYPIC_CUDA_ATTN_ROWS=0`: one KV append and one decode attention
    /// for all sequences) or sequence by sequence (`false`, the reference the batched
    /// kernels are compared with). Drops every recorded graph (their input layouts
    /// differ).
    pub fn set_attn_rows(&self, on: bool) {
        self.graphs.attn_rows.set(on);
        self.drop_recorded();
    }

    /// Drops the recorded and warmed-up graphs (after a switch that changes their
    /// input layout).
    fn drop_recorded(&self) {
        let old = {
            let mut g = self.graphs.lock();
            g.pending.clear();
            std::mem::take(&mut g.entries)
        };
        drop(old);
    }

    /// Whether decode steps may replay graphs: switched on, and the device's stream can
    /// be captured (not the legacy default stream of `HYPIC_CUDA_GRAPHS=0`).
    pub fn cuda_graphs_enabled(&self) -> bool {
        let on = self
            .graphs
            .lock()
            .enabled
            .unwrap_or_else(super::graphs_enabled_by_env);
        on && !self.gpu.stream().cu_stream().is_null()
    }

    /// Counters of this model's decode graphs.
    pub fn cuda_graph_stats(&self) -> GraphStats {
        let g = self.graphs.lock();
        let mut s = g.stats;
        s.held = g.entries.len() as u64;
        s.kept_bytes = g
            .entries
            .iter()
            .map(|e| e.keep.as_ref().map_or(0, |k| k.bytes()) as u64)
            .sum();
        s
    }

    /// Drops every recorded graph (waits for the stream; the scratch buffers go back).
    pub fn clear_cuda_graphs(&self) {
        let old = {
            let mut g = self.graphs.lock();
            g.pending.clear();
            g.failed.clear();
            std::mem::take(&mut g.entries)
        };
        drop(old);
    }

    /// For benchmarks: replays the most recently used graph `n` times back to back with
    /// its last inputs and returns the device milliseconds per replay (CUDA events
    /// around the `n` launches; host launch cost overlapped). Each replay writes the
    /// states it was recorded for again (the same KV row, the recurrent state advanced
    /// once more) without their host bookkeeping: discard those states afterwards.
    /// `None` when no graph is held.
    ///
    /// Errors: driver failures.
    pub fn bench_replay(&self, n: usize) -> Result<Option<f64>> {
        let inner = self.graphs.lock();
        let Some(e) = inner.entries.last() else {
            return Ok(None);
        };
        let st = self.gpu.stream();
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let (a, b) = (
            self.gpu.context().new_event(flags)?,
            self.gpu.context().new_event(flags)?,
        );
        a.record(st)?;
        for _ in 0..n.max(1) {
            // SAFETY: as for the replay in `graph_decode` (under the lock, same stream).
            unsafe {
                cudarc::driver::sys::cuGraphLaunch(e.graph.0.cu_graph_exec(), st.cu_stream())
            }
            .result()?;
        }
        b.record(st)?;
        b.synchronize()?;
        Ok(Some(a.elapsed_ms(&b)? as f64 / n.max(1) as f64))
    }

    /// For benchmarks: the eager greedy decode step (the kernels of
    /// [`GpuModel::decode_sample`] with greedy draws and graphs off) without copying the
    /// token ids to the host, so that the caller can time the host's enqueue apart from
    /// the device (then wait with [`super::Gpu::sync`]). States advance as in a step.
    ///
    /// Errors: as [`GpuModel::decode_batch`].
    pub fn decode_enqueue_eager(
        &self,
        tokens: &[u32],
        states: &mut [&mut GpuState<T>],
    ) -> Result<()> {
        let bsz = tokens.len();
        let x = self.decode_hidden(tokens, states, None)?;
        if bsz == 0 {
            return Ok(());
        }
        let vocab = self.config.vocab_size;
        let logits = self.logits_device(&x, bsz)?;
        let g = &*self.gpu;
        let wide = super::sample::widen_f32(g, &logits, bsz * vocab)?;
        let mut ids = g.scratch::<u32>(bsz)?;
        super::sample::argmax_into(g, &wide, bsz, vocab, &mut ids)?;
        Ok(())
    }

    /// Whether every layer of this step has kernels that read the step's inputs from
    /// the device (see the module docs), for KV lengths `len + 1`.
    fn graphable(&self, states: &[&mut GpuState<T>]) -> bool {
        let c = &self.config;
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let decode_kernel = attn::check_decode_kernel::<T>("", nh, nkv, hd).is_ok();
        let tuned = [64, 128, 256].contains(&hd);
        // Only mixers whose decode kernels are known to take every step-dependent value
        // from the device (a mixer added later runs eagerly until it is checked).
        if !self
            .layers
            .iter()
            .all(|l| matches!(l.mixer, MixerW::GatedDeltaNet(_) | MixerW::Attention(_)))
        {
            return false;
        }
        if self.layers.iter().any(|l| matches!(l.ffn, FfnW::Moe(_))) {
            return false;
        }
        if self
            .layers
            .iter()
            .any(|l| matches!(l.ffn, FfnW::MoeFused(_)))
        {
            let forced = self
                .moe_ws
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .forced_expert_gemm();
            if forced == Some(moe::ExpertGemm::PerExpert) {
                return false;
            }
        }
        for s in states {
            for l in &s.layers {
                if let GpuLayerState::Full(kv) = l {
                    // Eager: tuned head dims take a length-sized cuBLAS or flash path
                    // from ATTN_FAST_MIN_KV keys; other head dims always the generic
                    // kernel.
                    let n = kv.len() + 1;
                    if !(decode_kernel || !tuned || n < super::model::ATTN_FAST_MIN_KV) {
                        return false;
                    }
                }
            }
        }
        true
    }

    /// Attention between its projections for one decode token of one sequence, the
    /// device-input form of `attn_core`: `qkv` `[1, qw + 2·Hkv·hd]`, `pos` `[1]`, the
    /// KV length after the append in `n_kv` (one i32). Returns `[1, H·hd]`.
    pub(crate) fn attn_core_dev(
        &self,
        w: &AttnW<T>,
        qkv: &CudaSlice<T>,
        pos: &CudaSlice<i64>,
        kv: &mut GpuKv<T>,
        n_kv: &cudarc::driver::CudaView<'_, i32>,
    ) -> Result<Scratch<T>> {
        let c = &self.config;
        let g = &*self.gpu;
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let (q, gate, k, v) = self.attn_prep(w, qkv, 1, pos)?;
        kv.append_dev(g, &k, &v, pos, n_kv)?;
        let mut o: Scratch<T> = g.scratch(nh * hd)?;
        let cap = kv.capacity();
        if T::SUFFIX == "bf16"
            && attn::DECODE_HEAD_DIMS.contains(&hd)
            && nh / nkv <= attn::DECODE_MAX_GROUP
        {
            attn::decode_dev(
                g,
                &q,
                pos,
                kv.k(),
                kv.v(),
                kv.pos(),
                &mut o,
                n_kv,
                cap,
                nh,
                nkv,
                hd,
            )?;
        } else if [64, 128, 256].contains(&hd) {
            attn::prefill_dev(
                g,
                &q,
                pos,
                kv.k(),
                kv.v(),
                kv.pos(),
                &mut o,
                1,
                n_kv,
                cap,
                nh,
                nkv,
                hd,
            )?;
        } else {
            attn_generic_dev(g, &q, pos, kv, &mut o, n_kv, nh, nkv, hd)?;
        }
        if c.attn_output_gate {
            self.gate_mul(&mut o, &gate, nh * hd)?;
        }
        Ok(o)
    }

    /// The step's device work from the inputs in `dev` to its outputs: logits
    /// `[B, vocab]` in `T` and, for the draw modes, token ids `[B]`. The same kernels
    /// as the eager `decode_batch` / `decode_sample` tails.
    fn graph_body(
        &self,
        tokens: &[u32],
        states: &mut [&mut GpuState<T>],
        prep: &mut Prepared,
        mode: Mode,
    ) -> Result<(Scratch<T>, Option<Scratch<u32>>)> {
        let g = &*self.gpu;
        let st = g.stream();
        let lay = prep.layout;
        let (bsz, vocab) = (lay.bsz, self.config.vocab_size);
        let (base, _r) = prep.dev.device_ptr(st);
        // SAFETY: offsets and lengths from `lay`, inside `prep.dev` (lay.bytes long),
        // 16-byte aligned; the views are dropped before `prep`.
        let (tok_v, pos_v, len_v) = unsafe {
            (
                View::<u32>::new(st, base + lay.tokens as u64, bsz),
                View::<i64>::new(st, base + lay.pos as u64, bsz),
                View::<i32>::new(st, base + lay.kv_len as u64, bsz * lay.n_attn.max(1)),
            )
        };
        // SAFETY: as above (`lay.gdn`, `lay.gdn_words` u64 entries).
        let gdn_v = (lay.gdn_words > 0)
            .then(|| unsafe { View::<u64>::new(st, base + lay.gdn as u64, lay.gdn_words) });
        // SAFETY: as above (`lay.attn`, `lay.attn_words` u64 entries).
        let attn_v = (lay.attn_words > 0)
            .then(|| unsafe { View::<u64>::new(st, base + lay.attn as u64, lay.attn_words) });
        let x = {
            let mut dev = DevStep {
                tokens: &tok_v,
                pos: &pos_v,
                kv_len: &len_v,
                gdn_states: gdn_v.as_deref(),
                attn_states: attn_v.as_deref(),
                moe_ws: &mut prep.moe_ws,
            };
            self.decode_hidden(tokens, states, Some(&mut dev))?
        };
        let logits = self.logits_device(&x, bsz)?;
        drop(x);
        if mode == Mode::Logits {
            return Ok((logits, None));
        }
        let n = bsz * vocab;
        let mut wide: Scratch<f32> = g.scratch(n)?;
        {
            let f = g.function(
                &super::compile::SAMPLE,
                &format!("widen_{}_f32", T::SUFFIX),
                0,
            )?;
            let cfg = LaunchConfig {
                grid_dim: (grid_for(n, 256).min(65535), 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let n64 = n as i64;
            let mut b = st.launch_builder(&f);
            b.arg(&*logits).arg(&mut *wide).arg(&n64);
            // SAFETY: matches `widen_*_f32` (as `sample::widen_f32`); logits and wide hold n.
            unsafe { b.launch(cfg) }?;
        }
        let mut ids: Scratch<u32> = g.scratch(bsz)?;
        if mode == Mode::Greedy {
            super::sample::argmax_into(g, &wide, bsz, vocab, &mut ids)?;
        } else {
            // SAFETY: as above.
            let (tv, kv, pv, sv, stv) = unsafe {
                (
                    View::<f32>::new(st, base + lay.temp as u64, bsz),
                    View::<i32>::new(st, base + lay.topk as u64, bsz),
                    View::<f32>::new(st, base + lay.topp as u64, bsz),
                    View::<u64>::new(st, base + lay.seed as u64, bsz),
                    View::<u64>::new(st, base + lay.step as u64, bsz),
                )
            };
            check_len("logits", &wide, n)?;
            let f = g.function(&super::compile::SAMPLE, "sample_rows", 0)?;
            let cfg = LaunchConfig {
                grid_dim: (bsz as u32, 1, 1),
                block_dim: (1024, 1, 1),
                shared_mem_bytes: 0,
            };
            let v = i32::try_from(vocab)
                .map_err(|_| CudaError::Shape(format!("vocab {vocab} exceeds i32")))?;
            let mut b = st.launch_builder(&f);
            b.arg(&*wide)
                .arg(&v)
                .arg(&*tv)
                .arg(&*kv)
                .arg(&*pv)
                .arg(&*sv)
                .arg(&*stv)
                .arg(&mut *ids);
            // SAFETY: matches `sample_rows` (as `sample::sample_into`): logits [bsz, vocab],
            // one parameter of each kind per row, out [bsz].
            unsafe { b.launch(cfg) }?;
        }
        Ok((logits, Some(ids)))
    }

    /// Writes the step's inputs into `prep`'s pinned buffer and copies it to the device.
    fn write_inputs(
        &self,
        prep: &mut Prepared,
        tokens: &[u32],
        states: &[&mut GpuState<T>],
        draws: Option<&[Option<DrawParams>]>,
    ) -> Result<()> {
        let lay = prep.layout;
        let bsz = lay.bsz;
        let host = prep.host.as_mut_slice()?;
        let put = |host: &mut [u8], at: usize, bytes: &[u8]| {
            host[at..at + bytes.len()].copy_from_slice(bytes);
        };
        for (j, (tk, s)) in tokens.iter().zip(states).enumerate() {
            put(host, lay.tokens + 4 * j, &tk.to_le_bytes());
            put(host, lay.pos + 8 * j, &s.next_position.to_le_bytes());
            // Slots numbered over the attention layers, as `decode_hidden` reads them.
            let mut a = 0usize;
            for (l, lw) in s.layers.iter().zip(&self.layers) {
                if let (GpuLayerState::Full(kv), MixerW::Attention(_)) = (l, &lw.mixer) {
                    let n = i32::try_from(kv.len() + 1)
                        .map_err(|_| CudaError::Shape("KV length exceeds i32".into()))?;
                    put(host, lay.kv_len + 4 * (a * bsz + j), &n.to_le_bytes());
                    a += 1;
                }
            }
            let p = draws.and_then(|d| d[j]).unwrap_or(DrawParams {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                seed: 0,
                step: 0,
            });
            put(host, lay.temp + 4 * j, &p.temperature.to_le_bytes());
            let k = p.top_k.min(i32::MAX as usize) as i32;
            put(host, lay.topk + 4 * j, &k.to_le_bytes());
            put(host, lay.topp + 4 * j, &p.top_p.to_le_bytes());
            put(host, lay.seed + 8 * j, &p.seed.to_le_bytes());
            put(host, lay.step + 8 * j, &p.step.to_le_bytes());
        }
        if lay.gdn_words > 0 {
            let table = self.gdn_state_table(states)?.unwrap_or_default();
            if table.len() != lay.gdn_words {
                return Err(CudaError::Shape(format!(
                    "GDN state table of {} entries, the graph's layout holds {}",
                    table.len(),
                    lay.gdn_words
                )));
            }
            for (e, a) in table.iter().enumerate() {
                put(host, lay.gdn + 8 * e, &a.to_le_bytes());
            }
        }
        if lay.attn_words > 0 {
            // The step's KV rows are claimed (graph_decode), so these are its buffers;
            // the lengths went to `kv_len` above.
            let (table, _lens) = self.attn_state_table(states)?;
            if table.len() != lay.attn_words {
                return Err(CudaError::Shape(format!(
                    "attention state table of {} entries, the graph's layout holds {}",
                    table.len(),
                    lay.attn_words
                )));
            }
            for (e, a) in table.iter().enumerate() {
                put(host, lay.attn + 8 * e, &a.to_le_bytes());
            }
        }
        self.gpu.stream().memcpy_htod(&prep.host, &mut prep.dev)?;
        Ok(())
    }

    /// Fresh input buffers (and MoE workspace) for a key.
    fn prepare(&self, bsz: usize, n_attn: usize) -> Result<Prepared> {
        let layout = Layout::new(
            bsz,
            n_attn,
            self.gdn_table_words(bsz),
            self.attn_table_words(bsz),
        );
        let st = self.gpu.stream();
        // SAFETY: pinned host memory written before every copy (`write_inputs`).
        let host = unsafe { self.gpu.context().alloc_pinned::<u8>(layout.bytes) }?;
        let dev = st.alloc_zeros::<u8>(layout.bytes)?;
        let mut moe_ws = moe::MoeWorkspace::new();
        let forced = self
            .moe_ws
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .forced_expert_gemm();
        moe_ws.force_expert_gemm(forced);
        Ok(Prepared {
            layout,
            host,
            dev,
            moe_ws,
        })
    }

    /// Reads the step's results: token ids for rows with a draw, logits for the others.
    fn read_out(
        &self,
        logits: &CudaSlice<T>,
        ids: Option<&CudaSlice<u32>>,
        bsz: usize,
        draws: Option<&[Option<DrawParams>]>,
    ) -> Result<Vec<Decoded>> {
        let g = &*self.gpu;
        let vocab = self.config.vocab_size;
        let st = g.stream();
        let rows: Vec<Decoded> = match (draws, ids) {
            (Some(d), Some(ids)) => {
                let mut host_rows = Vec::with_capacity(bsz);
                for (b, dr) in d.iter().enumerate() {
                    host_rows.push(match dr {
                        Some(_) => None,
                        None => Some(st.clone_dtoh(&logits.slice(b * vocab..(b + 1) * vocab))?),
                    });
                }
                let ids = st.clone_dtoh(&ids.slice(..bsz))?;
                g.sync()?;
                host_rows
                    .into_iter()
                    .enumerate()
                    .map(|(b, r)| match r {
                        None => Decoded::Token(ids[b]),
                        Some(l) => Decoded::Logits(l.into_iter().map(Elem::to_f32).collect()),
                    })
                    .collect()
            }
            _ => {
                let all = st.clone_dtoh(&logits.slice(..bsz * vocab))?;
                g.sync()?;
                all.chunks_exact(vocab)
                    .map(|l| Decoded::Logits(l.iter().map(|x| x.to_f32()).collect()))
                    .collect()
            }
        };
        Ok(rows)
    }

    /// One decode step through a graph (see the module docs): `Ok(None)` when the step
    /// must run eagerly (graphs off, no device-input kernels for it, a failed key, or
    /// inputs the eager path will reject with its own error), with no state changed
    /// but KV rows claimed; else the step's rows as `decode_sample` returns them
    /// (`draws: None`: logits for every row).
    pub(crate) fn graph_decode(
        &self,
        tokens: &[u32],
        states: &mut [&mut GpuState<T>],
        draws: Option<&[Option<DrawParams>]>,
    ) -> Result<Option<Vec<Decoded>>> {
        let t_start = std::time::Instant::now();
        let bsz = tokens.len();
        if bsz == 0 || states.len() != bsz || draws.is_some_and(|d| d.len() != bsz) {
            return Ok(None);
        }
        if !self.cuda_graphs_enabled() {
            return Ok(None);
        }
        for (tk, s) in tokens.iter().zip(states.iter()) {
            if self.check_inputs(std::slice::from_ref(tk), s).is_err() {
                return Ok(None);
            }
        }
        if !self.graphable(states) {
            self.graphs.lock().stats.eager += 1;
            return Ok(None);
        }
        let mode = match draws {
            None => Mode::Logits,
            Some(d) if d.iter().flatten().all(|p| p.is_greedy()) => Mode::Greedy,
            Some(_) => Mode::Sample,
        };
        let g = &*self.gpu;
        // Every KV row this step writes, claimed now: the buffers are then final.
        for s in states.iter_mut() {
            for l in s.layers.iter_mut() {
                if let GpuLayerState::Full(kv) = l {
                    kv.claim_next(g)?;
                }
            }
        }
        let mut bufs = Vec::new();
        let st = g.stream();
        for s in states.iter() {
            for l in &s.layers {
                match l {
                    GpuLayerState::Linear { conv, recurrent } => {
                        bufs.push(conv.device_ptr(st).0);
                        bufs.push(recurrent.device_ptr(st).0);
                    }
                    GpuLayerState::Full(kv) => bufs.extend(kv.key(g)),
                }
            }
        }
        let n_attn = self
            .layers
            .iter()
            .filter(|l| matches!(l.mixer, MixerW::Attention(_)))
            .count();
        let key = Key { bsz, mode, bufs };
        let mut inner = self.graphs.lock();
        if inner.failed.contains(&key) {
            inner.stats.eager += 1;
            return Ok(None);
        }
        // Replay.
        if let Some(i) = inner.entries.iter().position(|e| e.key == key) {
            let e = inner.entries.remove(i);
            inner.entries.push(e);
            let e = inner.entries.last_mut().expect("just pushed");
            self.write_inputs(&mut e.prep, tokens, states, draws)?;
            // SAFETY: the graph's exec is launched on the stream it was recorded on, under
            // the lock; everything it refers to is alive (the entry's buffers, the states'
            // buffers named by the key, the weights).
            unsafe {
                cudarc::driver::sys::cuGraphLaunch(e.graph.0.cu_graph_exec(), st.cu_stream())
            }
            .result()?;
            let host_s = t_start.elapsed().as_secs_f64();
            advance(states);
            let (lp, ll) = e.logits;
            // SAFETY: the entry keeps these buffers (its keep list) while it lives; the
            // lock is held until the reads are done.
            let logits = unsafe { View::<T>::new(st, lp, ll) };
            let ids = e.ids.map(|p| unsafe { View::<u32>::new(st, p, bsz) });
            inner.stats.replays += 1;
            inner.stats.last_host_s = host_s;
            let out = self.read_out(&logits, ids.as_deref(), bsz, draws)?;
            return Ok(Some(out));
        }
        // Record (the key was warmed up before).
        if let Some(mut prep) = inner.pending.remove(&key) {
            self.write_inputs(&mut prep, tokens, states, draws)?;
            let saved: Vec<(i64, Vec<usize>)> = states.iter().map(|s| snapshot(s)).collect();
            match self.capture(tokens, states, &mut prep, mode) {
                Ok((graph, keep, logits, ids)) => {
                    // SAFETY: as for the replay above.
                    let launched = unsafe {
                        cudarc::driver::sys::cuGraphLaunch(graph.cu_graph_exec(), st.cu_stream())
                    }
                    .result();
                    if let Err(e) = launched {
                        // The capture advanced the host-side lengths and positions;
                        // nothing ran on the device.
                        for (s, snap) in states.iter_mut().zip(saved) {
                            restore(s, snap);
                        }
                        return Err(e.into());
                    }
                    // SAFETY: as above.
                    let lv = unsafe { View::<T>::new(st, logits.0, logits.1) };
                    let iv = ids.map(|p| unsafe { View::<u32>::new(st, p, bsz) });
                    let out = self.read_out(&lv, iv.as_deref(), bsz, draws)?;
                    inner.entries.push(Entry {
                        key,
                        graph: GraphHandle(ManuallyDrop::new(graph)),
                        prep,
                        keep: Some(keep),
                        logits,
                        ids,
                        stream: st.clone(),
                        cache: g.scratch_cache().clone(),
                    });
                    inner.stats.captures += 1;
                    while inner.entries.len() > MAX_GRAPHS {
                        drop(inner.entries.remove(0));
                        inner.stats.evictions += 1;
                    }
                    return Ok(Some(out));
                }
                Err(e) => {
                    for (s, snap) in states.iter_mut().zip(saved) {
                        restore(s, snap);
                    }
                    if !inner.logged {
                        inner.logged = true;
                        eprintln!(
                            "hypic: recording a CUDA graph of the decode step failed ({e}); \
                             such steps run kernel by kernel (logged once)"
                        );
                    }
                    inner.stats.failures += 1;
                    if inner.failed.len() >= MAX_FAILED {
                        inner.failed.clear();
                    }
                    inner.failed.insert(key);
                    return Ok(None);
                }
            }
        }
        // Warm up: the device-input kernels, launched eagerly.
        let mut prep = self.prepare(bsz, n_attn)?;
        self.write_inputs(&mut prep, tokens, states, draws)?;
        let (logits, ids) = self.graph_body(tokens, states, &mut prep, mode)?;
        let out = self.read_out(&logits, ids.as_deref(), bsz, draws)?;
        drop((logits, ids));
        if inner.pending.len() >= MAX_PENDING {
            inner.pending.clear();
        }
        inner.pending.insert(key, prep);
        inner.stats.warmups += 1;
        Ok(Some(out))
    }

    /// Records the step (nothing runs): the graph, the scratch buffers it keeps, the
    /// logits buffer `(address, elements)` and the ids buffer's address.
    #[allow(clippy::type_complexity)]
    fn capture(
        &self,
        tokens: &[u32],
        states: &mut [&mut GpuState<T>],
        prep: &mut Prepared,
        mode: Mode,
    ) -> Result<(CudaGraph, CaptureKeep, (u64, usize), Option<u64>)> {
        let g = &*self.gpu;
        let st = g.stream();
        let cache = g.scratch_cache();
        cache.begin_capture().map_err(CudaError::Driver)?;
        if let Err(e) = st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) {
            let keep = cache.end_capture();
            cache.release(keep);
            return Err(e.into());
        }
        let body = self.graph_body(tokens, states, prep, mode).map(|(l, i)| {
            let lp = (l.device_ptr(st).0, l.len());
            let ip = i.as_ref().map(|i| i.device_ptr(st).0);
            (lp, ip)
        });
        let ended = st.end_capture(CUgraphInstantiate_flags(0));
        let keep = cache.end_capture();
        let fail = |e: CudaError, keep: CaptureKeep| {
            let _ = st.synchronize();
            cache.release(keep);
            Err(e)
        };
        match (body, ended) {
            (Ok((lp, ip)), Ok(Some(graph))) => Ok((graph, keep, lp, ip)),
            (Ok(_), Ok(None)) => fail(CudaError::Driver("empty graph".into()), keep),
            (Err(e), _) => fail(e, keep),
            (_, Err(e)) => fail(e.into(), keep),
        }
    }
}

/// Key tile of the generic attention kernel (`ATG_TILE` in model.cu).
const ATG_TILE: usize = 256;
/// Largest head dim of the generic attention kernel (as `model::attn_generic`).
const ATTN_GENERIC_MAX_HD: usize = 1024;

/// `model::attn_generic` for one query over `kv` with the key count read from the
/// device (`n_kv`: one i32, at most the capacity): `q`, `o`: `[1, nh, hd]`, `pos`: `[1]`.
#[allow(clippy::too_many_arguments)]
fn attn_generic_dev<T: Elem>(
    g: &super::Gpu,
    q: &CudaSlice<T>,
    pos: &CudaSlice<i64>,
    kv: &GpuKv<T>,
    o: &mut CudaSlice<T>,
    n_kv: &cudarc::driver::CudaView<'_, i32>,
    nh: usize,
    nkv: usize,
    hd: usize,
) -> Result<()> {
    if nkv == 0 || !nh.is_multiple_of(nkv) || hd == 0 || hd > ATTN_GENERIC_MAX_HD {
        return Err(CudaError::Shape(format!(
            "generic attention: {nh} heads, {nkv} kv heads, head_dim {hd}"
        )));
    }
    let cap = kv.capacity();
    check_len("q", q, nh * hd)?;
    check_len("q_pos", pos, 1)?;
    check_len("k", kv.k(), cap * nkv * hd)?;
    check_len("v", kv.v(), cap * nkv * hd)?;
    check_len("kv_pos", kv.pos(), cap)?;
    check_len("o", o, nh * hd)?;
    if n_kv.is_empty() || nh > 65_535 {
        return Err(CudaError::Shape(
            "generic attention: counter or grid".into(),
        ));
    }
    let f = g.function(
        &super::compile::MODEL,
        &format!("attn_generic_dev_{}", T::SUFFIX),
        0,
    )?;
    let smem = ((2 * hd + ATG_TILE + 32) * 4) as u32;
    let cfg = LaunchConfig {
        grid_dim: (1, nh as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem,
    };
    let scale = (hd as f32).powf(-0.5);
    let (a, b_, e) = (nh as i32, nkv as i32, hd as i32);
    let mut b = g.stream().launch_builder(&f);
    b.arg(q)
        .arg(kv.k())
        .arg(kv.v())
        .arg(pos)
        .arg(kv.pos())
        .arg(o)
        .arg(n_kv)
        .arg(&a)
        .arg(&b_)
        .arg(&e)
        .arg(&scale);
    // SAFETY: matches `attn_generic_dev_*`; buffers checked for `cap` keys, the kernel
    // reads keys below the device count ≤ cap (the caller's contract).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// `next_position` and the KV lengths of a state (to undo a failed capture).
fn snapshot<T: Elem>(s: &GpuState<T>) -> (i64, Vec<usize>) {
    let lens = s
        .layers
        .iter()
        .filter_map(|l| match l {
            GpuLayerState::Full(kv) => Some(kv.len()),
            _ => None,
        })
        .collect();
    (s.next_position, lens)
}

fn restore<T: Elem>(s: &mut GpuState<T>, (pos, lens): (i64, Vec<usize>)) {
    s.next_position = pos;
    let mut it = lens.into_iter();
    for l in s.layers.iter_mut() {
        if let GpuLayerState::Full(kv) = l {
            if let Some(n) = it.next() {
                kv.len = n;
            }
        }
    }
}

/// The host side of a replayed step: every KV cache one row longer, positions + 1.
fn advance<T: Elem>(states: &mut [&mut GpuState<T>]) {
    for s in states.iter_mut() {
        for l in s.layers.iter_mut() {
            if let GpuLayerState::Full(kv) = l {
                kv.len += 1;
            }
        }
        s.next_position += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::Layout;

    /// Every section of the input buffer is 16-byte aligned, holds its elements and
    /// overlaps no other.
    #[test]
    fn input_layout_is_aligned_and_disjoint() {
        for bsz in [1usize, 3, 8, 64, 257] {
            for (n_attn, gdn_words, attn_words) in [
                (0usize, 0usize, 0usize),
                (1, 2 * bsz, 0),
                (1, 0, 3 * bsz),
                (10, 60 * bsz, 30 * bsz),
            ] {
                let l = Layout::new(bsz, n_attn, gdn_words, attn_words);
                let mut parts = [
                    (l.tokens, 4 * bsz),
                    (l.pos, 8 * bsz),
                    (l.kv_len, 4 * bsz * n_attn.max(1)),
                    (l.temp, 4 * bsz),
                    (l.topk, 4 * bsz),
                    (l.topp, 4 * bsz),
                    (l.seed, 8 * bsz),
                    (l.step, 8 * bsz),
                    (l.gdn, 8 * gdn_words),
                    (l.attn, 8 * attn_words),
                ];
                parts.sort();
                for w in parts.windows(2) {
                    assert!(w[0].0 + w[0].1 <= w[1].0, "{bsz} {n_attn}: {parts:?}");
                }
                for (o, n) in parts {
                    assert_eq!(o % 16, 0);
                    assert!(o + n <= l.bytes);
                }
                assert_eq!(
                    (l.bsz, l.n_attn, l.gdn_words, l.attn_words),
                    (bsz, n_attn, gdn_words, attn_words)
                );
            }
        }
    }
}
