//! Inference routes: completions, chat completions (SSE streaming), models,
//! health, metrics; the auth extractor; panic and body-limit handling.
use super::errors::parse_json;
use super::prompt::{self, mode_name};
use super::textgen::TextStream;
use super::types::*;
use super::AppState;
use crate::api::Caller;
use crate::auth::Principal;
use crate::catalog::SnapshotEntry;
use crate::error::ApiError;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dataplane::parallel::scatter::{ColdSegment, ScatterReport, ScatterRun};
use dataplane::parallel::EntrySource;
use dataplane::pic::{Mode, PicStats, SegmentRef};
use dataplane::sampling::{Constraint, SamplingParams};
use dataplane::scheduler::{
    ErrorKind, FinishReason, GenEvent, GenRequest, RequestHandle, SubmitError,
};
use dataplane::tokenizer::Bounded;
use futures_util::FutureExt;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The authenticated caller of a serving route (the control plane's bearer-JWT
/// check; 401 OpenAI-style otherwise).
pub struct Tenant(pub Principal);

impl FromRequestParts<AppState> for Tenant {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, s: &AppState) -> Result<Self, ApiError> {
        let Caller(p) = Caller::from_request_parts(parts, &s.0.control).await?;
        Ok(Tenant(p))
    }
}

/// The OpenAPI document of the serving routes, generated from the handlers'
/// annotations; [`openapi`] merges it with the control plane's.
#[derive(utoipa::OpenApi)]
#[openapi(paths(
    health,
    ready,
    metrics,
    metrics_history,
    recorded_traffic,
    models,
    model_one,
    completions,
    chat,
    super::responses::responses,
    super::segments::create,
    super::segments::list,
    super::segments::get_one,
    super::segments::update,
    super::segments::delete,
    super::why::why,
    super::why::evict,
    super::segments::prefill_one,
))]
pub struct ServeApi;

/// The OpenAPI document of `hypic serve` (`GET /openapi.json`): the serving
/// routes, and every control-plane route the server mounts; `/v1/segments` and
/// `/v1/segments/{id}` are the serving routes' (they extend the control plane's).
pub fn openapi() -> utoipa::openapi::OpenApi {
    use utoipa::OpenApi as _;
    let mut doc = crate::api::ControlApi::openapi();
    doc.info.title = "HYPIC".into();
    doc.info.description = Some(
        "OpenAI-compatible, segment-aware inference and its control plane. Every `/v1` \
         route needs `Authorization: Bearer <jwt>`; errors are \
         `{\"error\": {\"message\", \"type\", \"param\", \"code\"}}`."
            .into(),
    );
    for p in ["/v1/segments", "/v1/segments/{id}"] {
        doc.paths.paths.remove(p);
    }
    doc.merge(ServeApi::openapi());
    doc.paths
        .paths
        .insert("/openapi.json".into(), crate::api::openapi_path_item());
    if let Some(tags) = doc.tags.as_mut() {
        tags.push(utoipa::openapi::tag::Tag::new("inference"));
        tags.push(utoipa::openapi::tag::Tag::new("metrics"));
    }
    doc
}

async fn serve_openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(openapi())
}

/// The whole router: serving routes, then the control plane for every other path.
pub fn router(state: AppState) -> Router {
    let limit = state.0.cfg.max_body_bytes;
    let control = state.0.control_router.clone();
    let not_allowed = || async {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method_not_allowed",
            "method not allowed on this route",
        )
    };
    Router::new()
        .route("/health", get(health).fallback(not_allowed))
        .route("/ready", get(ready).fallback(not_allowed))
        .route("/metrics", get(metrics).fallback(not_allowed))
        .route("/openapi.json", get(serve_openapi).fallback(not_allowed))
        .route(
            "/v1/metrics/history",
            get(metrics_history).fallback(not_allowed),
        )
        .route(
            "/v1/admin/traffic",
            get(recorded_traffic).fallback(not_allowed),
        )
        .route("/v1/models", get(models).fallback(not_allowed))
        .route("/v1/models/{id}", get(model_one).fallback(not_allowed))
        .route("/v1/completions", post(completions).fallback(not_allowed))
        .route("/v1/chat/completions", post(chat).fallback(not_allowed))
        .route(
            "/v1/responses",
            post(super::responses::responses).fallback(not_allowed),
        )
        .route(
            "/v1/segments",
            post(super::segments::create)
                .get(super::segments::list)
                .fallback(not_allowed),
        )
        .route(
            "/v1/segments/{id}",
            get(super::segments::get_one)
                .put(super::segments::update)
                .delete(super::segments::delete)
                .fallback(not_allowed),
        )
        .route(
            "/v1/segments/{id}/why",
            get(super::why::why).fallback(not_allowed),
        )
        .route(
            "/v1/segments/{id}/evict",
            post(super::why::evict).fallback(not_allowed),
        )
        .route(
            "/v1/segments/{id}/prefill",
            post(super::segments::prefill_one).fallback(not_allowed),
        )
        .route_layer(axum::middleware::from_fn(super::reqlog::record_route))
        .fallback_service(control)
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(
            limit,
            early_body_limit,
        ))
        .layer(axum::middleware::from_fn(catch_panic))
        .with_state(state)
}

/// Bodies up to this size that declare a length over the limit are read and
/// discarded before the 413, so the client finishes sending and reads a clean
/// answer instead of a reset connection.
const DRAIN_CAP: u64 = 256 << 20;

/// Answers 413 to a declared `Content-Length` over the limit (bodies without a
/// declared length are cut by `DefaultBodyLimit` in the extractors).
async fn early_body_limit(
    State(limit): State<usize>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match declared {
        Some(len) if len > limit as u64 => {
            if len <= DRAIN_CAP {
                use http_body_util::BodyExt;
                let mut body = req.into_body();
                let drain = async {
                    while let Some(f) = body.frame().await {
                        if f.is_err() {
                            break;
                        }
                    }
                };
                let _ = tokio::time::timeout(Duration::from_secs(20), drain).await;
            }
            let mut r = ApiError::body_too_large(limit).into_response();
            r.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
            r
        }
        _ => next.run(req).await,
    }
}

/// Turns a handler panic into a 500 JSON error (the server keeps running).
async fn catch_panic(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    match std::panic::AssertUnwindSafe(next.run(req))
        .catch_unwind()
        .await
    {
        Ok(r) => r,
        Err(_) => ApiError::internal("internal error while handling the request").into_response(),
    }
}

/// Maps a body rejection (too large → 413, body not received before the
/// body-read deadline → 408).
pub fn body_error(e: BytesRejection, limit: usize) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::body_too_large(limit)
    } else if super::net::BodyReadTimeout::is_in(&e) {
        let mut r = ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "timeout_error",
            "body_read_timeout",
            e.body_text(),
        );
        r.message = std::error::Error::source(&e)
            .map(|s| s.to_string())
            .unwrap_or(r.message);
        r
    } else {
        ApiError::invalid("invalid_body", e.body_text())
    }
}

#[utoipa::path(get, path = "/health", tag = "health", summary = "Liveness, model and queue (no token)", operation_id = "serve_health", responses((status = 200, body = Object)))]
async fn health(State(s): State<AppState>) -> Json<Value> {
    let m = s.0.sched.metrics();
    Json(json!({
        "status": "ok",
        "model": s.0.model_id,
        "device": s.0.backend.device,
        "dtype": s.0.backend.dtype,
        "backend": s.0.backend.describe,
        "queue_depth": m.queue_depth.load(std::sync::atomic::Ordering::Relaxed),
        "running": m.running.load(std::sync::atomic::Ordering::Relaxed),
    }))
}

/// Readiness: the catalog accepts a write, the model is loaded and the scheduler
/// runs (see [`crate::readiness`]); `/health` is liveness only.
#[utoipa::path(get, path = "/ready", tag = "health", summary = "Readiness: catalog writable, model loaded, scheduler running (no token)", operation_id = "serve_ready", responses((status = 200, body = Object), (status = 503, description = "not ready: the failing checks", body = Object)))]
async fn ready(State(s): State<AppState>) -> Response {
    let sched = if s.0.sched.is_running() {
        Ok(())
    } else {
        Err((
            "scheduler_stopped",
            "the scheduler is not running; no request can be served".to_string(),
        ))
    };
    crate::readiness::ready_response(&s.0.control, vec![("model_loaded", sched)]).await
}

