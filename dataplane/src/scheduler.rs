//! Continuous-batching scheduler: one worker thread owns the model; new requests'
//! prefill (with PIC assembly through an [`Engine`]: the CPU
//! [`crate::pic::PicEngine`] or the GPU `cuda::pic::GpuPicEngine`) interleaves with
//! decode steps of the running batch.
//!
//! * Admission: a bounded queue (full → [`SubmitError::QueueFull`] with a retry hint);
//!   a request leaves the queue when a recurrent-state slot is free **and** its KV
//!   reservation (`(prompt + max_tokens) × KV bytes per token`) fits the KV budget;
//!   a request that waits longer than the queue timeout gets
//!   [`GenEvent::Error`] with [`ErrorKind::QueueTimeout`].
//! * Token-budget steps (the shape of vLLM v1's loop): every step runs one batched
//!   decode step over every running sequence ([`Engine::decode_sample`]: on the CPU
//!   `Model::decode_batch`, on the GPU `GpuModel::decode_sample`) and, before it,
//!   pieces of the admitted prefills ([`Engine::advance`]) up to
//!   [`SchedulerConfig::step_tokens`] tokens in all (the decode tokens count too),
//!   so a long cold prompt no longer stalls the running streams: they get a token
//!   every step while it is prefilled. Prefills are served in admission order
//!   (FIFO), each taking at most [`SchedulerConfig::prefill_chunk_tokens`] in a
//!   first pass, then the budget left goes again in order; the oldest prefill
//!   always gets one piece, even when the decode tokens fill the budget. A short
//!   request admitted behind a long one thus gets its first token in the step it is
//!   admitted when the budget holds the long one's chunk and the short prompt.
//!   Requests whose next piece is a segment computed in place (their queries, above
//!   all) run their pieces of a step as one batched forward
//!   ([`Engine::advance_computed_many`]: projections and FFN over all their rows,
//!   each request's recurrences and attention on its own state; on the CPU
//!   `Model::prefill_many`, on the GPU `GpuModel::prefill_many` with
//!   `HYPIC_CUDA_BATCHED_PREFILL=1`, else one request after the other); the
//!   metrics count these forwards. A request that has yet to match its prompt
//!   prefix and starts like an earlier one still going (same tenant, mode and first
//!   segment, that start not cached yet) waits for the step's second pass, so that
//!   it finds that one's snapshots as it would behind it alone; once the shared
//!   start (a system prompt) is cached, such requests batch. A request whose prefill ends in a step is
//!   sampled at once ([`GenEvent::Started`] and its first token) and decodes from
//!   that same step on. A row without logit
//!   processors, log-probabilities or scoring passes its [`Sampler::device_draw`] and
//!   the engine may return its token (the GPU draws it on the device, the same draw
//!   as the host's); every other row gets its logits and is sampled on the host with
//!   [`Sampler`]. Each
//!   running sequence owns its sampler, so penalties, `logit_bias`, `min_tokens` and
//!   a constraint (structured output) are per request within a batch; a constraint
//!   that fails ends its sequence with [`GenEvent::Error`].
//! * Cancellation: dropping the [`RequestHandle`] (client disconnect) or calling
//!   [`RequestHandle::cancel`] frees the sequence's state at the next step.
use crate::engine::{Decoded, Engine, EnginePools};
use crate::parallel::EntrySource;
use crate::pic::{Mode, PicStats, Prefetch, SegmentRef};
use crate::sampling::{Sampler, SamplingParams};
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// A generation request (already tokenised into segments).
#[derive(Clone, Debug)]
pub struct GenRequest {
    /// Ordered segments; the last is the query and is always computed.
    pub segments: Vec<SegmentRef>,
    /// Reuse mode.
    pub mode: Mode,
    /// Tenant (scopes the private pool).
    pub tenant: String,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Maximum new tokens (≥ 1).
    pub max_tokens: usize,
    /// Token ids that end generation (EOS); the stop token itself is not emitted.
    pub stop_token_ids: Vec<u32>,
    /// Number of top alternatives whose log-probabilities each token event carries.
    pub top_logprobs: usize,
    /// Whether token events carry the token's log-probability (and the
    /// `top_logprobs` alternatives). When false, and the sampling has no logit
    /// processor, the engine may draw the token itself (on the device,
    /// [`Engine::decode_sample`]) and the event's `logprob` is NaN.
    pub logprobs: bool,
    /// Offline evaluation (`hypic eval`; `None` when serving): a continuation to
    /// score teacher-forced from the prompt's state. The worker forks the state
    /// after the prefill ([`Engine::clone_state`]), feeds these tokens through the
    /// batched decode step, and sends [`GenEvent::Scored`] (with the prompt's
    /// last-token logits) before the first generated token; generation then goes
    /// on from the unforked state, so the generated tokens are those of a request
    /// without `score`. The fork's KV counts against the KV budget.
    pub score: Option<Vec<u32>>,
}

/// Why a sequence finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token was produced.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Cancelled by the client.
    Cancelled,
}

/// Error kinds reported on a request's event stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Waited in the queue longer than the configured timeout.
    QueueTimeout,
    /// The request itself is invalid (e.g. a token outside the vocabulary).
    InvalidRequest,
    /// It can never fit the KV budget.
    TooLarge,
    /// Anything else from the engine.
    Internal,
}

