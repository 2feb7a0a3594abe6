//! A worker: a model replica and its public pool that builds the entries of the
//! segments a combiner gives it, each prefilled alone from position 0, and ships
//! every entry as soon as it is built ([`Worker::run_task`]). `hypic worker --listen
//! ADDR --model DIR` serves one over TCP ([`serve_tcp`]); tests reach one in
//! process ([`super::transport::InProcess`]).
//!
//! Built entries stay in the worker's own public pool (its LRU policy, its byte
//! capacity), so a segment given to the same worker again is shipped without a
//! prefill (the combiner's holder affinity).
//!
//! With a [`RemoteExposer`] ([`serve_tcp_with`]) a worker answers a task that
//! offers NIXL with registered frames for the combiner's READ instead of streaming
//! them ([`super::nixl`]); it frees each segment's frames at the combiner's ack, at
//! the latest when the connection ends.
use std::cell::RefCell;
use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::nccl::DeviceHeader;
use super::nixl::{self, Exposed, RemoteEntry, RemoteExposer, Route};
use super::transport::{
    encode_entry, kind, write_frame, Failure, FrameReader, NcclJoin, NcclJoiner, Reply,
    SegmentTask, Task, WorkerInfo, MAX_TASK_FRAME,
};
use super::wire::{self, ModelFingerprint};
use super::Shipped;
use crate::pic::{Pic, PicBackend};

/// Tokens of the start-up build that measures a worker's throughput.
const PROBE_TOKENS: usize = 64;

/// A worker over an engine (see the module docs).
pub struct Worker<B: PicBackend> {
    engine: Arc<Pic<B>>,
    model: ModelFingerprint,
    tokens_per_s: f64,
    busy: AtomicUsize,
}

