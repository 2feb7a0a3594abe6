//! Connection handling of both HTTP servers (`hypic serve`, `hypic control`):
//! an accept loop over hyper's HTTP/1 connection builder with
//!
//! * a header-read timeout (hyper's own, [`NetLimits::header_read_timeout`]),
//! * an idle timeout: a connection with no request in progress (just accepted,
//!   between keep-alive requests, or still sending headers) is closed after
//!   [`NetLimits::idle_timeout`],
//! * a per-request body-read deadline ([`NetLimits::body_read_timeout`], counted from
//!   the request's headers, not reset by each chunk, so a client trickling a body
//!   byte by byte is cut off too),
//! * a connection cap ([`NetLimits::max_connections`]): at the cap, the oldest idle
//!   connection is closed to make room; when every connection has a request in
//!   progress, the new one gets a `503` and is closed at once (never queued),
//! * graceful shutdown (stop accepting, let requests in progress finish, close idle
//!   connections) and [`ConnectInfo<SocketAddr>`] in every request's extensions,
//! * one log line per request ([`super::reqlog`]).
use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tower::ServiceExt;

use super::reqlog;

/// Default of [`NetLimits::header_read_timeout`], milliseconds.
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 10_000;
/// Default of [`NetLimits::idle_timeout`], milliseconds.
pub const DEFAULT_IDLE_TIMEOUT_MS: u64 = 5_000;
/// Default of [`NetLimits::body_read_timeout`], milliseconds.
pub const DEFAULT_BODY_READ_TIMEOUT_MS: u64 = 30_000;
/// Default of [`NetLimits::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 8192;
/// Default of [`NetLimits::max_connections_per_ip`].
pub const DEFAULT_MAX_CONNECTIONS_PER_IP: usize = 256;
/// File descriptors kept free of connections (catalog, spill files, logs).
const FD_RESERVE: u64 = 256;

/// What a client may hold of a server: connections and time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NetLimits {
    /// A request's headers must be complete within this long of the server starting
    /// to wait for them (the accept, or the end of the previous response).
    pub header_read_timeout: Duration,
    /// A connection with no request in progress is closed after this long
    /// (`None`: only the header-read timeout applies).
    pub idle_timeout: Option<Duration>,
    /// A request's body must be received within this long of its headers
    /// (beyond: `408 body_read_timeout`).
    pub body_read_timeout: Duration,
    /// Open connections at most (also capped by the open-file limit, less a
    /// reserve of 256 descriptors).
    pub max_connections: usize,
    /// Open connections from one peer IP address at most: at the cap, that
    /// address's oldest idle connection gives way, else the new one is refused
    /// (`503 too_many_connections`). Loopback probes share the address of
    /// loopback clients.
    pub max_connections_per_ip: usize,
}

impl Default for NetLimits {
    fn default() -> Self {
        NetLimits {
            header_read_timeout: Duration::from_millis(DEFAULT_HEADER_READ_TIMEOUT_MS),
            idle_timeout: Some(Duration::from_millis(DEFAULT_IDLE_TIMEOUT_MS)),
            body_read_timeout: Duration::from_millis(DEFAULT_BODY_READ_TIMEOUT_MS),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_ip: DEFAULT_MAX_CONNECTIONS_PER_IP,
        }
    }
}

impl NetLimits {
    /// Limits from milliseconds (`idle_timeout_ms` 0: off); errors name the field
    /// that is out of range.
    pub fn from_ms(
        header_read_timeout_ms: u64,
        idle_timeout_ms: u64,
        body_read_timeout_ms: u64,
        max_connections: usize,
        max_connections_per_ip: usize,
    ) -> anyhow::Result<NetLimits> {
        anyhow::ensure!(
            header_read_timeout_ms > 0,
            "header_read_timeout_ms must be at least 1"
        );
        anyhow::ensure!(
            body_read_timeout_ms > 0,
            "body_read_timeout_ms must be at least 1"
        );
        anyhow::ensure!(max_connections > 0, "max_connections must be at least 1");
        anyhow::ensure!(
            max_connections_per_ip > 0,
            "max_connections_per_ip must be at least 1"
        );
        Ok(NetLimits {
            header_read_timeout: Duration::from_millis(header_read_timeout_ms),
            idle_timeout: (idle_timeout_ms > 0).then(|| Duration::from_millis(idle_timeout_ms)),
            body_read_timeout: Duration::from_millis(body_read_timeout_ms),
            max_connections,
            max_connections_per_ip,
        })
    }
}

