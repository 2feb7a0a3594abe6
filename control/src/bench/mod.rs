//! `hypic bench`: a RAG workload (Zipf document popularity, Poisson arrivals,
//! shuffled segments, shared system prompt, multi-turn sessions) or a JSONL trace,
//! replayed in-process or against a running `hypic serve`, once per reuse mode and
//! arrival rate. Reports p50/p95/p99 TTFT, throughput, cache hit ratio and the
//! highest rate whose p50 TTFT stays under the SLO; writes a results folder with a
//! summary (JSON, Markdown), every sample (JSONL) and SVG plots.
pub mod report;
pub mod workload;

use anyhow::{bail, Context};
use dataplane::engine::EnginePools;
use dataplane::pic::{Mode, SegmentRef};
use dataplane::sampling::SamplingParams;
use dataplane::scheduler::{GenEvent, GenRequest, Scheduler, SchedulerConfig, SubmitError};
use dataplane::tokenizer::Tokenizer;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use serde::Serialize;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use workload::{TraceRecord, WorkloadSpec};

use crate::backend::{DeviceArg, DtypeArg};

/// Arguments of `hypic bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Base URL of a running `hypic serve` (e.g. http://127.0.0.1:8080); default:
    /// in-process (model loaded here, no HTTP).
    #[arg(long)]
    pub url: Option<String>,
    /// Bearer token for --url.
    #[arg(long, env = "HYPIC_TOKEN")]
    pub token: Option<String>,
    /// Model folder for the in-process run (default: models/hypic-tiny).
    #[arg(long, env = "HYPIC_MODEL")]
    pub model: Option<PathBuf>,
    /// Modes, comma-separated: full_recompute, prefix_cache, naive_addition, hypic,
    /// and ablations hypic:w=N, hypic:w=N:norope.
    #[arg(
        long,
        default_value = "full_recompute,prefix_cache,naive_addition,hypic"
    )]
    pub modes: String,
    /// Arrival rates in requests/s, comma-separated (Poisson), or `trace` to use
    /// the trace file's timestamps.
    #[arg(long, default_value = "1,2,4")]
    pub rates: String,
    /// p50 TTFT target in ms for "highest rate under the SLO".
    #[arg(long, default_value_t = 1000.0)]
    pub slo_ms: f64,
    /// p99 TTFT target in ms for "highest rate under the tail SLO".
    #[arg(long, default_value_t = 2000.0)]
    pub slo_p99_ms: f64,
    /// Requests per run (generated workloads).
    #[arg(long, default_value_t = 48)]
    pub requests: usize,
    /// Documents in the corpus.
    #[arg(long, default_value_t = 24)]
    pub docs: usize,
    /// Documents per request.
    #[arg(long, default_value_t = 4)]
    pub docs_per_request: usize,
    /// Zipf exponent of document popularity.
    #[arg(long, default_value_t = 1.1)]
    pub zipf_s: f64,
    /// Words per document.
    #[arg(long, default_value_t = 160)]
    pub doc_words: usize,
    /// Words of the shared system prompt.
    #[arg(long, default_value_t = 120)]
    pub system_words: usize,
    /// Words per question.
    #[arg(long, default_value_t = 12)]
    pub query_words: usize,
    /// Fraction of requests that continue an earlier session.
    #[arg(long, default_value_t = 0.2)]
    pub multi_turn: f64,
    /// Generated tokens per request.
    #[arg(long, default_value_t = 8)]
    pub max_tokens: usize,
    /// Seed of the workload and the arrivals.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Replay this JSONL trace instead of generating a workload.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Also write the generated workload as a JSONL trace here.
    #[arg(long)]
    pub save_trace: Option<PathBuf>,
    /// Results folder (summary.json, summary.md, samples.jsonl, plots).
    #[arg(long, default_value = "results/bench")]
    pub out: PathBuf,
    /// Most requests in flight at once (the client side of the open loop).
    #[arg(long, default_value_t = 256)]
    pub max_in_flight: usize,
    /// Admission queue of the in-process scheduler.
    #[arg(long, default_value_t = 256)]
    pub queue_capacity: usize,
    /// Running sequences of the in-process scheduler.
    #[arg(long, default_value_t = 16)]
    pub max_running: usize,
    /// Backend of the in-process run: `cpu`, `cuda` (GPU 0; an error when unusable)
    /// or `auto` (CUDA when usable, else the CPU with a log line saying why), as for
    /// `hypic serve`.
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto, env = "HYPIC_DEVICE")]
    pub device: DeviceArg,
    /// Weight and activation type of the in-process run on the GPU: `f32` or `bf16`.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32, env = "HYPIC_DTYPE")]
    pub dtype: DtypeArg,
    /// Warm-up requests sent one at a time before the measured runs and not
    /// counted: they pay the one-time costs (kernels compiled on first use, pools
    /// and allocators growing) that would otherwise land on the first measured
    /// requests and queue the rest behind them. They are the workload's first
    /// requests under a salt of their own, so the measured runs cannot hit what
    /// they cached.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Before each measured (mode, rate) run, send every document the workload
    /// retrieves once, behind the system prompt, under that run's salt (not counted):
    /// the corpus is cached ahead of traffic, as a RAG knowledge base is, instead of
    /// each run starting cold. The documents are the segments between the first (the
    /// system prompt) and the last (the question) of each session's first request; a
    /// continuation's earlier answers and questions are never sent ahead. Every mode
    /// gets the same requests (the prefix cache keeps `[system, document]` prefixes).
    #[arg(long)]
    pub prime: bool,
    /// Skip the SVG plots.
    #[arg(long)]
    pub no_plots: bool,
    /// No progress bars (they are drawn on stderr only when it is a terminal).
    #[arg(long, short)]
    pub quiet: bool,
}

