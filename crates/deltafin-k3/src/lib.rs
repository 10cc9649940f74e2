//! `deltafin-k3`: the Kimi K3 text model.
//!
//! Configuration (`config.json`), the expected tensor inventory and checkpoint reading,
//! the model blocks one per file (KDA, gated MLA, Attention Residuals, router, latent MoE,
//! SiTU-GLU), the tiktoken-based tokenizer, the XTML chat template, and greedy generation.
//! All sizes come from `config.json`; nothing is hard-coded to the released dimensions.

pub mod attn_res;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod dims;
pub mod engine;
pub mod filelock;
pub mod generate;
pub mod install;
pub mod inventory;
pub mod kda;
pub mod linear;
pub mod loader;
pub mod mla;
pub mod model;
pub mod moe;
pub mod next_token;
pub mod norm;
pub mod offload;
pub mod resident;
pub mod router;
pub mod situ;
pub mod spine_int8;
pub mod spine_pack;
pub mod spine_quality;
pub mod spine_stream;
pub mod state;
pub mod synth;
pub mod taps;
#[cfg(test)]
mod test_util;
pub mod tokenizer;
