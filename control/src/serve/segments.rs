//! `/v1/segments`: the control plane's segment catalog, plus the data plane's side:
//! token counts for the served model, ahead-of-time prefill into the public pool
//! (`"prefill": true`, the default), cache residency, and eviction of superseded or
//! deleted versions.
//!
//! Catalog semantics (ownership, versions, grants, audit) are the control plane's:
//! each handler calls the [`crate::segments::SegmentService`] with the principal
//! its extractor verified (the token is checked once), and extends the answer the
//! control plane would give with a `hypic` object.
use super::routes::{body_error, catalog_tokens, Tenant};
use super::{AppState, CachedTokens};
use crate::api::{idempotency_key, mark_replayed, ApiPath, ApiQuery, ListQuery, UpdateSegment};
use crate::catalog::{now_ms, NewSegment, Residency, Segment, SnapshotEntry};
use crate::error::ApiError;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

/// Worker name under which this server reports residency to the catalog.
pub const WORKER: &str = "serve-local";

/// Reads the catalog fields of a create or update body as the control plane's
/// `Body` extractor reads them (the same rejections, messages included).
fn catalog_body<T: serde::de::DeserializeOwned>(v: &Value) -> Result<T, ApiError> {
    let bytes = serde_json::to_vec(v).map_err(|e| ApiError::internal(e.to_string()))?;
    match Json::<T>::from_bytes(&bytes) {
        Ok(Json(t)) => Ok(t),
        Err(e) => Err(ApiError::from(e)),
    }
}

/// A segment (as the caller sees it) as the JSON object the answers extend.
fn segment_json(seg: &Segment) -> Value {
    serde_json::to_value(seg).unwrap_or(Value::Null)
}

/// Body starts of the public-pool entries this server builds per segment: 0, the
/// default mode's seam width and the configured seam width.
pub(crate) fn body_starts(s: &AppState) -> Vec<usize> {
    let mut v = vec![0];
    if let dataplane::pic::Mode::Hypic { seam_width, .. } = s.0.default_mode {
        if seam_width > 0 {
            v.push(seam_width);
        }
    }
    if s.0.cfg.seam_width > 0 && !v.contains(&s.0.cfg.seam_width) {
        v.push(s.0.cfg.seam_width);
    }
    v
}

/// Refuses a path segment reference that no segment can have (an id of the
/// caller's or an address) with the serving API's 404 `segment_not_found`
/// naming `id`, before the catalog is asked (an id such as `doc?x`, `doc/grants`,
/// one with a space or a non-ASCII character).
fn bad_id(id: &str) -> Option<Response> {
    crate::catalog::validate_ref("segment id", id)
        .err()
        .map(|e| {
            ApiError {
                param: Some("id".into()),
                ..ApiError::openai_not_found(
                    "segment_not_found",
                    format!("segment {id:?} not found ({e})"),
                )
            }
            .into_response()
        })
}

/// Tokenises `content` (bounded: [`super::routes::tokenize_segment`]).
async fn tokenize(s: &AppState, content: String) -> Result<Vec<u32>, ApiError> {
    super::routes::tokenize_segment(s, content, "content").await
}

/// Parses a create/update body: content (string), optional prefill flag; adds
/// this model's token count to `tokens`.
async fn prepare_body(
    s: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Value, Vec<u32>, bool), ApiError> {
    let body = body.map_err(|e| body_error(e, s.0.cfg.max_body_bytes))?;
    let mut v: Value = super::routes::parse_body(s, body).await?;
    let obj = v
        .as_object_mut()
        .ok_or_else(|| ApiError::invalid("invalid_type", "the body must be a JSON object"))?;
    let prefill = match obj.remove("prefill") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => b,
        Some(_) => {
            return Err(ApiError::invalid_param(
                "prefill",
                "'prefill' must be a boolean",
            ))
        }
    };
    let content = match obj.get("content") {
        Some(Value::String(c)) => {
            // Refused before tokenising: the catalog would refuse it anyway.
            let max = s.0.control.catalog().limits().max_content_bytes;
            if c.len() > max {
                return Err(ApiError {
                    param: Some("content".into()),
                    ..ApiError::new(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "invalid_request_error",
                        "too_large",
                        format!(
                            "'content' is {} bytes, over the limit of {max} bytes per segment",
                            c.len()
                        ),
                    )
                });
            }
            c.clone()
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "content",
                "'content' must be a string",
            ))
        }
        None => return Err(ApiError::invalid_param("content", "'content' is required")),
    };
    if content.is_empty() {
        return Err(ApiError::invalid_param(
            "content",
            "'content' must not be empty",
        ));
    }
    let tokens = tokenize(s, content).await?;
    if tokens.is_empty() {
        return Err(ApiError::invalid_param(
            "content",
            "'content' encodes to no tokens",
        ));
    }
    if tokens.len() > s.0.ctx {
        return Err(ApiError {
            param: Some("content".into()),
            ..ApiError::invalid(
                "context_length_exceeded",
                format!(
                    "the segment has {} tokens, over the model's context of {}",
                    tokens.len(),
                    s.0.ctx
                ),
            )
        });
    }
    let counts = obj.entry("tokens").or_insert_with(|| json!({}));
    match counts.as_object_mut() {
        Some(m) => {
            m.insert(s.0.model_id.clone(), json!(tokens.len()));
        }
        None => {
            return Err(ApiError::invalid_param(
                "tokens",
                "'tokens' must be an object",
            ))
        }
    }
    Ok((v, tokens, prefill))
}

