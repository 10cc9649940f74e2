//! `deltafin-k3`: the Kimi K3 text model.
//!
//! All sizes come from `config.json`; nothing is hard-coded to the released dimensions.
//!
//! # Code map
//!
//! ```text
//! config          config.json (K3Config): re-exported from deltafin-store
//! engine/         EngineBuilder / EngineConfig: the pure memory planner, the expert-source
//!                 stack, device placement: one load path for run, serve and library users
//! error.rs        ModelError: a leaf, returned by the blocks, the layer loop and the loaders
//! model/          the math: the blocks one per file, and the layer loop composing them
//!   forward.rs      K3Model: embedding → layers with Attention Residuals → head;
//!                   prefill, decode, taps, PILOT hints
//!   layer.rs        one layer's weights (Layer, Attention, Ffn) and its projection order
//!   attn_res.rs kda.rs mla.rs router.rs moe.rs situ.rs norm.rs linear.rs
//!                   the blocks (docs/K3.md §4) and the projection type
//!   state.rs taps.rs next_token.rs
//!                   per-sequence state, activation taps, the provisional head
//!   dims inventory  sizes, and every tensor's name, stored shape and dtype (the one table
//!                   the loader, validation and synthesis read): re-exported from
//!                   deltafin-store
//!   spine.rs        what the model takes from storage: the StreamedSpine trait, the
//!                   resident copy's report
//!   offload.rs device_experts.rs
//!                   the spine and the routed experts on a compute device
//! weights/        the model built from storage (deltafin-store: checkpoint, spine_int8,
//!                 spine_pack, filelock, re-exported here under their old paths)
//!   loader.rs       checkpoint → K3Model (spine format, streaming, expert sources)
//!   spine_quality.rs
//!                   the agreement check of an int8 spine against bf16
//!   spine_stream.rs resident.rs
//!                   layers read per pass; the resident spine copied to huge pages
//!   install.rs      an install (checkpoint + tokenizer) opened as a model
//! text/           tokenizer.rs (tiktoken-style BPE), chat/ (the XTML template)
//! prefix/         conversation state: aligned, cancellable prefill; prefix states in RAM
//!                 and on disk
//! generate.rs     generation over a loaded model
//! synth/          test-checkpoint synthesis: feature `synth`, off by default
//! ```
//!
//! Storage (no model math) is the crate below, `deltafin-store`. Dependencies point one way:
//! `error` and `text` are leaves; `model` uses `error` and the store's `config`, `dims` and
//! `inventory`, and nothing of `weights` or of the store's files (a streamed spine reaches it
//! as a `model::spine::StreamedSpine`); `weights` builds `model` values; `prefix` and `generate`
//! drive a loaded model; `engine` assembles it all. No file imports, directly or through a
//! chain, a file that imports it back, and no folder imports a folder that imports it back
//! (`tools/check_import_cycles.py` reports file- and folder-level cycles for every crate). A parent
//! module only declares and re-exports its files; it never imports from them.
//!
//! `generate` sits at the top rather than in `model/`: it is not part of the forward pass
//! but a user of it (prompt → tokens through [`model::K3Model`]), like any program that
//! embeds the model.
//!
//! Modules are reached by their real paths (`deltafin_k3::model::kda`,
//! `deltafin_k3::weights::loader`, `deltafin_k3::text::chat`, …). The crate root re-exports
//! only the types a program embedding the model starts from: [`EngineBuilder`] (with its
//! [`EngineConfig`] and the [`LoadedEngine`] it builds), the model [`K3Model`], and
//! [`ModelError`].
//!
//! Test-checkpoint synthesis (`synth`: checkpoints in the exact release layout) is compiled
//! only with the `synth` feature (and in this crate's own tests): the crates that need it in
//! tests enable it in their `[dev-dependencies]`, `xtask` in its dependencies, so a release
//! build of the CLI does not contain it.

pub use deltafin_store::config;
pub mod engine;
pub mod error;
pub mod generate;
pub mod model;
pub mod prefix;
pub mod sampling;
#[cfg(any(test, feature = "synth"))]
pub mod synth;
#[cfg(test)]
mod test_util;
pub mod text;
pub mod weights;

pub use engine::{EngineBuilder, EngineConfig, LoadedEngine};
pub use error::ModelError;
pub use model::K3Model;