/// Events of one request, in order: `Started`, (`Scored` when the request asked
/// for it), then `Token`s, then `Done` — or a single `Error` (which may also follow
/// `Started` or `Token`s when the device fails).
#[derive(Clone, Debug)]
pub enum GenEvent {
    /// Prefill finished.
    Started {
        /// PIC statistics (per-segment hits/misses, tokens computed/reused).
        stats: PicStats,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Time from submission to the first token.
        ttft: Duration,
        /// Time spent queued.
        queued: Duration,
        /// The scheduler step that finished the prefill (steps count from 1 at
        /// the worker's start; see [`SchedulerMetrics::steps`]).
        step: u64,
        /// The step that admitted the request (its prefill ran in the steps
        /// `admitted_step..=step`).
        admitted_step: u64,
    },
    /// The scored continuation of [`GenRequest::score`] (only for such a request,
    /// after `Started` and before the first `Token`).
    Scored {
        /// Logits of the prompt's last token, `[vocab]` (host, fp32).
        prompt_logits: Vec<f32>,
        /// Negative log-likelihood (nats, computed in f64 from the logits) of each
        /// continuation token given the prompt and the tokens before it.
        token_nll: Vec<f64>,
    },
    /// One generated token.
    Token {
        /// Token id.
        id: u32,
        /// Its log-probability under the (unfiltered, temperature-1) distribution;
        /// NaN when the request asked for no log-probabilities
        /// ([`GenRequest::logprobs`]) and the engine drew the token itself.
        logprob: f32,
        /// The `top_logprobs` most likely tokens and their log-probabilities.
        top: Vec<(u32, f32)>,
        /// The scheduler step that produced it.
        step: u64,
    },
    /// Generation ended.
    Done {
        /// Why.
        reason: FinishReason,
        /// Tokens generated.
        generated: usize,
    },
    /// The request failed.
    Error {
        /// Kind (maps to an HTTP status).
        kind: ErrorKind,
        /// Message.
        message: String,
    },
}

/// Default [`SchedulerConfig::step_tokens`].
pub const DEFAULT_STEP_TOKENS: usize = 512;
/// Default [`SchedulerConfig::prefill_chunk_tokens`].
pub const DEFAULT_PREFILL_CHUNK_TOKENS: usize = 256;

/// Scheduler settings.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Requests that may wait in the queue.
    pub queue_capacity: usize,
    /// Recurrent-state slots: sequences decoding at once.
    pub max_running: usize,
    /// Budget for KV reservations of running sequences, bytes.
    pub kv_budget_bytes: usize,
    /// Longest a request may wait in the queue.
    pub queue_timeout: Duration,
    /// Token budget of one scheduler step: decode tokens of the running sequences
    /// plus pieces of pending prefills (≥ 1). The oldest prefill gets one piece per
    /// step even when the decode tokens fill it (a piece is a multiple of
    /// [`crate::pic::engine::PREFILL_ALIGN`] tokens unless it ends a segment).
    pub step_tokens: usize,
    /// Most prompt tokens one prefill takes in a step's first pass over the pending
    /// prefills (≥ 1), so that the prefills behind a long one get theirs in the
    /// same step; the budget left after that pass goes again in admission order.
    pub prefill_chunk_tokens: usize,
    /// Whether the pieces of several requests' computed segments in one step run as
    /// one batched forward ([`Engine::advance_computed_many`]); off, each request's
    /// piece runs alone.
    pub batch_prefills: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            queue_capacity: 64,
            max_running: 16,
            kv_budget_bytes: 2 << 30,
            queue_timeout: Duration::from_secs(30),
            step_tokens: DEFAULT_STEP_TOKENS,
            prefill_chunk_tokens: DEFAULT_PREFILL_CHUNK_TOKENS,
            batch_prefills: true,
        }
    }
}

/// Why a submission was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SubmitError {
    /// The queue is full; retry after about this long.
    #[error("the request queue is full ({capacity} waiting); retry after {retry_after_s} s")]
    QueueFull {
        /// Queue capacity.
        capacity: usize,
        /// Suggested wait in seconds.
        retry_after_s: u64,
    },
    /// Invalid request.
    #[error("{0}")]
    Invalid(String),
    /// The scheduler has shut down.
    #[error("the scheduler is not running")]
    Closed,
}

/// Handle of a submitted request: its event stream. Dropping it cancels the request.
pub struct RequestHandle {
    /// Events (see [`GenEvent`]).
    pub events: mpsc::UnboundedReceiver<GenEvent>,
    cancel: Arc<AtomicBool>,
}

