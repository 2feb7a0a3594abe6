//! `hypic serve`: the OpenAI-compatible, segment-aware HTTP server.
//!
//! * `POST /v1/completions`, `POST /v1/chat/completions` (SSE with `stream: true`),
//!   `GET /v1/models`: see [`routes`].
//! * `POST/GET/PUT/DELETE /v1/segments[/{id}]`: the control plane's segment catalog
//!   plus ahead-of-time prefill into the public pool and residency: see [`segments`].
//! * `GET /health`, `GET /metrics` (Prometheus).
//! * A periodic invalidation sweep ([`sweep`]) applies the active invalidation
//!   policy (e.g. TTL) to resident cache entries nobody requests.
//! * Everything else of the control plane (`/v1/whoami`, grants, versions,
//!   snapshots, `/v1/admin/*`) is mounted as is.
//!
//! Every `/v1` route needs a bearer JWT verified by the control plane's
//! authenticator; the tenant comes from the token, and each segment's isolation key
//! from the control plane's keyer (per tenant, unless the segment is an explicitly
//! shared catalog segment).
//!
//! Configuration: flags, then `HYPIC_*` environment variables, then a TOML file
//! (`--config`), then defaults ([`ServeConfig`]).
//!
//! Backend: `--device cpu|cuda|auto` and `--dtype f32|bf16` ([`crate::backend`], as
//! `hypic generate`, `eval` and `bench`) pick the CPU `PicEngine` or, in a binary
//! built with the `cuda` feature, the GPU `GpuPicEngine` (pools in device memory,
//! host spill), built by [`crate::runtime::start`] as for every other command. Both
//! sit behind [`dataplane::engine::Engine`]; the scheduler, the segment routes, the
//! sweep and the metrics see only that interface.
pub mod bounded;
pub mod devices;
pub mod errors;
pub mod first_use;
pub mod history;
pub mod metrics;
pub mod net;
pub mod prompt;
pub mod reqlog;
pub mod residency;
pub mod responses;
pub mod routes;
pub mod segments;
pub mod structured;
pub mod sweep;
pub mod textgen;
pub mod tools;
pub mod traffic;
pub mod types;
pub mod why;

use anyhow::{bail, Context};
use dataplane::engine::{BackendInfo, EnginePools};
use dataplane::pic::Mode;
use dataplane::scheduler::{Scheduler, SchedulerConfig};
use dataplane::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::backend::{select_device_on, Device, DeviceArg, DtypeArg};
use crate::runtime;
pub use crate::runtime::{default_model_dir, load_model, open_model, ModelSource};
use crate::{ControlArgs, ControlState};

