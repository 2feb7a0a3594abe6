//! "Why did it miss?": `GET /v1/segments/{id}/why` explains, for one catalog segment
//! and one tenant, where the segment's public-pool entries are (tier, bytes, hits)
//! and, for each that is not resident, why: from the data plane's per-entry history
//! (evicted by which policy from which tier, removed, checksum failure, refused by
//! admission, no room, never seen, too short for the seam window) and from what only
//! the control plane knows (no permission, superseded version, deleted, evicted on
//! request). `POST /v1/segments/{id}/evict` is the operator's (or owner's) explicit
//! eviction, remembered as a reason.
//!
//! The control plane's side is [`WhyLog`]: bounded rings of recent observations per
//! (tenant, segment) and per segment, filled by the request path and the segment
//! routes. Memory is bounded: [`WHY_MAX_KEYS`] keys of each kind,
//! [`WHY_PER_KEY`] observations a key.
use super::bounded::BoundedMap;
use super::routes::{catalog_tokens, Resolved, Tenant};
use super::AppState;
use crate::api::{ApiPath, ApiQuery};
use crate::auth::Principal;
use crate::catalog::{now_ms, Role, Segment};
use crate::error::ApiError;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use dataplane::pic::pool::{Decider, Tier};
use dataplane::pic::{EntryReport, Outcome, PicStats};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// Most (tenant, segment) pairs, and most segments, whose observations are kept
/// (oldest forgotten first).
pub const WHY_MAX_KEYS: usize = 16_384;

/// Observations kept per key (a ring: the oldest is dropped first).
pub const WHY_PER_KEY: usize = 8;

/// One thing the control plane saw happen to a segment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Observation {
    /// When, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// `request` (a request used the segment), `version_mismatch` (a request named
    /// a version the catalog no longer has as current), `version_superseded` (a new
    /// version replaced it; the old version's entries were evicted),
    /// `evicted_on_request` (`POST /v1/segments/{id}/evict`).
    pub event: String,
    /// The segment version concerned (for `version_mismatch`: the one named).
    pub version: Option<i64>,
    /// `request`: how the segment was served (`hit`, `miss`, `computed`,
    /// `prefix_hit`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
    /// `request`: the data plane's miss reason, when not reused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub miss_reason: Option<String>,
    /// `request`: position of the segment in the request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    /// Free text: the catalog's version, the actor, the entries evicted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl Observation {
    fn new(event: &str, version: Option<i64>, detail: Option<String>) -> Observation {
        Observation {
            at_ms: now_ms().max(0) as u64,
            event: event.into(),
            version,
            outcome: None,
            miss_reason: None,
            index: None,
            detail,
        }
    }
}

type Ring = VecDeque<Observation>;

/// Recent observations of segments, per (tenant, segment address) and per segment
/// address (events that concern every tenant), bounded (see the module docs).
pub struct WhyLog {
    by_tenant: Mutex<BoundedMap<(String, String), Ring>>,
    by_segment: Mutex<BoundedMap<String, Ring>>,
}

impl Default for WhyLog {
    fn default() -> Self {
        WhyLog {
            by_tenant: Mutex::new(BoundedMap::new(WHY_MAX_KEYS, WHY_MAX_KEYS, |_| 1)),
            by_segment: Mutex::new(BoundedMap::new(WHY_MAX_KEYS, WHY_MAX_KEYS, |_| 1)),
        }
    }
}

fn ring_push(r: &mut Ring, o: Observation) {
    r.push_back(o);
    while r.len() > WHY_PER_KEY {
        r.pop_front();
    }
}

impl WhyLog {
    /// Records `o` for `tenant`'s use of the segment at `address`.
    pub fn record(&self, tenant: &str, address: &str, o: Observation) {
        let mut m = self.by_tenant.lock().unwrap_or_else(|p| p.into_inner());
        ring_push(
            m.entry((tenant.to_string(), address.to_string()))
                .or_default(),
            o,
        );
    }

    /// Records `o` for the segment at `address`, for every tenant.
    pub fn record_segment(&self, address: &str, o: Observation) {
        let mut m = self.by_segment.lock().unwrap_or_else(|p| p.into_inner());
        ring_push(m.entry(address.to_string()).or_default(), o);
    }

