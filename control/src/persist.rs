//! What a restart must not lose, kept in the catalog: the serving usage per
//! tenant ([`crate::usage::UsageBook`]) and the running shadow policies with
//! their counts (table `policy_shadows`). Both live in memory while the server
//! runs; [`ControlState::spawn_persister`] writes them every [`PERSIST_EVERY`], the server
//! writes them once more when it stops ([`flush`]), and [`restore`] reads them
//! back at start (the usage totals, and every shadow that was still running,
//! resumed with its counts).
//!
//! Usage is written as the increments since the last write, added to the
//! stored row, so servers sharing one catalog sum up; a server shows the
//! stored totals it read at start plus what it counted since. A crash loses at
//! most the last [`PERSIST_EVERY`] of counts.

use std::time::Duration;

use sqlx::Row;

use crate::api::ControlState;
use crate::catalog::{now_ms, CatalogError};
use crate::policy::{DecisionCounts, PolicyKind, ShadowView};
use crate::usage::ServingUsage;

/// How often the usage increments and the shadow counts are written.
pub const PERSIST_EVERY: Duration = Duration::from_secs(5);

fn db(e: sqlx::Error) -> CatalogError {
    CatalogError::Db(e)
}

fn count(v: u64) -> i64 {
    v.min(i64::MAX as u64) as i64
}

/// Adds the usage counted since the last write to the catalog's rows (one
/// transaction). On failure the increments are kept for the next write.
pub async fn flush_usage(state: &ControlState) -> Result<usize, CatalogError> {
    let pending = state.usage().take_pending();
    if pending.is_empty() {
        return Ok(0);
    }
    let r = async {
        let mut tx = state.catalog().pool().begin().await.map_err(db)?;
        for (tenant, u) in &pending {
            sqlx::query(
                "INSERT INTO tenant_usage (tenant, requests, prompt_tokens, cached_tokens, \
                 completion_tokens, segment_hits, segment_misses, last_request_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (tenant) DO UPDATE SET \
                 requests = tenant_usage.requests + excluded.requests, \
                 prompt_tokens = tenant_usage.prompt_tokens + excluded.prompt_tokens, \
                 cached_tokens = tenant_usage.cached_tokens + excluded.cached_tokens, \
                 completion_tokens = tenant_usage.completion_tokens + excluded.completion_tokens, \
                 segment_hits = tenant_usage.segment_hits + excluded.segment_hits, \
                 segment_misses = tenant_usage.segment_misses + excluded.segment_misses, \
                 last_request_at = CASE \
                   WHEN excluded.last_request_at IS NULL THEN tenant_usage.last_request_at \
                   WHEN tenant_usage.last_request_at IS NULL \
                     OR excluded.last_request_at > tenant_usage.last_request_at \
                   THEN excluded.last_request_at ELSE tenant_usage.last_request_at END",
            )
            .bind(tenant.as_str())
            .bind(count(u.requests))
            .bind(count(u.prompt_tokens))
            .bind(count(u.cached_tokens))
            .bind(count(u.completion_tokens))
            .bind(count(u.segment_hits))
            .bind(count(u.segment_misses))
            .bind(u.last_request_at)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        }
        tx.commit().await.map_err(db)
    }
    .await;
    match r {
        Ok(()) => Ok(pending.len()),
        Err(e) => {
            state.usage().restore_pending(pending);
            Err(e)
        }
    }
}

/// The stored usage of every tenant.
pub async fn load_usage(state: &ControlState) -> Result<Vec<(String, ServingUsage)>, CatalogError> {
    let rows = sqlx::query(
        "SELECT tenant, requests, prompt_tokens, cached_tokens, completion_tokens, segment_hits, \
         segment_misses, last_request_at FROM tenant_usage ORDER BY tenant",
    )
    .fetch_all(state.catalog().pool())
    .await
    .map_err(db)?;
    let n = |r: &sqlx::any::AnyRow, i: usize| r.get::<i64, _>(i).max(0) as u64;
    Ok(rows
        .iter()
        .map(|r| {
            (
                r.get::<String, _>(0),
                ServingUsage {
                    requests: n(r, 1),
                    prompt_tokens: n(r, 2),
                    cached_tokens: n(r, 3),
                    completion_tokens: n(r, 4),
                    segment_hits: n(r, 5),
                    segment_misses: n(r, 6),
                    last_request_at: r.get::<Option<i64>, _>(7),
                },
            )
        })
        .collect())
}

fn json_text<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "{}".into())
}