/// Server settings (the TOML file's keys; every key optional).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ServeConfig {
    /// Listen address.
    pub bind: SocketAddr,
    /// Hugging Face model folder (default: the bundled `models/hypic-tiny`).
    pub model: Option<PathBuf>,
    /// Model id served in `/v1/models` and accepted in `model` (default: the
    /// folder name).
    pub model_id: Option<String>,
    /// Backend: `cpu`, `cuda` (GPU 0; a startup error when unusable) or `auto`
    /// (CUDA when usable, else the CPU with a line on stderr saying why).
    pub device: DeviceArg,
    /// Weight and activation type on the GPU backend: `f32` or `bf16` (the CPU
    /// backend always runs f32).
    pub dtype: DtypeArg,
    /// Default reuse mode: `hypic`, `prefix_cache`, `full_recompute`, `naive_addition`.
    pub mode: String,
    /// Default seam window of `hypic` mode.
    pub seam_width: usize,
    /// Default RoPE fix of `hypic` mode.
    pub rope_fix: bool,
    /// Separator that cuts a completions prompt into segments.
    pub separator: String,
    /// Public pool (segment entries) capacity, MiB.
    pub public_pool_mib: usize,
    /// Private pool (running-state snapshots) capacity, MiB.
    pub private_pool_mib: usize,
    /// Host spill tier of each pool, MiB (0: none). Entries evicted for space are
    /// kept as checksummed blobs and restored on a later hit once the checksum
    /// verifies; a damaged blob is dropped and recomputed.
    pub spill_mib: usize,
    /// Who decides admission and eviction in the public pool: `control` (the
    /// control plane's active policies, Wasm or native) or `lru`.
    pub pool_policy: String,
    /// Requests that may wait for admission (beyond: 429).
    pub queue_capacity: usize,
    /// Sequences decoding at once (recurrent-state slots).
    pub max_running: usize,
    /// KV budget of running sequences, MiB.
    pub kv_budget_mib: usize,
    /// Longest wait in the queue, seconds (beyond: 408).
    pub queue_timeout_s: f64,
    /// Token budget of one scheduler step: the running sequences' decode tokens
    /// plus pieces of pending prefills.
    pub step_tokens: usize,
    /// Most prompt tokens one prefill takes in a step's first pass, so that the
    /// prefills behind a long one get theirs in the same step.
    pub prefill_chunk_tokens: usize,
    /// Whether the pieces of several requests' computed segments (their queries) in
    /// one step run as one batched forward.
    pub batch_prefills: bool,
    /// Largest request body, bytes (beyond: 413).
    pub max_body_bytes: usize,
    /// `max_tokens` when a request does not set it.
    pub default_max_tokens: usize,
    /// Largest `n`.
    pub max_n: usize,
    /// Catalog database URL (default: SQLite in the data directory).
    pub database_url: Option<String>,
    /// Data directory (signing secret, SQLite catalog).
    pub data_dir: PathBuf,
    /// JWKS file with extra RS256/EdDSA keys.
    pub jwks_file: Option<PathBuf>,
    /// How often the JWKS file is re-read for rotated keys, ms (0: only on SIGHUP).
    pub jwks_reload_ms: u64,
    /// Audience tokens must carry.
    pub audience: String,
    /// Turn authentication off (loopback binds only).
    pub disable_auth: bool,
    /// Period of the invalidation sweep, ms: every resident public-pool entry
    /// the server knows (and each tenant's private snapshots) is put to the
    /// active invalidation policy (e.g. TTL) and dropped from the pool when the
    /// policy says so, even if no request touches it. 0 turns the sweep off.
    pub invalidation_sweep_ms: u64,
    // ---- Request bounds: tokenisation and per-request caps (see
    // docs/operations/bounds.md). ----
    /// Most segments one request may carry, all its prompts together (beyond: 400
    /// naming `max_segments_per_request`). Each segment is looked up, and on a miss
    /// prefilled and stored, on its own.
    pub max_segments_per_request: usize,
    /// Most prompt tokens one request may prefill, all its prompts and segments
    /// together, counted before the cache is consulted so that the bound holds when
    /// every segment misses (beyond: 400 naming `max_prefill_tokens_per_request`).
    pub max_prefill_tokens_per_request: usize,
    /// Largest text of one segment, bytes: an inline segment, a piece of a cut
    /// prompt (beyond: 400), a catalog segment version's content (beyond: 413 at
    /// creation; the control plane's `max_segment_bytes`).
    pub max_segment_bytes: usize,
    /// Largest content of one chat message, all its parts, bytes (beyond: 400).
    pub max_message_bytes: usize,
    /// Requests that may tokenise (or render a chat template) at once; the others
    /// wait for a turn. Bounds the memory tokenisation takes.
    pub tokenize_concurrency: usize,
    // ---- connections and time a client may hold ([`net::NetLimits`]) ----
    /// A request's headers must be complete within this many ms of the server
    /// starting to wait for them (the accept, or the end of the previous response).
    pub header_read_timeout_ms: u64,
    /// A connection with no request in progress (just accepted, idle between
    /// keep-alive requests, or still sending headers) is closed after this many
    /// ms (0: off; the header-read timeout still applies).
    pub idle_timeout_ms: u64,
    /// A request's body must be received within this many ms of its headers
    /// (beyond: 408 `body_read_timeout`).
    pub body_read_timeout_ms: u64,
    /// Open connections at most; at the cap the oldest idle connection is closed
    /// to make room, and when all are busy a new one gets 503 and is closed.
    pub max_connections: usize,
    /// Open connections from one peer IP address at most (`net::NetLimits`).
    pub max_connections_per_ip: usize,
    /// Longest token lifetime accepted (`exp - iat`), seconds.
    pub max_token_lifetime_s: u64,
    /// Largest policy module accepted at upload, bytes (beyond: 413).
    pub policy_max_module_bytes: usize,
    /// Policy modules compiled at once, off the request threads (further
    /// uploads meanwhile: 429).
    pub policy_max_concurrent_compiles: usize,
    /// Fair sharing of the public pool between tenants (default on): a tenant's
    /// misses evict its own entries once it holds more than its share
    /// (capacity / tenants holding entries) and never push another tenant below
    /// its share (`dataplane::pic::pool::CachePolicy::fair_share`). Off: the
    /// eviction policy chooses among every tenant's entries.
    pub pool_fair_share: bool,
    /// A tenant's first use of a shared (public) cache entry: `share` (use it as
    /// is: its latency shows whether another tenant used it recently) or
    /// `recompute` (that first use recomputes the entry, costing what a miss
    /// costs; see [`first_use`]).
    pub shared_first_use: String,
    /// How long an `Idempotency-Key` of `POST /v1/segments` is remembered, seconds.
    pub idempotency_ttl_s: u64,
    /// Serve deterministic random weights from this seed (`Model::random` /
    /// `GpuModel::random` of the model folder's config.json; the folder's weight
    /// files are not read) instead of the checkpoint.
    pub random_weights: Option<u64>,
    /// Segment-parallel workers (`hypic worker --listen ADDR`), `host:port` each:
    /// a request's cold segments are prefilled on them and composed here (see
    /// docs/segment-parallelism.md). Empty: every segment is prefilled here.
    pub workers: Vec<String>,
    /// GPUs of this process (`--device cuda` only), ordinals: the engine runs on the
    /// first; every further entry is an in-process segment-parallel worker with its
    /// own model replica on that GPU, shipping entries device to device ([`devices`];
    /// repeating an ordinal is allowed). Empty: the engine on GPU 0, no such worker.
    pub devices: Vec<usize>,
    /// Offer `workers` an NCCL communicator per task (`--device cuda` only; the
    /// workers run `hypic worker --device cuda --nccl`): entry payloads move GPU to
    /// GPU by ncclSend/ncclRecv, headers and checksums over TCP; a task whose
    /// worker refuses or whose NCCL set-up fails ships over TCP (logged).
    pub nccl: bool,
    /// Factor on a scattered segment's expected prefill time (tokens / the
    /// worker's measured throughput) in its deadline (at least 1).
    pub scatter_margin: f64,
    /// Time added to every scattered segment's deadline, ms.
    pub scatter_floor_ms: u64,
    /// Entry payloads from the workers: `tcp` (streamed on each task's connection)
    /// or `nixl` (NIXL READs of the entries a worker registered; needs a build with
    /// the `nixl` feature, and libnixl_capi.so at run time, else TCP with a
    /// warning). A worker without NIXL ships over TCP either way.
    pub worker_transport: String,
    /// This serving replica's id in the residency directory (`segment_residency`
    /// rows of its public pool); unique among the replicas over one catalog and
    /// stable across restarts (a starting replica deletes its id's rows). Default:
    /// the host name and the listen port.
    pub replica_id: Option<String>,
    /// Residency changes queued for the catalog at most; beyond, a change is
    /// dropped and counted (`hypic_residency_queue_drops_total`).
    pub residency_queue: usize,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            bind: "127.0.0.1:8080".parse().expect("static address"),
            model: None,
            model_id: None,
            device: DeviceArg::Auto,
            dtype: DtypeArg::F32,
            mode: "hypic".into(),
            seam_width: 8,
            rope_fix: true,
            separator: "<<PIC_SEP>>".into(),
            public_pool_mib: 1024,
            private_pool_mib: 1024,
            spill_mib: 0,
            pool_policy: "control".into(),
            queue_capacity: 64,
            max_running: 16,
            kv_budget_mib: 2048,
            queue_timeout_s: 30.0,
            step_tokens: dataplane::scheduler::DEFAULT_STEP_TOKENS,
            prefill_chunk_tokens: dataplane::scheduler::DEFAULT_PREFILL_CHUNK_TOKENS,
            batch_prefills: true,
            max_body_bytes: 16 << 20,
            default_max_tokens: 256,
            max_n: 16,
            database_url: None,
            data_dir: PathBuf::from("hypic-data"),
            jwks_file: None,
            jwks_reload_ms: crate::DEFAULT_JWKS_RELOAD_MS,
            audience: crate::auth::DEFAULT_AUDIENCE.into(),
            disable_auth: false,
            invalidation_sweep_ms: 10_000,
            max_segments_per_request: 256,
            max_prefill_tokens_per_request: 32_768,
            max_segment_bytes: crate::catalog::DEFAULT_MAX_SEGMENT_BYTES,
            max_message_bytes: 4 << 20,
            tokenize_concurrency: 4,
            header_read_timeout_ms: net::DEFAULT_HEADER_READ_TIMEOUT_MS,
            idle_timeout_ms: net::DEFAULT_IDLE_TIMEOUT_MS,
            body_read_timeout_ms: net::DEFAULT_BODY_READ_TIMEOUT_MS,
            max_connections: net::DEFAULT_MAX_CONNECTIONS,
            max_connections_per_ip: net::DEFAULT_MAX_CONNECTIONS_PER_IP,
            max_token_lifetime_s: crate::auth::DEFAULT_MAX_TOKEN_LIFETIME_S,
            policy_max_module_bytes: crate::policy::DEFAULT_MAX_MODULE_BYTES,
            policy_max_concurrent_compiles: crate::policy::DEFAULT_MAX_CONCURRENT_COMPILES,
            pool_fair_share: true,
            shared_first_use: "share".into(),
            idempotency_ttl_s: crate::DEFAULT_IDEMPOTENCY_TTL_S,
            random_weights: None,
            workers: vec![],
            devices: vec![],
            nccl: false,
            scatter_margin: 4.0,
            scatter_floor_ms: 2000,
            worker_transport: "tcp".into(),
            replica_id: None,
            residency_queue: 4096,
        }
    }
}

