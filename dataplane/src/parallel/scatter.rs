//! The combiner's side of segment parallelism: [`Scatter`] holds the workers
//! (their transports, health and measured throughput); [`Scatter::start`] sends a
//! request's cold segments to the live workers and returns the [`ScatterRun`] that
//! the PIC engine takes their entries from ([`super::EntrySource`]).
//!
//! * Assignment: LPT on token counts over the live workers weighted by their
//!   throughput ([`super::assign::lpt`]); a segment that a live worker built before
//!   (and so may still hold) goes to that worker.
//! * Each worker builds its segments in order and ships each as it is built; a
//!   driver thread per (request, worker) receives them, verifies every frame
//!   ([`super::wire::verify`]) and hands it to the run, waking the engine.
//! * Deadline per segment: `tokens / throughput × margin + floor` from the moment
//!   the worker could start it (the task start, or its predecessor's arrival). A
//!   missed deadline, a lost connection or a failed segment takes the worker out of
//!   the assignment set (until a health check finds it again) and moves its
//!   unanswered segments to another live worker not yet tried for them, else to
//!   the combiner (the engine builds them itself). A frame that does not verify is
//!   never handed over: that segment is moved the same way.
//! * Dropping the last handle of a run cancels it: its driver threads stop within
//!   [`POLL`] and drop their connections, which stops the workers before their next
//!   segment. Entries not yet taken are freed with the run.
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::assign::{self, Job};
use super::transport::{info_model, Reply, SegmentTask, Task, Transport, TransportError};
use super::wire::{self, ModelFingerprint};
use super::{EntrySource, Shipped, Supply};

/// How often a driver thread looks at its run's cancel flag while it waits.
pub const POLL: Duration = Duration::from_millis(50);
/// Most workers one segment is tried on before the combiner builds it itself.
const MAX_TRIES: usize = 2;
/// Bound of the holder directory (segments remembered per worker, all workers).
const DIRECTORY_CAP: usize = 1 << 16;

/// A directory of which worker holds which segment, shared beyond this combiner
/// (the control plane's residency directory: other serving replicas over the same
/// catalog see what a worker built for this one, and the other way round).
///
/// Both methods are called on the request path and on driver threads: they must
/// return at once (an in-memory view; writes queued, never awaited).
pub trait HolderDirectory: Send + Sync {
    /// The worker (by its [`Scatter::names`] name) that holds the segment whose
    /// digest is `segment` ([`segment_digest`]), if the directory knows one.
    fn holder(&self, segment: u128) -> Option<String>;
    /// Worker `worker` shipped the segment `segment` (of `tokens` tokens under the
    /// isolation key `isolation`; `bytes` on the wire) to this combiner, so it holds
    /// its entries now.
    fn built(&self, segment: u128, isolation: &str, worker: &str, tokens: usize, bytes: usize);
}

/// Settings of a [`Scatter`].
#[derive(Clone, Debug)]
pub struct ScatterConfig {
    /// Factor on the expected prefill time of a segment (≥ 1).
    pub margin: f64,
    /// Time added to every segment's deadline (transfer, queueing, noise).
    pub floor: Duration,
    /// Connect / ping timeout.
    pub connect_timeout: Duration,
    /// Interval of the background health checks ([`Scatter::spawn_health_checks`]).
    pub health_interval: Duration,
    /// Throughput assumed for a worker that reported none, tokens per second.
    pub default_tokens_per_s: f64,
}

impl Default for ScatterConfig {
    fn default() -> Self {
        ScatterConfig {
            margin: 4.0,
            floor: Duration::from_millis(2000),
            connect_timeout: Duration::from_millis(1000),
            health_interval: Duration::from_millis(1000),
            default_tokens_per_s: 100.0,
        }
    }
}

/// One cold segment to scatter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColdSegment {
    /// Index in the request.
    pub index: usize,
    /// Token ids.
    pub tokens: Vec<u32>,
    /// Isolation key.
    pub isolation: String,
    /// Body starts to build, ascending ([`crate::pic::Pic::cold_segments`]).
    pub roles: Vec<usize>,
}

/// One worker's share of a request (in [`ScatterReport::workers`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerShare {
    /// The worker's name (address).
    pub worker: String,
    /// How its entries travel ([`Transport::kind`]: `tcp`, `in-process`, `peer`).
    #[serde(default)]
    pub transport: String,
    /// Segments assigned to it (first assignment and reassignments).
    pub assigned: usize,
    /// Segments it shipped that verified.
    pub segments: usize,
    /// Their tokens.
    pub tokens: usize,
    /// Of `segments`, those served from its pool without a prefill.
    pub resident: usize,
    /// Its build time of them, ms (as it reported).
    pub prefill_ms: f64,
    /// Receive time of their frames (TCP), or time of their device copies and
    /// checksums (`peer`), ms.
    pub transfer_ms: f64,
    /// It failed during the request (dead, late, or shipped a bad frame).
    pub failed: bool,
}

/// Statistics of one request's scatter (the response's `hypic.scatter`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScatterReport {
    /// Cold segments scattered.
    pub segments: usize,
    /// Per worker used.
    pub workers: Vec<WorkerShare>,
    /// Start of the scatter → the last segment arrived or was given up, ms.
    pub scatter_ms: f64,
    /// Receive time of every frame, summed, ms.
    pub transfer_ms: f64,
    /// The combiner's first look at a scattered segment → its taking the last
    /// shipped one, ms (composition overlaps the arrivals in this time).
    pub combine_ms: f64,
    /// Of that, time the combiner waited for entries not yet in, ms.
    pub wait_ms: f64,
    /// Segments moved to another worker.
    pub reassigned: usize,
    /// Segments given up and built by the combiner itself.
    pub recomputed: usize,
    /// Frames that failed verification (or parsing) and were never composed.
    pub corrupt: usize,
}

