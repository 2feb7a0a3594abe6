//! Shared helpers for the control-plane integration tests.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hypic_control::auth::{Authenticator, IsolationKeyer};
use hypic_control::policy::{policy_engine, AuditSink, PolicyLimits, PolicyRuntime};
use hypic_control::{AuthMode, Catalog, ControlState};

/// Postgres used by the tests (CI starts it); override with HYPIC_TEST_PG_URL.
pub fn pg_url() -> String {
    std::env::var("HYPIC_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A fresh schema name, unique per process and call.
pub fn unique_schema() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "hypic_t_{}_{}_{}",
        std::process::id(),
        nanos % 1_000_000_000,
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// A catalog in a fresh Postgres schema. Panics with a clear message when
/// Postgres is unreachable: these tests must not pass silently without it.
pub async fn pg_catalog() -> Catalog {
    let url = pg_url();
    let schema = unique_schema();
    match Catalog::connect_in_schema(&url, Some(&schema)).await {
        Ok(c) => c,
        Err(e) => panic!(
            "Postgres is required for this test but {url} is unreachable or failed ({e}). \
             Start it (CI's .ci/run does) or set HYPIC_TEST_PG_URL."
        ),
    }
}

/// A catalog in a fresh SQLite file; keep the TempDir alive.
pub async fn sqlite_catalog() -> (Catalog, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("catalog.sqlite").display());
    (Catalog::connect(&url).await.unwrap(), dir)
}

/// Test HS256 secret.
pub const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef-test-secret";

/// A router state with HS256 auth plus the test JWKS.
pub fn state(catalog: Catalog) -> ControlState {
    let jwks = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/keys/jwks.json");
    let auth = Authenticator::hs256(SECRET, "hypic")
        .unwrap()
        .with_jwks_file(&jwks)
        .unwrap();
    let sink = AuditSink::spawn(catalog.clone());
    let rt = Arc::new(PolicyRuntime::new(
        policy_engine(),
        PolicyLimits::default(),
        Some(sink),
    ));
    ControlState::new(
        catalog,
        AuthMode::Enabled(auth),
        IsolationKeyer::new(SECRET),
        rt,
    )
}