/// A reuse mode under test, with its label.
#[derive(Clone, Debug, Serialize)]
pub struct ModeSpec {
    /// Label in reports.
    pub label: String,
    /// Mode.
    #[serde(skip)]
    pub mode: Mode,
}

/// Parses `--modes`.
pub fn parse_modes(s: &str) -> anyhow::Result<Vec<ModeSpec>> {
    let mut out = vec![];
    for raw in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        let mut parts = raw.split(':');
        let base = parts.next().unwrap_or_default();
        let (mut w, mut rope) = (8usize, true);
        for p in parts {
            if let Some(v) = p.strip_prefix("w=") {
                w = v
                    .parse()
                    .with_context(|| format!("mode {raw}: bad seam width"))?;
            } else if p == "norope" {
                rope = false;
            } else {
                bail!("mode {raw}: unknown option {p:?} (use w=N or norope)");
            }
        }
        let mode =
            crate::serve::prompt::parse_mode(base, w, rope).map_err(|e| anyhow::anyhow!(e))?;
        out.push(ModeSpec {
            label: raw.to_string(),
            mode,
        });
    }
    if out.is_empty() {
        bail!("--modes names no mode");
    }
    Ok(out)
}

/// One request's outcome.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Sample {
    /// Mode label.
    pub mode: String,
    /// Offered rate (req/s; 0 for trace times).
    pub rate: f64,
    /// Request index in the workload.
    pub index: usize,
    /// Scheduled arrival, s.
    pub arrival_s: f64,
    /// Completed.
    pub ok: bool,
    /// HTTP-like status (200, 429, 408, …).
    pub status: u16,
    /// Error text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Time to first token, ms (from the scheduled arrival).
    pub ttft_ms: f64,
    /// Time to the last token, ms.
    pub e2e_ms: f64,
    /// Finish time since the run start, s.
    pub done_s: f64,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens reused.
    pub cached_tokens: usize,
    /// Segments served from a pool.
    pub hits: usize,
    /// Segments that missed.
    pub misses: usize,
    /// Segments in the request (the last, the query, is always computed).
    pub segments: usize,
    /// Generated tokens.
    pub generated: usize,
}

