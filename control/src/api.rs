//! The control-plane HTTP API (axum): segment catalog routes for tenants,
//! policy lifecycle routes for operators. Every route except
//! `GET /v1/control/health` and `GET /openapi.json` (the OpenAPI document,
//! [`openapi`]) needs a bearer JWT; errors are [`ApiError`]s, OpenAI-style JSON
//! `{"error":{"message":..,"type":..,"param":..,"code":..}}`. The segment routes
//! call the [`SegmentService`] with the verified caller.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};

use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::auth::{AuthError, Authenticator, IsolationKeyer, Principal};
use crate::catalog::{now_ms, Catalog, Group, NewSegment, Residency, Role};
pub use crate::error::{ApiError, IDEMPOTENCY_KEY};
use crate::policy::{
    EntryInfo, IsolationInfo, PolicyError, PolicyKind, PolicyRuntime, PolicySet, PolicySlot,
};
use crate::segments::SegmentService;
pub use crate::segments::{SnapshotItem, SnapshotResponse, UpdateResult};
use crate::sim::{parse_trace, pseudonymise, simulate_until, SimStats};

/// How requests are authenticated.
pub enum AuthMode {
    /// Bearer JWTs verified by the authenticator.
    Enabled(Authenticator),
    /// No auth (only allowed on loopback binds, see
    /// [`crate::auth::check_auth_disable`]): every caller is operator
    /// `local` of tenant `local`.
    Disabled,
}

struct Inner {
    /// The catalog, keyer and policies, behind the segment operations.
    segments: SegmentService,
    auth: AuthMode,
    known: Mutex<HashSet<(String, String)>>,
    /// Requests and tokens per tenant since the server started.
    usage: crate::usage::UsageBook,
    /// Serialises activations and rollbacks: each changes the catalog and then
    /// installs the module in the runtime, and two interleaved ones would
    /// leave the server running a policy the catalog does not record as active.
    activation: tokio::sync::Mutex<()>,
    /// Dry-run replays running ([`DRY_RUNS_AT_ONCE`] at most).
    dry_runs: Arc<tokio::sync::Semaphore>,
}

/// Shared state of the control-plane router.
#[derive(Clone)]
pub struct ControlState {
    inner: Arc<Inner>,
}

impl ControlState {
    /// Builds the state. Load active policies with
    /// [`PolicyRuntime::load_active`] before serving.
    pub fn new(
        catalog: Catalog,
        auth: AuthMode,
        keyer: IsolationKeyer,
        policies: Arc<PolicyRuntime>,
    ) -> ControlState {
        ControlState {
            inner: Arc::new(Inner {
                segments: SegmentService::new(catalog, keyer, policies),
                auth,
                known: Mutex::new(HashSet::new()),
                usage: crate::usage::UsageBook::default(),
                activation: tokio::sync::Mutex::new(()),
                dry_runs: Arc::new(tokio::sync::Semaphore::new(DRY_RUNS_AT_ONCE)),
            }),
        }
    }

    /// The catalog.
    pub fn catalog(&self) -> &Catalog {
        self.inner.segments.catalog()
    }

    /// The live policies.
    pub fn policies(&self) -> &Arc<PolicyRuntime> {
        self.inner.segments.policies()
    }

    /// Requests and tokens per tenant, recorded by the serving routes.
    pub fn usage(&self) -> &crate::usage::UsageBook {
        &self.inner.usage
    }

    /// Held while a policy activation or rollback changes the catalog and the
    /// runtime (shadow starts take it too, so they see a settled active policy).
    pub async fn activation_lock(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.inner.activation.lock().await
    }

    /// The isolation keyer.
    pub fn keyer(&self) -> &IsolationKeyer {
        self.inner.segments.keyer()
    }

    /// The segment operations, authorized from a verified principal (the
    /// principal a [`Caller`] extractor yields).
    pub fn segments(&self) -> &SegmentService {
        &self.inner.segments
    }

    /// The token verifier (`None` when auth is disabled).
    pub fn authenticator(&self) -> Option<&Authenticator> {
        match &self.inner.auth {
            AuthMode::Enabled(a) => Some(a),
            AuthMode::Disabled => None,
        }
    }

    /// Starts the task that writes the usage increments and the shadow counts
    /// to the catalog every `every` ([`crate::persist::flush`]); it ends once
    /// the state is dropped. Failures are logged (the usage increments are kept
    /// for the next write). Needs a tokio runtime.
    pub fn spawn_persister(&self, every: std::time::Duration) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { break };
                let state = ControlState { inner };
                if let Err(e) = crate::persist::flush(&state).await {
                    tracing::warn!("writing usage and shadow counts to the catalog failed: {e}");
                }
            }
        })
    }

    /// Starts a task that re-reads the authenticator's JWKS files every
    /// `every` (`None`: never periodically) and on SIGHUP (Unix), so keys can
    /// be rotated without a restart. Reloads and failures are logged and
    /// audited (`auth.jwks_reload`, `auth.jwks_reload_failed`; a failure is
    /// audited again only when its message changes); a file that fails keeps
    /// its previous keys. Returns `None` when there is no JWKS file to watch.
    /// The task ends once the state is dropped. Needs a tokio runtime.
    pub fn spawn_jwks_reloader(
        &self,
        every: Option<std::time::Duration>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        if self.authenticator()?.jwks_files().is_empty() {
            return None;
        }
        let weak = Arc::downgrade(&self.inner);
        // Listen before returning, so a SIGHUP sent right after never hits the
        // default action (terminate).
        let mut hup = hangup_signal();
        Some(tokio::spawn(async move {
            let mut ticker = every.filter(|d| !d.is_zero()).map(|d| {
                let mut i = tokio::time::interval_at(tokio::time::Instant::now() + d, d);
                i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                i
            });
            let mut last_failure: Option<String> = None;
            loop {
                tokio::select! {
                    _ = async {
                        match ticker.as_mut() {
                            Some(t) => { t.tick().await; }
                            None => std::future::pending::<()>().await,
                        }
                    } => {}
                    _ = wait_hangup(&mut hup) => {}
                }
                let Some(inner) = weak.upgrade() else { break };
                let AuthMode::Enabled(a) = &inner.auth else {
                    break;
                };
                let r = a.reload_jwks();
                for path in &r.reloaded {
                    eprintln!(
                        "hypic: reloaded JWKS file {} ({} keys accepted)",
                        path.display(),
                        r.keys
                    );
                    let _ = inner
                        .segments
                        .catalog()
                        .audit(
                            "system",
                            None,
                            "auth.jwks_reload",
                            &path.display().to_string(),
                            &serde_json::json!({"keys": r.keys}),
                        )
                        .await;
                }
                let failure = (!r.failed.is_empty()).then(|| format!("{:?}", r.failed));
                if failure.is_some() && failure != last_failure {
                    for (path, err) in &r.failed {
                        eprintln!(
                            "hypic: JWKS file {} not reloaded, previous keys kept: {err}",
                            path.display()
                        );
                        let _ = inner
                            .segments
                            .catalog()
                            .audit(
                                "system",
                                None,
                                "auth.jwks_reload_failed",
                                &path.display().to_string(),
                                &serde_json::json!({"error": err}),
                            )
                            .await;
                    }
                }
                last_failure = failure;
            }
        }))
    }
}

#[cfg(unix)]
type Hangup = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Hangup = ();

#[cfg(unix)]
fn hangup_signal() -> Hangup {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!("cannot listen for SIGHUP, JWKS reloads only periodically: {e}");
            None
        }
    }
}
#[cfg(not(unix))]
fn hangup_signal() -> Hangup {}

#[cfg(unix)]
async fn wait_hangup(h: &mut Hangup) {
    match h.as_mut() {
        Some(s) => {
            if s.recv().await.is_none() {
                std::future::pending::<()>().await
            }
        }
        None => std::future::pending::<()>().await,
    }
}
#[cfg(not(unix))]
async fn wait_hangup(_: &mut Hangup) {
    std::future::pending::<()>().await
}

