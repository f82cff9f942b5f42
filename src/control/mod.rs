//! The reward control API (`reward.control`): an HTTP server on its own thread through which an
//! operator reads and changes reward-source weights while a run goes on.
//!
//! - `GET  /api/v1/reward/weights` → `{"<source>": weight, ...}` (the weights the next step uses)
//! - `POST /api/v1/reward/weights` with a JSON object of some or all weights → applied from the
//!   next step; the full set of weights is echoed back
//! - `GET  /api/v1/status` → `{"step", "total_steps", "weights", "metrics"}` (the last step's)
//!
//! Every rejected request (malformed JSON, not an object, unknown source, negative or non-number
//! weight, oversized body, missing or wrong bearer token) gets a 4xx with `{"error": "..."}` and
//! changes nothing. The trainer only ever takes a mutex for a copy, so it never waits on a client.
//!
//! What a client can hold is bounded ([`Limits`]): the token and a declared `Content-Length`
//! are checked from the headers alone, before any body byte is read; the request line and headers
//! must arrive within `header_timeout` and fit in 16 KiB; a connection that moves no byte for
//! `idle_timeout` is closed, as is any connection older than `connection_lifetime`; and at most
//! `max_connections` are open at once (more are closed on accept).

use std::collections::BTreeMap;
use std::future::Future;
use std::net::{SocketAddr, ToSocketAddrs};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::config::reward::RewardControlConfig;
use crate::metrics::Metrics;

#[derive(Debug, Default)]
struct Shared {
    /// The weights the next step uses.
    weights: BTreeMap<String, f64>,
    /// Set by a POST, cleared when the trainer takes the weights.
    changed: bool,
    step: u64,
    total_steps: u64,
    metrics: Metrics,
}

#[derive(Clone)]
struct AppState {
    shared: Arc<Mutex<Shared>>,
    token: Option<String>,
    max_body_bytes: usize,
}

/// How much time and how many connections a client may hold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// The request line and headers must be complete within this time.
    pub header_timeout: Duration,
    /// A connection that sends or receives nothing for this long is closed.
    pub idle_timeout: Duration,
    /// No connection stays open longer than this.
    pub connection_lifetime: Duration,
    /// Connections open at once; more are closed as soon as they are accepted.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            connection_lifetime: Duration::from_secs(120),
            max_connections: 64,
        }
    }
}

/// The request line plus headers may use at most this many bytes (hyper's smallest buffer is
/// 8 KiB; a longer head is answered 431).
const MAX_HEAD_BYTES: usize = 16 * 1024;

/// A running control server; dropping it stops the server.
pub struct ControlServer {
    pub addr: SocketAddr,
    shared: Arc<Mutex<Shared>>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A rejected request: its status and message (`{"error": "..."}`).
struct Reject(StatusCode, String);

impl IntoResponse for Reject {
    fn into_response(self) -> Response {
        let mut r = (self.0, axum::Json(json!({"error": self.1}))).into_response();
        if self.0 == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, "Bearer".parse().expect("header"));
        }
        r
    }
}

fn error(status: StatusCode, message: impl Into<String>) -> Reject {
    Reject(status, message.into())
}

fn authorised(state: &AppState, headers: &HeaderMap) -> Result<(), Reject> {
    let Some(token) = &state.token else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Compare every byte whatever the first difference (no early exit on a prefix match).
    let ok = given.is_some_and(|g| {
        g.len() == token.len()
            && g.bytes()
                .zip(token.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    });
    if ok {
        Ok(())
    } else {
        Err(error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token (Authorization: Bearer <reward.control.token>)",
        ))
    }
}

/// Runs on the request head, before any handler reads the body: the token, then the declared
/// body size. A rejected request's body is never read (hyper closes the connection instead).
async fn check_head(State(s): State<AppState>, req: Request, next: Next) -> Response {
    if let Err(r) = authorised(&s, req.headers()) {
        return r.into_response();
    }
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(n) = declared {
        if n > s.max_body_bytes as u64 {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the body declares {n} bytes, more than reward.control.max_body_bytes ({})",
                    s.max_body_bytes
                ),
            )
            .into_response();
        }
    }
    next.run(req).await
}

