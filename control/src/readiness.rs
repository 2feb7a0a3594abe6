//! Readiness and the causes of catalog failures.
//!
//! `GET /ready` (both servers) answers `200 {"status": "ready"}` when the catalog
//! accepts a write (a heartbeat row, committed) and, on `hypic serve`, the model is
//! loaded and the scheduler runs; otherwise `503` with
//! `{"status": "unready", "checks": {...}, "error": {"code", "message"}}` naming the
//! cause: `catalog_read_only`, `catalog_disk_full`, `catalog_unavailable`
//! (connection refused, unreachable, timed out) or `catalog_error`. `GET /health`
//! stays a liveness check.
//!
//! [`DbCause`] classifies database errors the same way for request errors (503
//! with the cause instead of a bare 500) and for startup errors, which also print
//! the database URL with its password redacted ([`redact_url`]).
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::catalog::{Catalog, CatalogError};
use crate::ControlState;

/// How long the readiness write may take before the catalog counts as unavailable.
pub const READY_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the startup check of a Postgres address waits for the TCP connection.
pub const CONNECT_PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Why the catalog database failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DbCause {
    /// The database (or its directory) is read-only, or the session is.
    ReadOnly,
    /// The disk (or the database's quota) is full.
    DiskFull,
    /// The server cannot be reached: connection refused, pool timed out, closed.
    Unavailable,
    /// Anything else.
    Other,
}

impl DbCause {
    /// Classifies a database error (SQLite result codes, Postgres SQLSTATEs, I/O
    /// errors, then the message's words).
    pub fn of(e: &sqlx::Error) -> DbCause {
        match e {
            sqlx::Error::Database(d) => {
                let code = d.code().map(|c| c.to_string()).unwrap_or_default();
                if let Ok(n) = code.parse::<i32>() {
                    // SQLite: the primary result code is the low byte.
                    match n & 0xff {
                        8 => return DbCause::ReadOnly,
                        13 => return DbCause::DiskFull,
                        _ => {}
                    }
                }
                match code.as_str() {
                    "25006" => return DbCause::ReadOnly,
                    "53100" => return DbCause::DiskFull,
                    "57P03" | "53300" => return DbCause::Unavailable,
                    c if c.starts_with("08") => return DbCause::Unavailable,
                    _ => {}
                }
                Self::of_message(d.message())
            }
            sqlx::Error::Io(io) => match io.kind() {
                std::io::ErrorKind::StorageFull => DbCause::DiskFull,
                std::io::ErrorKind::ReadOnlyFilesystem => DbCause::ReadOnly,
                _ => DbCause::Unavailable,
            },
            sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::WorkerCrashed => {
                DbCause::Unavailable
            }
            other => Self::of_message(&other.to_string()),
        }
    }

    fn of_message(m: &str) -> DbCause {
        let m = m.to_ascii_lowercase();
        if m.contains("readonly") || m.contains("read-only") || m.contains("read only") {
            DbCause::ReadOnly
        } else if m.contains("disk is full")
            || m.contains("no space left")
            || m.contains("disk full")
        {
            DbCause::DiskFull
        } else if m.contains("connection refused") {
            DbCause::Unavailable
        } else {
            DbCause::Other
        }
    }

    /// The classification of a catalog error (`None` for not-found, conflict and
    /// invalid input, which are the caller's).
    pub fn of_catalog(e: &CatalogError) -> Option<DbCause> {
        match e {
            CatalogError::Db(d) => Some(Self::of(d)),
            CatalogError::Migrate(sqlx::migrate::MigrateError::Execute(d)) => Some(Self::of(d)),
            CatalogError::Migrate(_) => Some(DbCause::Other),
            _ => None,
        }
    }

    /// Machine-readable code.
    pub fn code(self) -> &'static str {
        match self {
            DbCause::ReadOnly => "catalog_read_only",
            DbCause::DiskFull => "catalog_disk_full",
            DbCause::Unavailable => "catalog_unavailable",
            DbCause::Other => "catalog_error",
        }
    }

    /// What an operator reads.
    pub fn describe(self) -> &'static str {
        match self {
            DbCause::ReadOnly => "the catalog database is read-only (check the data directory's permissions and mount, or the database's read-only setting)",
            DbCause::DiskFull => "the catalog database's disk is full",
            DbCause::Unavailable => "the catalog database cannot be reached",
            DbCause::Other => "internal catalog error",
        }
    }

    /// The HTTP status of a request that failed for this cause.
    pub fn status(self) -> StatusCode {
        match self {
            DbCause::Other => StatusCode::INTERNAL_SERVER_ERROR,
            _ => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// `url` with its password (if any) replaced by `***`.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        Ok(_) => url.to_string(),
        // Not a URL the parser reads: cut anything between `://` and `@`.
        Err(_) => match (url.find("://"), url.rfind('@')) {
            (Some(a), Some(b)) if b > a => format!("{}***{}", &url[..a + 3], &url[b..]),
            _ => url.to_string(),
        },
    }
}

