//! `deltafin serve`: the OpenAI-compatible HTTP server (docs/SERVER.md).

use crate::ModelArgs;
use crate::session;
use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use deltafin_k3::engine::EngineConfig;
use deltafin_k3::text::chat::{ReasoningEffort, Thinking};
use deltafin_openai::access::{AccessConfig, ApiKey, check_origin};
use deltafin_openai::{
    DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TOKENS, DEFAULT_PORT, DEFAULT_QUEUE, MAX_QUEUE,
    MAX_REQUEST_BYTES_LIMIT, Server, ServerConfig, check_model_aliases,
};
use deltafin_spec::select::{DraftModels, Surfaces};
use std::process::ExitCode;

/// Flags of `deltafin serve`.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Listen address; non-empty, no `/`, `\` or NUL. A non-loopback address has no
    /// authentication: a warning is printed.
    #[arg(long, value_name = "ADDRESS", default_value = "127.0.0.1")]
    pub host: String,
    /// Listen port (0: any free port; the bound address is printed).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// Per-response token ceiling, > 0.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_TOKENS as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_tokens: u64,
    /// Requests allowed to wait beyond the generations running together, 0…64 (0: a
    /// request beyond them gets 429 at once) [env: K3_SERVER_QUEUE; default: 8, so that an
    /// agent's side requests wait instead of failing].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(0..=MAX_QUEUE as u64))]
    pub queue: Option<u64>,
    /// Generations that run together, 1…16: their decode steps share each pass, and each
    /// answer is bit-identical to the same request alone [env: K3_SERVER_PARALLEL; default:
    /// as many as the memory plan's state reserve holds, at least 2 where two fit, at most 4].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=deltafin_openai::sharing::MAX_PARALLEL as u64))]
    pub parallel: Option<u64>,
    /// JSON body limit in bytes, 1…1073741824.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_REQUEST_BYTES as u64,
          value_parser = clap::value_parser!(u64).range(1..=MAX_REQUEST_BYTES_LIMIT as u64))]
    pub max_request_bytes: u64,
    /// Append the routes of every pass to PATH (as `run --router-trace`) [env: K3_TRACE_PATH].
    #[arg(long, value_name = "PATH")]
    pub router_trace: Option<std::path::PathBuf>,
    /// Router trace mode: off, buffered or sync [env: K3_TRACE; default: off].
    #[arg(long, value_name = "MODE")]
    pub router_trace_mode: Option<String>,
    /// Another name requests may give as `model` (repeatable); `/v1/models` lists it after
    /// `deltafin-kimi-k3`. Non-empty, at most 256 bytes, no whitespace or control
    /// characters, each once.
    #[arg(long = "model-alias", value_name = "NAME")]
    pub model_aliases: Vec<String>,
    /// Require this API key (`Authorization: Bearer KEY` or `x-api-key: KEY`) on every
    /// endpoint but /health: 16…256 printable ASCII characters [env: DELTAFIN_API_KEY, which
    /// keeps the key out of the process list]. Without it anyone who can reach the port
    /// can use the model.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Let web pages of this origin (`http://HOST[:PORT]` or `https://…`) call the server
    /// from a browser (CORS); requests with any other `Origin` are refused.
    #[arg(long, value_name = "ORIGIN")]
    pub cors_origin: Option<String>,
    /// Seconds a whole request body may take to arrive, 1…3600 (besides 60 s at most
    /// between two of its chunks): a client trickling bytes is answered 408.
    #[arg(long, value_name = "S", default_value_t = deltafin_openai::server::BODY_DEADLINE.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub body_deadline_secs: u64,
    /// Seconds a request's line and headers may take to arrive, 1…3600; also how long an
    /// idle keep-alive connection stays open. Past it the connection is closed.
    #[arg(long, value_name = "S", default_value_t = deltafin_openai::server::HEADER_DEADLINE.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub header_deadline_secs: u64,
    /// Open connections at most, 1…65536; one more is answered 503 `too_many_connections`.
    /// Lowered at start when the open-files limit could not hold that many.
    #[arg(long, value_name = "N", default_value_t = deltafin_openai::DEFAULT_MAX_CONNECTIONS as u64,
          value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub max_connections: u64,
    /// Finished greedy answers kept for identical requests, 0…4096 (0: no memo).
    #[arg(long, value_name = "N", default_value_t = deltafin_openai::memo::DEFAULT_ENTRIES as u64,
          value_parser = clap::value_parser!(u64).range(0..=4096))]
    pub response_memo_entries: u64,
    /// Bytes the response memo may hold, 0…1073741824 (0: no memo).
    #[arg(long, value_name = "N", default_value_t = deltafin_openai::memo::DEFAULT_BYTES as u64,
          value_parser = clap::value_parser!(u64).range(0..=deltafin_openai::memo::MAX_BYTES as u64))]
    pub response_memo_bytes: u64,
    /// Gigabytes of stored Responses (`store`, `previous_response_id`), kept in
    /// `k3-meta/responses/` of the model root; 0: none are kept and `store: true` is refused
    /// [env: K3_RESPONSE_STORE_GB; default: 1].
    #[arg(long, value_name = "GB")]
    pub response_store_gb: Option<String>,
    /// Where the chat page finds the last `deltafin benchmark` (`GET /v1/benchmark`): an
    /// evidence directory, or a directory of them (the newest `result.json` is shown). It
    /// need not exist yet; relative to the working directory.
    #[arg(long, value_name = "DIR", default_value = "bench-results")]
    pub benchmark_dir: std::path::PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
}