pub(crate) type ApiResult<T> = Result<Json<T>, ApiError>;

/// Optional JSON body: an empty body (or none) is `T::default()`; anything
/// else must parse as `T` (400 naming the problem otherwise). The content type
/// is not checked, so `POST` without a body keeps working.
pub struct OptBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Default + Send> FromRequest<S> for OptBody<T> {
    type Rejection = ApiError;
    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| ApiError::bad_request(format!("invalid body: {}", e.body_text())))?;
        if bytes.iter().all(|b| b.is_ascii_whitespace()) {
            return Ok(OptBody(T::default()));
        }
        let de = &mut serde_json::Deserializer::from_slice(&bytes);
        serde_path_to_error::deserialize(de)
            .map(OptBody)
            .map_err(|e| {
                let path = e.path().to_string();
                let err = ApiError::bad_request(format!("invalid JSON body: {e}"));
                let param = if path != "." {
                    Some(path)
                } else {
                    crate::error::rejection_param(&e.to_string())
                };
                match param {
                    Some(p) => err.with_param(p),
                    None => err,
                }
            })
    }
}

/// JSON body extractor whose rejections are OpenAI-style 400s.
pub struct Body<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequest<S> for Body<T> {
    type Rejection = ApiError;
    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(Body(v)),
            Err(e) => Err(e.into()),
        }
    }
}

/// Path extractor whose rejections are OpenAI-style 400s naming the problem
/// (axum's own answers in plain text), and which refuses NUL characters (Postgres
/// cannot store or compare them: they would surface as a 500).
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        // A path that does not decode at all names the route's only parameter.
        let only_param = parts
            .extensions
            .get::<axum::extract::MatchedPath>()
            .and_then(|m| {
                let names: Vec<&str> = m
                    .as_str()
                    .split('/')
                    .filter_map(|seg| seg.strip_prefix('{')?.strip_suffix('}'))
                    .collect();
                (names.len() == 1).then(|| names[0].trim_start_matches('*').to_string())
            });
        let raw = Path::<Vec<(String, String)>>::from_request_parts(parts, state)
            .await
            .map_err(|e| {
                let err = ApiError::bad_request(format!("invalid path: {}", e.body_text()));
                match &only_param {
                    Some(p) => err.with_param(p.clone()),
                    None => err,
                }
            })?;
        if let Some((name, _)) = raw.0.iter().find(|(_, v)| v.contains('\0')) {
            return Err(ApiError::bad_request(format!(
                "path parameter {name:?} contains a NUL character"
            ))
            .with_param(name.clone()));
        }
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(v)) => Ok(ApiPath(v)),
            Err(e) => {
                let text = e.body_text();
                // The key the message names, else the route's only parameter.
                // `… at index N …` names the Nth parameter of the route.
                let at_index = text
                    .split_once("at index ")
                    .and_then(|(_, r)| r.split(' ').next()?.parse::<usize>().ok())
                    .and_then(|i| raw.0.get(i).map(|(k, _)| k.clone()));
                let param = crate::error::rejection_param(&text)
                    .or(at_index)
                    .or_else(|| (raw.0.len() == 1).then(|| raw.0[0].0.clone()));
                let err = ApiError::bad_request(format!("invalid path: {text}"));
                Err(match param {
                    Some(p) => err.with_param(p),
                    None => err,
                })
            }
        }
    }
}

/// Query extractor whose rejections are OpenAI-style 400s naming the problem.
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match Query::<T>::from_request_parts(parts, state).await {
            Ok(Query(v)) => Ok(ApiQuery(v)),
            Err(e) => {
                let text = e.body_text();
                let err = ApiError::bad_request(format!("invalid query string: {text}"));
                Err(match crate::error::rejection_param(&text) {
                    Some(p) => err.with_param(p),
                    None => err,
                })
            }
        }
    }
}

/// The authenticated caller.
pub struct Caller(pub Principal);

impl FromRequestParts<ControlState> for Caller {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &ControlState) -> Result<Self, ApiError> {
        let p = match &state.inner.auth {
            AuthMode::Disabled => Principal {
                sub: "local".into(),
                tenant: "local".into(),
                role: Role::Operator,
            },
            AuthMode::Enabled(a) => {
                let h = parts
                    .headers
                    .get(header::AUTHORIZATION)
                    .ok_or(AuthError::Missing)?;
                let h = h
                    .to_str()
                    .map_err(|_| AuthError::Invalid("authorization header is not ASCII".into()))?;
                let token = h
                    .strip_prefix("Bearer ")
                    .or_else(|| h.strip_prefix("bearer "))
                    .ok_or_else(|| {
                        AuthError::Invalid("authorization must be 'Bearer <jwt>'".into())
                    })?;
                a.verify(token.trim())?
            }
        };
        if let Some(slot) = parts.extensions.get::<crate::serve::reqlog::LogSlot>() {
            slot.set_tenant(state.keyer().pseudonym(&p.tenant));
        }
        let key = (p.tenant.clone(), p.sub.clone());
        let fresh = !state
            .inner
            .known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&key);
        if fresh {
            state
                .catalog()
                .upsert_principal(&p.tenant, &p.sub, p.role)
                .await?;
            state
                .inner
                .known
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key);
        }
        Ok(Caller(p))
    }
}

/// An authenticated operator (403 for tenant users).
pub struct Operator(pub Principal);

impl FromRequestParts<ControlState> for Operator {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &ControlState) -> Result<Self, ApiError> {
        let Caller(p) = Caller::from_request_parts(parts, state).await?;
        if !p.is_operator() {
            return Err(ApiError::forbidden(
                "operator_required",
                "this endpoint needs the operator role",
            ));
        }
        Ok(Operator(p))
    }
}

/// The OpenAPI document of the control plane's routes, generated from the
/// handlers' annotations (`GET /openapi.json`; [`openapi`]).
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "HYPIC control plane",
        description = "Segment catalog, tenants and groups, cache policies, audit. Every route \
            but the health checks and this document needs `Authorization: Bearer <jwt>`; \
            errors are `{\"error\": {\"message\", \"type\", \"param\", \"code\"}}`."
    ),
    paths(
        health, whoami, create_segment, list_segments, get_segment, update_segment,
        delete_segment, segment_versions, segment_version_content, list_grants, add_grant, revoke_grant,
        list_group_grants, add_group_grant, revoke_group_grant, snapshot, create_group,
        list_groups, get_group, delete_group, add_member, remove_member, upload_policy,
        list_policies, policy_stats, rollback_policy, activate_policy, dry_run, audit_log,
        report_residency, list_residency,
        crate::policy_api::policy_detail, crate::policy_api::start_shadow,
        crate::policy_api::list_shadows, crate::policy_api::get_shadow,
        crate::policy_api::stop_shadow,
        crate::tenants_api::list_tenants, crate::tenants_api::tenant_usage,
    ),
    components(schemas(crate::error::ErrorBody, crate::error::ErrorDetail, crate::catalog::Role)),
    modifiers(&BearerAuth),
    tags(
        (name = "segments", description = "segment catalog: versions, grants, snapshots"),
        (name = "tenants", description = "the caller, tenant groups and their members"),
        (name = "policies", description = "Wasm cache policies: upload, parameters, activate, roll back, dry-run, shadow"),
        (name = "audit", description = "the audit log"),
        (name = "health", description = "liveness and readiness"),
    )
)]
pub struct ControlApi;

/// Declares the bearer-JWT security scheme (`bearer`) the routes name.
pub struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let c = doc.components.get_or_insert_with(Default::default);
        c.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("JWT")
                    .build(),
            ),
        );
    }
}