impl RequestHandle {
    /// Cancels the request; its state is freed at the worker's next step.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

/// Live counters (read by metrics).
#[derive(Debug, Default)]
pub struct SchedulerMetrics {
    /// Requests waiting.
    pub queue_depth: AtomicUsize,
    /// Sequences decoding.
    pub running: AtomicUsize,
    /// KV bytes reserved by running sequences.
    pub kv_reserved_bytes: AtomicUsize,
    /// Recurrent/KV state bytes actually held by running sequences.
    pub state_bytes: AtomicUsize,
    /// Requests finished (any reason).
    pub finished: AtomicU64,
    /// Requests cancelled.
    pub cancelled: AtomicU64,
    /// Requests rejected with a full queue.
    pub rejected_queue_full: AtomicU64,
    /// Requests that timed out in the queue.
    pub queue_timeouts: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Admitted requests whose prompt is being processed.
    pub prefilling: AtomicUsize,
    /// Scheduler steps run (each: prefill pieces, then one decode step).
    pub steps: AtomicU64,
    /// Prompt tokens run through the model by prefill pieces (entry builds, seam
    /// windows and computed segments).
    pub prefill_tokens: AtomicU64,
    /// Batched forwards that ran several requests' prefill pieces together.
    pub batched_prefills: AtomicU64,
    /// Requests' pieces in those batched forwards (over all of them).
    pub batched_prefill_requests: AtomicU64,
    /// Segment registrations waiting or being built ([`Scheduler::register`]).
    pub registering: AtomicUsize,
    /// Segment tokens run through the model by registrations.
    pub registration_tokens: AtomicU64,
}

/// What [`Scheduler::register`] answers: per body start, what happened and the
/// entry's bytes (as [`crate::engine::EnginePools::prefetch_many`]), or why the
/// registration failed.
pub type Registered = crate::Result<Vec<(Prefetch, usize)>>;

/// A segment registration waiting for the worker.
struct QueuedRegistration {
    tokens: Vec<u32>,
    isolation: String,
    body_starts: Vec<usize>,
    tx: tokio::sync::oneshot::Sender<Registered>,
}

/// A segment registration being built in pieces of the step budget.
struct Registering<R> {
    job: R,
    tx: tokio::sync::oneshot::Sender<Registered>,
}

struct Queued {
    req: GenRequest,
    /// Entries of scattered cold segments, taken at admission.
    source: Option<Arc<dyn EntrySource>>,
    tx: mpsc::UnboundedSender<GenEvent>,
    cancel: Arc<AtomicBool>,
    submitted: Instant,
    reservation: usize,
}

struct Running<S> {
    state: S,
    sampler: Sampler,
    next: u32,
    generated: usize,
    max_tokens: usize,
    stop: Vec<u32>,
    top_logprobs: usize,
    /// Log-probabilities requested: the host path samples every token.
    logprobs: bool,
    tx: mpsc::UnboundedSender<GenEvent>,
    cancel: Arc<AtomicBool>,
    reservation: usize,
    /// The forked state scoring [`GenRequest::score`]; while present, decode steps
    /// feed the fork, and the generation waits.
    scoring: Option<Scoring<S>>,
    /// The current scheduler step (stamped on the events sent).
    step: u64,
}

/// An admitted request whose prompt is being processed in pieces.
struct Prefilling<P> {
    prefill: P,
    qr: Queued,
    /// Time it spent queued.
    queued: Duration,
    /// The step that admitted it.
    admitted_step: u64,
}

/// A teacher-forced continuation in progress on a forked state.
struct Scoring<S> {
    state: S,
    targets: Vec<u32>,
    /// Index of the target fed at the next decode step.
    fed: usize,
    token_nll: Vec<f64>,
    prompt_logits: Vec<f32>,
}

impl<S> Running<S> {
    /// The token and the state of this sequence's next decode step.
    fn step_input(&mut self) -> (u32, &mut S) {
        match &mut self.scoring {
            Some(sc) => (sc.targets[sc.fed], &mut sc.state),
            None => (self.next, &mut self.state),
        }
    }

    fn state_bytes<E: Engine<State = S>>(&self) -> usize {
        E::state_bytes(&self.state)
            + self
                .scoring
                .as_ref()
                .map_or(0, |sc| E::state_bytes(&sc.state))
    }
}

/// `-log softmax(logits)[t]` in f64 (`+inf` for a token outside the row).
fn token_nll(logits: &[f32], t: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln();
    logits
        .get(t as usize)
        .map_or(f64::INFINITY, |&lt| lse - lt as f64)
}

struct Shared {
    queue: Mutex<VecDeque<Queued>>,
    registrations: Mutex<VecDeque<QueuedRegistration>>,
    wake: Condvar,
    shutdown: AtomicBool,
    metrics: Arc<SchedulerMetrics>,
}

/// The scheduler: submit requests, read metrics.
pub struct Scheduler {
    shared: Arc<Shared>,
    cfg: SchedulerConfig,
    engine: Arc<dyn EnginePools>,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl Scheduler {
    /// Starts the worker thread over `engine` (CPU or GPU, see [`Engine`]).
    pub fn start<E: Engine + 'static>(engine: Arc<E>, cfg: SchedulerConfig) -> Self {
        let shared = Arc::new(Shared {
            queue: Mutex::new(VecDeque::new()),
            registrations: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
            metrics: Arc::new(SchedulerMetrics::default()),
        });
        let (s2, e2, c2) = (shared.clone(), engine.clone(), cfg.clone());
        let worker = std::thread::Builder::new()
            .name("hypic-scheduler".into())
            .spawn(move || worker_loop(s2, e2, c2))
            .expect("spawn scheduler thread");
        Scheduler {
            shared,
            cfg,
            engine,
            worker: Some(worker),
        }
    }

    /// The engine's pools and model configuration.
    pub fn engine(&self) -> &Arc<dyn EnginePools> {
        &self.engine
    }

    /// Whether the worker thread is alive and accepting requests.
    pub fn is_running(&self) -> bool {
        !self.shared.shutdown.load(Ordering::Relaxed)
            && self.worker.as_ref().is_some_and(|w| !w.is_finished())
    }

    /// Live counters.
    pub fn metrics(&self) -> Arc<SchedulerMetrics> {
        self.shared.metrics.clone()
    }

    /// Settings.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// KV bytes one token costs across all full-attention layers (K and V in the
    /// engine's KV element type: fp32 on the CPU, `f32`/`bf16` on the GPU).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.engine.kv_bytes_per_token()
    }

    /// Queues a request.
    ///
    /// Errors: [`SubmitError::Invalid`] (no segments, empty segment, `max_tokens` 0,
    /// prompt + `max_tokens` over the context limit, a reservation larger than the
    /// whole KV budget), [`SubmitError::QueueFull`].
    pub fn submit(&self, req: GenRequest) -> Result<RequestHandle, SubmitError> {
        self.submit_with_source(req, None)
    }