    /// Records how each catalog segment of one served prompt was served
    /// (`stats` of the prompt, `segs` its resolved segments).
    pub fn record_request(&self, tenant: &str, segs: &[Resolved], stats: &PicStats) {
        let at_ms = now_ms().max(0) as u64;
        for x in &stats.segments {
            let Some(r) = segs.get(x.index) else { continue };
            let Some(address) = &r.address else { continue };
            let outcome = match x.outcome {
                Outcome::Computed => "computed",
                Outcome::PrefixHit => "prefix_hit",
                Outcome::Hit => "hit",
                Outcome::Miss => "miss",
            };
            self.record(
                tenant,
                address,
                Observation {
                    at_ms,
                    event: "request".into(),
                    version: r.version,
                    outcome: Some(outcome.into()),
                    miss_reason: x.miss_reason.map(|m| m.as_str().into()),
                    index: Some(x.index),
                    detail: None,
                },
            );
        }
    }

    /// Records that a request of `tenant` named `named`, not the current version
    /// `current`, of the segment at `address`.
    pub fn record_version_mismatch(&self, tenant: &str, address: &str, named: i64, current: i64) {
        self.record(
            tenant,
            address,
            Observation::new(
                "version_mismatch",
                Some(named),
                Some(format!("the catalog is at version {current}")),
            ),
        );
    }

    /// Records that `version` of the segment at `address` was superseded by
    /// `by_version` and `evicted` entries of older versions were evicted.
    pub fn record_superseded(&self, address: &str, version: i64, by_version: i64, evicted: usize) {
        self.record_segment(
            address,
            Observation::new(
                "version_superseded",
                Some(version),
                Some(format!(
                    "superseded by version {by_version}; {evicted} cache entries of older versions evicted"
                )),
            ),
        );
    }

    /// Records an explicit eviction of the segment at `address` by `actor`.
    pub fn record_evicted(&self, address: &str, version: i64, actor: &str, evicted: usize) {
        self.record_segment(
            address,
            Observation::new(
                "evicted_on_request",
                Some(version),
                Some(format!("by {actor}; {evicted} cache entries evicted")),
            ),
        );
    }

    fn observations(&self, tenant: &str, address: &str) -> (Vec<Observation>, Vec<Observation>) {
        let t = self
            .by_tenant
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&(tenant.to_string(), address.to_string()))
            .map(|r| r.iter().rev().cloned().collect())
            .unwrap_or_default();
        let s = self
            .by_segment
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(address)
            .map(|r| r.iter().rev().cloned().collect())
            .unwrap_or_default();
        (t, s)
    }

    /// Keys held, per (tenant, segment) and per segment (for tests of the bound).
    pub fn len(&self) -> (usize, usize) {
        (
            self.by_tenant
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .len(),
            self.by_segment
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .len(),
        )
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == (0, 0)
    }
}

/// Query of `GET /v1/segments/{id}/why`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct WhyQuery {
    /// The tenant to explain for (default: the caller's). A tenant token may only
    /// name its own tenant (else 403 `tenant_mismatch`).
    pub tenant: Option<String>,
    /// A version the client used: an older one than the current is reported as
    /// superseded.
    pub version: Option<i64>,
}

/// The policy that decided an event, as the policy host reported it, with its
/// catalog name and version when it is a catalog policy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct PolicyRef {
    /// What the pool's policy called it (`native default`, `eviction policy #3`,
    /// `lru`, the spill tier's rule).
    pub name: String,
    /// Catalog id of the policy.
    pub policy_id: Option<i64>,
    /// Its catalog name.
    pub policy_name: Option<String>,
    /// Its version among policies of that name.
    pub policy_version: Option<i64>,
}

/// One event of an entry's history.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct WhyEvent {
    /// `inserted`, `spilled`, `restored`, `evicted`, `removed`, `damaged`
    /// (checksum failure), `not_admitted`, `no_room`.
    pub event: String,
    /// `gpu`, `host` (the primary tier) or `spill`.
    pub tier: String,
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// The deciding policy, for evictions and refusals.
    pub decided_by: Option<PolicyRef>,
}

