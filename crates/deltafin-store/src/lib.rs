//! `deltafin-store`: Kimi K3's weights on disk, with no model math.
//!
//! What a model root holds and how its bytes are found, checked, converted and locked:
//! `config.json`, the one table of tensor names and shapes derived from it, the release
//! safetensors shards (or a stream install's per-tensor files), the row-int8 spine, DFSP spine
//! packs and the advisory file locks around conversions. `deltafin-k3` builds the model from
//! these (its `weights` module: the loader, spine streaming, the resident copy) and re-exports
//! the modules here under their old paths (`deltafin_k3::config`, `deltafin_k3::weights::…`,
//! `deltafin_k3::model::{dims, inventory}`); the conversions of the CLI (`convert-spine-int8`,
//! `pack-spine`, `warm-expert-cache`, `convert-experts-scale4`) use this crate directly.
//!
//! All sizes come from `config.json`; nothing is hard-coded to the released dimensions.
//!
//! # Code map
//!
//! ```text
//! config.rs       config.json (K3Config), parsed strictly: a leaf
//! dims.rs         ModelDims: the sizes and the layer schedule the model runs with, derived
//!                 from the config
//! inventory.rs    every tensor's name, stored shape, dtype and shard: the one table that
//!                 validation, the loader and synthesis read
//! checkpoint/     Checkpoint: the shards and their index (or a stream install) validated
//!                 against the inventory; the per-expert files
//! spine_int8/     the row-int8 spine: its files, the resumable conversion, the check
//! spine_pack/     DFSP packs: one file per spine layer, optionally compressed
//! install.rs      whether a root is an install, its checkpoint opened, write access
//! resident.rs     HugePages: whether the resident spine is copied into huge-page memory
//! filelock.rs     the advisory locks that serialise conversions of one checkpoint
//! ```
//!
//! Dependencies point one way: `config` is a leaf; `dims` and `inventory` read it;
//! `checkpoint` checks files against the inventory; the spine formats read checkpoints and
//! take `filelock` around their conversions.
//!
//! The crate sits between `deltafin-experts` and `deltafin-k3` in the workspace order and uses
//! only `deltafin-tensor` of the crates below it.

pub mod checkpoint;
pub mod config;
pub mod dims;
pub mod experts;
pub mod filelock;
pub mod install;
pub mod inventory;
pub mod resident;
pub mod spine_int8;
pub mod spine_pack;
pub mod spine_reader;

pub use checkpoint::{Checkpoint, CheckpointError};
pub use config::K3Config;
pub use dims::ModelDims;
