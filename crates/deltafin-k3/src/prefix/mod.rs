//! Conversation state: the prompt's prefill in aligned, cancellable passes
//! ([`prefill`]), resumed from stored prefix states ([`cache`], RAM and [`disk`] tiers).
//! docs/NUMERICS.md "Prefix-state reuse" states why a resumed prefill gives the cold
//! prefill's bits; docs/SERVER.md "Conversation state" what is stored where.

pub mod cache;
pub(crate) mod disk;
pub mod prefill;
pub mod snapshot;

pub use cache::{CacheConfig, CacheStats, PrefixCache};
pub use prefill::{Chunked, OnePass, PrefillProgress, Prefilled, Prefiller, message_ends};
pub use snapshot::Snapshot;

#[cfg(test)]
mod tests;