/// Live counters of one worker (for `/metrics`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct WorkerMetrics {
    /// Name (address).
    pub worker: String,
    /// How its entries travel ([`Transport::kind`]).
    pub transport: String,
    /// In the assignment set now.
    pub up: bool,
    /// Throughput used for deadlines, tokens per second.
    pub tokens_per_s: f64,
    /// Segments shipped and verified.
    pub segments: u64,
    /// Their tokens.
    pub tokens: u64,
    /// Failures (dead, late, failed segment, bad frame).
    pub failures: u64,
    /// Transfer time of its verified entries ([`WorkerShare::transfer_ms`]), summed,
    /// ms.
    pub transfer_ms: f64,
    /// Segments in flight on it now.
    pub in_flight: usize,
}

/// Live counters of a [`Scatter`] (for `/metrics`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ScatterMetrics {
    /// Per worker.
    pub workers: Vec<WorkerMetrics>,
    /// Requests scattered.
    pub requests: u64,
    /// Segments scattered.
    pub segments: u64,
    /// Segments moved to another worker.
    pub reassigned: u64,
    /// Segments built by the combiner after all.
    pub recomputed: u64,
    /// Frames refused (checksum, model, shape).
    pub corrupt: u64,
    /// Deadlines missed.
    pub timeouts: u64,
    /// Driver threads running now.
    pub drivers: usize,
}

struct Slot {
    transport: Box<dyn Transport>,
    name: String,
    kind: &'static str,
    up: AtomicBool,
    /// Throughput (tokens/s) as f64 bits.
    tps: AtomicU64,
    segments: AtomicU64,
    tokens: AtomicU64,
    failures: AtomicU64,
    /// Transfer time of verified entries, µs.
    transfer_us: AtomicU64,
    in_flight: AtomicUsize,
}

impl Slot {
    fn tps(&self, default: f64) -> f64 {
        let t = f64::from_bits(self.tps.load(Ordering::Relaxed));
        if t.is_finite() && t > 0.0 {
            t
        } else {
            default.max(1e-3)
        }
    }
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    segments: AtomicU64,
    reassigned: AtomicU64,
    recomputed: AtomicU64,
    corrupt: AtomicU64,
    timeouts: AtomicU64,
}

/// The workers of a combiner (see the module docs).
pub struct Scatter {
    workers: Vec<Slot>,
    model: ModelFingerprint,
    cfg: ScatterConfig,
    /// Segment (tokens, isolation) digest → the worker that built it last.
    directory: Mutex<HashMap<u128, usize>>,
    /// The shared directory, when the control plane gave one
    /// ([`Scatter::set_holder_directory`]); the map above is the fallback.
    shared: Mutex<Option<Arc<dyn HolderDirectory>>>,
    counters: Counters,
    drivers: AtomicUsize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The digest the holder directories key a segment by: XXH3-128 of its token ids
/// (little-endian `u32`), a `0xff` byte and its isolation key.
pub fn segment_digest(tokens: &[u32], isolation: &str) -> u128 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    h.update(&[0xff]);
    h.update(isolation.as_bytes());
    h.digest128()
}

impl Scatter {
    /// A combiner over `transports` for entries of the model `model`. Workers start
    /// down; [`Scatter::check_health`] (or the background checks) brings them in.
    pub fn new(
        transports: Vec<Box<dyn Transport>>,
        model: ModelFingerprint,
        cfg: ScatterConfig,
    ) -> Arc<Self> {
        let workers = transports
            .into_iter()
            .map(|t| Slot {
                name: t.name(),
                kind: t.kind(),
                transport: t,
                up: AtomicBool::new(false),
                tps: AtomicU64::new(0f64.to_bits()),
                segments: AtomicU64::new(0),
                tokens: AtomicU64::new(0),
                failures: AtomicU64::new(0),
                transfer_us: AtomicU64::new(0),
                in_flight: AtomicUsize::new(0),
            })
            .collect();
        Arc::new(Scatter {
            workers,
            model,
            cfg,
            directory: Mutex::new(HashMap::new()),
            shared: Mutex::new(None),
            counters: Counters::default(),
            drivers: AtomicUsize::new(0),
        })
    }

    /// Pings every worker (each within the connect timeout) and sets who is in the
    /// assignment set: a worker that answers with this combiner's model. Returns how
    /// many are up.
    pub fn check_health(&self) -> usize {
        let mut up = 0;
        for w in &self.workers {
            let ok = match w.transport.ping(self.cfg.connect_timeout) {
                Ok(info) => {
                    if info.tokens_per_s > 0.0
                        && f64::from_bits(w.tps.load(Ordering::Relaxed)) <= 0.0
                    {
                        w.tps.store(info.tokens_per_s.to_bits(), Ordering::Relaxed);
                    }
                    info_model(&info).is_ok_and(|m| m == self.model)
                }
                Err(_) => false,
            };
            w.up.store(ok, Ordering::Relaxed);
            up += ok as usize;
        }
        up
    }

    /// Runs [`Scatter::check_health`] every `health_interval` on a thread of its
    /// own, until the scatter is dropped.
    pub fn spawn_health_checks(self: &Arc<Self>) {
        let weak: Weak<Scatter> = Arc::downgrade(self);
        let every = self.cfg.health_interval.max(Duration::from_millis(10));
        let _ = std::thread::Builder::new()
            .name("hypic-scatter-health".into())
            .spawn(move || loop {
                std::thread::sleep(every);
                match weak.upgrade() {
                    Some(s) => {
                        s.check_health();
                    }
                    None => return,
                }
            });
    }

    /// Consults `dir` for holder affinity from now on (before this combiner's own
    /// map) and tells it of every segment a worker ships; `None` goes back to the
    /// own map alone.
    pub fn set_holder_directory(&self, dir: Option<Arc<dyn HolderDirectory>>) {
        *lock(&self.shared) = dir;
    }

