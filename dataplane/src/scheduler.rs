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
//! * Each iteration prefills at most one new request, then runs one batched decode
//!   step over every running sequence ([`Engine::decode_batch`]: on the CPU
//!   `Model::decode_batch`, on the GPU `GpuModel::decode_batch`). Tokens are sampled
//!   on the host from the returned logits with [`Sampler`] on both backends; each
//!   running sequence owns its sampler, so penalties, `logit_bias`, `min_tokens` and
//!   a constraint (structured output) are per request within a batch; a constraint
//!   that fails ends its sequence with [`GenEvent::Error`].
//! * Cancellation: dropping the [`RequestHandle`] (client disconnect) or calling
//!   [`RequestHandle::cancel`] frees the sequence's state at the next step.
use crate::engine::{Engine, EnginePools};
use crate::pic::{Mode, PicStats, SegmentRef};
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
        /// Its log-probability under the (unfiltered, temperature-1) distribution.
        logprob: f32,
        /// The `top_logprobs` most likely tokens and their log-probabilities.
        top: Vec<(u32, f32)>,
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
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            queue_capacity: 64,
            max_running: 16,
            kv_budget_bytes: 2 << 30,
            queue_timeout: Duration::from_secs(30),
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
}

struct Queued {
    req: GenRequest,
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
    tx: mpsc::UnboundedSender<GenEvent>,
    cancel: Arc<AtomicBool>,
    reservation: usize,
    /// The forked state scoring [`GenRequest::score`]; while present, decode steps
    /// feed the fork, and the generation waits.
    scoring: Option<Scoring<S>>,
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

fn token_event(logits: &[f32], id: u32, top: usize) -> GenEvent {
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
    }
}

fn worker_loop<E: Engine>(shared: Arc<Shared>, engine: Arc<E>, cfg: SchedulerConfig) {
    let metrics = shared.metrics.clone();
    let mut running: Vec<Running<E::State>> = vec![];
    let mut reserved = 0usize;
    loop {
        if shared.shutdown.load(Ordering::Relaxed) {
            return;
        }
        // 1. Admission: expire timed-out and cancelled requests, admit at most one.
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
            let fits = |r: &Queued| {
                running.len() < cfg.max_running && reserved + r.reservation <= cfg.kv_budget_bytes
            };
            let out = if q.front().is_some_and(fits) {
                q.pop_front()
            } else {
                None
            };
            metrics.queue_depth.store(q.len(), Ordering::Relaxed);
            if out.is_none() && running.is_empty() {
                // Idle: sleep until a submission (or re-check timeouts periodically).
                let _unused = shared
                    .wake
                    .wait_timeout(q, Duration::from_millis(50))
                    .map(|(g, _)| drop(g));
                continue;
            }
            out
        };
        if let Some(mut qr) = admitted {
            let queued = qr.submitted.elapsed();
            // A panic in the engine fails this request only, never the worker
            // (which would leave every other request waiting forever).
            let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                engine.run(&qr.req.segments, qr.req.mode, &qr.req.tenant)
            }));
            let res = match res {
                Ok(r) => r.map_err(|e| {
                    let kind = match e {
                        crate::Error::Device(_) => ErrorKind::Internal,
                        _ => ErrorKind::InvalidRequest,
                    };
                    (kind, e.to_string())
                }),
                Err(p) => Err((
                    ErrorKind::Internal,
                    format!("prefill failed: {}", panic_message(&*p)),
                )),
            };
            match res {
                Err((kind, message)) => {
                    let _ = qr.tx.send(GenEvent::Error { kind, message });
                    metrics.finished.fetch_add(1, Ordering::Relaxed);
                }
                Ok(out) => 'started: {
                    // Per-sequence processor state: the prompt (for the repetition
                    // penalty) and the stop tokens (masked until `min_tokens`).
                    let prompt: Vec<u32> = if qr.req.sampling.repetition_penalty != 1.0 {
                        qr.req
                            .segments
                            .iter()
                            .flat_map(|s| s.tokens.iter().copied())
                            .collect()
                    } else {
                        Vec::new()
                    };
                    let mut sampler = Sampler::with_context(
                        qr.req.sampling.clone(),
                        &prompt,
                        &qr.req.stop_token_ids,
                    );
                    let next = match sampler.try_sample(&out.logits) {
                        Ok(t) => t,
                        Err(e) => {
                            let _ = qr.tx.send(constraint_error(&e));
                            metrics.finished.fetch_add(1, Ordering::Relaxed);
                            break 'started;
                        }
                    };
                    let prompt_tokens = qr.req.segments.iter().map(|s| s.tokens.len()).sum();
                    let _ = qr.tx.send(GenEvent::Started {
                        stats: out.stats,
                        prompt_tokens,
                        ttft: qr.submitted.elapsed(),
                        queued,
                    });
                    let mut r = Running {
                        state: out.state,
                        sampler,
                        next,
                        generated: 0,
                        max_tokens: qr.req.max_tokens,
                        stop: qr.req.stop_token_ids.clone(),
                        top_logprobs: qr.req.top_logprobs,
                        tx: qr.tx,
                        cancel: qr.cancel,
                        reservation: qr.reservation,
                        scoring: None,
                    };
                    reserved += r.reservation;
                    let go_on = match qr.req.score.take() {
                        None => emit(&mut r, &out.logits, &metrics),
                        Some(targets) => {
                            start_scoring(&*engine, &mut r, targets, out.logits, &metrics)
                        }
                    };
                    if go_on {
                        running.push(r);
                    } else {
                        reserved -= r.reservation;
                    }
                }
            }
        }
        // 2. One batched decode step for every running sequence.
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
            let step = {
                let mut states: Vec<&mut E::State> = Vec::with_capacity(live.len());
                for r in live.iter_mut() {
                    let (t, s) = r.step_input();
                    tokens.push(t);
                    states.push(s);
                }
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    engine.decode_batch(&tokens, &mut states)
                }))
                .unwrap_or_else(|p| {
                    Err(crate::Error::Input(format!(
                        "decode failed: {}",
                        panic_message(&*p)
                    )))
                })
            };
            match step {
                Ok(all_logits) => {
                    for (mut r, logits) in live.into_iter().zip(all_logits) {
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
                        if emit(&mut r, &logits, &metrics) {
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
        metrics.running.store(running.len(), Ordering::Relaxed);
        metrics.kv_reserved_bytes.store(reserved, Ordering::Relaxed);
        metrics.state_bytes.store(
            running.iter().map(|r| r.state_bytes::<E>()).sum(),
            Ordering::Relaxed,
        );
    }
}

/// The error event of a sequence whose constraint failed (see [`Sampler::try_sample`]).
fn constraint_error(message: &str) -> GenEvent {
    GenEvent::Error {
        kind: ErrorKind::Internal,
        message: format!("constrained decoding failed: {message}"),
    }
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
    emit(r, &logits, metrics)
}

/// Emits `r.next` (sampled from `logits`) unless it is a stop token; returns whether
/// the sequence continues.
fn emit<S>(r: &mut Running<S>, logits: &[f32], metrics: &SchedulerMetrics) -> bool {
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
    if r.tx
        .send(token_event(logits, r.next, r.top_logprobs))
        .is_err()
    {
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
