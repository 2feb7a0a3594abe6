//! OpenAI-style JSON errors: `{"error": {"message", "type", "param", "code"}}`.
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

/// An error answer of the serving API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeError {
    /// HTTP status.
    pub status: StatusCode,
    /// `invalid_request_error`, `authentication_error`, `rate_limit_error`, …
    pub kind: &'static str,
    /// Machine-readable code.
    pub code: &'static str,
    /// The offending parameter, when there is one.
    pub param: Option<String>,
    /// Human-readable message.
    pub message: String,
    /// `Retry-After` seconds (429).
    pub retry_after_s: Option<u64>,
}

impl ServeError {
    /// Any status.
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        ServeError {
            status,
            kind,
            code,
            param: None,
            message: message.into(),
            retry_after_s: None,
        }
    }
    /// 400 `invalid_request_error`.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message,
        )
    }
    /// 400 for one parameter.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        let mut e = Self::bad_request("invalid_value", message);
        e.param = Some(param.to_string());
        e
    }
    /// 404.
    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            code,
            message,
        )
    }
    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal_error",
            message,
        )
    }
    /// 503.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "unavailable",
            message,
        )
    }
    /// 429 with `Retry-After`.
    pub fn queue_full(message: impl Into<String>, retry_after_s: u64) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "queue_full",
            message,
        );
        e.retry_after_s = Some(retry_after_s.max(1));
        e
    }
    /// 413.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "body_too_large",
            format!("the request body is larger than the limit of {limit} bytes"),
        )
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl std::fmt::Display for ServeError {
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

impl From<crate::api::ApiError> for ServeError {
    fn from(e: crate::api::ApiError) -> Self {
        ServeError::new(e.status, e.kind, e.code, e.message)
    }
}

impl IntoResponse for ServeError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after_s {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

/// Parses a JSON request body: invalid UTF-8, malformed JSON and wrong types are
/// 400s naming the problem (and the field path for type errors).
pub fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ServeError> {
    if bytes.is_empty() {
        return Err(ServeError::bad_request(
            "invalid_json",
            "the request body is empty; send a JSON object",
        ));
    }
    if let Err(e) = std::str::from_utf8(bytes) {
        return Err(ServeError::bad_request(
            "invalid_utf8",
            format!("the request body is not valid UTF-8 ({e})"),
        ));
    }
    // Syntax first, so that a truncated document is "malformed", not "wrong type".
    if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
        return Err(ServeError::bad_request(
            "invalid_json",
            format!("malformed JSON: {e}"),
        ));
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize::<_, T>(de) {
        Ok(v) => Ok(v),
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            use serde_json::error::Category;
            match inner.classify() {
                Category::Syntax | Category::Eof | Category::Io => Err(ServeError::bad_request(
                    "invalid_json",
                    format!("malformed JSON: {inner}"),
                )),
                Category::Data => {
                    let mut err = ServeError::bad_request(
                        "invalid_type",
                        if path.is_empty() || path == "." {
                            format!("invalid request body: {inner}")
                        } else {
                            format!("invalid value for '{path}': {inner}")
                        },
                    );
                    if !path.is_empty() && path != "." {
                        err.param = Some(path);
                    }
                    Err(err)
                }
            }
        }
    }
}