/// The control plane's OpenAPI document (3.1): every route of
/// [`control_router`], with `/ready` of the standalone `hypic control` server.
pub fn openapi() -> utoipa::openapi::OpenApi {
    use utoipa::OpenApi as _;
    let mut doc = ControlApi::openapi();
    doc.paths.paths.insert(
        "/ready".into(),
        ready_path_item("Readiness: the catalog accepts a write (no token)"),
    );
    doc.paths
        .paths
        .insert("/openapi.json".into(), openapi_path_item());
    doc
}

/// The path item of a readiness route (`GET`, 200 or 503 JSON), described by `summary`.
pub fn ready_path_item(summary: &str) -> utoipa::openapi::PathItem {
    use utoipa::openapi::path::{HttpMethod, OperationBuilder};
    use utoipa::openapi::{ContentBuilder, ObjectBuilder, ResponseBuilder, ResponsesBuilder};
    let json = || {
        ContentBuilder::new()
            .schema(Some(ObjectBuilder::new()))
            .build()
    };
    utoipa::openapi::PathItem::new(
        HttpMethod::Get,
        OperationBuilder::new()
            .tag("health")
            .operation_id(Some("ready"))
            .summary(Some(summary))
            .responses(
                ResponsesBuilder::new()
                    .response(
                        "200",
                        ResponseBuilder::new()
                            .description("ready")
                            .content("application/json", json()),
                    )
                    .response(
                        "503",
                        ResponseBuilder::new()
                            .description("not ready: the failing checks")
                            .content("application/json", json()),
                    ),
            ),
    )
}

/// The path item of `GET /openapi.json` itself.
pub fn openapi_path_item() -> utoipa::openapi::PathItem {
    use utoipa::openapi::path::{HttpMethod, OperationBuilder};
    use utoipa::openapi::{ContentBuilder, ObjectBuilder, ResponseBuilder, ResponsesBuilder};
    utoipa::openapi::PathItem::new(
        HttpMethod::Get,
        OperationBuilder::new()
            .tag("health")
            .operation_id(Some("openapi"))
            .summary(Some("This OpenAPI document (no token)"))
            .responses(
                ResponsesBuilder::new().response(
                    "200",
                    ResponseBuilder::new()
                        .description("OpenAPI 3.1 JSON")
                        .content(
                            "application/json",
                            ContentBuilder::new()
                                .schema(Some(ObjectBuilder::new()))
                                .build(),
                        ),
                ),
            ),
    )
}

async fn control_openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(openapi())
}

/// The control-plane router (mount it at the root of the server).
pub fn control_router(state: ControlState) -> Router {
    Router::new()
        .route("/v1/control/health", get(health))
        .route("/openapi.json", get(control_openapi))
        .route("/v1/whoami", get(whoami))
        .route("/v1/segments", post(create_segment).get(list_segments))
        .route(
            "/v1/segments/{id}",
            get(get_segment).put(update_segment).delete(delete_segment),
        )
        .route("/v1/segments/{id}/versions", get(segment_versions))
        .route(
            "/v1/segments/{id}/versions/{version}",
            get(segment_version_content),
        )
        .route("/v1/segments/{id}/grants", get(list_grants).post(add_grant))
        .route(
            "/v1/segments/{id}/grants/{tenant}",
            axum::routing::delete(revoke_grant),
        )
        .route(
            "/v1/segments/{id}/group-grants",
            get(list_group_grants).post(add_group_grant),
        )
        .route(
            "/v1/segments/{id}/group-grants/{group}",
            axum::routing::delete(revoke_group_grant),
        )
        .route("/v1/snapshot", post(snapshot))
        .route("/v1/admin/groups", get(list_groups).post(create_group))
        .route("/v1/admin/groups/{id}", get(get_group).delete(delete_group))
        .route(
            "/v1/admin/groups/{id}/members/{tenant}",
            axum::routing::put(add_member).delete(remove_member),
        )
        .route("/v1/admin/policies", get(list_policies).post(upload_policy))
        .route("/v1/admin/policies/stats", get(policy_stats))
        .route("/v1/admin/policies/rollback", post(rollback_policy))
        .route("/v1/admin/policies/{id}/activate", post(activate_policy))
        .route("/v1/admin/policies/{id}/dry-run", post(dry_run))
        .route(
            "/v1/admin/policies/{id}",
            get(crate::policy_api::policy_detail),
        )
        .route(
            "/v1/admin/policies/{id}/shadow",
            post(crate::policy_api::start_shadow),
        )
        .route(
            "/v1/admin/policies/shadow",
            get(crate::policy_api::list_shadows),
        )
        .route(
            "/v1/admin/policies/shadow/{kind}",
            get(crate::policy_api::get_shadow).delete(crate::policy_api::stop_shadow),
        )
        .route("/v1/admin/tenants", get(crate::tenants_api::list_tenants))
        .route(
            "/v1/tenants/{tenant}/usage",
            get(crate::tenants_api::tenant_usage),
        )
        .route("/v1/admin/audit", get(audit_log))
        .route("/v1/admin/residency", post(report_residency))
        .route("/v1/residency", get(list_residency))
        .route_layer(axum::middleware::from_fn(
            crate::serve::reqlog::record_route,
        ))
        .merge(crate::ui::router())
        .fallback(|| async { ApiError::not_found("no such route") })
        .layer(DefaultBodyLimit::max(16 << 20))
        .with_state(state)
}

#[utoipa::path(get, path = "/v1/control/health", tag = "health", summary = "Control-plane liveness (no token)", responses((status = 200, description = "`{\"status\":\"ok\"}`", body = Object)))]
async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

#[utoipa::path(get, path = "/v1/whoami", tag = "tenants", summary = "The caller as the token names it", security(("bearer" = [])), responses((status = 200, body = crate::auth::Principal), (status = 401, description = "no or bad token", body = crate::error::ErrorBody)))]
async fn whoami(Caller(p): Caller) -> Json<Principal> {
    Json(p)
}

/// Response header set (`true`) when a create was answered from the record of
/// an earlier request with the same idempotency key.
pub const IDEMPOTENT_REPLAYED: &str = "Idempotent-Replayed";

/// The client's idempotency key (the [`IDEMPOTENCY_KEY`] header), if any; 400
/// naming the header when it is not printable ASCII.
pub fn idempotency_key(headers: &axum::http::HeaderMap) -> Result<Option<&str>, ApiError> {
    match headers.get(IDEMPOTENCY_KEY) {
        None => Ok(None),
        Some(v) => v.to_str().map(Some).map_err(|_| {
            ApiError::bad_request("the Idempotency-Key header must be printable ASCII")
                .with_param(IDEMPOTENCY_KEY)
        }),
    }
}

/// Marks a create answered from an earlier request's record
/// ([`IDEMPOTENT_REPLAYED`]).
pub fn mark_replayed(r: &mut Response) {
    r.headers_mut().insert(
        IDEMPOTENT_REPLAYED,
        header::HeaderValue::from_static("true"),
    );
}

#[utoipa::path(post, path = "/v1/segments", tag = "segments", summary = "Create a segment (version 1)", security(("bearer" = [])), params(("Idempotency-Key" = Option<String>, Header, description = "repeat-safe create: the same request under the same key answers the recorded segment")), request_body = crate::catalog::NewSegment, responses((status = 200, description = "the segment as the caller sees it (header `Idempotent-Replayed: true` on a replay)", body = crate::catalog::Segment), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 409, description = "the id is taken", body = crate::error::ErrorBody), (status = 413, description = "content over the limit", body = crate::error::ErrorBody), (status = 422, description = "idempotency key reused with another request", body = crate::error::ErrorBody)))]
async fn create_segment(
    State(s): State<ControlState>,
    Caller(p): Caller,
    headers: axum::http::HeaderMap,
    Body(seg): Body<NewSegment>,
) -> Result<Response, ApiError> {
    let key = idempotency_key(&headers)?;
    let c = s.segments().create(&p, &seg, key).await?;
    let mut r = Json(c.segment).into_response();
    if c.replayed {
        mark_replayed(&mut r);
    }
    Ok(r)
}

