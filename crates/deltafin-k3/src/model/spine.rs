//! What the model takes from the engine's weight storage, named here so that `model/`
//! imports nothing from `weights/`: the layers a spine streamer reads per pass
//! ([`StreamedSpine`], implemented by `crate::weights::spine_stream::SpineStreamer`) and the
//! report of the resident copy ([`ResidentCopy`], made by
//! `crate::weights::resident`).

use std::any::Any;

use deltafin_tensor::storage::CopyStats;

use crate::error::ModelError;
use crate::model::layer::Layer;

/// A spine whose layers past a resident prefix are read per forward pass.
pub trait StreamedSpine: Send + Sync + Any {
    /// How many leading layers stay resident (use the model's own weights).
    fn resident_layers(&self) -> usize;
    /// Start a forward pass: the first streamed layer's read begins now. Passes run one at
    /// a time; the pass's reads are collected when it drops.
    fn begin_pass(&self) -> Result<Box<dyn SpineLayers + '_>, ModelError>;
    /// The streamer itself, for its owner's reports.
    fn as_any(&self) -> &dyn Any;
}

/// One forward pass over a streamed spine: hands out each layer's weights in order.
pub trait SpineLayers {
    /// The weights of layer `l`: `None` for a resident layer (use the model's own), else
    /// `resident` (the model's entry for `l`, which supplies the small tensors) with its
    /// projections over the freshly read buffer.
    fn layer(&mut self, l: usize, resident: &Layer) -> Result<Option<Layer>, ModelError>;
}

/// What [`K3Model::copy_spine_to_huge_pages`](crate::model::K3Model::copy_spine_to_huge_pages)
/// copied.
#[derive(Clone, Debug, PartialEq)]
pub struct ResidentCopy {
    /// What was copied (`resident spine`, `routed experts`).
    pub what: &'static str,
    /// Matrices copied (projections, routers, `lm_head`).
    pub matrices: usize,
    /// Bytes of the one anonymous mapping.
    pub bytes: u64,
    /// Whether the system accepted the huge-page advice for it.
    pub huge_advised: bool,
    /// How the bytes arrived (read from their files, O_DIRECT or buffered, or copied from
    /// memory) and how long it took.
    pub stats: CopyStats,
}

impl ResidentCopy {
    /// One line for `--stats` and the startup log.
    pub fn describe(&self) -> String {
        let s = &self.stats;
        format!(
            "{}: {} matrices, {:.3} GB in anonymous memory ({}): {} ({:.3} GB/s)",
            self.what,
            self.matrices,
            self.bytes as f64 / 1e9,
            if self.huge_advised {
                "transparent huge pages advised"
            } else {
                "huge-page advice refused: 4 KiB pages"
            },
            s.describe(),
            s.total_bytes() as f64 / 1e9 / s.seconds.max(1e-9)
        )
    }
}
