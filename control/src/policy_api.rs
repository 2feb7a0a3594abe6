//! Policy routes beside those in [`crate::api`]: one policy's detail (its
//! declared parameter schema and what the module contains, what the console
//! diffs between versions) and shadow mode (start, read, stop a candidate that
//! answers the live hook calls beside the active policy, counted only).

use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};

use crate::api::{ApiError, ApiPath, ApiResult, ControlState, Operator, OptBody};
use crate::catalog::PolicyRecord;
use crate::policy::params::{read_schema, resolve, ParamSchema};
use crate::policy::{PolicyKind, ShadowView};

/// One export of a module.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ModuleExport {
    /// Export name.
    pub name: String,
    /// `func`, `memory`, `table`, `global` or `tag`.
    pub kind: String,
}

/// One custom section of a module.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CustomSection {
    /// Section name.
    pub name: String,
    /// Its size, bytes.
    pub bytes: usize,
}

/// What a policy module contains, read from its bytes (no code is run).
#[derive(Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ModuleInfo {
    /// Module size, bytes.
    pub bytes: usize,
    /// Exports in module order.
    pub exports: Vec<ModuleExport>,
    /// Imports (a loadable policy has none).
    pub imports: usize,
    /// Functions defined by the module.
    pub functions: u32,
    /// Size of the code section, bytes.
    pub code_bytes: u32,
    /// Initial size of the first memory, 64 KiB pages.
    pub memory_min_pages: Option<u64>,
    /// Custom sections (`hypic.params` among them when parameters are declared).
    pub custom_sections: Vec<CustomSection>,
}

/// `GET /v1/admin/policies/{id}`: a stored policy version with its declared
/// parameters and its module's contents.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PolicyDetail {
    /// The catalog row.
    #[serde(flatten)]
    pub policy: PolicyRecord,
    /// The parameters the module declares (`null`: no `hypic.params`
    /// section, ABI v1 integer parameters).
    pub param_schema: Option<ParamSchema>,
    /// The stored parameters completed with the schema's defaults, what the
    /// module is configured with (`null` without a schema, or when the stored
    /// parameters no longer match it).
    #[schema(value_type = Option<Object>)]
    pub effective_params: Option<serde_json::Value>,
    /// The module's contents.
    pub module: ModuleInfo,
}

/// Reads a module's exports, imports, function count, code size, memory and
/// custom sections. A part that does not parse ends the inventory there.
pub fn module_info(bytes: &[u8]) -> ModuleInfo {
    use wasmparser::{ExternalKind, Payload};
    let mut info = ModuleInfo {
        bytes: bytes.len(),
        ..ModuleInfo::default()
    };
    for payload in wasmparser::Parser::new(0).parse_all(bytes) {
        let Ok(payload) = payload else { break };
        match payload {
            Payload::ExportSection(r) => {
                for e in r.into_iter().flatten() {
                    let kind = match e.kind {
                        ExternalKind::Func => "func",
                        ExternalKind::Memory => "memory",
                        ExternalKind::Table => "table",
                        ExternalKind::Global => "global",
                        ExternalKind::Tag => "tag",
                        _ => "other",
                    };
                    info.exports.push(ModuleExport {
                        name: e.name.to_string(),
                        kind: kind.into(),
                    });
                }
            }
            Payload::ImportSection(r) => info.imports += r.count() as usize,
            Payload::CodeSectionStart { count, size, .. } => {
                info.functions = count;
                info.code_bytes = size;
            }
            Payload::MemorySection(r) => {
                if let Some(Ok(m)) = r.into_iter().next() {
                    info.memory_min_pages = Some(m.initial);
                }
            }
            Payload::CustomSection(c) => info.custom_sections.push(CustomSection {
                name: c.name().to_string(),
                bytes: c.data().len(),
            }),
            _ => {}
        }
    }
    info
}

