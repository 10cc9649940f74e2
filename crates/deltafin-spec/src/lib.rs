//! `deltafin-spec`: speculative decoding with K3 as the sole authority.
//!
//! Drafters (DSpark for chat, Qwen3 0.6B/1.7B for raw completion) propose tokens; K3
//! verifies each proposal in one pass and only its own greedy choices are ever emitted.
