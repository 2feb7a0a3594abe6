//! Unit-level tests of auth helpers: first start, `hypic token`, TTL parsing,
//! the loopback check and isolation keys.

use hypic_control::auth::{
    check_auth_disable, first_start, parse_ttl, token_from_args, Authenticator, IsolationKeyer,
    TokenArgs, SECRET_FILE,
};
use hypic_control::catalog::{Role, SnapshotEntry};

#[test]
fn first_start_creates_secret_once_and_prints_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let fs = first_start(dir.path(), "hypic", 3600).unwrap();
    assert!(fs.created);
    assert_eq!(fs.secret.len(), 32);
    let auth = Authenticator::hs256(&fs.secret, "hypic").unwrap();
    let op = auth.verify(fs.operator_token.as_deref().unwrap()).unwrap();
    assert_eq!((op.tenant.as_str(), op.role), ("ops", Role::Operator));
    let demo = auth.verify(fs.demo_token.as_deref().unwrap()).unwrap();
    assert_eq!((demo.tenant.as_str(), demo.role), ("demo", Role::Tenant));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join(SECRET_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    let again = first_start(dir.path(), "hypic", 3600).unwrap();
    assert!(!again.created);
    assert_eq!(again.secret, fs.secret);
    assert!(again.operator_token.is_none());
}

#[test]
fn token_command_mints_verifiable_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let args = TokenArgs {
        tenant: "acme".into(),
        role: "operator".into(),
        ttl: "2h".into(),
        sub: None,
        audience: "hypic".into(),
        data_dir: dir.path().to_path_buf(),
        max_lifetime: "90d".into(),
    };
    let t = token_from_args(&args).unwrap();
    let (secret, created) = hypic_control::auth::load_or_create_secret(dir.path()).unwrap();
    assert!(!created);
    let p = Authenticator::hs256(&secret, "hypic")
        .unwrap()
        .verify(&t)
        .unwrap();
    assert_eq!(p.tenant, "acme");
    assert_eq!(p.sub, "operator@acme");
    assert_eq!(p.role, Role::Operator);
    assert!(token_from_args(&TokenArgs {
        role: "root".into(),
        ..args.clone()
    })
    .unwrap_err()
    .to_string()
    .contains("unknown role"));
    assert!(token_from_args(&TokenArgs {
        tenant: "a b".into(),
        ..args.clone()
    })
    .is_err());
    assert!(token_from_args(&TokenArgs {
        ttl: "soon".into(),
        ..args
    })
    .is_err());
}

#[test]
fn ttl_parsing() {
    assert_eq!(parse_ttl("90").unwrap(), 90);
    assert_eq!(parse_ttl("15m").unwrap(), 900);
    assert_eq!(parse_ttl("24h").unwrap(), 86400);
    assert_eq!(parse_ttl("7d").unwrap(), 604800);
    assert!(parse_ttl("0").is_err());
    assert!(parse_ttl("-5s").is_err());
    assert!(parse_ttl("99999999999999999999d").is_err());
}

#[test]
fn disabling_auth_only_on_loopback() {
    assert!(check_auth_disable("127.0.0.1:8080".parse().unwrap(), true).is_ok());
    assert!(check_auth_disable("[::1]:8080".parse().unwrap(), true).is_ok());
    let e = check_auth_disable("0.0.0.0:8080".parse().unwrap(), true).unwrap_err();
    assert!(e.to_string().contains("loopback"));
    assert!(check_auth_disable("10.1.2.3:8080".parse().unwrap(), true).is_err());
    assert!(check_auth_disable("0.0.0.0:8080".parse().unwrap(), false).is_ok());
}