/// One public-pool entry of the segment in the tenant's namespace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct WhyEntry {
    /// Body start: 0 for the segment used first in a request, the seam width for
    /// the segment used after another.
    pub body_start: usize,
    /// `first` or `after_another`.
    pub role: String,
    /// False when this role is never cached (too short for the seam window).
    pub cacheable: bool,
    /// The tier holding it (`gpu`, `host`, `spill`), `null` when not resident.
    pub tier: Option<String>,
    /// Payload bytes when resident.
    pub bytes: Option<usize>,
    /// Hits since it was stored, when resident.
    pub hits: Option<u64>,
    /// When it was stored (ms since the Unix epoch), when resident.
    pub inserted_ms: Option<u64>,
    /// Its last use (ms since the Unix epoch), when resident.
    pub last_use_ms: Option<u64>,
    /// Its remembered history, oldest first. For an entry in the shared namespace
    /// asked about with a tenant token, `hits`, the times and the history are left
    /// out (they tell when other tenants used it).
    pub events: Vec<WhyEvent>,
}

/// One reason a lookup of the segment by the tenant misses (or missed).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct WhyReason {
    /// `never_seen`, `evicted`, `invalidated`, `checksum_failure`, `not_admitted`,
    /// `no_room`, `too_short_for_seam` (data plane); `no_permission`,
    /// `superseded_version`, `deleted`, `evicted_on_request` (control plane).
    pub code: String,
    /// A sentence saying what happened.
    pub message: String,
    /// When (ms since the Unix epoch), when known.
    pub at_ms: Option<u64>,
    /// The entry it concerns, for entry reasons.
    pub body_start: Option<usize>,
    /// The deciding policy, for evictions and refusals.
    pub decided_by: Option<PolicyRef>,
}

/// Answer of `GET /v1/segments/{id}/why`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct WhyAnswer {
    /// `segment.why`.
    pub object: String,
    /// The segment as the request named it.
    pub segment: String,
    /// Its address (`null` when it is unknown).
    pub address: Option<String>,
    /// The tenant explained for.
    pub tenant: String,
    /// The served model.
    pub model: String,
    /// The current catalog version (for a deleted segment: `null`).
    pub version: Option<i64>,
    /// Its token count for the served model, when known.
    pub tokens: Option<usize>,
    /// Whether the tenant's entries live in the shared namespace.
    pub shared: Option<bool>,
    /// Whether any of its entries is resident in the tenant's namespace.
    pub resident: bool,
    /// Its entries per body start (empty when the tenant may not read it).
    pub entries: Vec<WhyEntry>,
    /// Why a lookup misses, newest first (those without a time last); empty when
    /// every cacheable entry is resident and nothing else applies.
    pub reasons: Vec<WhyReason>,
    /// The tenant's recent requests and the segment's recent events, newest first.
    pub recent: Vec<Observation>,
}

fn tier_name(primary: &'static str, t: Tier) -> String {
    match t {
        Tier::Primary => primary.into(),
        Tier::Spill => "spill".into(),
    }
}

/// Resolves catalog ids of deciders to their names and versions (one catalog read
/// per id and answer).
struct Policies<'a> {
    s: &'a AppState,
    seen: HashMap<i64, Option<(String, i64)>>,
}

impl Policies<'_> {
    async fn of(&mut self, d: &Decider) -> PolicyRef {
        let rec = match d.policy_id {
            Some(id) => {
                if !self.seen.contains_key(&id) {
                    let r = self.s.0.control.catalog().policy(id).await.ok();
                    self.seen.insert(id, r.map(|r| (r.name, r.version)));
                }
                self.seen.get(&id).cloned().flatten()
            }
            None => None,
        };
        PolicyRef {
            name: d.name.clone(),
            policy_id: d.policy_id,
            policy_name: rec.as_ref().map(|r| r.0.clone()),
            policy_version: rec.map(|r| r.1),
        }
    }
}

fn describe(p: &PolicyRef) -> String {
    match (&p.policy_name, p.policy_version) {
        (Some(n), Some(v)) => format!("{} ({n} v{v})", p.name),
        _ => p.name.clone(),
    }
}