    /// [`Scheduler::submit`] with the entries of the request's scattered cold
    /// segments supplied by `source` ([`Engine::begin_with`]); the source is
    /// dropped with the request (done, failed or cancelled), which cancels what of
    /// the scatter still runs.
    ///
    /// Errors: as [`Scheduler::submit`].
    pub fn submit_with_source(
        &self,
        req: GenRequest,
        source: Option<Arc<dyn EntrySource>>,
    ) -> Result<RequestHandle, SubmitError> {
        if self.shared.shutdown.load(Ordering::Relaxed) {
            return Err(SubmitError::Closed);
        }
        if req.segments.is_empty() {
            return Err(SubmitError::Invalid("the prompt has no segments".into()));
        }
        if let Some(i) = req.segments.iter().position(|s| s.tokens.is_empty()) {
            return Err(SubmitError::Invalid(format!("segment {i} is empty")));
        }
        if req.max_tokens == 0 {
            return Err(SubmitError::Invalid("max_tokens must be at least 1".into()));
        }
        let c = self.engine.config();
        let prompt: usize = req.segments.iter().map(|s| s.tokens.len()).sum();
        if prompt + req.max_tokens > c.max_position_embeddings {
            return Err(SubmitError::Invalid(format!(
                "prompt ({prompt} tokens) plus max_tokens ({}) exceeds the context limit of {} tokens",
                req.max_tokens, c.max_position_embeddings
            )));
        }
        if let Some(t) = req
            .segments
            .iter()
            .flat_map(|s| &s.tokens)
            .chain(req.score.iter().flatten())
            .find(|&&t| t as usize >= c.vocab_size)
        {
            return Err(SubmitError::Invalid(format!(
                "token id {t} is outside the vocabulary"
            )));
        }
        let scored = req.score.as_ref().map_or(0, |s| s.len());
        if prompt + scored > c.max_position_embeddings {
            return Err(SubmitError::Invalid(format!(
                "prompt ({prompt} tokens) plus the scored continuation ({scored}) exceeds the context limit of {} tokens",
                c.max_position_embeddings
            )));
        }
        // The fork of a scored request holds a second copy of the prompt's KV.
        let fork = if req.score.is_some() {
            prompt + scored
        } else {
            0
        };
        let reservation = (prompt + req.max_tokens + fork) * self.kv_bytes_per_token();
        if reservation > self.cfg.kv_budget_bytes {
            return Err(SubmitError::Invalid(format!(
                "the request needs {reservation} bytes of KV, over the budget of {}",
                self.cfg.kv_budget_bytes
            )));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        {
            let mut q = self.shared.queue.lock().unwrap_or_else(|p| p.into_inner());
            if q.len() >= self.cfg.queue_capacity {
                self.shared
                    .metrics
                    .rejected_queue_full
                    .fetch_add(1, Ordering::Relaxed);
                return Err(SubmitError::QueueFull {
                    capacity: self.cfg.queue_capacity,
                    retry_after_s: 1,
                });
            }
            q.push_back(Queued {
                req,
                source,
                tx,
                cancel: cancel.clone(),
                submitted: Instant::now(),
                reservation,
            });
            self.shared
                .metrics
                .queue_depth
                .store(q.len(), Ordering::Relaxed);
        }
        self.shared.wake.notify_one();
        Ok(RequestHandle { events: rx, cancel })
    }
}

impl Scheduler {
    /// Queues a segment registration: the public-pool entries of `tokens` under
    /// `isolation` for each of `body_starts` are built by the worker in pieces of its
    /// step budget, beside the running sequences' decode steps (a long segment no
    /// longer holds the model for its whole prefill), and offered to the pool. The
    /// answer comes on the returned channel; dropping it abandons the registration
    /// at the worker's next step.
    ///
    /// Errors: [`SubmitError::Invalid`] (empty segment, a token outside the
    /// vocabulary, longer than the context limit), [`SubmitError::QueueFull`] when
    /// `queue_capacity` registrations wait, [`SubmitError::Closed`].
    pub fn register(
        &self,
        tokens: Vec<u32>,
        isolation: String,
        body_starts: Vec<usize>,
    ) -> Result<tokio::sync::oneshot::Receiver<Registered>, SubmitError> {
        if self.shared.shutdown.load(Ordering::Relaxed) || !self.is_running() {
            return Err(SubmitError::Closed);
        }
        let c = self.engine.config();
        if tokens.is_empty() {
            return Err(SubmitError::Invalid("the segment is empty".into()));
        }
        if tokens.len() > c.max_position_embeddings {
            return Err(SubmitError::Invalid(format!(
                "the segment ({} tokens) exceeds the context limit of {} tokens",
                tokens.len(),
                c.max_position_embeddings
            )));
        }
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(SubmitError::Invalid(format!(
                "token id {t} is outside the vocabulary"
            )));
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        {
            let mut q = self
                .shared
                .registrations
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if q.len() >= self.cfg.queue_capacity {
                return Err(SubmitError::QueueFull {
                    capacity: self.cfg.queue_capacity,
                    retry_after_s: 1,
                });
            }
            q.push_back(QueuedRegistration {
                tokens,
                isolation,
                body_starts,
                tx,
            });
        }
        self.shared
            .metrics
            .registering
            .fetch_add(1, Ordering::Relaxed);
        self.shared.wake.notify_one();
        Ok(rx)
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Relaxed);
        self.shared.wake.notify_all();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// Log-probabilities (log-softmax) of `logits`.
fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + logits.iter().map(|x| (x - m).exp()).sum::<f32>().ln();
    logits.iter().map(|x| x - lse).collect()
}

fn token_event(logits: &[f32], id: u32, top: usize, step: u64) -> GenEvent {
    let lp = log_softmax(logits);
    let mut topv = vec![];
    if top > 0 {
        let mut idx: Vec<usize> = (0..lp.len()).collect();
        idx.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]));
        topv = idx
            .into_iter()
            .take(top)
            .map(|i| (i as u32, lp[i]))
            .collect();
    }
    GenEvent::Token {
        id,
        logprob: lp.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY),
        top: topv,
        step,
    }
}

