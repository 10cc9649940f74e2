//! Tests of the storage formats (`deltafin-store`) that need the model: loading a converted or
//! packed spine and comparing logits, over synthesized checkpoints.

mod a_log;
mod checkpoint;
mod offload;
mod spine_int8;
mod spine_pack;
