//! [`EngineError`]: why the engine could not be built. Every variant's message is complete
//! on its own; [`EngineError::Context`] adds a step ("cannot build the model from …") over
//! its source, so an error printed with its chain (`anyhow`'s `{:#}`) reads as one line.

use crate::engine::plan::PlanError;
use crate::weights::install::{InstallError, Missing};
use crate::weights::loader::LoadError;
use deltafin_store::spine_int8::SpineError;
use std::path::PathBuf;

/// A boxed error from outside the engine (an injected expert layer's, an I/O error).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why the engine could not be built.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The kernel selection failed (a bad `DELTAFIN_KERNEL`).
    #[error("{0}")]
    Kernels(String),
    /// The device or expert backend asked for cannot be used (what is missing is named).
    #[error("{0}")]
    Device(String),
    /// A device query failed.
    #[error(transparent)]
    DeviceQuery(#[from] deltafin_kernels::DeviceError),
    /// The root holds no install.
    #[error(
        "no K3 model installed at {}: {what}.\nRun `deltafin setup --model-root {}` to install Kimi K3, or pass --model-root PATH pointing at an install (a synthesized test checkpoint: `cargo xtask synth --preset tiny --out DIR`).",
        root.display(),
        root.display()
    )]
    NotInstalled {
        /// The model root.
        root: PathBuf,
        /// What it lacks.
        what: Missing,
    },
    /// The int8 spine is asked for but not converted, or is invalid.
    #[error(transparent)]
    Spine(#[from] SpineError),
    /// The checkpoint or the tokenizer cannot be opened, or they disagree.
    #[error(transparent)]
    Install(#[from] InstallError),
    /// The model cannot be assembled.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The checkpoint's files cannot be read (its `config.json`, an expert file).
    #[error(transparent)]
    Checkpoint(#[from] deltafin_store::CheckpointError),
    /// The routed experts' table cannot be built.
    #[error(transparent)]
    Experts(#[from] deltafin_store::experts::ExpertsError),
    /// More resident spine layers were asked for than the model has.
    #[error("{requested} resident spine layers asked for, but the model has {layers}")]
    ResidentLayers {
        /// The cap asked for.
        requested: usize,
        /// The model's layers.
        layers: usize,
    },
    /// The memory budget cannot be planned.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A step that failed, over the error that made it fail.
    #[error("{context}")]
    Context {
        /// The step.
        context: String,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// An injected expert layer failed.
    #[error(transparent)]
    External(BoxError),
}

impl EngineError {
    /// A `map_err` adapter: `context` over the error.
    pub fn context<E: Into<BoxError>>(context: impl Into<String>) -> impl FnOnce(E) -> EngineError {
        let context = context.into();
        move |e| EngineError::Context {
            context,
            source: e.into(),
        }
    }
}