/// Connection options of a server command (each overrides the TOML file and the
/// default).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct NetArgs {
    /// Request headers must arrive within this many ms [default: 10000].
    #[arg(long, env = "HYPIC_HEADER_READ_TIMEOUT_MS")]
    pub header_read_timeout_ms: Option<u64>,
    /// Close a connection with no request in progress after this many ms
    /// (0: off) [default: 5000].
    #[arg(long, env = "HYPIC_IDLE_TIMEOUT_MS")]
    pub idle_timeout_ms: Option<u64>,
    /// A request body must arrive within this many ms of its headers [default: 30000].
    #[arg(long, env = "HYPIC_BODY_READ_TIMEOUT_MS")]
    pub body_read_timeout_ms: Option<u64>,
    /// Open connections at most [default: 8192].
    #[arg(long, env = "HYPIC_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Open connections from one peer IP address at most [default: 256].
    #[arg(long, env = "HYPIC_MAX_CONNECTIONS_PER_IP")]
    pub max_connections_per_ip: Option<usize>,
}

impl NetArgs {
    /// The limits these flags give over the defaults.
    pub fn limits(&self) -> anyhow::Result<NetLimits> {
        NetLimits::from_ms(
            self.header_read_timeout_ms
                .unwrap_or(DEFAULT_HEADER_READ_TIMEOUT_MS),
            self.idle_timeout_ms.unwrap_or(DEFAULT_IDLE_TIMEOUT_MS),
            self.body_read_timeout_ms
                .unwrap_or(DEFAULT_BODY_READ_TIMEOUT_MS),
            self.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS),
            self.max_connections_per_ip
                .unwrap_or(DEFAULT_MAX_CONNECTIONS_PER_IP),
        )
    }
}

/// The error a request body yields once its read deadline has passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyReadTimeout(pub Duration);

impl std::fmt::Display for BodyReadTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the request body was not received within {} ms",
            self.0.as_millis()
        )
    }
}

impl std::error::Error for BodyReadTimeout {}

