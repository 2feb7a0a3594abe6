//! Connection limits and deadlines, request logging, readiness, catalog error
//! causes, token lifetime and catalog startup errors (issue 15, items 2, 6, 7, 9).
use crate::serve_common::{assert_error, start, Srv};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Waits until the server closes `s` (EOF or reset), up to `within`; returns
/// whether it did.
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue, // e.g. an error answer before the close
        }
    }
}

/// Whether `s` is still open after `wait` (no EOF, no reset).
async fn still_open(s: &mut TcpStream, wait: Duration) -> bool {
    !closed_within(s, wait).await
}

/// `GET /health` on a fresh connection: status and latency.
async fn health(srv: &Srv) -> (u16, Duration) {
    let t = Instant::now();
    let c = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let st = match c.get(format!("{}/health", srv.url)).send().await {
        Ok(r) => r.status().as_u16(),
        Err(_) => 0,
    };
    (st, t.elapsed())
}

async fn open_many(srv: &Srv, n: usize, send: &[u8]) -> Vec<TcpStream> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let mut s = TcpStream::connect(srv.server.addr).await.unwrap();
        if !send.is_empty() {
            s.write_all(send).await.unwrap();
        }
        v.push(s);
    }
    v
}

#[tokio::test]
async fn idle_and_half_sent_connections_are_closed_after_the_timeouts() {
    let srv = start(|c| {
        c.idle_timeout_ms = 300;
        c.header_read_timeout_ms = 600;
    })
    .await;
    let mut idle = open_many(&srv, 200, b"").await;
    let mut half = open_many(&srv, 200, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ").await;
    // /health answers while they are open.
    let (st, lat) = health(&srv).await;
    assert_eq!(st, 200);
    assert!(lat < Duration::from_secs(2), "health took {lat:?}");
    let t = Instant::now();
    for s in idle.iter_mut().chain(half.iter_mut()) {
        assert!(
            closed_within(s, Duration::from_secs(3)).await,
            "a connection stayed open {:?} after a 300 ms idle timeout",
            t.elapsed()
        );
    }
    // Idle keep-alive: one request, then nothing; the server closes it.
    let mut s = TcpStream::connect(srv.server.addr).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let t = Instant::now();
    assert!(closed_within(&mut s, Duration::from_secs(3)).await);
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );
    srv.server.stop().await;
}

#[tokio::test]
async fn header_read_timeout_closes_slow_headers_without_idle_timeout() {
    let srv = start(|c| {
        c.idle_timeout_ms = 0;
        c.header_read_timeout_ms = 300;
    })
    .await;
    let mut half = open_many(&srv, 50, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n").await;
    let t = Instant::now();
    for s in half.iter_mut() {
        assert!(closed_within(s, Duration::from_secs(3)).await);
    }
    assert!(t.elapsed() < Duration::from_secs(3));
    srv.server.stop().await;
}

#[tokio::test]
async fn connection_cap_evicts_idle_connections_and_refuses_when_all_are_busy() {
    let srv = start(|c| {
        c.max_connections = 40;
        c.idle_timeout_ms = 30_000;
        c.header_read_timeout_ms = 30_000;
        c.body_read_timeout_ms = 30_000;
    })
    .await;
    // 40 idle sockets fill the cap; /health still answers (the oldest idle one
    // gives way), quickly.
    let mut idle = open_many(&srv, 40, b"").await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    for _ in 0..5 {
        let (st, lat) = health(&srv).await;
        assert_eq!(st, 200);
        assert!(lat < Duration::from_secs(1), "{lat:?}");
    }
    assert!(
        closed_within(&mut idle[0], Duration::from_secs(2)).await,
        "the oldest idle connection was not closed to make room"
    );
    assert!(still_open(&mut idle[39], Duration::from_millis(200)).await);
    drop(idle);
    tokio::time::sleep(Duration::from_millis(200)).await;
    // 40 requests in progress (bodies never finished): a new connection is
    // refused at once with 503, not queued.
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"prompt\":",
        srv.token
    );
    let busy = open_many(&srv, 40, head.as_bytes()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    let mut s = TcpStream::connect(srv.server.addr).await.unwrap();
    let _ = s
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut got)).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 503"), "{text:?}");
    assert!(text.contains("too_many_connections"), "{text:?}");
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    drop(busy);
    // Room again once they are gone.
    let mut ok = false;
    for _ in 0..20 {
        if health(&srv).await.0 == 200 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok);
    srv.server.stop().await;
}