/// Query of `GET /v1/segments`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Page size, 1..=1000 (default 100).
    pub limit: Option<i64>,
    /// Cursor: the `next` of the previous page.
    pub after: Option<String>,
}

impl ListQuery {
    /// The page size, or a 400 naming `limit`.
    pub fn page_size(&self) -> Result<usize, ApiError> {
        let max = crate::catalog::MAX_LIST_LIMIT as i64;
        match self.limit {
            None => Ok(crate::catalog::DEFAULT_LIST_LIMIT),
            Some(l) if (1..=max).contains(&l) => Ok(l as usize),
            Some(l) => Err(
                ApiError::bad_request(format!("'limit' must be 1..={max}, not {l}"))
                    .with_param("limit"),
            ),
        }
    }

    /// The cursor, or a 400 naming `after`.
    pub fn cursor(&self) -> Result<Option<&str>, ApiError> {
        match self.after.as_deref() {
            None | Some("") => Ok(None),
            Some(a)
                if a.len() <= 300
                    && a.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._:-~/".contains(&b)) =>
            {
                Ok(Some(a))
            }
            Some(_) => Err(ApiError::bad_request(
                "'after' must be the 'next' cursor of a previous page",
            )
            .with_param("after")),
        }
    }
}

/// Answer of the control plane's `GET /v1/segments`.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SegmentList {
    /// Always `list`.
    pub object: String,
    /// The segments of this page, as the caller may see them.
    pub data: Vec<crate::catalog::Segment>,
    /// Cursor of the next page (`after`), `null` on the last page.
    pub next: Option<String>,
}