#[utoipa::path(get, path = "/metrics", tag = "metrics", summary = "Prometheus metrics (text exposition format, no token)", responses((status = 200, description = "Prometheus text format", content_type = "text/plain", body = String)))]
async fn metrics(State(s): State<AppState>) -> Response {
    let mut text =
        s.0.metrics
            .render(&s.0.sched.metrics(), &*s.0.engine, s.0.control.policies());
    if let Some(sc) = &s.0.scatter {
        text.push_str(&super::metrics::scatter_text(&sc.metrics()));
    }
    if let Some(d) = &s.0.residency {
        text.push_str(&d.metrics_text());
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// `GET /v1/metrics/history` (operator): the last hour of metric samples.
#[utoipa::path(get, path = "/v1/metrics/history", tag = "metrics", summary = "The last hour of metric samples, one per interval, and TTFT over the window (operator)", security(("bearer" = [])), responses((status = 200, body = super::history::HistoryView), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody)))]
async fn metrics_history(
    State(s): State<AppState>,
    Tenant(p): Tenant,
) -> Result<Json<super::history::HistoryView>, ApiError> {
    if !p.is_operator() {
        return Err(ApiError::forbidden(
            "operator_required",
            "this endpoint needs the operator role",
        ));
    }
    Ok(Json(s.0.history.view(&s)))
}

/// `GET /v1/admin/traffic` (operator): the recorded recent prompts as a dry-run trace.
#[utoipa::path(get, path = "/v1/admin/traffic", tag = "policies", summary = "The recorded recent prompts (tenant-pseudonymised segment ids, versions, tokens, bytes) as a dry-run trace (operator)", security(("bearer" = [])), responses((status = 200, body = super::traffic::TrafficView), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody)))]
async fn recorded_traffic(
    State(s): State<AppState>,
    Tenant(p): Tenant,
) -> Result<Json<super::traffic::TrafficView>, ApiError> {
    if !p.is_operator() {
        return Err(ApiError::forbidden(
            "operator_required",
            "this endpoint needs the operator role",
        ));
    }
    let pool = (s.0.cfg.public_pool_mib as u64).saturating_mul(1 << 20);
    Ok(Json(s.0.traffic.view(pool)))
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn model_card(s: &AppState) -> Value {
    json!({"id": s.0.model_id, "object": "model", "created": s.0.model_created, "owned_by": "hypic",
           "max_model_len": s.0.ctx})
}

#[utoipa::path(get, path = "/v1/models", tag = "inference", summary = "The served model (OpenAI list)", security(("bearer" = [])), responses((status = 200, body = Object), (status = 401, description = "no or bad token", body = crate::error::ErrorBody)))]
async fn models(State(s): State<AppState>, Tenant(_): Tenant) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_card(&s)]}))
}

#[utoipa::path(get, path = "/v1/models/{id}", tag = "inference", summary = "One model", security(("bearer" = [])), params(("id" = String, Path, description = "model id")), responses((status = 200, body = Object), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 404, description = "not the served model", body = crate::error::ErrorBody)))]
async fn model_one(
    State(s): State<AppState>,
    Tenant(_): Tenant,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<Value>, ApiError> {
    if id != s.0.model_id {
        return Err(ApiError::openai_not_found(
            "model_not_found",
            format!("the model {id:?} does not exist"),
        ));
    }
    Ok(Json(model_card(&s)))
}

// ---- prompt resolution ----------------------------------------------------------------

/// One segment of a request before tokenisation.
#[derive(Clone, Debug)]
pub enum SegSource {
    /// Inline text (tenant-private namespace).
    Text(String),
    /// Token ids (a completions prompt given as ids; tenant-private namespace, like
    /// inline text, so it shares cache entries with the text that encodes to them).
    Tokens(Vec<u32>),
    /// A catalog segment.
    Catalog {
        /// Id.
        id: String,
        /// Expected version.
        version: Option<i64>,
    },
}

/// A tokenised segment with its namespace.
#[derive(Clone, Debug)]
pub struct Resolved {
    /// Tokens.
    pub tokens: Arc<Vec<u32>>,
    /// Isolation key.
    pub isolation: String,
    /// Catalog segment as the request named it (an own id or an address).
    pub id: Option<String>,
    /// Catalog segment address.
    pub address: Option<String>,
    /// Pinned catalog version.
    pub version: Option<i64>,
    /// Shared namespace.
    pub shared: bool,
    /// Text (for echo).
    pub text: Option<String>,
}

fn private_key(s: &AppState, tenant: &str, salt: Option<&str>) -> String {
    let e = SnapshotEntry {
        segment_id: String::new(),
        version: 0,
        content_hash: String::new(),
        owner_tenant: tenant.to_string(),
        public: false,
    };
    s.0.control.keyer().isolation_key(tenant, &e, false, salt)
}

// ---- bounded tokenisation ---------------------------------------------------------

/// Tokens one prompt may have: the model's context, or the per-request prefill cap
/// when that is lower.
fn prompt_limit(s: &AppState) -> usize {
    s.0.ctx.min(s.0.cfg.max_prefill_tokens_per_request)
}

/// A prompt (in request field `field`) of `n` tokens (`exact`) or at least `n` is
/// over [`prompt_limit`]: 400 naming the context or the request cap.
fn over_limit(s: &AppState, field: &str, n: usize, exact: bool) -> ApiError {
    let (ctx, cap) = (s.0.ctx, s.0.cfg.max_prefill_tokens_per_request);
    let has = if exact {
        format!("{n} tokens")
    } else {
        format!("at least {n} tokens")
    };
    let e = if ctx <= cap {
        ApiError::invalid(
            "context_length_exceeded",
            format!(
                "this model's maximum context length is {ctx} tokens, but the prompt has {has}"
            ),
        )
    } else {
        ApiError::invalid(
            "prefill_tokens_exceeded",
            format!(
                "a request may prefill at most {cap} prompt tokens (max_prefill_tokens_per_request), but the prompt has {has}"
            ),
        )
    };
    ApiError {
        param: Some(field.into()),
        ..e
    }
}

/// Refuses, before any tokenisation, a text of `bytes` bytes (the prompt of
/// request field `field`) that cannot fit [`prompt_limit`] tokens: more bytes than
/// the limit times the tokenizer's most bytes per token.
pub(crate) fn check_fits(s: &AppState, field: &str, bytes: usize) -> Result<(), ApiError> {
    if let Some(b) = s.0.tok.max_bytes_per_token() {
        if bytes > prompt_limit(s).saturating_mul(b) {
            return Err(over_limit(s, field, bytes.div_ceil(b), false));
        }
    }
    Ok(())
}

/// Refuses a text of `bytes` bytes in `param` over the cap `cap` (config key
/// `key`) per `what`: 400 `string_above_max_length`.
pub(crate) fn check_bytes(
    param: &str,
    bytes: usize,
    cap: usize,
    key: &str,
    what: &str,
) -> Result<(), ApiError> {
    if bytes > cap {
        return Err(ApiError {
            param: Some(param.into()),
            ..ApiError::invalid(
                "string_above_max_length",
                format!("'{param}' is {bytes} bytes; the server allows at most {cap} bytes per {what} ({key})"),
            )
        });
    }
    Ok(())
}

/// Refuses more than `max_segments_per_request` segments in one request.
pub(crate) fn check_segment_count(s: &AppState, field: &str, n: usize) -> Result<(), ApiError> {
    let cap = s.0.cfg.max_segments_per_request;
    if n > cap {
        return Err(ApiError {
            param: Some(field.into()),
            ..ApiError::invalid(
                "too_many_segments",
                format!("a request may have at most {cap} segments (max_segments_per_request), but this one has {n}"),
            )
        });
    }
    Ok(())
}

/// Parses a request body ([`parse_json`]) on the blocking pool in a
/// tokenisation turn: a large body's parse never holds an async worker (so
/// `/health` does not wait on it), and at most `tokenize_concurrency` bodies are
/// parsed into memory at once.
pub(crate) async fn parse_body<T: serde::de::DeserializeOwned + Send + 'static>(
    s: &AppState,
    body: Bytes,
) -> Result<T, ApiError> {
    in_tokenize_turn(s, move || parse_json::<T>(&body)).await?
}

/// Runs `f` on the blocking pool in a tokenisation turn (`tokenize_concurrency`
/// turns; the turn is held until `f` returns, even when the request is dropped).
pub(crate) async fn in_tokenize_turn<T: Send + 'static>(
    s: &AppState,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    let permit =
        s.0.tokenize_gate
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?;
    tokio::task::spawn_blocking(move || {
        let out = f();
        drop(permit);
        out
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))
}

/// Tokenises a segment's text (`param`: the field it came from) of at most
/// `max_segment_bytes` bytes and the model's context in tokens, without tokenising
/// more than a bounded piece of a text that cannot fit. 400 when over.
pub(crate) async fn tokenize_segment(
    s: &AppState,
    content: String,
    param: &str,
) -> Result<Vec<u32>, ApiError> {
    check_bytes(
        param,
        content.len(),
        s.0.cfg.max_segment_bytes,
        "max_segment_bytes",
        "segment",
    )?;
    let (tok, ctx) = (s.0.tok.clone(), s.0.ctx);
    match in_tokenize_turn(s, move || tok.encode_within(&content, ctx))
        .await?
        .map_err(|e| ApiError::invalid("tokenization_error", e.to_string()))?
    {
        Bounded::Fits(ids) => Ok(ids),
        Bounded::Over { at_least, .. } => Err(ApiError {
            param: Some(param.into()),
            ..ApiError::invalid(
                "context_length_exceeded",
                format!(
                    "the segment has at least {at_least} tokens, over the model's context of {ctx}"
                ),
            )
        }),
    }
}