fn worker_loop<E: Engine>(shared: Arc<Shared>, engine: Arc<E>, cfg: SchedulerConfig) {
    let metrics = shared.metrics.clone();
    let mut running: Vec<Running<E::State>> = vec![];
    let mut prefilling: VecDeque<Prefilling<E::Prefill>> = VecDeque::new();
    let mut registering: VecDeque<Registering<E::Registration>> = VecDeque::new();
    let mut reserved = 0usize;
    let mut step = 0u64;
    let step_tokens = cfg.step_tokens.max(1);
    let chunk_tokens = cfg.prefill_chunk_tokens.max(1);
    loop {
        if shared.shutdown.load(Ordering::Relaxed) {
            return;
        }
        // 1. Admission: expire timed-out and cancelled requests, admit in order
        //    while a slot is free and the KV reservation fits.
        let admitted = {
            let mut q = shared.queue.lock().unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            q.retain(|r| {
                if r.cancel.load(Ordering::Relaxed) || r.tx.is_closed() {
                    metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    return false;
                }
                if now.duration_since(r.submitted) > cfg.queue_timeout {
                    metrics.queue_timeouts.fetch_add(1, Ordering::Relaxed);
                    let _ = r.tx.send(GenEvent::Error {
                        kind: ErrorKind::QueueTimeout,
                        message: format!(
                            "the request waited longer than {:?} in the queue",
                            cfg.queue_timeout
                        ),
                    });
                    return false;
                }
                true
            });
            let mut out = vec![];
            let mut held = reserved;
            while let Some(r) = q.front() {
                let slots = running.len() + prefilling.len() + out.len();
                if slots >= cfg.max_running || held + r.reservation > cfg.kv_budget_bytes {
                    break;
                }
                held += r.reservation;
                out.extend(q.pop_front());
            }
            metrics.queue_depth.store(q.len(), Ordering::Relaxed);
            // Registrations need no slot or KV; at most `queue_capacity` are in
            // progress (the rest wait in their queue, which is bounded too).
            let regs: Vec<QueuedRegistration> = {
                let mut rq = shared
                    .registrations
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                let room = cfg.queue_capacity.saturating_sub(registering.len());
                let take = room.min(rq.len());
                rq.drain(..take).collect()
            };
            for r in regs {
                if r.tx.is_closed() {
                    metrics.registering.fetch_sub(1, Ordering::Relaxed);
                    continue;
                }
                let begun = registration_guard(|| {
                    engine.register_begin(r.tokens, &r.isolation, &r.body_starts)
                });
                match begun {
                    Ok(job) => registering.push_back(Registering { job, tx: r.tx }),
                    Err(e) => {
                        metrics.registering.fetch_sub(1, Ordering::Relaxed);
                        let _ = r.tx.send(Err(e));
                    }
                }
            }
            if out.is_empty()
                && running.is_empty()
                && prefilling.is_empty()
                && registering.is_empty()
            {
                // Idle: sleep until a submission (or re-check timeouts periodically).
                let _unused = shared
                    .wake
                    .wait_timeout(q, Duration::from_millis(50))
                    .map(|(g, _)| drop(g));
                continue;
            }
            out
        };
        step += 1;
        for mut qr in admitted {
            let queued = qr.submitted.elapsed();
            let begun = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                engine.begin_with(
                    &qr.req.segments,
                    qr.req.mode,
                    &qr.req.tenant,
                    qr.source.take(),
                )
            }));
            match begun.map_err(|p| {
                crate::Error::Device(format!("prefill failed: {}", panic_message(&*p)))
            }) {
                Ok(Ok(prefill)) => {
                    reserved += qr.reservation;
                    prefilling.push_back(Prefilling {
                        prefill,
                        qr,
                        queued,
                        admitted_step: step,
                    });
                }
                Ok(Err(e)) | Err(e) => {
                    let _ = qr.tx.send(prefill_error(e));
                    metrics.finished.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        // 2. Cancelled prefills leave before any more work is spent on them.
        prefilling.retain(|p| {
            if p.qr.cancel.load(Ordering::Relaxed) || p.qr.tx.is_closed() {
                let _ = p.qr.tx.send(GenEvent::Done {
                    reason: FinishReason::Cancelled,
                    generated: 0,
                });
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                metrics.finished.fetch_add(1, Ordering::Relaxed);
                reserved -= p.qr.reservation;
                return false;
            }
            true
        });
        // 3. Prefill pieces within the step's budget (the decode tokens of the
        //    running sequences count first), in admission order: a first pass with
        //    at most `chunk_tokens` each, a second with what is left; the oldest
        //    always gets a piece. With `batch_prefills`, the first pass takes each
        //    request up to its next segment computed in place (prefix match, builds
        //    and compositions within its share) and reserves that segment's piece
        //    (its query, above all); the reserved pieces run as one batched forward
        //    (projections and FFN over all their rows) before the second pass.
        let mut left = step_tokens.saturating_sub(running.len());
        let mut spent = 0usize;
        // What became of each prefill this step: done (its output) or failed.
        let mut ended: Vec<Option<crate::Result<crate::engine::EngineOutput<E::State>>>> =
            (0..prefilling.len()).map(|_| None).collect();
        // (prefill, piece tokens, whether it is the head's must-run piece).
        let mut batch: Vec<(usize, usize, bool)> = vec![];
        for pass in 0..2 {
            for k in 0..prefilling.len() {
                if ended[k].is_some() || (pass == 0 && batch.iter().any(|b| b.0 == k)) {
                    continue;
                }
                // The oldest prefill still going, before anything ran this step.
                let head = spent == 0 && ended[..k].iter().all(|e| e.is_some());
                if left == 0 && !head {
                    break;
                }
                let give = if pass == 0 {
                    left.min(chunk_tokens)
                } else {
                    left
                };
                // The budget and progress of this prefill's call to `advance` below.
                let (budget, progress) = if pass == 0 && cfg.batch_prefills {
                    // A request yet to match its prefix whose prompt starts like an
                    // earlier one still going waits for the second pass, after that one
                    // (and the batch) ran and stored its snapshots, as it would behind
                    // it alone.
                    let p = &prefilling[k].prefill;
                    if engine.before_prefix(p) {
                        if let Some(g) = engine.prefix_group(p) {
                            if (0..k).any(|j| {
                                ended[j].is_none()
                                    && engine.prefix_group(&prefilling[j].prefill) == Some(g)
                            }) {
                                continue;
                            }
                        }
                    }
                    let p = &mut prefilling[k];
                    // Up to its next computed segment (prefix match, lookups, builds
                    // and compositions within the piece's budget), then that segment's
                    // piece is reserved for the batch.
                    let used = match prefill_guard(|| {
                        engine.advance_to_computed(&mut p.prefill, give.max(1), head)
                    }) {
                        Ok(used) => used,
                        Err(e) => {
                            ended[k] = Some(Err(e));
                            continue;
                        }
                    };
                    spent += used;
                    left = left.saturating_sub(used);
                    metrics
                        .prefill_tokens
                        .fetch_add(used as u64, Ordering::Relaxed);
                    if let Some(out) = engine.finish(&mut p.prefill) {
                        ended[k] = Some(Ok(out));
                        continue;
                    }
                    let (rest, must) = (give.saturating_sub(used), head && used == 0);
                    if let Some(n) =
                        engine.computed_piece(&p.prefill, rest.max(must as usize), must)
                    {
                        batch.push((k, n, must));
                        spent += n;
                        left = left.saturating_sub(n);
                        continue;
                    }
                    // Not batched. Stopped anywhere but at a computed segment, it
                    // stopped where `advance` would have (a second call would only
                    // wait again on a pending shipped entry); at one (the engine does
                    // not batch, or no piece fits), it goes on alone with its share.
                    if !engine.at_computed(&p.prefill) {
                        continue;
                    }
                    (rest, must)
                } else {
                    (give.max(1), head)
                };
                let p = &mut prefilling[k];
                match prefill_guard(|| engine.advance(&mut p.prefill, budget, progress)) {
                    Ok(used) => {
                        spent += used;
                        left = left.saturating_sub(used);
                        metrics
                            .prefill_tokens
                            .fetch_add(used as u64, Ordering::Relaxed);
                        ended[k] = engine.finish(&mut p.prefill).map(Ok);
                    }
                    Err(e) => ended[k] = Some(Err(e)),
                }
            }
            run_prefill_batch(&*engine, &mut prefilling, &mut batch, &mut ended, &metrics);
        }
        // Prefills that ended leave the queue, in admission order.
        let mut k = 0;
        for out in ended {
            let Some(out) = out else {
                k += 1;
                continue;
            };
            let pf = prefilling.remove(k).expect("index in range");
            reserved -= pf.qr.reservation;
            match out {
                Err(e) => {
                    let _ = pf.qr.tx.send(prefill_error(e));
                    metrics.finished.fetch_add(1, Ordering::Relaxed);
                }
                Ok(out) => {
                    if let Some(r) = start_sequence(&*engine, pf, out, step, &metrics) {
                        reserved += r.reservation;
                        running.push(r);
                    }
                }
            }
        }
        metrics
            .prefilling
            .store(prefilling.len(), Ordering::Relaxed);
        // 3b. Segment registrations, in arrival order, from the budget left; the
        //     oldest gets one piece per step even when nothing is left (so a
        //     registration waits a bounded time and never holds the model longer
        //     than one piece).
        let mut k = 0;
        while k < registering.len() {
            let head = k == 0;
            if left == 0 && !head {
                break;
            }
            let r = &mut registering[k];
            if r.tx.is_closed() {
                registering.remove(k);
                metrics.registering.fetch_sub(1, Ordering::Relaxed);
                continue;
            }
            let res = registration_guard(|| engine.register_advance(&mut r.job, left, head));
            let done = match res {
                Ok(used) => {
                    left = left.saturating_sub(used);
                    metrics
                        .registration_tokens
                        .fetch_add(used as u64, Ordering::Relaxed);
                    if E::register_built(&r.job) {
                        None
                    } else {
                        k += 1;
                        continue;
                    }
                }
                Err(e) => Some(e),
            };
            let r = registering.remove(k).expect("index in range");
            metrics.registering.fetch_sub(1, Ordering::Relaxed);
            let answer = match done {
                Some(e) => Err(e),
                None => registration_guard(|| engine.register_finish(r.job)),
            };
            let _ = r.tx.send(answer);
        }
        // 4. One batched decode step for every running sequence.
        let mut live = Vec::with_capacity(running.len());
        for r in running.drain(..) {
            if r.cancel.load(Ordering::Relaxed) || r.tx.is_closed() {
                let _ = r.tx.send(GenEvent::Done {
                    reason: FinishReason::Cancelled,
                    generated: r.generated,
                });
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                metrics.finished.fetch_add(1, Ordering::Relaxed);
                reserved -= r.reservation;
            } else {
                live.push(r);
            }
        }
        let mut keep = Vec::with_capacity(live.len());
        if !live.is_empty() {
            let mut tokens = Vec::with_capacity(live.len());
            let step_result = {
                let mut states: Vec<&mut E::State> = Vec::with_capacity(live.len());
                // Rows the engine may draw itself: no scoring, no logprobs, no
                // processors (the host path samples the others from their logits).
                let draws: Vec<_> = live
                    .iter()
                    .map(|r| {
                        (r.scoring.is_none() && !r.logprobs)
                            .then(|| r.sampler.device_draw())
                            .flatten()
                    })
                    .collect();
                for r in live.iter_mut() {
                    r.step = step;
                    let (t, s) = r.step_input();
                    tokens.push(t);
                    states.push(s);
                }
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    engine.decode_sample(&tokens, &mut states, &draws)
                }))
                .unwrap_or_else(|p| {
                    Err(crate::Error::Input(format!(
                        "decode failed: {}",
                        panic_message(&*p)
                    )))
                })
            };
            match step_result {
                Ok(all_rows) => {
                    for (mut r, row) in live.into_iter().zip(all_rows) {
                        let logits = match row {
                            Decoded::Logits(l) => l,
                            Decoded::Token(t) if r.scoring.is_none() => {
                                r.next = t;
                                if let Err(e) = r.sampler.accept(t) {
                                    let _ = r.tx.send(constraint_error(&e));
                                    metrics.finished.fetch_add(1, Ordering::Relaxed);
                                    reserved -= r.reservation;
                                    continue;
                                }
                                if emit(&mut r, None, &metrics) {
                                    keep.push(r);
                                } else {
                                    reserved -= r.reservation;
                                }
                                continue;
                            }
                            Decoded::Token(_) => {
                                let _ = r.tx.send(GenEvent::Error {
                                    kind: ErrorKind::Internal,
                                    message: "decode returned a token for a scoring row".into(),
                                });
                                metrics.finished.fetch_add(1, Ordering::Relaxed);
                                reserved -= r.reservation;
                                continue;
                            }
                        };
                        if let Some(sc) = r.scoring.as_mut() {
                            sc.fed += 1;
                            sc.token_nll.push(token_nll(&logits, sc.targets[sc.fed]));
                            if sc.fed + 1 < sc.targets.len() {
                                keep.push(r);
                                continue;
                            }
                            let sc = r.scoring.take().expect("scoring in progress");
                            if scored(&mut r, sc.prompt_logits, sc.token_nll, &metrics) {
                                keep.push(r);
                            } else {
                                reserved -= r.reservation;
                            }
                            continue;
                        }
                        r.next = match r.sampler.try_sample(&logits) {
                            Ok(t) => t,
                            Err(e) => {
                                let _ = r.tx.send(constraint_error(&e));
                                metrics.finished.fetch_add(1, Ordering::Relaxed);
                                reserved -= r.reservation;
                                continue;
                            }
                        };
                        if emit(&mut r, Some(&logits), &metrics) {
                            keep.push(r);
                        } else {
                            reserved -= r.reservation;
                        }
                    }
                }
                Err(e) => {
                    for r in live {
                        let _ = r.tx.send(GenEvent::Error {
                            kind: ErrorKind::Internal,
                            message: e.to_string(),
                        });
                        metrics.finished.fetch_add(1, Ordering::Relaxed);
                        reserved -= r.reservation;
                    }
                }
            }
        }
        running = keep;
        metrics.steps.store(step, Ordering::Relaxed);
        metrics.running.store(running.len(), Ordering::Relaxed);
        metrics.kv_reserved_bytes.store(reserved, Ordering::Relaxed);
        metrics.state_bytes.store(
            running.iter().map(|r| r.state_bytes::<E>()).sum(),
            Ordering::Relaxed,
        );
    }
}