fn remember(s: &AppState, id: &str, version: i64, hash: &str, tokens: Arc<Vec<u32>>) {
    s.0.known
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .tokens
        .insert(
            (id.to_string(), version),
            CachedTokens {
                content_hash: hash.to_string(),
                tokens,
            },
        );
}

/// What an ahead-of-time prefill did (`hypic.prefill` of a create or update,
/// the answer of `POST /v1/segments/{id}/prefill`).
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct PrefillReport {
    /// Wall-clock time of the prefill, ms (one model pass builds every entry).
    pub prefill_ms: f64,
    /// The entries are in the shared namespace (a public segment).
    pub shared: bool,
    /// One row per body start this server builds entries for.
    pub entries: Vec<PrefillEntry>,
}

/// One public-pool entry an ahead-of-time prefill built (or found).
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct PrefillEntry {
    /// Body start: 0 for the segment used first, the seam width after another.
    pub body_start: usize,
    /// `present` (already resident), `stored`, `refused` (the admission policy
    /// or no room) or `not_needed` (no longer than the seam window); absent
    /// with `error`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub status: Option<dataplane::pic::Prefetch>,
    /// Payload bytes of the entry (absent with `error`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<usize>,
    /// Why the entry could not be built.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// [`prefill`]'s answer as the `hypic.prefill` object of a create or update:
/// the report, or `{"error": message}`.
fn prefill_json(r: Result<PrefillReport, String>) -> Value {
    match r {
        Ok(r) => serde_json::to_value(r).unwrap_or(Value::Null),
        Err(e) => json!({ "error": e }),
    }
}

/// Prefills the current version of `seg` (its tokens: `tokens`) into the
/// namespace of `tenant` and reports residency to the catalog. Errors: the
/// catalog could not pin the version for `tenant` (message), or the prefill
/// task failed; an entry the engine could not build is an `error` row.
async fn prefill(
    s: &AppState,
    tenant: &str,
    seg: &Segment,
    tokens: Arc<Vec<u32>>,
) -> Result<PrefillReport, String> {
    let snap =
        s.0.control
            .segments()
            .snapshot(tenant, std::slice::from_ref(&seg.address), None)
            .await
            .map_err(|e| e.message)?;
    let Some(item) = snap.segments.into_iter().next() else {
        return Err("no snapshot".into());
    };
    super::residency::label(s, &seg.address, item.version, &tokens, &item.isolation_key);
    let _gate = s.0.prefill_gate.acquire().await;
    let t0 = Instant::now();
    let starts = body_starts(s);
    // One build makes the entries of every body start; the scheduler runs it in
    // pieces of its step budget, beside the running sequences' decode steps.
    let rx =
        s.0.sched
            .register(tokens.to_vec(), item.isolation_key.clone(), starts.clone())
            .map_err(|e| e.to_string())?;
    let res: Vec<(usize, dataplane::Result<(dataplane::pic::Prefetch, usize)>)> = match rx.await {
        Ok(Ok(rs)) => starts.into_iter().zip(rs.into_iter().map(Ok)).collect(),
        Ok(Err(e)) => {
            let msg = e.to_string();
            starts
                .into_iter()
                .map(|b| (b, Err(dataplane::Error::Input(msg.clone()))))
                .collect()
        }
        Err(_) => return Err("the scheduler stopped before the segment was built".into()),
    };
    s.0.known
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .isolations
        .entry(seg.address.clone())
        .or_default()
        .insert(item.isolation_key.clone());
    let mut entries = vec![];
    let mut total = 0usize;
    for (b, r) in res {
        entries.push(match r {
            Ok((st, bytes)) => {
                total += bytes;
                PrefillEntry {
                    body_start: b,
                    status: Some(st),
                    bytes: Some(bytes),
                    error: None,
                }
            }
            Err(e) => PrefillEntry {
                body_start: b,
                status: None,
                bytes: None,
                error: Some(e.to_string()),
            },
        });
    }
    let _ =
        s.0.control
            .catalog()
            .report_residency(&Residency {
                worker: WORKER.into(),
                cache_key: item.cache_key.clone(),
                segment_id: seg.address.clone(),
                version: item.version,
                tenant: if item.shared {
                    None
                } else {
                    Some(tenant.to_string())
                },
                bytes: total as i64,
                last_use: now_ms(),
            })
            .await;
    Ok(PrefillReport {
        prefill_ms: t0.elapsed().as_secs_f64() * 1e3,
        shared: item.shared,
        entries,
    })
}

/// Query of `POST /v1/segments/{id}/prefill`.
#[derive(Debug, Default, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PrefillQuery {
    /// The tenant whose namespace to warm (default: the caller's; for an
    /// operator, the segment owner's, as segment answers report it). A tenant
    /// token may only name its own tenant (else 403 `tenant_mismatch`); the
    /// tenant must be able to read the segment (else 404 naming `tenant`).
    pub tenant: Option<String>,
}