impl BodyReadTimeout {
    /// Whether `e` or one of its sources is a body-read timeout.
    pub fn is_in(e: &(dyn std::error::Error + 'static)) -> bool {
        let mut cur = Some(e);
        while let Some(x) = cur {
            if x.is::<BodyReadTimeout>() {
                return true;
            }
            cur = x.source();
        }
        false
    }
}

/// A request body with a total read deadline.
struct DeadlineBody {
    inner: Incoming,
    limit: Duration,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl hyper::body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if let Poll::Ready(f) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(f.map(|r| r.map_err(Into::into)));
        }
        if this.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(Box::new(BodyReadTimeout(this.limit)))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Requests in progress on one connection and since when it is idle.
struct Activity {
    start: Instant,
    busy: AtomicUsize,
    idle_since_ms: AtomicU64,
}

impl Activity {
    fn idle_for(&self) -> Option<Duration> {
        if self.busy.load(Ordering::Acquire) > 0 {
            return None;
        }
        let since = Duration::from_millis(self.idle_since_ms.load(Ordering::Acquire));
        Some(self.start.elapsed().saturating_sub(since))
    }
}

/// Held while a request (and its response body) is in progress.
struct Busy(Arc<Activity>);

impl Busy {
    fn new(a: &Arc<Activity>) -> Busy {
        a.busy.fetch_add(1, Ordering::AcqRel);
        Busy(a.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let ms = self.0.start.elapsed().as_millis() as u64;
        self.0.idle_since_ms.store(ms, Ordering::Release);
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that ends the request's [`Busy`] and writes its log line when
/// it is finished or dropped.
struct TrackedBody {
    inner: Body,
    _busy: Busy,
    _log: reqlog::Pending,
}

impl hyper::body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

struct Slot {
    activity: Arc<Activity>,
    close: Arc<Notify>,
    ip: IpAddr,
}

/// The open connections, oldest first.
#[derive(Default)]
struct Registry {
    inner: Mutex<(u64, BTreeMap<u64, Slot>)>,
    /// Open connections per peer IP (counted until the connection's task ends).
    per_ip: Mutex<HashMap<IpAddr, usize>>,
}

/// A connection's place in the [`Registry`]; leaving it frees the place.
struct Admitted {
    id: u64,
    ip: IpAddr,
    reg: Arc<Registry>,
    activity: Arc<Activity>,
    close: Arc<Notify>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut g = self.reg.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.1.remove(&self.id);
        drop(g);
        let mut p = self.reg.per_ip.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = p.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                p.remove(&self.ip);
            }
        }
    }
}

impl Registry {
    /// A place for a new connection: at `max`, the oldest idle connection is told to
    /// close and gives up its place; `None` when every connection is busy.
    fn admit(self: &Arc<Self>, max: usize, per_ip: usize, ip: IpAddr) -> Result<Admitted, Refusal> {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut p = self.per_ip.lock().unwrap_or_else(|e| e.into_inner());
        if p.get(&ip).copied().unwrap_or(0) >= per_ip {
            // This address's oldest idle connection gives way (its count drops when
            // its task ends); none idle: refused.
            let victim =
                g.1.iter()
                    .find(|(_, s)| s.ip == ip && s.activity.busy.load(Ordering::Acquire) == 0)
                    .map(|(id, _)| *id)
                    .ok_or(Refusal::PerIp)?;
            if let Some(s) = g.1.remove(&victim) {
                s.close.notify_one();
            }
        }
        if g.1.len() >= max {
            let victim =
                g.1.iter()
                    .find(|(_, s)| s.activity.busy.load(Ordering::Acquire) == 0)
                    .map(|(id, _)| *id)
                    .ok_or(Refusal::Global)?;
            if let Some(s) = g.1.remove(&victim) {
                s.close.notify_one();
            }
        }
        g.0 += 1;
        let id = g.0;
        let activity = Arc::new(Activity {
            start: Instant::now(),
            busy: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
        });
        let close = Arc::new(Notify::new());
        g.1.insert(
            id,
            Slot {
                activity: activity.clone(),
                close: close.clone(),
                ip,
            },
        );
        *p.entry(ip).or_insert(0) += 1;
        Ok(Admitted {
            id,
            ip,
            reg: self.clone(),
            activity,
            close,
        })
    }
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// `max_connections` busy connections.
    Global,
    /// `max_connections_per_ip` busy connections from the same address.
    PerIp,
}

/// Connections refused at a connection cap since start: (global, per-IP).
pub static REFUSED_CONNECTIONS: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// The answer to a connection over the cap (OpenAI-style error body).
static REFUSED: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
    let body = r#"{"error":{"message":"too many open connections; retry later","type":"server_error","param":null,"code":"too_many_connections"}}"#;
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         connection: close\r\nretry-after: 1\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
});

/// Raises the soft open-file limit to the hard one and returns the connection cap
/// that fits under it.
// `rlim_t` is `u64` on some targets only.
#[allow(clippy::unnecessary_cast)]
fn fit_max_connections(max: usize) -> usize {
    #[cfg(unix)]
    {
        // SAFETY: getrlimit/setrlimit only read and write the struct passed in.
        unsafe {
            let mut r = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 {
                if r.rlim_cur < r.rlim_max {
                    let want = libc::rlimit {
                        rlim_cur: r.rlim_max,
                        rlim_max: r.rlim_max,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                        r.rlim_cur = r.rlim_max;
                    }
                }
                let room = (r.rlim_cur as u64).saturating_sub(FD_RESERVE).max(16);
                if (max as u64) > room {
                    tracing::warn!(
                        max_connections = max,
                        open_file_limit = r.rlim_cur as u64,
                        "max_connections lowered to {room} to fit the open-file limit"
                    );
                    return room as usize;
                }
            }
        }
    }
    max
}

