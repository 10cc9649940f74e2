//! [`ExpertError`]: every way obtaining a routed expert can fail.

use deltafin_tensor::TensorError;
use std::path::PathBuf;

/// An error obtaining a routed expert; each names the layer and expert (and file) at fault.
#[derive(Debug, thiserror::Error)]
pub enum ExpertError {
    /// The source does not hold this expert (out of range, dense layer, missing entry).
    #[error("expert {expert} of layer {layer}: {message}")]
    Unavailable {
        layer: usize,
        expert: usize,
        message: String,
    },
    /// A read of the expert's bytes failed.
    #[error("expert {expert} of layer {layer}: reading {} at byte {offset} (+{len}): {source}", path.display())]
    Io {
        layer: usize,
        expert: usize,
        path: PathBuf,
        offset: u64,
        len: u64,
        source: std::io::Error,
    },
    /// The bytes read do not form valid MXFP4 matrices (sizes, NaN scales).
    #[error("expert {expert} of layer {layer}: {source}")]
    Tensor {
        layer: usize,
        expert: usize,
        source: TensorError,
    },
    /// The expert table or the options are inconsistent (built before any read).
    #[error("expert storage: {0}")]
    Setup(String),
}

impl ExpertError {
    /// `(layer, expert)` this error is about, if it concerns one expert.
    pub fn location(&self) -> Option<(usize, usize)> {
        match self {
            ExpertError::Unavailable { layer, expert, .. }
            | ExpertError::Io { layer, expert, .. }
            | ExpertError::Tensor { layer, expert, .. } => Some((*layer, *expert)),
            ExpertError::Setup(_) => None,
        }
    }

    /// The message without the `expert E of layer L:` prefix.
    pub fn detail(&self) -> String {
        match self {
            ExpertError::Unavailable { message, .. } => message.clone(),
            ExpertError::Io {
                path,
                offset,
                len,
                source,
                ..
            } => format!(
                "reading {} at byte {offset} (+{len}): {source}",
                path.display()
            ),
            ExpertError::Tensor { source, .. } => source.to_string(),
            ExpertError::Setup(m) => format!("expert storage: {m}"),
        }
    }
}
