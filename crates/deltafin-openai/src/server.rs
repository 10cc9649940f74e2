//! The HTTP side: routing, admission (one generation plus a bounded FIFO queue), body limits,
//! JSON and SSE responses, disconnect cancellation and graceful shutdown; the request log
//! and the counters of `/metrics`.

use crate::access::{self, Admit};
use crate::conn::{CancelOnDrop, ClientConn, ClientLeft, abandoned, unless_gone};
use crate::engine::{Ending, Engine, GenEvent, prefill_comment, run_generation_timed};
use crate::error::{ApiError, json_response};
use crate::listen::{ConnCounters, ListenLimits};
use crate::messages::{self, MessagesMeta, reply::MessagesReply};
use crate::metrics::{CLIENT_CLOSED, Metrics, RequestLog, Snapshot};
use crate::ops::{self, BodyBudget, TokenizerOp, read_body};
use crate::output::Delta;
use crate::reply::ReplyContext;
use crate::request::{self, Limits, Surface};
use crate::response::Shape;
use crate::responses::{self, ResponsesMeta, reply::ResponsesReply};
use crate::transport::{answer_with, sse_headers};
use crate::{MODEL_ID, ServerConfig, bench, models, page, status};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc, watch};

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
enum EngineState {
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

struct AppState {
    cfg: ServerConfig,
    created: u64,
    started: Instant,
    metrics: Arc<Metrics>,
    engine: watch::Receiver<EngineState>,
    slot: Arc<Semaphore>,
    shutdown: AtomicBool,
    current: Mutex<Option<Arc<AtomicBool>>>,
    stats: Arc<ServerStats>,
    seq: AtomicU64,
    /// Whether the listener is on a loopback address (the `Host` check applies).
    loopback: bool,
    /// Open and refused connections.
    conns: Arc<ConnCounters>,
    /// Bytes of request bodies being read and validated.
    bodies: Arc<BodyBudget>,
}

/// A reservation of the slot or a queue place, held from when the request is validated
/// until its generation has stopped.
struct Ticket(Arc<ServerStats>);

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.reserved.fetch_sub(1, Ordering::SeqCst);
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl AppState {
    fn try_reserve(&self) -> Option<Ticket> {
        let cap = 1 + self.cfg.queue;
        self.stats
            .reserved
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < cap).then_some(n + 1)
            })
            .ok()
            .map(|_| Ticket(self.stats.clone()))
    }

    fn response_id(&self, prefix: &str) -> String {
        format!("{prefix}-{}", self.id_suffix())
    }

    /// 20 hex digits unique to one response: 8 of time, 12 of sequence.
    fn id_suffix(&self) -> String {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        format!("{:08x}{:012x}", unix_now() as u32, seq & 0xffff_ffff_ffff)
    }

    /// The engine, or why requests cannot use it yet.
    fn ready_engine(&self) -> Result<Arc<Engine>, ApiError> {
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
    fn snapshot(&self) -> Snapshot {
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
        let app = Router::new().fallback(route).with_state(state.clone());
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

/// Which API a generation request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Api {
    /// OpenAI's completions or chat completions.
    OpenAi(Surface),
    /// Anthropic's Messages API (`/v1/messages`).
    Messages,
    /// OpenAI's Responses API (`/v1/responses`).
    Responses,
}

impl Api {
    /// The error in this API's shape.
    fn error(self, e: ApiError) -> Response {
        match self {
            Api::Messages => e.response_with_body(&messages::wire::error_body(&e)),
            Api::OpenAi(_) | Api::Responses => e.into_response(),
        }
    }
}

/// The endpoint-specific part of a validated request.
enum Front {
    OpenAi(Surface),
    Messages(MessagesMeta),
    Responses(ResponsesMeta),
}

/// Every request: its id, its answer, then (when the answer's body is done) its log line
/// and its count.
async fn route(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let api = match path.as_str() {
        "/v1/completions" | "/completions" => Some(Api::OpenAi(Surface::Completions)),
        "/v1/chat/completions" | "/chat/completions" => Some(Api::OpenAi(Surface::Chat)),
        "/v1/messages" => Some(Api::Messages),
        "/v1/responses" | "/responses" => Some(Api::Responses),
        _ => None,
    };
    let prefix = match api {
        Some(Api::OpenAi(Surface::Completions)) => "cmpl",
        Some(Api::OpenAi(Surface::Chat)) => "chatcmpl",
        Some(Api::Messages) => "msg",
        Some(Api::Responses) => "resp",
        None => "req",
    };
    let log = RequestLog::new(
        state.metrics.clone(),
        method.as_str(),
        &path,
        &state.response_id(prefix),
        api.is_some(),
    );
    let admitted = access::check(
        &state.cfg.access,
        &state.cfg.host,
        state.loopback,
        &method,
        &path,
        req.headers(),
    );
    let mut resp = match admitted {
        Ok(Admit::Serve(cors)) => {
            let mut resp = dispatch(&state, req, &path, &method, api, &log).await;
            access::add_cors(resp.headers_mut(), cors);
            resp
        }
        Ok(Admit::Answered(resp)) => resp,
        Err(e) => match api {
            Some(a) => a.error(e),
            None => e.into_response(),
        },
    };
    log.set_status(if resp.extensions().get::<ClientLeft>().is_some() {
        CLIENT_CLOSED
    } else {
        resp.status().as_u16()
    });
    if let Ok(v) = HeaderValue::from_str(log.id()) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

async fn dispatch(
    state: &Arc<AppState>,
    req: Request,
    path: &str,
    method: &Method,
    api: Option<Api>,
    log: &RequestLog,
) -> Response {
    let get = method == Method::GET || method == Method::HEAD;
    let answer = |ok: bool, f: &dyn Fn() -> Response| {
        if ok {
            f()
        } else {
            ApiError::method_not_allowed().into_response()
        }
    };
    let aliases = &state.cfg.model_aliases;
    let api = match (path, api) {
        (_, Some(a)) => a,
        ("/v1/models" | "/models", _) => {
            return answer(method == Method::GET, &|| {
                let data: Vec<Value> = std::iter::once(MODEL_ID)
                    .chain(aliases.iter().map(String::as_str))
                    .map(|id| model_object(state, id))
                    .collect();
                json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
            });
        }
        ("/health" | "/v1/health", _) => {
            return answer(get, &|| ops::health(state.ready_engine().map(drop)));
        }
        ("/metrics", _) => {
            return answer(get, &|| ops::metrics(&state.metrics, &state.snapshot()));
        }
        ("/v1/status", _) => {
            return answer(get, &|| {
                let c = state.metrics.counters();
                status::status(&state.cfg, &c, &state.snapshot(), state.ready_engine())
            });
        }
        (bench::RESULT_PATH | bench::PLOT_PATH, _) if get => {
            return bench::serve(path, state.cfg.benchmark_dir.clone()).await;
        }
        (bench::RESULT_PATH | bench::PLOT_PATH, _) => {
            return ApiError::method_not_allowed().into_response();
        }
        (p, _) if page::is_page(p) => {
            return match page::serve(p, req.headers()) {
                Some(resp) if get => resp,
                _ => ApiError::method_not_allowed().into_response(),
            };
        }
        ("/tokenize" | "/detokenize", _) => {
            if method != Method::POST {
                return ApiError::method_not_allowed().into_response();
            }
            let op = if path == "/tokenize" {
                TokenizerOp::Tokenize
            } else {
                TokenizerOp::Detokenize
            };
            let limit = state.cfg.max_request_bytes;
            let result = match state.ready_engine() {
                Ok(engine) => {
                    ops::tokenizer(
                        engine,
                        req,
                        limit,
                        state.cfg.body_deadline,
                        &state.bodies,
                        op,
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            return result.unwrap_or_else(IntoResponse::into_response);
        }
        (p, _) => {
            let id = p
                .strip_prefix("/v1/models/")
                .or_else(|| p.strip_prefix("/models/"));
            return match id {
                Some(id) if method == Method::GET => {
                    if models::is_served(id, aliases) {
                        json_response(StatusCode::OK, &model_object(state, id))
                    } else {
                        ApiError::model_not_found(id, aliases).into_response()
                    }
                }
                Some(_) => ApiError::method_not_allowed().into_response(),
                None => ApiError::not_found().into_response(),
            };
        }
    };
    if method != Method::POST {
        return api.error(ApiError::method_not_allowed());
    }
    if api == Api::Messages
        && let Err(e) = messages::check_headers(req.headers())
    {
        return api.error(e);
    }
    let conn = req
        .extensions()
        .get::<axum::extract::ConnectInfo<ClientConn>>()
        .map(|c| c.0.clone())
        .unwrap_or(ClientConn {
            #[cfg(unix)]
            sock: None,
        });
    match generate(state.clone(), api, req, conn, log.clone()).await {
        Ok(resp) => resp,
        Err(e) => api.error(e),
    }
}

fn model_object(state: &AppState, id: &str) -> Value {
    json!({"id": id, "object": "model", "created": state.created, "owned_by": "deltafin"})
}

async fn generate(
    state: Arc<AppState>,
    api: Api,
    req: Request,
    conn: ClientConn,
    log: RequestLog,
) -> Result<Response, ApiError> {
    let engine = state.ready_engine()?;
    // The body is read and the request validated before it takes a place: a slow or
    // malformed request never keeps a valid one out. Meanwhile its bytes count against the
    // body budget.
    let (body, hold) = read_body(
        req,
        state.cfg.max_request_bytes,
        state.cfg.body_deadline,
        &state.bodies,
    )
    .await?;
    let json: Value = serde_json::from_slice(&body)
        .map_err(|_| ApiError::invalid("request body must be valid JSON"))?;
    drop(body);
    let limits = Limits {
        max_tokens: state.cfg.max_tokens,
        default_thinking: state.cfg.default_thinking,
        model_aliases: &state.cfg.model_aliases,
    };
    let (gen_req, front) = match api {
        Api::OpenAi(surface) => (
            request::parse(&json, surface, &limits)?,
            Front::OpenAi(surface),
        ),
        Api::Messages => {
            let (r, meta) = messages::parse(&json, &limits)?;
            (r, Front::Messages(meta))
        }
        Api::Responses => {
            let (r, meta) = responses::parse(&json, &limits)?;
            (r, Front::Responses(meta))
        }
    };
    drop(json);
    request::check_limits(&gen_req)?;
    let (gen_req, prompt) = {
        let engine = engine.clone();
        tokio::task::spawn_blocking(move || {
            let ids = engine.encode(&gen_req);
            ids.map(|ids| (gen_req, ids))
        })
        .await
        .map_err(|e| ApiError::server(format!("prompt encoding failed: {e}")))??
    };
    // A place: at most one generation plus `queue` waiters.
    let Some(ticket) = state.try_reserve() else {
        state.stats.busy_rejections.fetch_add(1, Ordering::Relaxed);
        return Err(ApiError::busy());
    };
    drop(hold);
    // Wait for the slot in arrival order; a client that leaves drops this future.
    let Some(permit) = unless_gone(&conn, state.slot.clone().acquire_owned()).await else {
        return Ok(abandoned());
    };
    let permit = permit.map_err(|_| ApiError::shutting_down())?;
    if state.shutdown.load(Ordering::SeqCst) {
        return Err(ApiError::shutting_down());
    }
    let prompt_tokens = prompt.len();
    let interrupt = Arc::new(AtomicBool::new(false));
    let guard = CancelOnDrop {
        flag: interrupt.clone(),
        armed: true,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let worker_state = state.clone();
    let gen_for_worker = gen_req.clone();
    tokio::task::spawn_blocking(move || {
        let slot_permit = permit;
        let reservation = ticket;
        let st = worker_state;
        st.stats.generations_started.fetch_add(1, Ordering::SeqCst);
        if let Ok(mut cur) = st.current.lock() {
            *cur = Some(interrupt.clone());
        }
        if st.shutdown.load(Ordering::SeqCst) {
            interrupt.store(true, Ordering::SeqCst);
        }
        let (ending, timing) = run_generation_timed(
            &engine,
            &gen_for_worker,
            &prompt,
            &interrupt,
            &st.shutdown,
            |ev| {
                if let GenEvent::Prefill {
                    done,
                    total,
                    reused,
                } = &ev
                {
                    st.metrics.prefill_progress(*done, *total, *reused);
                }
                tx.send(ev).is_ok()
            },
        );
        st.metrics.prefill_progress(0, 0, 0);
        if let Ok(mut cur) = st.current.lock() {
            *cur = None;
        }
        // Free the slot before the answer is complete on the client's side.
        drop(slot_permit);
        drop(reservation);
        let counter = match &ending {
            Ending::Cancelled(_)
            | Ending::Event(GenEvent::Failed(ApiError {
                kind: "server_shutting_down",
                ..
            })) => &st.stats.generations_cancelled,
            Ending::Event(_) => &st.stats.generations_finished,
        };
        if let Ending::Event(GenEvent::Done { usage, .. }) = &ending {
            st.metrics.record_generation(usage, &timing);
        }
        st.metrics.record_reuse(&timing);
        counter.fetch_add(1, Ordering::SeqCst);
        if let Ending::Event(ev) = ending {
            let _ = tx.send(ev);
        }
    });
    // A sampled answer names its seed, so that the run can be repeated.
    let seed = gen_req.sampling.map(|s| s.seed);
    let surface = match front {
        Front::OpenAi(surface) => surface,
        Front::Messages(meta) => {
            let ctx = reply_context(&state, "msg_", prompt_tokens, gen_req.max_new);
            let reply = Box::new(MessagesReply::new(ctx, meta));
            return with_seed(
                answer_with(reply, gen_req.stream, rx, guard, conn).await,
                seed,
            );
        }
        Front::Responses(meta) => {
            let ctx = reply_context(&state, "resp_", prompt_tokens, gen_req.max_new);
            let reply = Box::new(ResponsesReply::new(ctx, meta));
            return with_seed(
                answer_with(reply, gen_req.stream, rx, guard, conn).await,
                seed,
            );
        }
    };
    let tok_engine = state.engine.borrow().clone();
    let EngineState::Ready(tok_engine) = tok_engine else {
        return Err(ApiError::server("the model is not loaded"));
    };
    let shape = Shape {
        surface,
        id: log.id().to_string(),
        log,
        created: unix_now(),
        engine: tok_engine,
        logprobs: gen_req.logprobs.is_some(),
        include_usage: gen_req.include_usage,
    };
    let answer = if gen_req.stream {
        Ok(sse_response(shape, rx, guard, conn))
    } else {
        match unless_gone(&conn, collect_response(shape, rx, guard)).await {
            Some(r) => r,
            None => Ok(abandoned()),
        }
    };
    with_seed(answer, seed)
}

/// The `X-Deltafin-Seed` header of a sampled answer (docs/SERVER.md "Sampling").
fn with_seed(answer: Result<Response, ApiError>, seed: Option<u64>) -> Result<Response, ApiError> {
    let Some(seed) = seed else { return answer };
    let mut resp = answer?;
    resp.headers_mut()
        .insert("x-deltafin-seed", axum::http::HeaderValue::from(seed));
    Ok(resp)
}

async fn collect_response(
    shape: Shape,
    mut rx: mpsc::UnboundedReceiver<GenEvent>,
    mut guard: CancelOnDrop,
) -> Result<Response, ApiError> {
    let mut all = Delta::default();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Delta(d) => all.extend(d),
            GenEvent::Prefill { .. } => {}
            GenEvent::Done { finish, usage } => {
                guard.armed = false;
                shape.ended(Some((finish, &usage)));
                return Ok(json_response(
                    StatusCode::OK,
                    &shape.full(&all, finish, &usage),
                ));
            }
            GenEvent::Failed(e) => {
                guard.armed = false;
                shape.ended(None);
                return Err(e);
            }
        }
    }
    Err(ApiError::server("the generation ended without a result"))
}

struct SseState {
    conn: ClientConn,
    shape: Shape,
    rx: mpsc::UnboundedReceiver<GenEvent>,
    guard: CancelOnDrop,
    pending: VecDeque<String>,
    ended: bool,
}

impl SseState {
    fn frame(v: &Value) -> String {
        format!("data: {v}\n\n")
    }

    fn on_event(&mut self, ev: Option<GenEvent>) {
        let mut frames = VecDeque::new();
        match ev {
            Some(GenEvent::Prefill { done, total, .. }) => {
                self.pending.push_back(prefill_comment(done, total));
                return;
            }
            Some(GenEvent::Delta(d)) => self.shape.delta_frames(&d, &mut frames),
            Some(GenEvent::Done { finish, usage }) => {
                self.shape.ended(Some((finish, &usage)));
                frames.push_back(self.shape.finish_frame(finish));
                if self.shape.include_usage {
                    let mut u = self.shape.chunk(Value::Null);
                    u["choices"] = json!([]);
                    u["usage"] = self.shape.usage(&usage);
                    frames.push_back(u);
                }
                self.pending.extend(frames.iter().map(Self::frame));
                self.pending.push_back("data: [DONE]\n\n".into());
                self.ended = true;
                self.guard.armed = false;
                return;
            }
            Some(GenEvent::Failed(e)) => {
                self.shape.ended(None);
                let mut body = e.body();
                body["error"]["type"] = Value::from("server_error");
                body["error"]["code"] = Value::from(e.code);
                frames.push_back(body);
                self.ended = true;
                self.guard.armed = false;
            }
            None => {
                frames.push_back(ApiError::server("the generation ended without a result").body());
                self.ended = true;
            }
        }
        self.pending.extend(frames.iter().map(Self::frame));
    }
}

fn reply_context(
    state: &AppState,
    prefix: &str,
    prompt_tokens: usize,
    max_new: usize,
) -> ReplyContext {
    let suffix = state.id_suffix();
    ReplyContext {
        id: format!("{prefix}{suffix}"),
        suffix,
        created: unix_now(),
        prompt_tokens,
        max_new,
    }
}

fn sse_response(
    shape: Shape,
    rx: mpsc::UnboundedReceiver<GenEvent>,
    guard: CancelOnDrop,
    conn: ClientConn,
) -> Response {
    let mut pending = VecDeque::new();
    if shape.surface == Surface::Chat {
        let opening = shape.chunk(json!({
            "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null,
        }));
        pending.push_back(SseState::frame(&opening));
    }
    let st = SseState {
        conn,
        shape,
        rx,
        guard,
        pending,
        ended: false,
    };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(f) = st.pending.pop_front() {
                return Some((Ok::<Bytes, Infallible>(Bytes::from(f)), st));
            }
            if st.ended {
                return None;
            }
            // A client that leaves while nothing is written (prefill) is noticed too.
            let ev = unless_gone(&st.conn, st.rx.recv()).await?;
            st.on_event(ev);
        }
    });
    sse_headers(Response::new(Body::from_stream(stream)))
}
