//! The segment service: the catalog operations on segments (create, list, read,
//! new version, delete, versions, grants to tenants and groups, snapshots) with
//! their authorization, done once from an already-verified [`Principal`].
//!
//! Both HTTP front ends call it: the control plane's routes
//! ([`crate::api::control_router`]) and the serving routes of `hypic serve`
//! ([`crate::serve`]), which add token counts, prefill and residency around the
//! same calls. Neither re-enters the other's router, so a token is verified once
//! per request (by the route's extractor) and the rules below hold identically
//! on both.
//!
//! Rules:
//! * A tenant reads a live segment it owns, a public one, one granted to it or to
//!   a group it belongs to; operators read every segment. Any other reference is
//!   the same 404 as a segment that does not exist, so the ids of other tenants
//!   cannot be probed.
//! * Only the owner tenant or an operator modifies a segment (new version,
//!   delete, grants): 403 `not_owner` for another reader.
//! * Answers show a segment as the caller may see it ([`Segment::view_for`]).
//!
//! Every error is an [`ApiError`].

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::auth::{IsolationKeyer, Principal};
use crate::catalog::{
    now_ms, Catalog, CatalogError, NewSegment, Segment, SegmentVersion, SnapshotEntry,
};
use crate::error::ApiError;
use crate::policy::{opaque_id, EntryInfo, IsolationInfo, PolicyRuntime};

/// Catalog operations on segments, authorized from a verified principal.
/// Cheap to clone (the catalog is a pool handle, the runtime shared).
#[derive(Clone)]
pub struct SegmentService {
    catalog: Catalog,
    keyer: IsolationKeyer,
    policies: Arc<PolicyRuntime>,
}

/// A created segment (or the answer recorded for an earlier create with the same
/// idempotency key).
#[derive(Debug, Clone)]
pub struct Created {
    /// The segment as the caller sees it.
    pub segment: Segment,
    /// True when the answer is the record of an earlier request with the same
    /// idempotency key (nothing was created now).
    pub replayed: bool,
}

/// One segment of a listing page.
#[derive(Debug, Clone)]
pub struct Listed {
    /// The segment as the caller sees it.
    pub view: Segment,
    /// Its current version, pinned as a snapshot would pin it (owner included,
    /// for the isolation key; not for display).
    pub pin: SnapshotEntry,
}

/// One page of segments.
#[derive(Debug, Clone)]
pub struct ListPage {
    /// The segments of this page, by address order.
    pub items: Vec<Listed>,
    /// Cursor of the next page (`after`), `None` on the last page.
    pub next: Option<String>,
}

/// Answer of `PUT /v1/segments/{id}`.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct UpdateResult {
    /// The segment after the update, as the caller sees it.
    pub segment: Segment,
    /// Cache-residency rows of superseded versions dropped by the
    /// invalidation policy.
    pub invalidated_entries: u64,
}

/// A deleted segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deleted {
    /// Its address.
    pub address: String,
    /// Cache-residency rows dropped with it.
    pub invalidated_entries: u64,
}

/// One pinned segment of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SnapshotItem {
    /// Segment id as the request gave it (an own id or an address).
    pub segment_id: String,
    /// The segment's global address.
    pub address: String,
    /// Pinned version.
    pub version: i64,
    /// Content hash of the pinned version.
    pub content_hash: String,
    /// Isolation key (namespace) derived server-side.
    pub isolation_key: String,
    /// Cache key of this version in that namespace.
    pub cache_key: String,
    /// True when the shared namespace is used.
    pub shared: bool,
    /// Workers holding the entry (a hit when non-empty).
    pub resident_on: Vec<String>,
}

/// Answer of `POST /v1/snapshot`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SnapshotResponse {
    /// Tenant from the token.
    pub tenant: String,
    /// One item per requested segment, same order.
    pub segments: Vec<SnapshotItem>,
}

/// A client salt is at most this many bytes.
pub const MAX_SALT_BYTES: usize = 256;