/// The reason of one entry that is not resident.
fn entry_reason(e: &WhyEntry, tokens: usize) -> Option<WhyReason> {
    let r = |code: &str, message: String, last: Option<&WhyEvent>| WhyReason {
        code: code.into(),
        message,
        at_ms: last.map(|l| l.at_ms),
        body_start: Some(e.body_start),
        decided_by: last.and_then(|l| l.decided_by.clone()),
    };
    if !e.cacheable {
        return Some(r(
            "too_short_for_seam",
            format!(
                "the segment has {tokens} tokens, no more than the seam window of {}: used after another segment it is computed whole, never cached",
                e.body_start
            ),
            None,
        ));
    }
    if e.tier.is_some() {
        return None;
    }
    let last = e.events.last();
    let by = last
        .and_then(|l| l.decided_by.as_ref())
        .map(describe)
        .unwrap_or_else(|| "the pool".into());
    Some(match last.map(|l| l.event.as_str()) {
        Some("evicted") => r(
            "evicted",
            format!(
                "evicted for space from the {} tier by {by}",
                last.map_or("", |l| l.tier.as_str())
            ),
            last,
        ),
        Some("removed") => r(
            "invalidated",
            "removed on request: a segment update or deletion, an explicit eviction, a grant revocation or an invalidation".into(),
            last,
        ),
        Some("damaged") => r(
            "checksum_failure",
            "its spilled copy failed the checksum on restore and was dropped".into(),
            last,
        ),
        Some("not_admitted") => r(
            "not_admitted",
            format!("built, but the admission policy {by} refused it"),
            last,
        ),
        Some("no_room") => r(
            "no_room",
            format!("built, but no room could be made ({by}): larger than the pool, no victim named, or other tenants within their fair share"),
            last,
        ),
        _ => r(
            "never_seen",
            "no entry of this segment was built or offered in this namespace since the server started (or it was forgotten)".into(),
            None,
        ),
    })
}

async fn entry_of(pol: &mut Policies<'_>, rep: EntryReport, primary: &'static str) -> WhyEntry {
    let mut events = Vec::with_capacity(rep.events.len());
    for e in &rep.events {
        let decided_by = match &e.decided_by {
            Some(d) => Some(pol.of(d).await),
            None => None,
        };
        events.push(WhyEvent {
            event: e.kind.as_str().into(),
            tier: tier_name(primary, e.tier),
            at_ms: e.at_ms,
            decided_by,
        });
    }
    WhyEntry {
        body_start: rep.body_start,
        role: if rep.body_start == 0 {
            "first".into()
        } else {
            "after_another".into()
        },
        cacheable: rep.cacheable,
        tier: rep.tier.map(|t| tier_name(primary, t)),
        bytes: rep.meta.as_ref().map(|m| m.bytes),
        hits: rep.meta.as_ref().map(|m| m.hits),
        inserted_ms: rep.meta.as_ref().map(|m| m.inserted_ms),
        last_use_ms: rep.meta.as_ref().map(|m| m.last_use_ms),
        events,
    }
}

/// Reasons from the control plane's observations of the segment.
fn observed_reasons(seg_events: &[Observation], mine: &[Observation]) -> Vec<WhyReason> {
    let mut out = vec![];
    for o in seg_events.iter().chain(mine) {
        let (code, message) = match o.event.as_str() {
            "version_superseded" => (
                "superseded_version",
                format!(
                    "version {} was {}",
                    o.version.unwrap_or(0),
                    o.detail.clone().unwrap_or_default()
                ),
            ),
            "version_mismatch" => (
                "superseded_version",
                format!(
                    "a request named version {}, but {}",
                    o.version.unwrap_or(0),
                    o.detail.clone().unwrap_or_default()
                ),
            ),
            "evicted_on_request" => (
                "evicted_on_request",
                format!(
                    "evicted on request {}",
                    o.detail.clone().unwrap_or_default()
                ),
            ),
            _ => continue,
        };
        out.push(WhyReason {
            code: code.into(),
            message,
            at_ms: Some(o.at_ms),
            body_start: None,
            decided_by: None,
        });
    }
    out
}

fn sort_reasons(r: &mut [WhyReason]) {
    // Newest first; reasons without a time last, in their order.
    r.sort_by(|a, b| match (a.at_ms, b.at_ms) {
        (Some(x), Some(y)) => y.cmp(&x),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => std::cmp::Ordering::Equal,
    });
}

fn merged_recent(mine: Vec<Observation>, seg: Vec<Observation>) -> Vec<Observation> {
    let mut v: Vec<Observation> = mine.into_iter().chain(seg).collect();
    v.sort_by_key(|o| std::cmp::Reverse(o.at_ms));
    v
}

