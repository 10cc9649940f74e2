//! What every request handler shares: the engine's state, the queue, counters,
//! the reasoning sealer and the response store ([`AppState`]). The listener that owns it is
//! [`crate::server`].

use crate::ServerConfig;
use crate::engine::Engine;
use crate::error::ApiError;
use crate::listen::ConnCounters;
use crate::metrics::{Metrics, Snapshot};
use crate::ops::BodyBudget;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;

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
    /// Live reservations: the running generations plus queued requests.
    pub reserved: AtomicUsize,
}

pub(crate) struct AppState {
    pub(crate) cfg: ServerConfig,
    pub(crate) created: u64,
    pub(crate) started: Instant,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) engine: watch::Receiver<EngineState>,
    pub(crate) shutdown: AtomicBool,
    /// The interrupt flags of the running generations.
    pub(crate) current: Mutex<Vec<Arc<AtomicBool>>>,
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

/// A reservation of a generation slot or a queue place, held from when the request is validated
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
    /// A place among the `parallel` running generations and the `--queue` waiters.
    pub(crate) fn try_reserve(&self, parallel: usize) -> Option<Ticket> {
        let cap = parallel + self.cfg.queue;
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
            sequences: engine.as_ref().map(|e| {
                let sh = &e.sharing;
                crate::metrics::SequencesNow {
                    parallel: sh.parallel,
                    active: sh.running(),
                    reserve_bytes: sh.reserve_bytes,
                    reserved_bytes: sh.reserved_bytes(),
                    batch: sh.batcher.as_ref().map(|b| b.stats()).unwrap_or_default(),
                }
            }),
        }
    }

    pub(crate) fn begin_shutdown(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
        if let Ok(cur) = self.current.lock() {
            for flag in cur.iter() {
                flag.store(true, Ordering::SeqCst);
            }
        }
    }
}

/// The reasoning sealer and the response store of `cfg`: in its state directory when one
/// is given and writable, else in memory (the log says which and why).
pub(crate) fn durable_state(
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
