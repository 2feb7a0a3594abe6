//! NCCL send/recv between a combiner and a GPU worker process on one host
//! (`hypic serve --nccl` with `hypic worker --device cuda --nccl`): the device side
//! of [`crate::parallel::nccl`]. `libnccl` is loaded at run time (cudarc's
//! `dynamic-loading`; the NVIDIA wheel `nvidia-nccl-cu13` ships it: put its `lib`
//! folder on `LD_LIBRARY_PATH`); without it every offer fails and the entries go
//! over TCP.
//!
//! * [`NcclReceiver`] (combiner, rank 0): offers a fresh communicator per task,
//!   joins it when the worker accepts, and receives each announced entry's buffers
//!   into freshly allocated device memory shaped by the model's configuration; the
//!   entry then travels as a [`PeerEntry`] whose checksum the scatter verifies on
//!   this device.
//! * [`NcclSender`] (worker, rank 1): joins the offered communicator, computes each
//!   built entry's checksum on its device ([`super::peer::entry_checksum`]) for the
//!   header, and sends the buffers in [`GpuSegmentEntry::buffers`] order.
//!
//! NCCL refuses two ranks on one GPU: on one device the initialisation fails on
//! both sides, and both fall back to wire frames for that task (said on stderr).
use std::any::Any;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::cublas::{CudaBlas, Gemm};
use cudarc::nccl::safe::{Comm, Id};
use cudarc::nccl::NcclType;

use super::peer::{entry_checksum, PeerEntry};
use super::pic::{EntryBuffer, GpuBackend, GpuEntryLayer, GpuSegmentEntry};
use super::transition::{DensePair, ScalarPair};
use super::{Elem, Gpu};
use crate::config::{MixerKind, ModelConfig};
use crate::parallel::nccl::{EntryHeader, NcclOffer, ID_BYTES};
use crate::parallel::transport::{NcclJoin, NcclJoiner, NcclLink, NcclSession};
use crate::parallel::wire::ModelFingerprint;
use crate::parallel::worker::Packed;
use crate::parallel::{DeviceEntry, Shipped};

/// Whether `libnccl` can be loaded.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen libnccl.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// A communicator, owned by one task and used by one thread at a time.
struct OneComm(Comm);
// SAFETY: an NCCL communicator may be used from any thread as long as calls on it
// do not overlap; every `OneComm` sits behind a `Mutex` or is owned by one task.
unsafe impl Send for OneComm {}
// SAFETY: as above (shared references only reach it through a `Mutex`).
unsafe impl Sync for OneComm {}

fn nccl_err(what: &str, e: impl std::fmt::Debug) -> String {
    format!("{what}: {e:?}")
}

/// A fresh unique id, as bytes; NCCL or its loading failing is an error.
fn new_id() -> Result<Id, String> {
    if !nccl_present() {
        return Err("libnccl could not be loaded".into());
    }
    match std::panic::catch_unwind(Id::new) {
        Ok(Ok(id)) => Ok(id),
        Ok(Err(e)) => Err(nccl_err("ncclGetUniqueId", e)),
        Err(_) => Err("libnccl failed to load (panic while loading)".into()),
    }
}

fn id_bytes(id: &Id) -> [u8; ID_BYTES] {
    id.internal().map(|c| c as u8)
}

/// Joins the communicator `id` as `rank` of 2 on `gpu`'s stream.
fn join(gpu: &Gpu, rank: usize, id: Id) -> Result<OneComm, String> {
    let stream = gpu.stream().clone();
    let init = std::panic::AssertUnwindSafe(move || Comm::from_rank(stream, rank, 2, id));
    match std::panic::catch_unwind(init) {
        Ok(Ok(c)) => Ok(OneComm(c)),
        Ok(Err(e)) => Err(nccl_err("ncclCommInitRank", e)),
        Err(_) => Err("ncclCommInitRank panicked".into()),
    }
}

