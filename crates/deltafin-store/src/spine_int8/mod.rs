//! The row-int8 spine on disk (docs/K3.md §12.6): conversion from the BF16 shards,
//! zero-copy loading, and a full hash check.
//!
//! Layout under the model root: `k3-resident-int8/tensors/<name>.i8` (int8 codes, row-major),
//! `<name>.sc` (one little-endian f16 scale per row) and `<name>.row-i8.json` (the receipt,
//! schema [`RECEIPT_SCHEMA`]), where `<name>` is the full checkpoint tensor name.
//!
//! Quantized: every 2-D BF16 spine matrix whose name contains none of [`EXCLUDED`], except
//! the router (`block_sparse_moe.gate.weight`) and the embedding; `lm_head` is quantized.
//! The rule is [`deltafin_tensor::int8::quantize_row`] (one function for conversion and for
//! in-memory quantization).
//!
//! Loading checks every receipt (schema, tensor, source dtype and shape against the
//! inventory, byte counts) and every file size, maps the files, and scans the f16 scales; it
//! does **not** hash the 53 GB of codes. [`verify_spine`] (`deltafin convert-spine-int8
//! --check`) re-hashes every output and its BF16 source against the receipts.
//!
//! Conversion is resumable: each tensor is written to `<name>.i8.part` / `<name>.sc.part`,
//! and every `checkpoint_rows` rows the parts are synced and `<name>.progress.json` records
//! the rows done. A restart truncates the parts to the recorded rows and continues; the
//! result is byte-identical to an uninterrupted conversion because each row is quantized
//! independently. Finished parts are renamed into place and the receipt is written last (a
//! receipt means a complete tensor). `.convert.lock` (an advisory file lock, released when
//! the process dies) keeps a second converter out.

mod convert;
mod format;
#[cfg(test)]
mod tests;
mod verify;

pub use convert::*;
pub use format::*;
pub use verify::*;