impl<B: PicBackend> Worker<B> {
    /// A worker over `engine`; measures its entry-build throughput once with a
    /// short probe segment (not stored).
    pub fn new(engine: Arc<Pic<B>>) -> Self {
        let vocab = engine.pic_backend().config().vocab_size.max(1);
        let probe: Vec<u32> = (0..PROBE_TOKENS)
            .map(|i| ((i * 7919 + 11) % vocab) as u32)
            .collect();
        let t = Instant::now();
        let ok = engine.build_entries(&probe, &[0]).is_ok();
        let s = t.elapsed().as_secs_f64();
        let tokens_per_s = if ok && s > 0.0 {
            PROBE_TOKENS as f64 / s
        } else {
            0.0
        };
        let model = engine.model_fingerprint();
        Worker {
            engine,
            model,
            tokens_per_s,
            busy: AtomicUsize::new(0),
        }
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<Pic<B>> {
        &self.engine
    }

    /// What a ping answers.
    pub fn info(&self) -> WorkerInfo {
        WorkerInfo {
            model: self.model.hex(),
            tokens_per_s: self.tokens_per_s,
            busy: self.busy.load(Ordering::Relaxed),
        }
    }

    /// Builds (or finds in the pool) the entries of `task`'s segments in order and
    /// hands each segment's answer to `send` as soon as it is ready, then
    /// [`Reply::Done`]. Stops early, without `Done`, when `cancelled()` says so
    /// before a segment or `send` returns false (the combiner is gone). A segment
    /// that cannot be built is a [`Reply::Failed`]; a task for another model fails
    /// every segment. Never panics on bad input. Entries ship as wire frames
    /// ([`wire::encode`]).
    pub fn run_task(
        &self,
        task: &Task,
        cancelled: &dyn Fn() -> bool,
        send: &mut dyn FnMut(Reply) -> bool,
    ) {
        let model = self.model;
        let backend = self.engine.pic_backend();
        let frames = move |seg: &SegmentTask, entries: &[Arc<B::Entry>]| -> Packed {
            let f: Vec<Shipped> = backend.decoding(|| {
                entries
                    .iter()
                    .map(|e| Shipped::Frame(wire::encode(&**e, seg.tokens.len(), model)))
                    .collect()
            });
            Ok((f, 0.0))
        };
        self.run_task_with(task, cancelled, &frames, send)
    }

    /// [`Worker::run_task`] with the entries of each segment packed for shipping by
    /// `pack` (called under the backend's [`PicBackend::exclusive`] guard, right
    /// after the build): it returns one [`Shipped`] per body start of the segment,
    /// in order, and the transfer time it spent, ms; an `Err(message)` fails that
    /// segment ([`Reply::Failed`]). A device transport packs by copying each entry
    /// to the combiner's device (`cuda::peer`).
    pub fn run_task_with(
        &self,
        task: &Task,
        cancelled: &dyn Fn() -> bool,
        pack: &Pack<'_, B>,
        send: &mut dyn FnMut(Reply) -> bool,
    ) {
        self.busy.fetch_add(1, Ordering::Relaxed);
        let _busy = Busy(&self.busy);
        let mine = self.model.hex();
        for seg in &task.segments {
            if cancelled() {
                return;
            }
            let reply = if task.model != mine {
                Reply::Failed(Failure {
                    index: seg.index,
                    message: format!("task for model {}, this worker runs {mine}", task.model),
                })
            } else {
                let t = Instant::now();
                // One task at a time on a backend that serialises its device work
                // (the GPU: one stream, shared workspaces); the CPU builds in
                // parallel. The entries are packed under the same guard.
                let backend = self.engine.pic_backend();
                let _serial = backend.exclusive();
                match self
                    .engine
                    .entries_for(&seg.tokens, &seg.isolation, &seg.roles)
                {
                    Ok((entries, resident)) => {
                        let prefill_ms = if resident {
                            0.0
                        } else {
                            t.elapsed().as_secs_f64() * 1e3
                        };
                        match pack(seg, &entries) {
                            Ok((entries, transfer_ms)) => Reply::Entry {
                                index: seg.index,
                                entries,
                                prefill_ms,
                                resident,
                                transfer_ms,
                            },
                            Err(message) => Reply::Failed(Failure {
                                index: seg.index,
                                message,
                            }),
                        }
                    }
                    Err(e) => Reply::Failed(Failure {
                        index: seg.index,
                        message: e.to_string(),
                    }),
                }
            };
            if !send(reply) {
                return;
            }
        }
        send(Reply::Done);
    }
}

/// What [`Worker::run_task_with`]'s packer returns: one shipped entry per body
/// start and the transfer time, ms; or why the segment cannot be shipped.
pub type Packed = Result<(Vec<Shipped>, f64), String>;

/// A packer of [`Worker::run_task_with`]: a segment's task and its built entries →
/// [`Packed`].
pub type Pack<'a, B> = dyn Fn(&SegmentTask, &[Arc<<B as PicBackend>::Entry>]) -> Packed + 'a;

struct Busy<'a>(&'a AtomicUsize);
impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How long a worker waits for the first frame of a new connection.
const IDLE: Duration = Duration::from_secs(30);

/// How long a worker waits for an NCCL communicator to initialise (NCCL's own
/// initialisation has no deadline); past it the task ships wire frames.
const NCCL_JOIN: Duration = Duration::from_secs(30);

/// The one NCCL task a worker runs at a time (one communicator, one device): held
/// by the task and by a join still blocked in NCCL, freed when both are gone.
struct NcclSlot(Arc<AtomicBool>);
impl NcclSlot {
    /// The slot, or `None` while another task holds it.
    fn take(flag: &Arc<AtomicBool>) -> Option<Arc<NcclSlot>> {
        (!flag.swap(true, Ordering::AcqRel)).then(|| Arc::new(NcclSlot(flag.clone())))
    }
}
impl Drop for NcclSlot {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Joins `j`'s communicator on a thread of its own, waiting at most [`NCCL_JOIN`]; a
/// join that times out keeps `slot` until NCCL returns.
fn join_nccl<B: PicBackend>(j: Arc<dyn NcclJoiner<B>>, slot: Arc<NcclSlot>) -> Result<(), String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("hypic-nccl-join".into())
        .spawn(move || {
            let r = j.connect();
            // Free the slot before the result is seen: a task that goes on (or falls
            // back to TCP) and finishes must find it free for the next offer.
            drop(slot);
            let _ = tx.send(r);
        })
        .map_err(|e| format!("cannot start a thread: {e}"))?;
    rx.recv_timeout(NCCL_JOIN)
        .unwrap_or_else(|_| Err(format!("no communicator within {} s", NCCL_JOIN.as_secs())))
}

