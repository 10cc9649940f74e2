//! Weights: the model built from what a checkpoint holds, and kept in memory.
//!
//! The storage itself (no model math) is the `deltafin-store` crate, re-exported here under
//! its old paths: [`checkpoint`] (the safetensors shards, their index and the per-expert
//! files), [`spine_int8`] (the row-int8 spine conversion and its files), [`spine_pack`] (the
//! DFSP packed spine), [`filelock`] (the advisory lock that serialises conversions);
//! `config.json` is [`crate::config`] and the tensor inventory every reader checks against is
//! [`deltafin_store::inventory`]. What turns those bytes into model values lives here:
//! - [`loader`]: builds a [`crate::model::K3Model`] from a checkpoint (bf16, int8 or packed
//!   spine; resident or streamed layers; expert sources).
//! - [`spine_quality`]: the agreement check of an int8 spine against bf16.
//! - [`spine_stream`]: the layers read from disk per forward pass when the spine does not fit.
//! - [`resident`]: the copy of the resident spine into huge-page memory.
//! - [`install`]: an install directory (checkpoint + tokenizer) opened as a model.

pub use deltafin_store::{checkpoint, filelock, spine_int8, spine_pack};

pub mod install;
pub mod loader;
pub mod resident;
pub mod spine_quality;
pub mod spine_stream;
#[cfg(test)]
mod store_tests;
