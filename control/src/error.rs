//! The API's one error type, [`ApiError`]: every failure of a control route, of
//! the [`crate::segments::SegmentService`] and of a serving route of `hypic serve`
//! (`/v1/completions`, `/v1/chat/completions`, `/v1/responses`, `/v1/segments`, …)
//! is one, and is rendered the same way, as OpenAI-style JSON
//! `{"error": {"message", "type", "param", "code"}}` with its HTTP status
//! (`WWW-Authenticate: Bearer` on a 401, `Retry-After` on a 429 that says when to
//! come back). The mapping from the errors of the layers below (token
//! verification, catalog, policy loading, the blocking pool) to status, type and
//! code lives here and nowhere else.
//!
//! Two families of constructors keep the two wire conventions the routes have
//! always had: the control routes' (`bad_request` with code `invalid_request`,
//! `not_found` with type `not_found_error`) and the OpenAI-compatible serving
//! routes' (`invalid` with a specific code, `invalid_param`, `openai_not_found`
//! with type `invalid_request_error`, as OpenAI answers an unknown model).

use axum::extract::rejection::JsonRejection;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::auth::AuthError;
use crate::catalog::CatalogError;
use crate::policy::PolicyError;

/// Header carrying a client's idempotency key on `POST /v1/segments` (named by
/// the error about a reused key).
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";

/// The JSON body of an error answer: `{"error": {"message", "type", "param",
/// "code"}}` (`param` is `null` when the error names no request field). Shared by
/// the control API and the serving API, so both speak one wire format.
pub fn error_body(message: &str, kind: &str, param: Option<&str>, code: &str) -> serde_json::Value {
    serde_json::json!({"error": {
        "message": message,
        "type": kind,
        "param": param,
        "code": code,
    }})
}

/// The shape of an error answer, for the OpenAPI document: what
/// [`error_body`] writes.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct ErrorBody {
    /// The error.
    error: ErrorDetail,
}

/// The `error` object of an [`ErrorBody`].
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct ErrorDetail {
    /// Human-readable message.
    message: String,
    /// Error type: `invalid_request_error`, `authentication_error`,
    /// `permission_error`, `not_found_error`, `conflict_error`,
    /// `rate_limit_error`, `timeout_error` or `server_error`.
    #[schema(rename = "type")]
    kind: String,
    /// The request field the error is about, or `null`.
    param: Option<String>,
    /// Machine-readable code, e.g. `not_owner`, `segment_not_found`.
    code: String,
}

/// An error of the API (control and serving routes), rendered as OpenAI-style
/// JSON with its status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// Error type, e.g. `authentication_error`.
    pub kind: &'static str,
    /// Machine-readable code.
    pub code: &'static str,
    /// The request field the error is about, if any (`param` in the JSON).
    pub param: Option<String>,
    /// Seconds after which a retry may succeed, sent as `Retry-After` (a 429).
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    /// Any status, type and code.
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            code,
            param: None,
            retry_after_s: None,
        }
    }

    /// The same error, naming the request field it is about.
    pub fn with_param(mut self, param: impl Into<String>) -> ApiError {
        self.param = Some(param.into());
        self
    }

    /// 400 `invalid_request_error` / `invalid_request`.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_request",
            message,
        )
    }

    /// 403 `permission_error` with `code`.
    pub fn forbidden(code: &'static str, message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::FORBIDDEN, "permission_error", code, message)
    }

    /// 404 `not_found_error` / `not_found`.
    pub fn not_found(message: impl Into<String>) -> ApiError {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            "not_found",
            message,
        )
    }

    /// 500 `server_error` / `internal_error`.
    pub fn internal(message: impl Into<String>) -> ApiError {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal_error",
            message,
        )
    }

    /// 400 `invalid_request_error` with a specific `code` (`invalid_json`,
    /// `invalid_type`, …): the serving routes' malformed-request answer.
    pub fn invalid(code: &'static str, message: impl Into<String>) -> ApiError {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message,
        )
    }

    /// 400 `invalid_request_error` / `invalid_value` naming the request field
    /// `param`.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> ApiError {
        Self::invalid("invalid_value", message).with_param(param)
    }

    /// 404 of the OpenAI-compatible routes: type `invalid_request_error` (as
    /// OpenAI answers an unknown model) with a specific `code`
    /// (`model_not_found`, `segment_not_found`, …).
    pub fn openai_not_found(code: &'static str, message: impl Into<String>) -> ApiError {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            code,
            message,
        )
    }

    /// 503 `server_error` / `unavailable`.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "unavailable",
            message,
        )
    }

    /// 429 `rate_limit_error` / `queue_full` with `Retry-After` (at least 1 s).
    pub fn queue_full(message: impl Into<String>, retry_after_s: u64) -> ApiError {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "queue_full",
            message,
        );
        e.retry_after_s = Some(retry_after_s.max(1));
        e
    }

    /// 413 `invalid_request_error` / `body_too_large`: a request body over
    /// `limit` bytes.
    pub fn body_too_large(limit: usize) -> ApiError {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "body_too_large",
            format!("the request body is larger than the limit of {limit} bytes"),
        )
    }

    /// The JSON body of this error (see [`error_body`]).
    pub fn body(&self) -> serde_json::Value {
        error_body(&self.message, self.kind, self.param.as_deref(), self.code)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.code,
            self.message
        )
    }
}

