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

/// A test schema in the Postgres test database, dropped (with everything in
/// it) when this guard is dropped, also when the test fails.
pub struct PgSchema {
    url: String,
    /// Schema name (`hypic_t_<pid>_<nanos>_<seq>`).
    pub name: String,
}

impl Drop for PgSchema {
    fn drop(&mut self) {
        let (url, name) = (self.url.clone(), self.name.clone());
        // Own thread and runtime: Drop cannot await, and the test's runtime may be
        // single-threaded.
        let r = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(drop_schemas(&url, &[name]))
        })
        .join();
        match r {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => eprintln!("warning: could not drop test schema {}: {e}", self.name),
            Err(_) => eprintln!("warning: dropping test schema {} panicked", self.name),
        }
    }
}

/// Drops `schemas` (CASCADE); returns how many existed.
pub async fn drop_schemas(url: &str, schemas: &[String]) -> Result<usize, sqlx::Error> {
    use sqlx::Connection;
    let mut conn = sqlx::postgres::PgConnection::connect(url).await?;
    // Never wait forever on a lock held by a straggling connection.
    sqlx::query("SET lock_timeout = '10s'")
        .execute(&mut conn)
        .await?;
    let mut n = 0;
    for s in schemas {
        assert!(
            s.starts_with("hypic_t_") && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "refusing to drop schema {s:?}"
        );
        let exists = sqlx::query("SELECT 1 FROM pg_namespace WHERE nspname = $1")
            .bind(s)
            .fetch_optional(&mut conn)
            .await?
            .is_some();
        sqlx::query(&format!("DROP SCHEMA IF EXISTS {s} CASCADE"))
            .execute(&mut conn)
            .await?;
        n += exists as usize;
    }
    conn.close().await?;
    Ok(n)
}

/// Test schemas left behind by test processes that no longer run (a crashed
/// or killed run): `hypic_t_<pid>_…` whose process is gone. Schemas of live
/// processes (tests running concurrently) are never listed. Linux only
/// (`/proc`); elsewhere nothing is stale.
pub async fn stale_schemas(url: &str) -> Result<Vec<String>, sqlx::Error> {
    use sqlx::{Connection, Row};
    if !std::path::Path::new("/proc/self").exists() {
        return Ok(vec![]);
    }
    let mut conn = sqlx::postgres::PgConnection::connect(url).await?;
    let rows = sqlx::query("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'hypic\\_t\\_%'")
        .fetch_all(&mut conn)
        .await?;
    conn.close().await?;
    Ok(rows
        .iter()
        .map(|r| r.get::<String, _>(0))
        .filter(|name| {
            let pid = name.split('_').nth(2).and_then(|p| p.parse::<u32>().ok());
            match pid {
                Some(pid) => !std::path::Path::new(&format!("/proc/{pid}")).exists(),
                None => false,
            }
        })
        .collect())
}

static CLEANED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

/// A catalog in a fresh Postgres schema, and the guard that drops the schema;
/// keep the guard alive for the test. The first call of a process also drops
/// stale schemas of earlier runs. Panics with a clear message when Postgres is
/// unreachable: these tests must not pass silently without it.
pub async fn pg_catalog() -> (Catalog, PgSchema) {
    let url = pg_url();
    CLEANED
        .get_or_init(|| async {
            match stale_schemas(&url).await {
                Ok(stale) if !stale.is_empty() => {
                    if let Err(e) = drop_schemas(&url, &stale).await {
                        eprintln!("warning: could not drop stale test schemas: {e}");
                    }
                }
                Ok(_) => {}
                Err(e) => eprintln!("warning: could not list stale test schemas: {e}"),
            }
        })
        .await;
    let schema = unique_schema();
    let guard = PgSchema {
        url: url.clone(),
        name: schema.clone(),
    };
    match Catalog::connect_in_schema(&url, Some(&schema)).await {
        Ok(c) => (c, guard),
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

/// Runs each named `async fn(Catalog)` of the calling module as two tests: in a
/// `sqlite` module on a temp-file catalog and in a `postgres` module on a fresh schema.
macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let (c, _dir) = crate::common::sqlite_catalog().await;
                    super::$name(c).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let (c, _schema) = crate::common::pg_catalog().await;
                    super::$name(c).await;
                }
            )*
        }
    };
}
