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

use super::transport::{
    encode_entry, kind, write_frame, Failure, FrameReader, Reply, Task, WorkerInfo, MAX_TASK_FRAME,
};
use super::wire::{self, ModelFingerprint};
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
    /// every segment. Never panics on bad input.
    pub fn run_task(
        &self,
        task: &Task,
        cancelled: &dyn Fn() -> bool,
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
                // parallel. The frames are read back under the same guard.
                let backend = self.engine.pic_backend();
                let _serial = backend.exclusive();
                match self
                    .engine
                    .entries_for(&seg.tokens, &seg.isolation, &seg.roles)
                {
                    Ok((entries, resident)) => Reply::Entry {
                        index: seg.index,
                        frames: backend.decoding(|| {
                            entries
                                .iter()
                                .map(|e| wire::encode(&**e, seg.tokens.len(), self.model))
                                .collect()
                        }),
                        prefill_ms: if resident {
                            0.0
                        } else {
                            t.elapsed().as_secs_f64() * 1e3
                        },
                        resident,
                        transfer_ms: 0.0,
                    },
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

fn serve_conn<B: PicBackend>(mut s: TcpStream, worker: &Worker<B>) -> std::io::Result<()> {
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
            let out = &s;
            worker.run_task(&task, &|| peer_closed(out), &mut |reply| {
                let mut w = out;
                let sent = match &reply {
                    Reply::Entry {
                        index,
                        frames,
                        prefill_ms,
                        resident,
                        ..
                    } => write_frame(
                        &mut w,
                        kind::ENTRY,
                        &encode_entry(*index, frames, *prefill_ms, *resident),
                    ),
                    Reply::Failed(f) => match serde_json::to_vec(f) {
                        Ok(b) => write_frame(&mut w, kind::FAILED, &b),
                        Err(e) => Err(std::io::Error::other(e)),
                    },
                    Reply::Done => write_frame(&mut w, kind::DONE, &[]),
                };
                sent.is_ok()
            });
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
    let open = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        let Ok(s) = conn else { continue };
        if open.load(Ordering::Relaxed) >= max_conns {
            drop(s);
            continue;
        }
        open.fetch_add(1, Ordering::Relaxed);
        let (w, n) = (worker.clone(), open.clone());
        let spawned = std::thread::Builder::new()
            .name("hypic-worker-conn".into())
            .spawn(move || {
                // Frees the slot however the connection ends (a panic included).
                let _slot = Busy(&n);
                let _ = serve_conn(s, &w);
            });
        if spawned.is_err() {
            open.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
