//! One log line per request, written when the response body is finished (or the
//! client goes away): request id, tenant pseudonym, method, route, status, time,
//! and for generation requests the prompt, cached and completion tokens, TTFT
//! and segment hits and misses. Never a token, a prompt or any other request text
//! (the route is the matched route template, e.g. `/v1/segments/{id}`, never the
//! path itself, so ids in the path stay out; [`UNMATCHED_ROUTE`] for a path no route
//! matches). 5xx answers are logged at error
//! level with their cause, everything else at info level, under the target
//! `hypic::request`.
//!
//! The tenant pseudonym is a short keyed hash of the tenant
//! ([`crate::auth::IsolationKeyer::pseudonym`]), set by the auth extractor through
//! the [`LogSlot`] in the request's extensions, which [`record_route`] also fills
//! with the matched route; handlers attach [`RequestStats`]
//! and [`ErrorCause`] to their responses.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Body;
use axum::http::{header::HeaderValue, Request};

/// Output format of the log.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Installs the process-wide tracing subscriber on stderr. The filter comes from
/// `HYPIC_LOG`, else `RUST_LOG`, else `info` (syntax of `tracing_subscriber`'s
/// `EnvFilter`, e.g. `info,hypic::request=warn`). Does nothing when a subscriber
/// is already installed.
pub fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = std::env::var("HYPIC_LOG")
        .ok()
        .and_then(|v| EnvFilter::try_new(v).ok())
        .or_else(|| EnvFilter::try_from_default_env().ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => b.try_init(),
        LogFormat::Json => b.json().try_init(),
    };
}

/// The `route` logged for a request whose path matched no route.
pub const UNMATCHED_ROUTE: &str = "unmatched";

/// Written while the request is handled: the caller's tenant pseudonym (by the
/// auth extractor) and the matched route template (by [`record_route`]). A
/// request extension; absent when the request does not come through
/// [`super::net`].
#[derive(Clone, Debug, Default)]
pub struct LogSlot(Arc<Mutex<SlotData>>);

#[derive(Debug, Default)]
struct SlotData {
    tenant: Option<String>,
    route: Option<String>,
}

impl LogSlot {
    /// Records the caller's tenant pseudonym.
    pub fn set_tenant(&self, pseudonym: String) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).tenant = Some(pseudonym);
    }
    /// Records the matched route template (e.g. `/v1/segments/{id}`).
    pub fn set_route(&self, template: &str) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).route =
            Some(template.chars().take(160).collect());
    }
    fn tenant(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .tenant
            .clone()
    }
    fn route(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .route
            .clone()
    }
}

/// Middleware (as a `route_layer`): records the matched route template in the
/// request's [`LogSlot`], so the log line names the route, not the path.
pub async fn record_route(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    if let (Some(m), Some(slot)) = (
        req.extensions().get::<axum::extract::MatchedPath>(),
        req.extensions().get::<LogSlot>(),
    ) {
        slot.set_route(m.as_str());
    }
    next.run(req).await
}

/// Figures of a generation request (a response extension).
#[derive(Clone, Debug, Default)]
pub struct RequestStats {
    /// Prompt tokens over all prompts.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the cache.
    pub cached_tokens: usize,
    /// Tokens generated so far (streams count up while they run).
    pub completion_tokens: Arc<AtomicUsize>,
    /// Time to first token of the first choice, ms.
    pub ttft_ms: Option<f64>,
    /// Segment hits over all choices' prefills.
    pub hits: usize,
    /// Segment misses.
    pub misses: usize,
    /// The tenant's usage counters: completion tokens are added when the last
    /// clone is dropped, once the answer is complete.
    pub usage: Option<Arc<crate::usage::UsageTicket>>,
}

/// Why a request failed with a 5xx (a response extension; logged, not sent).
#[derive(Clone, Debug)]
pub struct ErrorCause(pub String);

/// The id of a request (a request extension; also the `x-request-id` header of
/// the answer).
#[derive(Clone, Debug)]
pub struct RequestId(pub String);

struct Answer {
    status: u16,
    stats: Option<RequestStats>,
    cause: Option<String>,
}

/// A request's log line, written when dropped.
pub struct Pending {
    id: String,
    method: String,
    t0: Instant,
    slot: LogSlot,
    answer: Option<Answer>,
}

impl Pending {
    /// Starts the line of `req` and puts a [`LogSlot`] and a [`RequestId`] into its
    /// extensions.
    pub fn start(req: &mut Request<Body>) -> Pending {
        let x: u64 = rand::random();
        let id = format!("req-{x:016x}");
        let slot = LogSlot::default();
        req.extensions_mut().insert(slot.clone());
        req.extensions_mut().insert(RequestId(id.clone()));
        Pending {
            id,
            method: req.method().as_str().chars().take(16).collect(),
            t0: Instant::now(),
            slot,
            answer: None,
        }
    }

    /// Records the answer's head and adds the `x-request-id` header.
    pub fn respond(mut self, parts: &mut axum::http::response::Parts) -> Pending {
        if let Ok(v) = HeaderValue::from_str(&self.id) {
            parts.headers.insert("x-request-id", v);
        }
        self.answer = Some(Answer {
            status: parts.status.as_u16(),
            stats: parts.extensions.get::<RequestStats>().cloned(),
            cause: parts.extensions.get::<ErrorCause>().map(|c| c.0.clone()),
        });
        self
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let ms = self.t0.elapsed().as_secs_f64() * 1e3;
        let tenant = self.slot.tenant().unwrap_or_else(|| "-".into());
        let route = self.slot.route();
        let route = route.as_deref().unwrap_or(UNMATCHED_ROUTE);
        let Some(a) = &self.answer else {
            tracing::info!(target: "hypic::request", request_id = %self.id, tenant = %tenant,
                method = %self.method, route = %route, duration_ms = ms,
                "client closed the connection before the answer");
            return;
        };
        let (pt, ct, gen, ttft, hits, misses) = match &a.stats {
            Some(s) => (
                Some(s.prompt_tokens),
                Some(s.cached_tokens),
                Some(s.completion_tokens.load(Ordering::Relaxed)),
                s.ttft_ms,
                Some(s.hits),
                Some(s.misses),
            ),
            None => (None, None, None, None, None, None),
        };
        if a.status >= 500 {
            let cause = a.cause.as_deref().unwrap_or("unknown");
            tracing::error!(target: "hypic::request", request_id = %self.id, tenant = %tenant,
                method = %self.method, route = %route, status = a.status, duration_ms = ms,
                prompt_tokens = pt, cached_tokens = ct, completion_tokens = gen, ttft_ms = ttft,
                hits, misses, cause = %cause, "request failed");
        } else {
            tracing::info!(target: "hypic::request", request_id = %self.id, tenant = %tenant,
                method = %self.method, route = %route, status = a.status, duration_ms = ms,
                prompt_tokens = pt, cached_tokens = ct, completion_tokens = gen, ttft_ms = ttft,
                hits, misses, "request");
        }
    }
}
