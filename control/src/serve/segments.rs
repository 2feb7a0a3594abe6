//! `/v1/segments`: the control plane's segment catalog, plus the data plane's side:
//! token counts for the served model, ahead-of-time prefill into the public pool
//! (`"prefill": true`, the default), cache residency, and eviction of superseded or
//! deleted versions.
//!
//! Catalog semantics (ownership, versions, grants, audit) are the control plane's:
//! each handler calls the [`crate::segments::SegmentService`] with the principal
//! its extractor verified (the token is checked once), and extends the answer the
//! control plane would give with a `hypic` object.
use super::errors::ServeError;
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
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

/// Worker name under which this server reports residency to the catalog.
pub const WORKER: &str = "serve-local";

/// Reads the catalog fields of a create or update body as the control plane's
/// `Body` extractor reads them (the same rejections, messages included).
fn catalog_body<T: serde::de::DeserializeOwned>(v: &Value) -> Result<T, ServeError> {
    let bytes = serde_json::to_vec(v).map_err(|e| ServeError::internal(e.to_string()))?;
    match Json::<T>::from_bytes(&bytes) {
        Ok(Json(t)) => Ok(t),
        Err(e) => Err(ApiError::from(e).into()),
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
            ServeError {
                param: Some("id".into()),
                ..ServeError::not_found(
                    "segment_not_found",
                    format!("segment {id:?} not found ({e})"),
                )
            }
            .into_response()
        })
}

/// Tokenises `content` (bounded: [`super::routes::tokenize_segment`]).
async fn tokenize(s: &AppState, content: String) -> Result<Vec<u32>, ServeError> {
    super::routes::tokenize_segment(s, content, "content").await
}