    /// The worker index holding `digest`: the shared directory's answer when it
    /// names a worker of this combiner, else the own map's.
    fn holder_of(&self, digest: u128) -> Option<usize> {
        let shared = lock(&self.shared).clone();
        if let Some(name) = shared.and_then(|d| d.holder(digest)) {
            if let Some(w) = self.workers.iter().position(|w| w.name == name) {
                return Some(w);
            }
        }
        lock(&self.directory).get(&digest).copied()
    }

    /// Names of the workers, in order.
    pub fn names(&self) -> Vec<String> {
        self.workers.iter().map(|w| w.name.clone()).collect()
    }

    /// Workers in the assignment set now.
    pub fn live(&self) -> usize {
        self.workers
            .iter()
            .filter(|w| w.up.load(Ordering::Relaxed))
            .count()
    }

    /// The model entries are verified against.
    pub fn model(&self) -> ModelFingerprint {
        self.model
    }

    /// Driver threads running now (0 once every run ended or was cancelled).
    pub fn drivers(&self) -> usize {
        self.drivers.load(Ordering::Relaxed)
    }

    /// Live counters.
    pub fn metrics(&self) -> ScatterMetrics {
        let c = &self.counters;
        ScatterMetrics {
            workers: self
                .workers
                .iter()
                .map(|w| WorkerMetrics {
                    worker: w.name.clone(),
                    transport: w.kind.to_string(),
                    up: w.up.load(Ordering::Relaxed),
                    tokens_per_s: w.tps(self.cfg.default_tokens_per_s),
                    segments: w.segments.load(Ordering::Relaxed),
                    tokens: w.tokens.load(Ordering::Relaxed),
                    failures: w.failures.load(Ordering::Relaxed),
                    transfer_ms: w.transfer_us.load(Ordering::Relaxed) as f64 / 1e3,
                    in_flight: w.in_flight.load(Ordering::Relaxed),
                })
                .collect(),
            requests: c.requests.load(Ordering::Relaxed),
            segments: c.segments.load(Ordering::Relaxed),
            reassigned: c.reassigned.load(Ordering::Relaxed),
            recomputed: c.recomputed.load(Ordering::Relaxed),
            corrupt: c.corrupt.load(Ordering::Relaxed),
            timeouts: c.timeouts.load(Ordering::Relaxed),
            drivers: self.drivers(),
        }
    }

    /// Sets the throughput worker `w` is assumed to have (tests; measurements
    /// replace it as entries arrive).
    #[doc(hidden)]
    pub fn set_tokens_per_s(&self, w: usize, tokens_per_s: f64) {
        if let Some(s) = self.workers.get(w) {
            s.tps.store(tokens_per_s.to_bits(), Ordering::Relaxed);
        }
    }

    /// Expected time of a segment of `tokens` tokens on worker `w`, with the margin
    /// and the floor: its deadline from the moment the worker can start it.
    fn allowance(&self, w: usize, tokens: usize) -> Duration {
        let tps = self.workers[w].tps(self.cfg.default_tokens_per_s);
        let secs = tokens as f64 / tps * self.cfg.margin.max(1.0);
        self.cfg.floor + Duration::from_secs_f64(secs.clamp(0.0, 86_400.0))
    }

    /// Scatters `cold` over the live workers; `None` when there is nothing to send
    /// or no live worker (the engine then builds everything itself).
    pub fn start(self: &Arc<Self>, cold: Vec<ColdSegment>) -> Option<Arc<ScatterRun>> {
        let live: Vec<usize> = (0..self.workers.len())
            .filter(|&w| self.workers[w].up.load(Ordering::Relaxed))
            .collect();
        if cold.is_empty() || live.is_empty() {
            return None;
        }
        let jobs: Vec<Job> = cold
            .iter()
            .map(|c| Job {
                index: c.index,
                tokens: c.tokens.len(),
                holder: self
                    .holder_of(segment_digest(&c.tokens, &c.isolation))
                    .and_then(|w| live.iter().position(|&l| l == w)),
            })
            .collect();
        let speeds: Vec<f64> = live
            .iter()
            .map(|&w| self.workers[w].tps(self.cfg.default_tokens_per_s))
            .collect();
        let plan = assign::lpt(&jobs, &speeds);
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        self.counters
            .segments
            .fetch_add(cold.len() as u64, Ordering::Relaxed);
        let mut report = ScatterReport {
            segments: cold.len(),
            workers: self
                .workers
                .iter()
                .map(|w| WorkerShare {
                    worker: w.name.clone(),
                    transport: w.kind.to_string(),
                    ..WorkerShare::default()
                })
                .collect(),
            ..ScatterReport::default()
        };
        let mut slots = HashMap::new();
        for (k, list) in plan.per_worker.iter().enumerate() {
            for &i in list {
                slots.insert(
                    i,
                    State::Pending {
                        tried: vec![live[k]],
                    },
                );
            }
            report.workers[live[k]].assigned += list.len();
        }
        let shared = Arc::new(Shared {
            scatter: self.clone(),
            segs: cold.into_iter().map(|c| (c.index, c)).collect(),
            run: Mutex::new(RunState {
                slots,
                report,
                first_take: None,
                last_take: None,
                outstanding: 0,
            }),
            cv: Condvar::new(),
            cancel: AtomicBool::new(false),
            t0: Instant::now(),
        });
        for (k, list) in plan.per_worker.into_iter().enumerate() {
            if !list.is_empty() {
                shared.launch(live[k], list);
            }
        }
        Some(Arc::new(ScatterRun { shared }))
    }
}

enum State {
    /// On a worker (the last in `tried`).
    Pending { tried: Vec<usize> },
    /// Arrived and verified.
    Ready(Vec<Shipped>),
    /// Built by the combiner (given up, or taken and rejected).
    Local,
    /// Handed to the engine.
    Taken,
}