impl SegmentService {
    /// The service over `catalog`, deriving keys with `keyer` and asking the
    /// isolation and invalidation hooks of `policies`.
    pub fn new(
        catalog: Catalog,
        keyer: IsolationKeyer,
        policies: Arc<PolicyRuntime>,
    ) -> SegmentService {
        SegmentService {
            catalog,
            keyer,
            policies,
        }
    }

    /// The catalog.
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    /// The isolation keyer.
    pub fn keyer(&self) -> &IsolationKeyer {
        &self.keyer
    }

    /// The live policies.
    pub fn policies(&self) -> &Arc<PolicyRuntime> {
        &self.policies
    }

    /// The live segment `p` addresses as `reference` (an own id or an address)
    /// and may read (see the module rules); 404 otherwise.
    pub async fn readable(&self, p: &Principal, reference: &str) -> Result<Segment, ApiError> {
        let nf = || ApiError::not_found(format!("segment {reference:?} not found"));
        if crate::catalog::validate_ref("segment id", reference).is_err() {
            return Err(nf());
        }
        let seg = match self.catalog.find_segment(&p.tenant, reference).await {
            Ok(seg) => seg,
            Err(CatalogError::NotFound(_)) => return Err(nf()),
            Err(e) => return Err(e.into()),
        };
        if p.is_operator() || self.catalog.can_read(&p.tenant, &seg.address).await? {
            Ok(seg)
        } else {
            Err(nf())
        }
    }

    /// The segment `p` addresses as `reference`, when `p` may modify it (its
    /// owner tenant or an operator): 404 when it may not read it, 403
    /// `not_owner` when it may only read it.
    pub async fn owned(&self, p: &Principal, reference: &str) -> Result<Segment, ApiError> {
        let seg = self.readable(p, reference).await?;
        if p.is_operator() || seg.owner_tenant.as_deref() == Some(p.tenant.as_str()) {
            return Ok(seg);
        }
        Err(ApiError::forbidden(
            "not_owner",
            format!("only the owner tenant or an operator may modify segment {reference:?}"),
        ))
    }

    /// Creates a segment owned by `p`'s tenant (version 1, public as `new`
    /// says). With an idempotency key, a repeat of the same request answers the
    /// recorded segment (`replayed`), a different request under the same key is
    /// a 422.
    pub async fn create(
        &self,
        p: &Principal,
        new: &NewSegment,
        idempotency_key: Option<&str>,
    ) -> Result<Created, ApiError> {
        let c = self
            .catalog
            .create_segment_idempotent(&p.tenant, &p.sub, new, idempotency_key)
            .await?;
        Ok(Created {
            segment: c.segment.view_for(&p.tenant, p.is_operator()),
            replayed: c.replayed,
        })
    }

    /// One page (at most `limit`, after the cursor `after`) of the segments `p`
    /// may read (an operator: all), in one catalog query.
    pub async fn list(
        &self,
        p: &Principal,
        after: Option<&str>,
        limit: usize,
    ) -> Result<ListPage, ApiError> {
        let page = self
            .catalog
            .list_segments(&p.tenant, p.is_operator(), after, limit)
            .await?;
        Ok(ListPage {
            items: page
                .items
                .into_iter()
                .map(|seg| Listed {
                    pin: SnapshotEntry {
                        segment_id: seg.address.clone(),
                        version: seg.current_version,
                        content_hash: seg.content_hash.clone(),
                        owner_tenant: seg.owner_tenant.clone().unwrap_or_default(),
                        public: seg.public,
                    },
                    view: seg.view_for(&p.tenant, p.is_operator()),
                })
                .collect(),
            next: page.next,
        })
    }

    /// The segment `p` addresses as `reference`, as `p` sees it (404 when it may
    /// not read it).
    pub async fn get(&self, p: &Principal, reference: &str) -> Result<Segment, ApiError> {
        let seg = self.readable(p, reference).await?;
        Ok(seg.view_for(&p.tenant, p.is_operator()))
    }