/// `--response-store-gb`, else `K3_RESPONSE_STORE_GB`, else 1 GB: bytes.
fn resolve_response_store(flag: Option<&str>) -> Result<u64> {
    let parse = |v: &str| match v.trim() {
        "0" => Ok(0),
        v => crate::env::parse_gb(v).map_err(|e| anyhow!("{e} (0 keeps no responses)")),
    };
    match flag {
        Some(v) => parse(v).map_err(|e| anyhow!("--response-store-gb: {e}")),
        None => match crate::env::env_var("K3_RESPONSE_STORE_GB")? {
            Some(v) => {
                parse(&v).map_err(|e| anyhow!("environment variable K3_RESPONSE_STORE_GB: {e}"))
            }
            None => Ok(deltafin_openai::responses::store::DEFAULT_BYTES),
        },
    }
}

/// Raise the soft limit on open files to the hard limit (each connection takes descriptors,
/// and expert files are opened beside them); returns `(before, after)`.
#[cfg(unix)]
fn raise_open_files_limit() -> Option<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the struct passed; no other memory.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    let before: u64 = lim.rlim_cur;
    // An unlimited hard limit is not a valid soft one for descriptors (Linux caps it at
    // fs.nr_open, 1,048,576 by default).
    let target = lim.rlim_max.min(1 << 20);
    if lim.rlim_cur < target {
        lim.rlim_cur = target;
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            return Some((before, before));
        }
    }
    Some((before, lim.rlim_cur))
}

#[cfg(not(unix))]
fn raise_open_files_limit() -> Option<(u64, u64)> {
    None
}

/// Descriptors kept for everything but connections: the model's files, the expert cache's
/// open files, the state cache, logs.
const RESERVED_FILES: u64 = 256;

/// `asked`, lowered so that the connections fit in the open-files limit `files`: each one
/// takes two descriptors (the socket and the duplicate that notices a client leave).
fn connection_cap(asked: u64, files: Option<u64>) -> u64 {
    match files {
        Some(f) => asked.min((f.saturating_sub(RESERVED_FILES) / 2).max(1)),
        None => asked,
    }
}

/// `--api-key`, else `DELTAFIN_API_KEY` (empty: none), and `--cors-origin`, checked.
fn resolve_access(args: &ServeArgs) -> Result<AccessConfig> {
    let (key, from) = match (&args.api_key, crate::env::env_var("DELTAFIN_API_KEY")?) {
        (Some(k), _) => (Some(k.clone()), "--api-key"),
        (None, Some(k)) if !k.is_empty() => (Some(k), "environment variable DELTAFIN_API_KEY"),
        _ => (None, ""),
    };
    let api_key = key
        .map(|k| ApiKey::new(&k).map_err(|e| anyhow!("{from}: {e}")))
        .transpose()?;
    let cors_origin = args
        .cors_origin
        .as_deref()
        .map(|o| check_origin(o).map_err(|e| anyhow!("--cors-origin: {e}")))
        .transpose()?;
    Ok(AccessConfig {
        api_key,
        cors_origin,
    })
}

/// `--queue`, else `K3_SERVER_QUEUE` (strict: an integer 0…64), else [`DEFAULT_QUEUE`].
fn resolve_queue(flag: Option<u64>) -> Result<(usize, &'static str)> {
    let env = crate::env::env_var("K3_SERVER_QUEUE")?;
    let from_env = env
        .as_deref()
        .map(|v| match v.parse::<usize>() {
            Ok(n) if n <= MAX_QUEUE => Ok(n),
            _ => Err(anyhow!(
                "environment variable K3_SERVER_QUEUE: {v:?} is not an integer in 0..={MAX_QUEUE}"
            )),
        })
        .transpose()?;
    Ok(match (flag, from_env) {
        (Some(n), _) => (n as usize, "flag"),
        (None, Some(n)) => (n, "env"),
        (None, None) => (DEFAULT_QUEUE, "default"),
    })
}