/// Tokens of a catalog segment version (tokenised once per server).
pub(crate) async fn catalog_tokens(
    s: &AppState,
    id: &str,
    version: i64,
    content_hash: &str,
) -> Result<(Arc<Vec<u32>>, String), ApiError> {
    if let Some(c) =
        s.0.known
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .tokens
            .get(&(id.to_string(), version))
    {
        if c.content_hash == content_hash {
            // Content is only needed for echo; fetch lazily below when absent.
            return Ok((c.tokens.clone(), String::new()));
        }
    }
    let content =
        s.0.control
            .catalog()
            .version_content(id, version)
            .await
            .map_err(ApiError::from)?
            .ok_or_else(|| {
                ApiError::openai_not_found(
                    "segment_not_found",
                    format!("segment {id:?} has no content"),
                )
            })?;
    if crate::catalog::content_hash(&content) != content_hash {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "invalid_request_error",
            "version_conflict",
            format!("segment {id:?} changed while the request was resolved; retry"),
        ));
    }
    let tokens = tokenize_segment(s, content.clone(), "segments")
        .await
        .map_err(|mut e| {
            e.message = format!("catalog segment {id:?}: {}", e.message);
            e
        })?;
    let tokens = Arc::new(tokens);
    let mut k = s.0.known.lock().unwrap_or_else(|p| p.into_inner());
    if k.tokens.len() > 65536 {
        k.tokens.clear();
    }
    k.tokens.insert(
        (id.to_string(), version),
        super::CachedTokens {
            content_hash: content_hash.to_string(),
            tokens: tokens.clone(),
        },
    );
    Ok((tokens, content))
}

/// Resolves and tokenises a request's segments for `tenant`: catalog segments get
/// a version pinned in one snapshot and the isolation key the control plane
/// derives; inline text gets the tenant's private key. `field` is the request
/// field the segments came from (`messages`, `prompt` or `segments`), named by the
/// errors about the prompt as a whole; `empty` is the message when it has no tokens.
pub async fn resolve(
    s: &AppState,
    tenant: &str,
    salt: Option<&str>,
    sources: Vec<SegSource>,
    field: &str,
    empty: &str,
) -> Result<Vec<Resolved>, ApiError> {
    check_segment_count(s, field, sources.len())?;
    if let Some(salt) = salt {
        if salt.len() > 256 {
            return Err(ApiError::invalid_param(
                "hypic.salt",
                "salt must be at most 256 bytes",
            ));
        }
    }
    let ids: Vec<String> = sources
        .iter()
        .filter_map(|x| match x {
            SegSource::Catalog { id, .. } => Some(id.clone()),
            _ => None,
        })
        .collect();
    let mut snap = std::collections::HashMap::new();
    if !ids.is_empty() {
        let mut uniq = ids.clone();
        uniq.sort();
        uniq.dedup();
        let r =
            s.0.control
                .segments()
                .snapshot(tenant, &uniq, salt)
                .await
                .map_err(|e| {
                    let mut se = e;
                    if se.status == StatusCode::NOT_FOUND {
                        se.code = "segment_not_found";
                        se.kind = "invalid_request_error";
                        se.param = Some("segments".into());
                    }
                    se
                })?;
        for it in r.segments {
            snap.insert(it.segment_id.clone(), it);
        }
    }
    let texts: Vec<(usize, String)> = sources
        .iter()
        .enumerate()
        .filter_map(|(i, x)| match x {
            SegSource::Text(t) => Some((i, t.clone())),
            _ => None,
        })
        .collect();
    let text_bytes: usize = texts.iter().map(|(_, t)| t.len()).sum();
    check_fits(s, field, text_bytes)?;
    for (i, t) in &texts {
        let param = match field {
            "segments" => format!("segments[{i}].text"),
            _ => field.to_string(),
        };
        check_bytes(
            &param,
            t.len(),
            s.0.cfg.max_segment_bytes,
            "max_segment_bytes",
            "segment",
        )?;
    }
    // Inline texts share the prompt's budget: tokenisation stops at the first text
    // that takes the prompt past it.
    let tok = s.0.tok.clone();
    let limit = prompt_limit(s);
    type Encoded = Result<Vec<(usize, String, Vec<u32>)>, usize>;
    let encoded = in_tokenize_turn(s, move || -> dataplane::Result<Encoded> {
        let mut left = limit;
        let mut out = Vec::with_capacity(texts.len());
        for (i, t) in texts {
            match tok.encode_within(&t, left)? {
                Bounded::Fits(ids) => {
                    left -= ids.len();
                    out.push((i, t, ids));
                }
                Bounded::Over { at_least, .. } => {
                    return Ok(Err(limit - left + at_least));
                }
            }
        }
        Ok(Ok(out))
    })
    .await?
    .map_err(|e: dataplane::error::Error| ApiError::invalid("tokenization_error", e.to_string()))?
    .map_err(|n| over_limit(s, field, n, false))?;
    let mut encoded: std::collections::HashMap<usize, (String, Vec<u32>)> = encoded
        .into_iter()
        .map(|(i, t, ids)| (i, (t, ids)))
        .collect();
    let private = private_key(s, tenant, salt);
    let mut out = Vec::with_capacity(sources.len());
    for (i, src) in sources.into_iter().enumerate() {
        match src {
            SegSource::Text(_) => {
                let (text, ids) = encoded.remove(&i).expect("encoded above");
                if ids.is_empty() {
                    continue;
                }
                out.push(Resolved {
                    tokens: Arc::new(ids),
                    isolation: private.clone(),
                    id: None,
                    address: None,
                    version: None,
                    shared: false,
                    text: Some(text),
                });
            }
            SegSource::Tokens(ids) => {
                if ids.is_empty() {
                    continue;
                }
                let text = s.0.tok.decode(&ids).ok();
                out.push(Resolved {
                    tokens: Arc::new(ids),
                    isolation: private.clone(),
                    id: None,
                    address: None,
                    version: None,
                    shared: false,
                    text,
                });
            }
            SegSource::Catalog { id, version } => {
                let it = snap.get(&id).ok_or_else(|| {
                    ApiError::openai_not_found(
                        "segment_not_found",
                        format!("segment {id:?} not found"),
                    )
                })?;
                if let Some(v) = version {
                    if v != it.version {
                        s.0.why
                            .record_version_mismatch(tenant, &it.address, v, it.version);
                        return Err(ApiError {
                            param: Some(format!("segments[{i}].version")),
                            ..ApiError::new(
                                StatusCode::CONFLICT,
                                "invalid_request_error",
                                "version_mismatch",
                                format!("segment {id:?} is at version {}, not {v}", it.version),
                            )
                        });
                    }
                }
                let (tokens, text) =
                    catalog_tokens(s, &it.address, it.version, &it.content_hash).await?;
                if tokens.is_empty() {
                    continue;
                }
                s.0.known
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .isolations
                    .entry(it.address.clone())
                    .or_default()
                    .insert(it.isolation_key.clone());
                out.push(Resolved {
                    tokens,
                    isolation: it.isolation_key.clone(),
                    id: Some(id),
                    address: Some(it.address.clone()),
                    version: Some(it.version),
                    shared: it.shared,
                    text: if text.is_empty() { None } else { Some(text) },
                });
            }
        }
    }
    if out.is_empty() {
        return Err(ApiError::invalid_param(field, empty));
    }
    let total: usize = out.iter().map(|r| r.tokens.len()).sum();
    if total > prompt_limit(s) {
        return Err(over_limit(s, field, total, true));
    }
    Ok(out)
}

// ---- generation -------------------------------------------------------------------

/// Sampling and output settings shared by every choice.
#[derive(Clone, Debug)]
pub struct GenSettings {
    /// Mode.
    pub mode: Mode,
    /// max_tokens.
    pub max_tokens: usize,
    /// Sampling.
    pub sampling: SamplingParams,
    /// n.
    pub n: usize,
    /// Stop strings.
    pub stops: Vec<String>,
    /// Top log-probabilities per token (None: no logprobs).
    pub logprobs: Option<usize>,
    /// Do not stop at end-of-sequence tokens.
    pub ignore_eos: bool,
}

fn check_sampling(
    temperature: Option<f32>,
    top_p: Option<f32>,
    n: Option<i64>,
    max_n: usize,
) -> Result<(f32, f32, usize), ApiError> {
    let t = temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&t) || !t.is_finite() {
        return Err(ApiError::invalid_param(
            "temperature",
            "temperature must be between 0 and 2",
        ));
    }
    let p = top_p.unwrap_or(1.0);
    if !(p > 0.0 && p <= 1.0) {
        return Err(ApiError::invalid_param("top_p", "top_p must be in (0, 1]"));
    }
    let n = n.unwrap_or(1);
    if n < 1 || n as usize > max_n {
        return Err(ApiError::invalid_param(
            "n",
            format!("n must be between 1 and {max_n}"),
        ));
    }
    Ok((t, p, n as usize))
}

/// The logit-processor fields of a completions or chat request.
struct ProcessorFields<'a> {
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    logit_bias: Option<&'a LogitBias>,
    min_tokens: Option<i64>,
}

