//! [`Scale4Error`]: every scale4 failure, naming what is at fault.

use crate::error::ExpertError;
use std::path::{Path, PathBuf};

/// A scale4 encoding, decoding, file or manifest error; each names what is at fault.
#[derive(Debug, thiserror::Error)]
pub enum Scale4Error {
    /// A matrix's scales span more than 16 values.
    #[error(
        "layer {layer} expert {expert} {matrix}: E8M0 scale {value} at index {index} exceeds base {base} + 15; the matrix cannot be stored as 4-bit deltas"
    )]
    Span {
        layer: usize,
        expert: usize,
        matrix: &'static str,
        base: u8,
        value: u8,
        index: usize,
    },
    /// A record is malformed (magic, version, dims, tables, checksum, padding).
    #[error("{}: record of layer {layer} expert {expert}: {message}", path.display())]
    Record {
        path: PathBuf,
        layer: usize,
        expert: usize,
        message: String,
    },
    /// A file header or file is malformed or the wrong size.
    #[error("{}: {message}", path.display())]
    File { path: PathBuf, message: String },
    /// Reading or writing failed.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The manifest is missing, malformed or disagrees with the model.
    #[error("{}: {message}", path.display())]
    Manifest { path: PathBuf, message: String },
    /// The raw source could not be read.
    #[error(transparent)]
    Source(#[from] ExpertError),
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Scale4Error + '_ {
    move |source| Scale4Error::Io {
        path: path.to_path_buf(),
        source,
    }
}