/// Arguments of `hypic serve` (each overrides the TOML file and the default).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ServeArgs {
    /// TOML configuration file (keys as the long flags, with underscores).
    #[arg(long, env = "HYPIC_CONFIG")]
    pub config: Option<PathBuf>,
    /// Listen address.
    #[arg(long, env = "HYPIC_BIND")]
    pub bind: Option<SocketAddr>,
    /// Hugging Face model folder (default: models/hypic-tiny).
    #[arg(long, env = "HYPIC_MODEL")]
    pub model: Option<PathBuf>,
    /// Model id to serve (default: the folder name).
    #[arg(long, env = "HYPIC_MODEL_ID")]
    pub model_id: Option<String>,
    /// Backend: cpu, cuda (GPU 0; an error when unusable or not built in) or auto
    /// (CUDA when usable, else the CPU with a log line saying why) [default: auto].
    #[arg(long, value_enum, env = "HYPIC_DEVICE")]
    pub device: Option<DeviceArg>,
    /// Weight and activation type on the GPU backend: f32 (the CPU backend's answers)
    /// or bf16 (half the weight memory) [default: f32].
    #[arg(long, value_enum, env = "HYPIC_DTYPE")]
    pub dtype: Option<DtypeArg>,
    /// Default reuse mode: hypic, prefix_cache, full_recompute, naive_addition.
    #[arg(long, env = "HYPIC_MODE")]
    pub mode: Option<String>,
    /// Default seam window (hypic mode).
    #[arg(long, env = "HYPIC_SEAM_WIDTH")]
    pub seam_width: Option<usize>,
    /// Default RoPE fix (hypic mode): true or false.
    #[arg(long, env = "HYPIC_ROPE_FIX")]
    pub rope_fix: Option<bool>,
    /// Prompt separator for completions.
    #[arg(long, env = "HYPIC_SEPARATOR")]
    pub separator: Option<String>,
    /// Public pool capacity, MiB.
    #[arg(long, env = "HYPIC_PUBLIC_POOL_MIB")]
    pub public_pool_mib: Option<usize>,
    /// Private pool capacity, MiB.
    #[arg(long, env = "HYPIC_PRIVATE_POOL_MIB")]
    pub private_pool_mib: Option<usize>,
    /// Host spill tier per pool, MiB (0: evicted entries are dropped).
    #[arg(long, env = "HYPIC_SPILL_MIB")]
    pub spill_mib: Option<usize>,
    /// Public-pool policy: control (the control plane's active policies) or lru.
    #[arg(long, env = "HYPIC_POOL_POLICY")]
    pub pool_policy: Option<String>,
    /// Admission queue capacity.
    #[arg(long, env = "HYPIC_QUEUE_CAPACITY")]
    pub queue_capacity: Option<usize>,
    /// Sequences decoding at once.
    #[arg(long, env = "HYPIC_MAX_RUNNING")]
    pub max_running: Option<usize>,
    /// KV budget, MiB.
    #[arg(long, env = "HYPIC_KV_BUDGET_MIB")]
    pub kv_budget_mib: Option<usize>,
    /// Queue timeout, seconds.
    #[arg(long, env = "HYPIC_QUEUE_TIMEOUT_S")]
    pub queue_timeout_s: Option<f64>,
    /// Token budget of one scheduler step (decode tokens plus prefill pieces).
    #[arg(long, env = "HYPIC_STEP_TOKENS")]
    pub step_tokens: Option<usize>,
    /// Most prompt tokens one prefill takes in a step's first pass.
    #[arg(long, env = "HYPIC_PREFILL_CHUNK_TOKENS")]
    pub prefill_chunk_tokens: Option<usize>,
    /// Batch several requests' computed prefill pieces into one forward: true or false.
    #[arg(long, env = "HYPIC_BATCH_PREFILLS")]
    pub batch_prefills: Option<bool>,
    /// Largest request body, bytes.
    #[arg(long, env = "HYPIC_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Default max_tokens.
    #[arg(long, env = "HYPIC_DEFAULT_MAX_TOKENS")]
    pub default_max_tokens: Option<usize>,
    /// Largest n.
    #[arg(long, env = "HYPIC_MAX_N")]
    pub max_n: Option<usize>,
    /// Catalog database URL (postgres://… or sqlite://…).
    #[arg(long, env = "HYPIC_DATABASE_URL")]
    pub database_url: Option<String>,
    /// Data directory.
    #[arg(long, env = "HYPIC_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// JWKS file.
    #[arg(long)]
    pub jwks_file: Option<PathBuf>,
    /// JWKS re-read period, ms (0: only on SIGHUP).
    #[arg(long, env = "HYPIC_JWKS_RELOAD_MS")]
    pub jwks_reload_ms: Option<u64>,
    /// Invalidation sweep period, ms (0: off).
    #[arg(long, env = "HYPIC_INVALIDATION_SWEEP_MS")]
    pub invalidation_sweep_ms: Option<u64>,
    /// How long an Idempotency-Key of POST /v1/segments is remembered, seconds
    /// [default: 86400].
    #[arg(long, env = "HYPIC_IDEMPOTENCY_TTL_S")]
    pub idempotency_ttl_s: Option<u64>,
    /// Token audience.
    #[arg(long)]
    pub audience: Option<String>,
    /// Largest policy module accepted at upload, bytes [default: 1048576].
    #[arg(long, env = "HYPIC_POLICY_MAX_MODULE_BYTES")]
    pub policy_max_module_bytes: Option<usize>,
    /// Policy modules compiled at once [default: 1].
    #[arg(long, env = "HYPIC_POLICY_MAX_CONCURRENT_COMPILES")]
    pub policy_max_concurrent_compiles: Option<usize>,
    /// Fair sharing of the public pool between tenants: true or false [default: true].
    #[arg(long, env = "HYPIC_POOL_FAIR_SHARE")]
    pub pool_fair_share: Option<bool>,
    /// A tenant's first use of a shared cache entry: share or recompute [default: share].
    #[arg(long, env = "HYPIC_SHARED_FIRST_USE")]
    pub shared_first_use: Option<String>,
    /// Serve deterministic random weights from this seed (of the model folder's
    /// config.json shape; its weight files are not read), e.g. as the reference of a
    /// `hypic random-checkpoint` folder written with the same seed.
    #[arg(long, env = "HYPIC_RANDOM_WEIGHTS")]
    pub random_weights: Option<u64>,
    /// Segment-parallel workers, `host:port,host:port` (each a `hypic worker
    /// --listen`): cold segments are prefilled there, composed here.
    #[arg(long, env = "HYPIC_WORKERS", value_delimiter = ',')]
    pub workers: Option<Vec<String>>,
    /// GPUs of this process, `0,1,…` (with `--device cuda`): the engine on the
    /// first, an in-process worker (its own model replica) on each further one; a
    /// GPU may repeat (`0,0`).
    #[arg(long, env = "HYPIC_DEVICES", value_delimiter = ',')]
    pub devices: Option<Vec<usize>>,
    /// Offer the `--workers` NCCL (GPU to GPU payloads; `--device cuda`, workers
    /// with `--nccl`): true or false [default: false]; `--nccl` alone is true.
    #[arg(long, env = "HYPIC_NCCL", num_args = 0..=1, default_missing_value = "true")]
    pub nccl: Option<bool>,
    /// Factor on a scattered segment's expected prefill time in its deadline
    /// [default: 4].
    #[arg(long, env = "HYPIC_SCATTER_MARGIN")]
    pub scatter_margin: Option<f64>,
    /// Time added to every scattered segment's deadline, ms [default: 2000].
    #[arg(long, env = "HYPIC_SCATTER_FLOOR_MS")]
    pub scatter_floor_ms: Option<u64>,
    /// Entry payloads from the workers: tcp or nixl (NIXL READs; a build with the
    /// `nixl` feature, libnixl_capi.so at run time) [default: tcp].
    #[arg(long, env = "HYPIC_WORKER_TRANSPORT")]
    pub worker_transport: Option<String>,
    /// This replica's id in the residency directory [default: host:port].
    #[arg(long, env = "HYPIC_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// Residency changes queued for the catalog at most [default: 4096].
    #[arg(long, env = "HYPIC_RESIDENCY_QUEUE")]
    pub residency_queue: Option<usize>,
    /// Turn authentication off (loopback binds only).
    #[arg(long)]
    pub disable_auth: bool,
    /// Most segments per request [default: 256].
    #[arg(long, env = "HYPIC_MAX_SEGMENTS_PER_REQUEST")]
    pub max_segments_per_request: Option<usize>,
    /// Most prompt tokens one request may prefill [default: 32768].
    #[arg(long, env = "HYPIC_MAX_PREFILL_TOKENS_PER_REQUEST")]
    pub max_prefill_tokens_per_request: Option<usize>,
    /// Largest text of one segment (inline, or a catalog segment version's content),
    /// bytes [default: 1048576].
    #[arg(long, env = "HYPIC_MAX_SEGMENT_BYTES")]
    pub max_segment_bytes: Option<usize>,
    /// Largest content of one chat message, bytes [default: 4194304].
    #[arg(long, env = "HYPIC_MAX_MESSAGE_BYTES")]
    pub max_message_bytes: Option<usize>,
    /// Requests that may tokenise at once [default: 4].
    #[arg(long, env = "HYPIC_TOKENIZE_CONCURRENCY")]
    pub tokenize_concurrency: Option<usize>,
    /// Connection limits and deadlines.
    #[command(flatten)]
    pub net: net::NetArgs,
    /// Longest token lifetime accepted (exp - iat), e.g. 90d [default: 90d].
    #[arg(long, env = "HYPIC_MAX_TOKEN_LIFETIME")]
    pub max_token_lifetime: Option<String>,
}