/// Checks the logit-processor fields (each 400 names its field) and writes them
/// into `sp`; `max_tokens` bounds `min_tokens`.
fn check_processors(
    s: &AppState,
    f: ProcessorFields<'_>,
    max_tokens: usize,
    sp: &mut SamplingParams,
) -> Result<(), ApiError> {
    for (name, v, slot) in [
        (
            "presence_penalty",
            f.presence_penalty,
            &mut sp.presence_penalty,
        ),
        (
            "frequency_penalty",
            f.frequency_penalty,
            &mut sp.frequency_penalty,
        ),
    ] {
        let v = v.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(&v) {
            return Err(ApiError::invalid_param(
                name,
                format!("{name} must be between -2 and 2, got {v}"),
            ));
        }
        *slot = v;
    }
    let r = f.repetition_penalty.unwrap_or(1.0);
    if !(r > 0.0 && r <= 10.0) {
        return Err(ApiError::invalid_param(
            "repetition_penalty",
            format!("repetition_penalty must be in (0, 10], got {r}"),
        ));
    }
    sp.repetition_penalty = r;
    let vocab = s.0.engine.config().vocab_size;
    sp.logit_bias.clear();
    for (k, &b) in f.logit_bias.into_iter().flatten() {
        let id = k.parse::<u32>().ok().filter(|&t| (t as usize) < vocab);
        let Some(id) = id else {
            return Err(ApiError::invalid_param(
                "logit_bias",
                format!(
                    "logit_bias key {k:?} is not a token id (a decimal integer below the vocabulary size {vocab})"
                ),
            ));
        };
        if !(-100.0..=100.0).contains(&b) {
            return Err(ApiError::invalid_param(
                "logit_bias",
                format!("logit_bias[{k:?}] must be between -100 and 100, got {b}"),
            ));
        }
        sp.logit_bias.push((id, b as f32));
    }
    let m = f.min_tokens.unwrap_or(0);
    if m < 0 || m as u64 > max_tokens as u64 {
        return Err(ApiError::invalid_param(
            "min_tokens",
            format!("min_tokens must be between 0 and max_tokens ({max_tokens}), got {m}"),
        ));
    }
    sp.min_tokens = m as usize;
    Ok(())
}

/// The sampling parameters of a request: the checked `(temperature, top_p)`, the
/// request's `top_k` and `seed`, and its logit processors ([`check_processors`]).
fn request_sampling(
    s: &AppState,
    (temperature, top_p, top_k, seed): (f32, f32, Option<usize>, Option<u64>),
    f: ProcessorFields<'_>,
    max_tokens: usize,
) -> Result<SamplingParams, ApiError> {
    let mut sp = SamplingParams {
        temperature,
        top_k: top_k.unwrap_or(0),
        top_p,
        seed,
        ..Default::default()
    };
    check_processors(s, f, max_tokens, &mut sp)?;
    Ok(sp)
}

/// The decoding constraint of a request's `response_format` (None for text), compiled
/// on the blocking pool. Errors: 400 naming the field of a bad format.
async fn compile_format(
    s: &AppState,
    format: Option<ResponseFormat>,
) -> Result<Option<Constraint>, ApiError> {
    let Some(format) = format else {
        return Ok(None);
    };
    if format.kind == "text" {
        return Ok(None);
    }
    let g = s.0.grammars.clone();
    in_tokenize_turn(s, move || g.compile(&format)).await?
}

/// A 400 for the first field of `body` the route does not read (`known`).
fn check_fields(body: &[u8], known: &[&str]) -> Result<(), ApiError> {
    match unsupported_field(body, known) {
        None => Ok(()),
        Some(f) => Err(ApiError {
            param: Some(f.clone()),
            ..ApiError::invalid(
                "unsupported_parameter",
                format!("the parameter '{f}' is not supported by this server"),
            )
        }),
    }
}

fn check_max_tokens(
    s: &AppState,
    given: Option<i64>,
    param: &str,
    prompt_tokens: usize,
) -> Result<usize, ApiError> {
    let room = s.0.ctx.saturating_sub(prompt_tokens);
    match given {
        Some(m) if m <= 0 => Err(ApiError::invalid_param(
            param,
            format!("{param} must be at least 1, got {m}"),
        )),
        Some(m) if m as u64 > room as u64 => Err(ApiError {
            param: Some(param.into()),
            ..ApiError::invalid(
                "context_length_exceeded",
                format!(
                    "this model's maximum context length is {} tokens; the prompt has {prompt_tokens} tokens and {param} is {m}",
                    s.0.ctx
                ),
            )
        }),
        Some(m) => Ok(m as usize),
        None if room == 0 => Err(ApiError::invalid(
            "context_length_exceeded",
            format!("the prompt fills the whole context of {} tokens", s.0.ctx),
        )),
        None => Ok(s.0.cfg.default_max_tokens.min(room)),
    }
}

fn check_stops(stop: Option<StopSpec>) -> Result<Vec<String>, ApiError> {
    let v = stop.map(|s| s.into_vec()).unwrap_or_default();
    if v.len() > MAX_STOPS {
        return Err(ApiError::invalid_param(
            "stop",
            format!("'stop' must be a string or an array of up to {MAX_STOPS} strings"),
        ));
    }
    if v.iter().any(|s| s.len() > 256) {
        return Err(ApiError::invalid_param(
            "stop",
            "stop sequences must be at most 256 bytes",
        ));
    }
    Ok(v)
}

fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::QueueFull {
            capacity,
            retry_after_s,
        } => ApiError::queue_full(
            format!("the server is busy ({capacity} requests queued); retry later"),
            retry_after_s,
        ),
        SubmitError::Invalid(m) => {
            let code = if m.contains("context") {
                "context_length_exceeded"
            } else {
                "invalid_request"
            };
            ApiError::invalid(code, m)
        }
        SubmitError::Closed => ApiError::unavailable("the scheduler is not running"),
    }
}

fn event_error(kind: ErrorKind, message: String) -> ApiError {
    match kind {
        ErrorKind::QueueTimeout => ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "timeout_error",
            "queue_timeout",
            message,
        ),
        ErrorKind::InvalidRequest => ApiError::invalid("invalid_request", message),
        ErrorKind::TooLarge => ApiError::invalid("request_too_large", message),
        ErrorKind::Internal => ApiError::internal(message),
    }
}

/// One token with its log-probabilities.
#[derive(Clone, Debug)]
pub struct TokLp {
    /// Token text.
    pub text: String,
    /// Log-probability.
    pub logprob: f32,
    /// Alternatives.
    pub top: Vec<(String, f32)>,
}

/// The prefill report of a choice.
#[derive(Clone, Debug)]
pub struct StartInfo {
    /// PIC stats.
    pub stats: PicStats,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// TTFT.
    pub ttft: Duration,
    /// Queued.
    pub queued: Duration,
}

struct Choice {
    handle: Option<RequestHandle>,
    text: TextStream,
    start: Option<StartInfo>,
    finish: Option<&'static str>,
    last: Option<Instant>,
    generated: usize,
}

/// What the driver produced.
pub enum Out {
    /// New text (and the tokens' logprobs) of choice `i`.
    Delta(usize, String, Vec<TokLp>),
    /// Choice `i` finished.
    Finish(usize, &'static str),
    /// Choice `i` failed after it started.
    Error(usize, ApiError),
}

/// Drives the handles of one HTTP request: detokenises, applies stop strings
/// (cancelling the sequence when one matches), records latency metrics.
pub struct Driver {
    s: AppState,
    mode: &'static str,
    choices: Vec<Choice>,
    logprobs: Option<usize>,
    pending: VecDeque<Out>,
    next_poll: usize,
    t0: Instant,
    endpoint: &'static str,
    /// Tokens generated so far over all choices (for the request's log line).
    tokens_out: Arc<std::sync::atomic::AtomicUsize>,
}

impl Driver {
    fn new(
        s: AppState,
        handles: Vec<RequestHandle>,
        set: &GenSettings,
        endpoint: &'static str,
        t0: Instant,
    ) -> Self {
        Driver {
            s,
            mode: mode_name(&set.mode),
            choices: handles
                .into_iter()
                .map(|h| Choice {
                    handle: Some(h),
                    text: TextStream::new(set.stops.clone()),
                    start: None,
                    finish: None,
                    last: None,
                    generated: 0,
                })
                .collect(),
            logprobs: set.logprobs,
            pending: VecDeque::new(),
            next_poll: 0,
            t0,
            endpoint,
            tokens_out: Arc::default(),
        }
    }

    /// Waits for every choice's prefill; the first error becomes the answer.
    async fn started(&mut self) -> Result<(), ApiError> {
        for i in 0..self.choices.len() {
            let ev = match self.choices[i].handle.as_mut() {
                Some(h) => h.events.recv().await,
                None => continue,
            };
            match ev {
                Some(GenEvent::Started {
                    stats,
                    prompt_tokens,
                    ttft,
                    queued,
                    ..
                }) => {
                    let m = &self.s.0.metrics;
                    m.ttft
                        .with_label_values(&[self.mode])
                        .observe(ttft.as_secs_f64());
                    let reused = stats.tokens_reused as u64;
                    m.prompt_tokens
                        .with_label_values(&[self.mode, "cached"])
                        .inc_by(reused);
                    m.prompt_tokens
                        .with_label_values(&[self.mode, "computed"])
                        .inc_by((prompt_tokens as u64).saturating_sub(reused));
                    m.seam_tokens
                        .with_label_values(&[self.mode])
                        .inc_by(stats.seam_tokens as u64);
                    for sgm in &stats.segments {
                        m.segments
                            .with_label_values(&[self.mode, outcome_name(sgm.outcome)])
                            .inc();
                    }
                    m.observe_reuse(self.mode, &stats);
                    self.choices[i].start = Some(StartInfo {
                        stats,
                        prompt_tokens,
                        ttft,
                        queued,
                    });
                    self.choices[i].last = Some(Instant::now());
                }
                Some(GenEvent::Error { kind, message }) => return Err(event_error(kind, message)),
                Some(other) => {
                    return Err(ApiError::internal(format!(
                        "unexpected first event {other:?}"
                    )))
                }
                None => return Err(ApiError::internal("the scheduler dropped the request")),
            }
        }
        Ok(())
    }

