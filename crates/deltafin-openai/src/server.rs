//! The server: binding, the model loading in the background, the state every request
//! shares (admission counters, metrics, the reasoning sealer, stored responses) and graceful
//! shutdown. Requests are routed by [`crate::routes`]; a generation request runs through
//! [`crate::admission`].

use crate::engine::Engine;
use crate::error::ApiError;
use crate::listen::{ConnCounters, ListenLimits};
use crate::metrics::{Metrics, Snapshot};
use crate::ops::{self, BodyBudget};
use crate::{ServerConfig, models};
use axum::Router;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

pub use crate::ops::{BODY_DEADLINE, BODY_IDLE_TIMEOUT};
/// Default time a request head may take to arrive, and an idle keep-alive connection may
/// stay open (`ServerConfig::header_deadline`).
pub const HEADER_DEADLINE: Duration = Duration::from_secs(30);
/// After a shutdown signal, connections still open after this long are abandoned.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// `host:port` as given.
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The model failed to load.
    #[error("{0}")]
    Load(String),
    /// A setting of [`ServerConfig`] is invalid (a model alias).
    #[error("{0}")]
    Config(String),
    /// The HTTP server failed.
    #[error("server error: {0}")]
    Io(#[from] std::io::Error),
}

/// Where the model is.
#[derive(Clone)]
pub(crate) enum EngineState {
    Loading,
    Ready(Arc<Engine>),
    Failed(String),
}

/// Counters a caller (tests, logs) can read while the server runs.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Generations that started on the engine.
    pub generations_started: AtomicU64,
    /// Generations that ran to their end (stop, length, or an engine error).
    pub generations_finished: AtomicU64,
    /// Generations cancelled because their client left (or shutdown).
    pub generations_cancelled: AtomicU64,
    /// Requests answered 429.
    pub busy_rejections: AtomicU64,
    /// Live reservations: the running generation plus queued requests.
    pub reserved: AtomicUsize,
}

pub(crate) struct AppState {
    pub(crate) cfg: ServerConfig,
    pub(crate) created: u64,
    pub(crate) started: Instant,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) engine: watch::Receiver<EngineState>,
    pub(crate) slot: Arc<Semaphore>,
    pub(crate) shutdown: AtomicBool,
    pub(crate) current: Mutex<Option<Arc<AtomicBool>>>,
    pub(crate) stats: Arc<ServerStats>,
    pub(crate) seq: AtomicU64,
    /// Whether the listener is on a loopback address (the `Host` check applies).
    pub(crate) loopback: bool,
    /// Open and refused connections.
    pub(crate) conns: Arc<ConnCounters>,
    /// Bytes of request bodies being read and validated.
    pub(crate) bodies: Arc<BodyBudget>,
    /// Seals answers' reasoning for clients to send back.
    pub(crate) sealer: crate::seal::Sealer,
    /// Stored Responses (`None`: `--response-store-gb 0`).
    pub(crate) store: Option<Arc<crate::responses::store::Store>>,
}