impl ServeConfig {
    /// Defaults, overridden by the TOML file, then by flags and environment.
    pub fn resolve(a: &ServeArgs) -> anyhow::Result<ServeConfig> {
        let mut c = match &a.config {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading config {}", p.display()))?;
                toml::from_str::<ServeConfig>(&text)
                    .with_context(|| format!("parsing config {}", p.display()))?
            }
            None => ServeConfig::default(),
        };
        macro_rules! set {
            ($($f:ident),*) => {$( if let Some(v) = &a.$f { c.$f = v.clone(); } )*};
        }
        set!(
            bind,
            device,
            dtype,
            mode,
            seam_width,
            rope_fix,
            separator,
            public_pool_mib,
            private_pool_mib,
            spill_mib,
            pool_policy,
            queue_capacity,
            max_running,
            kv_budget_mib,
            queue_timeout_s,
            step_tokens,
            prefill_chunk_tokens,
            batch_prefills,
            max_body_bytes,
            default_max_tokens,
            max_n,
            data_dir,
            audience,
            jwks_reload_ms,
            invalidation_sweep_ms,
            policy_max_module_bytes,
            policy_max_concurrent_compiles,
            pool_fair_share,
            shared_first_use
        );
        set!(
            max_segments_per_request,
            max_prefill_tokens_per_request,
            max_segment_bytes,
            max_message_bytes,
            tokenize_concurrency,
            idempotency_ttl_s,
            workers,
            devices,
            nccl,
            scatter_margin,
            scatter_floor_ms,
            worker_transport,
            residency_queue
        );
        if a.replica_id.is_some() {
            c.replica_id = a.replica_id.clone();
        }
        if a.model.is_some() {
            c.model = a.model.clone();
        }
        if a.model_id.is_some() {
            c.model_id = a.model_id.clone();
        }
        if a.random_weights.is_some() {
            c.random_weights = a.random_weights;
        }
        if a.database_url.is_some() {
            c.database_url = a.database_url.clone();
        }
        if a.jwks_file.is_some() {
            c.jwks_file = a.jwks_file.clone();
        }
        c.disable_auth |= a.disable_auth;
        let n = &a.net;
        c.header_read_timeout_ms = n.header_read_timeout_ms.unwrap_or(c.header_read_timeout_ms);
        c.idle_timeout_ms = n.idle_timeout_ms.unwrap_or(c.idle_timeout_ms);
        c.body_read_timeout_ms = n.body_read_timeout_ms.unwrap_or(c.body_read_timeout_ms);
        c.max_connections = n.max_connections.unwrap_or(c.max_connections);
        c.max_connections_per_ip = n.max_connections_per_ip.unwrap_or(c.max_connections_per_ip);
        if let Some(t) = &a.max_token_lifetime {
            c.max_token_lifetime_s = crate::auth::parse_ttl(t).context("--max-token-lifetime")?;
        }
        c.validate()?;
        Ok(c)
    }

    /// Checks ranges.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.default_mode()?;
        if !["control", "lru"].contains(&self.pool_policy.as_str()) {
            bail!(
                "pool_policy must be `control` or `lru`, not {:?}",
                self.pool_policy
            );
        }
        if !(self.scatter_margin >= 1.0 && self.scatter_margin.is_finite()) {
            bail!("scatter_margin must be a finite number of at least 1");
        }
        if let Some(w) = self.workers.iter().find(|w| !w.contains(':')) {
            bail!("workers: {w:?} is not host:port");
        }
        match self.worker_transport.as_str() {
            "tcp" => {}
            "nixl" if !dataplane::parallel::nixl::BUILT => bail!(
                "worker_transport = \"nixl\": {}",
                dataplane::parallel::nixl::Unavailable::NotBuilt
            ),
            "nixl" => {}
            other => bail!("worker_transport must be `tcp` or `nixl`, not {other:?}"),
        }
        devices::validate(self)?;
        if self.queue_capacity == 0 || self.max_running == 0 {
            bail!("queue_capacity and max_running must be at least 1");
        }
        if !(self.queue_timeout_s > 0.0 && self.queue_timeout_s.is_finite()) {
            bail!("queue_timeout_s must be positive");
        }
        if self.step_tokens == 0 || self.prefill_chunk_tokens == 0 {
            bail!("step_tokens and prefill_chunk_tokens must be at least 1");
        }
        if self.max_body_bytes < 1024 {
            bail!("max_body_bytes must be at least 1024");
        }
        if self.default_max_tokens == 0 || self.max_n == 0 {
            bail!("default_max_tokens and max_n must be at least 1");
        }
        for (name, v) in [
            ("max_segments_per_request", self.max_segments_per_request),
            (
                "max_prefill_tokens_per_request",
                self.max_prefill_tokens_per_request,
            ),
            ("max_segment_bytes", self.max_segment_bytes),
            ("max_message_bytes", self.max_message_bytes),
            ("tokenize_concurrency", self.tokenize_concurrency),
        ] {
            if v == 0 {
                bail!("{name} must be at least 1");
            }
        }
        self.net_limits()?;
        if self.max_token_lifetime_s == 0 {
            bail!("max_token_lifetime_s must be at least 1");
        }
        if !first_use::FIRST_USE_CHOICES.contains(&self.shared_first_use.as_str()) {
            bail!(
                "shared_first_use must be `share` or `recompute`, not {:?}",
                self.shared_first_use
            );
        }
        if self.policy_max_module_bytes == 0 || self.policy_max_concurrent_compiles == 0 {
            bail!("policy_max_module_bytes and policy_max_concurrent_compiles must be at least 1");
        }
        Ok(())
    }

    /// The default mode.
    pub fn default_mode(&self) -> anyhow::Result<Mode> {
        prompt::parse_mode(&self.mode, self.seam_width, self.rope_fix)
            .map_err(|e| anyhow::anyhow!("mode: {e}"))
    }

    /// The control-plane options.
    pub fn control_args(&self) -> ControlArgs {
        ControlArgs {
            database_url: self.database_url.clone(),
            data_dir: self.data_dir.clone(),
            jwks_file: self.jwks_file.clone(),
            jwks_reload_ms: self.jwks_reload_ms,
            audience: self.audience.clone(),
            disable_auth: self.disable_auth,
            max_token_lifetime_s: self.max_token_lifetime_s,
            policy_max_module_bytes: self.policy_max_module_bytes,
            policy_max_concurrent_compiles: self.policy_max_concurrent_compiles,
            max_segment_bytes: self.max_segment_bytes,
            idempotency_ttl_s: self.idempotency_ttl_s,
        }
    }

    /// Connection limits and deadlines.
    pub fn net_limits(&self) -> anyhow::Result<net::NetLimits> {
        net::NetLimits::from_ms(
            self.header_read_timeout_ms,
            self.idle_timeout_ms,
            self.body_read_timeout_ms,
            self.max_connections,
            self.max_connections_per_ip,
        )
    }

    /// Scheduler settings.
    pub fn scheduler(&self) -> SchedulerConfig {
        SchedulerConfig {
            queue_capacity: self.queue_capacity,
            max_running: self.max_running,
            kv_budget_bytes: self.kv_budget_mib << 20,
            queue_timeout: Duration::from_secs_f64(self.queue_timeout_s),
            step_tokens: self.step_tokens,
            prefill_chunk_tokens: self.prefill_chunk_tokens,
            batch_prefills: self.batch_prefills,
        }
    }
}