    fn token_text(&self, id: u32) -> String {
        self.s.0.tok.decode(&[id]).unwrap_or_default()
    }

    fn handle_event(&mut self, i: usize, ev: Option<GenEvent>) {
        let tok = self.s.0.tok.clone();
        match ev {
            Some(GenEvent::Token {
                id, logprob, top, ..
            }) => {
                let now = Instant::now();
                let c = &mut self.choices[i];
                if let Some(l) = c.last {
                    if c.generated > 0 {
                        self.s
                            .0
                            .metrics
                            .itl
                            .with_label_values(&[self.mode])
                            .observe((now - l).as_secs_f64());
                    }
                }
                c.last = Some(now);
                c.generated += 1;
                self.tokens_out
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let step = c.text.push(&tok, id);
                let lps = if self.logprobs.is_some() {
                    vec![TokLp {
                        text: self.token_text(id),
                        logprob,
                        top: top.iter().map(|(t, l)| (self.token_text(*t), *l)).collect(),
                    }]
                } else {
                    vec![]
                };
                if !step.delta.is_empty() || !lps.is_empty() {
                    self.pending.push_back(Out::Delta(i, step.delta, lps));
                }
                if step.stopped {
                    let c = &mut self.choices[i];
                    c.handle = None; // cancels the sequence
                    c.finish = Some("stop");
                    self.pending.push_back(Out::Finish(i, "stop"));
                }
            }
            Some(GenEvent::Done { reason, .. }) => {
                let c = &mut self.choices[i];
                let rest = c.text.finish(&tok);
                if !rest.is_empty() {
                    self.pending.push_back(Out::Delta(i, rest, vec![]));
                }
                let r = match reason {
                    FinishReason::Length => "length",
                    FinishReason::Stop | FinishReason::Cancelled => "stop",
                };
                c.handle = None;
                c.finish = Some(r);
                self.pending.push_back(Out::Finish(i, r));
            }
            Some(GenEvent::Error { kind, message }) => {
                let c = &mut self.choices[i];
                c.handle = None;
                c.finish = Some("error");
                self.pending
                    .push_back(Out::Error(i, event_error(kind, message)));
            }
            Some(GenEvent::Started { .. } | GenEvent::Scored { .. }) => {}
            None => {
                let c = &mut self.choices[i];
                c.handle = None;
                c.finish = Some("error");
                self.pending.push_back(Out::Error(
                    i,
                    ApiError::internal("the scheduler dropped the request"),
                ));
            }
        }
    }

    /// The next output, or `None` when every choice has finished.
    pub async fn next(&mut self) -> Option<Out> {
        loop {
            if let Some(o) = self.pending.pop_front() {
                return Some(o);
            }
            if self.choices.iter().all(|c| c.handle.is_none()) {
                self.observe_end();
                return None;
            }
            let n = self.choices.len();
            let start = self.next_poll;
            let (i, ev) = std::future::poll_fn(|cx| {
                for k in 0..n {
                    let i = (start + k) % n;
                    if let Some(h) = self.choices[i].handle.as_mut() {
                        if let Poll::Ready(ev) = h.events.poll_recv(cx) {
                            return Poll::Ready((i, ev));
                        }
                    }
                }
                Poll::Pending
            })
            .await;
            self.next_poll = (i + 1) % n;
            self.handle_event(i, ev);
        }
    }

    fn observe_end(&mut self) {
        if self.endpoint.is_empty() {
            return;
        }
        let m = &self.s.0.metrics;
        m.e2e
            .with_label_values(&[self.endpoint])
            .observe(self.t0.elapsed().as_secs_f64());
        let gen: usize = self.choices.iter().map(|c| c.generated).sum();
        m.completion_tokens
            .with_label_values(&[self.mode])
            .inc_by(gen as u64);
        self.endpoint = "";
    }
}

fn outcome_name(o: dataplane::pic::Outcome) -> &'static str {
    use dataplane::pic::Outcome::*;
    match o {
        Computed => "computed",
        PrefixHit => "prefix_hit",
        Hit => "hit",
        Miss => "miss",
    }
}

/// The `hypic` extension of a prompt's first choice.
pub fn hypic_ext(mode: &Mode, st: &StartInfo, segs: &[Resolved]) -> HypicResponseExt {
    let (w, r) = match mode {
        Mode::Hypic {
            seam_width,
            rope_fix,
        } => (Some(*seam_width), Some(*rope_fix)),
        _ => (None, None),
    };
    HypicResponseExt {
        mode: mode_name(mode).into(),
        seam_width: w,
        rope_fix: r,
        tokens_computed: st.stats.tokens_computed,
        tokens_reused: st.stats.tokens_reused,
        hits: st.stats.hits,
        misses: st.stats.misses,
        ttft_ms: st.ttft.as_secs_f64() * 1e3,
        queued_ms: st.queued.as_secs_f64() * 1e3,
        segments: st
            .stats
            .segments
            .iter()
            .map(|x| {
                let r = segs.get(x.index);
                SegmentReport {
                    index: x.index,
                    tokens: x.tokens,
                    outcome: outcome_name(x.outcome).into(),
                    computed: x.computed,
                    reused: x.reused,
                    seam: x.seam,
                    content_hash: x.content_hash.clone(),
                    id: r.and_then(|r| r.id.clone()),
                    version: r.and_then(|r| r.version),
                    shared: r.map(|r| r.shared).unwrap_or(false),
                    miss_reason: x.miss_reason.map(|m| m.as_str().into()),
                }
            })
            .collect(),
        scatter: None,
    }
}

/// Submits every prompt `set.n` times (seed + i); on any refusal the ones already
/// queued are cancelled. With segment-parallel workers, each
/// prompt's cold segments are scattered first and their entries supplied to the
/// prompt's first choice; the returned runs (one per prompt, `None` when nothing
/// was scattered) give the scatter statistics and cancel the scatter when dropped.
#[allow(clippy::type_complexity)]
fn submit_all(
    s: &AppState,
    tenant: &str,
    prompts: &[Vec<Resolved>],
    set: &GenSettings,
) -> Result<(Vec<RequestHandle>, Vec<Option<Arc<ScatterRun>>>), ApiError> {
    let mut handles = Vec::with_capacity(prompts.len() * set.n);
    let mut runs = Vec::with_capacity(prompts.len());
    for segs in prompts {
        for r in segs {
            if let (Some(address), Some(version)) = (&r.address, r.version) {
                super::residency::label(s, address, version, &r.tokens, &r.isolation);
            }
        }
        let segments: Vec<SegmentRef> = segs
            .iter()
            .map(|r| SegmentRef {
                tokens: r.tokens.as_ref().clone(),
                isolation: r.isolation.clone(),
            })
            .collect();
        let run = s.0.scatter.as_ref().and_then(|sc| {
            let cold =
                s.0.engine
                    .cold_segments(&segments, set.mode, tenant)
                    .into_iter()
                    .map(|(index, roles)| ColdSegment {
                        index,
                        tokens: segments[index].tokens.clone(),
                        isolation: segments[index].isolation.clone(),
                        roles,
                    })
                    .collect();
            sc.start(cold)
        });
        for i in 0..set.n {
            let mut sampling = set.sampling.clone();
            sampling.seed = sampling.seed.map(|x| x.wrapping_add(i as u64));
            let req = GenRequest {
                segments: segments.clone(),
                mode: set.mode,
                tenant: tenant.to_string(),
                sampling,
                max_tokens: set.max_tokens,
                stop_token_ids: if set.ignore_eos {
                    vec![]
                } else {
                    s.0.tok.eos_ids.clone()
                },
                top_logprobs: set.logprobs.unwrap_or(0),
                logprobs: set.logprobs.is_some(),
                score: None,
            };
            let source = run
                .clone()
                .filter(|_| i == 0)
                .map(|r| r as Arc<dyn EntrySource>);
            handles.push(
                s.0.sched
                    .submit_with_source(req, source)
                    .map_err(submit_error)?,
            );
        }
        runs.push(run);
    }
    Ok((handles, runs))
}

fn record_status(s: &AppState, endpoint: &str, status: StatusCode) {
    s.0.metrics
        .requests
        .with_label_values(&[endpoint, status.as_str()])
        .inc();
}

pub(crate) fn rand_id(prefix: &str) -> String {
    let x: u128 = rand::random();
    format!("{prefix}-{:024x}", x & ((1u128 << 96) - 1))
}

