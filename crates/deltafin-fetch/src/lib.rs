//! `deltafin-fetch`: pinned, parallel, resumable and verified downloads of the K3, DSpark
//! and Qwen3 files, and the `setup` family of commands that plan and perform installs.
//!
//! - [`manifest`]: the committed source manifests (pinned revision, files, sizes, sha256).
//! - [`hub`]: a Hugging Face Hub client (`resolve/<revision>/<file>`, redirects,
//!   `X-Repo-Commit` checked against the pin, range requests, `HF_ENDPOINT`, `HF_TOKEN`).
//! - [`transfer`]: the parallel transfer engine (`.part` files, resume by range, bounded
//!   retries with backoff, sha256 and size checks, atomic rename).
//! - [`inventory`]: the K3 tensor inventory rebuilt from the 96 shard headers.
//! - [`plan`], [`check`], [`setup`]: plans (dry run), offline audits and the install steps.
//! - [`lock`]: the install lock of a model root (installers hold it whole, expert fetches
//!   one byte each).
//! - [`expert`]: on-demand fetch of one routed expert's exact byte range (stream installs).
//! - [`hf_cache`]: files already in a Hugging Face hub cache (`hf download`), verified
//!   against the pins and hard-linked (or copied) instead of fetched again.
//! - [`receipts`]: the SHA-256 recorded for each weight file fetched without a pinned
//!   digest, re-checked by `setup --check`.
//! - [`progress`]: progress bars on stderr (transfers, and the CLI's conversions).
//! - `mock_hub` (feature `mock`): an in-process HTTP server speaking the hub protocol, with
//!   fault injection, for tests; `synth_source` (feature `mock`) builds a synthesized K3
//!   source and its manifests for it.

// No unsafe code: this crate needs none (docs/ARCHITECTURE.md "Invariants").
#![forbid(unsafe_code)]

pub mod check;
pub mod disk;
pub mod error;
pub mod expert;
pub mod hf_cache;
pub mod hub;
pub mod inventory;
pub mod layers;
pub mod lock;
pub mod manifest;
#[cfg(feature = "mock")]
pub mod mock_hub;
pub mod plan;
pub mod progress;
pub mod receipts;
pub mod setup;
#[cfg(feature = "mock")]
pub mod synth_source;
pub mod transfer;

pub use error::FetchError;