    /// Adds a version with `content` (and its token counts per model) to the
    /// segment `p` owns as `reference`; the invalidation hook then decides which
    /// residency rows of superseded versions are dropped.
    pub async fn update(
        &self,
        p: &Principal,
        reference: &str,
        content: &str,
        tokens: &BTreeMap<String, i64>,
    ) -> Result<UpdateResult, ApiError> {
        let old = self.owned(p, reference).await?;
        let seg = self
            .catalog
            .update_segment(&old.address, &p.sub, content, tokens)
            .await?;
        let invalidated = self.invalidate_superseded(&seg).await?;
        Ok(UpdateResult {
            segment: seg.view_for(&p.tenant, p.is_operator()),
            invalidated_entries: invalidated,
        })
    }

    /// Runs the invalidation hook over the residency rows of superseded versions
    /// of `seg` and drops those it rejects; answers how many it dropped.
    async fn invalidate_superseded(&self, seg: &Segment) -> Result<u64, ApiError> {
        let rows = self.catalog.residency_of_segment(&seg.address).await?;
        let now = now_ms() as u64;
        let mut dropped = 0;
        for r in rows.iter().filter(|r| r.version < seg.current_version) {
            let info = EntryInfo {
                id: opaque_id(&r.cache_key),
                tenant: r.tenant.as_deref().map(opaque_id).unwrap_or(0),
                bytes: r.bytes.max(0) as u64,
                recompute_tokens: seg.tokens.values().copied().max().unwrap_or(0).max(0) as u64,
                last_use_ms: r.last_use.max(0) as u64,
                inserted_ms: r.last_use.max(0) as u64,
                hits: 0,
                shared: r.tenant.is_none(),
                superseded: true,
            };
            if self.policies.invalidate(&info, now) {
                self.catalog.drop_residency(&r.worker, &r.cache_key).await?;
                dropped += 1;
            }
        }
        Ok(dropped)
    }

    /// Deletes the segment `p` owns as `reference` and every residency row of it.
    pub async fn delete(&self, p: &Principal, reference: &str) -> Result<Deleted, ApiError> {
        let seg = self.owned(p, reference).await?;
        self.catalog.delete_segment(&seg.address, &p.sub).await?;
        let dropped = self.catalog.drop_all_residency(&seg.address).await?;
        Ok(Deleted {
            address: seg.address,
            invalidated_entries: dropped,
        })
    }

    /// Every version of the segment `p` reads as `reference`, oldest first.
    pub async fn versions(
        &self,
        p: &Principal,
        reference: &str,
    ) -> Result<Vec<SegmentVersion>, ApiError> {
        let seg = self.readable(p, reference).await?;
        Ok(self.catalog.versions(&seg.address).await?)
    }

    /// The content of version `version` of the segment `p` reads as `reference`
    /// (any version, superseded ones included, so an operator can compare them).
    /// Errors: 404 when the segment is not readable by `p` or has no such version.
    pub async fn version_content(
        &self,
        p: &Principal,
        reference: &str,
        version: i64,
    ) -> Result<VersionContent, ApiError> {
        let seg = self.readable(p, reference).await?;
        let content = self
            .catalog
            .version_content(&seg.address, version)
            .await?
            .unwrap_or_default();
        Ok(VersionContent {
            segment_id: seg.address,
            version,
            content,
        })
    }

    /// Tenants granted read access to the segment `p` owns as `reference`.
    pub async fn grants(&self, p: &Principal, reference: &str) -> Result<Vec<String>, ApiError> {
        let seg = self.owned(p, reference).await?;
        Ok(self.catalog.grants(&seg.address).await?)
    }

    /// Grants `tenant` read access to the segment `p` owns as `reference`.
    pub async fn grant(
        &self,
        p: &Principal,
        reference: &str,
        tenant: &str,
    ) -> Result<(), ApiError> {
        let seg = self.owned(p, reference).await?;
        Ok(self.catalog.grant(&seg.address, tenant, &p.sub).await?)
    }