/// The subject tenant of a why query: the caller's own, or (operators only) the
/// one named. 403 `tenant_mismatch` when a tenant names another.
pub(crate) fn subject(caller: &Principal, q: &WhyQuery) -> Result<Principal, ApiError> {
    let Some(t) = q.tenant.as_deref().filter(|t| *t != caller.tenant) else {
        return Ok(caller.clone());
    };
    // The rule every tenant id follows (tokens and the catalog use it too).
    if let Err(e) = crate::catalog::validate_id("'tenant'", t) {
        return Err(ApiError::invalid_param("tenant", e.to_string()));
    }
    if !caller.is_operator() {
        return Err(ApiError::forbidden(
            "tenant_mismatch",
            format!(
                "a tenant token may only name its own tenant ({:?}), not {t:?}",
                caller.tenant
            ),
        )
        .with_param("tenant"));
    }
    Ok(Principal {
        sub: caller.sub.clone(),
        tenant: t.to_string(),
        role: Role::Tenant,
    })
}

fn answer(s: &AppState, id: &str, tenant: &str) -> WhyAnswer {
    WhyAnswer {
        object: "segment.why".into(),
        segment: id.into(),
        address: None,
        tenant: tenant.into(),
        model: s.0.model_id.clone(),
        version: None,
        tokens: None,
        shared: None,
        resident: false,
        entries: vec![],
        reasons: vec![],
        recent: vec![],
    }
}