/// `--parallel`, else `K3_SERVER_PARALLEL` (strict: an integer 1…16), else `None` (the
/// memory plan decides, `deltafin_openai::sharing`).
fn resolve_parallel(flag: Option<u64>) -> Result<Option<(usize, &'static str)>> {
    let max = deltafin_openai::sharing::MAX_PARALLEL;
    let env = crate::env::env_var("K3_SERVER_PARALLEL")?;
    let from_env = env
        .as_deref()
        .map(|v| match v.parse::<usize>() {
            Ok(n) if (1..=max).contains(&n) => Ok(n),
            _ => Err(anyhow!(
                "environment variable K3_SERVER_PARALLEL: {v:?} is not an integer in 1..={max}"
            )),
        })
        .transpose()?;
    Ok(match (flag, from_env) {
        (Some(n), _) => Some((n as usize, "flag")),
        (None, Some(n)) => Some((n, "env")),
        (None, None) => None,
    })
}

/// The chat default when a request names no effort: `K3_REASONING_EFFORT` (the server's
/// spellings, `none` included), else thinking at `max`.
fn resolve_thinking() -> Result<(Thinking, &'static str)> {
    Ok(match crate::env::env_thinking()? {
        Some(t) => (t, "env"),
        None => (Thinking::On(ReasoningEffort::Max), "default"),
    })
}