/// Answer of `POST /v1/segments/{id}/prefill`.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct Prefilled {
    /// The segment's address.
    pub address: String,
    /// The version prefilled (the current one).
    pub version: i64,
    /// The tenant whose namespace was warmed (shared entries serve every tenant).
    pub tenant: String,
    /// Its token count for the served model.
    pub tokens: usize,
    /// What the prefill did, per entry.
    pub prefill: PrefillReport,
    /// Residency in that tenant's namespace after the prefill (absent when the
    /// catalog could not pin the version).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub residency: Option<SegmentResidency>,
}

/// `POST /v1/segments/{id}/prefill`: builds the public-pool entries of an
/// existing segment's current version now (every body start this server uses),
/// so its first request is a hit. Entries already resident are left as they
/// are (`present`).
#[utoipa::path(post, path = "/v1/segments/{id}/prefill", tag = "segments", summary = "Warm an existing segment's current version into the public pool now", operation_id = "prefill_segment", security(("bearer" = [])), params(("id" = String, Path, description = "a segment id of the caller's, or a segment address the caller may read"), PrefillQuery), responses((status = 200, body = Prefilled), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "a tenant token named another tenant", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller or the named tenant", body = crate::error::ErrorBody), (status = 500, description = "the prefill failed", body = crate::error::ErrorBody)))]
pub async fn prefill_one(
    State(s): State<AppState>,
    Tenant(p): Tenant,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<PrefillQuery>,
) -> Response {
    if let Some(r) = bad_id(&id) {
        return r;
    }
    match prefill_inner(&s, &p, &id, q).await {
        Ok(r) => Json(r).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn prefill_inner(
    s: &AppState,
    p: &crate::auth::Principal,
    id: &str,
    q: PrefillQuery,
) -> Result<Prefilled, ApiError> {
    let named = q.tenant.is_some();
    let mut target = super::why::subject(
        p,
        &super::why::WhyQuery {
            tenant: q.tenant,
            version: None,
        },
    )?;
    let seg = s.0.control.segments().readable(p, id).await.map_err(|e| {
        if e.status == StatusCode::NOT_FOUND {
            ApiError {
                param: Some("id".into()),
                ..ApiError::openai_not_found("segment_not_found", e.message)
            }
        } else {
            e
        }
    })?;
    // An operator naming no tenant warms the namespace the owner uses, the one
    // segment answers report to an operator.
    if !named && p.is_operator() {
        if let Some(owner) = seg.owner_tenant.as_deref().filter(|o| !o.is_empty()) {
            target.tenant = owner.to_string();
        }
    }
    if target.tenant != p.tenant
        && !target.is_operator()
        && s.0
            .control
            .segments()
            .readable(&target, &seg.address)
            .await
            .is_err()
    {
        return Err(ApiError {
            param: Some("tenant".into()),
            ..ApiError::openai_not_found(
                "segment_not_found",
                format!(
                    "tenant {:?} may not read segment {}",
                    target.tenant, seg.address
                ),
            )
        });
    }
    let (tokens, _) =
        catalog_tokens(s, &seg.address, seg.current_version, &seg.content_hash).await?;
    let report = prefill(s, &target.tenant, &seg, tokens.clone())
        .await
        .map_err(|e| ApiError::internal(format!("prefill of {} failed: {e}", seg.address)))?;
    let res = residency(s, &target, &seg.address, &tokens).await;
    let stored = report
        .entries
        .iter()
        .filter(|e| e.status == Some(dataplane::pic::Prefetch::Stored))
        .count();
    let _ =
        s.0.control
            .catalog()
            .audit(
                &p.sub,
                Some(&p.tenant),
                "segment.prefill",
                &seg.address,
                &json!({"tenant": target.tenant, "version": seg.current_version, "stored_entries": stored}),
            )
            .await;
    Ok(Prefilled {
        address: seg.address,
        version: seg.current_version,
        tenant: target.tenant,
        tokens: tokens.len(),
        prefill: report,
        residency: res,
    })
}

/// Residency of a segment version in the caller's namespace (the `residency`
/// of a segment answer on `hypic serve`).
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct SegmentResidency {
    /// Some public-pool entry of the version is resident (any tier).
    pub resident: bool,
    /// The entries are in the shared namespace (a public segment).
    pub shared: bool,
    /// One row per body start this server builds entries for.
    pub entries: Vec<ResidencyEntry>,
}

/// One public-pool entry of a segment version.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ResidencyEntry {
    /// Body start: 0 for the segment used first in a request, the seam width for
    /// the segment used after another.
    pub body_start: usize,
    /// Whether the entry is resident (any tier).
    pub resident: bool,
    /// Payload bytes (0 when not resident).
    pub bytes: usize,
    /// Hits since the entry was stored; `null` when not resident, or for a
    /// shared entry asked about with a tenant token (it tells when other
    /// tenants used it).
    pub hits: Option<u64>,
    /// The entry's last use, a hit or its insertion (ms since the Unix epoch);
    /// `null` as for `hits`.
    pub last_use_ms: Option<u64>,
}

impl SegmentResidency {
    /// Hits over all resident entries, `null` when no entry tells (none
    /// resident, or usage hidden from the caller).
    pub fn hits(&self) -> Option<u64> {
        self.entries
            .iter()
            .filter_map(|e| e.hits)
            .reduce(|a, b| a + b)
    }

    /// The latest use of any resident entry (ms since the Unix epoch), `null`
    /// as for [`SegmentResidency::hits`].
    pub fn last_use_ms(&self) -> Option<u64> {
        self.entries.iter().filter_map(|e| e.last_use_ms).max()
    }
}

/// Residency of a segment version (by address) in the caller's namespace.
async fn residency(
    s: &AppState,
    p: &crate::auth::Principal,
    address: &str,
    tokens: &[u32],
) -> Option<SegmentResidency> {
    // An operator pins the version as the owner would (it may not read every
    // tenant's segment through the catalog's tenant snapshot).
    let pin_as = if p.is_operator() {
        s.0.control
            .catalog()
            .get_segment(address)
            .await
            .ok()
            .and_then(|seg| seg.owner_tenant)
            .unwrap_or_else(|| p.tenant.clone())
    } else {
        p.tenant.clone()
    };
    let snap =
        s.0.control
            .catalog()
            .snapshot(&pin_as, &[address.to_string()])
            .await
            .ok()?;
    snap.first().map(|e| residency_of(s, p, e, tokens))
}

/// The tenant whose namespace a segment answer reports residency in: the
/// caller's, except that an operator sees another tenant's segment as its
/// owner uses it (the operator's own namespace never holds it unless the
/// operator warmed it there).
fn namespace_of<'a>(p: &'a crate::auth::Principal, e: &'a SnapshotEntry) -> &'a str {
    if p.is_operator() && !e.owner_tenant.is_empty() {
        &e.owner_tenant
    } else {
        &p.tenant
    }
}

/// Residency of the pinned segment version `e` (its tokens: `tokens`) in the
/// namespace of [`namespace_of`], from the pool alone. Hits and last use of a
/// shared entry are left out for a tenant caller, as the why view leaves them
/// out.
fn residency_of(
    s: &AppState,
    p: &crate::auth::Principal,
    e: &SnapshotEntry,
    tokens: &[u32],
) -> SegmentResidency {
    let ns = namespace_of(p, e);
    let (iso, shared) = s.0.control.segments().isolation_of(ns, e, None);
    let show_usage = !shared || p.is_operator();
    let entries: Vec<ResidencyEntry> = body_starts(s)
        .into_iter()
        .map(|b| {
            let bytes = s.0.engine.resident_bytes(tokens, &iso, b);
            let meta = match bytes {
                Some(_) if show_usage => s.0.engine.entry_report(tokens, &iso, b).meta,
                _ => None,
            };
            ResidencyEntry {
                body_start: b,
                resident: bytes.is_some(),
                bytes: bytes.unwrap_or(0),
                hits: meta.as_ref().map(|m| m.hits),
                last_use_ms: meta.as_ref().map(|m| m.last_use_ms),
            }
        })
        .collect();
    SegmentResidency {
        resident: entries.iter().any(|e| e.resident),
        shared,
        entries,
    }
}

/// The `hypic` object of a segment answer on `hypic serve`: what the served
/// model makes of the segment's current version.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct SegmentServing {
    /// The served model's id.
    pub model: String,
    /// The version counted and cached.
    pub version: i64,
    /// Its token count for the served model (`null` with `error`).
    pub tokens: Option<usize>,
    /// Why the version's tokens could not be counted (get; then no residency).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Residency in the caller's namespace, an operator's answer in the
    /// owner's (create and get; absent when the catalog could not pin the
    /// version).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub residency: Option<SegmentResidency>,
    /// The ahead-of-time prefill (create and update with `prefill`): `{}` when
    /// not asked for, else `prefill_ms`, `shared` and one `entries` row per
    /// body start (`body_start`, `status`, `bytes` or `error`), or `error`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub prefill: Option<Value>,
    /// Entries of superseded versions evicted (update).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evicted_entries: Option<usize>,
}