/// The error event of a failed prefill: a device failure is internal, anything else
/// (an invalid request) the client's.
fn prefill_error(e: crate::Error) -> GenEvent {
    let kind = match e {
        crate::Error::Device(_) => ErrorKind::Internal,
        _ => ErrorKind::InvalidRequest,
    };
    GenEvent::Error {
        kind,
        message: e.to_string(),
    }
}

/// A prefill is done: samples the first token from the prompt's logits, sends
/// `Started` (and, for a scored request, starts scoring or sends `Scored`) and the
/// first token. Returns the running sequence, or `None` when it already ended
/// (stop token, `max_tokens` 1, a constraint failure, a failed fork).
fn start_sequence<E: Engine>(
    engine: &E,
    pf: Prefilling<E::Prefill>,
    out: crate::engine::EngineOutput<E::State>,
    step: u64,
    metrics: &SchedulerMetrics,
) -> Option<Running<E::State>> {
    let Prefilling {
        mut qr,
        queued,
        admitted_step,
        ..
    } = pf;
    // Per-sequence processor state: the prompt (for the repetition penalty) and the
    // stop tokens (masked until `min_tokens`).
    let prompt: Vec<u32> = if qr.req.sampling.repetition_penalty != 1.0 {
        qr.req
            .segments
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect()
    } else {
        Vec::new()
    };
    let mut sampler =
        Sampler::with_context(qr.req.sampling.clone(), &prompt, &qr.req.stop_token_ids);
    let next = match sampler.try_sample(&out.logits) {
        Ok(t) => t,
        Err(e) => {
            let _ = qr.tx.send(constraint_error(&e));
            metrics.finished.fetch_add(1, Ordering::Relaxed);
            return None;
        }
    };
    let prompt_tokens = qr.req.segments.iter().map(|s| s.tokens.len()).sum();
    let _ = qr.tx.send(GenEvent::Started {
        stats: out.stats,
        prompt_tokens,
        ttft: qr.submitted.elapsed(),
        queued,
        step,
        admitted_step,
    });
    let mut r = Running {
        state: out.state,
        sampler,
        next,
        generated: 0,
        max_tokens: qr.req.max_tokens,
        stop: qr.req.stop_token_ids.clone(),
        top_logprobs: qr.req.top_logprobs,
        logprobs: qr.req.logprobs || qr.req.top_logprobs > 0,
        tx: qr.tx,
        cancel: qr.cancel,
        reservation: qr.reservation,
        scoring: None,
        step,
    };
    let go_on = match qr.req.score.take() {
        None => emit(&mut r, Some(&out.logits), metrics),
        Some(targets) => start_scoring(engine, &mut r, targets, out.logits, metrics),
    };
    go_on.then_some(r)
}