/// Where requests go.
#[derive(Clone)]
pub enum Backend {
    /// An engine and scheduler in this process.
    InProcess(Arc<InProcess>),
    /// A server over HTTP.
    Http(Arc<HttpClient>),
}

/// The in-process backend: the engine and scheduler `hypic serve` builds
/// ([`crate::runtime`]).
pub struct InProcess {
    /// Engine (cleared between runs).
    pub engine: Arc<dyn EnginePools>,
    /// Scheduler.
    pub sched: Arc<Scheduler>,
    /// Tokenizer.
    pub tok: Arc<Tokenizer>,
    cache: Mutex<HashMap<String, Arc<Vec<u32>>>>,
}

impl InProcess {
    /// Loads `model` (or the bundled default) on the backend `device` / `dtype`
    /// pick and starts a scheduler over its engine; returns it with the model id
    /// and the backend's description.
    ///
    /// Errors: as [`crate::runtime::open`] (`--device cuda` without a usable
    /// device is refused before the weights are read).
    pub fn load(
        model: Option<PathBuf>,
        device: DeviceArg,
        dtype: DtypeArg,
        cfg: SchedulerConfig,
    ) -> anyhow::Result<(Self, String, String)> {
        let dir = crate::runtime::model_dir(model)?;
        let (rt, tok) = crate::runtime::open(
            &dir,
            device,
            dtype,
            crate::runtime::PoolSizes::offline(1),
            cfg,
        )?;
        Ok((
            InProcess {
                engine: rt.engine,
                sched: rt.sched,
                tok: Arc::new(tok),
                cache: Mutex::new(HashMap::new()),
            },
            crate::runtime::model_id(&dir),
            rt.backend.describe,
        ))
    }

    fn tokens(&self, text: &str) -> anyhow::Result<Arc<Vec<u32>>> {
        if let Some(t) = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(text)
        {
            return Ok(t.clone());
        }
        let t = Arc::new(self.tok.encode(text)?);
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(text.to_string(), t.clone());
        Ok(t)
    }

    async fn run(
        &self,
        rec: &TraceRecord,
        mode: Mode,
        salt: &str,
        max_tokens: usize,
        s: &mut Sample,
        t_arr: Instant,
    ) {
        let mut segs = vec![];
        for text in rec.segments.iter().filter(|x| !x.is_empty()) {
            match self.tokens(text) {
                Ok(t) if !t.is_empty() => segs.push(SegmentRef {
                    tokens: t.as_ref().clone(),
                    isolation: salt.to_string(),
                }),
                Ok(_) => {}
                Err(e) => {
                    s.error = Some(e.to_string());
                    s.status = 400;
                    return;
                }
            }
        }
        let req = GenRequest {
            segments: segs,
            mode,
            tenant: "bench".into(),
            sampling: SamplingParams::default(),
            max_tokens,
            stop_token_ids: vec![],
            top_logprobs: 0,
            logprobs: false,
            score: None,
        };
        let mut h = match self.sched.submit(req) {
            Ok(h) => h,
            Err(e) => {
                s.status = match e {
                    SubmitError::QueueFull { .. } => 429,
                    SubmitError::Invalid(_) => 400,
                    SubmitError::Closed => 503,
                };
                s.error = Some(e.to_string());
                return;
            }
        };
        while let Some(ev) = h.events.recv().await {
            match ev {
                GenEvent::Started {
                    stats,
                    prompt_tokens,
                    ..
                } => {
                    s.ttft_ms = t_arr.elapsed().as_secs_f64() * 1e3;
                    s.prompt_tokens = prompt_tokens;
                    s.cached_tokens = stats.tokens_reused;
                    s.hits = stats.hits;
                    s.misses = stats.misses;
                    s.segments = stats.segments.len();
                }
                GenEvent::Token { .. } => s.generated += 1,
                GenEvent::Scored { .. } => {}
                GenEvent::Done { .. } => {
                    s.ok = true;
                    s.status = 200;
                    break;
                }
                GenEvent::Error { kind, message } => {
                    s.status = match kind {
                        dataplane::scheduler::ErrorKind::QueueTimeout => 408,
                        dataplane::scheduler::ErrorKind::Internal => 500,
                        _ => 400,
                    };
                    s.error = Some(message);
                    break;
                }
            }
        }
    }
}

