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

use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};

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
}

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

async fn get_weights(State(s): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(r) = authorised(&s, &headers) {
        return r.into_response();
    }
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

async fn post_weights(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(r) = authorised(&s, &headers) {
        return r.into_response();
    }
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

async fn status(State(s): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(r) = authorised(&s, &headers) {
        return r.into_response();
    }
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
        };
        let app = Router::new()
            .route(
                "/api/v1/reward/weights",
                get(get_weights).post(post_weights),
            )
            .route("/api/v1/status", get(status))
            .fallback(not_found)
            .layer(DefaultBodyLimit::max(cfg.max_body_bytes))
            .with_state(state);
        let (tx_addr, rx_addr) = std::sync::mpsc::channel::<Result<SocketAddr, String>>();
        let (tx_stop, rx_stop) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("reward-control".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_io()
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
                    let serve = axum::serve(listener, app).with_graceful_shutdown(async {
                        let _ = rx_stop.await;
                    });
                    if let Err(e) = serve.await {
                        tracing::warn!("reward.control server stopped: {e}");
                    }
                });
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