/// The byte lengths of the buffers of an entry of `tokens` tokens with body from
/// `body_start` of a model `c` in element type `T`, in [`GpuSegmentEntry::buffers`]
/// order; with `true` for buffers in `T` (else fp32).
fn layout<T: Elem>(
    c: &ModelConfig,
    tokens: usize,
    body_start: usize,
) -> Result<Vec<(usize, bool)>, String> {
    if body_start > tokens {
        return Err(format!("body start {body_start} past {tokens} tokens"));
    }
    let (hv, dk, dv) = (c.linear_v_heads, c.linear_k_dim, c.linear_v_dim);
    let conv_len = c.conv_dim() * c.conv_kernel.saturating_sub(1);
    // `tokens` comes off the wire: an absurd count is an error, not an overflow.
    let kv_bytes = (tokens - body_start)
        .checked_mul(c.num_kv_heads * c.head_dim * std::mem::size_of::<T>())
        .ok_or_else(|| format!("an entry of {tokens} tokens overflows the buffer sizes"))?;
    let mut out = Vec::new();
    for (i, m) in c.mixers.iter().enumerate() {
        if matches!(m, MixerKind::Lightning) {
            out.push((4 * hv, false));
            out.push((4 * hv * dk * dv, false));
        } else if m.is_linear() {
            out.push((4 * hv * dk * dk, false));
            out.push((4 * hv * dk * dv, false));
            out.push((4 * conv_len, false));
        } else if matches!(m, MixerKind::Attention) {
            out.push((kv_bytes, true));
            out.push((kv_bytes, true));
        } else {
            return Err(format!("layer {i}: mixer {m:?} has no GPU entry"));
        }
    }
    Ok(out)
}

/// The combiner's side (rank 0): see the module docs.
pub struct NcclReceiver<T: Elem> {
    gpu: Arc<Gpu>,
    config: ModelConfig,
    _t: PhantomData<T>,
}

impl<T: Elem> NcclReceiver<T> {
    /// Receives into `gpu` entries of the model `config` in element type `T`.
    pub fn new(gpu: Arc<Gpu>, config: ModelConfig) -> Self {
        NcclReceiver {
            gpu,
            config,
            _t: PhantomData,
        }
    }
}

impl<T: Elem + NcclType> NcclLink for NcclReceiver<T> {
    fn offer(&self) -> Result<(NcclOffer, Box<dyn NcclSession>), String> {
        let id = new_id()?;
        let offer = NcclOffer::new(&id_bytes(&id));
        Ok((
            offer,
            Box::new(RecvSession::<T> {
                gpu: self.gpu.clone(),
                config: self.config.clone(),
                id: Some(id),
                comm: None,
                _t: PhantomData,
            }),
        ))
    }
}

struct RecvSession<T: Elem> {
    gpu: Arc<Gpu>,
    config: ModelConfig,
    id: Option<Id>,
    comm: Option<OneComm>,
    _t: PhantomData<T>,
}

impl<T: Elem + NcclType> RecvSession<T> {
    fn recv<U: Elem + NcclType>(
        &self,
        comm: &Comm,
        bytes: usize,
    ) -> Result<super::CudaSlice<U>, String> {
        let n = bytes / std::mem::size_of::<U>();
        let mut b = self.gpu.zeros::<U>(n).map_err(|e| e.to_string())?;
        if n > 0 {
            comm.recv(&mut b.slice_mut(..n), 0)
                .map_err(|e| nccl_err("ncclRecv", e))?;
        }
        Ok(b)
    }
}

impl<T: Elem + NcclType> NcclSession for RecvSession<T> {
    fn connect(&mut self) -> Result<(), String> {
        let id = self.id.take().ok_or("the communicator was joined before")?;
        self.comm = Some(join(&self.gpu, 0, id)?);
        Ok(())
    }