/// A segment answer of `hypic serve` (`POST /v1/segments`, `GET
/// /v1/segments/{id}`): the control plane's segment plus the `hypic` object.
#[derive(Serialize, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct ServedSegment {
    #[serde(flatten)]
    segment: Segment,
    /// What the served model makes of the segment.
    hypic: SegmentServing,
}

/// Answer of `PUT /v1/segments/{id}` on `hypic serve`: the control plane's
/// answer plus the `hypic` object (`version`, `tokens`, `prefill`,
/// `evicted_entries`).
#[derive(Serialize, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct ServedUpdate {
    /// The segment after the update, as the caller sees it.
    segment: Segment,
    /// Cache-residency rows of superseded versions dropped by the invalidation
    /// policy.
    invalidated_entries: u64,
    /// What the served model makes of the new version.
    hypic: SegmentServing,
}

fn ext(s: &AppState, version: i64, tokens: usize) -> SegmentServing {
    SegmentServing {
        model: s.0.model_id.clone(),
        version,
        tokens: Some(tokens),
        error: None,
        residency: None,
        prefill: None,
        evicted_entries: None,
    }
}

/// Body of `POST /v1/segments` on `hypic serve`: the control plane's create
/// body plus `prefill`.
#[derive(serde::Deserialize, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct CreateSegmentBody {
    #[serde(flatten)]
    segment: NewSegment,
    /// Build the segment's cache entries now (default true).
    prefill: Option<bool>,
}