impl std::error::Error for ApiError {}

/// 401 `authentication_error`, code from the verifier (`missing_token`, …).
impl From<AuthError> for ApiError {
    fn from(e: AuthError) -> ApiError {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            e.code(),
            e.to_string(),
        )
    }
}

/// 404 not found, 409 conflict, 400 invalid input, 413 too large, 422 a reused
/// idempotency key; a database failure is the status and code of its cause (see
/// [`crate::readiness::DbCause`]) with the database's own message logged, not
/// sent. The field the catalog names becomes `param`.
impl From<CatalogError> for ApiError {
    fn from(e: CatalogError) -> ApiError {
        let param = e.field();
        let err = match e {
            CatalogError::NotFound(_) => ApiError::not_found(e.to_string()),
            CatalogError::Conflict(_) => ApiError::new(
                StatusCode::CONFLICT,
                "conflict_error",
                "conflict",
                e.to_string(),
            ),
            CatalogError::Invalid(_) | CatalogError::InvalidField(..) => {
                ApiError::bad_request(e.to_string())
            }
            CatalogError::TooLarge(..) => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                "too_large",
                e.to_string(),
            ),
            CatalogError::IdempotencyMismatch(_) => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_request_error",
                "idempotency_key_reused",
                e.to_string(),
            )
            .with_param(IDEMPOTENCY_KEY),
            CatalogError::Db(_) | CatalogError::Migrate(_) => {
                // The cause (read-only, disk full, unreachable) is the operator's to
                // fix and the client's to know; the database's own message is logged.
                let cause = crate::readiness::DbCause::of_catalog(&e)
                    .unwrap_or(crate::readiness::DbCause::Other);
                tracing::error!(code = cause.code(), "catalog error: {e}");
                ApiError::new(
                    cause.status(),
                    "server_error",
                    cause.code(),
                    cause.describe(),
                )
            }
        };
        match param {
            Some(p) => err.with_param(p),
            None => err,
        }
    }
}

/// A policy load error: 413 `module_too_large` for a module over the size limit,
/// 429 `compile_busy` when the compile slots are taken, 400 otherwise.
impl From<PolicyError> for ApiError {
    fn from(e: PolicyError) -> ApiError {
        match e {
            PolicyError::TooLarge { .. } => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                "module_too_large",
                e.to_string(),
            ),
            PolicyError::Busy { .. } => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "compile_busy",
                e.to_string(),
            ),
            PolicyError::Schema(_) => ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_param_schema",
                e.to_string(),
            )
            .with_param("wasm_base64"),
            PolicyError::Param { ref name, .. } => {
                let param = if name.is_empty() {
                    "params".to_string()
                } else {
                    format!("params.{name}")
                };
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    "invalid_param",
                    e.to_string(),
                )
                .with_param(&param)
            }
            other => ApiError::bad_request(other.to_string()),
        }
    }
}

/// A task of the blocking pool that panicked or was cancelled: 500.
impl From<tokio::task::JoinError> for ApiError {
    fn from(e: tokio::task::JoinError) -> ApiError {
        ApiError::internal(e.to_string())
    }
}

/// A JSON body that could not be read or parsed: the status of a body-read
/// failure (e.g. 413) with code `invalid_body`, else 400; the message is axum's.
impl From<JsonRejection> for ApiError {
    fn from(e: JsonRejection) -> ApiError {
        match e {
            JsonRejection::BytesRejection(b) => ApiError::new(
                b.status(),
                "invalid_request_error",
                "invalid_body",
                b.body_text(),
            ),
            other => {
                let text = other.body_text();
                let err = ApiError::bad_request(text.clone());
                match rejection_param(&text) {
                    Some(p) => err.with_param(p),
                    None => err,
                }
            }
        }
    }
}