    fn receive(&mut self, h: &EntryHeader) -> Result<Box<dyn DeviceEntry>, String> {
        let comm = &self.comm.as_ref().ok_or("no communicator")?.0;
        let c = &self.config;
        let want = layout::<T>(c, h.tokens, h.body_start)?;
        let got: Vec<usize> = h.buffers.iter().map(|&b| b as usize).collect();
        if got != want.iter().map(|w| w.0).collect::<Vec<_>>() {
            return Err(format!(
                "buffers of {got:?} bytes announced, the model's entry of {} tokens (body from {}) has {:?}",
                h.tokens,
                h.body_start,
                want.iter().map(|w| w.0).collect::<Vec<_>>()
            ));
        }
        let model = ModelFingerprint::from_hex(&h.model).map_err(|e| e.to_string())?;
        let (hv, dk, dv) = (c.linear_v_heads, c.linear_k_dim, c.linear_v_dim);
        let row = c.num_kv_heads * c.head_dim;
        let mut sizes = got.into_iter();
        let mut next = || sizes.next().ok_or_else(|| "too few buffers".to_string());
        let mut layers = Vec::with_capacity(c.mixers.len());
        for m in &c.mixers {
            if matches!(m, MixerKind::Lightning) {
                let t = self.recv::<f32>(comm, next()?)?;
                let b = self.recv::<f32>(comm, next()?)?;
                layers.push(GpuEntryLayer::Lightning {
                    pair: ScalarPair {
                        h: hv,
                        dk,
                        dv,
                        t,
                        b,
                    },
                });
            } else if m.is_linear() {
                let t = self.recv::<f32>(comm, next()?)?;
                let b = self.recv::<f32>(comm, next()?)?;
                let conv_bytes = next()?;
                let conv_tail = self.recv::<f32>(comm, conv_bytes)?;
                layers.push(GpuEntryLayer::Linear {
                    pair: DensePair { hv, dk, dv, t, b },
                    conv_tail,
                    conv_len: conv_bytes / 4,
                });
            } else {
                let k = self.recv::<T>(comm, next()?)?;
                let v = self.recv::<T>(comm, next()?)?;
                layers.push(GpuEntryLayer::Full {
                    k,
                    v,
                    rows: h.tokens - h.body_start,
                    row,
                });
            }
        }
        self.gpu.sync().map_err(|e| e.to_string())?;
        let entry = GpuSegmentEntry::from_parts(self.gpu.clone(), h.body_start, h.tokens, layers);
        Ok(Box::new(PeerEntry::new(entry, h.checksum, model)))
    }
}

/// The worker's side (rank 1): see the module docs.
pub struct NcclSender<T: Elem> {
    gpu: Arc<Gpu>,
    model: ModelFingerprint,
    _t: PhantomData<T>,
}

impl<T: Elem> NcclSender<T> {
    /// Sends entries built on `gpu` by a worker of model `model`.
    pub fn new(gpu: Arc<Gpu>, model: ModelFingerprint) -> Self {
        NcclSender {
            gpu,
            model,
            _t: PhantomData,
        }
    }
}

impl<T: Elem + NcclType> NcclJoin<GpuBackend<T>> for NcclSender<T>
where
    CudaBlas: Gemm<T>,
{
    fn prepare(&self, offer: &NcclOffer) -> Result<Box<dyn NcclJoiner<GpuBackend<T>>>, String> {
        if !nccl_present() {
            return Err("libnccl could not be loaded on the worker".into());
        }
        let id = offer.id_bytes()?;
        Ok(Box::new(Joiner::<T> {
            gpu: self.gpu.clone(),
            model: self.model,
            id: Mutex::new(Some(id)),
            comm: Mutex::new(None),
            _t: PhantomData,
        }))
    }
}

struct Joiner<T: Elem> {
    gpu: Arc<Gpu>,
    model: ModelFingerprint,
    id: Mutex<Option<[u8; ID_BYTES]>>,
    comm: Mutex<Option<OneComm>>,
    _t: PhantomData<T>,
}

/// An entry of the worker's pool packed for sending, with its checksum.
struct Outgoing<T: Elem> {
    entry: Arc<GpuSegmentEntry<T>>,
    checksum: u64,
    model: ModelFingerprint,
}