struct RunState {
    slots: HashMap<usize, State>,
    report: ScatterReport,
    first_take: Option<Instant>,
    last_take: Option<Instant>,
    /// Segments not yet arrived or given up.
    outstanding: usize,
}

struct Shared {
    scatter: Arc<Scatter>,
    segs: HashMap<usize, ColdSegment>,
    run: Mutex<RunState>,
    cv: Condvar,
    cancel: AtomicBool,
    t0: Instant,
}

/// Decrements a counter when dropped.
struct Count<'a>(&'a AtomicUsize, usize);
impl Drop for Count<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::Relaxed);
    }
}

impl Shared {
    /// Starts a driver thread for `list` (segment indices, in build order) on
    /// worker `w`.
    fn launch(self: &Arc<Self>, w: usize, list: Vec<usize>) {
        let n = list.len();
        lock(&self.run).outstanding += n;
        let me = self.clone();
        let sc = &self.scatter;
        sc.drivers.fetch_add(1, Ordering::Relaxed);
        sc.workers[w].in_flight.fetch_add(n, Ordering::Relaxed);
        let spawned = std::thread::Builder::new()
            .name("hypic-scatter".into())
            .spawn(move || {
                let _d = Count(&me.scatter.drivers, 1);
                me.drive(w, list);
            });
        if let Err(e) = spawned {
            // `list` moved into the closure that failed to start: undo and give up.
            sc.drivers.fetch_sub(1, Ordering::Relaxed);
            sc.workers[w].in_flight.fetch_sub(n, Ordering::Relaxed);
            let _ = e;
            self.give_up_all(w);
        }
    }

    /// Thread creation failed for worker `w`: every segment pending on it goes to
    /// the combiner.
    fn give_up_all(&self, w: usize) {
        let mut run = lock(&self.run);
        let idx: Vec<usize> = run
            .slots
            .iter()
            .filter(|(_, s)| matches!(s, State::Pending { tried } if tried.last() == Some(&w)))
            .map(|(i, _)| *i)
            .collect();
        for i in idx {
            run.slots.insert(i, State::Local);
            run.report.recomputed += 1;
            run.outstanding = run.outstanding.saturating_sub(1);
            self.scatter
                .counters
                .recomputed
                .fetch_add(1, Ordering::Relaxed);
        }
        self.cv.notify_all();
    }

    fn drive(self: &Arc<Self>, w: usize, list: Vec<usize>) {
        let sc = &self.scatter;
        let slot = &sc.workers[w];
        let _flight = Count(&slot.in_flight, list.len());
        let task = Task {
            nccl: None,
            model: sc.model.hex(),
            segments: list
                .iter()
                .filter_map(|i| self.segs.get(i))
                .map(|c| SegmentTask {
                    index: c.index,
                    tokens: c.tokens.clone(),
                    isolation: c.isolation.clone(),
                    roles: c.roles.clone(),
                })
                .collect(),
            // The transport sets its own offer (`Tcp::with_reader`).
            nixl: None,
        };
        let mut pending: VecDeque<usize> = list.into();
        let mut replies = match slot.transport.start(task, sc.cfg.connect_timeout) {
            Ok(r) => r,
            Err(_) => {
                self.worker_failed(w, pending, false);
                return;
            }
        };
        let allowance = |i: usize| {
            let n = self.segs.get(&i).map_or(0, |c| c.tokens.len());
            sc.allowance(w, n)
        };
        let mut deadline =
            Instant::now() + pending.front().map_or(Duration::ZERO, |&i| allowance(i));
        while !pending.is_empty() {
            if self.cancel.load(Ordering::Relaxed) {
                return;
            }
            let now = Instant::now();
            let slice = deadline.min(now + POLL);
            match replies.next(slice) {
                Ok(Reply::Entry {
                    index,
                    entries,
                    prefill_ms,
                    resident,
                    transfer_ms,
                }) => {
                    let Some(pos) = pending.iter().position(|&i| i == index) else {
                        continue;
                    };
                    pending.remove(pos);
                    if !self.arrived(w, index, entries, prefill_ms, resident, transfer_ms) {
                        // A bad frame: this worker is not trusted for the rest.
                        self.worker_failed(w, std::mem::take(&mut pending), false);
                        return;
                    }
                    if let Some(&next) = pending.front() {
                        deadline = Instant::now() + allowance(next);
                    }
                }
                Ok(Reply::Failed(f)) => {
                    if let Some(pos) = pending.iter().position(|&i| i == f.index) {
                        pending.remove(pos);
                        slot.failures.fetch_add(1, Ordering::Relaxed);
                        self.move_on(f.index, w);
                    }
                }
                Ok(Reply::Done) => break,
                Err(TransportError::Timeout(_)) => {
                    if Instant::now() >= deadline {
                        sc.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                        self.worker_failed(w, pending, true);
                        return;
                    }
                }
                Err(_) => {
                    self.worker_failed(w, pending, true);
                    return;
                }
            }
        }
        // `Done` with segments unanswered: a protocol fault; they move on.
        if !pending.is_empty() {
            self.worker_failed(w, pending, false);
        }
    }