/// Which API shape a request uses.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Completions,
    Chat,
}

struct Job {
    api: Api,
    model: String,
    prompts: Vec<Vec<Resolved>>,
    set: GenSettings,
    stream: bool,
    include_usage: bool,
    echo: bool,
    /// Chat tools whose calls are parsed from the output (`tool_choice` not `none`).
    tools: Option<Arc<super::tools::ToolSet>>,
}

#[utoipa::path(post, path = "/v1/completions", tag = "inference", summary = "OpenAI completions with segment reuse (SSE with `stream: true`)", security(("bearer" = [])), request_body(content = Object, description = "OpenAI completions body; `segments` and the `hypic` extension are HYPIC's"), responses((status = 200, body = Object), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 408, description = "body not received in time", body = crate::error::ErrorBody), (status = 429, description = "queue full (`Retry-After`)", body = crate::error::ErrorBody)))]
async fn completions(
    State(s): State<AppState>,
    Tenant(p): Tenant,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = completions_inner(&s, &p, body).await;
    finish_response(&s, "completions", r)
}

#[utoipa::path(post, path = "/v1/chat/completions", tag = "inference", summary = "OpenAI chat completions with segment reuse (SSE with `stream: true`)", security(("bearer" = [])), request_body(content = Object, description = "OpenAI chat body; the `hypic` extension is HYPIC's"), responses((status = 200, body = Object), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 408, description = "body not received in time", body = crate::error::ErrorBody), (status = 429, description = "queue full (`Retry-After`)", body = crate::error::ErrorBody)))]
async fn chat(
    State(s): State<AppState>,
    Tenant(p): Tenant,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = chat_inner(&s, &p, body).await;
    finish_response(&s, "chat_completions", r)
}

pub(crate) fn finish_response(
    s: &AppState,
    endpoint: &str,
    r: Result<Response, ApiError>,
) -> Response {
    let resp = match r {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    record_status(s, endpoint, resp.status());
    resp
}

fn check_model(s: &AppState, model: &Option<String>) -> Result<String, ApiError> {
    match model {
        Some(m) if m != &s.0.model_id => Err(ApiError {
            param: Some("model".into()),
            ..ApiError::openai_not_found(
                "model_not_found",
                format!(
                    "the model {m:?} does not exist; this server serves {:?}",
                    s.0.model_id
                ),
            )
        }),
        _ => Ok(s.0.model_id.clone()),
    }
}

async fn completions_inner(
    s: &AppState,
    p: &Principal,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let body = body.map_err(|e| body_error(e, s.0.cfg.max_body_bytes))?;
    let req: CompletionRequest = in_tokenize_turn(s, move || {
        let req = parse_json::<CompletionRequest>(&body)?;
        check_fields(&body, COMPLETION_FIELDS)?;
        Ok::<_, ApiError>(req)
    })
    .await??;
    let model = check_model(s, &req.model)?;
    let constraint = compile_format(s, req.response_format.clone()).await?;
    let mode = prompt::request_mode(req.hypic.as_ref(), s.0.default_mode)?;
    let salt = req.hypic.as_ref().and_then(|h| h.salt.clone());
    let sources: Vec<Vec<SegSource>> = match (&req.prompt, &req.segments) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid_param(
                "segments",
                "give either 'prompt' or 'segments', not both",
            ))
        }
        (None, None) => {
            return Err(ApiError::invalid_param(
                "prompt",
                "'prompt' (or 'segments') is required",
            ))
        }
        (Some(PromptSpec::Tokens { prompts, nested }), None) => {
            if prompts.is_empty() || prompts.len() > 16 {
                return Err(ApiError::invalid_param(
                    "prompt",
                    "'prompt' must be a list of token ids or a list of 1 to 16 lists of token ids",
                ));
            }
            let vocab = s.0.engine.config().vocab_size;
            let limit = prompt_limit(s);
            let mut out = Vec::with_capacity(prompts.len());
            for (i, ids) in prompts.iter().enumerate() {
                if ids.len() > limit {
                    return Err(over_limit(s, "prompt", ids.len(), true));
                }
                let mut v = Vec::with_capacity(ids.len());
                for (j, &t) in ids.iter().enumerate() {
                    if t < 0 || t as u64 >= vocab as u64 {
                        let at = if *nested {
                            format!("prompt[{i}][{j}]")
                        } else {
                            format!("prompt[{j}]")
                        };
                        return Err(ApiError::invalid_param(
                            &at,
                            format!(
                                "'{at}' is {t}, not a token id of this model (0 to {})",
                                vocab - 1
                            ),
                        ));
                    }
                    v.push(t as u32);
                }
                out.push(vec![SegSource::Tokens(v)]);
            }
            out
        }
        (Some(pr), None) => {
            let list = match pr {
                PromptSpec::One(t) => vec![t.clone()],
                PromptSpec::Many(v) => v.clone(),
                PromptSpec::Tokens { .. } => unreachable!("matched above"),
            };
            if list.is_empty() || list.len() > 16 {
                return Err(ApiError::invalid_param(
                    "prompt",
                    "'prompt' must be a string or a list of 1 to 16 strings",
                ));
            }
            // Before any copy or tokenisation: each prompt must be able to fit, and
            // the request may not carry too many segments.
            let sep = s.0.cfg.separator.as_str();
            let mut pieces = 0;
            for t in &list {
                check_fits(s, "prompt", t.len())?;
                pieces += if sep.is_empty() {
                    usize::from(!t.is_empty())
                } else {
                    t.split(sep).filter(|x| !x.is_empty()).count()
                };
            }
            check_segment_count(s, "prompt", pieces)?;
            list.iter()
                .map(|t| {
                    prompt::split_prompt(t, &s.0.cfg.separator)
                        .into_iter()
                        .map(SegSource::Text)
                        .collect()
                })
                .collect()
        }
        (None, Some(items)) => {
            if items.is_empty() {
                return Err(ApiError::invalid_param(
                    "segments",
                    "'segments' is an empty array; give at least one segment",
                ));
            }
            check_segment_count(s, "segments", items.len())?;
            let bytes = items
                .iter()
                .map(|it| it.text.as_ref().map_or(0, |t| t.len()))
                .sum();
            check_fits(s, "segments", bytes)?;
            let mut v = Vec::with_capacity(items.len());
            for (i, it) in items.iter().enumerate() {
                v.push(match (&it.text, &it.id) {
                    (Some(t), None) if it.version.is_none() => SegSource::Text(t.clone()),
                    (None, Some(id)) => SegSource::Catalog {
                        id: id.clone(),
                        version: it.version,
                    },
                    _ => {
                        return Err(ApiError::invalid_param(
                            &format!("segments[{i}]"),
                            "each segment is {\"text\": …} or {\"id\": …, \"version\": …}",
                        ))
                    }
                });
            }
            vec![v]
        }
    };
    let (temperature, top_p, n) = check_sampling(req.temperature, req.top_p, req.n, s.0.cfg.max_n)?;
    let logprobs = match req.logprobs {
        None => None,
        Some(k) if (0..=5).contains(&k) => Some(k as usize),
        Some(_) => {
            return Err(ApiError::invalid_param(
                "logprobs",
                "logprobs must be between 0 and 5",
            ))
        }
    };
    let stops = check_stops(req.stop.clone())?;
    let several = match &req.prompt {
        Some(PromptSpec::Many(v)) => v.len() > 1,
        Some(PromptSpec::Tokens { prompts, .. }) => prompts.len() > 1,
        _ => false,
    };
    let mut prompts = Vec::with_capacity(sources.len());
    let cap = s.0.cfg.max_prefill_tokens_per_request;
    let mut request_tokens = 0usize;
    for (i, src) in sources.into_iter().enumerate() {
        let (field, empty) = if req.segments.is_some() {
            (
                "segments",
                "every segment in 'segments' is empty".to_string(),
            )
        } else if several {
            ("prompt", format!("'prompt[{i}]' is empty"))
        } else {
            ("prompt", "'prompt' is empty".to_string())
        };
        let resolved = resolve(s, &p.tenant, salt.as_deref(), src, field, &empty).await?;
        request_tokens += resolved.iter().map(|r| r.tokens.len()).sum::<usize>();
        if request_tokens > cap {
            return Err(ApiError {
                param: Some(field.into()),
                ..ApiError::invalid(
                    "prefill_tokens_exceeded",
                    format!(
                        "a request may prefill at most {cap} prompt tokens (max_prefill_tokens_per_request), but its prompts have {request_tokens} tokens"
                    ),
                )
            });
        }
        s.0.first_use
            .apply(s.0.engine.as_ref(), &p.tenant, mode, &resolved);
        prompts.push(resolved);
    }
    let longest = prompts
        .iter()
        .map(|v| v.iter().map(|r| r.tokens.len()).sum::<usize>())
        .max()
        .unwrap_or(0);
    let max_tokens = check_max_tokens(s, req.max_tokens, "max_tokens", longest)?;
    let mut sampling = request_sampling(
        s,
        (temperature, top_p, req.top_k, req.seed),
        ProcessorFields {
            presence_penalty: req.presence_penalty,
            frequency_penalty: req.frequency_penalty,
            repetition_penalty: req.repetition_penalty,
            logit_bias: req.logit_bias.as_ref(),
            min_tokens: req.min_tokens,
        },
        max_tokens,
    )?;
    sampling.constraint = constraint;
    let set = GenSettings {
        mode,
        max_tokens,
        sampling,
        n,
        stops,
        logprobs,
        ignore_eos: req.ignore_eos.unwrap_or(false),
    };
    let job = Job {
        api: Api::Completions,
        model,
        prompts,
        set,
        stream: req.stream.unwrap_or(false),
        include_usage: req.stream_options.map(|o| o.include_usage).unwrap_or(false),
        echo: req.echo.unwrap_or(false),
        tools: None,
    };
    run_job(s, p, job, t0).await
}