async fn get_weights(State(s): State<AppState>) -> Response {
    let w = s.shared.lock().expect("control state").weights.clone();
    axum::Json(w).into_response()
}

/// Validates a POST body against the known sources: the new weights, or the 4xx to send.
fn parse_update(
    body: &[u8],
    known: &BTreeMap<String, f64>,
) -> Result<BTreeMap<String, f64>, Reject> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| error(StatusCode::BAD_REQUEST, format!("malformed JSON: {e}")))?;
    let Value::Object(obj) = v else {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "the body must be a JSON object {\"<source>\": weight, ...}",
        ));
    };
    if obj.is_empty() {
        return Err(error(StatusCode::BAD_REQUEST, "no weights given"));
    }
    let mut out = BTreeMap::new();
    for (name, w) in obj {
        if !known.contains_key(&name) {
            return Err(error(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!(
                    "unknown reward source `{name}` (sources: {})",
                    known.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            ));
        }
        let Some(x) = w.as_f64() else {
            return Err(error(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("the weight of `{name}` must be a number, got {w}"),
            ));
        };
        if !(x.is_finite() && x >= 0.0) {
            return Err(error(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("the weight of `{name}` must be a finite number >= 0, got {x}"),
            ));
        }
        out.insert(name, x);
    }
    Ok(out)
}

async fn post_weights(State(s): State<AppState>, body: Bytes) -> Response {
    let mut shared = s.shared.lock().expect("control state");
    let update = match parse_update(&body, &shared.weights) {
        Ok(u) => u,
        Err(r) => return r.into_response(),
    };
    for (k, v) in update {
        shared.weights.insert(k, v);
    }
    shared.changed = true;
    let echo = shared.weights.clone();
    drop(shared);
    tracing::info!("reward.control: weights for the next step: {echo:?}");
    axum::Json(echo).into_response()
}

async fn status(State(s): State<AppState>) -> Response {
    let shared = s.shared.lock().expect("control state");
    let metrics: serde_json::Map<String, Value> = shared
        .metrics
        .iter()
        .map(|(k, v)| (k.clone(), Value::from(*v)))
        .collect();
    axum::Json(json!({
        "step": shared.step,
        "total_steps": shared.total_steps,
        "weights": shared.weights,
        "metrics": metrics,
    }))
    .into_response()
}

async fn not_found() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "unknown path (GET/POST /api/v1/reward/weights, GET /api/v1/status)",
    )
    .into_response()
}

impl ControlServer {
    /// Binds `host:port` and serves on a new thread. A non-loopback address without a token is
    /// refused: anyone on the network could change the reward.
    pub fn start(
        cfg: &RewardControlConfig,
        weights: BTreeMap<String, f64>,
        total_steps: u64,
    ) -> Result<Self, String> {
        Self::start_with(cfg, weights, total_steps, Limits::default())
    }