/// Whether the peer of `s` closed the connection (a non-blocking peek).
fn peer_closed(s: &TcpStream) -> bool {
    if s.set_nonblocking(true).is_err() {
        return true;
    }
    let mut b = [0u8; 1];
    let closed = match s.peek(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    let _ = s.set_nonblocking(false);
    closed
}

/// Writes one answer of a task as TCP frames: an entry (wire frames, or with an
/// NCCL joiner a device-entry header then the buffers by `ncclSend`), a failure or
/// done. False when the connection or NCCL failed.
fn write_reply<B: PicBackend>(
    out: &TcpStream,
    reply: &Reply,
    nccl: Option<&dyn NcclJoiner<B>>,
    held: Option<(&dyn RemoteExposer, &RefCell<Held>)>,
) -> bool {
    let mut w = out;
    let sent = match reply {
        Reply::Entry {
            index,
            entries,
            prefill_ms,
            resident,
            ..
        } => match nccl {
            Some(j) => {
                let header = j.headers(entries).map(|entries| DeviceHeader {
                    index: *index,
                    prefill_ms: *prefill_ms,
                    resident: *resident,
                    entries,
                });
                match header.and_then(|h| serde_json::to_vec(&h).map_err(|e| e.to_string())) {
                    Ok(b) => write_frame(&mut w, kind::DEVICE_ENTRY, &b)
                        .and_then(|_| j.send(entries).map_err(std::io::Error::other)),
                    Err(e) => Err(std::io::Error::other(e)),
                }
            }
            None => match entries
                .iter()
                .map(Shipped::frame)
                .collect::<Option<Vec<_>>>()
            {
                Some(frames) => match held {
                    Some((x, h)) => {
                        expose_entry(&mut w, x, h, *index, &frames, *prefill_ms, *resident)
                    }
                    None => write_frame(
                        &mut w,
                        kind::ENTRY,
                        &encode_entry(*index, &frames, *prefill_ms, *resident),
                    ),
                },
                // Over TCP every entry is a wire frame (`run_task` packs so).
                None => Err(std::io::Error::other("a device entry cannot go over TCP")),
            },
        },
        Reply::Failed(f) => match serde_json::to_vec(f) {
            Ok(b) => write_frame(&mut w, kind::FAILED, &b),
            Err(e) => Err(std::io::Error::other(e)),
        },
        Reply::Done => write_frame(&mut w, kind::DONE, &[]),
    };
    sent.is_ok()
}

/// The NIXL side of one connection: the registered frames by segment index, and
/// the reader of the combiner's acks.
struct Held {
    exposed: HashMap<usize, Box<dyn Exposed>>,
    acks: FrameReader,
    stream: TcpStream,
    /// The combiner closed the connection.
    closed: bool,
}

impl Held {
    /// Reads the acks that arrive within `wait` and frees their frames; notes a
    /// closed connection (then frees everything).
    fn drain(&mut self, wait: Duration) {
        let deadline = Instant::now() + wait.max(Duration::from_millis(1));
        while !self.closed {
            match self.acks.next(&mut self.stream, deadline) {
                Ok(None) => return,
                Ok(Some((kind::NIXL_ACK, body, _))) => {
                    if let Ok(i) = nixl::decode_ack(&body) {
                        self.exposed.remove(&i);
                    }
                }
                Ok(Some(_)) | Err(_) => {
                    self.closed = true;
                    self.exposed.clear();
                }
            }
        }
    }
}

/// Logged once per process: registration failed, entries went over TCP.
static TOLD_EXPOSE_FAILED: AtomicBool = AtomicBool::new(false);

/// Ships one segment's wire frames registered for the combiner's NIXL READ, or
/// over TCP when the registration fails (logged once).
fn expose_entry(
    w: &mut &TcpStream,
    x: &dyn RemoteExposer,
    h: &RefCell<Held>,
    index: usize,
    frames: &[&[u8]],
    prefill_ms: f64,
    resident: bool,
) -> std::io::Result<()> {
    let owned: Vec<Vec<u8>> = frames.iter().map(|f| f.to_vec()).collect();
    match x.expose(owned) {
        Ok(ex) => {
            let body = nixl::encode_remote_entry(&RemoteEntry {
                index,
                prefill_ms,
                resident,
                agent: ex.agent(),
                metadata: ex.metadata(),
                buffers: ex.buffers(),
            });
            h.borrow_mut().exposed.insert(index, ex);
            write_frame(w, kind::NIXL_ENTRY, &body)
        }
        Err((why, frames)) => {
            if !TOLD_EXPOSE_FAILED.swap(true, Ordering::Relaxed) {
                tracing::warn!("NIXL registration failed ({why}); shipping entries over TCP");
            }
            write_frame(
                w,
                kind::ENTRY,
                &encode_entry(index, &frames, prefill_ms, resident),
            )
        }
    }
}

fn serve_conn<B: PicBackend>(
    mut s: TcpStream,
    worker: &Worker<B>,
    nccl: Option<&dyn NcclJoin<B>>,
    nccl_busy: &Arc<AtomicBool>,
    exposer: Option<&dyn RemoteExposer>,
) -> std::io::Result<()> {
    let _ = s.set_nodelay(true);
    let mut r = FrameReader::new(MAX_TASK_FRAME);
    let Some((k, body, _)) = r.next(&mut s, Instant::now() + IDLE)? else {
        return Ok(());
    };
    match k {
        kind::PING => {
            let info = serde_json::to_vec(&worker.info()).map_err(std::io::Error::other)?;
            write_frame(&mut s, kind::PONG, &info)
        }
        kind::TASK => {
            let task: Task = serde_json::from_slice(&body)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
            // An NCCL offer is answered before anything is built.
            let joiner = match &task.nccl {
                None => None,
                Some(offer) => {
                    let j = match nccl {
                        Some(n) => match NcclSlot::take(nccl_busy) {
                            Some(slot) => n.prepare(offer).map(|j| (j, slot)),
                            None => Err("this worker is busy with another NCCL task".to_string()),
                        },
                        None => Err("this worker was started without --nccl".to_string()),
                    };
                    match j {
                        Ok((j, slot)) => {
                            write_frame(&mut s, kind::NCCL_READY, &[])?;
                            let j: Arc<dyn NcclJoiner<B>> = Arc::from(j);
                            match join_nccl(j.clone(), slot.clone()) {
                                Ok(()) => Some((j, slot)),
                                // The combiner's side fails too and reads wire
                                // frames (e.g. two ranks on one GPU).
                                Err(e) => {
                                    eprintln!(
                                        "hypic: worker: NCCL initialisation failed ({e}); \
                                         this task goes over TCP"
                                    );
                                    None
                                }
                            }
                        }
                        Err(message) => {
                            let f = serde_json::to_vec(&Failure { index: 0, message })
                                .map_err(std::io::Error::other)?;
                            write_frame(&mut s, kind::NCCL_REFUSED, &f)?;
                            None
                        }
                    }
                }
            };
            // NIXL only where no NCCL communicator moves the payloads.
            let route = match joiner {
                Some(_) => Route::Tcp("the payloads go by NCCL"),
                None => nixl::route(task.nixl.as_ref(), exposer.is_some()),
            };
            let held = match (route, exposer) {
                (Route::Nixl, Some(x)) => Some((
                    x,
                    RefCell::new(Held {
                        exposed: HashMap::new(),
                        acks: FrameReader::new(1 << 10),
                        stream: s.try_clone()?,
                        closed: false,
                    }),
                )),
                _ => None,
            };
            let out = &s;
            let cancelled = || match &held {
                // Acks may be pending on the connection: read them (a peek would
                // see their bytes, not the close).
                Some((_, h)) => {
                    let mut h = h.borrow_mut();
                    h.drain(Duration::ZERO);
                    h.closed
                }
                None => peer_closed(out),
            };
            let held_ref = || held.as_ref().map(|(x, h)| (*x, h));
            match &joiner {
                Some((j, _slot)) => {
                    let pack = |_: &SegmentTask, e: &[Arc<B::Entry>]| j.pack(e);
                    worker.run_task_with(&task, &cancelled, &pack, &mut |reply| {
                        write_reply::<B>(out, &reply, Some(&**j), None)
                    })
                }
                None => worker.run_task(&task, &cancelled, &mut |reply| {
                    write_reply::<B>(out, &reply, None, held_ref())
                }),
            }
            // Keep the registered frames until the combiner acked every READ or
            // left, at most `IDLE`.
            if let Some((_, h)) = &held {
                let until = Instant::now() + IDLE;
                let mut h = h.borrow_mut();
                while !h.closed && !h.exposed.is_empty() && Instant::now() < until {
                    h.drain(Duration::from_millis(50));
                }
            }
            Ok(())
        }
        other => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("unexpected frame kind {other}"),
        )),
    }
}