/// Body of `PUT /v1/segments/{id}` on `hypic serve`: the control plane's update
/// body plus `prefill`.
#[derive(serde::Deserialize, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct UpdateSegmentBody {
    #[serde(flatten)]
    segment: UpdateSegment,
    /// Build the new version's cache entries now (default true).
    prefill: Option<bool>,
}

/// One row of `GET /v1/segments` on `hypic serve`: the catalog's fields of the
/// current version, its token count and residency for the served model.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ServedSegmentRow {
    /// The id the caller addresses the segment by.
    pub id: String,
    /// Opaque global address (`~` + 32 hex digits).
    pub address: String,
    /// Always `segment`.
    pub object: &'static str,
    /// Human-readable name.
    pub name: String,
    /// Explicitly public.
    pub public: bool,
    /// Current version number (1-based).
    pub version: i64,
    /// Content hash of the current version.
    pub content_hash: String,
    /// Content length in bytes of the current version.
    pub byte_len: i64,
    /// Token count for the served model; `null` when neither the catalog nor
    /// this server has counted it.
    pub tokens: Option<i64>,
    /// Residency in the caller's namespace (an operator: the owner's); `null`
    /// for a version this server holds no tokens of.
    pub residency: Option<SegmentResidency>,
    /// Hits of its resident entries (see [`SegmentResidency::hits`]).
    pub hits: Option<u64>,
    /// Last use of any resident entry (ms since the Unix epoch).
    pub last_use_ms: Option<u64>,
    /// Creation time (ms since the Unix epoch).
    pub created_at: i64,
    /// Time of the last update (ms since the Unix epoch).
    pub updated_at: i64,
    /// Owning tenant; shown only to the owner and to operators.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner_tenant: Option<String>,
}