/// The HTTP backend (streaming completions with a `segments` array).
pub struct HttpClient {
    client: reqwest::Client,
    url: String,
    token: Option<String>,
}

impl HttpClient {
    /// A client for `url`.
    pub fn new(url: &str, token: Option<String>) -> anyhow::Result<Self> {
        Ok(HttpClient {
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(600))
                .build()?,
            url: url.trim_end_matches('/').to_string(),
            token,
        })
    }

    async fn run(
        &self,
        rec: &TraceRecord,
        mode: &Mode,
        salt: &str,
        max_tokens: usize,
        s: &mut Sample,
        t_arr: Instant,
    ) {
        let (name, w, rope) = match mode {
            Mode::Hypic {
                seam_width,
                rope_fix,
            } => ("hypic", *seam_width, *rope_fix),
            m => (crate::serve::prompt::mode_name(m), 8, true),
        };
        let body = serde_json::json!({
            "segments": rec.segments.iter().filter(|x| !x.is_empty()).map(|t| serde_json::json!({"text": t})).collect::<Vec<_>>(),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
            "ignore_eos": true,
            "hypic": {"mode": name, "seam_width": w, "rope_fix": rope, "salt": salt},
        });
        let mut rb = self
            .client
            .post(format!("{}/v1/completions", self.url))
            .json(&body);
        if let Some(t) = &self.token {
            rb = rb.bearer_auth(t);
        }
        let resp = match rb.send().await {
            Ok(r) => r,
            Err(e) => {
                s.status = 599;
                s.error = Some(e.to_string());
                return;
            }
        };
        s.status = resp.status().as_u16();
        if !resp.status().is_success() {
            s.error = Some(resp.text().await.unwrap_or_default());
            return;
        }
        use futures_util::StreamExt;
        let mut stream = resp.bytes_stream();
        let mut buf = Vec::<u8>::new();
        let mut first = true;
        while let Some(chunk) = stream.next().await {
            let Ok(chunk) = chunk else {
                s.error = Some("stream broken".into());
                return;
            };
            buf.extend_from_slice(&chunk);
            while let Some(pos) = find_event_end(&buf) {
                let ev: Vec<u8> = buf.drain(..pos + 2).collect();
                let text = String::from_utf8_lossy(&ev);
                for line in text.lines() {
                    let Some(data) = line.strip_prefix("data:") else {
                        continue;
                    };
                    let data = data.trim();
                    if data == "[DONE]" {
                        s.ok = s.error.is_none();
                        return;
                    }
                    let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
                        continue;
                    };
                    if v.get("error").is_some() {
                        s.error = Some(
                            v["error"]["message"]
                                .as_str()
                                .unwrap_or("error")
                                .to_string(),
                        );
                        continue;
                    }
                    if first {
                        first = false;
                        s.ttft_ms = t_arr.elapsed().as_secs_f64() * 1e3;
                        if let Some(h) = v.get("hypic") {
                            s.hits = h["hits"].as_u64().unwrap_or(0) as usize;
                            s.misses = h["misses"].as_u64().unwrap_or(0) as usize;
                            s.segments = h["segments"].as_array().map(|a| a.len()).unwrap_or(0);
                        }
                    }
                    if let Some(u) = v.get("usage") {
                        s.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as usize;
                        s.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                            .as_u64()
                            .unwrap_or(0) as usize;
                        s.generated = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
                    }
                }
            }
        }
        s.error
            .get_or_insert_with(|| "stream ended without [DONE]".into());
    }
}

fn find_event_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\n\n")
}