/// The startup error of a catalog that would not open: the cause in words and the
/// URL without its password.
pub fn startup_error(url: &str, e: CatalogError) -> anyhow::Error {
    let what = match DbCause::of_catalog(&e) {
        Some(DbCause::Other) | None => String::new(),
        Some(c) => format!("{}: ", c.describe()),
    };
    anyhow::anyhow!("opening catalog {}: {what}{e}", redact_url(url))
}

/// On a `postgres://` URL with a TCP host, opens (and closes) a TCP connection to
/// it first, so that a closed port is reported at once as "connection refused"
/// instead of after the pool's acquire timeout.
pub async fn probe_postgres(url: &str) -> anyhow::Result<()> {
    let Ok(u) = url::Url::parse(url) else {
        return Ok(());
    };
    if !matches!(u.scheme(), "postgres" | "postgresql") {
        return Ok(());
    }
    let Some(host) = u.host_str().filter(|h| !h.is_empty()) else {
        return Ok(()); // a Unix socket (host in the query)
    };
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let port = u.port().unwrap_or(5432);
    let shown = redact_url(url);
    match tokio::time::timeout(
        CONNECT_PROBE_TIMEOUT,
        tokio::net::TcpStream::connect((host.as_str(), port)),
    )
    .await
    {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => Err(anyhow::anyhow!(
            "opening catalog {shown}: connection refused by {host}:{port} (is PostgreSQL running and listening there?)"
        )),
        Ok(Err(e)) => Err(anyhow::anyhow!(
            "opening catalog {shown}: cannot connect to {host}:{port}: {e}"
        )),
        Err(_) => Err(anyhow::anyhow!(
            "opening catalog {shown}: no answer from {host}:{port} within {} s",
            CONNECT_PROBE_TIMEOUT.as_secs()
        )),
    }
}

/// Commits a heartbeat row (the table is created on first use), within
/// [`READY_TIMEOUT`].
pub async fn check_catalog_writes(cat: &Catalog) -> Result<(), (DbCause, String)> {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    let write = async {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS hypic_heartbeat (id BIGINT PRIMARY KEY, beat_at_ms BIGINT NOT NULL)",
        )
        .execute(cat.pool())
        .await?;
        sqlx::query(&format!(
            "INSERT INTO hypic_heartbeat (id, beat_at_ms) VALUES (1, {now_ms}) \
             ON CONFLICT (id) DO UPDATE SET beat_at_ms = excluded.beat_at_ms"
        ))
        .execute(cat.pool())
        .await?;
        Ok::<(), sqlx::Error>(())
    };
    match tokio::time::timeout(READY_TIMEOUT, write).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => {
            let c = DbCause::of(&e);
            Err((c, format!("{}: {e}", c.describe())))
        }
        Err(_) => Err((
            DbCause::Unavailable,
            format!(
                "{}: the heartbeat write took longer than {} s",
                DbCause::Unavailable.describe(),
                READY_TIMEOUT.as_secs()
            ),
        )),
    }
}

/// One readiness check: its name and `Ok`, or the error code and message.
pub type Check = (&'static str, Result<(), (&'static str, String)>);

/// The readiness answer from the catalog check and the other checks (the first
/// failure's code becomes the error).
pub async fn ready_response(control: &ControlState, mut checks: Vec<Check>) -> Response {
    let cat = check_catalog_writes(control.catalog())
        .await
        .map_err(|(c, m)| (c.code(), m));
    checks.insert(0, ("catalog_writable", cat));
    let mut obj = serde_json::Map::new();
    let mut first_err = None;
    for (name, r) in &checks {
        obj.insert((*name).into(), serde_json::Value::Bool(r.is_ok()));
        if let (Err((code, msg)), None) = (r, &first_err) {
            first_err = Some((*code, msg.clone()));
        }
    }
    match first_err {
        None => Json(serde_json::json!({"status": "ready", "checks": obj})).into_response(),
        Some((code, message)) => {
            tracing::warn!(code, "not ready: {message}");
            let mut r = (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(serde_json::json!({
                    "status": "unready",
                    "checks": obj,
                    "error": {"message": message, "type": "server_error", "param": null, "code": code},
                })),
            )
                .into_response();
            // The request log line names the cause.
            r.extensions_mut()
                .insert(crate::serve::reqlog::ErrorCause(format!(
                    "{code}: {message}"
                )));
            r
        }
    }
}

/// `GET /ready` of the standalone control plane: the catalog accepts writes.
pub async fn ready_control(state: ControlState) -> Response {
    ready_response(&state, vec![]).await
}
