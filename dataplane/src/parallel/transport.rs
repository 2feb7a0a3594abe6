//! How the combiner talks to a worker: the [`Transport`] trait, an in-process
//! transport ([`InProcess`], a worker in the same process, with fault injection for
//! tests) and a blocking TCP transport ([`Tcp`], a `hypic worker` on another host or
//! port).
//!
//! One request's work on one worker is a [`Task`]: the segments to build, in order.
//! The worker answers with one [`Reply::Entry`] per segment as soon as it is built
//! (or [`Reply::Failed`]), then [`Reply::Done`]. Dropping the [`Replies`] of a task
//! cancels it: the TCP connection closes and the worker stops before its next
//! segment.
//!
//! TCP frames: a `u32` little-endian length `n` (of what follows, at most the
//! receiver's bound), a kind byte, `n − 1` body bytes. Kinds: 1 ping (empty),
//! 2 pong (JSON [`WorkerInfo`]), 3 task (JSON [`Task`]), 4 entry (binary, see
//! [`encode_entry`]), 5 failed (JSON [`Failure`]), 6 done (empty); with NCCL
//! ([`super::nccl`], [`Tcp::with_nccl`]) also 7 NCCL ready (empty), 8 NCCL refused
//! (JSON [`Failure`]), 9 device entry (JSON [`DeviceHeader`], the payload follows by
//! `ncclSend`); with NIXL ([`super::nixl`], [`Tcp::with_reader`]) also 10 NIXL entry
//! (binary, [`super::nixl::encode_remote_entry`]: the entry waits on the worker for
//! the combiner's NIXL READ) and 11 NIXL ack (combiner → worker,
//! [`super::nixl::encode_ack`]). Every read has a deadline; a frame over the bound,
//! a malformed one or a closed connection ends the task with [`TransportError`].
//! Kinds 7–9 occur only when the task carried an [`NcclOffer`], 10 and 11 only when
//! it carried a [`NixlOffer`].
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::nccl::{DeviceHeader, EntryHeader, NcclOffer, MAX_PAYLOAD};
use super::nixl::{self, NixlOffer, RemoteReader};
use super::wire::ModelFingerprint;
use super::worker::{Packed, Worker};
use super::{DeviceEntry, Shipped};
use crate::pic::PicBackend;

/// Default bound of one received frame (an entry of a large model is tens to
/// hundreds of MiB: its pairs `[Hv, dk, dk]` and `[Hv, dk, dv]` per linear layer).
pub const DEFAULT_MAX_FRAME: usize = 1 << 30;
/// Bound of a task frame a worker accepts (token ids and isolation keys only).
pub const MAX_TASK_FRAME: usize = 64 << 20;

/// One segment a worker is asked to build.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentTask {
    /// Index of the segment in its request (echoed in the reply).
    pub index: usize,
    /// Token ids.
    pub tokens: Vec<u32>,
    /// Isolation key (scopes the worker's own pool entry).
    pub isolation: String,
    /// Body starts to build (ascending; one wire frame each in the reply).
    pub roles: Vec<usize>,
}

/// One request's segments for one worker, in build order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Task {
    /// The model the combiner runs (the worker refuses a task for another).
    pub model: String,
    /// Segments, built in this order.
    pub segments: Vec<SegmentTask>,
    /// An NCCL communicator offered for this task's payloads ([`super::nccl`]);
    /// absent: wire frames over TCP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nccl: Option<NcclOffer>,
    /// Set by a combiner that can READ entries by NIXL (absent otherwise; a worker
    /// without NIXL ignores it and ships over TCP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nixl: Option<NixlOffer>,
}

/// What a worker says about itself (the answer to a ping).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// Model fingerprint (hex of [`ModelFingerprint`]).
    pub model: String,
    /// Prefill throughput of an entry build measured at start-up, tokens per second.
    pub tokens_per_s: f64,
    /// Tasks running now.
    pub busy: usize,
}

/// A worker could not build one segment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// Segment index in the request.
    pub index: usize,
    /// Why.
    pub message: String,
}

/// One answer of a worker within a task.
#[derive(Debug)]
pub enum Reply {
    /// The entries of one segment.
    Entry {
        /// Segment index in the request.
        index: usize,
        /// One entry per body start of the task, in its order: wire frames (TCP,
        /// [`InProcess`]) or entries already on the combiner's device (a device
        /// transport).
        entries: Vec<Shipped>,
        /// Time the worker spent building it, ms (0 when served from its pool).
        prefill_ms: f64,
        /// Served from the worker's pool without a prefill.
        resident: bool,
        /// Time from the frame's first byte to its last on the receiver (TCP), or
        /// of the device copy and its checksum (a device transport), ms; 0 for
        /// [`InProcess`] without a device packer.
        transfer_ms: f64,
    },
    /// One segment failed on the worker.
    Failed(Failure),
    /// Every segment of the task was answered.
    Done,
}