    /// As [`ControlServer::start`], with explicit connection limits.
    pub fn start_with(
        cfg: &RewardControlConfig,
        weights: BTreeMap<String, f64>,
        total_steps: u64,
        limits: Limits,
    ) -> Result<Self, String> {
        let at = format!("reward.control.host={}:{}", cfg.host, cfg.port);
        let addrs: Vec<SocketAddr> = (cfg.host.as_str(), cfg.port)
            .to_socket_addrs()
            .map_err(|e| format!("{at}: cannot resolve: {e}"))?
            .collect();
        let addr = *addrs
            .first()
            .ok_or_else(|| format!("{at}: resolves to no address"))?;
        if cfg.token.is_none() && addrs.iter().any(|a| !a.ip().is_loopback()) {
            return Err(format!(
                "{at} is reachable from other machines and reward.control.token is not set: set a token, or bind 127.0.0.1"
            ));
        }
        let shared = Arc::new(Mutex::new(Shared {
            weights,
            total_steps,
            ..Default::default()
        }));
        let state = AppState {
            shared: shared.clone(),
            token: cfg.token.clone(),
            max_body_bytes: cfg.max_body_bytes,
        };
        let app = Router::new()
            .route(
                "/api/v1/reward/weights",
                get(get_weights).post(post_weights),
            )
            .route("/api/v1/status", get(status))
            .fallback(not_found)
            // A body without a declared length (chunked) is cut off at the limit while read.
            .layer(DefaultBodyLimit::max(cfg.max_body_bytes))
            .layer(axum::middleware::from_fn_with_state(
                state.clone(),
                check_head,
            ))
            .with_state(state);
        let (tx_addr, rx_addr) = std::sync::mpsc::channel::<Result<SocketAddr, String>>();
        let (tx_stop, rx_stop) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("reward-control".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_io()
                    .enable_time()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx_addr.send(Err(format!("cannot start the runtime: {e}")));
                        return;
                    }
                };
                rt.block_on(async move {
                    let listener = match tokio::net::TcpListener::bind(addr).await {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = tx_addr.send(Err(format!("{at}: cannot bind: {e}")));
                            return;
                        }
                    };
                    let bound = listener.local_addr().map_err(|e| e.to_string());
                    let _ = tx_addr.send(bound);
                    serve(listener, app, limits, rx_stop).await;
                });
                // Dropping the runtime here ends every open connection.
            })
            .map_err(|e| format!("cannot start the control thread: {e}"))?;
        let addr = rx_addr
            .recv()
            .map_err(|_| "the control thread ended before binding".to_string())??;
        tracing::info!("reward.control: serving http://{addr}/api/v1/reward/weights");
        Ok(Self {
            addr,
            shared,
            shutdown: Some(tx_stop),
            thread: Some(thread),
        })
    }

    /// The weights posted since the last call, if any (the trainer applies them to the next
    /// step).
    pub fn take_changes(&self) -> Option<BTreeMap<String, f64>> {
        let mut s = self.shared.lock().expect("control state");
        if s.changed {
            s.changed = false;
            Some(s.weights.clone())
        } else {
            None
        }
    }

    /// Replaces the served weights (after a resume restored them).
    pub fn set_weights(&self, w: BTreeMap<String, f64>) {
        let mut s = self.shared.lock().expect("control state");
        s.weights = w;
        s.changed = false;
    }

    /// Publishes a finished step for `GET /api/v1/status`.
    pub fn publish(&self, step: u64, metrics: &Metrics) {
        let mut s = self.shared.lock().expect("control state");
        s.step = step;
        s.metrics = metrics.clone();
    }
}

/// Accepts connections until `stop` fires; each is served by hyper's HTTP/1 with the header
/// timeout, idle timeout, lifetime and connection cap of `limits`.
async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: Limits,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    loop {
        let accepted = tokio::select! {
            _ = &mut stop => return,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(e) => {
                // Out of file descriptors and the like: wait instead of spinning.
                tracing::warn!("reward.control: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(
                "reward.control: {} connections already open; closing a new one",
                limits.max_connections
            );
            drop(stream);
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let io = hyper_util::rt::TokioIo::new(IdleTimeout::new(stream, limits.idle_timeout));
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .max_buf_size(MAX_HEAD_BYTES);
            let conn = http.serve_connection(io, service);
            match tokio::time::timeout(limits.connection_lifetime, conn).await {
                Ok(Err(e)) => tracing::debug!("reward.control: connection ended: {e}"),
                Err(_) => tracing::debug!("reward.control: connection closed at its lifetime"),
                Ok(Ok(())) => {}
            }
        });
    }
}

/// A stream that fails with `TimedOut` once no byte has moved either way for `idle`.
struct IdleTimeout<T> {
    inner: T,
    idle: Duration,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl<T> IdleTimeout<T> {
    fn new(inner: T, idle: Duration) -> Self {
        Self {
            inner,
            idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
        }
    }

    fn moved(&mut self) {
        let next = tokio::time::Instant::now() + self.idle;
        self.deadline.as_mut().reset(next);
    }

    /// `Pending` from the stream becomes an error once the deadline has passed.
    fn pending_or_expired<R>(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<R>> {
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "idle connection closed",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for IdleTimeout<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.moved();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => this.pending_or_expired(cx),
            other => other,
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for IdleTimeout<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_write(cx, data) {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    this.moved();
                }
                Poll::Ready(Ok(n))
            }
            Poll::Pending => this.pending_or_expired(cx),
            other => other,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_flush(cx) {
            Poll::Pending => this.pending_or_expired(cx),
            other => other,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