    /// Revokes the grant of `tenant` on the segment `p` owns as `reference`.
    pub async fn revoke(
        &self,
        p: &Principal,
        reference: &str,
        tenant: &str,
    ) -> Result<(), ApiError> {
        let seg = self.owned(p, reference).await?;
        Ok(self.catalog.revoke(&seg.address, tenant, &p.sub).await?)
    }

    /// Groups granted read access to the segment `p` owns as `reference`.
    pub async fn group_grants(
        &self,
        p: &Principal,
        reference: &str,
    ) -> Result<Vec<String>, ApiError> {
        let seg = self.owned(p, reference).await?;
        Ok(self.catalog.group_grants(&seg.address).await?)
    }

    /// Grants the members of `group` read access to the segment `p` owns as
    /// `reference`.
    pub async fn grant_group(
        &self,
        p: &Principal,
        reference: &str,
        group: &str,
    ) -> Result<(), ApiError> {
        let seg = self.owned(p, reference).await?;
        Ok(self
            .catalog
            .grant_group(&seg.address, group, &p.sub)
            .await?)
    }

    /// Revokes the grant of `group` on the segment `p` owns as `reference`.
    pub async fn revoke_group(
        &self,
        p: &Principal,
        reference: &str,
        group: &str,
    ) -> Result<(), ApiError> {
        let seg = self.owned(p, reference).await?;
        Ok(self
            .catalog
            .revoke_group(&seg.address, group, &p.sub)
            .await?)
    }

    /// The isolation key of the pinned segment `e` for `tenant` (narrowed by the
    /// client `salt`) and whether it is the shared namespace: the segment is
    /// public and the isolation policy allows sharing it.
    pub fn isolation_of(
        &self,
        tenant: &str,
        e: &SnapshotEntry,
        salt: Option<&str>,
    ) -> (String, bool) {
        let allowed = self.policies.isolation(&IsolationInfo {
            segment: opaque_id(&e.segment_id),
            tenant: opaque_id(tenant),
            public: e.public,
            owner: e.owner_tenant == tenant,
        });
        let shared = allowed && e.public;
        (self.keyer.isolation_key(tenant, e, shared, salt), shared)
    }

    /// Pins the current version of each segment in `ids` (`tenant`'s own ids or
    /// addresses, all readable by it, else the catalog's 404) in one snapshot and
    /// derives their isolation and cache keys and residency. 400 for a salt over
    /// [`MAX_SALT_BYTES`].
    pub async fn snapshot(
        &self,
        tenant: &str,
        ids: &[String],
        salt: Option<&str>,
    ) -> Result<SnapshotResponse, ApiError> {
        if salt.is_some_and(|s| s.len() > MAX_SALT_BYTES) {
            return Err(ApiError::bad_request(format!(
                "salt must be at most {MAX_SALT_BYTES} bytes"
            ))
            .with_param("salt"));
        }
        let entries: Vec<SnapshotEntry> = self.catalog.snapshot(tenant, ids).await?;
        let mut out = Vec::with_capacity(entries.len());
        for (reference, e) in ids.iter().zip(entries) {
            let (isolation_key, shared) = self.isolation_of(tenant, &e, salt);
            let cache_key = self.keyer.cache_key(&isolation_key, &e);
            let resident_on = self
                .catalog
                .residency_of(&cache_key)
                .await?
                .into_iter()
                .map(|r| r.worker)
                .collect();
            out.push(SnapshotItem {
                segment_id: reference.clone(),
                address: e.segment_id,
                version: e.version,
                content_hash: e.content_hash,
                isolation_key,
                cache_key,
                shared,
                resident_on,
            });
        }
        Ok(SnapshotResponse {
            tenant: tenant.to_string(),
            segments: out,
        })
    }
}

/// Body of `GET /v1/segments/{id}/versions/{version}`: one version's text.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct VersionContent {
    /// Segment address.
    pub segment_id: String,
    /// Version number.
    pub version: i64,
    /// The version's content, as registered.
    pub content: String,
}
