//! The server: binding, the model loading in the background, the state every request
//! shares (admission counters, metrics, the reasoning sealer, stored responses) and graceful
//! shutdown. Requests are routed by [`crate::routes`]; a generation request runs through
//! [`crate::admission`].

use crate::engine::Engine;
use crate::listen::{ConnCounters, ListenLimits};
use crate::metrics::Metrics;
use crate::ops::{self, BodyBudget};
pub use crate::state::ServerStats;
use crate::state::{AppState, EngineState, durable_state, unix_now};
use crate::{ServerConfig, models};
use axum::Router;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::watch;

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
                shutdown: AtomicBool::new(false),
                current: Mutex::new(Vec::new()),
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
                _ = shutdown => crate::log_line!("[deltafin serve] shutting down: no new connections, cancelling the running generations"),
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