/// Why a transport call failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// Nothing arrived by the deadline (the connection may still be usable).
    #[error("no answer from worker {0} by the deadline")]
    Timeout(String),
    /// The worker is gone (connection refused, reset or closed).
    #[error("worker {worker} unreachable: {message}")]
    Closed {
        /// The worker.
        worker: String,
        /// The OS or protocol error.
        message: String,
    },
    /// The worker sent something that is not a valid frame.
    #[error("worker {worker} sent a bad frame: {message}")]
    Protocol {
        /// The worker.
        worker: String,
        /// What was wrong.
        message: String,
    },
}

/// The answers of one task, in the order they arrive.
pub trait Replies: Send {
    /// The next answer, waiting until `deadline`.
    ///
    /// Errors: [`TransportError::Timeout`] when nothing (complete) arrived by then
    /// (call again later); [`TransportError::Closed`] / [`TransportError::Protocol`]
    /// when the task is lost.
    fn next(&mut self, deadline: Instant) -> Result<Reply, TransportError>;
}

/// A way to reach one worker.
pub trait Transport: Send + Sync {
    /// The worker's name in reports and metrics (its address, or `local:N`).
    fn name(&self) -> String;
    /// How entries travel, in reports and metrics: `tcp`, `in-process` (wire
    /// frames through a channel), `peer` (device-to-device copies between GPUs of
    /// this process).
    fn kind(&self) -> &'static str {
        "tcp"
    }
    /// Asks the worker about itself, waiting at most `timeout`.
    ///
    /// Errors: the worker does not answer in time or is unreachable.
    fn ping(&self, timeout: Duration) -> Result<WorkerInfo, TransportError>;
    /// Sends a task; its answers come through the returned [`Replies`].
    ///
    /// Errors: the worker is unreachable within `timeout`.
    fn start(&self, task: Task, timeout: Duration) -> Result<Box<dyn Replies>, TransportError>;
}

/// Faults an [`InProcess`] transport injects (tests).
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// The worker dies after shipping this many entries (counted over all tasks):
    /// the task's replies end without `Done`, and pings fail until
    /// [`InProcess::revive`].
    pub die_after: Option<usize>,
    /// Flips one payload bit of the segment shipped as number `n` (0-based, over all
    /// tasks): the last byte of its first wire frame, or a bit of its first device
    /// entry after the copy ([`super::DeviceEntry::damage`]).
    pub corrupt: Option<usize>,
    /// Extra time before each entry is shipped.
    pub delay: Duration,
}

/// How an [`InProcess`] transport packs a segment's entries (see
/// [`Worker::run_task_with`]).
pub type Packer<B> = dyn Fn(&SegmentTask, &[Arc<<B as PicBackend>::Entry>]) -> Packed + Send + Sync;

/// A worker in this process, reached through a channel. By default its entries go
/// as wire frames (no copy beyond the encoding, which is kept so that the checksum
/// path is the one of TCP); [`InProcess::with_packer`] ships them otherwise (a
/// device-to-device copy, `cuda::peer`).
pub struct InProcess<B: PicBackend> {
    worker: Arc<Worker<B>>,
    name: String,
    kind: &'static str,
    packer: Option<Arc<Packer<B>>>,
    faults: Arc<Mutex<Faults>>,
    shipped: Arc<AtomicUsize>,
    dead: Arc<AtomicBool>,
}

impl<B: PicBackend> InProcess<B> {
    /// A transport to `worker`, named `name` in reports, shipping wire frames.
    pub fn new(worker: Arc<Worker<B>>, name: &str) -> Self {
        InProcess {
            worker,
            name: name.to_string(),
            kind: "in-process",
            packer: None,
            faults: Arc::default(),
            shipped: Arc::default(),
            dead: Arc::default(),
        }
    }

    /// A transport to `worker` whose entries are packed by `packer` (called on the
    /// worker's thread right after each build), reported as transport `kind`.
    pub fn with_packer(
        worker: Arc<Worker<B>>,
        name: &str,
        kind: &'static str,
        packer: Arc<Packer<B>>,
    ) -> Self {
        InProcess {
            kind,
            packer: Some(packer),
            ..InProcess::new(worker, name)
        }
    }
    /// Sets the faults to inject from now on.
    pub fn set_faults(&self, f: Faults) {
        *self.faults.lock().unwrap_or_else(|p| p.into_inner()) = f;
    }
    /// Brings a worker killed by [`Faults::die_after`] back (faults cleared).
    pub fn revive(&self) {
        self.set_faults(Faults::default());
        self.shipped.store(0, Ordering::Relaxed);
        self.dead.store(false, Ordering::Relaxed);
    }
    /// Entries shipped so far.
    pub fn shipped(&self) -> usize {
        self.shipped.load(Ordering::Relaxed)
    }
}