/// `GET /v1/segments/{id}/why`: residency and miss reasons of a segment for a tenant.
#[utoipa::path(get, path = "/v1/segments/{id}/why", tag = "segments", summary = "Why did it miss? Residency and miss reasons of a segment for a tenant", operation_id = "segment_why", security(("bearer" = [])), params(("id" = String, Path, description = "the tenant's segment id, or a segment address"), WhyQuery), responses((status = 200, description = "residency per entry, the entries' history and the reasons, newest first", body = WhyAnswer), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "a tenant token named another tenant", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
pub async fn why(
    State(s): State<AppState>,
    Tenant(p): Tenant,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<WhyQuery>,
) -> Response {
    match why_inner(&s, &p, &id, &q).await {
        Ok(a) => Json(a).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn why_inner(
    s: &AppState,
    caller: &Principal,
    id: &str,
    q: &WhyQuery,
) -> Result<WhyAnswer, ApiError> {
    if crate::catalog::validate_ref("segment id", id).is_err() {
        return Err(ApiError {
            param: Some("id".into()),
            ..ApiError::openai_not_found("segment_not_found", format!("segment {id:?} not found"))
        });
    }
    let subj = subject(caller, q)?;
    let segs = s.0.control.segments();
    let mut out = answer(s, id, &subj.tenant);
    // The segment as the tenant may read it; else, for an operator, as it exists.
    let (seg, readable): (Segment, bool) = match segs.readable(&subj, id).await {
        Ok(seg) => (seg, true),
        Err(e) if e.status == StatusCode::NOT_FOUND => {
            let as_caller = if caller.is_operator() {
                segs.readable(caller, id).await.ok()
            } else {
                None
            };
            match as_caller {
                // The id is the operator's name for it (ids are per namespace); the
                // tenant reaches the same segment by its address when it is public,
                // its own or granted to it.
                Some(seg) => {
                    let by_address = segs.readable(&subj, &seg.address).await.is_ok();
                    (seg, by_address)
                }
                None => return deleted(s, caller, &subj, id, out, e).await,
            }
        }
        Err(e) => return Err(e),
    };
    out.address = Some(seg.address.clone());
    out.version = Some(seg.current_version);
    let (mine, seg_events) = s.0.why.observations(&subj.tenant, &seg.address);
    let mut reasons = observed_reasons(&seg_events, &mine);
    if let Some(v) = q.version {
        if v < 1 || v > seg.current_version {
            return Err(ApiError::invalid_param(
                "version",
                format!(
                    "segment {id:?} has versions 1 to {}, not {v}",
                    seg.current_version
                ),
            ));
        }
        if v < seg.current_version {
            let since = segs
                .catalog()
                .versions(&seg.address)
                .await
                .ok()
                .and_then(|vs| vs.into_iter().find(|x| x.version == v))
                .and_then(|x| x.superseded_at)
                .map(|t| t.max(0) as u64);
            reasons.push(WhyReason {
                code: "superseded_version".into(),
                message: format!(
                    "version {v} is superseded: the catalog is at version {}, and a request naming version {v} is refused (409 version_mismatch)",
                    seg.current_version
                ),
                at_ms: since,
                body_start: None,
                decided_by: None,
            });
        }
    }
    // The tenant's namespace: pinned in a snapshot (the permission check the
    // request path uses).
    let snap = if readable {
        match segs
            .catalog()
            .snapshot(&subj.tenant, std::slice::from_ref(&seg.address))
            .await
        {
            Ok(mut v) => v.pop(),
            Err(crate::catalog::CatalogError::NotFound(_)) => None,
            Err(e) => return Err(ApiError::from(e)),
        }
    } else {
        None
    };
    let Some(pin) = snap else {
        reasons.insert(
            0,
            WhyReason {
                code: "no_permission".into(),
                message: format!(
                    "tenant {:?} may not read segment {}: it is not public, not owned by the tenant, and not granted to it or to a group it is in",
                    subj.tenant, seg.address
                ),
                at_ms: None,
                body_start: None,
                decided_by: None,
            },
        );
        sort_reasons(&mut reasons);
        out.reasons = reasons;
        out.recent = merged_recent(mine, seg_events);
        return Ok(out);
    };
    let (tokens, _) = catalog_tokens(s, &pin.segment_id, pin.version, &pin.content_hash).await?;
    let (iso, shared) = segs.isolation_of(&subj.tenant, &pin, None);
    out.tokens = Some(tokens.len());
    out.shared = Some(shared);
    let primary = s.0.engine.primary_tier_name();
    let mut pol = Policies {
        s,
        seen: HashMap::new(),
    };
    for b in super::segments::body_starts(s) {
        let rep = s.0.engine.entry_report(&tokens, &iso, b);
        let mut e = entry_of(&mut pol, rep, primary).await;
        if shared && !caller.is_operator() {
            // Shared entries are used by other tenants too: a tenant sees their
            // residency (as `GET /v1/segments/{id}` shows it), not when others
            // used them.
            e.hits = None;
            e.inserted_ms = None;
            e.last_use_ms = None;
            e.events.clear();
        }
        if let Some(r) = entry_reason(&e, tokens.len()) {
            reasons.push(r);
        }
        out.entries.push(e);
    }
    out.resident = out.entries.iter().any(|e| e.tier.is_some());
    sort_reasons(&mut reasons);
    out.reasons = reasons;
    out.recent = merged_recent(mine, seg_events);
    Ok(out)
}

/// The answer for a segment the tenant cannot find: `deleted` when a deleted
/// segment matches and the caller may know of it (an operator; the owner; anyone
/// for a public one), else the 404 `not_found`.
async fn deleted(
    s: &AppState,
    caller: &Principal,
    subj: &Principal,
    id: &str,
    mut out: WhyAnswer,
    not_found: ApiError,
) -> Result<WhyAnswer, ApiError> {
    let d =
        s.0.control
            .catalog()
            .deleted_segment(&subj.tenant, id)
            .await
            .map_err(ApiError::from)?;
    match d {
        Some(d) if caller.is_operator() || d.owner_tenant == subj.tenant || d.public => {
            out.address = Some(d.address.clone());
            let (mine, seg_events) = s.0.why.observations(&subj.tenant, &d.address);
            out.reasons = vec![WhyReason {
                code: "deleted".into(),
                message: format!(
                    "segment {} was deleted; its cache entries were evicted",
                    d.address
                ),
                at_ms: Some(d.deleted_at.max(0) as u64),
                body_start: None,
                decided_by: None,
            }];
            out.recent = merged_recent(mine, seg_events);
            Ok(out)
        }
        _ => {
            let mut e = not_found;
            e.code = "segment_not_found";
            e.param = Some("id".into());
            Err(e)
        }
    }
}

/// `POST /v1/segments/{id}/evict`: drops the segment's cache entries (every
/// version this server built, in every namespace) and remembers it as a reason.
#[utoipa::path(post, path = "/v1/segments/{id}/evict", tag = "segments", summary = "Evict a segment's cache entries (owner or operator)", operation_id = "evict_segment", security(("bearer" = [])), params(("id" = String, Path, description = "the caller's segment id, or a segment address")), responses((status = 200, body = Evicted), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "not the owner tenant or an operator", body = crate::error::ErrorBody), (status = 404, description = "no such segment, or not readable by the caller", body = crate::error::ErrorBody)))]
pub async fn evict(
    State(s): State<AppState>,
    Tenant(p): Tenant,
    ApiPath(id): ApiPath<String>,
) -> Response {
    if crate::catalog::validate_ref("segment id", &id).is_err() {
        return ApiError {
            param: Some("id".into()),
            ..ApiError::openai_not_found("segment_not_found", format!("segment {id:?} not found"))
        }
        .into_response();
    }
    let seg = match s.0.control.segments().owned(&p, &id).await {
        Ok(seg) => seg,
        Err(e) => return e.into_response(),
    };
    let n = super::segments::evict_entries(&s, &seg.address);
    s.0.why
        .record_evicted(&seg.address, seg.current_version, &p.sub, n);
    let _ =
        s.0.control
            .catalog()
            .audit(
                &p.sub,
                Some(&p.tenant),
                "segment.evict",
                &seg.address,
                &serde_json::json!({"evicted_entries": n}),
            )
            .await;
    Json(Evicted {
        address: seg.address,
        version: seg.current_version,
        evicted_entries: n,
    })
    .into_response()
}

/// Answer of `POST /v1/segments/{id}/evict`.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct Evicted {
    /// The segment's address.
    pub address: String,
    /// Its current version.
    pub version: i64,
    /// Public-pool entries removed (every known version, every namespace).
    pub evicted_entries: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(i: u64) -> Observation {
        Observation {
            at_ms: i,
            event: "request".into(),
            version: Some(1),
            outcome: Some("hit".into()),
            miss_reason: None,
            index: Some(0),
            detail: None,
        }
    }

    #[test]
    fn the_log_is_bounded_per_key_and_in_keys() {
        let log = WhyLog::default();
        for i in 0..(3 * WHY_PER_KEY) as u64 {
            log.record("t", "~a", obs(i));
        }
        let (mine, seg) = log.observations("t", "~a");
        assert_eq!(mine.len(), WHY_PER_KEY);
        assert!(seg.is_empty());
        // Newest first.
        assert_eq!(mine[0].at_ms, (3 * WHY_PER_KEY - 1) as u64);
        for i in 0..(WHY_MAX_KEYS + 10) {
            log.record(&format!("t{i}"), "~a", obs(0));
            log.record_segment(&format!("~s{i}"), obs(0));
        }
        let (a, b) = log.len();
        assert!(a <= WHY_MAX_KEYS && b <= WHY_MAX_KEYS, "{a} {b}");
        assert!(
            log.observations("t", "~a").0.is_empty(),
            "oldest key forgotten"
        );
    }

    #[test]
    fn reasons_sort_newest_first_untimed_last() {
        let r = |c: &str, at: Option<u64>| WhyReason {
            code: c.into(),
            message: String::new(),
            at_ms: at,
            body_start: None,
            decided_by: None,
        };
        let mut v = vec![r("a", None), r("b", Some(1)), r("c", Some(5)), r("d", None)];
        sort_reasons(&mut v);
        let codes: Vec<&str> = v.iter().map(|x| x.code.as_str()).collect();
        assert_eq!(codes, ["c", "b", "a", "d"]);
    }

    #[test]
    fn a_tenant_may_not_ask_for_another() {
        let t = Principal {
            sub: "u".into(),
            tenant: "acme".into(),
            role: Role::Tenant,
        };
        let q = |x: Option<&str>| WhyQuery {
            tenant: x.map(String::from),
            version: None,
        };
        assert_eq!(subject(&t, &q(None)).unwrap().tenant, "acme");
        assert_eq!(subject(&t, &q(Some("acme"))).unwrap().tenant, "acme");
        let e = subject(&t, &q(Some("globex"))).unwrap_err();
        assert_eq!((e.status.as_u16(), e.code), (403, "tenant_mismatch"));
        let op = Principal {
            role: Role::Operator,
            ..t
        };
        let s = subject(&op, &q(Some("globex"))).unwrap();
        assert_eq!((s.tenant.as_str(), s.role), ("globex", Role::Tenant));
    }
}