/// A reservation of the slot or a queue place, held from when the request is validated
/// until its generation has stopped.
pub(crate) struct Ticket(Arc<ServerStats>);

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.reserved.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl AppState {
    pub(crate) fn try_reserve(&self) -> Option<Ticket> {
        let cap = 1 + self.cfg.queue;
        self.stats
            .reserved
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < cap).then_some(n + 1)
            })
            .ok()
            .map(|_| Ticket(self.stats.clone()))
    }

    /// 20 hex digits unique to one response: 8 of time, 12 of sequence.
    pub(crate) fn id_suffix(&self) -> String {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        format!("{:08x}{:012x}", unix_now() as u32, seq & 0xffff_ffff_ffff)
    }

    /// The engine, or why requests cannot use it yet.
    pub(crate) fn ready_engine(&self) -> Result<Arc<Engine>, ApiError> {
        if self.shutdown.load(Ordering::SeqCst) {
            return Err(ApiError::shutting_down());
        }
        match &*self.engine.borrow() {
            EngineState::Loading => Err(ApiError::loading()),
            EngineState::Failed(e) => {
                Err(ApiError::server(format!("the model failed to load: {e}")))
            }
            EngineState::Ready(e) => Ok(e.clone()),
        }
    }

    /// What `/metrics` reads besides the request counters.
    pub(crate) fn snapshot(&self) -> Snapshot {
        let started = self.stats.generations_started.load(Ordering::SeqCst);
        let finished = self.stats.generations_finished.load(Ordering::SeqCst);
        let cancelled = self.stats.generations_cancelled.load(Ordering::SeqCst);
        let running = started.saturating_sub(finished + cancelled) as usize;
        let reserved = self.stats.reserved.load(Ordering::SeqCst);
        let engine = match &*self.engine.borrow() {
            EngineState::Ready(e) => Some(e.clone()),
            _ => None,
        };
        Snapshot {
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            ready: engine.is_some(),
            busy: running > 0,
            queue_depth: reserved.saturating_sub(running),
            queue_capacity: self.cfg.queue,
            generations_finished: finished,
            generations_cancelled: cancelled,
            host_experts: engine.as_ref().and_then(|e| e.model.experts.stats()),
            device_experts: engine
                .as_ref()
                .and_then(|e| e.model.device_experts.as_ref().map(|c| c.stats())),
            state_cache: engine
                .as_ref()
                .and_then(|e| e.prefix.as_ref().map(|c| c.stats())),
            memo: engine.as_ref().map(|e| e.memo.stats()),
            connections_open: self.conns.open.load(Ordering::SeqCst),
            connections_refused: self.conns.refused.load(Ordering::Relaxed),
            body_bytes_held: self.bodies.held(),
        }
    }

    fn begin_shutdown(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
        if let Ok(cur) = self.current.lock()
            && let Some(flag) = cur.as_ref()
        {
            flag.store(true, Ordering::SeqCst);
        }
    }
}

/// The reasoning sealer and the response store of `cfg`: in its state directory when one
/// is given and writable, else in memory (the log says which and why).
fn durable_state(
    cfg: &ServerConfig,
) -> (
    crate::seal::Sealer,
    Option<Arc<crate::responses::store::Store>>,
) {
    use crate::responses::store::Store;
    use crate::seal::Sealer;
    let sealer = match &cfg.state_dir {
        Some(dir) => Sealer::in_dir(dir).unwrap_or_else(|why| {
            crate::log_line!(
                "[deltafin serve] reasoning tokens are sealed with a key in memory ({why}): reasoning handed out before a restart cannot be sent back after it"
            );
            Sealer::ephemeral()
        }),
        None => Sealer::ephemeral(),
    };
    let budget = cfg.response_store_bytes;
    let store = (budget > 0).then(|| match &cfg.state_dir {
        Some(dir) => Store::in_dir(dir, budget).unwrap_or_else(|why| {
            crate::log_line!(
                "[deltafin serve] stored responses are kept in memory ({why}): they do not survive a restart"
            );
            Store::in_memory(budget)
        }),
        None => Store::in_memory(budget),
    });
    (sealer, store.map(Arc::new))
}

/// A bound server whose model loads in the background.
pub struct Server {
    listener: TcpListener,
    state: Arc<AppState>,
}

impl Server {
    /// Binds `cfg.host:cfg.port` and starts loading the model at `model_root` on a
    /// background thread; `/v1/models` answers at once, completions get 503 until ready.
    pub async fn bind(
        cfg: ServerConfig,
        model_root: std::path::PathBuf,
    ) -> Result<Server, ServeError> {
        Self::bind_with_loader(cfg, move || {
            Engine::load(&model_root).map_err(|e| e.to_string())
        })
        .await
    }

    /// [`Server::bind`] loading through the engine builder with `engine` (memory budget,
    /// streaming, spine format, device).
    pub async fn bind_with_engine_config(
        cfg: ServerConfig,
        model_root: std::path::PathBuf,
        engine: deltafin_k3::engine::EngineConfig,
    ) -> Result<Server, ServeError> {
        Self::bind_with_loader(cfg, move || {
            Engine::load_with(&model_root, &engine).map_err(|e| e.to_string())
        })
        .await
    }