    /// Verifies and stores the entries of `index` from worker `w`; false when one
    /// does not verify (the segment has then been moved on). A wire frame is
    /// checked by [`wire::verify`]; a device entry by its model, shape and
    /// [`super::DeviceEntry::verify`] (its checksum recomputed on this device).
    fn arrived(
        self: &Arc<Self>,
        w: usize,
        index: usize,
        frames: Vec<Shipped>,
        prefill_ms: f64,
        resident: bool,
        transfer_ms: f64,
    ) -> bool {
        let sc = &self.scatter;
        let Some(seg) = self.segs.get(&index) else {
            return true;
        };
        let good = |f: &Shipped, b: usize| match f {
            Shipped::Frame(f) => wire::verify(f, sc.model, seg.tokens.len(), b).is_ok(),
            Shipped::Device(d) => {
                d.model() == sc.model
                    && d.tokens() == seg.tokens.len()
                    && d.body_start() == b
                    && d.verify().is_ok()
            }
        };
        let ok = frames.len() == seg.roles.len()
            && frames.iter().zip(&seg.roles).all(|(f, &b)| good(f, b));
        if !ok {
            sc.counters.corrupt.fetch_add(1, Ordering::Relaxed);
            lock(&self.run).report.corrupt += 1;
            self.move_on(index, w);
            return false;
        }
        let slot = &sc.workers[w];
        slot.segments.fetch_add(1, Ordering::Relaxed);
        slot.tokens
            .fetch_add(seg.tokens.len() as u64, Ordering::Relaxed);
        slot.transfer_us.fetch_add(
            (transfer_ms.max(0.0) * 1e3).min(u64::MAX as f64) as u64,
            Ordering::Relaxed,
        );
        if !resident && prefill_ms > 0.0 {
            // Throughput for later deadlines: a moving average of the builds.
            let now = seg.tokens.len() as f64 / (prefill_ms / 1e3);
            let old = f64::from_bits(slot.tps.load(Ordering::Relaxed));
            let new = if old > 0.0 {
                0.7 * old + 0.3 * now
            } else {
                now
            };
            slot.tps.store(new.to_bits(), Ordering::Relaxed);
        }
        {
            let mut dir = lock(&sc.directory);
            if dir.len() >= DIRECTORY_CAP {
                dir.clear();
            }
            dir.insert(segment_digest(&seg.tokens, &seg.isolation), w);
        }
        let shared = lock(&sc.shared).clone();
        if let Some(d) = shared {
            let bytes = frames.iter().map(|f| f.len()).sum();
            d.built(
                segment_digest(&seg.tokens, &seg.isolation),
                &seg.isolation,
                &slot.name,
                seg.tokens.len(),
                bytes,
            );
        }
        let mut run = lock(&self.run);
        if matches!(run.slots.get(&index), Some(State::Pending { .. })) {
            run.slots.insert(index, State::Ready(frames));
            run.outstanding = run.outstanding.saturating_sub(1);
            let share = &mut run.report.workers[w];
            share.segments += 1;
            share.tokens += seg.tokens.len();
            share.resident += resident as usize;
            share.prefill_ms += prefill_ms;
            share.transfer_ms += transfer_ms;
            run.report.transfer_ms += transfer_ms;
            if run.outstanding == 0 {
                run.report.scatter_ms = self.t0.elapsed().as_secs_f64() * 1e3;
            }
        }
        drop(run);
        self.cv.notify_all();
        true
    }

    /// Worker `w` failed this run (dead, late, a bad frame): it leaves the
    /// assignment set when `down`, and its unanswered segments move on.
    fn worker_failed(self: &Arc<Self>, w: usize, pending: VecDeque<usize>, down: bool) {
        let slot = &self.scatter.workers[w];
        slot.failures.fetch_add(1, Ordering::Relaxed);
        if down {
            slot.up.store(false, Ordering::Relaxed);
        }
        lock(&self.run).report.workers[w].failed = true;
        let mut groups: HashMap<Option<usize>, Vec<usize>> = HashMap::new();
        for i in pending {
            let to = self.next_worker(i);
            groups.entry(to).or_default().push(i);
        }
        for (to, list) in groups {
            self.reassign(to, list);
        }
    }

    /// Segment `index` failed on worker `w`: it moves to another worker or to the
    /// combiner.
    fn move_on(self: &Arc<Self>, index: usize, w: usize) {
        let _ = w;
        let to = self.next_worker(index);
        self.reassign(to, vec![index]);
    }

    /// A live worker not yet tried for `index` (least loaded), if tries are left.
    fn next_worker(&self, index: usize) -> Option<usize> {
        if self.cancel.load(Ordering::Relaxed) {
            return None;
        }
        let run = lock(&self.run);
        let tried: &[usize] = match run.slots.get(&index) {
            Some(State::Pending { tried }) => tried,
            _ => return None,
        };
        if tried.len() >= MAX_TRIES {
            return None;
        }
        let sc = &self.scatter;
        (0..sc.workers.len())
            .filter(|w| !tried.contains(w) && sc.workers[*w].up.load(Ordering::Relaxed))
            .min_by_key(|&w| sc.workers[w].in_flight.load(Ordering::Relaxed))
    }