/// Serves `app` on `listener` until `shutdown` completes, then stops accepting,
/// lets requests in progress finish and returns once every connection is closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: NetLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let max = fit_max_connections(limits.max_connections);
    let reg = Arc::new(Registry::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, remote) = tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of descriptors or memory: back off instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        match reg.admit(max, limits.max_connections_per_ip, remote.ip()) {
            Ok(adm) => {
                tasks.spawn(serve_connection(
                    stream,
                    remote,
                    app.clone(),
                    limits,
                    adm,
                    stop_rx.clone(),
                ));
            }
            Err(why) => {
                let (i, cap, what) = match why {
                    Refusal::Global => (0, max, "max_connections"),
                    Refusal::PerIp => (1, limits.max_connections_per_ip, "max_connections_per_ip"),
                };
                let n = REFUSED_CONNECTIONS[i].fetch_add(1, Ordering::Relaxed) + 1;
                // Warn on the 1st, 2nd, 4th, 8th, ... refusal: a flood cannot flood the log.
                if n.is_power_of_two() {
                    tracing::warn!(
                        %remote,
                        refused_total = n,
                        "connection refused (503 too_many_connections): {cap} connections busy ({what})"
                    );
                } else {
                    tracing::debug!(%remote, refused_total = n, "connection refused ({what})");
                }
                let _ = stream.try_write(&REFUSED);
            }
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    while tasks.join_next().await.is_some() {}
    Ok(())
}

async fn serve_connection(
    stream: TcpStream,
    remote: SocketAddr,
    app: Router,
    limits: NetLimits,
    adm: Admitted,
    mut stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let activity = adm.activity.clone();
    let act = activity.clone();
    let body_limit = limits.body_read_timeout;
    let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let busy = Busy::new(&act);
        let app = app.clone();
        let deadline = Box::pin(tokio::time::sleep(body_limit));
        let mut req = req.map(|inner| {
            Body::new(DeadlineBody {
                inner,
                limit: body_limit,
                deadline,
            })
        });
        req.extensions_mut().insert(ConnectInfo(remote));
        let log = reqlog::Pending::start(&mut req);
        async move {
            let resp = match app.oneshot(req).await {
                Ok(r) => r,
                Err(e) => match e {},
            };
            let (mut parts, body) = resp.into_parts();
            let log = log.respond(&mut parts);
            let body = Body::new(TrackedBody {
                inner: body,
                _busy: busy,
                _log: log,
            });
            Ok::<_, Infallible>(axum::response::Response::from_parts(parts, body))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    let conn = builder.serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    let mut draining = *stop.borrow();
    if draining {
        conn.as_mut().graceful_shutdown();
    }
    loop {
        // When to look at the idle clock again.
        let check = limits.idle_timeout.map(|t| match activity.idle_for() {
            Some(idle) => t.saturating_sub(idle),
            None => t,
        });
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(%remote, "connection closed: {e}");
                }
                return;
            }
            _ = adm.close.notified() => {
                // Evicted to make room: close now unless a request has just started.
                if activity.idle_for().is_some() {
                    return;
                }
                conn.as_mut().graceful_shutdown();
            }
            r = stop.changed(), if !draining => {
                draining = true;
                let _ = r;
                conn.as_mut().graceful_shutdown();
            }
            _ = tokio::time::sleep(check.unwrap_or_default()), if check.is_some() => {
                if let (Some(idle), Some(t)) = (activity.idle_for(), limits.idle_timeout) {
                    if idle >= t {
                        tracing::debug!(%remote, "idle connection closed after {} ms", idle.as_millis());
                        return;
                    }
                }
            }
        }
    }
}
