//! Error type shared by everything that reads tensor bytes.

use std::path::PathBuf;

/// An error while reading or interpreting tensor data. Every variant names what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    #[error("tensor `{name}`: {message}")]
    Tensor { name: String, message: String },
    #[error("{0}")]
    Invalid(String),
}

impl TensorError {
    pub fn tensor(name: impl Into<String>, message: impl Into<String>) -> Self {
        TensorError::Tensor {
            name: name.into(),
            message: message.into(),
        }
    }
    pub fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        TensorError::Format {
            path: path.into(),
            message: message.into(),
        }
    }
}
