//! The same-process GPU transport of segment parallelism
//! (docs/segment-parallelism.md): a worker with its own model replica on one GPU of
//! the serving process ships each entry it builds to the combiner's GPU device to
//! device, never through host bytes.
//!
//! Per entry, on the worker's thread (under its backend's serialising guard):
//!
//! 1. the sender's checksum ([`entry_checksum`]) is computed on the worker's device
//!    by the kernel `hash_word_sum` (`kernels/hash.cu`; CPU reference and definition
//!    in [`crate::parallel::checksum`]);
//! 2. the entry is copied into the combiner's device memory
//!    ([`GpuSegmentEntry::copy_to`]: a device-to-device copy on the same GPU,
//!    `cuMemcpyPeerAsync` between GPUs, direct where peer access could be enabled
//!    ([`enable_peer_access`]), else staged through host memory by the driver);
//! 3. the copy travels as a [`Shipped::Device`] ([`PeerEntry`]) with the sender's
//!    checksum. The combiner's scatter recomputes the checksum on its own device
//!    ([`DeviceEntry::verify`]) where it checks a wire frame's: a mismatch is a
//!    corrupt entry (counted, the segment moved on or recomputed), never composed.
//!
//! [`peer_transport`] builds the transport (an [`InProcess`] with this packer, so
//! fault injection and cancellation are those of the in-process transport).
use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

use cudarc::cublas::{CudaBlas, Gemm};
use cudarc::driver::{CudaView, DeviceRepr, LaunchConfig, PushKernelArg};

use super::compile::HASH;
use super::pic::{EntryBuffer, GpuBackend, GpuSegmentEntry};
use super::{CudaError, Elem, Gpu, Result};
use crate::parallel::checksum;
use crate::parallel::transport::{InProcess, Packer, SegmentTask};
use crate::parallel::wire::ModelFingerprint;
use crate::parallel::worker::{Packed, Worker};
use crate::parallel::{DeviceEntry, Shipped};

/// How entries reach the combiner's device from a worker's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerPath {
    /// Both on one device: device-to-device copies.
    SameDevice,
    /// Different devices with peer access enabled: direct copies (NVLink or PCIe).
    Direct,
    /// Different devices without peer access: the driver stages each copy
    /// through host memory.
    Staged,
}

impl PeerPath {
    /// Short name for logs.
    pub fn describe(&self) -> &'static str {
        match self {
            PeerPath::SameDevice => "same device",
            PeerPath::Direct => "peer access",
            PeerPath::Staged => "staged through host memory",
        }
    }
}

/// Enables `dst`'s context to access `src`'s memory where the devices allow it
/// (`cuDeviceCanAccessPeer`, `cuCtxEnablePeerAccess`; already enabled counts as
/// enabled) and says which path copies from `src` to `dst` take.
///
/// Errors: a driver failure other than "already enabled" or "not supported".
pub fn enable_peer_access(src: &Gpu, dst: &Gpu) -> Result<PeerPath> {
    use cudarc::driver::sys;
    let (s, d) = (src.context(), dst.context());
    if s.cu_device() == d.cu_device() {
        return Ok(PeerPath::SameDevice);
    }
    let mut can = 0i32;
    // SAFETY: plain driver queries on two valid devices; `can` outlives the call.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, d.cu_device(), s.cu_device()) }.result()?;
    if can == 0 {
        return Ok(PeerPath::Staged);
    }
    d.bind_to_thread()?;
    // SAFETY: `dst`'s context is current on this thread; `src`'s context is live
    // (held by `src`) for the call.
    let r = unsafe { sys::cuCtxEnablePeerAccess(s.cu_ctx(), 0) };
    match r {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            Ok(PeerPath::Direct)
        }
        sys::CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
        | sys::CUresult::CUDA_ERROR_TOO_MANY_PEERS => Ok(PeerPath::Staged),
        e => Err(CudaError::Driver(format!("cuCtxEnablePeerAccess: {e:?}"))),
    }
}