pub(crate) async fn chat_inner(
    s: &AppState,
    p: &Principal,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let body = body.map_err(|e| body_error(e, s.0.cfg.max_body_bytes))?;
    let req: ChatRequest = in_tokenize_turn(s, move || {
        let req = parse_json::<ChatRequest>(&body)?;
        check_fields(&body, CHAT_FIELDS)?;
        Ok::<_, ApiError>(req)
    })
    .await??;
    let model = check_model(s, &req.model)?;
    let constraint = compile_format(s, req.response_format.clone()).await?;
    let tools = super::tools::ToolSet::parse(
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
    )?
    .map(Arc::new);
    let constraint = match tools.as_ref().and_then(|t| t.grammar()) {
        None => constraint,
        Some(_) if constraint.is_some() => {
            return Err(ApiError::invalid_param(
                "tool_choice",
                "a required or named tool_choice and a JSON response_format cannot both constrain the output",
            ))
        }
        Some(g) => {
            let gr = s.0.grammars.clone();
            Some(
                in_tokenize_turn(s, move || {
                    gr.compile_grammar(g, "tool_choice".into(), "tool_choice")
                })
                .await??,
            )
        }
    };
    let mode = prompt::request_mode(req.hypic.as_ref(), s.0.default_mode)?;
    let salt = req.hypic.as_ref().and_then(|h| h.salt.clone());
    // Before rendering or tokenising: each message within its cap, and the whole
    // conversation able to fit.
    let mut bytes = 0;
    for (i, m) in req.messages.iter().enumerate() {
        let b = m.content.as_ref().map_or(0, |c| c.text_bytes());
        check_bytes(
            &format!("messages[{i}].content"),
            b,
            s.0.cfg.max_message_bytes,
            "max_message_bytes",
            "message",
        )?;
        bytes += b;
    }
    check_fits(s, "messages", bytes)?;
    let tok = s.0.tok.clone();
    let msgs = req.messages.clone();
    let tools_r = tools.clone();
    let texts = in_tokenize_turn(s, move || {
        prompt::chat_segments(&tok, &msgs, tools_r.as_deref())
    })
    .await??;
    let (temperature, top_p, n) = check_sampling(req.temperature, req.top_p, req.n, s.0.cfg.max_n)?;
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (_, Some(k)) if !(0..=20).contains(&k) => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "top_logprobs must be between 0 and 20",
            ))
        }
        (false, Some(k)) if k > 0 => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ))
        }
        (true, k) => Some(k.unwrap_or(0) as usize),
        (false, _) => None,
    };
    let stops = check_stops(req.stop.clone())?;
    let segs = resolve(
        s,
        &p.tenant,
        salt.as_deref(),
        texts.into_iter().map(SegSource::Text).collect(),
        "messages",
        "the conversation renders to an empty prompt",
    )
    .await?;
    let prompt_tokens: usize = segs.iter().map(|r| r.tokens.len()).sum();
    let (given, param) = match (req.max_completion_tokens, req.max_tokens) {
        (Some(m), _) => (Some(m), "max_completion_tokens"),
        (None, m) => (m, "max_tokens"),
    };
    let max_tokens = check_max_tokens(s, given, param, prompt_tokens)?;
    let mut sampling = request_sampling(
        s,
        (temperature, top_p, req.top_k, req.seed),
        ProcessorFields {
            presence_penalty: req.presence_penalty,
            frequency_penalty: req.frequency_penalty,
            repetition_penalty: req.repetition_penalty,
            logit_bias: req.logit_bias.as_ref(),
            min_tokens: req.min_tokens,
        },
        max_tokens,
    )?;
    sampling.constraint = constraint;
    let set = GenSettings {
        mode,
        max_tokens,
        sampling,
        n,
        stops,
        logprobs,
        ignore_eos: req.ignore_eos.unwrap_or(false),
    };
    let job = Job {
        api: Api::Chat,
        model,
        prompts: vec![segs],
        set,
        stream: req.stream.unwrap_or(false),
        include_usage: req.stream_options.map(|o| o.include_usage).unwrap_or(false),
        echo: false,
        tools: tools.filter(|t| t.parses()),
    };
    run_job(s, p, job, t0).await
}

fn usage_of(
    prompts: &[Vec<Resolved>],
    starts: &[Option<StartInfo>],
    n: usize,
    gen: usize,
) -> Usage {
    let prompt_tokens: usize = prompts
        .iter()
        .map(|v| v.iter().map(|r| r.tokens.len()).sum::<usize>())
        .sum();
    let cached: usize = (0..prompts.len())
        .filter_map(|pi| starts.get(pi * n).and_then(|x| x.as_ref()))
        .map(|st| st.stats.tokens_reused)
        .sum();
    Usage {
        prompt_tokens,
        completion_tokens: gen,
        total_tokens: prompt_tokens + gen,
        prompt_tokens_details: PromptTokensDetails {
            cached_tokens: cached,
        },
    }
}

fn completion_lp_json(lps: &[TokLp], base_offset: usize) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    let mut off = base_offset;
    for t in lps {
        out.tokens.push(t.text.clone());
        out.token_logprobs.push(t.logprob);
        out.top_logprobs
            .push(t.top.iter().map(|(s, l)| (s.clone(), json!(l))).collect());
        out.text_offset.push(off);
        off += t.text.len();
    }
    out
}

