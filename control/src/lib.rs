//! HYPIC control plane: the catalog of tenants, segments and versions,
//! bearer-JWT auth and isolation keys, Wasm cache policies, the policy
//! simulator, the segment service both HTTP front ends call
//! ([`segments::SegmentService`]), and the HTTP API that exposes them (errors:
//! [`error::ApiError`]).
//!
//! The `hypic` binary (`src/main.rs`) wires these in:
//! [`auth::run_token_command`] for `hypic token`, [`run_control_command`] for
//! a standalone control-plane server, and [`api::control_router`] /
//! [`build_control_state`] to mount the control plane in another server.

pub mod api;
pub mod auth;
pub mod backend;
pub mod bench;
pub mod catalog;
pub mod error;
pub mod persist;
pub mod policy;
pub mod policy_api;
pub mod readiness;
pub mod residency;
pub mod runtime;
pub mod segments;
pub mod serve;
pub mod sim;
pub mod tenants_api;
pub mod ui;
pub mod usage;
pub mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;

pub use api::{control_router, AuthMode, ControlState};
pub use auth::{run_token_command, TokenArgs};
pub use catalog::Catalog;

/// Where the progress bars of `hypic bench` and `hypic eval` draw: nowhere with
/// `--quiet`, else stderr, which indicatif leaves blank when it is not a terminal
/// (a pipe, a CI log, a test harness capturing output).
pub fn progress_target(quiet: bool) -> indicatif::ProgressDrawTarget {
    if quiet {
        indicatif::ProgressDrawTarget::hidden()
    } else {
        indicatif::ProgressDrawTarget::stderr()
    }
}

/// Default period of the JWKS file check, milliseconds.
pub const DEFAULT_JWKS_RELOAD_MS: u64 = 10_000;

/// Options of the control plane (flatten into any server command).
#[derive(clap::Args, Debug, Clone)]
pub struct ControlArgs {
    /// Catalog database: `postgres://…` or `sqlite://…` (default: SQLite in the data directory).
    #[arg(long, env = "HYPIC_DATABASE_URL")]
    pub database_url: Option<String>,
    /// Data directory (signing secret, embedded SQLite catalog).
    #[arg(long, env = "HYPIC_DATA_DIR", default_value = "hypic-data")]
    pub data_dir: PathBuf,
    /// JWKS file with RS256/EdDSA public keys accepted in addition to HS256.
    #[arg(long)]
    pub jwks_file: Option<PathBuf>,
    /// How often to re-read the JWKS file for rotated keys, milliseconds
    /// (0: only on SIGHUP).
    #[arg(long, env = "HYPIC_JWKS_RELOAD_MS", default_value_t = DEFAULT_JWKS_RELOAD_MS)]
    pub jwks_reload_ms: u64,
    /// Audience tokens must carry.
    #[arg(long, default_value = auth::DEFAULT_AUDIENCE)]
    pub audience: String,
    /// Turn authentication off (only allowed on a loopback bind address).
    #[arg(long)]
    pub disable_auth: bool,
    /// Longest token lifetime accepted (`exp - iat`), seconds.
    #[arg(long = "max-token-lifetime", env = "HYPIC_MAX_TOKEN_LIFETIME",
          value_parser = auth::parse_ttl, default_value = "90d")]
    pub max_token_lifetime_s: u64,
    /// Largest policy module accepted, bytes (larger uploads get 413).
    #[arg(long, env = "HYPIC_POLICY_MAX_MODULE_BYTES", default_value_t = policy::DEFAULT_MAX_MODULE_BYTES)]
    pub policy_max_module_bytes: usize,
    /// Policy modules compiled at once (further uploads meanwhile get 429).
    #[arg(long, env = "HYPIC_POLICY_MAX_CONCURRENT_COMPILES", default_value_t = policy::DEFAULT_MAX_CONCURRENT_COMPILES)]
    pub policy_max_concurrent_compiles: usize,
    /// Largest content of one segment version, bytes (beyond: 413).
    #[arg(long, env = "HYPIC_MAX_SEGMENT_BYTES", default_value_t = catalog::DEFAULT_MAX_SEGMENT_BYTES)]
    pub max_segment_bytes: usize,
    /// How long an `Idempotency-Key` of `POST /v1/segments` is remembered, seconds.
    #[arg(long, env = "HYPIC_IDEMPOTENCY_TTL_S", default_value_t = DEFAULT_IDEMPOTENCY_TTL_S)]
    pub idempotency_ttl_s: u64,
}