#[utoipa::path(get, path = "/v1/segments", tag = "segments", summary = "One page of the segments the caller may read", security(("bearer" = [])), params(ListQuery), responses((status = 200, body = SegmentList), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody)))]
async fn list_segments(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> ApiResult<SegmentList> {
    let page = s.segments().list(&p, q.cursor()?, q.page_size()?).await?;
    Ok(Json(SegmentList {
        object: "list".into(),
        data: page.items.into_iter().map(|x| x.view).collect(),
        next: page.next,
    }))
}

#[utoipa::path(get, path = "/v1/segments/{id}", tag = "segments", summary = "One segment", security(("bearer" = [])), params(("id" = String, Path, description = "the caller's segment id, or a segment address")), responses((status = 200, body = crate::catalog::Segment), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
async fn get_segment(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<crate::catalog::Segment> {
    Ok(Json(s.segments().get(&p, &id).await?))
}

/// Body of `PUT /v1/segments/{id}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct UpdateSegment {
    /// New content.
    pub content: String,
    /// Token counts per model.
    #[serde(default)]
    pub tokens: BTreeMap<String, i64>,
}

#[utoipa::path(put, path = "/v1/segments/{id}", tag = "segments", summary = "Add a version (owner or operator)", security(("bearer" = [])), params(("id" = String, Path, description = "the caller's segment id, or a segment address")), request_body = UpdateSegment, responses((status = 200, body = UpdateResult), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "not the owner tenant or an operator", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
async fn update_segment(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
    Body(u): Body<UpdateSegment>,
) -> ApiResult<UpdateResult> {
    Ok(Json(
        s.segments().update(&p, &id, &u.content, &u.tokens).await?,
    ))
}

#[utoipa::path(delete, path = "/v1/segments/{id}", tag = "segments", summary = "Delete a segment (owner or operator)", security(("bearer" = [])), params(("id" = String, Path, description = "the caller's segment id, or a segment address")), responses((status = 200, description = "`deleted` (the id given), `address`, `invalidated_entries`", body = Object), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "not the owner tenant or an operator", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
async fn delete_segment(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<serde_json::Value> {
    let d = s.segments().delete(&p, &id).await?;
    Ok(Json(serde_json::json!({
        "deleted": id, "address": d.address, "invalidated_entries": d.invalidated_entries,
    })))
}

#[utoipa::path(get, path = "/v1/segments/{id}/versions", tag = "segments", summary = "Every version of a segment, oldest first", security(("bearer" = [])), params(("id" = String, Path, description = "the caller's segment id, or a segment address")), responses((status = 200, body = Vec<crate::catalog::SegmentVersion>), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
async fn segment_versions(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Vec<crate::catalog::SegmentVersion>> {
    Ok(Json(s.segments().versions(&p, &id).await?))
}

#[utoipa::path(get, path = "/v1/segments/{id}/versions/{version}", tag = "segments", summary = "One version's content", security(("bearer" = [])), params(("id" = String, Path, description = "the caller's segment id, or a segment address"), ("version" = i64, Path, description = "version number, from 1")), responses((status = 200, body = crate::segments::VersionContent), (status = 400, description = "version is not an integer", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 404, description = "no such segment or version, or not readable by the caller", body = crate::error::ErrorBody)))]
async fn segment_version_content(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath((id, version)): ApiPath<(String, i64)>,
) -> ApiResult<crate::segments::VersionContent> {
    Ok(Json(s.segments().version_content(&p, &id, version).await?))
}

/// Body of `POST /v1/segments/{id}/grants`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct GrantBody {
    /// Tenant to grant read access to.
    pub tenant: String,
}

#[utoipa::path(get, path = "/v1/segments/{id}/grants", tag = "segments", summary = "Tenants granted read access", security(("bearer" = [])), params(("id" = String, Path, description = "the caller's segment id, or a segment address")), responses((status = 200, body = Vec<String>), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "not the owner tenant or an operator", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
async fn list_grants(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Vec<String>> {
    Ok(Json(s.segments().grants(&p, &id).await?))
}

#[utoipa::path(post, path = "/v1/segments/{id}/grants", tag = "segments", summary = "Grant a tenant read access", security(("bearer" = [])), params(("id" = String, Path, description = "the caller's segment id, or a segment address")), request_body = GrantBody, responses((status = 200, description = "`segment`, `granted`", body = Object), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "not the owner tenant or an operator", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
async fn add_grant(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
    Body(g): Body<GrantBody>,
) -> ApiResult<serde_json::Value> {
    s.segments().grant(&p, &id, &g.tenant).await?;
    Ok(Json(
        serde_json::json!({"segment": id, "granted": g.tenant}),
    ))
}

#[utoipa::path(delete, path = "/v1/segments/{id}/grants/{tenant}", tag = "segments", summary = "Revoke a tenant's grant", security(("bearer" = [])), params(("id" = String, Path, description = "segment id or address"), ("tenant" = String, Path, description = "the tenant")), responses((status = 200, description = "`segment`, `revoked`", body = Object), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "not the owner tenant or an operator", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
async fn revoke_grant(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath((id, tenant)): ApiPath<(String, String)>,
) -> ApiResult<serde_json::Value> {
    s.segments().revoke(&p, &id, &tenant).await?;
    Ok(Json(serde_json::json!({"segment": id, "revoked": tenant})))
}

/// Body of `POST /v1/segments/{id}/group-grants`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct GroupGrantBody {
    /// Group whose members get read access.
    pub group: String,
}

#[utoipa::path(get, path = "/v1/segments/{id}/group-grants", tag = "segments", summary = "Groups granted read access", security(("bearer" = [])), params(("id" = String, Path, description = "the caller's segment id, or a segment address")), responses((status = 200, body = Vec<String>), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "not the owner tenant or an operator", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
async fn list_group_grants(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Vec<String>> {
    Ok(Json(s.segments().group_grants(&p, &id).await?))
}

#[utoipa::path(post, path = "/v1/segments/{id}/group-grants", tag = "segments", summary = "Grant a group's members read access", security(("bearer" = [])), params(("id" = String, Path, description = "the caller's segment id, or a segment address")), request_body = GroupGrantBody, responses((status = 200, description = "`segment`, `granted_group`", body = Object), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "not the owner tenant or an operator", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
async fn add_group_grant(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
    Body(g): Body<GroupGrantBody>,
) -> ApiResult<serde_json::Value> {
    s.segments().grant_group(&p, &id, &g.group).await?;
    Ok(Json(
        serde_json::json!({"segment": id, "granted_group": g.group}),
    ))
}

#[utoipa::path(delete, path = "/v1/segments/{id}/group-grants/{group}", tag = "segments", summary = "Revoke a group's grant", security(("bearer" = [])), params(("id" = String, Path, description = "segment id or address"), ("group" = String, Path, description = "the group id")), responses((status = 200, description = "`segment`, `revoked_group`", body = Object), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "not the owner tenant or an operator", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
async fn revoke_group_grant(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath((id, group)): ApiPath<(String, String)>,
) -> ApiResult<serde_json::Value> {
    s.segments().revoke_group(&p, &id, &group).await?;
    Ok(Json(
        serde_json::json!({"segment": id, "revoked_group": group}),
    ))
}

// ---- groups (operators) ---------------------------------------------------------------

/// Body of `POST /v1/admin/groups`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct NewGroup {
    /// Group id: 1..=128 characters of `[A-Za-z0-9._:-]`.
    pub id: String,
    /// Human-readable name (defaults to the id).
    #[serde(default)]
    pub name: Option<String>,
}

#[utoipa::path(post, path = "/v1/admin/groups", tag = "tenants", summary = "Create a tenant group (operator)", security(("bearer" = [])), request_body = NewGroup, responses((status = 200, body = Group), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody), (status = 409, description = "the id is taken", body = crate::error::ErrorBody)))]
async fn create_group(
    State(s): State<ControlState>,
    Operator(p): Operator,
    Body(g): Body<NewGroup>,
) -> ApiResult<Group> {
    Ok(Json(
        s.catalog()
            .create_group(&g.id, g.name.as_deref(), &p.sub)
            .await?,
    ))
}

#[utoipa::path(get, path = "/v1/admin/groups", tag = "tenants", summary = "Every tenant group (operator)", security(("bearer" = [])), responses((status = 200, body = Vec<Group>), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody)))]
async fn list_groups(
    State(s): State<ControlState>,
    Operator(_): Operator,
) -> ApiResult<Vec<Group>> {
    Ok(Json(s.catalog().groups().await?))
}

#[utoipa::path(get, path = "/v1/admin/groups/{id}", tag = "tenants", summary = "One group with its members (operator)", security(("bearer" = [])), params(("id" = String, Path, description = "group id")), responses((status = 200, body = Group), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody), (status = 404, description = "no such group", body = crate::error::ErrorBody)))]
async fn get_group(
    State(s): State<ControlState>,
    Operator(_): Operator,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Group> {
    Ok(Json(s.catalog().group(&id).await?))
}

#[utoipa::path(delete, path = "/v1/admin/groups/{id}", tag = "tenants", summary = "Delete a group (operator)", security(("bearer" = [])), params(("id" = String, Path, description = "group id")), responses((status = 200, description = "`deleted`", body = Object), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody), (status = 404, description = "no such group", body = crate::error::ErrorBody)))]
async fn delete_group(
    State(s): State<ControlState>,
    Operator(p): Operator,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<serde_json::Value> {
    s.catalog().delete_group(&id, &p.sub).await?;
    Ok(Json(serde_json::json!({"deleted": id})))
}

#[utoipa::path(put, path = "/v1/admin/groups/{id}/members/{tenant}", tag = "tenants", summary = "Add a tenant to a group (operator)", security(("bearer" = [])), params(("id" = String, Path, description = "group id"), ("tenant" = String, Path, description = "the tenant")), responses((status = 200, body = Group), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody), (status = 404, description = "no such group", body = crate::error::ErrorBody)))]
async fn add_member(
    State(s): State<ControlState>,
    Operator(p): Operator,
    ApiPath((id, tenant)): ApiPath<(String, String)>,
) -> ApiResult<Group> {
    s.catalog().add_member(&id, &tenant, &p.sub).await?;
    Ok(Json(s.catalog().group(&id).await?))
}

#[utoipa::path(delete, path = "/v1/admin/groups/{id}/members/{tenant}", tag = "tenants", summary = "Remove a tenant from a group (operator)", security(("bearer" = [])), params(("id" = String, Path, description = "group id"), ("tenant" = String, Path, description = "the tenant")), responses((status = 200, body = Group), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody), (status = 404, description = "no such group", body = crate::error::ErrorBody)))]
async fn remove_member(
    State(s): State<ControlState>,
    Operator(p): Operator,
    ApiPath((id, tenant)): ApiPath<(String, String)>,
) -> ApiResult<Group> {
    s.catalog().remove_member(&id, &tenant, &p.sub).await?;
    Ok(Json(s.catalog().group(&id).await?))
}

/// Body of `POST /v1/snapshot`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct SnapshotRequest {
    /// Segments the request uses (own ids or addresses), in prompt order.
    pub segments: Vec<String>,
    /// Optional client salt: narrows sharing (mixed into the key), never widens it.
    #[serde(default)]
    pub salt: Option<String>,
}

#[utoipa::path(post, path = "/v1/snapshot", tag = "segments", summary = "Pin versions and derive isolation and cache keys", security(("bearer" = [])), request_body = SnapshotRequest, responses((status = 200, body = SnapshotResponse), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 404, description = "a segment is not readable", body = crate::error::ErrorBody)))]
async fn snapshot(
    State(s): State<ControlState>,
    Caller(p): Caller,
    Body(r): Body<SnapshotRequest>,
) -> ApiResult<SnapshotResponse> {
    Ok(Json(
        s.segments()
            .snapshot(&p.tenant, &r.segments, r.salt.as_deref())
            .await?,
    ))
}

/// Body of `POST /v1/admin/residency`: a worker reports an entry it holds.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct ResidencyReport {
    /// Worker id.
    pub worker: String,
    /// Cache key from a snapshot.
    pub cache_key: String,
    /// Segment id.
    pub segment_id: String,
    /// Segment version.
    pub version: i64,
    /// Tenant namespace (`None` for shared).
    #[serde(default)]
    pub tenant: Option<String>,
    /// Bytes held.
    pub bytes: i64,
}

#[utoipa::path(post, path = "/v1/admin/residency", tag = "segments", summary = "A worker reports a cache entry it holds (operator)", security(("bearer" = [])), request_body = ResidencyReport, responses((status = 200, description = "`{\"ok\":true}`", body = Object), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody)))]
async fn report_residency(
    State(s): State<ControlState>,
    Operator(_): Operator,
    Body(r): Body<ResidencyReport>,
) -> ApiResult<serde_json::Value> {
    if r.worker.is_empty() || r.cache_key.is_empty() || r.bytes < 0 {
        let param = if r.worker.is_empty() {
            "worker"
        } else if r.cache_key.is_empty() {
            "cache_key"
        } else {
            "bytes"
        };
        return Err(ApiError::bad_request(
            "worker and cache_key must be non-empty and bytes non-negative",
        )
        .with_param(param));
    }
    for (what, v) in [
        ("worker", Some(&r.worker)),
        ("cache_key", Some(&r.cache_key)),
        ("segment_id", Some(&r.segment_id)),
        ("tenant", r.tenant.as_ref()),
    ] {
        if let Some(v) = v {
            crate::catalog::validate_text(what, v)
                .map_err(|e| ApiError::from(e).with_param(what))?;
        }
    }
    s.catalog()
        .report_residency(&Residency {
            worker: r.worker,
            cache_key: r.cache_key,
            segment_id: r.segment_id,
            version: r.version,
            tenant: r.tenant,
            bytes: r.bytes,
            last_use: now_ms(),
        })
        .await?;
    Ok(Json(serde_json::json!({"ok": true})))
}

/// Query of `GET /v1/residency`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ResidencyQuery {
    /// Only entries of this catalog segment: the caller's id or an address it may
    /// read (404 otherwise).
    pub segment: Option<String>,
    /// Only rows of this holder (a replica id or a worker name); operators only (a
    /// tenant gets 400).
    pub holder: Option<String>,
    /// At most this many rows, 1 to 10000 (default 100).
    pub limit: Option<i64>,
}

/// Answer of `GET /v1/residency`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ResidencyList {
    /// `list`.
    pub object: String,
    /// The rows, newest change first.
    pub data: Vec<crate::residency::ResidencyRow>,
}