    /// [`Server::bind`] with any loader (run on a background thread).
    pub async fn bind_with_loader(
        cfg: ServerConfig,
        loader: impl FnOnce() -> Result<Engine, String> + Send + 'static,
    ) -> Result<Server, ServeError> {
        models::check_model_aliases(&cfg.model_aliases).map_err(ServeError::Config)?;
        let addr = format!("{}:{}", cfg.host, cfg.port);
        let listener = TcpListener::bind((cfg.host.as_str(), cfg.port))
            .await
            .map_err(|source| ServeError::Bind { addr, source })?;
        let loopback = listener.local_addr().map_or(true, |a| a.ip().is_loopback());
        let cfg_body_budget = cfg
            .max_request_bytes
            .saturating_mul(ops::BODY_BUDGET_REQUESTS);
        let (sealer, store) = durable_state(&cfg);
        let (tx, rx) = watch::channel(EngineState::Loading);
        std::thread::spawn(move || {
            let t = std::time::Instant::now();
            // A loader that panics fails the load like one that returns an error: the
            // server reports it and stops, instead of answering 503 "loading" forever.
            let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(loader))
                .unwrap_or_else(|p| {
                    let why = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "no message".into());
                    Err(format!("the model loader panicked: {why}"))
                });
            let state = match loaded {
                Ok(engine) => {
                    crate::log_line!(
                        "[deltafin serve] model ready in {:.2}s (context {} positions)",
                        t.elapsed().as_secs_f64(),
                        engine.max_context
                    );
                    EngineState::Ready(Arc::new(engine))
                }
                Err(e) => EngineState::Failed(e),
            };
            let _ = tx.send(state);
        });
        Ok(Server {
            listener,
            state: Arc::new(AppState {
                cfg,
                created: unix_now(),
                started: Instant::now(),
                metrics: Arc::new(Metrics::default()),
                engine: rx,
                slot: Arc::new(Semaphore::new(1)),
                shutdown: AtomicBool::new(false),
                current: Mutex::new(None),
                stats: Arc::new(ServerStats::default()),
                seq: AtomicU64::new(0),
                loopback,
                conns: Arc::new(ConnCounters::default()),
                bodies: Arc::new(BodyBudget::new(cfg_body_budget)),
                sealer,
                store,
            }),
        })
    }

    /// The bound address (with the real port when 0 was asked for).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Live counters.
    pub fn stats(&self) -> Arc<ServerStats> {
        self.state.stats.clone()
    }

    /// Serves until `shutdown` completes (then stops accepting, cancels the running
    /// generation and waits up to [`SHUTDOWN_GRACE`] for open connections) or the model
    /// fails to load (an error).
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        let state = self.state.clone();
        let mut engine_rx = state.engine.clone();
        let signal_state = state.clone();
        let signal = async move {
            // The loader drops its sender once done: only a failure ends the wait.
            let load_failed = async move {
                if engine_rx
                    .wait_for(|s| matches!(s, EngineState::Failed(_)))
                    .await
                    .is_err()
                {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                _ = shutdown => crate::log_line!("[deltafin serve] shutting down: no new connections, cancelling the running generation"),
                _ = load_failed => {}
            }
            signal_state.begin_shutdown();
        };
        let app = Router::new()
            .fallback(crate::routes::route)
            .with_state(state.clone());
        let limits = ListenLimits {
            max_connections: state.cfg.max_connections,
            header_deadline: state.cfg.header_deadline,
        };
        let drained = crate::listen::serve(
            self.listener,
            app,
            limits,
            state.conns.clone(),
            signal,
            SHUTDOWN_GRACE,
        )
        .await;
        if !drained {
            crate::log_line!(
                "[deltafin serve] connections still open after {}s; exiting",
                SHUTDOWN_GRACE.as_secs()
            );
        }
        if let EngineState::Failed(e) = &*state.engine.borrow() {
            return Err(ServeError::Load(e.clone()));
        }
        Ok(())
    }
}