#[test]
fn isolation_keys_never_widen() {
    let k = IsolationKeyer::new(b"server-secret-server-secret-32by");
    let private = SnapshotEntry {
        segment_id: "d".into(),
        version: 1,
        content_hash: "h".into(),
        owner_tenant: "a".into(),
        public: false,
    };
    let public = SnapshotEntry {
        public: true,
        ..private.clone()
    };
    // Private: per tenant, even if the policy (wrongly) allows sharing.
    assert_ne!(
        k.isolation_key("a", &private, true, None),
        k.isolation_key("b", &private, true, None)
    );
    // Public + policy allows: shared.
    assert_eq!(
        k.isolation_key("a", &public, true, None),
        k.isolation_key("b", &public, true, None)
    );
    // Public + strict policy: per tenant.
    assert_ne!(
        k.isolation_key("a", &public, false, None),
        k.isolation_key("b", &public, false, None)
    );
    // No salt can produce another tenant's key or the unsalted shared key.
    let a_key = k.isolation_key("a", &private, false, None);
    for salt in ["", "a", "x", a_key.as_str()] {
        let kb = k.isolation_key("b", &private, false, Some(salt));
        assert_ne!(kb, a_key, "salt {salt:?}");
        let ks = k.isolation_key("b", &public, true, Some(salt));
        if !salt.is_empty() {
            assert_ne!(ks, k.isolation_key("a", &public, true, None));
        }
    }
    // Keys depend on the server secret.
    let other = IsolationKeyer::new(b"another-secret-another-secret-xx");
    assert_ne!(other.isolation_key("a", &private, false, None), a_key);
    // Cache keys separate versions.
    let v2 = SnapshotEntry {
        version: 2,
        ..private.clone()
    };
    assert_ne!(k.cache_key(&a_key, &private), k.cache_key(&a_key, &v2));
}

#[test]
fn tokens_not_valid_yet_are_refused() {
    // `nbf` in the future: refused until then; in the past: accepted.
    let secret = b"0123456789abcdef0123456789abcdef";
    let auth = Authenticator::hs256(secret, "hypic").unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let token = |nbf: u64| {
        let claims = serde_json::json!({
            "sub": "u@acme", "tenant": "acme", "role": "tenant", "aud": "hypic",
            "exp": now + 3600, "iat": now, "nbf": nbf,
        });
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &claims,
            &jsonwebtoken::EncodingKey::from_secret(secret).unwrap(),
        )
        .unwrap()
    };
    let err = auth.verify(&token(now + 600)).unwrap_err();
    assert_eq!(err.code(), "invalid_token");
    assert!(err.to_string().contains("not valid yet"), "{err}");
    assert_eq!(auth.verify(&token(now - 60)).unwrap().tenant, "acme");
}

#[test]
fn future_issue_times_and_unsafe_subjects_are_refused() {
    let secret = b"0123456789abcdef0123456789abcdef";
    let auth = Authenticator::hs256(secret, "hypic").unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let token = |sub: &str, iat: u64, exp: u64| {
        let claims = serde_json::json!({
            "sub": sub, "tenant": "acme", "role": "operator", "aud": "hypic",
            "exp": exp, "iat": iat,
        });
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &claims,
            &jsonwebtoken::EncodingKey::from_secret(secret).unwrap(),
        )
        .unwrap()
    };
    // An `iat` ten years ahead would stretch the lifetime check (exp − iat) to ten
    // years of use: refused.
    let ten_years = 10 * 365 * 86_400;
    let err = auth
        .verify(&token("u@acme", now + ten_years, now + ten_years + 3600))
        .unwrap_err();
    assert_eq!(err.code(), "invalid_token");
    assert!(err.to_string().contains("issued in the future"), "{err}");
    // Within the clock-skew leeway, and in the past: accepted.
    assert!(auth.verify(&token("u@acme", now + 2, now + 3600)).is_ok());
    assert!(auth.verify(&token("u@acme", now - 60, now + 3600)).is_ok());
    // Subjects that would break or reorder log lines and the console.
    for sub in [
        "a\nb",
        "a\rb",
        "a\u{0}b",
        "a\u{202e}b",
        "a\u{2066}b",
        "a\u{2028}b",
    ] {
        let err = auth.verify(&token(sub, now, now + 3600)).unwrap_err();
        assert_eq!(err.code(), "invalid_token", "{sub:?}");
    }
    assert_eq!(
        auth.verify(&token("ops-ui", now, now + 3600)).unwrap().sub,
        "ops-ui"
    );
}