#[tokio::test]
async fn request_body_must_arrive_before_the_deadline_even_trickled() {
    let srv = start(|c| c.body_read_timeout_ms = 400).await;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n",
        srv.token
    );
    let mut s = TcpStream::connect(srv.server.addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let t = Instant::now();
    // One byte every 100 ms: no gap is longer than the deadline, the total is.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while t.elapsed() < Duration::from_secs(3) {
        let _ = s.write_all(b" ").await;
        match tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => {
                got.extend_from_slice(&buf[..n]);
                if got.windows(4).any(|w| w == b"\r\n\r\n") && got.ends_with(b"}") {
                    break;
                }
            }
            Err(_) => {}
        }
    }
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text:?}");
    assert!(text.contains("body_read_timeout"), "{text:?}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    srv.server.stop().await;
}

/// A `MakeWriter` that appends to a shared buffer.
#[derive(Clone, Default)]
pub(crate) struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Capture {
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// The log of this test process: a global subscriber writing to a buffer,
/// installed on first use. (A thread-scoped subscriber misses events while other
/// tests run in parallel without one: tracing caches each call site's interest
/// process-wide.) Tests pick their own lines by request id.
pub(crate) fn log_capture() -> Capture {
    static CAP: std::sync::OnceLock<Capture> = std::sync::OnceLock::new();
    CAP.get_or_init(|| {
        let cap = Capture::default();
        let w = cap.clone();
        let sub = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                "hypic=info,hypic_control=info",
            ))
            .with_ansi(false)
            .with_writer(move || w.clone())
            .finish();
        tracing::subscriber::set_global_default(sub).expect("no other global subscriber");
        cap
    })
    .clone()
}

/// Sets `PRAGMA query_only` on every connection of the (SQLite) catalog pool: the
/// database then refuses writes as a read-only one does (`SQLITE_READONLY`). A
/// chmod would not do: the tests may run as root, whom file modes do not stop.
async fn make_catalog_read_only(srv: &Srv) {
    let pool = srv.server.state.control().catalog().pool().clone();
    let mut held = Vec::new();
    while held.len() < pool.options().get_max_connections() as usize {
        let mut c = pool.acquire().await.unwrap();
        sqlx::query("PRAGMA query_only = ON")
            .execute(&mut *c)
            .await
            .unwrap();
        held.push(c);
    }
}