/// Tokens of one catalog segment version.
#[derive(Clone, Debug)]
pub(crate) struct CachedTokens {
    pub content_hash: String,
    pub tokens: Arc<Vec<u32>>,
}

/// What this server knows of a catalog segment: tokenised versions and the
/// isolation keys its entries were stored under (to evict them on update/delete).
/// Both are bounded ([`bounded`]): at most [`KNOWN_MAX_VERSIONS`] versions and
/// [`KNOWN_MAX_TOKENS`] tokens, at most [`KNOWN_MAX_SEGMENTS`] segments'
/// namespaces and [`bounded::KEY_SET_CAP`] namespaces each. A forgotten version
/// is tokenised again on its next use; entries in a forgotten namespace are left
/// to ordinary eviction.
#[derive(Debug)]
pub(crate) struct Known {
    pub tokens: bounded::BoundedMap<(String, i64), CachedTokens>,
    pub isolations: bounded::BoundedMap<String, bounded::KeySet>,
}

/// Most segment versions whose tokens a server keeps.
pub const KNOWN_MAX_VERSIONS: usize = 65_536;
/// Most tokens of segment versions a server keeps (all versions together).
pub const KNOWN_MAX_TOKENS: usize = 16 << 20;
/// Most segments whose cache namespaces a server remembers.
pub const KNOWN_MAX_SEGMENTS: usize = 16_384;

