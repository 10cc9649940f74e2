//! [`ModelError`]: the errors of model construction and of the forward pass.
//!
//! A leaf module: the model blocks, the layer loop and the weight loaders all return it, and
//! it depends on nothing else in the crate.

/// Errors of model construction and of the forward pass. Each names what is wrong.
#[derive(Clone, Debug, thiserror::Error)]
pub enum ModelError {
    /// Inconsistent dimensions.
    #[error("model dimensions: {0}")]
    Dims(String),
    /// A weight whose shape disagrees with the dimensions.
    #[error("tensor `{tensor}`: expected shape {expected}, found {found}")]
    Shape {
        tensor: String,
        expected: String,
        found: String,
    },
    /// A layer whose block kind disagrees with the schedule.
    #[error("layer {layer}: {message}")]
    Layer { layer: usize, message: String },
    /// A token id outside the vocabulary.
    #[error("token id {token} at input position {index} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        token: u32,
        index: usize,
        vocab: usize,
    },
    /// An empty token list.
    #[error("no input tokens")]
    EmptyInput,
    /// The pass was stopped between layers by its interrupt flag
    /// ([`K3Model::forward_watched`](crate::model::K3Model::forward_watched)); the state it
    /// was advancing is partially advanced and must be discarded.
    #[error("interrupted")]
    Interrupted,
    /// A `State` built for different dimensions.
    #[error("state does not fit this model: {0}")]
    StateMismatch(String),
    /// A product, upload or other operation on the compute device failed (`matrix`: the
    /// tensor, or `layer L expert E` for a routed expert).
    #[error("device: {matrix}: {message}")]
    Device { matrix: String, message: String },
    /// A weight matrix could not be moved to other memory
    /// ([`K3Model::copy_spine_to_huge_pages`](crate::model::K3Model::copy_spine_to_huge_pages)).
    #[error("{name}: {message}")]
    Weights { name: String, message: String },
    /// A NaN or infinite value appeared in the forward pass (`site`: where it first
    /// appeared, e.g. `layer 3's attention output`, `expert 5 of layer 2`): damaged weights
    /// or a numerical fault. The state the pass was advancing must be discarded.
    #[error(
        "numerical failure: a non-finite value (NaN or infinity) first appeared in {site}; the weights it reads are damaged (`deltafin doctor` checks the install)"
    )]
    NonFinite { site: String },
    /// A routed expert could not be obtained.
    #[error("expert {expert} of layer {layer}: {message}")]
    Expert {
        layer: usize,
        expert: usize,
        message: String,
    },
}

impl From<deltafin_experts::ExpertError> for ModelError {
    fn from(e: deltafin_experts::ExpertError) -> ModelError {
        match e.location() {
            Some((layer, expert)) => ModelError::Expert {
                layer,
                expert,
                message: e.detail(),
            },
            None => ModelError::Dims(e.to_string()),
        }
    }
}

impl From<deltafin_store::dims::DimsError> for ModelError {
    fn from(e: deltafin_store::dims::DimsError) -> ModelError {
        ModelError::Dims(e.0)
    }
}