/// The request field an extractor's rejection message is about: the path
/// serde reports before the message (`name: invalid type…`, `params.x: …`),
/// the field of a `missing field`, `unknown field` or `duplicate field`
/// message, or the key of a path parameter that does not parse; `None` when
/// the message names none (malformed JSON, a body of the wrong type).
pub fn rejection_param(message: &str) -> Option<String> {
    let mut rest = message;
    for prefix in [
        "Failed to deserialize the JSON body into the target type: ",
        "Failed to deserialize query string: ",
        "Failed to deserialize form: ",
    ] {
        if let Some(i) = rest.find(prefix) {
            rest = &rest[i + prefix.len()..];
        }
    }
    // A serde path: identifiers joined by dots, with [n] indexes.
    if let Some((head, _)) = rest.split_once(": ") {
        let ident = |t: &str| {
            t.split('[').next().is_some_and(|n| {
                n.chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                    && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            }) && t
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_[]".contains(c))
        };
        if !head.is_empty() && head.split('.').all(ident) {
            return Some(head.to_string());
        }
    }
    for marker in [
        "missing field `",
        "unknown field `",
        "duplicate field `",
        "Cannot parse `",
    ] {
        if let Some(i) = rest.find(marker) {
            let name = &rest[i + marker.len()..];
            if let Some(end) = name.find('`') {
                // `Cannot parse `v` to a `T`` (no key) names a value, not a field.
                if marker == "Cannot parse `" && !name[end..].starts_with("` with value") {
                    return None;
                }
                return Some(name[..end].to_string());
            }
        }
    }
    None
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if self.status.is_server_error() {
            r.extensions_mut()
                .insert(crate::serve::reqlog::ErrorCause(self.message.clone()));
        }
        if let Some(s) = self.retry_after_s {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        mark_no_retry(self.status, &mut r);
        r
    }
}

/// The response header that tells OpenAI SDKs not to retry.
pub const SHOULD_RETRY: &str = "x-should-retry";

/// Whether a retry of the same request cannot succeed: 400, 404, 409 and 422 depend
/// on the request (or on state that a retry does not change), unlike 408, 429 and 5xx.
pub fn retry_cannot_fix(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::BAD_REQUEST
            | StatusCode::NOT_FOUND
            | StatusCode::CONFLICT
            | StatusCode::UNPROCESSABLE_ENTITY
    )
}

/// Sets `x-should-retry: false` on `r` when [`retry_cannot_fix`] its `status` (the
/// OpenAI SDKs otherwise retry a 409).
pub fn mark_no_retry(status: StatusCode, r: &mut Response) {
    if retry_cannot_fix(status) {
        r.headers_mut()
            .insert(SHOULD_RETRY, HeaderValue::from_static("false"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejection_messages_name_their_field() {
        let cases = [
            ("Failed to deserialize the JSON body into the target type: missing field `name` at line 1 column 2", Some("name")),
            ("Failed to deserialize the JSON body into the target type: kind: invalid type: integer `1`, expected a string at line 1 column 9", Some("kind")),
            ("Failed to deserialize the JSON body into the target type: params.ttl_ms: invalid type", Some("params.ttl_ms")),
            ("Failed to deserialize query string: since_ms: invalid digit found in string", Some("since_ms")),
            ("Failed to deserialize the JSON body into the target type: unknown field `nope`, expected `params` at line 1 column 7", Some("nope")),
            ("Cannot parse `id` with value `abc` to a `i64`", Some("id")),
            ("Cannot parse `abc` to a `i64`", None),
            ("Failed to parse the request body as JSON: EOF while parsing an object at line 1 column 1", None),
        ];
        for (msg, want) in cases {
            assert_eq!(rejection_param(msg).as_deref(), want, "{msg}");
        }
    }

    #[test]
    fn catalog_errors_map_to_their_status_and_code() {
        let nf = ApiError::from(CatalogError::NotFound("segment \"x\"".into()));
        assert_eq!(
            (nf.status, nf.kind, nf.code),
            (StatusCode::NOT_FOUND, "not_found_error", "not_found")
        );
        let c = ApiError::from(CatalogError::Conflict("exists".into()));
        assert_eq!((c.status, c.code), (StatusCode::CONFLICT, "conflict"));
        let i = ApiError::from(CatalogError::IdempotencyMismatch("k".into()));
        assert_eq!(i.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(i.param.as_deref(), Some(IDEMPOTENCY_KEY));
    }

    #[test]
    fn the_body_is_openai_style_and_a_401_asks_for_a_bearer_token() {
        let e = ApiError::from(AuthError::Missing).with_param("authorization");
        assert_eq!(
            e.body(),
            serde_json::json!({"error": {"message": e.message, "type": "authentication_error",
                "param": "authorization", "code": e.code}})
        );
        let r = e.into_response();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(r.headers()[header::WWW_AUTHENTICATE], "Bearer");
        assert!(r.headers().get(SHOULD_RETRY).is_none());
    }

    #[test]
    fn errors_a_retry_cannot_fix_say_so() {
        for (st, no_retry) in [
            (StatusCode::BAD_REQUEST, true),
            (StatusCode::NOT_FOUND, true),
            (StatusCode::CONFLICT, true),
            (StatusCode::UNPROCESSABLE_ENTITY, true),
            (StatusCode::TOO_MANY_REQUESTS, false),
            (StatusCode::SERVICE_UNAVAILABLE, false),
        ] {
            let r = ApiError::new(st, "invalid_request_error", "x", "m").into_response();
            assert_eq!(
                r.headers().get(SHOULD_RETRY).map(|v| v.to_str().unwrap()),
                no_retry.then_some("false"),
                "{st}"
            );
        }
    }
}
