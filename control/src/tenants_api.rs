//! Tenant routes: every tenant with its principals, groups, grants and usage
//! (`GET /v1/admin/tenants`, operator), and one tenant's own view
//! (`GET /v1/tenants/{tenant}/usage`, that tenant or an operator).
//!
//! Catalog figures (principals, groups, segments owned, grants received) come
//! from the catalog; serving figures (requests, tokens) from the
//! [`crate::usage::UsageBook`] the serving routes fill, which starts from the
//! totals stored in the catalog ([`crate::persist`]; `hypic control`, which
//! serves no completions, shows the stored totals).

use std::collections::BTreeMap;

use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};
use sqlx::Row;

use crate::api::{ApiError, ApiPath, ApiResult, Caller, ControlState, Operator};
use crate::catalog::{Catalog, CatalogError};
use crate::usage::ServingUsage;

/// A token subject recorded for a tenant (seen on an authenticated request).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TenantPrincipal {
    /// Token subject.
    pub sub: String,
    /// `tenant` or `operator`.
    pub role: String,
}

/// Catalog figures of one tenant.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CatalogUsage {
    /// Live segments the tenant owns.
    pub segments: u64,
    /// Content bytes of their current versions.
    pub segment_bytes: u64,
    /// Live segments of other tenants granted to it directly.
    pub granted_segments: u64,
    /// Live segments granted to a group it belongs to.
    pub group_granted_segments: u64,
}

/// One tenant: who signs in as it, its groups, its catalog and serving usage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TenantView {
    /// Tenant id.
    pub tenant: String,
    /// Token subjects seen for it, by subject.
    pub principals: Vec<TenantPrincipal>,
    /// Groups it is a member of, sorted.
    pub groups: Vec<String>,
    /// Segments and grants.
    pub catalog: CatalogUsage,
    /// Requests and tokens, kept across restarts in the catalog.
    pub serving: ServingUsage,
}

fn db(e: sqlx::Error) -> ApiError {
    ApiError::from(CatalogError::Db(e))
}

/// Catalog figures of every tenant (`only`: of that tenant alone).
async fn catalog_views(c: &Catalog, only: Option<&str>) -> Result<Vec<TenantView>, ApiError> {
    let pool = c.pool();
    let f = only.unwrap_or("");
    let all = only.is_none() as i64;
    let mut out: BTreeMap<String, TenantView> = BTreeMap::new();
    let rows = sqlx::query("SELECT id FROM tenants WHERE $1 = 1 OR id = $2 ORDER BY id")
        .bind(all)
        .bind(f)
        .fetch_all(pool)
        .await
        .map_err(db)?;
    for r in rows {
        let t: String = r.get(0);
        out.insert(
            t.clone(),
            TenantView {
                tenant: t,
                principals: vec![],
                groups: vec![],
                catalog: CatalogUsage::default(),
                serving: ServingUsage::default(),
            },
        );
    }
    let rows = sqlx::query(
        "SELECT tenant_id, sub, role FROM principals WHERE $1 = 1 OR tenant_id = $2 ORDER BY tenant_id, sub",
    )
    .bind(all)
    .bind(f)
    .fetch_all(pool)
    .await
    .map_err(db)?;
    for r in rows {
        if let Some(v) = out.get_mut(&r.get::<String, _>(0)) {
            v.principals.push(TenantPrincipal {
                sub: r.get(1),
                role: r.get(2),
            });
        }
    }
    let rows = sqlx::query(
        "SELECT tenant_id, group_id FROM group_members WHERE $1 = 1 OR tenant_id = $2 ORDER BY tenant_id, group_id",
    )
    .bind(all)
    .bind(f)
    .fetch_all(pool)
    .await
    .map_err(db)?;
    for r in rows {
        if let Some(v) = out.get_mut(&r.get::<String, _>(0)) {
            v.groups.push(r.get(1));
        }
    }
    let owned = sqlx::query(
        "SELECT s.owner_tenant, COUNT(*), CAST(COALESCE(SUM(v.byte_len), 0) AS BIGINT) \
         FROM segments s JOIN segment_versions v ON v.segment_id = s.id AND v.version = s.current_version \
         WHERE s.deleted_at IS NULL AND ($1 = 1 OR s.owner_tenant = $2) GROUP BY s.owner_tenant",
    )
    .bind(all)
    .bind(f)
    .fetch_all(pool)
    .await
    .map_err(db)?;
    for r in owned {
        if let Some(v) = out.get_mut(&r.get::<String, _>(0)) {
            v.catalog.segments = r.get::<i64, _>(1).max(0) as u64;
            v.catalog.segment_bytes = r.get::<i64, _>(2).max(0) as u64;
        }
    }
    let direct = sqlx::query(
        "SELECT g.tenant_id, COUNT(*) FROM grants g JOIN segments s ON s.id = g.segment_id \
         WHERE s.deleted_at IS NULL AND ($1 = 1 OR g.tenant_id = $2) GROUP BY g.tenant_id",
    )
    .bind(all)
    .bind(f)
    .fetch_all(pool)
    .await
    .map_err(db)?;
    for r in direct {
        if let Some(v) = out.get_mut(&r.get::<String, _>(0)) {
            v.catalog.granted_segments = r.get::<i64, _>(1).max(0) as u64;
        }
    }
    let via_groups = sqlx::query(
        "SELECT m.tenant_id, COUNT(DISTINCT gg.segment_id) FROM group_members m \
         JOIN group_grants gg ON gg.group_id = m.group_id JOIN segments s ON s.id = gg.segment_id \
         WHERE s.deleted_at IS NULL AND ($1 = 1 OR m.tenant_id = $2) GROUP BY m.tenant_id",
    )
    .bind(all)
    .bind(f)
    .fetch_all(pool)
    .await
    .map_err(db)?;
    for r in via_groups {
        if let Some(v) = out.get_mut(&r.get::<String, _>(0)) {
            v.catalog.group_granted_segments = r.get::<i64, _>(1).max(0) as u64;
        }
    }
    Ok(out.into_values().collect())
}

#[utoipa::path(get, path = "/v1/admin/tenants", tag = "tenants", summary = "Every tenant: principals, groups, segments, grants, serving usage (operator)", security(("bearer" = [])), responses((status = 200, body = Vec<TenantView>), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody)))]
pub async fn list_tenants(
    State(s): State<ControlState>,
    Operator(_): Operator,
) -> ApiResult<Vec<TenantView>> {
    let mut views = catalog_views(s.catalog(), None).await?;
    for v in &mut views {
        v.serving = s.usage().of(&v.tenant);
    }
    Ok(Json(views))
}

#[utoipa::path(get, path = "/v1/tenants/{tenant}/usage", tag = "tenants", summary = "One tenant's principals, groups, segments, grants and serving usage (the tenant itself or an operator)", security(("bearer" = [])), params(("tenant" = String, Path, description = "tenant id")), responses((status = 200, body = TenantView), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "another tenant's usage (tenant tokens see their own only)", body = crate::error::ErrorBody), (status = 404, description = "no such tenant", body = crate::error::ErrorBody)))]
pub async fn tenant_usage(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(tenant): ApiPath<String>,
) -> ApiResult<TenantView> {
    if !p.is_operator() && p.tenant != tenant {
        return Err(ApiError::forbidden(
            "other_tenant",
            "a tenant token may read its own usage only",
        ));
    }
    let mut v = catalog_views(s.catalog(), Some(&tenant))
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| ApiError::not_found(format!("no tenant {tenant:?}")))?;
    v.serving = s.usage().of(&v.tenant);
    Ok(Json(v))
}