struct ChannelReplies {
    rx: mpsc::Receiver<Reply>,
    name: String,
    cancel: Arc<AtomicBool>,
}

impl Replies for ChannelReplies {
    fn next(&mut self, deadline: Instant) -> Result<Reply, TransportError> {
        let wait = deadline.saturating_duration_since(Instant::now());
        match self.rx.recv_timeout(wait) {
            Ok(r) => Ok(r),
            Err(mpsc::RecvTimeoutError::Timeout) => Err(TransportError::Timeout(self.name.clone())),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(TransportError::Closed {
                worker: self.name.clone(),
                message: "the worker stopped".into(),
            }),
        }
    }
}

impl Drop for ChannelReplies {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl<B: PicBackend> Transport for InProcess<B> {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn kind(&self) -> &'static str {
        self.kind
    }
    fn ping(&self, _timeout: Duration) -> Result<WorkerInfo, TransportError> {
        if self.dead.load(Ordering::Relaxed) {
            return Err(TransportError::Closed {
                worker: self.name.clone(),
                message: "the worker is dead".into(),
            });
        }
        Ok(self.worker.info())
    }
    fn start(&self, task: Task, _timeout: Duration) -> Result<Box<dyn Replies>, TransportError> {
        if self.dead.load(Ordering::Relaxed) {
            return Err(TransportError::Closed {
                worker: self.name.clone(),
                message: "the worker is dead".into(),
            });
        }
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let (worker, faults, shipped, dead, packer) = (
            self.worker.clone(),
            self.faults.clone(),
            self.shipped.clone(),
            self.dead.clone(),
            self.packer.clone(),
        );
        let stop = cancel.clone();
        let spawned = std::thread::Builder::new()
            .name("hypic-inproc-worker".into())
            .spawn(move || {
                let cancelled = || stop.load(Ordering::Relaxed);
                let mut send = |mut reply: Reply| {
                    let f = faults.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    if let Reply::Entry { entries, .. } = &mut reply {
                        std::thread::sleep(f.delay);
                        let n = shipped.load(Ordering::Relaxed);
                        if f.die_after.is_some_and(|d| n >= d) {
                            dead.store(true, Ordering::Relaxed);
                            return false;
                        }
                        if f.corrupt == Some(n) {
                            match entries.first_mut() {
                                Some(Shipped::Frame(fr)) => {
                                    if let Some(b) = fr.last_mut() {
                                        *b ^= 0x40;
                                    }
                                }
                                Some(Shipped::Device(d)) => {
                                    d.damage();
                                }
                                None => {}
                            }
                        }
                        shipped.fetch_add(1, Ordering::Relaxed);
                    }
                    if dead.load(Ordering::Relaxed) {
                        return false;
                    }
                    tx.send(reply).is_ok()
                };
                match &packer {
                    Some(p) => worker.run_task_with(&task, &cancelled, &**p, &mut send),
                    None => worker.run_task(&task, &cancelled, &mut send),
                }
            });
        spawned.map_err(|e| TransportError::Closed {
            worker: self.name.clone(),
            message: format!("cannot start a thread: {e}"),
        })?;
        Ok(Box::new(ChannelReplies {
            rx,
            name: self.name.clone(),
            cancel,
        }))
    }
}

/// Frame kinds on TCP.
pub(crate) mod kind {
    pub const PING: u8 = 1;
    pub const PONG: u8 = 2;
    pub const TASK: u8 = 3;
    pub const ENTRY: u8 = 4;
    pub const FAILED: u8 = 5;
    pub const DONE: u8 = 6;
    pub const NCCL_READY: u8 = 7;
    pub const NCCL_REFUSED: u8 = 8;
    pub const DEVICE_ENTRY: u8 = 9;
    pub const NIXL_ENTRY: u8 = 10;
    pub const NIXL_ACK: u8 = 11;
}

/// The combiner's side of NCCL ([`super::nccl`]; implemented on the GPU by
/// `cuda::nccl::NcclReceiver`).
pub trait NcclLink: Send + Sync {
    /// A new communicator: the offer to put in a task, and the session that joins
    /// it as rank 0 once the worker accepts.
    ///
    /// Errors: NCCL cannot be used here (no library, no unique id); the task then
    /// goes without an offer.
    fn offer(&self) -> Result<(NcclOffer, Box<dyn NcclSession>), String>;
}