    /// Moves `list` to worker `to`, or to the combiner (`None`).
    fn reassign(self: &Arc<Self>, to: Option<usize>, list: Vec<usize>) {
        if list.is_empty() {
            return;
        }
        let sc = &self.scatter;
        {
            let mut run = lock(&self.run);
            for &i in &list {
                run.outstanding = run.outstanding.saturating_sub(1);
                let Some(State::Pending { tried }) = run.slots.get_mut(&i) else {
                    continue;
                };
                match to {
                    Some(w) => tried.push(w),
                    None => {
                        run.slots.insert(i, State::Local);
                        run.report.recomputed += 1;
                        sc.counters.recomputed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            match to {
                Some(w) => {
                    run.report.reassigned += list.len();
                    run.report.workers[w].assigned += list.len();
                    sc.counters
                        .reassigned
                        .fetch_add(list.len() as u64, Ordering::Relaxed);
                }
                None if run.outstanding == 0 => {
                    run.report.scatter_ms = self.t0.elapsed().as_secs_f64() * 1e3;
                }
                None => {}
            }
        }
        self.cv.notify_all();
        if let Some(w) = to {
            self.launch(w, list);
        }
    }
}

/// One request's scatter (see the module docs); the PIC engine reads it as an
/// [`EntrySource`]. Dropping the last handle cancels what still runs.
pub struct ScatterRun {
    shared: Arc<Shared>,
}

impl ScatterRun {
    /// The statistics so far (complete once the request's prompt is processed).
    pub fn report(&self) -> ScatterReport {
        let run = lock(&self.shared.run);
        let mut r = run.report.clone();
        if let (Some(a), Some(b)) = (run.first_take, run.last_take) {
            r.combine_ms = (b - a).as_secs_f64() * 1e3;
        }
        r.workers.retain(|w| w.assigned > 0);
        r
    }

    /// Cancels the scatter: drivers stop within [`POLL`], their connections close.
    pub fn cancel(&self) {
        self.shared.cancel.store(true, Ordering::Relaxed);
        self.shared.cv.notify_all();
    }
}

impl Drop for ScatterRun {
    fn drop(&mut self) {
        self.cancel();
    }
}

impl EntrySource for ScatterRun {
    fn take(&self, index: usize, wait: Duration) -> Supply {
        let sh = &self.shared;
        let t = Instant::now();
        let until = t + wait;
        let mut run = lock(&sh.run);
        if run.slots.contains_key(&index) && run.first_take.is_none() {
            run.first_take = Some(t);
        }
        loop {
            match run.slots.get(&index) {
                None | Some(State::Local) | Some(State::Taken) => return Supply::Local,
                Some(State::Ready(_)) => {
                    let Some(State::Ready(frames)) = run.slots.insert(index, State::Taken) else {
                        return Supply::Local;
                    };
                    run.report.wait_ms += t.elapsed().as_secs_f64() * 1e3;
                    run.last_take = Some(Instant::now());
                    return Supply::Ready(frames);
                }
                Some(State::Pending { .. }) => {
                    let now = Instant::now();
                    if now >= until || sh.cancel.load(Ordering::Relaxed) {
                        run.report.wait_ms += t.elapsed().as_secs_f64() * 1e3;
                        return Supply::Pending;
                    }
                    run = sh
                        .cv
                        .wait_timeout(run, until - now)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|p| p.into_inner().0);
                }
            }
        }
    }

    fn rejected(&self, index: usize, why: &str) {
        let _ = why;
        let sc = &self.shared.scatter;
        sc.counters.corrupt.fetch_add(1, Ordering::Relaxed);
        sc.counters.recomputed.fetch_add(1, Ordering::Relaxed);
        let mut run = lock(&self.shared.run);
        run.slots.insert(index, State::Local);
        run.report.corrupt += 1;
        run.report.recomputed += 1;
    }

    fn model(&self) -> ModelFingerprint {
        self.shared.scatter.model
    }
}

#[cfg(test)]
mod tests {
    use super::super::transport::{Faults, InProcess};
    use super::super::worker::Worker;
    use super::*;
    use crate::model::Model;
    use crate::pic::{Mode, PicEngine, PicOutput, SegmentRef};
    use crate::state::ModelState;

    fn model() -> Arc<Model> {
        static M: std::sync::OnceLock<Arc<Model>> = std::sync::OnceLock::new();
        M.get_or_init(|| {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/golden/qwen3_5");
            Arc::new(Model::load(&dir, &mut |_, _| {}).unwrap())
        })
        .clone()
    }

    fn engine() -> Arc<PicEngine> {
        Arc::new(PicEngine::new(model(), "m", 1 << 28, 1 << 28))
    }

    fn seg(n: usize, seed: u32) -> SegmentRef {
        SegmentRef {
            tokens: (0..n as u32)
                .map(|i| (i * 31 + seed * 17 + 3) % 300)
                .collect(),
            isolation: "t".into(),
        }
    }

    /// System prompt, four unequal documents, the query.
    fn request() -> Vec<SegmentRef> {
        vec![
            seg(10, 1),
            seg(40, 2),
            seg(70, 3),
            seg(25, 4),
            seg(55, 5),
            seg(12, 6),
        ]
    }

    struct Rig {
        combiner: Arc<PicEngine>,
        scatter: Arc<Scatter>,
        workers: Vec<Arc<InProcess<crate::pic::CpuBackend>>>,
    }

    struct Shared<T: Transport>(Arc<T>);
    impl<T: Transport> Transport for Shared<T> {
        fn name(&self) -> String {
            self.0.name()
        }
        fn kind(&self) -> &'static str {
            self.0.kind()
        }
        fn ping(&self, t: Duration) -> Result<super::super::transport::WorkerInfo, TransportError> {
            self.0.ping(t)
        }
        fn start(
            &self,
            task: Task,
            t: Duration,
        ) -> Result<Box<dyn super::super::transport::Replies>, TransportError> {
            self.0.start(task, t)
        }
    }

    fn rig(n: usize, cfg: ScatterConfig) -> Rig {
        let combiner = engine();
        let workers: Vec<Arc<InProcess<_>>> = (0..n)
            .map(|k| {
                Arc::new(InProcess::new(
                    Arc::new(Worker::new(engine())),
                    &format!("local:{k}"),
                ))
            })
            .collect();
        let transports: Vec<Box<dyn Transport>> = workers
            .iter()
            .map(|w| Box::new(Shared(w.clone())) as Box<dyn Transport>)
            .collect();
        let scatter = Scatter::new(transports, combiner.model_fingerprint(), cfg);
        assert_eq!(scatter.check_health(), n);
        for k in 0..n {
            scatter.set_tokens_per_s(k, 1e6);
        }
        Rig {
            combiner,
            scatter,
            workers,
        }
    }

    fn cold(e: &PicEngine, segs: &[SegmentRef], mode: Mode) -> Vec<ColdSegment> {
        e.cold_segments(segs, mode, "tenant")
            .into_iter()
            .map(|(index, roles)| ColdSegment {
                index,
                tokens: segs[index].tokens.clone(),
                isolation: segs[index].isolation.clone(),
                roles,
            })
            .collect()
    }

    /// Serves `segs` on the rig's combiner through a scatter; returns the output
    /// and the scatter's report.
    fn scattered(
        r: &Rig,
        segs: &[SegmentRef],
        mode: Mode,
    ) -> (PicOutput<ModelState>, ScatterReport) {
        let run = r.scatter.start(cold(&r.combiner, segs, mode));
        let src = run.clone().map(|x| x as Arc<dyn EntrySource>);
        let mut job = r
            .combiner
            .begin_with_source(segs.to_vec(), mode, "tenant", src)
            .unwrap();
        // Unbounded budgets, as `Pic::run` (a build in pieces rounds differently).
        while !job.is_done() {
            r.combiner.advance(&mut job, usize::MAX, true).unwrap();
        }
        let report = run.map(|x| x.report()).unwrap_or_default();
        (job.take_output().unwrap(), report)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn drained(s: &Scatter) {
        let t = Instant::now();
        while s.drivers() > 0 {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "scatter drivers still running"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Scattered over two in-process workers, a request gives bit-identical logits,
    /// the same statistics and the same public pool as one engine alone, the first
    /// time (every document cold, shipped) and reordered (every document a hit).
    #[test]
    fn parallel_scatter_matches_single_engine() {
        let mode = Mode::hypic_default();
        let r = rig(2, ScatterConfig::default());
        let single = engine();
        let segs = request();
        let want = single.run(&segs, mode, "tenant").unwrap();
        let (got, rep) = scattered(&r, &segs, mode);
        assert_eq!(bits(&got.logits), bits(&want.logits));
        assert_eq!(got.stats, want.stats);
        // The system prompt and the four documents.
        assert_eq!(want.stats.misses, 5);
        assert_eq!(rep.segments, 5);
        assert_eq!(rep.recomputed + rep.corrupt + rep.reassigned, 0);
        assert_eq!(rep.workers.iter().map(|w| w.segments).sum::<usize>(), 5);
        assert_eq!(rep.workers.len(), 2, "LPT uses both workers: {rep:?}");
        assert!(
            rep.workers.iter().all(|w| w.transport == "in-process"),
            "{rep:?}"
        );
        assert_eq!(r.combiner.public_usage(), single.public_usage());
        // Reordered: hits, nothing to scatter.
        let mut again = segs.clone();
        again.swap(1, 3);
        again.swap(2, 4);
        let want2 = single.run(&again, mode, "tenant").unwrap();
        assert!(cold(&r.combiner, &again, mode).is_empty());
        let (got2, rep2) = scattered(&r, &again, mode);
        assert_eq!(bits(&got2.logits), bits(&want2.logits));
        assert_eq!(got2.stats, want2.stats);
        assert_eq!(rep2, ScatterReport::default());
        drained(&r.scatter);
        assert_eq!(r.scatter.metrics().segments, 5);
    }

    /// A worker that dies after shipping one entry: the request completes with the
    /// single engine's answer and statistics, the dead worker leaves the assignment
    /// set (and comes back when it answers pings again), and nothing is left over:
    /// no driver thread, and the combiner's pool holds what one engine's holds.
    #[test]
    fn parallel_worker_death_mid_request_recovers_and_leaks_nothing() {
        let mode = Mode::hypic_default();
        let r = rig(2, ScatterConfig::default());
        r.workers[0].set_faults(Faults {
            die_after: Some(1),
            ..Faults::default()
        });
        let single = engine();
        let segs = request();
        let want = single.run(&segs, mode, "tenant").unwrap();
        let (got, rep) = scattered(&r, &segs, mode);
        assert_eq!(bits(&got.logits), bits(&want.logits));
        assert_eq!(got.stats, want.stats);
        assert!(rep.workers.iter().any(|w| w.failed), "{rep:?}");
        assert!(rep.reassigned + rep.recomputed >= 1, "{rep:?}");
        drained(&r.scatter);
        assert_eq!(r.combiner.public_usage(), single.public_usage());
        assert_eq!(r.scatter.live(), 1);
        assert_eq!(r.scatter.check_health(), 1);
        r.workers[0].revive();
        assert_eq!(r.scatter.check_health(), 2);
        assert!(r.scatter.metrics().workers[0].failures >= 1);
    }

    /// A shipped entry damaged in transit is detected and recomputed, never
    /// composed: the answer is the single engine's.
    #[test]
    fn parallel_corrupt_entry_is_recomputed() {
        let mode = Mode::hypic_default();
        let r = rig(1, ScatterConfig::default());
        r.workers[0].set_faults(Faults {
            corrupt: Some(0),
            ..Faults::default()
        });
        let single = engine();
        let segs = request();
        let want = single.run(&segs, mode, "tenant").unwrap();
        let (got, rep) = scattered(&r, &segs, mode);
        assert_eq!(bits(&got.logits), bits(&want.logits));
        assert_eq!(got.stats, want.stats);
        assert_eq!(rep.corrupt, 1, "{rep:?}");
        // The only worker is not trusted after a bad frame: the rest is built here.
        assert!(rep.recomputed >= 1, "{rep:?}");
        drained(&r.scatter);
        assert_eq!(r.combiner.public_usage(), single.public_usage());
        assert_eq!(r.scatter.metrics().corrupt, 1);
    }

    /// A slow worker misses its deadline (floor + tokens / throughput × margin):
    /// its segments are built elsewhere, the request completes long before the slow
    /// worker would have, with the same answer.
    #[test]
    fn parallel_missed_deadline_moves_segments() {
        let mode = Mode::hypic_default();
        let cfg = ScatterConfig {
            margin: 1.0,
            floor: Duration::from_millis(100),
            ..ScatterConfig::default()
        };
        let r = rig(2, cfg);
        r.workers[1].set_faults(Faults {
            delay: Duration::from_secs(3),
            ..Faults::default()
        });
        let single = engine();
        let segs = request();
        let want = single.run(&segs, mode, "tenant").unwrap();
        let t = Instant::now();
        let (got, rep) = scattered(&r, &segs, mode);
        assert!(
            t.elapsed() < Duration::from_millis(2500),
            "{:?}",
            t.elapsed()
        );
        assert_eq!(bits(&got.logits), bits(&want.logits));
        assert_eq!(got.stats, want.stats);
        assert!(rep.workers.iter().any(|w| w.failed), "{rep:?}");
        assert!(r.scatter.metrics().timeouts >= 1);
        assert_eq!(r.scatter.live(), 1);
    }

    /// Dropping a run (a cancelled request) stops its drivers and the worker's
    /// task before it has shipped everything.
    #[test]
    fn parallel_cancelled_request_cancels_its_scatter() {
        let mode = Mode::hypic_default();
        let r = rig(1, ScatterConfig::default());
        r.workers[0].set_faults(Faults {
            delay: Duration::from_millis(150),
            ..Faults::default()
        });
        let segs = request();
        let run = r.scatter.start(cold(&r.combiner, &segs, mode)).unwrap();
        assert_eq!(r.scatter.drivers(), 1);
        std::thread::sleep(Duration::from_millis(20));
        drop(run);
        drained(&r.scatter);
        std::thread::sleep(Duration::from_millis(400));
        assert!(r.workers[0].shipped() < 5, "{}", r.workers[0].shipped());
        assert_eq!(r.scatter.metrics().workers[0].in_flight, 0);
    }
}

/// The inputs of `scripts/sp_sim.py`, measured on this machine: per-segment entry
/// build and composition times of the bundled model at several lengths, shipped
/// entry sizes, and TCP loopback bandwidth with the transport's framing. Writes
/// `docs/segment-parallelism/measured.json`. Run on purpose:
/// `cargo test -p hypic-dataplane --lib parallel_measure -- --ignored --nocapture`.
#[cfg(test)]
mod measure {
    use super::super::transport::{kind, write_frame, FrameReader};
    use super::super::wire;
    use crate::model::Model;
    use crate::pic::{PicBackend, PicEngine};
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    fn sh(cmd: &str, args: &[&str]) -> String {
        std::process::Command::new(cmd)
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    }

    /// MB/s (1e6 bytes) of `total` bytes in frames of `frame` bytes over loopback.
    fn loopback_mb_s(frame: usize, total: usize) -> f64 {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let n = total.div_ceil(frame);
        let sender = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_nodelay(true).unwrap();
            let body = vec![7u8; frame];
            for _ in 0..n {
                write_frame(&mut s, kind::ENTRY, &body).unwrap();
            }
        });
        let (mut s, _) = l.accept().unwrap();
        let mut r = FrameReader::new(frame + 16);
        let t = Instant::now();
        let mut got = 0usize;
        while got < n {
            if r.next(&mut s, Instant::now() + Duration::from_secs(30))
                .unwrap()
                .is_some()
            {
                got += 1;
            }
        }
        let secs = t.elapsed().as_secs_f64();
        sender.join().unwrap();
        (n * frame) as f64 / secs / 1e6
    }

    #[test]
    #[ignore = "a measurement: writes docs/segment-parallelism/measured.json"]
    fn parallel_measure_inputs_of_the_simulation() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let dir = root.join("models/hypic-tiny");
        let model = Arc::new(Model::load(&dir, &mut |_, _| {}).unwrap());
        let eng = PicEngine::new(model, "hypic-tiny", 1 << 30, 1 << 30);
        let vocab = eng.pic_backend().config().vocab_size as u32;
        let fp = eng.model_fingerprint();
        let mut rows = vec![];
        for &n in &[256usize, 512, 1024, 2048, 4096] {
            let tokens: Vec<u32> = (0..n as u32)
                .map(|i| (i * 7919 + 13) % (vocab - 8))
                .collect();
            let mut build = vec![];
            let mut compose = vec![];
            let mut bytes = 0;
            for rep in 0..3 {
                let t = Instant::now();
                let es = eng.build_entries(&tokens, &[0, 8]).unwrap();
                build.push(t.elapsed().as_secs_f64() * 1e3);
                bytes = wire::encode(&es[1], n, fp).len();
                // Composition after a 64-token prefix (the seam window and the
                // body's pairs and KV), what the combiner does per segment.
                let be = eng.pic_backend();
                let mut st = be.new_state().unwrap();
                be.prefill(&tokens[..64], &mut st, false).unwrap();
                let t = Instant::now();
                be.compose_run(&[(&tokens[..], &es[1])], &mut st, false, true, 0)
                    .unwrap();
                compose.push(t.elapsed().as_secs_f64() * 1e3);
                let _ = rep;
            }
            println!("{n} tokens: build {build:?} ms, compose {compose:?} ms, {bytes} B");
            rows.push(serde_json::json!({
                "tokens": n,
                "build_ms": median(build),
                "compose_ms": median(compose),
                "entry_bytes": bytes,
            }));
        }
        let frame = rows.last().unwrap()["entry_bytes"].as_u64().unwrap() as usize;
        let bw: Vec<f64> = (0..3).map(|_| loopback_mb_s(frame, 256 << 20)).collect();
        println!("loopback {bw:?} MB/s");
        let cpu = sh(
            "sh",
            &["-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
        );
        let out = serde_json::json!({
            "what": "inputs of scripts/sp_sim.py, measured by parallel_measure_inputs_of_the_simulation (dataplane/src/parallel/scatter.rs)",
            "date_utc": sh("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
            "machine": {"cpu": cpu, "cores": sh("nproc", &[]), "note": "shared with other jobs; debug profile (opt-level 2, GEMM at 3)"},
            "model": "models/hypic-tiny (qwen3_next, 12 layers, hidden 256), CPU backend, fp32",
            "segments": rows,
            "tcp_loopback": {"frame_bytes": frame, "mb_per_s_median": median(bw.clone()), "mb_per_s": bw},
        });
        let path = root.join("docs/segment-parallelism/measured.json");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, serde_json::to_string_pretty(&out).unwrap() + "\n").unwrap();
    }
}