#[utoipa::path(get, path = "/v1/residency", tag = "segments", summary = "The residency directory: which replica or worker holds which entry (a tenant: its own namespace and the shared one, holders blank)", security(("bearer" = [])), params(ResidencyQuery), responses((status = 200, body = ResidencyList), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
async fn list_residency(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiQuery(q): ApiQuery<ResidencyQuery>,
) -> ApiResult<ResidencyList> {
    let limit = q.limit.unwrap_or(100);
    if !(1..=10_000).contains(&limit) {
        return Err(
            ApiError::bad_request(format!("'limit' must be 1..=10000, not {limit}"))
                .with_param("limit"),
        );
    }
    if let Some(h) = &q.holder {
        // Holders name the deployment's replicas and worker addresses: an
        // operator's view only.
        if !p.is_operator() {
            return Err(ApiError::bad_request(
                "'holder' filters by replica or worker, which only an operator may see",
            )
            .with_param("holder"));
        }
        crate::catalog::validate_text("holder", h)
            .map_err(|e| ApiError::from(e).with_param("holder"))?;
    }
    let segment_id = match &q.segment {
        Some(r) => Some(s.segments().get(&p, r).await?.address),
        None => None,
    };
    let scopes =
        (!p.is_operator()).then(|| vec![s.keyer().tenant_account(&p.tenant), "shared".to_string()]);
    let f = crate::residency::ResidencyFilter {
        scopes,
        segment_id,
        holder: q.holder.filter(|h| !h.is_empty()),
        limit: limit as usize,
    };
    let mut data = s.catalog().residency_rows(&f).await?;
    if !p.is_operator() {
        for r in &mut data {
            r.holder.clear();
        }
    }
    Ok(Json(ResidencyList {
        object: "list".into(),
        data,
    }))
}

// ---- policies -----------------------------------------------------------------------

/// Body of `POST /v1/admin/policies`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct UploadPolicy {
    /// Policy name (versions accumulate per name).
    pub name: String,
    /// Hook kind.
    pub kind: String,
    /// The module, base64 (standard alphabet).
    pub wasm_base64: String,
    /// Parameters (JSON object): checked against the module's declared
    /// schema (its `hypic.params` section) when it has one, else integers
    /// and booleans only.
    #[serde(default)]
    #[schema(value_type = Object)]
    pub params: serde_json::Value,
}

#[utoipa::path(post, path = "/v1/admin/policies", tag = "policies", summary = "Upload and validate a Wasm policy module (operator)", security(("bearer" = [])), request_body = UploadPolicy, responses((status = 200, body = crate::catalog::PolicyRecord), (status = 400, description = "the module does not load or fails its smoke call (`invalid_param_schema`: its parameter schema is malformed; `invalid_param`, `param` = `params.<name>`: a parameter does not match it)", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody), (status = 413, description = "module over the size limit", body = crate::error::ErrorBody), (status = 429, description = "every compile slot is taken", body = crate::error::ErrorBody)))]
async fn upload_policy(
    State(s): State<ControlState>,
    Operator(p): Operator,
    Body(u): Body<UploadPolicy>,
) -> ApiResult<crate::catalog::PolicyRecord> {
    let kind: PolicyKind = u
        .kind
        .parse()
        .map_err(|e| ApiError::bad_request(e).with_param("kind"))?;
    let rt = &s.policies();
    let limit = rt.limits().max_module_bytes;
    // Refuse an oversized module before decoding it (base64: 4 characters per 3 bytes).
    let b64 = u.wasm_base64.trim();
    if b64.len() / 4 * 3 > limit.saturating_add(3) {
        return Err(ApiError::from(PolicyError::TooLarge {
            bytes: b64.len() / 4 * 3,
            limit,
        }));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| {
            ApiError::bad_request(format!("wasm_base64 is not valid base64: {e}"))
                .with_param("wasm_base64")
        })?;
    // Compiled on the blocking pool (once per module: activation and dry runs of
    // this module reuse it); at the compile cap this answers 429 at once.
    let validated = rt
        .load(kind, bytes.as_slice().into(), &u.params, false)
        .await
        .and_then(|p| {
            // Smoke call: the hook must answer a synthetic input within limits.
            let mut slot = PolicySlot::wasm(p, None);
            smoke(&mut slot)
        });
    if let Err(e) = validated {
        if matches!(e, PolicyError::Busy { .. }) {
            return Err(ApiError::from(e));
        }
        s.catalog()
            .audit(
                &p.sub,
                Some(&p.tenant),
                "policy.reject",
                &u.name,
                &serde_json::json!({"kind": u.kind, "error": e.to_string()}),
            )
            .await?;
        return Err(module_error(e));
    }
    let params = if u.params.is_null() {
        "{}".to_string()
    } else {
        u.params.to_string()
    };
    Ok(Json(
        s.catalog()
            .insert_policy(&u.name, kind.as_str(), &bytes, &params, &p.sub)
            .await?,
    ))
}

/// A module that does not load or fails its smoke call names `wasm_base64`
/// (parameter errors keep the parameter they name).
fn module_error(e: PolicyError) -> ApiError {
    let named = matches!(e, PolicyError::Param { .. } | PolicyError::Schema(_));
    let err = ApiError::from(e);
    if named || err.status != StatusCode::BAD_REQUEST || err.param.is_some() {
        err
    } else {
        err.with_param("wasm_base64")
    }
}

fn smoke(slot: &mut PolicySlot) -> Result<(), crate::policy::PolicyError> {
    let now = now_ms() as u64;
    let e = EntryInfo {
        id: 1,
        tenant: 2,
        bytes: 4096,
        recompute_tokens: 100,
        last_use_ms: now,
        inserted_ms: now,
        hits: 1,
        shared: false,
        superseded: false,
    };
    let fault = match slot.kind() {
        PolicyKind::Eviction => {
            slot.evict(
                &[
                    e,
                    EntryInfo {
                        id: 3,
                        last_use_ms: now - 1,
                        ..e
                    },
                ],
                now,
            )
            .1
        }
        PolicyKind::Admission => {
            slot.admit(
                &crate::policy::AdmitInfo {
                    id: 1,
                    tenant: 2,
                    bytes: 4096,
                    recompute_tokens: 100,
                    tenant_used_bytes: 0,
                    capacity_bytes: 1 << 30,
                    seen_count: 1,
                    shared: false,
                },
                now,
            )
            .1
        }
        PolicyKind::Invalidation => slot.invalidate(&e, now).1,
        PolicyKind::Isolation => {
            slot.isolation(&IsolationInfo {
                segment: 1,
                tenant: 2,
                public: true,
                owner: false,
            })
            .1
        }
    };
    match fault {
        Some(f) => Err(f),
        None => Ok(()),
    }
}