impl Default for Known {
    fn default() -> Self {
        Known {
            tokens: bounded::BoundedMap::new(KNOWN_MAX_VERSIONS, KNOWN_MAX_TOKENS, |c| {
                c.tokens.len()
            }),
            isolations: bounded::BoundedMap::new(KNOWN_MAX_SEGMENTS, KNOWN_MAX_SEGMENTS, |_| 1),
        }
    }
}

pub(crate) struct Inner {
    pub cfg: ServeConfig,
    pub model_id: String,
    /// Unix seconds when this server loaded the model (`created` of `/v1/models`).
    pub model_created: u64,
    pub default_mode: Mode,
    pub tok: Arc<Tokenizer>,
    pub engine: Arc<dyn EnginePools>,
    pub backend: BackendInfo,
    pub sched: Arc<Scheduler>,
    pub control: ControlState,
    pub control_router: axum::Router,
    pub metrics: metrics::ServeMetrics,
    pub known: Mutex<Known>,
    pub first_use: first_use::FirstUse,
    pub ledger: sweep::Ledger,
    /// Metric samples of the last hour (`GET /v1/metrics/history`).
    pub history: history::History,
    /// Recent prompts' cacheable segments, for policy dry runs (`GET /v1/admin/traffic`).
    pub traffic: traffic::Traffic,
    /// Recent observations of segments for `GET /v1/segments/{id}/why`.
    pub why: why::WhyLog,
    pub prefill_gate: tokio::sync::Semaphore,
    pub ctx: usize,
    /// Turns to tokenise (`tokenize_concurrency` permits).
    pub tokenize_gate: Arc<tokio::sync::Semaphore>,
    /// Grammar compiler of `response_format` (structured output).
    pub grammars: Arc<structured::Grammars>,
    /// Segment-parallel workers (`workers`), when any.
    pub scatter: Option<Arc<dataplane::parallel::scatter::Scatter>>,
    /// The residency directory (absent when the state was built outside a Tokio
    /// runtime).
    pub residency: Option<Arc<residency::Directory>>,
}

/// Shared state of the serving routes.
#[derive(Clone)]
pub struct AppState(pub(crate) Arc<Inner>);

/// Sets the public pool's policy per `cfg.pool_policy`: `control`, the control
/// plane's active eviction/admission policies (Wasm or native) decide what the
/// public pool keeps; `lru`, the engine's own LRU (global unless
/// `pool_fair_share`).
fn set_pool_policy(engine: &dyn EnginePools, cfg: &ServeConfig, control: &ControlState) {
    if cfg.pool_policy == "control" {
        engine.set_public_policy(Box::new(
            crate::policy::pool_adapter::RuntimePoolPolicy::new(
                control.policies().clone(),
                cfg.public_pool_mib << 20,
            )
            .with_fair_share(cfg.pool_fair_share),
        ));
    } else if !cfg.pool_fair_share {
        engine.set_public_policy(Box::new(dataplane::pic::pool::GlobalLru));
    }
}

/// The combiner over the in-process workers `local` (`devices`) and `cfg.workers`
/// (TCP; NCCL payloads with `nccl`, NIXL READs of the payloads with
/// `worker_transport = "nixl"` where the library loads), health-checked once now
/// and then in the background; `None` without workers.
fn start_scatter(
    cfg: &ServeConfig,
    engine: &dyn EnginePools,
    local: Vec<Box<dyn dataplane::parallel::transport::Transport>>,
    nccl: Option<Arc<dyn dataplane::parallel::transport::NcclLink>>,
) -> Option<Arc<dataplane::parallel::scatter::Scatter>> {
    use dataplane::parallel::scatter::{Scatter, ScatterConfig};
    use dataplane::parallel::transport::{Tcp, Transport, DEFAULT_MAX_FRAME};
    if cfg.workers.is_empty() && local.is_empty() {
        return None;
    }
    // `validate` refused "nixl" in a build without the feature.
    let reader = match cfg.worker_transport.as_str() {
        "nixl" => crate::worker::nixl_or_tcp("combiner", dataplane::parallel::nixl::reader)
            .ok()
            .flatten(),
        _ => None,
    };
    let mut transports = local;
    transports.extend(cfg.workers.iter().map(|a| {
        let t = match &reader {
            Some(r) => Tcp::with_reader(a, DEFAULT_MAX_FRAME, r.clone()),
            None => Tcp::new(a, DEFAULT_MAX_FRAME),
        };
        let t = match &nccl {
            Some(link) => t.with_nccl(link.clone()),
            None => t,
        };
        Box::new(t) as Box<dyn Transport>
    }));
    let n = transports.len();
    let sc = Scatter::new(
        transports,
        engine.model_fingerprint(),
        ScatterConfig {
            margin: cfg.scatter_margin,
            floor: std::time::Duration::from_millis(cfg.scatter_floor_ms),
            ..ScatterConfig::default()
        },
    );
    let up = sc.check_health();
    tracing::info!(workers = n, up, "segment-parallel workers: {up} of {n} up");
    sc.spawn_health_checks();
    Some(sc)
}

