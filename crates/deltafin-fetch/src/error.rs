//! The one error type of this crate.

use std::path::PathBuf;

/// Everything that can go wrong while planning, fetching or checking an install.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// A committed or supplied manifest is malformed.
    #[error("manifest {name}: {msg}")]
    Manifest { name: String, msg: String },
    /// The hub answered with an HTTP error status.
    #[error("{url}: HTTP {status}")]
    Http { url: String, status: u16 },
    /// The file does not exist at the pinned revision.
    #[error("{url}: not found (HTTP 404) at the pinned revision")]
    NotFound { url: String },
    /// The hub served a different commit than the pinned revision.
    #[error("{url}: the hub answered for commit {got}, but the pinned revision is {expected}")]
    CommitMismatch {
        url: String,
        expected: String,
        got: String,
    },
    /// Connection failure, reset or a body cut short (retryable).
    #[error("{url}: {msg}")]
    Transport { url: String, msg: String },
    /// A response that breaks the protocol (bad redirect, range or size headers).
    #[error("{url}: {msg}")]
    Protocol { url: String, msg: String },
    /// The downloaded bytes do not hash to the pinned digest, even after refetching.
    #[error(
        "{file}: sha256 {got} does not match the pinned {expected} after {attempts} complete downloads"
    )]
    Sha256 {
        file: String,
        expected: String,
        got: String,
        attempts: u32,
    },
    /// A local file-system error (disk full, permission denied, …).
    #[error("{}: {}{}", path.display(), source, io_hint(source))]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The tensor inventory is malformed or disagrees with its pin.
    #[error("tensor inventory: {0}")]
    Inventory(String),
    /// A bad argument (layer list, worker count, …).
    #[error("{0}")]
    Invalid(String),
    /// The install does not fit the free disk (the message has the numbers).
    #[error("{0}")]
    Disk(String),
    /// Another deltafin holds the install lock (the message names it and the lock file).
    #[error("{0}")]
    Busy(String),
    /// A file of the Hugging Face cache given to `setup --from-hf-cache` fails its pins, or
    /// the cache directory is not usable (the message names the file).
    #[error("{0}")]
    Cache(String),
    /// Another transfer failed and this one was stopped (its `.part` file is kept).
    #[error("stopped after another transfer failed")]
    Stopped,
}

fn io_hint(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::StorageFull => {
            " (free some space and rerun: completed files and .part files are kept and resumed)"
        }
        std::io::ErrorKind::PermissionDenied => " (check the ownership and mode of the model root)",
        _ => "",
    }
}

impl FetchError {
    /// Wrap an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> FetchError {
        let path = path.into();
        move |source| FetchError::Io { path, source }
    }

    /// An error of manifest `name`, from its message.
    pub fn manifest(name: &str) -> impl Fn(String) -> FetchError + Copy + '_ {
        move |msg| FetchError::Manifest {
            name: name.to_string(),
            msg,
        }
    }

    /// Whether retrying the same request may succeed (5xx, 429, transport failures).
    pub fn is_retryable(&self) -> bool {
        match self {
            FetchError::Http { status, .. } => *status >= 500 || *status == 429 || *status == 408,
            FetchError::Transport { .. } => true,
            _ => false,
        }
    }
}