/// The error event of a sequence whose constraint failed (see [`Sampler::try_sample`]).
/// Runs the prefill pieces reserved in `batch` (`(index in prefilling, tokens,
/// head)`) and empties it: one batched forward for two or more, the plain
/// [`Engine::advance`] for one. Marks the prefills that ended (done or failed) in
/// `ended`; an error fails every prefill of the batch.
fn run_prefill_batch<E: Engine>(
    engine: &E,
    prefilling: &mut VecDeque<Prefilling<E::Prefill>>,
    batch: &mut Vec<(usize, usize, bool)>,
    ended: &mut [Option<crate::Result<crate::engine::EngineOutput<E::State>>>],
    metrics: &SchedulerMetrics,
) {
    if batch.is_empty() {
        return;
    }
    let res = if let [(k, n, head)] = batch[..] {
        // Alone: the plain path (its budget is exactly the piece).
        prefill_guard(|| engine.advance(&mut prefilling[k].prefill, n, head))
    } else {
        let ks: Vec<usize> = batch.iter().map(|b| b.0).collect();
        let pieces: Vec<usize> = batch.iter().map(|b| b.1).collect();
        let mut jobs: Vec<&mut E::Prefill> = prefilling
            .iter_mut()
            .enumerate()
            .filter(|(k, _)| ks.contains(k))
            .map(|(_, p)| &mut p.prefill)
            .collect();
        metrics.batched_prefills.fetch_add(1, Ordering::Relaxed);
        metrics
            .batched_prefill_requests
            .fetch_add(ks.len() as u64, Ordering::Relaxed);
        prefill_guard(|| engine.advance_computed_many(&mut jobs, &pieces))
    };
    match res {
        Ok(used) => {
            metrics
                .prefill_tokens
                .fetch_add(used as u64, Ordering::Relaxed);
            for &(k, _, _) in batch.iter() {
                ended[k] = engine.finish(&mut prefilling[k].prefill).map(Ok);
            }
        }
        Err(e) => {
            // The batch shares the error (its kind kept).
            for &(k, _, _) in batch.iter() {
                ended[k] = Some(Err(match &e {
                    crate::Error::Input(m) => crate::Error::Input(m.clone()),
                    crate::Error::Device(m) => crate::Error::Device(m.clone()),
                    other => crate::Error::Device(other.to_string()),
                }));
            }
        }
    }
    batch.clear();
}