/// Register the SIGINT/SIGTERM/SIGHUP handlers now (before the server says it is listening,
/// so a signal sent right after that line is never missed) and return the future that
/// resolves on the first of them. SIGHUP (the terminal that started the server closed)
/// shuts down gracefully like SIGTERM: streams end with their error frame, heat is merged.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let int = signal(SignalKind::interrupt());
        let term = signal(SignalKind::terminate());
        let hup = signal(SignalKind::hangup());
        async move {
            match (int, term, hup) {
                (Ok(mut int), Ok(mut term), Ok(mut hup)) => {
                    tokio::select! {
                        _ = int.recv() => {}
                        _ = term.recv() => {}
                        _ = hup.recv() => {}
                    }
                }
                (int, term, hup) => {
                    for e in [int.err(), term.err(), hup.err()].into_iter().flatten() {
                        deltafin_openai::log_line!(
                            "deltafin: warning: signal handler not installed: {e}"
                        );
                    }
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Generations a server's memory plan reserves state for: `--parallel`
/// (`K3_SERVER_PARALLEL`), else [`DEFAULT_SEQUENCES`].
fn planned_sequences(parallel: Option<(usize, &'static str)>) -> usize {
    parallel.map_or(DEFAULT_SEQUENCES, |(n, _)| n)
}

/// Without `--parallel`, a memory budget reserves state for two generations where the expert
/// cache can spare the second's (a KDA state and a side context: an agent's title or
/// sub-agent request then runs beside its main turn instead of waiting for it); the default
/// `--parallel` follows from the plan's reserve (`deltafin_openai::sharing`).
pub const DEFAULT_SEQUENCES: usize = 2;

/// The engine configuration `deltafin serve` loads with: the model flags and their
/// variables (as `run`), the router trace, and the generations to reserve state for. A
/// server does not know how long its contexts grow: the memory budget reserves state for
/// `CONTEXT_RESERVE_TOKENS` positions, shared by its generations.
pub fn engine_config(args: &ServeArgs) -> Result<EngineConfig> {
    let router_trace = crate::engine_config::resolve_router_trace(
        args.router_trace.as_deref(),
        args.router_trace_mode.as_deref(),
        &args.model.root(),
    )?;
    let mut config = crate::engine_config::engine_config(&args.model, router_trace, None)?;
    config.sequences = planned_sequences(resolve_parallel(args.parallel)?);
    Ok(config)
}

/// Runs the server until SIGINT, SIGTERM or SIGHUP.
pub fn serve(args: &ServeArgs) -> Result<ExitCode> {
    if args.host.is_empty() || args.host.contains(['/', '\\', '\0']) {
        bail!(
            "--host {:?}: must be a non-empty address without `/`, `\\` or NUL",
            args.host
        );
    }
    check_model_aliases(&args.model_aliases).map_err(|e| anyhow!("--model-alias: {e}"))?;
    session::check_kernels()?;
    let config = engine_config(args)?;
    let spine = config.spine;
    // Fail at startup, not in the background loader, when the model root is wrong or the
    // int8 spine is missing (in that order: a wrong path is not a missing conversion).
    let root = args.model.root();
    session::check_root(&root)?;
    // Absolute from here on: every path in an error is then one the answers' path
    // scrubbing recognises (a relative `--model-root` would put server paths into bodies).
    let root = std::fs::canonicalize(&root).unwrap_or(root);
    deltafin_k3::engine::check_spine(&root, spine)?;
    let (queue, queue_source) = resolve_queue(args.queue)?;
    let parallel = resolve_parallel(args.parallel)?;
    let (thinking, thinking_source) = resolve_thinking()?;
    let spec = crate::env::spec_config()?;
    let states = crate::engine_config::state_cache_settings(&args.model)?;
    let memo = (
        args.response_memo_entries as usize,
        args.response_memo_bytes as usize,
    );
    let access = resolve_access(args)?;
    let response_store_bytes = resolve_response_store(args.response_store_gb.as_deref())?;
    let limit = raise_open_files_limit();
    if let Some((before, after)) = limit
        && after > before
    {
        deltafin_openai::log_line!(
            "[deltafin serve] open files limit raised from {before} to {after}"
        );
    }
    let max_connections = connection_cap(args.max_connections, limit.map(|(_, now)| now));
    if max_connections < args.max_connections {
        deltafin_openai::log_line!(
            "[deltafin serve] at most {max_connections} connections (asked {}): the open-files limit is {}",
            args.max_connections,
            limit.map_or(0, |(_, now)| now)
        );
    }
    let cfg = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        max_tokens: usize::try_from(args.max_tokens).unwrap_or(usize::MAX),
        queue,
        max_request_bytes: args.max_request_bytes as usize,
        default_thinking: thinking,
        model_aliases: args.model_aliases.clone(),
        access,
        state_dir: Some(root.join("k3-meta")),
        response_store_bytes,
        body_deadline: std::time::Duration::from_secs(args.body_deadline_secs),
        header_deadline: std::time::Duration::from_secs(args.header_deadline_secs),
        max_connections: usize::try_from(max_connections).unwrap_or(usize::MAX),
        benchmark_dir: Some(args.benchmark_dir.clone()),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let shutdown = shutdown_signal();
        // The model loads through the same path as `run` (memory budget included), on the
        // server's background loader thread.
        let loader_root = root.clone();
        let server = Server::bind_with_loader(cfg.clone(), move || {
            let s = session::load(&loader_root, &config).map_err(|e| crate::errtext::describe(&e))?;
            session::report_memory_plan(&s.model, s.plan.as_ref());
            deltafin_openai::log_line!("[deltafin serve] model loaded: {}", session::backend_description());
            // The same drafting as `run`: DSpark for chat completions, Qwen for completions.
            let surfaces = Surfaces { chat: true, raw: true };
            let drafts = DraftModels::load(&loader_root, &spec, surfaces, &s.model)?;
            deltafin_openai::log_line!("[deltafin serve] drafting: {}", drafts.describe());
            let cache = session::state_cache(&s, &states);
            if let Some(c) = &cache {
                deltafin_openai::log_line!("[deltafin serve] {}", session::describe_state_cache(c, &s, &states));
            }
            let engine = deltafin_openai::Engine::from_loaded(s, Some(drafts))
                .with_memo(memo.0, memo.1)
                .with_parallel(parallel);
            let sharing = &engine.sharing;
            deltafin_openai::log_line!(
                "[deltafin serve] parallel={} ({}): state reserve {:.3} GB, {:.3} GB for a full {}-position context",
                sharing.parallel,
                sharing.source,
                sharing.reserve_bytes as f64 / 1e9,
                sharing.state_bytes(engine.max_context, 0) as f64 / 1e9,
                engine.max_context
            );
            Ok(match cache {
                Some(c) => engine.with_state_cache(c),
                None => engine,
            })
        })
        .await?;
        let addr = server.local_addr()?;
        deltafin_openai::log_line!(
            "[deltafin serve] surface=server {} spine={} model_root={} host={} port={} queue={queue} ({queue_source}) max_tokens={} max_request_bytes={} reasoning_effort={thinking} ({thinking_source}) model_aliases={} api_key={} cors_origin={} response_store_bytes={} benchmark_dir={}",
            session::backend_description(),
            spine.as_str(),
            root.display(),
            cfg.host,
            addr.port(),
            cfg.max_tokens,
            cfg.max_request_bytes,
            if cfg.model_aliases.is_empty() {
                "none".to_string()
            } else {
                cfg.model_aliases.join(",")
            },
            if cfg.access.api_key.is_some() { "required" } else { "none" },
            cfg.access.cors_origin.as_deref().unwrap_or("none"),
            cfg.response_store_bytes,
            args.benchmark_dir.display(),
        );
        if !addr.ip().is_loopback() && cfg.access.api_key.is_none() {
            deltafin_openai::log_line!(
                "deltafin: warning: listening on non-loopback address {addr} without --api-key (or DELTAFIN_API_KEY): anyone who can reach it can use the model"
            );
        }
        deltafin_openai::log_line!("[deltafin serve] listening on http://{addr} (model loading in the background; chat page at http://{addr}/)");
        server.run(shutdown).await?;
        deltafin_openai::log_line!("[deltafin serve] stopped");
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}