impl<T: Elem> std::fmt::Debug for Outgoing<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outgoing")
            .field("len", &self.entry.len)
            .field("body_start", &self.entry.body_start)
            .finish()
    }
}

impl<T: Elem> DeviceEntry for Outgoing<T> {
    fn model(&self) -> ModelFingerprint {
        self.model
    }
    fn tokens(&self) -> usize {
        self.entry.len
    }
    fn body_start(&self) -> usize {
        self.entry.body_start
    }
    fn bytes(&self) -> usize {
        self.entry.bytes()
    }
    fn verify(&self) -> std::result::Result<(), String> {
        match entry_checksum(&self.entry) {
            Ok(x) if x == self.checksum => Ok(()),
            Ok(x) => Err(format!(
                "checksum {x:016x}, packed as {:016x}",
                self.checksum
            )),
            Err(e) => Err(e.to_string()),
        }
    }
    fn damage(&mut self) -> bool {
        false
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        Box::new(self.entry)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn lock<X>(m: &Mutex<X>) -> std::sync::MutexGuard<'_, X> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<T: Elem> Joiner<T> {
    fn outgoing<'a>(&self, entries: &'a [Shipped]) -> Result<Vec<&'a Outgoing<T>>, String> {
        entries
            .iter()
            .map(|s| match s {
                Shipped::Device(d) => d
                    .as_any()
                    .downcast_ref::<Outgoing<T>>()
                    .ok_or_else(|| "an entry this sender did not pack".to_string()),
                Shipped::Frame(_) => Err("a wire frame, not a device entry".to_string()),
            })
            .collect()
    }
}

impl<T: Elem + NcclType> NcclJoiner<GpuBackend<T>> for Joiner<T>
where
    CudaBlas: Gemm<T>,
{
    fn connect(&self) -> Result<(), String> {
        let id = lock(&self.id)
            .take()
            .ok_or("the communicator was joined before")?;
        let c = join(&self.gpu, 1, Id::uninit(id.map(|b| b as std::ffi::c_char)))?;
        *lock(&self.comm) = Some(c);
        Ok(())
    }

    fn pack(&self, entries: &[Arc<GpuSegmentEntry<T>>]) -> Packed {
        let t = Instant::now();
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            let checksum = entry_checksum(e).map_err(|x| format!("checksum on the worker: {x}"))?;
            out.push(Shipped::Device(Box::new(Outgoing {
                entry: e.clone(),
                checksum,
                model: self.model,
            })));
        }
        Ok((out, t.elapsed().as_secs_f64() * 1e3))
    }

    fn headers(&self, entries: &[Shipped]) -> Result<Vec<EntryHeader>, String> {
        Ok(self
            .outgoing(entries)?
            .into_iter()
            .map(|o| EntryHeader {
                model: o.model.hex(),
                tokens: o.entry.len,
                body_start: o.entry.body_start,
                checksum: o.checksum,
                buffers: o
                    .entry
                    .buffers()
                    .iter()
                    .map(|b| match b {
                        EntryBuffer::F32(v) => (v.len() * 4) as u64,
                        EntryBuffer::Elem(v) => (v.len() * std::mem::size_of::<T>()) as u64,
                    })
                    .collect(),
            })
            .collect())
    }

    fn send(&self, entries: &[Shipped]) -> Result<(), String> {
        let out = self.outgoing(entries)?;
        let guard = lock(&self.comm);
        let comm = &guard.as_ref().ok_or("no communicator")?.0;
        for o in out {
            for b in o.entry.buffers() {
                match b {
                    EntryBuffer::F32(v) if !v.is_empty() => comm.send(&v, 0),
                    EntryBuffer::Elem(v) if !v.is_empty() => comm.send(&v, 0),
                    _ => Ok(()),
                }
                .map_err(|e| nccl_err("ncclSend", e))?;
            }
        }
        self.gpu.sync().map_err(|e| e.to_string())
    }
}