/// Default of `--idempotency-ttl-s`: 24 hours.
pub const DEFAULT_IDEMPOTENCY_TTL_S: u64 = 24 * 3600;

/// Builds the control-plane state: checks the auth flag against `bind`,
/// creates the signing secret on first start (printing an operator and a
/// demo-tenant token), opens and migrates the catalog, starts the audit
/// writer, loads the active policies and starts the JWKS reloader (when a
/// JWKS file is configured). Needs a tokio runtime.
pub async fn build_control_state(
    args: &ControlArgs,
    bind: SocketAddr,
) -> anyhow::Result<ControlState> {
    auth::check_auth_disable(bind, args.disable_auth)?;
    // The tokens printed at first start live 30 days, or less when this server
    // accepts no token that long.
    let first_ttl_s = (30 * 86400).min(args.max_token_lifetime_s);
    let fs = auth::first_start(&args.data_dir, &args.audience, first_ttl_s)?;
    auth::print_first_start(&fs, &args.data_dir);
    let url = match &args.database_url {
        Some(u) => u.clone(),
        None => format!(
            "sqlite://{}",
            args.data_dir.join("catalog.sqlite").display()
        ),
    };
    readiness::probe_postgres(&url).await?;
    let catalog = Catalog::connect(&url)
        .await
        .map_err(|e| readiness::startup_error(&url, e))?
        .with_limits(catalog::CatalogLimits {
            max_content_bytes: args.max_segment_bytes,
            idempotency_ttl_ms: (args.idempotency_ttl_s.min(i64::MAX as u64 / 1000) * 1000) as i64,
        });
    let mode = if args.disable_auth {
        eprintln!("hypic: WARNING authentication is disabled (loopback only)");
        AuthMode::Disabled
    } else {
        let mut a = auth::Authenticator::hs256(&fs.secret, &args.audience)?
            .with_max_lifetime(args.max_token_lifetime_s);
        if let Some(j) = &args.jwks_file {
            a = a.with_jwks_file(j)?;
        }
        AuthMode::Enabled(a)
    };
    let sink = policy::AuditSink::spawn(catalog.clone());
    let rt = Arc::new(policy::PolicyRuntime::new(
        policy::policy_engine(),
        policy::PolicyLimits {
            max_module_bytes: args.policy_max_module_bytes,
            max_concurrent_compiles: args.policy_max_concurrent_compiles.max(1),
            ..policy::PolicyLimits::default()
        },
        Some(sink),
    ));
    rt.load_active(&catalog).await;
    let state = ControlState::new(catalog, mode, auth::IsolationKeyer::new(&fs.secret), rt);
    // Usage totals and running shadows of the previous run, then written as they move.
    persist::restore(&state)
        .await
        .context("reading the stored usage and shadow policies from the catalog")?;
    state.spawn_persister(persist::PERSIST_EVERY);
    // Key rotation without a restart: re-read the JWKS file periodically and on SIGHUP.
    state.spawn_jwks_reloader(Some(std::time::Duration::from_millis(args.jwks_reload_ms)));
    Ok(state)
}

/// Arguments of a standalone control-plane server.
#[derive(clap::Args, Debug, Clone)]
pub struct ControlServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub bind: SocketAddr,
    /// Control-plane options.
    #[command(flatten)]
    pub control: ControlArgs,
    /// Connection limits and deadlines.
    #[command(flatten)]
    pub net: serve::net::NetArgs,
}

/// Serves the control-plane API alone until Ctrl-C.
pub async fn run_control_command(args: ControlServeArgs) -> anyhow::Result<()> {
    let limits = args.net.limits()?;
    let state = build_control_state(&args.control, args.bind).await?;
    let listener = tokio::net::TcpListener::bind(args.bind)
        .await
        .with_context(|| format!("binding {}", args.bind))?;
    eprintln!("hypic: control plane listening on http://{}", args.bind);
    let ready = state.clone();
    let app = control_router(state.clone()).route(
        "/ready",
        axum::routing::get(move || readiness::ready_control(ready.clone())),
    );
    serve::net::serve(listener, app, limits, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    if let Err(e) = persist::flush(&state).await {
        eprintln!("hypic: could not write usage and shadow counts to the catalog: {e}");
    }
    Ok(())
}