/// Runs a prefill call, turning a panic in the engine into an error of that call.
fn prefill_guard<T>(f: impl FnOnce() -> crate::Result<T>) -> crate::Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        Err(crate::Error::Device(format!(
            "prefill failed: {}",
            panic_message(&*p)
        )))
    })
}

fn constraint_error(message: &str) -> GenEvent {
    GenEvent::Error {
        kind: ErrorKind::Internal,
        message: format!("constrained decoding failed: {message}"),
    }
}

/// Runs one step of a segment registration, turning a panic into a device error (the
/// worker thread and the running sequences survive it).
fn registration_guard<T>(f: impl FnOnce() -> crate::Result<T>) -> crate::Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        Err(crate::Error::Device(format!(
            "segment registration failed: {}",
            panic_message(&*p)
        )))
    })
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

/// Starts scoring `targets` for the freshly prefilled `r` (`logits`: the prompt's
/// last-token logits, which score the first target): forks its state unless the
/// prompt's logits score everything, in which case `Scored` and the first token go
/// out at once. Returns whether the sequence continues.
fn start_scoring<E: Engine>(
    engine: &E,
    r: &mut Running<E::State>,
    targets: Vec<u32>,
    logits: Vec<f32>,
    metrics: &SchedulerMetrics,
) -> bool {
    let nll: Vec<f64> = targets
        .first()
        .map(|&t| token_nll(&logits, t))
        .into_iter()
        .collect();
    if targets.len() <= 1 {
        return scored(r, logits, nll, metrics);
    }
    let fork = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        engine.clone_state(&r.state)
    }))
    .unwrap_or_else(|p| {
        Err(crate::Error::Device(format!(
            "forking the state failed: {}",
            panic_message(&*p)
        )))
    });
    match fork {
        Ok(state) => {
            r.scoring = Some(Scoring {
                state,
                targets,
                fed: 0,
                token_nll: nll,
                prompt_logits: logits,
            });
            true
        }
        Err(e) => {
            let _ = r.tx.send(GenEvent::Error {
                kind: ErrorKind::Internal,
                message: e.to_string(),
            });
            metrics.finished.fetch_add(1, Ordering::Relaxed);
            false
        }
    }
}

/// Sends `Scored`, then the sequence's first token (sampled from `prompt_logits` at
/// admission); returns whether the sequence continues.
fn scored<S>(
    r: &mut Running<S>,
    prompt_logits: Vec<f32>,
    token_nll: Vec<f64>,
    metrics: &SchedulerMetrics,
) -> bool {
    let logits = prompt_logits.clone();
    let _ = r.tx.send(GenEvent::Scored {
        prompt_logits,
        token_nll,
    });
    emit(r, Some(&logits), metrics)
}

/// Emits `r.next` (sampled from `logits`, or drawn by the engine when `None`: its
/// event's `logprob` is NaN) unless it is a stop token; returns whether the sequence
/// continues.
fn emit<S>(r: &mut Running<S>, logits: Option<&[f32]>, metrics: &SchedulerMetrics) -> bool {
    // Counters move before the last event is sent, so a client that has its answer
    // reads them updated.
    if r.stop.contains(&r.next) {
        metrics.finished.fetch_add(1, Ordering::Relaxed);
        let _ = r.tx.send(GenEvent::Done {
            reason: FinishReason::Stop,
            generated: r.generated,
        });
        return false;
    }
    r.generated += 1;
    metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
    let event = match logits {
        Some(l) => token_event(l, r.next, r.top_logprobs, r.step),
        None => GenEvent::Token {
            id: r.next,
            logprob: f32::NAN,
            top: vec![],
            step: r.step,
        },
    };
    if r.tx.send(event).is_err() {
        metrics.cancelled.fetch_add(1, Ordering::Relaxed);
        metrics.finished.fetch_add(1, Ordering::Relaxed);
        return false;
    }
    if r.generated >= r.max_tokens {
        metrics.finished.fetch_add(1, Ordering::Relaxed);
        let _ = r.tx.send(GenEvent::Done {
            reason: FinishReason::Length,
            generated: r.generated,
        });
        return false;
    }
    true
}