fn chat_lp_json(lps: &[TokLp]) -> ChatLogprobs {
    ChatLogprobs {
        content: lps
            .iter()
            .map(|t| ChatLogprob {
                token: t.text.clone(),
                logprob: t.logprob,
                bytes: t.text.as_bytes().to_vec(),
                top_logprobs: t
                    .top
                    .iter()
                    .map(|(s, l)| ChatTopLogprob {
                        token: s.clone(),
                        logprob: *l,
                        bytes: s.as_bytes().to_vec(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

async fn run_job(s: &AppState, p: &Principal, job: Job, t0: Instant) -> Result<Response, ApiError> {
    let (handles, runs) = submit_all(s, &p.tenant, &job.prompts, &job.set)?;
    let endpoint = match job.api {
        Api::Completions => "completions",
        Api::Chat => "chat_completions",
    };
    let mut d = Driver::new(s.clone(), handles, &job.set, endpoint, t0);
    d.started().await?;
    let starts: Vec<Option<StartInfo>> = d.choices.iter().map(|c| c.start.clone()).collect();
    // The recorded traffic of policy dry runs: one line per prompt (its first choice).
    let who = s.0.control.keyer().pseudonym(&p.tenant);
    let bpt = s.0.engine.kv_bytes_per_token();
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    for (pi, prompt) in job.prompts.iter().enumerate() {
        if let Some(st) = starts.get(pi * job.set.n).and_then(|x| x.as_ref()) {
            let engine = s.0.engine.clone();
            let resident = move |r: &Resolved, body_start: usize| {
                engine.resident_bytes(&r.tokens, &r.isolation, body_start)
            };
            s.0.traffic
                .record(&who, prompt, &st.stats, &resident, bpt, now_ms);
            s.0.why.record_request(&p.tenant, prompt, &st.stats);
        }
    }
    // Wall-clock times of the cache entries built or used, for the invalidation sweep
    // (only pruned by the sweep, so not kept when it is off).
    let sweeping = s.0.cfg.invalidation_sweep_ms > 0;
    for (i, st) in starts.iter().enumerate().filter(|_| sweeping) {
        if let Some(st) = st {
            s.0.ledger.record(
                &p.tenant,
                job.set.mode,
                &job.prompts[i / job.set.n],
                &st.stats,
            );
        }
    }
    let mut log_stats = request_stats(&job, &starts, &d.tokens_out);
    log_stats.usage = Some(Arc::new(s.0.control.usage().start(
        &p.tenant,
        log_stats.prompt_tokens,
        log_stats.cached_tokens,
        log_stats.hits,
        log_stats.misses,
        d.tokens_out.clone(),
    )));
    // Every prompt has started: its scatter is over (the runs drop here).
    let scatters: Vec<Option<ScatterReport>> =
        runs.into_iter().map(|r| r.map(|r| r.report())).collect();
    s.0.metrics.observe_scatter(&scatters);
    let with_scatter = |pi: usize, mut e: HypicResponseExt| {
        e.scatter = scatters.get(pi).cloned().flatten();
        e
    };
    let ext = starts[0]
        .as_ref()
        .map(|st| with_scatter(0, hypic_ext(&job.set.mode, st, &job.prompts[0])));
    let ext_all: Vec<HypicResponseExt> = (0..job.prompts.len())
        .filter_map(|pi| {
            starts[pi * job.set.n]
                .as_ref()
                .map(|st| with_scatter(pi, hypic_ext(&job.set.mode, st, &job.prompts[pi])))
        })
        .collect();
    let id = rand_id(if job.api == Api::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    });
    let created = now_s();
    if job.stream {
        let mut r = stream_response(d, job, id, created, starts, ext);
        r.extensions_mut().insert(log_stats);
        return Ok(r);
    }
    // Non-streaming: collect everything.
    let nch = d.choices.len();
    let mut texts = vec![String::new(); nch];
    let mut lps: Vec<Vec<TokLp>> = vec![vec![]; nch];
    let mut finish = vec!["stop"; nch];
    while let Some(o) = d.next().await {
        match o {
            Out::Delta(i, t, l) => {
                texts[i].push_str(&t);
                lps[i].extend(l);
            }
            Out::Finish(i, r) => finish[i] = r,
            Out::Error(_, e) => return Err(e),
        }
    }
    let gen: usize = d.choices.iter().map(|c| c.generated).sum();
    let usage = usage_of(&job.prompts, &starts, job.set.n, gen);
    let choices: Vec<Value> = (0..nch)
        .map(|i| {
            let pi = i / job.set.n;
            match job.api {
                Api::Completions => {
                    let prefix = if job.echo {
                        job.prompts[pi]
                            .iter()
                            .filter_map(|r| r.text.clone())
                            .collect::<Vec<_>>()
                            .join("")
                    } else {
                        String::new()
                    };
                    let lp = job
                        .set
                        .logprobs
                        .map(|_| json!(completion_lp_json(&lps[i], prefix.len())));
                    json!({"index": i, "text": format!("{prefix}{}", texts[i]),
                           "logprobs": lp, "finish_reason": finish[i]})
                }
                Api::Chat => {
                    let lp = job.set.logprobs.map(|_| json!(chat_lp_json(&lps[i])));
                    let (content, calls) = match &job.tools {
                        Some(_) => super::tools::split_calls(&texts[i]),
                        None => (Some(texts[i].clone()), vec![]),
                    };
                    let mut message = json!({"role": "assistant", "content": content});
                    let mut reason = finish[i];
                    if !calls.is_empty() {
                        message["tool_calls"] = json!(calls
                            .iter()
                            .enumerate()
                            .map(|(k, c)| {
                                let mut v = c.to_json(k, &rand_id("call"));
                                v.as_object_mut().map(|o| o.remove("index"));
                                v
                            })
                            .collect::<Vec<_>>());
                        reason = "tool_calls";
                    }
                    json!({"index": i, "message": message,
                           "logprobs": lp, "finish_reason": reason})
                }
            }
        })
        .collect();
    let mut body = json!({
        "id": id,
        "object": if job.api == Api::Chat { "chat.completion" } else { "text_completion" },
        "created": created,
        "model": job.model,
        "system_fingerprint": null,
        "choices": choices,
        "usage": usage,
        "hypic": ext,
    });
    if ext_all.len() > 1 {
        body["hypic_prompts"] = json!(ext_all);
    }
    let mut r = Json(body).into_response();
    r.extensions_mut().insert(log_stats);
    Ok(r)
}

/// The figures of a request's log line (counts and times only, no text).
fn request_stats(
    job: &Job,
    starts: &[Option<StartInfo>],
    tokens_out: &Arc<std::sync::atomic::AtomicUsize>,
) -> super::reqlog::RequestStats {
    let usage = usage_of(&job.prompts, starts, job.set.n, 0);
    let started = starts.iter().flatten();
    super::reqlog::RequestStats {
        prompt_tokens: usage.prompt_tokens,
        cached_tokens: usage.prompt_tokens_details.cached_tokens,
        completion_tokens: tokens_out.clone(),
        ttft_ms: starts
            .first()
            .and_then(|s| s.as_ref())
            .map(|s| s.ttft.as_secs_f64() * 1e3),
        hits: started.clone().map(|s| s.stats.hits).sum(),
        misses: started.map(|s| s.stats.misses).sum(),
        usage: None,
    }
}

/// Sends the released `pieces` of choice `i` of a chat stream with tools: text as
/// content deltas (the first carries `lp`), each call as a `tool_calls` delta
/// (`calls`: the choice's calls so far). Returns false when the client is gone.
async fn send_pieces(
    tx: &tokio::sync::mpsc::Sender<Event>,
    base: &(impl Fn(Value) -> Value + Sync),
    i: usize,
    pieces: Vec<super::tools::Piece>,
    mut lp: Option<Value>,
    calls: &mut usize,
) -> bool {
    for p in pieces {
        let delta = match p {
            super::tools::Piece::Text(t) => json!({"content": t}),
            super::tools::Piece::Call(c) => {
                *calls += 1;
                json!({"tool_calls": [c.to_json(*calls - 1, &rand_id("call"))]})
            }
        };
        let v = base(json!([{"index": i, "delta": delta, "logprobs": lp.take(),
                              "finish_reason": null}]));
        if tx.send(Event::default().data(v.to_string())).await.is_err() {
            return false;
        }
    }
    true
}

fn stream_response(
    mut d: Driver,
    job: Job,
    id: String,
    created: u64,
    starts: Vec<Option<StartInfo>>,
    ext: Option<HypicResponseExt>,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Event>(64);
    let Job {
        api,
        model,
        prompts,
        set,
        include_usage,
        tools,
        ..
    } = job;
    let chat = api == Api::Chat;
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let base = move |choices: Value| {
        json!({"id": id, "object": object, "created": created, "model": model,
               "system_fingerprint": null, "choices": choices})
    };
    tokio::spawn(async move {
        let send = |v: Value| Event::default().data(v.to_string());
        let nch = d.choices.len();
        // First chunk: role (chat) and the hypic extension.
        let first: Vec<Value> = (0..nch)
            .map(|i| {
                if chat {
                    json!({"index": i, "delta": {"role": "assistant", "content": ""},
                           "logprobs": null, "finish_reason": null})
                } else {
                    json!({"index": i, "text": "", "logprobs": null, "finish_reason": null})
                }
            })
            .collect();
        let mut v = base(json!(first));
        v["hypic"] = json!(ext);
        if tx.send(send(v)).await.is_err() {
            return;
        }
        let mut offsets = vec![0usize; nch];
        // Chat with tools: calls are cut out of the text as they complete.
        let mut parsers: Vec<Option<super::tools::CallParser>> = (0..nch)
            .map(|_| tools.as_ref().map(|_| super::tools::CallParser::default()))
            .collect();
        let mut calls = vec![0usize; nch];
        while let Some(o) = d.next().await {
            let v = match o {
                Out::Delta(i, t, l) if parsers[i].is_some() => {
                    let pieces = parsers[i].as_mut().map(|p| p.push(&t)).unwrap_or_default();
                    let lp = set.logprobs.map(|_| json!(chat_lp_json(&l)));
                    if !send_pieces(&tx, &base, i, pieces, lp, &mut calls[i]).await {
                        return;
                    }
                    continue;
                }
                Out::Finish(i, r) if parsers[i].is_some() => {
                    let pieces = parsers[i].as_mut().map(|p| p.finish()).unwrap_or_default();
                    if !send_pieces(&tx, &base, i, pieces, None, &mut calls[i]).await {
                        return;
                    }
                    let r = if calls[i] > 0 { "tool_calls" } else { r };
                    base(json!([{"index": i, "delta": {}, "logprobs": null, "finish_reason": r}]))
                }
                Out::Delta(i, t, l) => {
                    let lp = set.logprobs.map(|_| {
                        if chat {
                            json!(chat_lp_json(&l))
                        } else {
                            json!(completion_lp_json(&l, offsets[i]))
                        }
                    });
                    offsets[i] += t.len();
                    if chat {
                        base(
                            json!([{"index": i, "delta": {"content": t}, "logprobs": lp, "finish_reason": null}]),
                        )
                    } else {
                        base(
                            json!([{"index": i, "text": t, "logprobs": lp, "finish_reason": null}]),
                        )
                    }
                }
                Out::Finish(i, r) => {
                    if chat {
                        base(
                            json!([{"index": i, "delta": {}, "logprobs": null, "finish_reason": r}]),
                        )
                    } else {
                        base(
                            json!([{"index": i, "text": "", "logprobs": null, "finish_reason": r}]),
                        )
                    }
                }
                Out::Error(_, e) => e.body(),
            };
            if tx.send(send(v)).await.is_err() {
                return; // client gone: dropping `d` cancels the sequences
            }
        }
        if include_usage {
            let gen: usize = d.choices.iter().map(|c| c.generated).sum();
            let mut v = base(json!([]));
            v["usage"] = json!(usage_of(&prompts, &starts, set.n, gen));
            if tx.send(send(v)).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Event::default().data("[DONE]")).await;
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|e| (Ok::<Event, std::convert::Infallible>(e), rx))
    });
    Sse::new(stream).into_response()
}