/// One (mode, rate) run.
#[allow(clippy::too_many_arguments)]
///
/// Requests carry `salt`: runs under different salts share no cache entry.
pub async fn run_once(
    backend: &Backend,
    recs: &[TraceRecord],
    arrivals: &[f64],
    mode: &ModeSpec,
    (rate, salt): (f64, &str),
    max_tokens: usize,
    max_in_flight: usize,
    bar: &ProgressBar,
) -> Vec<Sample> {
    let gate = Arc::new(tokio::sync::Semaphore::new(max_in_flight.max(1)));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(recs.len());
    for (i, rec) in recs.iter().enumerate() {
        let at = start + Duration::from_secs_f64(arrivals[i].max(0.0));
        tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await;
        let permit = gate.clone().acquire_owned().await.expect("open semaphore");
        let (backend, rec, m, salt, bar) = (
            backend.clone(),
            rec.clone(),
            mode.clone(),
            salt.to_string(),
            bar.clone(),
        );
        let arrival_s = arrivals[i];
        tasks.push(tokio::spawn(async move {
            let _p = permit;
            let mut s = Sample {
                mode: m.label.clone(),
                rate,
                index: i,
                arrival_s,
                ..Default::default()
            };
            let mt = rec.max_tokens.unwrap_or(max_tokens).max(1);
            match &backend {
                Backend::InProcess(ip) => ip.run(&rec, m.mode, &salt, mt, &mut s, at).await,
                Backend::Http(h) => h.run(&rec, &m.mode, &salt, mt, &mut s, at).await,
            }
            s.e2e_ms = at.elapsed().as_secs_f64() * 1e3;
            s.done_s = start.elapsed().as_secs_f64();
            bar.inc(1);
            s
        }));
    }
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        if let Ok(s) = t.await {
            out.push(s);
        }
    }
    out
}

/// Priming requests in flight at once (`--prime`).
const PRIME_IN_FLIGHT: usize = 4;

/// A fresh salt for one (mode, rate) run.
fn run_salt(label: &str, rate: f64) -> String {
    format!("bench-{label}-{rate}-{:x}", rand::random::<u64>())
}

/// The in-process engine starts each run with empty pools (a server's are left as
/// they are: the run's salt keeps earlier entries out of reach).
fn clear_in_process(backend: &Backend) {
    if let Backend::InProcess(ip) = backend {
        ip.engine.clear();
    }
}

/// The requests of `--prime`: `[system, document]` for each distinct document of
/// the workload, in order of first use, and `[system]` alone when no request has a
/// document (none when every prompt is one segment). The documents are the segments strictly between the first and the last
/// of each session's first request (a record without a session counts as its own).
fn prime_records(recs: &[TraceRecord]) -> Vec<TraceRecord> {
    let mut seen_sessions = std::collections::HashSet::new();
    let mut seen = std::collections::HashSet::new();
    let mut out = vec![];
    for r in recs {
        if let Some(sid) = r.session {
            if !seen_sessions.insert(sid) {
                continue;
            }
        }
        let Some((system, rest)) = r.segments.split_first() else {
            continue;
        };
        let docs = rest.split_last().map_or(&[][..], |(_, d)| d);
        for d in docs {
            if !d.is_empty() && seen.insert((system.clone(), d.clone())) {
                out.push(TraceRecord {
                    t: None,
                    segments: vec![system.clone(), d.clone()],
                    max_tokens: Some(1),
                    session: None,
                });
            }
        }
    }
    if out.is_empty() {
        // A one-segment prompt is its own question: nothing of it is sent ahead.
        if let Some(system) = recs
            .iter()
            .find(|r| r.segments.len() >= 2)
            .map(|r| &r.segments[0])
        {
            out.push(TraceRecord {
                t: None,
                segments: vec![system.clone()],
                max_tokens: Some(1),
                session: None,
            });
        }
    }
    out
}