/// `GET /v1/segments` on `hypic serve`.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ServedSegmentList {
    /// Always `list`.
    pub object: &'static str,
    /// One page of rows.
    pub data: Vec<ServedSegmentRow>,
    /// `after` of the next page, `null` on the last one.
    pub next: Option<String>,
}

/// The residency directory's eviction gate, for a route that changes a segment in
/// the catalog and then evicts (see `Directory::evict_gate`); `None` without the
/// directory.
async fn evict_gate(s: &AppState) -> Option<tokio::sync::MutexGuard<'_, ()>> {
    match &s.0.residency {
        Some(d) => Some(d.evict_gate.lock().await),
        None => None,
    }
}

/// Evicts every known version of the segment at address `id` (only those older
/// than `keep_from` when given) from the public pool, in every namespace it was
/// used in.
pub(crate) fn evict(s: &AppState, id: &str, keep_from: Option<i64>) -> usize {
    let starts = body_starts(s);
    let mut k = s.0.known.lock().unwrap_or_else(|p| p.into_inner());
    let isos: Vec<String> = k
        .isolations
        .get(id)
        .map(|x| x.iter().cloned().collect())
        .unwrap_or_default();
    let versions: Vec<(String, i64)> = k
        .tokens
        .keys()
        .filter(|(i, v)| i == id && keep_from.is_none_or(|f| *v < f))
        .cloned()
        .collect();
    let mut n = 0;
    for key in versions {
        if let Some(c) = k.tokens.remove(&key) {
            for iso in &isos {
                n += s.0.engine.evict_segment(&c.tokens, iso, &starts);
            }
        }
    }
    if keep_from.is_none() {
        k.isolations.remove(id);
    }
    n
}

/// Evicts the public-pool entries of every version of the segment at `address`
/// this server holds tokens of, in every namespace it was used in, keeping what
/// the server knows of it (tokens, namespaces) so that its residency stays
/// answerable; returns how many entries were present.
pub(crate) fn evict_entries(s: &AppState, address: &str) -> usize {
    let starts = body_starts(s);
    let k = s.0.known.lock().unwrap_or_else(|p| p.into_inner());
    let isos: Vec<String> = k
        .isolations
        .get(address)
        .map(|x| x.iter().cloned().collect())
        .unwrap_or_default();
    let mut n = 0;
    for ((i, _), c) in k.tokens.iter() {
        if i == address {
            for iso in &isos {
                n += s.0.engine.evict_segment(&c.tokens, iso, &starts);
            }
        }
    }
    n
}

