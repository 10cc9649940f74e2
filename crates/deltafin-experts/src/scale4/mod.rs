//! Lossless scale4 expert sidecars (`K3SC4V2`, docs/K3.md §12.4).
//!
//! Every E8M0 scale byte `s` of an expert matrix is stored as a 4-bit delta `δ = s − base`
//! from the matrix minimum `base`; a matrix whose scales span more than `base…base+15` cannot
//! be encoded (an error naming layer, expert and matrix). The E2M1 codes are untouched, so
//! decoding `base + δ` gives back the raw scale bytes exactly.
//!
//! **Nibble order**: the scales of a matrix are taken row-major (`[rows, cols/32]` flattened);
//! scale `2j` goes in the low nibble of delta byte `j`, scale `2j+1` in the high nibble (the
//! order of the E2M1 codes). An odd count leaves the last high nibble 0.
//!
//! **File** `L{layer}.sc4` (all integers little-endian):
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic `K3SC4V2\0` |
//! | 8 | u32 version 2, u32 layout id 2 |
//! | 16 | u32 header bytes, u32 record bytes, u32 layer, u32 experts, u32 F, u32 Lr |
//! | 64 | record index: per expert a u64 file offset of its record |
//!
//! The header is `64 + 8·experts` bytes rounded up to 4,096, at least 8,192 (8,192 for K3);
//! the records follow in expert order. One record:
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic `K3SC4REC`, u32 version 2, u32 layer, u32 expert, u32 F, u32 Lr, u32 0 |
//! | 32 | sha256 of the three delta regions (the bytes from 8,192 to the end of w3's deltas) |
//! | 64 | per matrix w1, w2, w3: u32 base, u32 rows, u32 cols, u32 scale count |
//! | 128 | three 16-entry f32 exponent tables: entry δ is the f32 bit pattern `(base+δ) << 23` |
//! | 8,192 | w1 deltas, w2 deltas, w3 deltas (`⌈n/2⌉` bytes each), zero padding to a 4,096 multiple |
//!
//! For K3 (F 3,072, Lr 3,584) a record is 8,192 + 3 × 172,032 = 524,288 bytes. (A table
//! entry for base+δ = 0 is +0.0, not the subnormal 2⁻¹²⁷ of `e8m0_scale(0)`; the CPU path
//! never uses the tables — it decodes the deltas back to E8M0 bytes.)
//!
//! The in-memory compact blob of one expert (the GPU layout) is an 8,192-byte record header,
//! then per matrix its E2M1 codes and its deltas: 17,039,360 bytes for K3.
//!
//! `scale4-manifest.json` (schema `deltafin-expert-scale4-v2`) is written last by the
//! converter and lists every layer file with its size, expert count and sha256.

mod convert;
mod error;
mod format;
mod manifest;
mod source;

pub use convert::{RawSource, convert_layer, raw_file_table, sha256_file, verify_layer};
pub use error::Scale4Error;
pub use format::{
    EncodedScales, LAYOUT_ID, MAGIC, MANIFEST_FILE, MATRICES, RECORD_HEADER, RECORD_MAGIC,
    SCALE4_DIR, SCHEMA, Scale4Layout, VERSION, check_file_header, compact_blob, decode_expert,
    decode_matrix, encode_expert, encode_matrix, exponent_table, file_header, layer_file_name,
    parse_record, write_record,
};
pub use manifest::{ManifestLayer, Scale4Manifest, Scale4Sidecars};
pub use source::Scale4Experts;

#[cfg(test)]
mod tests;