/// Parses `--rates`: `None` means the trace's own timestamps.
pub fn parse_rates(s: &str) -> anyhow::Result<Option<Vec<f64>>> {
    if s.trim() == "trace" {
        return Ok(None);
    }
    let v: Vec<f64> = s
        .split(',')
        .map(|x| x.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .context("--rates: comma-separated numbers, or `trace`")?;
    if v.is_empty() || v.iter().any(|r| !(*r > 0.0 && r.is_finite())) {
        bail!("--rates: every rate must be positive");
    }
    Ok(Some(v))
}

/// Runs the benchmark and writes the results folder; returns the summary.
pub async fn run_bench(a: &BenchArgs) -> anyhow::Result<report::Summary> {
    let modes = parse_modes(&a.modes)?;
    let rates = parse_rates(&a.rates)?;
    let spec = WorkloadSpec {
        requests: a.requests,
        docs: a.docs,
        docs_per_request: a.docs_per_request,
        zipf_s: a.zipf_s,
        doc_words: a.doc_words,
        system_words: a.system_words,
        query_words: a.query_words,
        multi_turn: a.multi_turn,
        seed: a.seed,
    };
    let recs = match &a.trace {
        Some(p) => workload::read_trace(p)?,
        None => {
            if a.requests == 0 {
                bail!("--requests must be at least 1");
            }
            workload::generate(&spec)
        }
    };
    if let Some(p) = &a.save_trace {
        workload::write_trace(p, &recs)?;
    }
    let (backend, target) = match &a.url {
        Some(u) => (
            Backend::Http(Arc::new(HttpClient::new(u, a.token.clone())?)),
            u.clone(),
        ),
        None => {
            let cfg = SchedulerConfig {
                queue_capacity: a.queue_capacity,
                max_running: a.max_running,
                ..SchedulerConfig::default()
            };
            let (m, device, dtype) = (a.model.clone(), a.device, a.dtype);
            let (ip, id, backend) =
                tokio::task::spawn_blocking(move || InProcess::load(m, device, dtype, cfg))
                    .await??;
            eprintln!("backend: {backend}");
            (Backend::InProcess(Arc::new(ip)), format!("in-process {id}"))
        }
    };
    let rate_list: Vec<f64> = rates.clone().unwrap_or_else(|| vec![0.0]);
    let mp = MultiProgress::with_draw_target(crate::progress_target(a.quiet));
    let style = ProgressStyle::with_template("{prefix:>28} [{bar:30}] {pos}/{len} ({elapsed})")
        .expect("static template")
        .progress_chars("=> ");
    let warm = a.warmup.min(recs.len());
    if warm > 0 {
        let bar = mp.add(ProgressBar::new(warm as u64));
        bar.set_style(style.clone());
        bar.set_prefix("warm-up (not counted)");
        let first = modes.first().context("--modes names no mode")?;
        clear_in_process(&backend);
        let salt = run_salt(&first.label, 0.0);
        let s = run_once(
            &backend,
            &recs[..warm],
            &vec![0.0; warm],
            first,
            (0.0, &salt),
            a.max_tokens,
            1,
            &bar,
        )
        .await;
        bar.finish();
        if let Some(bad) = s.iter().find(|x| !x.ok) {
            bail!(
                "warm-up request {} failed (status {}): {}",
                bad.index,
                bad.status,
                bad.error.as_deref().unwrap_or("no error text")
            );
        }
    }
    let primes = if a.prime {
        prime_records(&recs)
    } else {
        vec![]
    };
    let mut samples = vec![];
    for m in &modes {
        for &rate in &rate_list {
            clear_in_process(&backend);
            let salt = run_salt(&m.label, rate);
            if !primes.is_empty() {
                let bar = mp.add(ProgressBar::new(primes.len() as u64));
                bar.set_style(style.clone());
                bar.set_prefix(format!("{} priming (not counted)", m.label));
                let s = run_once(
                    &backend,
                    &primes,
                    &vec![0.0; primes.len()],
                    m,
                    (0.0, &salt),
                    1,
                    PRIME_IN_FLIGHT,
                    &bar,
                )
                .await;
                bar.finish();
                if let Some(bad) = s.iter().find(|x| !x.ok) {
                    bail!(
                        "priming request {} of {} failed (status {}): {}",
                        bad.index,
                        m.label,
                        bad.status,
                        bad.error.as_deref().unwrap_or("no error text")
                    );
                }
            }
            let arrivals: Vec<f64> = match rates {
                Some(_) => workload::poisson_arrivals(recs.len(), rate, a.seed),
                None => recs.iter().map(|r| r.t.unwrap_or(0.0)).collect(),
            };
            let bar = mp.add(ProgressBar::new(recs.len() as u64));
            bar.set_style(style.clone());
            bar.set_prefix(if rate > 0.0 {
                format!("{} @ {rate} req/s", m.label)
            } else {
                format!("{} @ trace", m.label)
            });
            let s = run_once(
                &backend,
                &recs,
                &arrivals,
                m,
                (rate, &salt),
                a.max_tokens,
                a.max_in_flight,
                &bar,
            )
            .await;
            bar.finish();
            samples.extend(s);
        }
    }
    let summary = report::summarize(
        &samples,
        &modes,
        &rate_list,
        report::Slo {
            p50_ms: a.slo_ms,
            p99_ms: a.slo_p99_ms,
        },
        &target,
        &spec,
        a.trace.is_some(),
    );
    let summary = report::Summary {
        warmup_requests: warm,
        primed_requests: primes.len(),
        ..summary
    };
    report::write_results(&a.out, &summary, &samples, !a.no_plots)?;
    Ok(summary)
}

/// `hypic bench`.
pub fn run_bench_command(a: BenchArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let summary = rt.block_on(run_bench(&a))?;
    println!("{}", report::markdown(&summary));
    eprintln!("results written to {}", a.out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: BenchArgs,
    }

    #[test]
    fn quiet_hides_the_progress_bars() {
        let loud = Cli::parse_from(["bench"]).a;
        let quiet = Cli::parse_from(["bench", "--quiet"]).a;
        let short = Cli::parse_from(["bench", "-q"]).a;
        assert!(!loud.quiet);
        assert!(quiet.quiet && short.quiet);
        assert!(crate::progress_target(quiet.quiet).is_hidden());
        // A bar added to the quiet target draws nowhere, whatever stderr is.
        let mp = MultiProgress::with_draw_target(crate::progress_target(true));
        let bar = mp.add(ProgressBar::new(3));
        bar.inc(1);
        assert!(bar.is_hidden());
    }

    fn rec(segs: &[&str], session: Option<u64>) -> TraceRecord {
        TraceRecord {
            t: None,
            segments: segs.iter().map(|x| x.to_string()).collect(),
            max_tokens: None,
            session,
        }
    }

    #[test]
    fn priming_sends_each_document_once_behind_the_system_prompt() {
        let recs = vec![
            rec(&["sys", "d1", "d2", "q1"], Some(0)),
            rec(&["sys", "d2", "d3", "q2"], Some(1)),
            // A continuation: its earlier answer and questions are never primed.
            rec(&["sys", "d1", "d2", "q1", "a1", "q3"], Some(0)),
            // No session: counts as its own first request; "" is skipped.
            rec(&["sys", "d4", "", "q4"], None),
        ];
        let p = prime_records(&recs);
        let got: Vec<Vec<&str>> = p
            .iter()
            .map(|r| r.segments.iter().map(String::as_str).collect())
            .collect();
        assert_eq!(
            got,
            vec![
                vec!["sys", "d1"],
                vec!["sys", "d2"],
                vec!["sys", "d3"],
                vec!["sys", "d4"]
            ]
        );
        assert!(p
            .iter()
            .all(|r| r.max_tokens == Some(1) && r.session.is_none()));
        // Requests without documents prime the system prompt alone.
        let bare = prime_records(&[rec(&["sys", "q"], Some(0))]);
        assert_eq!(bare.len(), 1);
        assert_eq!(bare[0].segments, vec!["sys".to_string()]);
        assert!(prime_records(&[]).is_empty());
        assert!(prime_records(&[rec(&["only a question"], None)]).is_empty());
        // The flag parses.
        assert!(Cli::parse_from(["bench", "--prime"]).a.prime);
        assert!(!Cli::parse_from(["bench"]).a.prime);
    }
}
