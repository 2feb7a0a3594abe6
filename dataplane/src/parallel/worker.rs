//! A worker: a model replica and its public pool that builds the entries of the
//! segments a combiner gives it, each prefilled alone from position 0, and ships
//! every entry as soon as it is built ([`Worker::run_task`]). `hypic worker --listen
//! ADDR --model DIR` serves one over TCP ([`serve_tcp`]); tests reach one in
//! process ([`super::transport::InProcess`]).
//!
//! Built entries stay in the worker's own public pool (its LRU policy, its byte
//! capacity), so a segment given to the same worker again is shipped without a
//! prefill (the combiner's holder affinity).
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::nccl::DeviceHeader;
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
                Some(frames) => write_frame(
                    &mut w,
                    kind::ENTRY,
                    &encode_entry(*index, &frames, *prefill_ms, *resident),
                ),
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

fn serve_conn<B: PicBackend>(
    mut s: TcpStream,
    worker: &Worker<B>,
    nccl: Option<&dyn NcclJoin<B>>,
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
                        Some(n) => n.prepare(offer),
                        None => Err("this worker was started without --nccl".to_string()),
                    };
                    match j {
                        Ok(j) => {
                            write_frame(&mut s, kind::NCCL_READY, &[])?;
                            match j.connect() {
                                Ok(()) => Some(j),
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
            let out = &s;
            let cancelled = || peer_closed(out);
            match &joiner {
                Some(j) => {
                    let pack = |_: &SegmentTask, e: &[Arc<B::Entry>]| j.pack(e);
                    worker.run_task_with(&task, &cancelled, &pack, &mut |reply| {
                        write_reply::<B>(out, &reply, Some(&**j))
                    })
                }
                None => worker.run_task(&task, &cancelled, &mut |reply| {
                    write_reply::<B>(out, &reply, None)
                }),
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
    serve_tcp_with(listener, worker, max_conns, None)
}

/// [`serve_tcp`] with NCCL: a task that offers a communicator ([`super::nccl`]) is
/// answered through `nccl` (joined, or refused with the reason, the task then
/// shipping wire frames); without `nccl` every offer is refused.
pub fn serve_tcp_with<B: PicBackend>(
    listener: TcpListener,
    worker: Arc<Worker<B>>,
    max_conns: usize,
    nccl: Option<Arc<dyn NcclJoin<B>>>,
) {
    let open = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        let Ok(s) = conn else { continue };
        if open.load(Ordering::Relaxed) >= max_conns {
            drop(s);
            continue;
        }
        open.fetch_add(1, Ordering::Relaxed);
        let (w, n, link) = (worker.clone(), open.clone(), nccl.clone());
        let spawned = std::thread::Builder::new()
            .name("hypic-worker-conn".into())
            .spawn(move || {
                // Frees the slot however the connection ends (a panic included).
                let _slot = Busy(&n);
                let _ = serve_conn(s, &w, link.as_deref());
            });
        if spawned.is_err() {
            open.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