/// `POST /v1/segments`: create in the catalog, then prefill.
#[utoipa::path(post, path = "/v1/segments", tag = "segments", summary = "Create a segment, tokenise and prefill it", operation_id = "create_segment", security(("bearer" = [])), params(("Idempotency-Key" = Option<String>, Header, description = "repeat-safe create")), request_body(content = CreateSegmentBody, description = "the catalog's segment fields and `prefill` (default true: build the public-pool entries now)"), responses((status = 200, description = "the control plane's answer plus a `hypic` object (model, version, tokens, residency, prefill)", body = ServedSegment), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 409, description = "the id is taken", body = crate::error::ErrorBody), (status = 413, description = "content over the limit", body = crate::error::ErrorBody)))]
pub async fn create(
    State(s): State<AppState>,
    Tenant(p): Tenant,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match create_inner(&s, &p, &headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn create_inner(
    s: &AppState,
    p: &crate::auth::Principal,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (v, tokens, pre) = prepare_body(s, body).await?;
    let new: NewSegment = catalog_body(&v)?;
    let key = idempotency_key(headers)?;
    let created = s.0.control.segments().create(p, &new, key).await?;
    let seg = created.segment;
    let tokens = Arc::new(tokens);
    remember(
        s,
        &seg.address,
        seg.current_version,
        &seg.content_hash,
        tokens.clone(),
    );
    let extra = if pre {
        prefill_json(prefill(s, &p.tenant, &seg, tokens.clone()).await)
    } else {
        json!({})
    };
    let res = residency(s, p, &seg.address, &tokens).await;
    let mut out = segment_json(&seg);
    out["hypic"] = json!(SegmentServing {
        residency: res,
        prefill: Some(extra),
        ..ext(s, seg.current_version, tokens.len())
    });
    let mut r = (StatusCode::OK, Json(out)).into_response();
    if created.replayed {
        mark_replayed(&mut r);
    }
    Ok(r)
}

/// `GET /v1/segments/{id}`: the catalog's view plus token count and residency.
#[utoipa::path(get, path = "/v1/segments/{id}", tag = "segments", summary = "One segment with its token count and residency", operation_id = "get_segment", security(("bearer" = [])), params(("id" = String, Path, description = "the caller's segment id, or a segment address")), responses((status = 200, description = "the control plane's answer plus a `hypic` object (model, version, tokens, residency, prefill)", body = ServedSegment), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
pub async fn get_one(
    State(s): State<AppState>,
    Tenant(p): Tenant,
    ApiPath(id): ApiPath<String>,
) -> Response {
    if let Some(r) = bad_id(&id) {
        return r;
    }
    let seg = match s.0.control.segments().get(&p, &id).await {
        Ok(seg) => seg,
        Err(e) => return e.into_response(),
    };
    let mut out = segment_json(&seg);
    match catalog_tokens(&s, &seg.address, seg.current_version, &seg.content_hash).await {
        Ok((tokens, _)) => {
            let res = residency(&s, &p, &seg.address, &tokens).await;
            out["hypic"] = json!(SegmentServing {
                residency: res,
                ..ext(&s, seg.current_version, tokens.len())
            });
        }
        Err(e) => {
            out["hypic"] = json!(SegmentServing {
                tokens: None,
                error: Some(e.message),
                ..ext(&s, seg.current_version, 0)
            })
        }
    }
    Json(out).into_response()
}

/// `GET /v1/segments?limit=&after=`: one page of the catalog segments the caller
/// may read (an operator: all), in one catalog query, with the token count for the
/// served model (from the catalog) and the residency in the caller's namespace.
/// Residency is `null` for a version this server holds no tokens of (it built no
/// entry from it since its token cache was last filled); `GET /v1/segments/{id}`
/// answers it exactly. `next` is the `after` of the following page (`null` on the
/// last one).
#[utoipa::path(get, path = "/v1/segments", tag = "segments", summary = "One page of segments with token counts and residency", operation_id = "list_segments", security(("bearer" = [])), params(ListQuery), responses((status = 200, description = "one page of rows; `next` is the `after` of the following page", body = ServedSegmentList), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody)))]
pub async fn list(
    State(s): State<AppState>,
    Tenant(p): Tenant,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Response {
    let (limit, after) = match (q.page_size(), q.cursor()) {
        (Ok(l), Ok(a)) => (l, a),
        (Err(e), _) | (_, Err(e)) => return e.into_response(),
    };
    let page = match s.0.control.segments().list(&p, after, limit).await {
        Ok(page) => page,
        Err(e) => return e.into_response(),
    };
    let mut data = Vec::with_capacity(page.items.len());
    for crate::segments::Listed { view: seg, pin } in page.items {
        let cached = {
            let k = s.0.known.lock().unwrap_or_else(|p| p.into_inner());
            k.tokens
                .get(&(seg.address.clone(), seg.current_version))
                .filter(|c| c.content_hash == seg.content_hash)
                .map(|c| c.tokens.clone())
        };
        let count = match (seg.tokens.get(&s.0.model_id), &cached) {
            (Some(n), _) => Some(*n),
            (None, Some(t)) => Some(t.len() as i64),
            (None, None) => None,
        };
        let res = cached.as_ref().map(|t| residency_of(&s, &p, &pin, t));
        data.push(ServedSegmentRow {
            hits: res.as_ref().and_then(SegmentResidency::hits),
            last_use_ms: res.as_ref().and_then(SegmentResidency::last_use_ms),
            id: seg.id,
            address: seg.address,
            object: "segment",
            name: seg.name,
            public: seg.public,
            version: seg.current_version,
            content_hash: seg.content_hash,
            byte_len: seg.byte_len,
            tokens: count,
            residency: res,
            created_at: seg.created_at,
            updated_at: seg.updated_at,
            owner_tenant: seg.owner_tenant,
        });
    }
    Json(ServedSegmentList {
        object: "list",
        data,
        next: page.next,
    })
    .into_response()
}

/// `PUT /v1/segments/{id}`: new version in the catalog; entries of superseded
/// versions are evicted; the new version is prefilled.
#[utoipa::path(put, path = "/v1/segments/{id}", tag = "segments", summary = "Add a version: evict superseded entries, prefill the new one", operation_id = "update_segment", security(("bearer" = [])), params(("id" = String, Path, description = "the caller's segment id, or a segment address")), request_body = UpdateSegmentBody, responses((status = 200, description = "the control plane's answer plus a `hypic` object (model, version, tokens, residency, prefill)", body = ServedUpdate), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "not the owner tenant or an operator", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
pub async fn update(
    State(s): State<AppState>,
    Tenant(p): Tenant,
    ApiPath(id): ApiPath<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    if let Some(r) = bad_id(&id) {
        return r;
    }
    match update_inner(&s, &p, &id, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn update_inner(
    s: &AppState,
    p: &crate::auth::Principal,
    id: &str,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (v, tokens, pre) = prepare_body(s, body).await?;
    let u: UpdateSegment = catalog_body(&v)?;
    let gate = evict_gate(s).await;
    let updated =
        s.0.control
            .segments()
            .update(p, id, &u.content, &u.tokens)
            .await?;
    let seg = updated.segment.clone();
    let evicted = evict(s, &seg.address, Some(seg.current_version));
    drop(gate);
    s.0.why.record_superseded(
        &seg.address,
        seg.current_version - 1,
        seg.current_version,
        evicted,
    );
    let tokens = Arc::new(tokens);
    remember(
        s,
        &seg.address,
        seg.current_version,
        &seg.content_hash,
        tokens.clone(),
    );
    let extra = if pre {
        prefill_json(prefill(s, &p.tenant, &seg, tokens.clone()).await)
    } else {
        json!({})
    };
    let mut out = serde_json::to_value(&updated).unwrap_or(Value::Null);
    out["hypic"] = json!(SegmentServing {
        prefill: Some(extra),
        evicted_entries: Some(evicted),
        ..ext(s, seg.current_version, tokens.len())
    });
    Ok(Json(out).into_response())
}

/// `DELETE /v1/segments/{id}`: delete in the catalog, evict every cached version.
#[utoipa::path(delete, path = "/v1/segments/{id}", tag = "segments", summary = "Delete a segment and evict its entries", operation_id = "delete_segment", security(("bearer" = [])), params(("id" = String, Path, description = "the caller's segment id, or a segment address")), responses((status = 200, description = "`deleted`, `address`, `invalidated_entries`, `hypic.evicted_entries`", body = Object), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "not the owner tenant or an operator", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
pub async fn delete(
    State(s): State<AppState>,
    Tenant(p): Tenant,
    ApiPath(id): ApiPath<String>,
) -> Response {
    if let Some(r) = bad_id(&id) {
        return r;
    }
    let gate = evict_gate(&s).await;
    let d = match s.0.control.segments().delete(&p, &id).await {
        Ok(d) => d,
        Err(e) => return e.into_response(),
    };
    let evicted = evict(&s, &d.address, None);
    drop(gate);
    Json(json!({
        "deleted": id, "address": d.address, "invalidated_entries": d.invalidated_entries,
        "hypic": {"evicted_entries": evicted},
    }))
    .into_response()
}