#[utoipa::path(get, path = "/v1/admin/policies", tag = "policies", summary = "Every uploaded policy version (operator)", security(("bearer" = [])), responses((status = 200, body = Vec<crate::catalog::PolicyRecord>), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody)))]
async fn list_policies(
    State(s): State<ControlState>,
    Operator(_): Operator,
) -> ApiResult<Vec<crate::catalog::PolicyRecord>> {
    Ok(Json(s.catalog().policies().await?))
}

#[utoipa::path(get, path = "/v1/admin/policies/stats", tag = "policies", summary = "Active policy per kind, call and fault counters (operator)", security(("bearer" = [])), responses((status = 200, body = PolicyStats), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody)))]
async fn policy_stats(
    State(s): State<ControlState>,
    Operator(_): Operator,
) -> ApiResult<PolicyStats> {
    let rt = &s.policies();
    let active: BTreeMap<String, Option<i64>> = PolicyKind::ALL
        .iter()
        .map(|k| (k.as_str().to_string(), rt.active_id(*k)))
        .collect();
    let mut rollback_to = BTreeMap::new();
    for k in PolicyKind::ALL {
        if let Some(target) = s.catalog().rollback_target(k.as_str()).await? {
            rollback_to.insert(k.as_str().to_string(), target);
        }
    }
    Ok(Json(PolicyStats {
        active,
        rollback_to,
        metrics: serde_json::to_value(rt.metrics().snapshot()).unwrap_or_default(),
        module_compiles: rt.modules().compiles(),
        modules_cached: rt.modules().len() as u64,
    }))
}

/// Answer of `GET /v1/admin/policies/stats`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct PolicyStats {
    /// Active policy id per kind (`eviction`, `admission`, `invalidation`,
    /// `isolation`); `null`: the native default.
    pub active: BTreeMap<String, Option<i64>>,
    /// Where `POST /v1/admin/policies/rollback` would take each kind: the
    /// latest earlier policy different from the active one (`null`: the native
    /// default). A kind with nothing to roll back to is absent.
    pub rollback_to: BTreeMap<String, Option<i64>>,
    /// Call, fault and fallback counters and call times per kind and policy.
    #[schema(value_type = Object)]
    pub metrics: serde_json::Value,
    /// Modules compiled since the server started.
    pub module_compiles: u64,
    /// Compiled modules held in the module cache.
    pub modules_cached: u64,
}

/// Body of `POST /v1/admin/policies/{id}/activate` (optional).
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ActivateBody {
    /// New parameters: when given and different from the policy's, they are
    /// checked against its schema and stored as a new version of the policy
    /// (same module), which is the one activated.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub params: Option<serde_json::Value>,
}

#[utoipa::path(post, path = "/v1/admin/policies/{id}/activate", tag = "policies", summary = "Activate a policy version, optionally with new parameters (operator)", security(("bearer" = [])), params(("id" = i64, Path, description = "policy id")), request_body(content = Option<ActivateBody>, description = "optional: `params` to activate the policy with (stored as a new version)"), responses((status = 200, body = Activated), (status = 400, description = "invalid input (`invalid_param`, `param` = `params.<name>`: a parameter the policy's schema refuses)", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody), (status = 404, description = "no such policy", body = crate::error::ErrorBody), (status = 409, description = "`already_active`: the version (with these parameters) is the active one; nothing changed, no audit row", body = crate::error::ErrorBody)))]
async fn activate_policy(
    State(s): State<ControlState>,
    Operator(p): Operator,
    ApiPath(id): ApiPath<i64>,
    OptBody(b): OptBody<ActivateBody>,
) -> ApiResult<Activated> {
    let mut rec = s.catalog().policy(id).await?;
    let kind: PolicyKind = rec.kind.parse().map_err(ApiError::bad_request)?;
    let stored: serde_json::Value =
        serde_json::from_str(&rec.params).unwrap_or(serde_json::Value::Null);
    let params = b.params.unwrap_or_else(|| stored.clone());
    let _serial = s.inner.activation.lock().await;
    // Load first (compiled module from the cache, or compiled on the blocking
    // pool): a module that no longer loads, or parameters its schema refuses,
    // are not activated.
    let loaded = s
        .policies()
        .load(kind, rec.module.clone().into(), &params, false)
        .await
        .map_err(ApiError::from)?;
    // With a schema, parameters are the same when their effective values are
    // (an omitted parameter and its default are one setting).
    let schema = crate::policy::params::read_schema(&rec.module)
        .ok()
        .flatten();
    let effective = |v: &serde_json::Value| match &schema {
        Some(sc) => crate::policy::params::resolve(sc, v)
            .map(serde_json::Value::Object)
            .unwrap_or_else(|_| v.clone()),
        None => v.clone(),
    };
    let changed = !same_params(&effective(&params), &effective(&stored));
    // Read under the activation lock: a concurrent activation may have changed it.
    let active_now = s
        .catalog()
        .active_policy(kind.as_str())
        .await?
        .map(|r| r.id);
    if !changed && active_now == Some(rec.id) {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict_error",
            "already_active",
            format!(
                "{} policy #{} {} v{} is already the active one; nothing changed",
                kind.as_str(),
                rec.id,
                rec.name,
                rec.version
            ),
        )
        .with_param("id"));
    }
    if changed {
        rec = s
            .catalog()
            .insert_policy(
                &rec.name,
                kind.as_str(),
                &rec.module,
                &params.to_string(),
                &p.sub,
            )
            .await?;
    }
    s.catalog()
        .activate_policy(kind.as_str(), Some(rec.id), &p.sub)
        .await?;
    s.policies().install_wasm(loaded, Some(rec.id));
    Ok(Json(Activated {
        kind: kind.as_str().into(),
        active: rec.id,
        params,
    }))
}

/// Answer of `POST /v1/admin/policies/{id}/activate`.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Activated {
    /// The policy's kind.
    pub kind: String,
    /// The activated policy id: a new version when the parameters changed.
    pub active: i64,
    /// The parameters it was activated with.
    #[schema(value_type = Object)]
    pub params: serde_json::Value,
}

/// Answer of `POST /v1/admin/policies/rollback`.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RolledBack {
    /// The kind rolled back.
    pub kind: String,
    /// The policy now active (`null`: the native default).
    pub active: Option<i64>,
    /// The policy active before the rollback (`null`: the native default).
    pub from: Option<i64>,
}

/// Whether two parameter objects are the same (`null` is `{}`).
fn same_params(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    let norm = |v: &serde_json::Value| match v {
        serde_json::Value::Null => serde_json::json!({}),
        o => o.clone(),
    };
    norm(a) == norm(b)
}

/// Body of `POST /v1/admin/policies/rollback`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct RollbackBody {
    /// Hook kind to roll back.
    pub kind: String,
}

#[utoipa::path(post, path = "/v1/admin/policies/rollback", tag = "policies", summary = "Re-activate the previous policy of a kind (operator)", security(("bearer" = [])), description = "Goes to the latest earlier policy that differs from the active one (activations of the same policy, or of one with the same module and parameters, are skipped); the native default when there is none. `GET /v1/admin/policies/stats` says where it would go (`rollback_to`).", request_body = RollbackBody, responses((status = 200, body = RolledBack), (status = 400, description = "invalid input (`param` = `kind`)", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody), (status = 404, description = "nothing to roll back to", body = crate::error::ErrorBody)))]
async fn rollback_policy(
    State(s): State<ControlState>,
    Operator(p): Operator,
    Body(b): Body<RollbackBody>,
) -> ApiResult<RolledBack> {
    let kind: PolicyKind = b
        .kind
        .parse()
        .map_err(|e| ApiError::bad_request(e).with_param("kind"))?;
    let _serial = s.inner.activation.lock().await;
    let from = s.policies().active_id(kind);
    let now_active = s.catalog().rollback_policy(kind.as_str(), &p.sub).await?;
    match now_active {
        Some(id) => {
            let rec = s.catalog().policy(id).await?;
            let params: serde_json::Value =
                serde_json::from_str(&rec.params).unwrap_or(serde_json::Value::Null);
            let _ = s
                .policies()
                .activate(kind, Some(id), rec.module.into(), &params)
                .await;
        }
        None => s.policies().set_native(kind),
    }
    Ok(Json(RolledBack {
        kind: kind.as_str().into(),
        active: now_active,
        from,
    }))
}