#[tokio::test]
async fn a_request_logs_one_line_without_prompt_or_token_text() {
    let cap = log_capture();
    let srv = start(|_| {}).await;
    let r = srv
        .client
        .post(format!("{}/v1/completions", srv.url))
        .bearer_auth(&srv.token)
        .json(&json!({"prompt": "zebra quartz secret prompt", "max_tokens": 3, "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let rid = r.headers()["x-request-id"].to_str().unwrap().to_string();
    let _ = r.bytes().await.unwrap();
    srv.server.stop().await;
    let all = cap.text();
    let line = all
        .lines()
        .find(|l| l.contains(&format!("request_id={rid}")))
        .unwrap_or_else(|| panic!("no log line for request {rid} in:\n{all}"));
    assert!(line.contains(" INFO "), "{line}");
    assert!(line.contains("route=/v1/completions"), "{line}");
    assert!(line.contains("status=200"), "{line}");
    assert!(line.contains("prompt_tokens="), "{line}");
    assert!(line.contains("completion_tokens=3"), "{line}");
    assert!(line.contains("ttft_ms="), "{line}");
    assert!(line.contains("tenant=t-"), "{line}");
    assert!(!line.contains("acme"), "tenant name in the log: {line}");
    assert!(!all.contains("zebra"), "prompt text in the log:\n{all}");
    assert!(!all.contains(&srv.token), "token in the log");
}

#[tokio::test]
async fn the_request_log_names_the_route_template_not_the_path() {
    let cap = log_capture();
    let srv = start(|_| {}).await;
    let mut rids = vec![];
    for path in [
        "/v1/segments/secret-id-123",
        "/v1/segments/secret-id-123/versions",
        "/no/such/secret-id-123",
        "/ui/",
        "/ui/assets/app.js",
    ] {
        let r = srv
            .client
            .get(format!("{}{path}", srv.url))
            .bearer_auth(&srv.token)
            .send()
            .await
            .unwrap();
        rids.push(r.headers()["x-request-id"].to_str().unwrap().to_string());
        let _ = r.bytes().await.unwrap();
    }
    srv.server.stop().await;
    let all = cap.text();
    let line = |rid: &str| {
        all.lines()
            .find(|l| l.contains(&format!("request_id={rid}")))
            .unwrap_or_else(|| panic!("no log line for request {rid} in:\n{all}"))
            .to_string()
    };
    assert!(
        line(&rids[0]).contains("route=/v1/segments/{id} "),
        "{}",
        line(&rids[0])
    );
    assert!(
        line(&rids[1]).contains("route=/v1/segments/{id}/versions "),
        "{}",
        line(&rids[1])
    );
    assert!(
        line(&rids[2]).contains("route=unmatched "),
        "{}",
        line(&rids[2])
    );
    // The console's routes are named too (they are the control router's).
    assert!(line(&rids[3]).contains("route=/ui/ "), "{}", line(&rids[3]));
    assert!(
        line(&rids[4]).contains("route=/ui/{*path} "),
        "{}",
        line(&rids[4])
    );
    assert!(
        !all.contains("secret-id-123"),
        "a segment id in the log:\n{all}"
    );
}

#[tokio::test]
async fn ready_names_a_read_only_catalog_and_writes_fail_with_the_cause() {
    let cap = log_capture();
    let srv = start(|_| {}).await;
    let (st, body) = srv.get_as(None, "/ready").await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(body["status"], "ready");
    make_catalog_read_only(&srv).await;
    // Liveness stays ok, readiness does not.
    assert_eq!(srv.get_as(None, "/health").await.0, 200);
    let r = srv
        .client
        .get(format!("{}/ready", srv.url))
        .send()
        .await
        .unwrap();
    let ready_rid = r.headers()["x-request-id"].to_str().unwrap().to_string();
    let st = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    assert_eq!(st, 503, "{body}");
    assert_eq!(body["error"]["code"], "catalog_read_only", "{body}");
    assert_eq!(body["checks"]["catalog_writable"], false, "{body}");
    assert_eq!(body["checks"]["model_loaded"], true, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("read-only"),
        "{body}"
    );
    // A catalog write names the cause (not a bare 500).
    let r = srv
        .client
        .post(format!("{}/v1/segments", srv.url))
        .bearer_auth(&srv.token)
        .json(&json!({"id": "doc-a", "content": "hello"}))
        .send()
        .await
        .unwrap();
    let rid = r.headers()["x-request-id"].to_str().unwrap().to_string();
    let st = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    assert_error(st, &body, 503, "catalog_read_only");
    srv.server.stop().await;
    let text = cap.text();
    let line = text
        .lines()
        .find(|l| l.contains(&format!("request_id={rid}")))
        .unwrap_or_else(|| panic!("no line for {rid}:\n{text}"));
    assert!(
        line.contains("ERROR") && line.contains("route=/v1/segments") && line.contains("read-only"),
        "not an error-level line with the cause: {line}"
    );
    // The /ready 503 line names the readiness cause too.
    let line = text
        .lines()
        .find(|l| l.contains(&format!("request_id={ready_rid}")))
        .unwrap_or_else(|| panic!("no line for {ready_rid}:\n{text}"));
    assert!(
        line.contains("catalog_read_only") && !line.contains("cause=unknown"),
        "the /ready line lacks the cause: {line}"
    );
}

#[tokio::test]
async fn control_server_serves_ready_through_the_same_connection_limits() {
    use hypic_control::serve::net::{serve, NetLimits};
    let dir = tempfile::tempdir().unwrap();
    let args = hypic_control::ControlArgs {
        database_url: None,
        data_dir: dir.path().to_path_buf(),
        jwks_file: None,
        jwks_reload_ms: 0,
        audience: "hypic".into(),
        disable_auth: false,
        max_token_lifetime_s: 3600,
        ..hypic_control::serve::ServeConfig::default().control_args()
    };
    let bind: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    let state = hypic_control::build_control_state(&args, bind)
        .await
        .unwrap();
    let app = hypic_control::control_router(state.clone()).route(
        "/ready",
        axum::routing::get(move || hypic_control::readiness::ready_control(state.clone())),
    );
    let listener = tokio::net::TcpListener::bind(bind).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = NetLimits {
        idle_timeout: Some(Duration::from_millis(300)),
        ..NetLimits::default()
    };
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let join = tokio::spawn(serve(listener, app, limits, async {
        let _ = rx.await;
    }));
    let r = reqwest::get(format!("http://{addr}/ready")).await.unwrap();
    assert_eq!(r.status(), 200);
    let mut s = TcpStream::connect(addr).await.unwrap();
    assert!(closed_within(&mut s, Duration::from_secs(3)).await);
    let _ = tx.send(());
    tokio::time::timeout(Duration::from_secs(5), join)
        .await
        .expect("graceful shutdown")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn closed_postgres_port_is_reported_promptly_without_the_password() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let dir = tempfile::tempdir().unwrap();
    let args = hypic_control::ControlArgs {
        database_url: Some(format!(
            "postgres://postgres:hunter2secret@127.0.0.1:{port}/test"
        )),
        data_dir: dir.path().to_path_buf(),
        jwks_file: None,
        jwks_reload_ms: 0,
        audience: "hypic".into(),
        disable_auth: false,
        max_token_lifetime_s: 3600,
        ..hypic_control::serve::ServeConfig::default().control_args()
    };
    let t = Instant::now();
    let e = hypic_control::build_control_state(&args, "127.0.0.1:0".parse().unwrap())
        .await
        .err()
        .expect("no server on that port");
    let took = t.elapsed();
    let msg = format!("{e:#}");
    assert!(took < Duration::from_secs(2), "took {took:?}: {msg}");
    assert!(msg.contains("connection refused"), "{msg}");
    assert!(!msg.contains("hunter2secret"), "{msg}");
    assert!(msg.contains("postgres:***@127.0.0.1"), "{msg}");
}

#[test]
fn database_urls_are_redacted() {
    use hypic_control::readiness::redact_url;
    assert_eq!(
        redact_url("postgres://u:p%40ss@db:5432/x?sslmode=require"),
        "postgres://u:***@db:5432/x?sslmode=require"
    );
    assert_eq!(redact_url("postgres://u@db/x"), "postgres://u@db/x");
    assert_eq!(
        redact_url("sqlite:///tmp/c.sqlite"),
        "sqlite:///tmp/c.sqlite"
    );
}

#[test]
fn token_lifetime_is_bounded_when_minting_and_verifying() {
    use hypic_control::auth::{
        load_or_create_secret, mint_token, token_from_args, Authenticator, TokenArgs,
    };
    use hypic_control::catalog::Role;
    let dir = tempfile::tempdir().unwrap();
    let args = TokenArgs {
        tenant: "acme".into(),
        role: "tenant".into(),
        ttl: "100d".into(),
        sub: None,
        audience: "hypic".into(),
        data_dir: dir.path().to_path_buf(),
        max_lifetime: "90d".into(),
    };
    let e = token_from_args(&args).unwrap_err().to_string();
    assert!(e.contains("maximum token lifetime"), "{e}");
    assert!(token_from_args(&TokenArgs {
        ttl: "90d".into(),
        ..args.clone()
    })
    .is_ok());
    let (secret, _) = load_or_create_secret(dir.path()).unwrap();
    let long = mint_token(
        &secret,
        "hypic",
        "acme",
        "u",
        Role::Tenant,
        10 * 365 * 86400,
    )
    .unwrap();
    let a = Authenticator::hs256(&secret, "hypic").unwrap();
    let e = a.verify(&long).unwrap_err().to_string();
    assert!(e.contains("exceeds"), "{e}");
    let day = mint_token(&secret, "hypic", "acme", "u", Role::Tenant, 86400).unwrap();
    assert!(a.verify(&day).is_ok());
    let strict = Authenticator::hs256(&secret, "hypic")
        .unwrap()
        .with_max_lifetime(3600);
    assert!(strict.verify(&day).is_err());
}

/// Figures for the report: `HYPIC_NETOPS_IDLE=2000 cargo test ... measure_idle_flood
/// -- --ignored --nocapture`.
#[tokio::test]
#[ignore]
async fn measure_idle_flood() {
    let n: usize = std::env::var("HYPIC_NETOPS_IDLE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let srv = start(|c| {
        c.idle_timeout_ms = 2000;
        c.header_read_timeout_ms = 2000;
    })
    .await;
    let t = Instant::now();
    let mut socks = open_many(&srv, n / 2, b"").await;
    socks.extend(open_many(&srv, n - n / 2, b"GET / HTTP/1.1\r\nHost: x\r\n").await);
    let opened = t.elapsed();
    let mut lats = Vec::new();
    for _ in 0..20 {
        let (st, lat) = health(&srv).await;
        assert_eq!(st, 200);
        lats.push(lat);
    }
    lats.sort();
    let mut closed = 0;
    for s in socks.iter_mut() {
        if closed_within(s, Duration::from_secs(5)).await {
            closed += 1;
        }
    }
    println!(
        "idle sockets {n} (opened in {opened:?}); /health p50 {:?} max {:?}; closed after the 2 s timeout: {closed}/{n} by {:?}",
        lats[lats.len() / 2],
        lats[lats.len() - 1],
        t.elapsed()
    );
    srv.server.stop().await;
}

/// Bodies of millions of empty arrays (issue 15 review): parsed off the async
/// workers in bounded turns, refused before parsing past `MAX_JSON_VALUES`;
/// `/health` keeps answering promptly meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_json_arrays_do_not_stall_health() {
    let srv = start(|_| {}).await;
    let body = |n: usize| {
        let mut b = String::with_capacity(40 + 3 * n);
        b.push_str(r#"{"max_tokens":1,"segments":["#);
        for i in 0..n {
            b.push_str(if i == 0 { "[]" } else { ",[]" });
        }
        b.push_str("]}");
        b
    };
    // Two over the value cap (8 MB), two under it (still far over the segment cap).
    let bodies = [2_700_000, 400_000, 2_700_000, 400_000].map(body);
    let mut posts = Vec::new();
    for b in bodies {
        let (url, token, c) = (srv.url.clone(), srv.token.clone(), srv.client.clone());
        let path = "/v1/completions";
        posts.push(tokio::spawn(async move {
            let t = Instant::now();
            let r = c
                .post(format!("{url}{path}"))
                .bearer_auth(token)
                .header("content-type", "application/json")
                .body(b)
                .send()
                .await
                .unwrap();
            let st = r.status().as_u16();
            let v: Value = r.json().await.unwrap_or(Value::Null);
            (st, v, t.elapsed())
        }));
    }
    let mut worst = Duration::ZERO;
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(1500) && posts.iter().any(|p| !p.is_finished()) {
        let (st, lat) = health(&srv).await;
        assert_eq!(st, 200);
        worst = worst.max(lat);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("/health worst latency during the parses: {worst:?}");
    assert!(worst < Duration::from_millis(500), "/health took {worst:?}");
    for (i, p) in posts.into_iter().enumerate() {
        let (st, v, took) = p.await.unwrap();
        assert_eq!(st, 400, "{v}");
        let code = v["error"]["code"].as_str().unwrap_or_default().to_string();
        let want = if i % 2 == 0 {
            "too_many_json_values"
        } else {
            "too_many_segments"
        };
        assert_eq!(code, want, "{v}");
        eprintln!("body {i}: {code} in {took:?}");
    }
    srv.server.stop().await;
}

/// One peer address cannot take every connection (issue 15 review): slow bodies
/// from loopback are refused at `max_connections_per_ip`, well below the global
/// cap, at once with 503; the refusals are counted.
#[tokio::test]
async fn one_peer_address_is_capped_below_the_global_connection_cap() {
    use hypic_control::serve::net::REFUSED_CONNECTIONS;
    let srv = start(|c| {
        c.max_connections = 64;
        c.max_connections_per_ip = 4;
        c.header_read_timeout_ms = 30_000;
        c.body_read_timeout_ms = 30_000;
    })
    .await;
    let before = REFUSED_CONNECTIONS[1].load(std::sync::atomic::Ordering::Relaxed);
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{{",
        srv.token
    );
    let mut conns = Vec::new();
    let mut refused = Vec::new();
    for i in 0..10 {
        let t = Instant::now();
        let mut s = TcpStream::connect(srv.server.addr).await.unwrap();
        let _ = s.write_all(head.as_bytes()).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut buf = vec![0u8; 4096];
        match tokio::time::timeout(Duration::from_millis(300), s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => {
                let text = String::from_utf8_lossy(&buf[..n]).to_string();
                assert!(text.starts_with("HTTP/1.1 503"), "{i}: {text:?}");
                assert!(text.contains("too_many_connections"), "{text:?}");
                refused.push((i, t.elapsed()));
            }
            _ => conns.push(s), // still waiting for the rest of its body
        }
    }
    let idx: Vec<usize> = refused.iter().map(|r| r.0).collect();
    assert_eq!(idx, (4..10).collect::<Vec<_>>(), "refused: {refused:?}");
    for (_, took) in &refused {
        assert!(*took < Duration::from_secs(1), "{took:?}");
    }
    eprintln!("per-IP refusals: {refused:?}");
    let after = REFUSED_CONNECTIONS[1].load(std::sync::atomic::Ordering::Relaxed);
    assert!(after >= before + 6, "{before} -> {after}");
    // Room again once the slow clients are gone.
    drop(conns);
    let mut ok = false;
    for _ in 0..20 {
        if health(&srv).await.0 == 200 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok);
    srv.server.stop().await;
}
