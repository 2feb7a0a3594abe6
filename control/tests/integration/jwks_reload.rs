//! JWKS key rotation without a restart: the authenticator re-reads its JWKS
//! file (periodically and on SIGHUP); tokens of added keys are accepted and
//! tokens of removed keys get 401 from the next request on; a broken file
//! keeps the previous keys.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use hypic_control::auth::{Authenticator, Claims, IsolationKeyer};
use hypic_control::policy::{policy_engine, AuditSink, PolicyLimits, PolicyRuntime};
use hypic_control::{control_router, AuthMode, ControlState};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::Value;
use tower::ServiceExt;

fn keys_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/keys")
}

/// Writes `src` over `dst` atomically (as a key-rotation tool would).
fn install(src: &str, dst: &Path) {
    let tmp = dst.with_extension("tmp");
    std::fs::copy(keys_dir().join(src), &tmp).unwrap();
    std::fs::rename(&tmp, dst).unwrap();
}

fn token(pem: &str, alg: Algorithm, kid: &str) -> String {
    let pem = std::fs::read(keys_dir().join(pem)).unwrap();
    let key = match alg {
        Algorithm::EdDSA => EncodingKey::from_ed_pem(&pem).unwrap(),
        _ => EncodingKey::from_rsa_pem(&pem).unwrap(),
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = Claims {
        sub: format!("user-{kid}"),
        tenant: "rot".into(),
        role: "operator".into(),
        aud: "hypic".into(),
        exp: now + 600,
        iat: now,
    };
    let mut h = Header::new(alg);
    h.kid = Some(kid.into());
    jsonwebtoken::encode(&h, &claims, &key).unwrap()
}

async fn whoami(s: &ControlState, token: &str) -> (StatusCode, Value) {
    let req = Request::builder()
        .method(Method::GET)
        .uri("/v1/whoami")
        .header("authorization", format!("Bearer {token}"))
        .body(Body::empty())
        .unwrap();
    let resp = control_router(s.clone()).oneshot(req).await.unwrap();
    let st = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (st, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

async fn state_with_jwks(file: &Path) -> (ControlState, tempfile::TempDir) {
    let (c, d) = common::sqlite_catalog().await;
    let auth = Authenticator::without_keys("hypic")
        .with_jwks_file(file)
        .unwrap();
    let rt = Arc::new(PolicyRuntime::new(
        policy_engine(),
        PolicyLimits::default(),
        Some(AuditSink::spawn(c.clone())),
    ));
    let s = ControlState::new(
        c,
        AuthMode::Enabled(auth),
        IsolationKeyer::new(common::SECRET),
        rt,
    );
    (s, d)
}

/// Polls until `token` gets `want` (or panics after 20 s).
async fn until_status(s: &ControlState, token: &str, want: StatusCode) {
    let t0 = Instant::now();
    loop {
        let (st, v) = whoami(s, token).await;
        if st == want {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "still {st} ({v}), want {want}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_jwks_file_is_picked_up_without_restart() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("jwks.json");
    install("jwks.json", &file); // ed-1 + rsa-1
    let (s, _d) = state_with_jwks(&file).await;
    let ed1 = token("ed25519.pem", Algorithm::EdDSA, "ed-1");
    let ed2 = token("ed25519-2.pem", Algorithm::EdDSA, "ed-2");
    let rsa1 = token("rsa.pem", Algorithm::RS256, "rsa-1");
    assert_eq!(whoami(&s, &ed1).await.0, StatusCode::OK);
    assert_eq!(whoami(&s, &rsa1).await.0, StatusCode::OK);
    let (st, v) = whoami(&s, &ed2).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED, "{v}");
    assert_eq!(v["error"]["code"], "invalid_token");
    assert_eq!(s.authenticator().unwrap().key_count(), 2);

    // Nothing changed: a reload replaces nothing.
    let r = s.authenticator().unwrap().reload_jwks();
    assert!(r.reloaded.is_empty() && r.failed.is_empty(), "{r:?}");
    assert_eq!(r.keys, 2);

    // Rotation: ed-1 removed, ed-2 added, rsa-1 kept; the periodic check picks it up.
    s.spawn_jwks_reloader(Some(Duration::from_millis(50)))
        .expect("a JWKS file to watch");
    install("jwks-rotated.json", &file);
    until_status(&s, &ed2, StatusCode::OK).await;
    let (st, v) = whoami(&s, &ed2).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(v["sub"], "user-ed-2");
    let (st, v) = whoami(&s, &ed1).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED, "removed key: {v}");
    assert_eq!(v["error"]["code"], "invalid_token");
    assert_eq!(whoami(&s, &rsa1).await.0, StatusCode::OK, "kept key");

    // A broken file keeps the previous keys, and the failure is reported and audited.
    std::fs::write(&file, b"{\"keys\": [ {\"kty\": ").unwrap();
    let r = s.authenticator().unwrap().reload_jwks();
    assert_eq!(r.failed.len(), 1, "{r:?}");
    assert!(r.failed[0].1.contains("parsing JWKS file"), "{r:?}");
    assert!(r.reloaded.is_empty());
    assert_eq!(r.keys, 2);
    let t0 = Instant::now();
    loop {
        let rows = s
            .catalog()
            .audit_log(Some("auth.jwks_reload_failed"), 10)
            .await
            .unwrap();
        if !rows.is_empty() {
            assert_eq!(rows[0].target, file.display().to_string());
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no failure audit row"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(whoami(&s, &ed2).await.0, StatusCode::OK);
    assert_eq!(whoami(&s, &ed1).await.0, StatusCode::UNAUTHORIZED);

    // Rolling back to the first set, by an explicit reload.
    install("jwks.json", &file);
    let r = s.authenticator().unwrap().reload_jwks();
    // The watcher may have been first; either way the keys are the old ones now.
    assert!(r.failed.is_empty(), "{r:?}");
    assert_eq!(whoami(&s, &ed1).await.0, StatusCode::OK);
    assert_eq!(whoami(&s, &ed2).await.0, StatusCode::UNAUTHORIZED);
    let rows = s
        .catalog()
        .audit_log(Some("auth.jwks_reload"), 10)
        .await
        .unwrap();
    assert!(!rows.is_empty(), "reloads are audited");
    assert!(rows[0].detail.contains("\"keys\":2"), "{:?}", rows[0]);
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_jwks_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("jwks.json");
    install("jwks.json", &file);
    let (s, _d) = state_with_jwks(&file).await;
    let ed2 = token("ed25519-2.pem", Algorithm::EdDSA, "ed-2");
    // No periodic check: only the signal can trigger a reload.
    s.spawn_jwks_reloader(None).expect("a JWKS file to watch");
    install("jwks-rotated.json", &file);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        whoami(&s, &ed2).await.0,
        StatusCode::UNAUTHORIZED,
        "not reloaded before the signal"
    );
    let st = std::process::Command::new("kill")
        .args(["-HUP", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    until_status(&s, &ed2, StatusCode::OK).await;
    assert_eq!(
        whoami(&s, &token("ed25519.pem", Algorithm::EdDSA, "ed-1"))
            .await
            .0,
        StatusCode::UNAUTHORIZED
    );
}