impl AppState {
    /// Builds the state from a loaded model and a control-plane state, on the
    /// backend `cfg.device` / `cfg.dtype` select (on the first of `cfg.devices`;
    /// [`crate::backend::select_device_on`]).
    pub fn new(
        cfg: ServeConfig,
        model: impl Into<ModelSource>,
        tok: Tokenizer,
        model_id: String,
        control: ControlState,
    ) -> anyhow::Result<AppState> {
        let device = select_device_on(cfg.device, cfg.dtype, devices::combiner_ordinal(&cfg))?;
        Self::on_device(cfg, &device, model, tok, model_id, control)
    }

    /// [`AppState::new`] on an already selected device.
    pub fn on_device(
        cfg: ServeConfig,
        device: &Device,
        model: impl Into<ModelSource>,
        tok: Tokenizer,
        model_id: String,
        control: ControlState,
    ) -> anyhow::Result<AppState> {
        let default_mode = cfg.default_mode()?;
        let model = model.into();
        let ctx = model.config().max_position_embeddings;
        let pools = runtime::PoolSizes {
            public_bytes: cfg.public_pool_mib << 20,
            private_bytes: cfg.private_pool_mib << 20,
            spill_bytes: cfg.spill_mib << 20,
        };
        // The replicas first: the engine below takes the model source.
        let local = devices::start_workers(&cfg, device, &model)?;
        let nccl = devices::nccl_link(&cfg, device, model.config())?;
        let rt = runtime::start(
            device,
            cfg.dtype,
            model,
            &model_id,
            pools,
            cfg.scheduler(),
            &|e| set_pool_policy(e, &cfg, &control),
        )?;
        let (engine, sched, backend) = (rt.engine, rt.sched, rt.backend);
        let cfg_tok_conc = cfg.tokenize_concurrency;
        let control_router = crate::control_router(control.clone());
        let metrics = metrics::ServeMetrics::new();
        metrics.set_backend(&backend);
        let first_use = first_use::FirstUse::new(&cfg.shared_first_use);
        let tok = Arc::new(tok);
        let grammars = Arc::new(structured::Grammars::new(
            tok.clone(),
            engine.config().vocab_size,
        ));
        let scatter = start_scatter(&cfg, &*engine, local, nccl);
        let rt = tokio::runtime::Handle::try_current().ok();
        let residency = rt.as_ref().map(|rt| {
            let id = cfg
                .replica_id
                .clone()
                .unwrap_or_else(|| residency::default_replica_id(cfg.bind));
            let d =
                residency::Directory::spawn(id, control.catalog().clone(), cfg.residency_queue, rt);
            engine.set_residency_observer(Some(Arc::new(residency::PoolHook(d.clone()))));
            if let Some(sc) = &scatter {
                sc.set_holder_directory(Some(d.clone()));
            }
            d
        });
        let inner = Arc::new(Inner {
            cfg,
            model_id,
            model_created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            default_mode,
            tok,
            engine,
            backend,
            sched,
            control,
            control_router,
            metrics,
            known: Mutex::new(Known::default()),
            first_use,
            ledger: sweep::Ledger::default(),
            history: history::History::default(),
            traffic: traffic::Traffic::default(),
            why: why::WhyLog::default(),
            prefill_gate: tokio::sync::Semaphore::new(1),
            ctx,
            tokenize_gate: Arc::new(tokio::sync::Semaphore::new(cfg_tok_conc)),
            grammars,
            scatter,
            residency,
        });
        if let (Some(rt), Some(d)) = (&rt, &inner.residency) {
            residency::spawn_invalidator(Arc::downgrade(&inner), d, rt);
        }
        Ok(AppState(inner))
    }

    /// The residency directory, when it runs.
    pub fn residency(&self) -> Option<&Arc<residency::Directory>> {
        self.0.residency.as_ref()
    }

    /// The segment-parallel workers, when `workers` names any.
    pub fn scatter(&self) -> Option<&Arc<dataplane::parallel::scatter::Scatter>> {
        self.0.scatter.as_ref()
    }

    /// The engine's pools (CPU or GPU).
    pub fn engine(&self) -> &Arc<dyn EnginePools> {
        &self.0.engine
    }
    /// Which backend serves (device, dtype, description).
    pub fn backend(&self) -> &BackendInfo {
        &self.0.backend
    }
    /// The scheduler.
    pub fn scheduler(&self) -> &Arc<Scheduler> {
        &self.0.sched
    }
    /// The served model id.
    pub fn model_id(&self) -> &str {
        &self.0.model_id
    }
    /// The settings.
    pub fn config(&self) -> &ServeConfig {
        &self.0.cfg
    }
    /// The control-plane state.
    pub fn control(&self) -> &ControlState {
        &self.0.control
    }
    /// The `shared_first_use` state (first uses recomputed so far).
    pub fn first_use(&self) -> &first_use::FirstUse {
        &self.0.first_use
    }
    /// The wall-clock ledger of cache entries used by the invalidation sweep.
    pub fn ledger(&self) -> &sweep::Ledger {
        &self.0.ledger
    }
}

/// A server running in the background (tests, `hypic bench`).
pub struct RunningServer {
    /// Bound address.
    pub addr: SocketAddr,
    /// Its state.
    pub state: AppState,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    join: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl RunningServer {
    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
    /// Stops accepting, waits for open requests, then writes the usage and
    /// shadow counts to the catalog ([`crate::persist::flush`]).
    pub async fn stop(mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        if let Some(j) = self.join.take() {
            let _ = j.await;
        }
        if let Err(e) = crate::persist::flush(self.state.control()).await {
            eprintln!("hypic: could not write usage and shadow counts to the catalog: {e}");
        }
    }
}

/// Model folder and id of a config.
pub fn model_location(cfg: &ServeConfig) -> anyhow::Result<(PathBuf, String)> {
    let dir = match cfg.model.clone().or_else(default_model_dir) {
        Some(d) => d,
        None => bail!(
            "no model: pass --model DIR (a Hugging Face folder), or add the bundled models/hypic-tiny"
        ),
    };
    let id = cfg.model_id.clone().unwrap_or_else(|| {
        dir.canonicalize()
            .unwrap_or_else(|_| dir.clone())
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| "hypic".into())
    });
    Ok((dir, id))
}

