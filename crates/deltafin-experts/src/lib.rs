//! `deltafin-experts`: routed-expert storage for K3.
//!
//! Locates each expert's six byte ranges (MXFP4 codes and E8M0 scales of w1/w2/w3), reads
//! them explicitly from disk under a RAM budget, caches hot experts and prefetches the next
//! layer's likely picks. The model never touches expert bytes except through this crate.
//!
//! - [`ExpertSource`]: what the model asks for (one expert's three matrices), plus the
//!   scheduling hints a streaming source uses (the layer's route union, a next-layer guess).
//! - [`StreamingExperts`]: positional reads (`pread`, O_DIRECT on Linux when the filesystem
//!   allows it) by a bounded pool of I/O threads into aligned, reused buffers, an expert cache
//!   under a byte budget with a decayed-heat policy, and PILOT next-layer prefetch.
//! - [`scale4`]: lossless 4-bit scale sidecars (`K3SC4V2`) and the source that reads them.
//! - [`probe`]: the read-bandwidth probe (same read path) that throughput is reported against.

pub mod buffer;
pub mod heat;
pub mod io;
pub mod layout;
pub mod policy;
pub mod probe;
pub mod rank;
pub mod scale4;
pub mod stats;
pub mod stream;
pub mod trace;

/// Shared fixtures of the heat and rank tests.
#[cfg(test)]
pub(crate) mod test_support {
    use crate::heat::HeatDims;
    use crate::{ExpertError, ExpertSource, ExpertWeights};

    /// A small layout: 3 MoE layers of 8 experts, top-2.
    pub(crate) const DIMS: HeatDims = HeatDims {
        layers: 3,
        experts: 8,
        top_k: 2,
    };

    /// A source with no experts (the tests only record routes).
    pub(crate) struct Nothing;
    impl ExpertSource for Nothing {
        fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError> {
            Err(ExpertError::Unavailable {
                layer,
                expert,
                message: "none".into(),
            })
        }
    }
}

pub use layout::{ExpertLocation, ExpertShape, ExpertTable};
pub use stats::{ExpertStats, LayerStats, RankStats};
pub use stream::{DirectIo, PilotGate, StreamOptions, StreamingExperts};
pub use trace::{RouterTrace, TraceMode};

use deltafin_tensor::{Mxfp4Matrix, TensorError};
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

/// One routed expert's three MXFP4 matrices (cheap to clone: the bytes are shared).
#[derive(Clone, Debug)]
pub struct ExpertWeights {
    /// `w1` gate `[F, Lr]`.
    pub w1: Mxfp4Matrix,
    /// `w2` down `[Lr, F]`.
    pub w2: Mxfp4Matrix,
    /// `w3` up `[F, Lr]`.
    pub w3: Mxfp4Matrix,
}

impl ExpertWeights {
    /// Check the three shapes: `w1`, `w3` `[f, lr]`, `w2` `[lr, f]`. The error names the
    /// checkpoint tensor at fault.
    pub fn check_shape(
        &self,
        f: usize,
        lr: usize,
        layer: usize,
        expert: usize,
    ) -> Result<(), ShapeMismatch> {
        for (name, m, rows, cols) in [
            ("w1", &self.w1, f, lr),
            ("w2", &self.w2, lr, f),
            ("w3", &self.w3, f, lr),
        ] {
            if m.rows() != rows || m.cols() != cols {
                return Err(ShapeMismatch {
                    tensor: format!(
                        "model.layers.{layer}.block_sparse_moe.experts.{expert}.{name}"
                    ),
                    expected: format!("[{rows}, {cols}]"),
                    found: format!("[{}, {}]", m.rows(), m.cols()),
                });
            }
        }
        Ok(())
    }
}

/// A routed-expert matrix whose shape disagrees with the model dimensions.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tensor `{tensor}`: expected shape {expected}, found {found}")]
pub struct ShapeMismatch {
    pub tensor: String,
    pub expected: String,
    pub found: String,
}

/// One PILOT guess: an expert the next layer's router, run on this layer's input, chose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PilotGuess {
    /// Expert id.
    pub expert: usize,
    /// Its best position over the pass's rows in the guessed route order (0 = some row's top
    /// choice).
    pub rank: usize,
    /// Rows whose guessed route holds it.
    pub votes: usize,
}

/// The guesses of one pass from each row's guessed route (ids in route order: descending
/// router score), most confident first: by best rank, then by votes (descending), then by id.
pub fn rank_guesses<'a>(routes: impl IntoIterator<Item = &'a [usize]>) -> Vec<PilotGuess> {
    let mut by_id: std::collections::BTreeMap<usize, PilotGuess> = Default::default();
    for ids in routes {
        for (rank, &expert) in ids.iter().enumerate() {
            let g = by_id.entry(expert).or_insert(PilotGuess {
                expert,
                rank,
                votes: 0,
            });
            g.rank = g.rank.min(rank);
            g.votes += 1;
        }
    }
    let mut out: Vec<PilotGuess> = by_id.into_values().collect();
    out.sort_by(|a, b| {
        a.rank
            .cmp(&b.rank)
            .then(b.votes.cmp(&a.votes))
            .then(a.expert.cmp(&b.expert))
    });
    out
}

/// Where routed-expert weights come from (memory, a page cache, a disk stream, ...).
///
/// The model calls [`ExpertSource::begin_layer`] with the union of a pass's routes before it
/// asks for those experts one by one (ascending id), and, when
/// [`ExpertSource::wants_prediction`] says so, [`ExpertSource::predict`] with a guess of the
/// next MoE layer's union. Neither hint changes which bytes an expert has, only when they are
/// read, so routing and numerics never depend on them.
pub trait ExpertSource: Send + Sync {
    /// Expert `expert` of MoE layer `layer`.
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError>;

    /// The experts this pass needs at `layer` (ascending, no duplicates), in the order they
    /// will be requested. A streaming source starts reading them now.
    fn begin_layer(&self, _layer: usize, _experts: &[usize]) {}

    /// Which of `pending` (experts of `layer` this pass still has to request, from the
    /// route union) to request next, as an index into `pending`: a streaming source blocks
    /// until one of them is in memory and names it, so the model multiplies hits first and
    /// misses in the order their reads complete. The default, 0, keeps the union's order.
    /// Only the request order changes, never a result (each expert's product lands in its
    /// own slot and the weighted sum runs in route order).
    fn next_ready(&self, _layer: usize, _pending: &[usize]) -> usize {
        0
    }

    /// Whether [`ExpertSource::predict`] is worth calling (it costs one extra router product).
    fn wants_prediction(&self) -> bool {
        false
    }

    /// A guess (PILOT: the next layer's router on this layer's input) of the union `layer`
    /// will need, for a pass of `rows` tokens, most confident first (see [`rank_guesses`]);
    /// precision and recall are measured against the later [`ExpertSource::begin_layer`].
    fn predict(&self, _layer: usize, _rows: usize, _guesses: &[PilotGuess]) {}

    /// Counters so far (`None` for sources that do no I/O).
    fn stats(&self) -> Option<ExpertStats> {
        None
    }

    /// The routes of one pass at `layer`: row `r` chose `ids[r·k..(r+1)·k]` with router
    /// weights `weights[r·k..(r+1)·k]`, in the authoritative order (for router traces).
    fn record_routes(&self, _layer: usize, _k: usize, _ids: &[usize], _weights: &[f32]) {}
}