/// Records a shadow that has just started (replacing the kind's earlier row),
/// so that a restart resumes it.
pub async fn shadow_started(state: &ControlState, v: &ShadowView) -> Result<(), CatalogError> {
    sqlx::query(
        "INSERT INTO policy_shadows (kind, policy_id, params, started_at, started_by, candidate, \
         active, agreed, disagreed, updated_at, stopped_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, NULL) ON CONFLICT (kind) DO UPDATE SET \
         policy_id = excluded.policy_id, params = excluded.params, \
         started_at = excluded.started_at, started_by = excluded.started_by, \
         candidate = excluded.candidate, active = excluded.active, agreed = excluded.agreed, \
         disagreed = excluded.disagreed, updated_at = excluded.updated_at, stopped_at = NULL",
    )
    .bind(v.kind.as_str())
    .bind(v.policy_id)
    .bind(json_text(&v.params))
    .bind(v.started_at)
    .bind(v.started_by.as_str())
    .bind(json_text(&v.candidate))
    .bind(json_text(&v.active))
    .bind(count(v.agreed))
    .bind(count(v.disagreed))
    .bind(now_ms())
    .execute(state.catalog().pool())
    .await
    .map_err(db)?;
    Ok(())
}

/// Writes the counts of the shadow run `v` (the row of the same kind, policy
/// and start that is still running); with `stopped`, marks it stopped, so a
/// restart does not resume it.
pub async fn shadow_counts(
    state: &ControlState,
    v: &ShadowView,
    stopped: bool,
) -> Result<(), CatalogError> {
    let now = now_ms();
    sqlx::query(
        "UPDATE policy_shadows SET candidate = $1, active = $2, agreed = $3, disagreed = $4, \
         updated_at = $5, stopped_at = CASE WHEN $6 = 1 THEN $5 ELSE NULL END \
         WHERE kind = $7 AND policy_id = $8 AND started_at = $9 AND stopped_at IS NULL",
    )
    .bind(json_text(&v.candidate))
    .bind(json_text(&v.active))
    .bind(count(v.agreed))
    .bind(count(v.disagreed))
    .bind(now)
    .bind(stopped as i64)
    .bind(v.kind.as_str())
    .bind(v.policy_id)
    .bind(v.started_at)
    .execute(state.catalog().pool())
    .await
    .map_err(db)?;
    Ok(())
}

/// Writes the counts of every running shadow.
pub async fn flush_shadows(state: &ControlState) -> Result<(), CatalogError> {
    for kind in PolicyKind::ALL {
        if let Some(v) = state.policies().shadow(kind) {
            shadow_counts(state, &v, false).await?;
        }
    }
    Ok(())
}

/// Writes the usage increments and the shadow counts now.
pub async fn flush(state: &ControlState) -> Result<(), CatalogError> {
    let u = flush_usage(state).await;
    let s = flush_shadows(state).await;
    u.map(|_| ()).and(s)
}

/// Shadows the catalog records as running, as the API shows them.
pub async fn running_shadows(state: &ControlState) -> Result<Vec<ShadowView>, CatalogError> {
    let rows = sqlx::query(
        "SELECT kind, policy_id, params, started_at, started_by, candidate, active, agreed, \
         disagreed FROM policy_shadows WHERE stopped_at IS NULL ORDER BY kind",
    )
    .fetch_all(state.catalog().pool())
    .await
    .map_err(db)?;
    let counts = |s: String| serde_json::from_str::<DecisionCounts>(&s).unwrap_or_default();
    Ok(rows
        .into_iter()
        .map(|r| ShadowView {
            kind: r.get(0),
            policy_id: r.get(1),
            params: serde_json::from_str(&r.get::<String, _>(2)).unwrap_or(serde_json::Value::Null),
            started_at: r.get(3),
            started_by: r.get(4),
            active_policy_id: None,
            candidate: counts(r.get(5)),
            active: counts(r.get(6)),
            agreed: r.get::<i64, _>(7).max(0) as u64,
            disagreed: r.get::<i64, _>(8).max(0) as u64,
            tripped: false,
        })
        .collect())
}

/// Reads the stored usage into the state's book and resumes every shadow the
/// catalog records as running, with its counts. A shadow whose policy no
/// longer loads is marked stopped and logged; the others still resume.
pub async fn restore(state: &ControlState) -> Result<(), CatalogError> {
    state.usage().load(load_usage(state).await?);
    for saved in running_shadows(state).await? {
        let resumed = async {
            let kind: PolicyKind = saved.kind.parse().map_err(|e: String| e)?;
            let rec = state
                .catalog()
                .policy(saved.policy_id)
                .await
                .map_err(|e| e.to_string())?;
            let w = state
                .policies()
                .load(kind, rec.module.into(), &saved.params, true)
                .await
                .map_err(|e| e.to_string())?;
            state.policies().resume_shadow(w, &saved);
            Ok::<_, String>(())
        }
        .await;
        if let Err(e) = resumed {
            tracing::warn!(
                kind = saved.kind.as_str(),
                policy_id = saved.policy_id,
                "shadow policy not resumed: {e}"
            );
            shadow_counts(state, &saved, true).await?;
        }
    }
    Ok(())
}