#[utoipa::path(get, path = "/v1/admin/policies/{id}", tag = "policies", summary = "One policy version: declared parameters, effective values, module contents (operator)", security(("bearer" = [])), params(("id" = i64, Path, description = "policy id")), responses((status = 200, body = PolicyDetail), (status = 400, description = "invalid input", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody), (status = 404, description = "no such policy", body = crate::error::ErrorBody)))]
pub async fn policy_detail(
    State(s): State<ControlState>,
    Operator(_): Operator,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<PolicyDetail> {
    let rec = s.catalog().policy(id).await?;
    // A stored module passed these checks at upload; a schema that no longer
    // parses (a host of another version) shows as none.
    let param_schema = read_schema(&rec.module).ok().flatten();
    let stored: serde_json::Value =
        serde_json::from_str(&rec.params).unwrap_or(serde_json::Value::Null);
    let effective_params = param_schema
        .as_ref()
        .and_then(|sc| resolve(sc, &stored).ok())
        .map(serde_json::Value::Object);
    let module = module_info(&rec.module);
    Ok(Json(PolicyDetail {
        policy: rec,
        param_schema,
        effective_params,
        module,
    }))
}

/// Body of `POST /v1/admin/policies/{id}/shadow` (optional).
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ShadowBody {
    /// Parameters to run the candidate with instead of its stored ones
    /// (checked against its schema; nothing is stored).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub params: Option<serde_json::Value>,
}

fn parse_kind(kind: &str) -> Result<PolicyKind, ApiError> {
    kind.parse::<PolicyKind>()
        .map_err(|e| ApiError::bad_request(e).with_param("kind"))
}

#[utoipa::path(post, path = "/v1/admin/policies/{id}/shadow", tag = "policies", summary = "Run a policy in shadow beside the active one of its kind (operator)", description = "From now on every live call of the policy's hook is also answered by this policy; its answers are counted, never applied. Replaces the kind's previous shadow. The hit ratio it would have had is not observable from live calls (its cache would differ from the real one): dry-run it on the recorded traffic for that. Audited as `policy.shadow_start`.", security(("bearer" = [])), params(("id" = i64, Path, description = "policy id")), request_body(content = Option<ShadowBody>, description = "optional: `params` to run it with"), responses((status = 200, body = ShadowView), (status = 400, description = "the module does not load, or `invalid_param` (`param` = `params.<name>`)", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody), (status = 404, description = "no such policy", body = crate::error::ErrorBody)))]
pub async fn start_shadow(
    State(s): State<ControlState>,
    Operator(p): Operator,
    ApiPath(id): ApiPath<i64>,
    OptBody(b): OptBody<ShadowBody>,
) -> ApiResult<ShadowView> {
    let rec = s.catalog().policy(id).await?;
    let kind: PolicyKind = rec.kind.parse().map_err(ApiError::bad_request)?;
    let params = match b.params {
        Some(p) => p,
        None => serde_json::from_str(&rec.params).unwrap_or(serde_json::Value::Null),
    };
    let effective = match read_schema(&rec.module).map_err(ApiError::from)? {
        Some(sc) => serde_json::Value::Object(resolve(&sc, &params).map_err(ApiError::from)?),
        None => params.clone(),
    };
    let _serial = s.activation_lock().await;
    let w = s
        .policies()
        .load(kind, rec.module.into(), &params, false)
        .await
        .map_err(ApiError::from)?;
    let view = s.policies().start_shadow(w, id, effective, &p.sub);
    // Recorded at once, so that a restart resumes it.
    crate::persist::shadow_started(&s, &view).await?;
    s.catalog()
        .audit(
            &p.sub,
            None,
            "policy.shadow_start",
            &id.to_string(),
            &serde_json::json!({
                "kind": kind.as_str(),
                "name": rec.name,
                "version": rec.version,
                "params": view.params,
                "active_policy_id": view.active_policy_id,
            }),
        )
        .await?;
    Ok(Json(view))
}

#[utoipa::path(get, path = "/v1/admin/policies/shadow", tag = "policies", summary = "Every running shadow policy with its counts beside the active policy's (operator)", security(("bearer" = [])), responses((status = 200, body = Vec<ShadowView>), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody)))]
pub async fn list_shadows(
    State(s): State<ControlState>,
    Operator(_): Operator,
) -> ApiResult<Vec<ShadowView>> {
    Ok(Json(
        PolicyKind::ALL
            .iter()
            .filter_map(|k| s.policies().shadow(*k))
            .collect(),
    ))
}

#[utoipa::path(get, path = "/v1/admin/policies/shadow/{kind}", tag = "policies", summary = "The shadow policy of a kind with its counts beside the active policy's (operator)", security(("bearer" = [])), params(("kind" = String, Path, description = "eviction, admission, invalidation or isolation")), responses((status = 200, body = ShadowView), (status = 400, description = "unknown kind", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody), (status = 404, description = "no shadow runs for the kind", body = crate::error::ErrorBody)))]
pub async fn get_shadow(
    State(s): State<ControlState>,
    Operator(_): Operator,
    ApiPath(kind): ApiPath<String>,
) -> ApiResult<ShadowView> {
    let kind = parse_kind(&kind)?;
    s.policies()
        .shadow(kind)
        .map(Json)
        .ok_or_else(|| ApiError::not_found(format!("no {} shadow policy runs", kind.as_str())))
}

#[utoipa::path(delete, path = "/v1/admin/policies/shadow/{kind}", tag = "policies", summary = "Stop the shadow policy of a kind; its final counts (operator)", description = "Audited as `policy.shadow_stop` with the final counts.", security(("bearer" = [])), params(("kind" = String, Path, description = "eviction, admission, invalidation or isolation")), responses((status = 200, body = ShadowView), (status = 400, description = "unknown kind", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 403, description = "operator role needed", body = crate::error::ErrorBody), (status = 404, description = "no shadow runs for the kind", body = crate::error::ErrorBody)))]
pub async fn stop_shadow(
    State(s): State<ControlState>,
    Operator(p): Operator,
    ApiPath(kind): ApiPath<String>,
) -> ApiResult<ShadowView> {
    let kind = parse_kind(&kind)?;
    let view = s
        .policies()
        .stop_shadow(kind)
        .ok_or_else(|| ApiError::not_found(format!("no {} shadow policy runs", kind.as_str())))?;
    crate::persist::shadow_counts(&s, &view, true).await?;
    s.catalog()
        .audit(
            &p.sub,
            None,
            "policy.shadow_stop",
            &view.policy_id.to_string(),
            &serde_json::json!({
                "kind": kind.as_str(),
                "candidate": view.candidate,
                "active": view.active,
                "agreed": view.agreed,
                "disagreed": view.disagreed,
            }),
        )
        .await?;
    Ok(Json(view))
}
