//! Weights and formats: what a checkpoint holds, how it is read, converted and kept in memory.
//!
//! `config.json` is [`crate::config`]; the tensor inventory every reader checks against is
//! [`crate::model::inventory`].
//! - [`checkpoint`]: the safetensors shards, their index and the per-expert files.
//! - [`loader`]: builds a [`crate::model::K3Model`] from a checkpoint (bf16, int8 or packed
//!   spine; resident or streamed layers; expert sources).
//! - [`spine_int8`]: the row-int8 spine conversion and its files; [`spine_quality`]: the
//!   agreement check of an int8 spine against bf16.
//! - [`spine_pack`]: the DFSP packed spine (one file per layer, optional compression).
//! - [`spine_stream`]: the layers read from disk per forward pass when the spine does not fit.
//! - [`resident`]: the copy of the resident spine into huge-page memory.
//! - [`install`]: an install directory (checkpoint + tokenizer) opened as a model.
//! - [`filelock`]: the advisory lock that serialises conversions of one checkpoint.

pub mod checkpoint;
pub mod filelock;
pub mod install;
pub mod loader;
pub mod resident;
pub mod spine_int8;
pub mod spine_pack;
pub mod spine_quality;
pub mod spine_stream;
