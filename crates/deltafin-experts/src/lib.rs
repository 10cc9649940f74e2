//! `deltafin-experts`: routed-expert storage for K3.
//!
//! Locates each expert's six byte ranges (MXFP4 codes and E8M0 scales of w1/w2/w3), reads
//! them explicitly from disk under a RAM budget, caches hot experts and prefetches the next
//! layer's likely picks. The model never touches expert bytes except through this crate.
//!
//! - [`ExpertSource`]: what the model asks for (one expert's three matrices), plus the
//!   scheduling hints a streaming source uses (the layer's route union, a next-layer guess);
//!   [`Layered`]: a source over another one that changes only what its [`SourceLayer`] says.
//! - [`observe`]: the route observers a model calls with every pass's routes ([`heat`] and
//!   [`trace`] are two).
//! - [`StreamingExperts`]: positional reads (`pread`, O_DIRECT on Linux when the filesystem
//!   allows it) by a bounded pool of I/O threads into aligned, reused buffers, an expert cache
//!   under a byte budget with a decayed-heat policy, and PILOT next-layer prefetch.
//! - [`scale4`]: lossless 4-bit scale sidecars (`K3SC4V2`) and the source that reads them.
//! - [`homes`]: expert homes, directories on other drives holding verified copies of
//!   experts that [`StreamingExperts::with_homes`] reads from (and [`homes::place`] fills).
//! - [`probe`]: the read-bandwidth probe (same read path) that throughput is reported against.

pub mod buffer;
pub mod error;
pub mod heat;
pub mod homes;
pub mod io;
pub mod layout;
pub mod observe;
pub mod policy;
pub mod probe;
pub mod rank;
pub mod scale4;
pub mod source;
pub mod stats;
pub mod stream;
pub mod trace;

#[cfg(test)]
pub(crate) mod test_support;

pub use error::ExpertError;
pub use homes::{ExpertHomes, HomeModel};
pub use layout::{ExpertLocation, ExpertShape, ExpertTable};
pub use observe::{PassRoutes, RouteObserver, RouteObservers};
pub use source::{
    ExpertSource, ExpertWeights, Layered, PilotGuess, ShapeMismatch, SourceLayer, rank_guesses,
};
pub use stats::{ExpertStats, HomeReadStats, LayerStats, RankStats};
pub use stream::{DirectIo, PilotGate, StreamOptions, StreamingExperts};
pub use trace::{RouterTrace, TraceMode};
