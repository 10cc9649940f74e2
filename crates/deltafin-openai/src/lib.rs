//! `deltafin-openai`: the strict OpenAI-compatible HTTP server behind `deltafin serve`.
//!
//! It implements a documented subset of `/v1/chat/completions`, `/v1/completions`, the
//! Responses API (`/v1/responses`), the Anthropic Messages API (`/v1/messages`) and the
//! Ollama API (`/api/chat`, `/api/generate`) exactly, all through one request path
//! ([`front`]), runs one generation at a time with a queue behind it, and refuses every
//! unsupported field with a 400 instead of silently ignoring it. `docs/SERVER.md` lists every
//! field and rule.

// No unsafe code: this crate needs none (docs/ARCHITECTURE.md "Invariants").
#![forbid(unsafe_code)]

pub mod access;
mod admission;
pub mod bench;
mod conn;
pub mod constrain;
pub mod engine;
pub mod error;
pub mod front;
mod listen;
pub mod memo;
pub mod messages;
pub mod metrics;
pub mod models;
pub mod ollama;
mod ops;
pub mod outcome;
pub mod output;
pub mod page;
pub mod reply;
pub mod request;
pub mod response;
pub mod responses;
mod routes;
pub mod seal;
pub mod server;
pub mod sharing;
mod state;
pub mod status;
pub mod strict;
// Public only for the fuzz harness (fuzz/harness); not part of the library's interface.
#[doc(hidden)]
pub mod tokenize;
mod transport;

pub use engine::{Engine, LoadError};
pub use error::ApiError;
pub use models::{MAX_MODEL_ALIAS_BYTES, check_model_aliases};
pub use server::{ServeError, Server, ServerStats};

use deltafin_k3::text::chat::{ReasoningEffort, Thinking};

/// Writes one line to stderr, ignoring a closed stderr (a server must not die for its log).
#[macro_export]
macro_rules! log_line {
    ($($arg:tt)*) => {{
        use ::std::io::Write as _;
        let _ = ::std::writeln!(::std::io::stderr(), $($arg)*);
    }};
}

/// The one model id the server advertises and accepts.
pub const MODEL_ID: &str = "deltafin-kimi-k3";
/// Default `--port`.
pub const DEFAULT_PORT: u16 = 8000;
/// Default `--max-tokens`.
pub const DEFAULT_MAX_TOKENS: usize = 1_000_000;
/// Largest `--queue`.
pub const MAX_QUEUE: usize = 64;
/// Default `--queue`: an agent's side requests (a title beside the turn, a sub-agent) wait
/// for the slot instead of being refused.
pub const DEFAULT_QUEUE: usize = 8;
/// Default `--max-request-bytes` (128 MiB).
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 134_217_728;

/// Default cap on open connections (`ServerConfig::max_connections`).
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// Largest `--max-request-bytes` (1 GiB).
pub const MAX_REQUEST_BYTES_LIMIT: usize = 1_073_741_824;

/// Server settings (`deltafin serve` flags, already validated).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Listen address (`--host`).
    pub host: String,
    /// Listen port (`--port`, 0 = any free port).
    pub port: u16,
    /// Per-response token ceiling (`--max-tokens`).
    pub max_tokens: usize,
    /// Requests allowed to wait for the generation slot (`--queue`, 0…64).
    pub queue: usize,
    /// JSON body limit in bytes (`--max-request-bytes`).
    pub max_request_bytes: usize,
    /// Chat thinking when a request names no `reasoning_effort` (`K3_REASONING_EFFORT`,
    /// else thinking at `max`).
    pub default_thinking: Thinking,
    /// More names requests may use for the model (`--model-alias`), listed by `/v1/models`
    /// after [`MODEL_ID`]; checked by [`check_model_aliases`] when the server binds.
    pub model_aliases: Vec<String>,
    /// Who may use the server: the API key and the one web origin allowed
    /// ([`access`]).
    pub access: access::AccessConfig,
    /// Where the server keeps what survives a restart (a model root's `k3-meta/`): the key of
    /// opaque reasoning tokens ([`seal`]) and stored responses. `None`, or a directory that
    /// cannot be written: both in memory.
    pub state_dir: Option<std::path::PathBuf>,
    /// Byte budget of stored responses (`--response-store-gb`; 0: none are stored, and
    /// `store: true` is refused).
    pub response_store_bytes: u64,
    /// Longest a whole request body may take to arrive (`--body-deadline-secs`).
    pub body_deadline: std::time::Duration,
    /// Longest a request head (line and headers) may take to arrive, counted from when the
    /// connection is ready for it: also how long an idle keep-alive connection stays open
    /// (`--header-deadline-secs`).
    pub header_deadline: std::time::Duration,
    /// Open connections at most; one more is answered 503 `too_many_connections`
    /// (`--max-connections`).
    pub max_connections: usize,
    /// Where `GET /v1/benchmark` looks for the last `deltafin benchmark` evidence directory
    /// (`--benchmark-dir`; `None`: it answers 404).
    pub benchmark_dir: Option<std::path::PathBuf>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: DEFAULT_PORT,
            max_tokens: DEFAULT_MAX_TOKENS,
            queue: DEFAULT_QUEUE,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            default_thinking: Thinking::On(ReasoningEffort::Max),
            model_aliases: Vec::new(),
            access: access::AccessConfig::default(),
            state_dir: None,
            response_store_bytes: responses::store::DEFAULT_BYTES,
            body_deadline: server::BODY_DEADLINE,
            header_deadline: server::HEADER_DEADLINE,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            benchmark_dir: None,
        }
    }
}