/// Serves `worker` on `listener` until the process ends: one thread per connection,
/// at most `max_conns` at once (more are closed at once, which the combiner reads as
/// the worker being unavailable for that task). Connection errors end that
/// connection only.
pub fn serve_tcp<B: PicBackend>(listener: TcpListener, worker: Arc<Worker<B>>, max_conns: usize) {
    serve_tcp_with(listener, worker, max_conns, None, None)
}

/// [`serve_tcp`] with NCCL: a task that offers a communicator ([`super::nccl`]) is
/// answered through `nccl` (joined, or refused with the reason, the task then
/// shipping wire frames); without `nccl` every offer is refused. A task that
/// offers NIXL is answered through `exposer` (registered frames for the combiner's
/// READ; see the module docs); without it such a task ships over TCP.
pub fn serve_tcp_with<B: PicBackend>(
    listener: TcpListener,
    worker: Arc<Worker<B>>,
    max_conns: usize,
    nccl: Option<Arc<dyn NcclJoin<B>>>,
    exposer: Option<Arc<dyn RemoteExposer>>,
) {
    let open = Arc::new(AtomicUsize::new(0));
    let nccl_busy = Arc::new(AtomicBool::new(false));
    for conn in listener.incoming() {
        let Ok(s) = conn else { continue };
        if open.load(Ordering::Relaxed) >= max_conns {
            drop(s);
            continue;
        }
        open.fetch_add(1, Ordering::Relaxed);
        let (w, n, link, x) = (worker.clone(), open.clone(), nccl.clone(), exposer.clone());
        let busy = nccl_busy.clone();
        let spawned = std::thread::Builder::new()
            .name("hypic-worker-conn".into())
            .spawn(move || {
                // Frees the slot however the connection ends (a panic included).
                let _slot = Busy(&n);
                let _ = serve_conn(s, &w, link.as_deref(), &busy, x.as_deref());
            });
        if spawned.is_err() {
            open.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    //! NCCL's protocol on the CPU backend, with fake communicators: one NCCL task at
    //! a time per worker, and a combiner that stops offering after a failed join.
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{mpsc, Arc, Mutex};
    use std::time::{Duration, Instant};

    use super::*;
    use crate::parallel::nccl::{EntryHeader, NcclOffer, ID_BYTES};
    use crate::parallel::transport::{
        NcclLink, NcclSession, Replies, Tcp, Transport, DEFAULT_MAX_FRAME,
    };
    use crate::parallel::DeviceEntry;
    use crate::pic::PicBackend;

    type Cpu = crate::pic::cpu::CpuBackend;

    /// A worker-side NCCL whose joins wait for a verdict sent on `verdicts`.
    struct FakeJoin {
        verdicts: Arc<Mutex<mpsc::Receiver<Result<(), String>>>>,
        prepared: AtomicUsize,
    }
    struct FakeJoiner(Arc<Mutex<mpsc::Receiver<Result<(), String>>>>);

    impl NcclJoin<Cpu> for FakeJoin {
        fn prepare(&self, _: &NcclOffer) -> Result<Box<dyn NcclJoiner<Cpu>>, String> {
            self.prepared.fetch_add(1, Ordering::Relaxed);
            Ok(Box::new(FakeJoiner(self.verdicts.clone())))
        }
    }
    impl NcclJoiner<Cpu> for FakeJoiner {
        fn connect(&self) -> Result<(), String> {
            let rx = self.0.lock().unwrap();
            rx.recv_timeout(Duration::from_secs(20))
                .unwrap_or_else(|_| Err("no verdict".into()))
        }
        fn pack(&self, _: &[Arc<<Cpu as PicBackend>::Entry>]) -> Packed {
            Err("fake".into())
        }
        fn headers(&self, _: &[Shipped]) -> Result<Vec<EntryHeader>, String> {
            Err("fake".into())
        }
        fn send(&self, _: &[Shipped]) -> Result<(), String> {
            Err("fake".into())
        }
    }

    /// A worker on a loopback port with `join`; its address and model.
    fn worker(join: Arc<FakeJoin>) -> (String, ModelFingerprint) {
        let w = Arc::new(Worker::new(crate::parallel::golden_engine()));
        let fp = w.engine().model_fingerprint();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        std::thread::spawn(move || serve_tcp_with(l, w, 8, Some(join), None));
        (addr, fp)
    }

    fn task(fp: ModelFingerprint, nccl: bool) -> Task {
        Task {
            model: fp.hex(),
            segments: vec![SegmentTask {
                index: 0,
                tokens: (0..20).collect(),
                isolation: String::new(),
                roles: vec![0],
            }],
            nccl: nccl.then(|| NcclOffer::new(&[7u8; ID_BYTES])),
            nixl: None,
        }
    }

    /// Sends `t` on a new connection and returns it with the first answer's kind
    /// and body.
    fn offer(addr: &str, t: &Task) -> (TcpStream, FrameReader, u8, Vec<u8>) {
        let mut s = TcpStream::connect(addr).unwrap();
        write_frame(&mut s, kind::TASK, &serde_json::to_vec(t).unwrap()).unwrap();
        let mut r = FrameReader::new(DEFAULT_MAX_FRAME);
        let (k, body, _) = r
            .next(&mut s, Instant::now() + Duration::from_secs(20))
            .unwrap()
            .expect("an answer");
        (s, r, k, body)
    }

    /// Reads frames until `DONE`; the kinds seen.
    fn rest(s: &mut TcpStream, r: &mut FrameReader) -> Vec<u8> {
        let mut kinds = Vec::new();
        loop {
            let (k, _, _) = r
                .next(s, Instant::now() + Duration::from_secs(60))
                .unwrap()
                .expect("a frame");
            kinds.push(k);
            if k == kind::DONE {
                return kinds;
            }
        }
    }

    /// While one task's communicator is joining, a second offer is refused as busy
    /// (that task ships wire frames); once the first join ended, offers are taken
    /// again.
    #[test]
    fn parallel_nccl_one_task_at_a_time_per_worker() {
        let (tx, rx) = mpsc::channel();
        let join = Arc::new(FakeJoin {
            verdicts: Arc::new(Mutex::new(rx)),
            prepared: AtomicUsize::new(0),
        });
        let (addr, fp) = worker(join.clone());
        let t = task(fp, true);
        let (mut s1, mut r1, k1, _) = offer(&addr, &t);
        assert_eq!(k1, kind::NCCL_READY);
        let (mut s2, mut r2, k2, body) = offer(&addr, &t);
        assert_eq!(k2, kind::NCCL_REFUSED);
        let f: Failure = serde_json::from_slice(&body).unwrap();
        assert!(f.message.contains("busy"), "{}", f.message);
        assert_eq!(rest(&mut s2, &mut r2), vec![kind::ENTRY, kind::DONE]);
        assert_eq!(join.prepared.load(Ordering::Relaxed), 1);
        // The first join fails: that task goes over TCP and frees the slot.
        tx.send(Err("injected".into())).unwrap();
        assert_eq!(rest(&mut s1, &mut r1), vec![kind::ENTRY, kind::DONE]);
        let (_s3, _r3, k3, _) = offer(&addr, &t);
        assert_eq!(k3, kind::NCCL_READY);
        assert_eq!(join.prepared.load(Ordering::Relaxed), 2);
        tx.send(Err("injected".into())).unwrap();
    }

    /// Reads a task's replies until `Done`: the number of segment entries, each of
    /// which must be wire frames (not device entries).
    fn wire_entries(r: &mut dyn Replies) -> usize {
        let mut n = 0;
        loop {
            match r.next(Instant::now() + Duration::from_secs(60)).unwrap() {
                Reply::Done => return n,
                Reply::Entry { entries, .. } => {
                    assert!(entries.iter().all(|x| x.frame().is_some()));
                    n += 1
                }
                other => panic!("{other:?}"),
            }
        }
    }

    /// A combiner-side NCCL whose joins succeed (nothing is received: the fake
    /// worker's packer fails every segment).
    struct JoiningLink(AtomicUsize);
    struct JoiningSession;
    impl NcclLink for JoiningLink {
        fn offer(&self) -> Result<(NcclOffer, Box<dyn NcclSession>), String> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok((NcclOffer::new(&[5u8; ID_BYTES]), Box::new(JoiningSession)))
        }
    }
    impl NcclSession for JoiningSession {
        fn connect(&mut self) -> Result<(), String> {
            Ok(())
        }
        fn receive(&mut self, _: &EntryHeader) -> Result<Box<dyn DeviceEntry>, String> {
            Err("fake".into())
        }
    }

    /// While one of its tasks uses a communicator with a worker, a combiner makes
    /// that worker no further offer (a refused offer would leave NCCL's bootstrap
    /// of its unique id waiting); once that task's replies are gone it offers
    /// again.
    #[test]
    fn parallel_nccl_one_offer_in_flight_per_worker() {
        let (tx, rx) = mpsc::channel();
        let join = Arc::new(FakeJoin {
            verdicts: Arc::new(Mutex::new(rx)),
            prepared: AtomicUsize::new(0),
        });
        for _ in 0..2 {
            tx.send(Ok(())).unwrap();
        }
        let (addr, fp) = worker(join.clone());
        let link = Arc::new(JoiningLink(AtomicUsize::new(0)));
        let t = Tcp::new(&addr, DEFAULT_MAX_FRAME).with_nccl(link.clone());
        let a = t.start(task(fp, false), Duration::from_secs(5)).unwrap();
        assert_eq!(link.0.load(Ordering::Relaxed), 1);
        let mut b = t.start(task(fp, false), Duration::from_secs(5)).unwrap();
        assert_eq!(
            link.0.load(Ordering::Relaxed),
            1,
            "an offer while one is in use"
        );
        // Without an offer the task ships wire frames.
        assert_eq!(wire_entries(&mut *b), 1);
        drop(a);
        let _c = t.start(task(fp, false), Duration::from_secs(5)).unwrap();
        assert_eq!(link.0.load(Ordering::Relaxed), 2);
    }

    /// A combiner-side NCCL whose joins fail at once.
    struct FailingLink(AtomicUsize);
    struct FailingSession;
    impl NcclLink for FailingLink {
        fn offer(&self) -> Result<(NcclOffer, Box<dyn NcclSession>), String> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok((NcclOffer::new(&[9u8; ID_BYTES]), Box::new(FailingSession)))
        }
    }
    impl NcclSession for FailingSession {
        fn connect(&mut self) -> Result<(), String> {
            Err("injected".into())
        }
        fn receive(&mut self, _: &EntryHeader) -> Result<Box<dyn DeviceEntry>, String> {
            Err("injected".into())
        }
    }

    /// After a communicator failed to initialise, the combiner offers that worker
    /// no more (each failed join may leave a thread blocked in NCCL); both tasks
    /// still get their entries over TCP.
    #[test]
    fn parallel_nccl_failed_join_stops_the_offers() {
        let (tx, rx) = mpsc::channel();
        let join = Arc::new(FakeJoin {
            verdicts: Arc::new(Mutex::new(rx)),
            prepared: AtomicUsize::new(0),
        });
        tx.send(Err("injected".into())).unwrap();
        let (addr, fp) = worker(join.clone());
        let link = Arc::new(FailingLink(AtomicUsize::new(0)));
        let t = Tcp::new(&addr, DEFAULT_MAX_FRAME).with_nccl(link.clone());
        for _ in 0..2 {
            let mut r = t.start(task(fp, false), Duration::from_secs(5)).unwrap();
            assert_eq!(wire_entries(&mut *r), 1);
        }
        assert_eq!(link.0.load(Ordering::Relaxed), 1);
        assert_eq!(join.prepared.load(Ordering::Relaxed), 1);
    }
}