/// One task's communicator on the combiner.
pub trait NcclSession: Send {
    /// Joins the communicator as rank 0 (blocks until the worker joined too).
    ///
    /// Errors: NCCL's initialisation failed.
    fn connect(&mut self) -> Result<(), String>;
    /// Receives the buffers of the entry announced by `h` into this device by
    /// `ncclRecv`, in the order of `h.buffers`.
    ///
    /// Errors: sizes that do not fit the model, NCCL or device failures.
    fn receive(&mut self, h: &EntryHeader) -> Result<Box<dyn DeviceEntry>, String>;
}

/// The worker's side of NCCL for backend `B` (implemented on the GPU by
/// `cuda::nccl::NcclSender`).
pub trait NcclJoin<B: PicBackend>: Send + Sync {
    /// Whether this worker takes the offer: a joiner, or why not (the task then
    /// ships wire frames).
    ///
    /// Errors: the reason for refusing.
    fn prepare(&self, offer: &NcclOffer) -> Result<Box<dyn NcclJoiner<B>>, String>;
}

/// One task's communicator on a worker.
pub trait NcclJoiner<B: PicBackend>: Send + Sync {
    /// Joins the communicator as rank 1 (blocks until the combiner joined too).
    ///
    /// Errors: NCCL's initialisation failed.
    fn connect(&self) -> Result<(), String>;
    /// Packs a built segment's entries (checksums computed on this device) for
    /// [`NcclJoiner::send`]; as a [`Worker::run_task_with`] packer.
    ///
    /// Errors: device failures.
    fn pack(&self, entries: &[Arc<B::Entry>]) -> Packed;
    /// The headers of packed entries.
    ///
    /// Errors: entries this joiner did not pack.
    fn headers(&self, entries: &[Shipped]) -> Result<Vec<EntryHeader>, String>;
    /// Sends the buffers of packed entries by `ncclSend` in header order and waits
    /// until they left.
    ///
    /// Errors: NCCL or device failures.
    fn send(&self, entries: &[Shipped]) -> Result<(), String>;
}

/// Writes one frame (see the module docs).
///
/// Errors: the body is over 4 GiB, or the write fails.
pub fn write_frame(w: &mut impl Write, kind: u8, body: &[u8]) -> std::io::Result<()> {
    let n = u32::try_from(body.len() + 1)
        .map_err(|_| std::io::Error::new(ErrorKind::InvalidInput, "frame over 4 GiB"))?;
    let mut head = [0u8; 5];
    head[..4].copy_from_slice(&n.to_le_bytes());
    head[4] = kind;
    w.write_all(&head)?;
    w.write_all(body)?;
    w.flush()
}

/// Body of an entry frame: `u64` index, `f64` prefill ms, `u8` resident, `u32`
/// frame count, then per frame a `u64` length and the wire frame.
pub fn encode_entry<F: AsRef<[u8]>>(
    index: usize,
    frames: &[F],
    prefill_ms: f64,
    resident: bool,
) -> Vec<u8> {
    let total: usize = frames.iter().map(|f| f.as_ref().len() + 8).sum();
    let mut b = Vec::with_capacity(21 + total);
    b.extend_from_slice(&(index as u64).to_le_bytes());
    b.extend_from_slice(&prefill_ms.to_le_bytes());
    b.push(resident as u8);
    b.extend_from_slice(&(frames.len() as u32).to_le_bytes());
    for f in frames {
        let f = f.as_ref();
        b.extend_from_slice(&(f.len() as u64).to_le_bytes());
        b.extend_from_slice(f);
    }
    b
}

/// An entry frame's body parsed: `(index, wire frames, prefill_ms, resident)`.
pub type EntryBody = (usize, Vec<Vec<u8>>, f64, bool);

/// Parses [`encode_entry`].
///
/// Errors: a length past the end, trailing bytes.
pub fn decode_entry(b: &[u8]) -> Result<EntryBody, String> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8], String> {
        let end = at
            .checked_add(n)
            .filter(|&e| e <= b.len())
            .ok_or_else(|| format!("entry frame truncated at byte {at}"))?;
        let s = &b[at..end];
        at = end;
        Ok(s)
    };
    let u64_of = |s: &[u8]| {
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        u64::from_le_bytes(a)
    };
    let index = usize::try_from(u64_of(take(8)?)).map_err(|_| "index too large".to_string())?;
    let prefill_ms = f64::from_bits(u64_of(take(8)?));
    let resident = take(1)?[0] != 0;
    let mut c = [0u8; 4];
    c.copy_from_slice(take(4)?);
    let count = u32::from_le_bytes(c) as usize;
    if count > b.len() {
        return Err(format!("{count} frames in a {}-byte body", b.len()));
    }
    let mut frames = Vec::with_capacity(count);
    for _ in 0..count {
        let n = usize::try_from(u64_of(take(8)?)).map_err(|_| "length too large".to_string())?;
        frames.push(take(n)?.to_vec());
    }
    if at != b.len() {
        return Err(format!("{} trailing bytes", b.len() - at));
    }
    Ok((index, frames, prefill_ms, resident))
}

