//! The model: the K3 blocks, one per file, and the layer loop that composes them.
//!
//! - [`forward`]: [`K3Model`], embedding → layer loop with Attention Residuals → output head;
//!   prefill, decode, taps, and the PILOT hints across layers and tokens.
//! - [`layer`]: one decoder layer's weights ([`Layer`], [`Attention`], [`Ffn`]) and the
//!   fixed order of its projections ([`layer::linears_mut`]).
//! - Blocks: [`attn_res`] (Attention Residuals), [`kda`] (Kimi Delta Attention), [`mla`]
//!   (gated MLA and its cache), [`router`], [`moe`] (latent MoE and the expert-source
//!   traits), [`situ`] (SiTU-GLU MLPs), [`norm`] (RMSNorm), [`linear`] (a projection in any
//!   weight format, on the CPU or a device).
//! - Support: [`dims`] (every size, from `config.json`) and [`inventory`] (every tensor's name,
//!   stored shape and dtype: the one table the loader, validation and synthesis read), both
//!   re-exported from `deltafin-store` where they are defined; [`state`] (per-sequence KDA state
//!   and MLA cache), [`taps`] (activation taps), [`next_token`] (the provisional head),
//!   [`profile`] (per-layer phase times of every pass, `run --layer-profile`).
//! - Storage seen from the model: [`spine`] (the trait a streamed spine implements, the
//!   resident copy's report); the model imports nothing from `crate::weights`.
//! - On a device: [`offload`] (the spine placed on a [`deltafin_kernels::ProductDevice`]) and
//!   [`device_experts`] (the device cache of routed experts).
//!
//! Errors are [`ModelError`] ([`crate::error`]).

pub mod attn_res;
pub mod device_experts;
mod exec;
pub(crate) mod finite;
pub mod forward;
pub mod kda;
pub mod layer;
pub mod linear;
pub mod mla;
pub mod moe;
pub mod moe_schedule;
pub mod next_token;
pub mod norm;
pub mod offload;
pub mod profile;
pub mod router;
pub mod situ;
pub mod spine;
pub mod state;
pub mod taps;

pub use crate::error::ModelError;
pub use deltafin_store::{dims, inventory};
pub use exec::Watch;
pub use forward::{K3Model, LogitRows, Logits, Segment};
pub use kda::KdaForm;
pub use layer::{Attention, Ffn, Layer};
pub use next_token::greedy;