/// Parses a create/update body: content (string), optional prefill flag; adds
/// this model's token count to `tokens`.
async fn prepare_body(
    s: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Value, Vec<u32>, bool), ServeError> {
    let body = body.map_err(|e| body_error(e, s.0.cfg.max_body_bytes))?;
    let mut v: Value = super::routes::parse_body(s, body).await?;
    let obj = v
        .as_object_mut()
        .ok_or_else(|| ServeError::bad_request("invalid_type", "the body must be a JSON object"))?;
    let prefill = match obj.remove("prefill") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => b,
        Some(_) => {
            return Err(ServeError::invalid_param(
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
                return Err(ServeError {
                    param: Some("content".into()),
                    ..ServeError::new(
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
            return Err(ServeError::invalid_param(
                "content",
                "'content' must be a string",
            ))
        }
        None => {
            return Err(ServeError::invalid_param(
                "content",
                "'content' is required",
            ))
        }
    };
    if content.is_empty() {
        return Err(ServeError::invalid_param(
            "content",
            "'content' must not be empty",
        ));
    }
    let tokens = tokenize(s, content).await?;
    if tokens.is_empty() {
        return Err(ServeError::invalid_param(
            "content",
            "'content' encodes to no tokens",
        ));
    }
    if tokens.len() > s.0.ctx {
        return Err(ServeError {
            param: Some("content".into()),
            ..ServeError::bad_request(
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
            return Err(ServeError::invalid_param(
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

/// Prefills the current version of `seg` into the caller's namespace and reports
/// residency to the catalog.
async fn prefill(s: &AppState, tenant: &str, seg: &Segment, tokens: Arc<Vec<u32>>) -> Value {
    let snap = match s
        .0
        .control
        .segments()
        .snapshot(tenant, std::slice::from_ref(&seg.address), None)
        .await
    {
        Ok(r) => r,
        Err(e) => return json!({"error": e.message}),
    };
    let Some(item) = snap.segments.into_iter().next() else {
        return json!({"error": "no snapshot"});
    };
    let _gate = s.0.prefill_gate.acquire().await;
    let t0 = Instant::now();
    let (engine, iso, toks, starts) = (
        s.0.engine.clone(),
        item.isolation_key.clone(),
        tokens.clone(),
        body_starts(s),
    );
    let res = tokio::task::spawn_blocking(move || {
        // One prefill builds the entries of every body start.
        match engine.prefetch_many(&toks, &iso, &starts) {
            Ok(rs) => starts
                .into_iter()
                .zip(rs.into_iter().map(Ok))
                .collect::<Vec<_>>(),
            Err(e) => {
                let msg = e.to_string();
                starts
                    .into_iter()
                    .map(|b| (b, Err(dataplane::Error::Input(msg.clone()))))
                    .collect()
            }
        }
    })
    .await;
    let res = match res {
        Ok(r) => r,
        Err(e) => return json!({"error": e.to_string()}),
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
        match r {
            Ok((st, bytes)) => {
                total += bytes;
                entries.push(json!({"body_start": b, "status": st, "bytes": bytes}));
            }
            Err(e) => entries.push(json!({"body_start": b, "error": e.to_string()})),
        }
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
    json!({
        "prefill_ms": t0.elapsed().as_secs_f64() * 1e3,
        "shared": item.shared,
        "entries": entries,
    })
}

/// Residency of a segment version (by address) in the caller's namespace.
async fn residency(s: &AppState, tenant: &str, address: &str, tokens: &[u32]) -> Value {
    let Ok(snap) =
        s.0.control
            .catalog()
            .snapshot(tenant, &[address.to_string()])
            .await
    else {
        return Value::Null;
    };
    match snap.first() {
        Some(e) => residency_of(s, tenant, e, tokens),
        None => Value::Null,
    }
}

/// Residency of the pinned segment version `e` (its tokens: `tokens`) in
/// `tenant`'s namespace, from the pool alone.
fn residency_of(s: &AppState, tenant: &str, e: &SnapshotEntry, tokens: &[u32]) -> Value {
    let (iso, shared) = s.0.control.segments().isolation_of(tenant, e, None);
    let entries: Vec<Value> = body_starts(s)
        .into_iter()
        .map(|b| {
            let bytes = s.0.engine.resident_bytes(tokens, &iso, b);
            json!({"body_start": b, "resident": bytes.is_some(), "bytes": bytes.unwrap_or(0)})
        })
        .collect();
    let resident = entries.iter().any(|e| e["resident"] == json!(true));
    json!({"resident": resident, "shared": shared, "entries": entries})
}

fn ext(s: &AppState, version: i64, tokens: usize, extra: Value) -> Value {
    let mut v = json!({"model": s.0.model_id, "version": version, "tokens": tokens});
    if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
        o.extend(e);
    }
    v
}

/// Evicts every known version of the segment at address `id` (only those older
/// than `keep_from` when given) from the public pool, in every namespace it was
/// used in.
fn evict(s: &AppState, id: &str, keep_from: Option<i64>) -> usize {
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
#[utoipa::path(post, path = "/v1/segments", tag = "segments", summary = "Create a segment, tokenise and prefill it", operation_id = "create_segment", security(("bearer" = [])), params(("Idempotency-Key" = Option<String>, Header, description = "repeat-safe create")), request_body(content = crate::catalog::NewSegment, description = "the control plane's create body, plus `prefill` (boolean, default true): build the cache entries now"), responses((status = 200, description = "the control plane's answer plus a `hypic` object (model, version, tokens, residency, prefill)", body = Object), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 409, description = "the id is taken", body = crate::error::ErrorBody), (status = 413, description = "content over the limit", body = crate::error::ErrorBody)))]
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
) -> Result<Response, ServeError> {
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
        prefill(s, &p.tenant, &seg, tokens.clone()).await
    } else {
        json!({})
    };
    let res = residency(s, &p.tenant, &seg.address, &tokens).await;
    let mut out = segment_json(&seg);
    let mut e = ext(
        s,
        seg.current_version,
        tokens.len(),
        json!({"prefill": extra}),
    );
    e["residency"] = res;
    out["hypic"] = e;
    let mut r = (StatusCode::OK, Json(out)).into_response();
    if created.replayed {
        mark_replayed(&mut r);
    }
    Ok(r)
}

/// `GET /v1/segments/{id}`: the catalog's view plus token count and residency.
#[utoipa::path(get, path = "/v1/segments/{id}", tag = "segments", summary = "One segment with its token count and residency", operation_id = "get_segment", security(("bearer" = [])), params(("id" = String, Path, description = "the caller's segment id, or a segment address")), responses((status = 200, description = "the control plane's answer plus a `hypic` object (model, version, tokens, residency, prefill)", body = Object), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
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
        Err(e) => return ServeError::from(e).into_response(),
    };
    let mut out = segment_json(&seg);
    match catalog_tokens(&s, &seg.address, seg.current_version, &seg.content_hash).await {
        Ok((tokens, _)) => {
            let res = residency(&s, &p.tenant, &seg.address, &tokens).await;
            out["hypic"] = ext(
                &s,
                seg.current_version,
                tokens.len(),
                json!({"residency": res}),
            );
        }
        Err(e) => out["hypic"] = json!({"error": e.message}),
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
#[utoipa::path(get, path = "/v1/segments", tag = "segments", summary = "One page of segments with token counts and residency", operation_id = "list_segments", security(("bearer" = [])), params(ListQuery), responses((status = 200, description = "`object`, `data` (id, address, name, public, version, content_hash, tokens, residency, owner_tenant), `next`", body = Object), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody)))]
pub async fn list(
    State(s): State<AppState>,
    Tenant(p): Tenant,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Response {
    let (limit, after) = match (q.page_size(), q.cursor()) {
        (Ok(l), Ok(a)) => (l, a),
        (Err(e), _) | (_, Err(e)) => return ServeError::from(e).into_response(),
    };
    let page = match s.0.control.segments().list(&p, after, limit).await {
        Ok(page) => page,
        Err(e) => return ServeError::from(e).into_response(),
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
            (Some(n), _) => json!(n),
            (None, Some(t)) => json!(t.len()),
            (None, None) => Value::Null,
        };
        let res = match &cached {
            Some(t) => residency_of(&s, &p.tenant, &pin, t),
            None => Value::Null,
        };
        let mut item = json!({
            "id": seg.id, "address": seg.address, "object": "segment", "name": seg.name,
            "public": seg.public, "version": seg.current_version, "content_hash": seg.content_hash,
            "tokens": count, "residency": res,
        });
        if let Some(o) = seg.owner_tenant {
            item["owner_tenant"] = json!(o);
        }
        data.push(item);
    }
    Json(json!({"object": "list", "data": data, "next": page.next})).into_response()
}

/// `PUT /v1/segments/{id}`: new version in the catalog; entries of superseded
/// versions are evicted; the new version is prefilled.
#[utoipa::path(put, path = "/v1/segments/{id}", tag = "segments", summary = "Add a version: evict superseded entries, prefill the new one", operation_id = "update_segment", security(("bearer" = [])), params(("id" = String, Path, description = "the caller's segment id, or a segment address")), request_body(content = UpdateSegment, description = "the new content, plus `prefill` (boolean, default true)"), responses((status = 200, description = "the control plane's answer plus a `hypic` object (model, version, tokens, residency, prefill)", body = Object), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "not the owner tenant or an operator", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
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
) -> Result<Response, ServeError> {
    let (v, tokens, pre) = prepare_body(s, body).await?;
    let u: UpdateSegment = catalog_body(&v)?;
    let updated =
        s.0.control
            .segments()
            .update(p, id, &u.content, &u.tokens)
            .await?;
    let seg = updated.segment.clone();
    let evicted = evict(s, &seg.address, Some(seg.current_version));
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
        prefill(s, &p.tenant, &seg, tokens.clone()).await
    } else {
        json!({})
    };
    let mut out = serde_json::to_value(&updated).unwrap_or(Value::Null);
    out["hypic"] = ext(
        s,
        seg.current_version,
        tokens.len(),
        json!({"evicted_entries": evicted, "prefill": extra}),
    );
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
    let d = match s.0.control.segments().delete(&p, &id).await {
        Ok(d) => d,
        Err(e) => return ServeError::from(e).into_response(),
    };
    let evicted = evict(&s, &d.address, None);
    Json(json!({
        "deleted": id, "address": d.address, "invalidated_entries": d.invalidated_entries,
        "hypic": {"evicted_entries": evicted},
    }))
    .into_response()
}