/// Adds the word sum of `buf` under `seed` ([`checksum::word_sum`]) into `out[0]`
/// on `gpu`'s stream (`out` zeroed before).
fn word_sum_into<U: DeviceRepr>(
    gpu: &Gpu,
    buf: &CudaView<'_, U>,
    seed: u64,
    out: &mut cudarc::driver::CudaViewMut<'_, u64>,
) -> Result<()> {
    let n = buf.len() * std::mem::size_of::<U>();
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(&HASH, "hash_word_sum", 0)?;
    let block = 256u32;
    let cfg = LaunchConfig {
        grid_dim: (super::grid_for(n.div_ceil(4), block).min(1024), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    let (nn, s) = (n as u64, seed);
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(buf).arg(&nn).arg(&s).arg(out);
    // SAFETY: matches `hash_word_sum` in hash.cu: `buf` holds `n` bytes, `out` one
    // u64; block size a multiple of 32 and at most 1024.
    unsafe { l.launch(cfg) }?;
    Ok(())
}

/// The [`checksum::buffer_hash`] of each of `bufs` (buffer `j` with seed `j`),
/// computed on `gpu`: one kernel per buffer, one download.
///
/// Errors: driver failures.
pub fn buffer_hashes<T: Elem>(gpu: &Gpu, bufs: &[EntryBuffer<'_, T>]) -> Result<Vec<(usize, u64)>> {
    if bufs.is_empty() {
        return Ok(vec![]);
    }
    let mut sums: cudarc::driver::CudaSlice<u64> = gpu.zeros(bufs.len())?;
    let mut lens = Vec::with_capacity(bufs.len());
    for (j, b) in bufs.iter().enumerate() {
        let mut slot = sums.slice_mut(j..j + 1);
        match b {
            EntryBuffer::F32(v) => {
                lens.push(v.len() * 4);
                word_sum_into(gpu, v, j as u64, &mut slot)?;
            }
            EntryBuffer::Elem(v) => {
                lens.push(v.len() * std::mem::size_of::<T>());
                word_sum_into(gpu, v, j as u64, &mut slot)?;
            }
        }
    }
    let sums = gpu.download(&sums)?;
    Ok(lens
        .into_iter()
        .zip(sums)
        .map(|(n, s)| (n, checksum::finish(s, n)))
        .collect())
}

/// The checksum of `e` ([`checksum::entry_checksum`] of its buffers in
/// [`GpuSegmentEntry::buffers`] order), computed on the device that holds it.
///
/// Errors: driver failures.
pub fn entry_checksum<T: Elem>(e: &GpuSegmentEntry<T>) -> Result<u64> {
    let parts = buffer_hashes(e.gpu(), &e.buffers())?;
    Ok(checksum::combine(e.len, e.body_start, &parts))
}

/// The checksum of an arbitrary byte buffer on `gpu` ([`checksum::buffer_hash`]
/// with `seed`; uploads it first). For the tests of the kernel against the CPU
/// reference.
///
/// Errors: driver failures.
pub fn bytes_hash(gpu: &Gpu, bytes: &[u8], seed: u64) -> Result<u64> {
    let buf = gpu.upload(if bytes.is_empty() { &[0u8][..] } else { bytes })?;
    let mut sum: cudarc::driver::CudaSlice<u64> = gpu.zeros(1)?;
    word_sum_into(
        gpu,
        &buf.slice(..bytes.len()),
        seed,
        &mut sum.slice_mut(0..1),
    )?;
    let s = gpu.download(&sum)?;
    Ok(checksum::finish(s[0], bytes.len()))
}

/// An entry copied into the combiner's device memory, with the checksum its sender
/// computed before the copy (see the module docs).
pub struct PeerEntry<T: Elem> {
    entry: GpuSegmentEntry<T>,
    sent: u64,
    model: ModelFingerprint,
}

impl<T: Elem> std::fmt::Debug for PeerEntry<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerEntry")
            .field("len", &self.entry.len)
            .field("body_start", &self.entry.body_start)
            .field("bytes", &self.entry.bytes())
            .field("checksum", &format_args!("{:016x}", self.sent))
            .finish()
    }
}

impl<T: Elem> DeviceEntry for PeerEntry<T> {
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
        let got = entry_checksum(&self.entry).map_err(|e| e.to_string())?;
        if got != self.sent {
            return Err(format!(
                "device entry checksum {got:016x} after the copy, the sender computed {:016x}",
                self.sent
            ));
        }
        Ok(())
    }
    fn damage(&mut self) -> bool {
        self.entry.damage().unwrap_or(false)
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        Box::new(self.entry)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl<T: Elem> PeerEntry<T> {
    /// An entry received into this device, with the checksum its sender computed
    /// and the sender's model.
    pub(crate) fn new(entry: GpuSegmentEntry<T>, sent: u64, model: ModelFingerprint) -> Self {
        PeerEntry { entry, sent, model }
    }
}

/// Checksums `entries` on their (the worker's) device, copies them to `dst` and
/// packs them with the sender's checksums; the time of it all, ms.
fn pack<T: Elem>(
    dst: &Arc<Gpu>,
    model: ModelFingerprint,
    entries: &[Arc<GpuSegmentEntry<T>>],
) -> Packed {
    let t = Instant::now();
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        let sent = entry_checksum(e).map_err(|x| format!("checksum on the worker: {x}"))?;
        let entry = e
            .copy_to(dst)
            .map_err(|x| format!("copy to the combiner's device: {x}"))?;
        out.push(Shipped::Device(Box::new(PeerEntry { entry, sent, model })));
    }
    Ok((out, t.elapsed().as_secs_f64() * 1e3))
}

/// A transport to `worker` (a replica on any GPU of this process) that ships its
/// entries to the combiner's device `dst` as [`PeerEntry`]s (kind `peer`), and the
/// copy path it takes. Peer access is enabled here when the devices differ and
/// allow it.
///
/// Errors: enabling peer access fails with a driver error.
pub fn peer_transport<T: Elem>(
    worker: Arc<Worker<GpuBackend<T>>>,
    name: &str,
    dst: Arc<Gpu>,
) -> Result<(InProcess<GpuBackend<T>>, PeerPath)>
where
    CudaBlas: Gemm<T>,
{
    let src = worker.engine().model().gpu().clone();
    let path = enable_peer_access(&src, &dst)?;
    let model = worker.engine().model_fingerprint();
    let packer: Arc<Packer<GpuBackend<T>>> = Arc::new(
        move |_seg: &SegmentTask, entries: &[Arc<GpuSegmentEntry<T>>]| pack(&dst, model, entries),
    );
    Ok((InProcess::with_packer(worker, name, "peer", packer), path))
}