/// Largest simulated cache capacity of a dry run, bytes (1 PiB).
pub const MAX_DRY_RUN_CAPACITY: u64 = 1 << 50;

/// Dry-run replays that may run at once (each holds a blocking thread); another
/// is a 429 `dry_run_busy`.
pub const DRY_RUNS_AT_ONCE: usize = 2;

/// Sets its flag when dropped: the request future of a dry run was dropped (the
/// client went away, or the replay ended), so the replay stops.
struct CancelOnDrop(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Body of `POST /v1/admin/policies/{id}/dry-run`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct DryRunBody {
    /// The recorded trace, JSONL (see [`crate::sim::TraceRecord`]).
    pub trace: String,
    /// Simulated cache capacity in bytes.
    pub capacity_bytes: u64,
    /// Parameters to try the candidate with instead of its stored ones
    /// (checked against its schema; nothing is stored).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub params: Option<serde_json::Value>,
}

/// Answer of a dry run.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DryRunResult {
    /// Policy tried.
    pub policy_id: i64,
    /// Its kind.
    pub kind: String,
    /// Replay with the candidate in its hook (other hooks as active); its
    /// `tenants` break it down per tenant, named by pseudonym (`t-…`, as in the
    /// request log and the recorded traffic).
    pub candidate: SimStats,
    /// Replay with the active policies.
    pub active: SimStats,
    /// candidate.hit_ratio − active.hit_ratio.
    pub hit_ratio_delta: f64,
    /// candidate.recompute_tokens − active.recompute_tokens.
    pub recompute_tokens_delta: i64,
}

#[utoipa::path(post, path = "/v1/admin/policies/{id}/dry-run", tag = "policies", summary = "Replay a trace with a candidate policy beside the active ones (operator)", security(("bearer" = [])), params(("id" = i64, Path, description = "policy id")), request_body = DryRunBody, responses((status = 200, body = DryRunResult), (status = 400, description = "invalid input (`invalid_param`, `param` = `params.<name>`: a parameter the policy's schema refuses)", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody), (status = 404, description = "no such policy", body = crate::error::ErrorBody), (status = 429, description = "dry runs already running (`dry_run_busy`)", body = crate::error::ErrorBody)))]
async fn dry_run(
    State(s): State<ControlState>,
    Operator(p): Operator,
    ApiPath(id): ApiPath<i64>,
    Body(b): Body<DryRunBody>,
) -> ApiResult<DryRunResult> {
    let rec = s.catalog().policy(id).await?;
    let kind: PolicyKind = rec.kind.parse().map_err(ApiError::bad_request)?;
    if b.capacity_bytes == 0 || b.capacity_bytes > MAX_DRY_RUN_CAPACITY {
        return Err(ApiError::bad_request(format!(
            "capacity_bytes must be 1 to {MAX_DRY_RUN_CAPACITY}"
        ))
        .with_param("capacity_bytes"));
    }
    let trace = parse_trace(&b.trace).map_err(|e| ApiError::bad_request(e).with_param("trace"))?;
    let rt = s.policies().clone();
    let catalog = s.catalog().clone();
    let mut active = PolicySet::from_catalog(&catalog, &rt).await;
    let mut candidate = PolicySet::from_catalog(&catalog, &rt).await;
    let params: serde_json::Value = match b.params {
        Some(p) => p,
        None => serde_json::from_str(&rec.params).unwrap_or(serde_json::Value::Null),
    };
    let w = rt
        .load(kind, rec.module.into(), &params, false)
        .await
        .map_err(ApiError::from)?;
    candidate.set(PolicySlot::wasm(w, Some(id)));
    let cap = b.capacity_bytes;
    // At most DRY_RUNS_AT_ONCE replays run; a client that goes away stops its own
    // (the guard sets the flag when this future is dropped).
    // The permit moves into the replay: it is held until the replay ends, even
    // after its client went away.
    let slot = s.inner.dry_runs.clone().try_acquire_owned().map_err(|_| {
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "dry_run_busy",
            format!("{DRY_RUNS_AT_ONCE} dry runs are already running; try again when one is done"),
        )
    })?;
    let cancel = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let _cancel_on_drop = CancelOnDrop(cancel.clone());
    let replays = tokio::task::spawn_blocking(move || {
        let _slot = slot;
        let c = simulate_until(&trace, cap, &mut candidate, &cancel)?;
        let a = simulate_until(&trace, cap, &mut active, &cancel)?;
        Some((c, a))
    })
    .await
    .map_err(|e| {
        tracing::error!(error = %e, "dry-run replay failed");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal_error",
            "the dry-run replay failed",
        )
    })?;
    let Some((mut cand, mut act)) = replays else {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "dry_run_cancelled",
            "the dry run was cancelled",
        ));
    };
    let keyer = s.keyer();
    pseudonymise(&mut cand, |t| keyer.pseudonym(t));
    pseudonymise(&mut act, |t| keyer.pseudonym(t));
    let result = DryRunResult {
        policy_id: id,
        kind: kind.as_str().into(),
        hit_ratio_delta: cand.hit_ratio - act.hit_ratio,
        recompute_tokens_delta: cand.recompute_tokens as i64 - act.recompute_tokens as i64,
        candidate: cand,
        active: act,
    };
    s.catalog()
        .audit(
            &p.sub,
            None,
            "policy.dry_run",
            &id.to_string(),
            &serde_json::json!({
                "requests": result.candidate.requests,
                "candidate_hit_ratio": result.candidate.hit_ratio,
                "active_hit_ratio": result.active.hit_ratio,
            }),
        )
        .await?;
    Ok(Json(result))
}

/// Query of `GET /v1/admin/audit`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct AuditQuery {
    /// Only this action.
    pub action: Option<String>,
    /// Only rows by this actor (token subject, or `system`).
    pub actor: Option<String>,
    /// Only rows at or after this time (ms since the Unix epoch).
    pub since_ms: Option<i64>,
    /// Only rows before this time (ms since the Unix epoch).
    pub until_ms: Option<i64>,
    /// At most this many rows, 1 to 10000 (default 100).
    pub limit: Option<i64>,
}

#[utoipa::path(get, path = "/v1/admin/audit", tag = "audit", summary = "The audit log, newest first (operator)", security(("bearer" = [])), params(AuditQuery), responses((status = 200, body = Vec<crate::catalog::AuditEntry>), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody)))]
async fn audit_log(
    State(s): State<ControlState>,
    Operator(_): Operator,
    ApiQuery(q): ApiQuery<AuditQuery>,
) -> ApiResult<Vec<crate::catalog::AuditEntry>> {
    for (name, v) in [("action", &q.action), ("actor", &q.actor)] {
        if v.as_deref().is_some_and(|a| a.contains('\0')) {
            return Err(
                ApiError::bad_request(format!("{name} contains a NUL character")).with_param(name),
            );
        }
    }
    let limit = q.limit.unwrap_or(100);
    if !(1..=10_000).contains(&limit) {
        return Err(
            ApiError::bad_request(format!("'limit' must be 1..=10000, not {limit}"))
                .with_param("limit"),
        );
    }
    let f = crate::catalog::AuditFilter {
        action: q.action.filter(|a| !a.is_empty()),
        actor: q.actor.filter(|a| !a.is_empty()),
        since_ms: q.since_ms,
        until_ms: q.until_ms,
    };
    Ok(Json(s.catalog().audit_log_filtered(&f, limit).await?))
}