/// An incremental frame reader over a stream with read timeouts: a read that times
/// out keeps what arrived, so a frame may come in over several calls.
pub(crate) struct FrameReader {
    buf: Vec<u8>,
    max: usize,
    /// When the current frame's first byte arrived.
    started: Option<Instant>,
}

impl FrameReader {
    pub(crate) fn new(max: usize) -> Self {
        FrameReader {
            buf: Vec::new(),
            max,
            started: None,
        }
    }

    /// The next complete frame `(kind, body, receive time)` by `deadline`;
    /// `Ok(None)` on timeout.
    ///
    /// Errors: the peer closed, an I/O error, a frame length over the bound or 0.
    pub(crate) fn next(
        &mut self,
        s: &mut TcpStream,
        deadline: Instant,
    ) -> std::io::Result<Option<(u8, Vec<u8>, Duration)>> {
        let mut chunk = vec![0u8; 1 << 16];
        loop {
            if self.buf.len() >= 4 {
                let n = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]])
                    as usize;
                if n == 0 || n > self.max.saturating_add(1) {
                    return Err(std::io::Error::new(
                        ErrorKind::InvalidData,
                        format!("frame of {n} bytes, the bound is {}", self.max),
                    ));
                }
                if self.buf.len() >= 4 + n {
                    let rest = self.buf.split_off(4 + n);
                    let frame = std::mem::replace(&mut self.buf, rest);
                    let took = self.started.take().map(|t| t.elapsed()).unwrap_or_default();
                    if !self.buf.is_empty() {
                        self.started = Some(Instant::now());
                    }
                    return Ok(Some((frame[4], frame[5..].to_vec(), took)));
                }
                // Read the rest of a large frame in one go where possible.
                if chunk.len() < 4 + n - self.buf.len() {
                    chunk.resize((4 + n - self.buf.len()).min(16 << 20), 0);
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let wait = (deadline - now).max(Duration::from_millis(1));
            s.set_read_timeout(Some(wait))?;
            match s.read(&mut chunk) {
                Ok(0) => {
                    return Err(std::io::Error::new(
                        ErrorKind::UnexpectedEof,
                        "connection closed",
                    ))
                }
                Ok(k) => {
                    if self.buf.is_empty() {
                        self.started = Some(Instant::now());
                    }
                    self.buf.extend_from_slice(&chunk[..k]);
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Ok(None)
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// A `hypic worker` reached over TCP; one connection per task (and per ping).
/// With a [`RemoteReader`] ([`Tcp::with_reader`]) each task offers NIXL and entries
/// the worker registered are READ instead of streamed (see [`super::nixl`]).
pub struct Tcp {
    addr: String,
    max_frame: usize,
    nccl: Option<Arc<dyn NcclLink>>,
    /// The NCCL fallback was logged (once per transport).
    fallback_logged: AtomicBool,
    /// A communicator failed to initialise with this worker: no more offers (an
    /// initialisation that timed out leaves a thread blocked in NCCL; another
    /// offer would leave one more).
    nccl_off: AtomicBool,
    /// A task of this combiner uses an NCCL communicator with this worker (which
    /// runs one at a time): further tasks go without an offer meanwhile, since a
    /// refused offer leaves NCCL's bootstrap of its unique id waiting.
    nccl_in_flight: Arc<AtomicBool>,
    nixl: Option<Arc<NixlState>>,
}

/// Marks [`Tcp::nccl_in_flight`] until dropped.
struct NcclInFlight(Arc<AtomicBool>);
impl Drop for NcclInFlight {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// A combiner's NIXL reader for one worker, and what was logged about it.
struct NixlState {
    reader: Arc<dyn RemoteReader>,
    /// A READ from this worker failed: no more offers (TCP from now on).
    off: AtomicBool,
    /// "ships over TCP" was logged for this worker.
    told_tcp: AtomicBool,
}

impl Tcp {
    /// A transport to the worker at `addr` (`host:port`) that accepts frames of up
    /// to `max_frame` bytes ([`DEFAULT_MAX_FRAME`] is a sensible bound).
    pub fn new(addr: &str, max_frame: usize) -> Self {
        Tcp {
            addr: addr.to_string(),
            max_frame,
            nccl: None,
            fallback_logged: AtomicBool::new(false),
            nccl_off: AtomicBool::new(false),
            nccl_in_flight: Arc::new(AtomicBool::new(false)),
            nixl: None,
        }
    }

    /// As [`Tcp::new`], offering NIXL READs through `reader` in every task until a
    /// READ from this worker fails (then TCP, logged once). A READ is bounded by
    /// `max_frame` bytes per entry as a TCP frame is.
    pub fn with_reader(addr: &str, max_frame: usize, reader: Arc<dyn RemoteReader>) -> Self {
        let mut t = Tcp::new(addr, max_frame);
        t.nixl = Some(Arc::new(NixlState {
            reader,
            off: AtomicBool::new(false),
            told_tcp: AtomicBool::new(false),
        }));
        t
    }

    /// Whether the next task offers NIXL (a reader is set and no READ failed).
    pub fn offers_nixl(&self) -> bool {
        self.nixl
            .as_ref()
            .is_some_and(|n| !n.off.load(Ordering::Relaxed))
    }

    /// Offers every task an NCCL communicator through `link` ([`super::nccl`]):
    /// payloads then move device to device, headers and checksums over TCP. A
    /// worker that refuses, or an offer that cannot be made, falls back to wire
    /// frames over TCP (said once on stderr). Kind `nccl`.
    pub fn with_nccl(mut self, link: Arc<dyn NcclLink>) -> Self {
        self.nccl = Some(link);
        self
    }

    fn fallback(&self, why: &str) {
        if !self.fallback_logged.swap(true, Ordering::Relaxed) {
            eprintln!(
                "hypic: worker {}: NCCL not used ({why}); entries go over TCP",
                self.addr
            );
        }
    }

    fn closed(&self, e: impl std::fmt::Display) -> TransportError {
        TransportError::Closed {
            worker: self.addr.clone(),
            message: e.to_string(),
        }
    }

    fn connect(&self, timeout: Duration) -> Result<TcpStream, TransportError> {
        let addrs: Vec<SocketAddr> = self
            .addr
            .to_socket_addrs()
            .map_err(|e| self.closed(e))?
            .collect();
        let mut last = None;
        for a in addrs {
            match TcpStream::connect_timeout(&a, timeout.max(Duration::from_millis(1))) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    s.set_write_timeout(Some(timeout.max(Duration::from_millis(1))))
                        .map_err(|e| self.closed(e))?;
                    return Ok(s);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(self.closed(
            last.map(|e| e.to_string())
                .unwrap_or_else(|| "no address".into()),
        ))
    }
}

struct TcpReplies {
    stream: TcpStream,
    reader: FrameReader,
    name: String,
    /// A frame read ahead (the first answer to an NCCL offer that was not one).
    ahead: Option<(u8, Vec<u8>, Duration)>,
    /// The task's NCCL communicator, when the worker joined it.
    nccl: Option<Box<dyn NcclSession>>,
    /// Held while `nccl` is in use (see [`Tcp::nccl_in_flight`]).
    _nccl_in_flight: Option<NcclInFlight>,
    /// Set when this task offered NIXL.
    nixl: Option<Arc<NixlState>>,
    /// A READ of this task failed: its later entries fail without one.
    nixl_failed: bool,
    max_frame: usize,
}

impl TcpReplies {
    /// READs the entry a worker registered, acknowledges it (so the worker frees
    /// it, whatever the outcome) and answers the entry, or a failed segment when
    /// the READ fails (NIXL is then off for this worker, logged once, and the
    /// task's later entries fail without a READ).
    fn read_remote(
        &mut self,
        st: &NixlState,
        body: &[u8],
        deadline: Instant,
    ) -> Result<Reply, TransportError> {
        let e = nixl::decode_remote_entry(body).map_err(|m| TransportError::Protocol {
            worker: self.name.clone(),
            message: m,
        })?;
        let read = if e.bytes() > self.max_frame as u64 {
            Err(format!(
                "an entry of {} bytes, the bound is {}",
                e.bytes(),
                self.max_frame
            ))
        } else if self.nixl_failed {
            // An earlier READ of this task failed: the rest of it fails at once
            // rather than wait out a timeout per entry.
            Err("an earlier READ of this task failed".to_string())
        } else {
            let t = Instant::now();
            st.reader
                .read(&e, deadline.max(t + nixl::READ_TIMEOUT))
                .map(|frames| (frames, t.elapsed()))
        };
        // The worker holds the buffers until this ack or the connection's end.
        let _ = write_frame(&mut self.stream, kind::NIXL_ACK, &nixl::encode_ack(e.index));
        match read {
            Ok((frames, took)) => Ok(Reply::Entry {
                index: e.index,
                entries: frames.into_iter().map(Shipped::Frame).collect(),
                prefill_ms: e.prefill_ms,
                resident: e.resident,
                transfer_ms: took.as_secs_f64() * 1e3,
            }),
            Err(why) => {
                self.nixl_failed = true;
                if !st.off.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        worker = %self.name,
                        "NIXL READ from worker {} failed ({why}); its entries come over TCP from now on",
                        self.name
                    );
                }
                Ok(Reply::Failed(Failure {
                    index: e.index,
                    message: format!("NIXL READ failed: {why}"),
                }))
            }
        }
    }
}

impl Replies for TcpReplies {
    fn next(&mut self, deadline: Instant) -> Result<Reply, TransportError> {
        let got = match self.ahead.take() {
            Some(f) => Ok(Some(f)),
            None => self.reader.next(&mut self.stream, deadline),
        };
        let closed = |e: std::io::Error| TransportError::Closed {
            worker: self.name.clone(),
            message: e.to_string(),
        };
        let proto = |m: String| TransportError::Protocol {
            worker: self.name.clone(),
            message: m,
        };
        let Some((k, body, took)) = got.map_err(closed)? else {
            return Err(TransportError::Timeout(self.name.clone()));
        };
        match k {
            kind::NIXL_ENTRY => match self.nixl.clone() {
                Some(st) => self.read_remote(&st, &body, deadline),
                None => Err(proto("a NIXL entry for a task that offered no NIXL".into())),
            },
            kind::DEVICE_ENTRY => {
                let Some(session) = self.nccl.as_mut() else {
                    return Err(proto("a device entry without an NCCL communicator".into()));
                };
                let h = DeviceHeader::parse(&body, MAX_PAYLOAD).map_err(proto)?;
                let t = Instant::now();
                let mut entries = Vec::with_capacity(h.entries.len());
                for e in &h.entries {
                    let d = session
                        .receive(e)
                        .map_err(|m| proto(format!("NCCL receive: {m}")))?;
                    entries.push(Shipped::Device(d));
                }
                Ok(Reply::Entry {
                    index: h.index,
                    entries,
                    prefill_ms: h.prefill_ms,
                    resident: h.resident,
                    transfer_ms: (took + t.elapsed()).as_secs_f64() * 1e3,
                })
            }
            kind::ENTRY => {
                if let Some(st) = &self.nixl {
                    if !st.told_tcp.swap(true, Ordering::Relaxed) {
                        tracing::info!(
                            worker = %self.name,
                            "worker {} ships its entries over TCP (no NIXL there)",
                            self.name
                        );
                    }
                }
                let (index, frames, prefill_ms, resident) = decode_entry(&body).map_err(proto)?;
                Ok(Reply::Entry {
                    index,
                    entries: frames.into_iter().map(Shipped::Frame).collect(),
                    prefill_ms,
                    resident,
                    transfer_ms: took.as_secs_f64() * 1e3,
                })
            }
            kind::FAILED => serde_json::from_slice(&body)
                .map(Reply::Failed)
                .map_err(|e| proto(format!("failure frame: {e}"))),
            kind::DONE => Ok(Reply::Done),
            other => Err(proto(format!("unexpected frame kind {other}"))),
        }
    }
}

impl Drop for TcpReplies {
    fn drop(&mut self) {
        // Cancels the task: the worker sees the closed connection.
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

impl Transport for Tcp {
    fn name(&self) -> String {
        self.addr.clone()
    }
    fn kind(&self) -> &'static str {
        if self.nccl.is_some() {
            "nccl"
        } else if self.nixl.is_some() {
            "nixl"
        } else {
            "tcp"
        }
    }
    fn ping(&self, timeout: Duration) -> Result<WorkerInfo, TransportError> {
        let deadline = Instant::now() + timeout;
        let mut s = self.connect(timeout)?;
        write_frame(&mut s, kind::PING, &[]).map_err(|e| self.closed(e))?;
        let mut r = FrameReader::new(1 << 16);
        match r.next(&mut s, deadline).map_err(|e| self.closed(e))? {
            None => Err(TransportError::Timeout(self.addr.clone())),
            Some((kind::PONG, body, _)) => {
                serde_json::from_slice(&body).map_err(|e| TransportError::Protocol {
                    worker: self.addr.clone(),
                    message: format!("pong: {e}"),
                })
            }
            Some((k, _, _)) => Err(TransportError::Protocol {
                worker: self.addr.clone(),
                message: format!("answered a ping with frame kind {k}"),
            }),
        }
    }
    fn start(&self, task: Task, timeout: Duration) -> Result<Box<dyn Replies>, TransportError> {
        let mut task = task;
        let mut session = None;
        let mut in_flight = None;
        if let Some(link) = self.nccl.as_ref().filter(|_| {
            !self.nccl_off.load(Ordering::Relaxed)
                && !self.nccl_in_flight.swap(true, Ordering::AcqRel)
        }) {
            in_flight = Some(NcclInFlight(self.nccl_in_flight.clone()));
            match link.offer() {
                Ok((offer, s)) => {
                    task.nccl = Some(offer);
                    session = Some(s);
                }
                Err(e) => {
                    in_flight = None;
                    self.fallback(&e)
                }
            }
        }
        let mut s = self.connect(timeout)?;
        let nixl = self.nixl.clone().filter(|_| self.offers_nixl());
        task.nixl = nixl.as_ref().map(|n| NixlOffer {
            agent: n.reader.agent(),
        });
        let body = serde_json::to_vec(&task).map_err(|e| self.closed(e))?;
        write_frame(&mut s, kind::TASK, &body).map_err(|e| self.closed(e))?;
        let mut reader = FrameReader::new(self.max_frame);
        let mut ahead = None;
        let mut nccl = None;
        if let Some(mut session) = session {
            // The worker's first answer says whether it joins the communicator.
            // A worker answers an offer before it builds anything.
            let first = reader
                .next(
                    &mut s,
                    Instant::now() + timeout.max(Duration::from_secs(10)),
                )
                .map_err(|e| self.closed(e))?
                .ok_or_else(|| TransportError::Timeout(self.addr.clone()))?;
            match first.0 {
                kind::NCCL_READY => match join_within(&mut session, timeout) {
                    Ok(()) => nccl = Some(session),
                    // The worker's side fails too (NCCL fails on both ranks, e.g.
                    // two ranks on one GPU) and then ships wire frames.
                    Err(m) => {
                        self.nccl_off.store(true, Ordering::Relaxed);
                        self.fallback(&format!(
                            "NCCL initialisation failed: {m}; no more offers to this worker"
                        ))
                    }
                },
                kind::NCCL_REFUSED => {
                    let why = serde_json::from_slice::<Failure>(&first.1)
                        .map(|f| f.message)
                        .unwrap_or_else(|_| "refused".into());
                    self.fallback(&format!("the worker refused: {why}"));
                }
                _ => {
                    self.fallback("the worker does not speak NCCL");
                    ahead = Some(first);
                }
            }
        }
        // The mark stays while the communicator is in use, i.e. with the replies.
        let nccl_in_flight = nccl.as_ref().and(in_flight);
        Ok(Box::new(TcpReplies {
            stream: s,
            reader,
            name: self.addr.clone(),
            ahead,
            nccl,
            _nccl_in_flight: nccl_in_flight,
            nixl,
            nixl_failed: false,
            max_frame: self.max_frame,
        }))
    }
}

/// Joins `session` as rank 0 on a thread of its own, waiting at most `timeout`
/// (NCCL's initialisation has no deadline of its own): on time out the thread is
/// left blocked in NCCL and the task fails.
fn join_within(session: &mut Box<dyn NcclSession>, timeout: Duration) -> Result<(), String> {
    let (tx, rx) = mpsc::channel();
    let s = std::mem::replace(session, Box::new(Joined));
    std::thread::Builder::new()
        .name("hypic-nccl-init".into())
        .spawn(move || {
            let mut s = s;
            let r = s.connect();
            let _ = tx.send((r, s));
        })
        .map_err(|e| format!("cannot start a thread: {e}"))?;
    match rx.recv_timeout(timeout.max(Duration::from_secs(30))) {
        Ok((r, s)) => {
            *session = s;
            r
        }
        Err(_) => Err("communicator initialisation timed out".into()),
    }
}

/// Placeholder while a session joins on another thread.
struct Joined;
impl NcclSession for Joined {
    fn connect(&mut self) -> Result<(), String> {
        Err("the session is joining".into())
    }
    fn receive(&mut self, _: &EntryHeader) -> Result<Box<dyn DeviceEntry>, String> {
        Err("the session is joining".into())
    }
}

/// The fingerprint in a [`WorkerInfo`].
///
/// Errors: not a fingerprint.
pub fn info_model(info: &WorkerInfo) -> Result<ModelFingerprint, String> {
    ModelFingerprint::from_hex(&info.model).map_err(|e| e.to_string())
}
