//! The DSpark block-parallel drafter (`Inferact/Kimi-K3-DSpark`, docs/K3.md §9): K3's
//! partial sums tapped at a few layers are injected as attention context into a small dense
//! MLA decoder that drafts a block of tokens in one pass.

pub mod config;
pub mod drafter;
pub mod model;
pub mod rope;

pub use config::{BLOCK, DsparkConfig, YarnConfig};
pub use drafter::{DraftMode, DsparkDrafter, SpecConfig, SpecConfigError};
pub use model::{BlockOutput, DsparkContext, DsparkModel, Proposal, expected_tensors};

use std::path::PathBuf;

/// Errors of loading a DSpark checkpoint; each names the file, field or tensor.
#[derive(Debug, thiserror::Error)]
pub enum DsparkError {
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A bad `config.json` field.
    #[error("DSpark config.json field `{field}`: {message}")]
    Config { field: String, message: String },
    /// A bad or unexpected tensor.
    #[error("DSpark tensor `{tensor}`: {message}")]
    Tensor { tensor: String, message: String },
    /// A safetensors-level error.
    #[error(transparent)]
    Safetensors(#[from] deltafin_tensor::TensorError),
    /// The checkpoint does not fit the K3 model it would draft for.
    #[error("DSpark does not fit the target model: {0}")]
    Target(String),
}

impl From<crate::tensors::TensorIssue> for DsparkError {
    fn from(e: crate::tensors::TensorIssue) -> Self {
        DsparkError::Tensor {
            tensor: e.tensor,
            message: e.message,
        }
    }
}