/// Loads the model, opens the control plane, binds and serves in the background.
pub async fn spawn(cfg: ServeConfig) -> anyhow::Result<RunningServer> {
    cfg.validate()?;
    let (dir, id) = model_location(&cfg)?;
    // The device first: `--device cuda` without CUDA fails before the model loads.
    let (device_arg, dtype, ordinal) = (cfg.device, cfg.dtype, devices::combiner_ordinal(&cfg));
    let device =
        tokio::task::spawn_blocking(move || select_device_on(device_arg, dtype, ordinal)).await??;
    let on_gpu = !matches!(device, Device::Cpu);
    let random = cfg.random_weights;
    let (model, tok) =
        tokio::task::spawn_blocking(move || open_model(&dir, on_gpu, random)).await??;
    let control = crate::build_control_state(&cfg.control_args(), cfg.bind).await?;
    let listener = tokio::net::TcpListener::bind(cfg.bind)
        .await
        .with_context(|| format!("binding {}", cfg.bind))?;
    let addr = listener.local_addr()?;
    let sweep_every = cfg.invalidation_sweep_ms;
    let state = AppState::on_device(cfg, &device, model, tok, id, control)?;
    if sweep_every > 0 {
        sweep::spawn_sweeper(Arc::downgrade(&state.0), Duration::from_millis(sweep_every));
    }
    history::spawn_sampler(
        Arc::downgrade(&state.0),
        Duration::from_millis(history::SAMPLE_EVERY_MS),
    );
    let app = routes::router(state.clone());
    let limits = state.config().net_limits()?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let join = tokio::spawn(net::serve(listener, app, limits, async {
        let _ = rx.await;
    }));
    Ok(RunningServer {
        addr,
        state,
        shutdown: Some(tx),
        join: Some(join),
    })
}

/// `hypic serve`: serves until Ctrl-C.
pub fn run_serve_command(args: ServeArgs) -> anyhow::Result<()> {
    let cfg = ServeConfig::resolve(&args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let server = spawn(cfg).await?;
        eprintln!("backend: {}", server.state.backend().describe);
        eprintln!(
            "hypic: serving {} on {} (mode {}, backend {}, OpenAI API at {}/v1)",
            server.state.model_id(),
            server.addr,
            server.state.config().mode,
            server.state.backend().describe,
            server.url()
        );
        let _ = tokio::signal::ctrl_c().await;
        eprintln!("hypic: shutting down");
        server.stop().await;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// The repository's sample configuration.
    fn sample_path() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../hypic.toml")
    }

    /// Keys the sample sets (`key = …`) and keys it shows commented out (`# key = …`).
    fn sample_keys(text: &str) -> (Vec<String>, Vec<String>) {
        let key = |l: &str| {
            let (k, _) = l.split_once(" = ")?;
            k.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                .then(|| k.to_string())
        };
        let (mut set, mut commented) = (vec![], vec![]);
        for l in text.lines() {
            if let Some(c) = l.strip_prefix("# ") {
                commented.extend(key(c));
            } else {
                set.extend(key(l));
            }
        }
        (set, commented)
    }

    #[test]
    fn sample_hypic_toml_loads_to_the_defaults() {
        let args = ServeArgs {
            config: Some(sample_path()),
            ..Default::default()
        };
        let cfg = ServeConfig::resolve(&args).expect("the sample hypic.toml loads");
        assert_eq!(
            cfg,
            ServeConfig::default(),
            "hypic.toml's values drifted from the defaults"
        );
    }

    #[test]
    fn sample_hypic_toml_names_every_key() {
        let text = std::fs::read_to_string(sample_path()).unwrap();
        let (set, commented) = sample_keys(&text);
        let fields = match serde_json::to_value(ServeConfig::default()).unwrap() {
            serde_json::Value::Object(m) => m,
            v => panic!("ServeConfig serialises to {v}"),
        };
        for (name, default) in &fields {
            let (is_set, is_commented) = (set.contains(name), commented.contains(name));
            assert!(
                is_set != is_commented,
                "hypic.toml must name `{name}` exactly once, set or (no default) commented out"
            );
            // A key without a default value cannot be written in TOML: commented out.
            assert_eq!(
                is_commented,
                default.is_null(),
                "`{name}`: set it to its default in hypic.toml, or comment it out if it has none"
            );
        }
        for k in set.iter().chain(&commented) {
            assert!(
                fields.contains_key(k),
                "hypic.toml names `{k}`, which ServeConfig lacks"
            );
        }
    }

    #[test]
    fn sample_hypic_toml_commented_keys_are_valid_values() {
        // Uncommenting every example line must still give a file the loader accepts.
        let text = std::fs::read_to_string(sample_path()).unwrap();
        let (_, commented) = sample_keys(&text);
        let uncommented: String = text
            .lines()
            .map(|l| match l.strip_prefix("# ") {
                Some(c) if commented.iter().any(|k| c.starts_with(&format!("{k} = "))) => c,
                _ => l,
            })
            .collect::<Vec<_>>()
            .join("\n");
        let cfg: ServeConfig = toml::from_str(&uncommented).expect("uncommented sample parses");
        cfg.validate().unwrap();
        assert_eq!(cfg.model.as_deref(), Some(Path::new("models/hypic-tiny")));
        assert_eq!(cfg.model_id.as_deref(), Some("hypic-tiny"));
        assert_eq!(cfg.random_weights, Some(0));
        assert!(cfg.database_url.is_some() && cfg.jwks_file.is_some());
    }

    #[test]
    fn a_misspelt_key_is_an_error_naming_it() {
        let err = toml::from_str::<ServeConfig>("max_runing = 4").unwrap_err();
        assert!(err.to_string().contains("max_runing"), "{err}");
    }
}
