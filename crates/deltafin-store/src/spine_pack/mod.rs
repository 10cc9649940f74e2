//! DFSP per-layer spine packs (docs/K3.md §12.7): one contiguous, aligned file per layer
//! (`layer-NNN.dfsp`, zero-based) plus `globals.dfsp` (the embedding, `lm_head`, the final
//! norm and the output Attention-Residual tensors), so a layer loads with one read (or one
//! mmap) and every byte is covered by a SHA-256.
//!
//! BF16 packs live under `k3-resident-packs-bf16/` and hold the checkpoint's exact bytes of
//! every spine tensor (codec `Raw`). Int8 packs live under `k3-resident-packs/` and hold the
//! row-int8 spine (§4.6) of every quantized matrix (codec `RowI8F16Scale`: int8 codes plus one
//! f16 scale per row) and the raw checkpoint bytes of every other spine tensor.
//!
//! # Layout (all integers little endian)
//!
//! ```text
//! [0, 4096)            superblock
//! [4096, 4096 + D)     directory: T tensor records (256 B) then C chunk records (48 B)
//! [.., P)              zero padding; P = round_up(4096 + D, 64 KiB)
//! [P, P + L)           payload: every int8 code block, then every f16 scale block, then
//!                      every raw tensor ("quantized bytes, then row scales, then raw
//!                      tails"), each component at a 256-B aligned payload offset, zero gaps,
//!                      L rounded up to 256 B
//! ```
//!
//! Superblock:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `DFSPINE\0` |
//! | 8 | 2 + 2 | version major 1, minor 0 |
//! | 12 | 4 | endian tag `0x01020304` |
//! | 16 | 4 | superblock size 4,096 |
//! | 20 | 4 | tensor record size 256 |
//! | 24 | 4 | chunk record size 48 |
//! | 28 | 4 | spine format: 1 = bf16, 2 = int8 |
//! | 32 | 4 | layer index (zero-based), `0xFFFFFFFF` for `globals.dfsp` |
//! | 36 | 4 | the model's layer count |
//! | 40 | 4 | tensor count T |
//! | 44 | 4 | chunk count C |
//! | 48 | 8 | chunk size (8 MiB default) |
//! | 56 | 8 | directory offset (4,096) |
//! | 64 | 8 | directory length D = 256 T + 48 C |
//! | 72 | 8 | payload offset P (64 KiB multiple) |
//! | 80 | 8 | payload length L |
//! | 88 | 8 | file length P + L |
//! | 96 | 32 | model digest |
//! | 128 | 32 | source-inventory digest |
//! | 160 | 32 | layout-schema digest |
//! | 192 | 96 | zero |
//! | 288 | 32 | directory digest: SHA-256 of the directory bytes |
//! | 320 | 32 | payload digest: SHA-256 of the payload bytes |
//! | 352 | 32 | pack digest: SHA-256 of the three identity digests, the directory digest and the payload digest |
//! | 384 | 32 | header digest: SHA-256 of the superblock with these 32 bytes zeroed |
//! | 416 | 3,680 | zero |
//!
//! Tensor record (256 B): name (UTF-8, NUL padded, ≤ 96 B) at 0; codec (`Raw = 0`,
//! `RowI8F16Scale = 1`) at 96; source dtype at 97 and stored dtype at 98 (`None = 0`, `U8 = 1`,
//! `I8 = 2`, `F16 = 3`, `BF16 = 4`, `F32 = 5`); rank (≤ 4) at 99; zero u32 at 100; shape as
//! four u64 at 104 (unused dims 0); data offset / length at 136 / 144 and scale offset /
//! length at 152 / 160 (payload-relative; scales 0 / 0 for `Raw`); zero at 168..192; SHA-256 of
//! the data component at 192 and of the scale component at 224 (zero for `Raw`).
//!
//! Chunk record (48 B): payload offset u64, length u64, SHA-256 of those bytes. Chunks tile
//! the payload exactly (all `chunk size` long but the last).
//!
//! Identity: the model digest is SHA-256 of `config.json` and `model.safetensors.index.json`;
//! the source-inventory digest is SHA-256 over each tensor's name, codec, source dtype and
//! shape in directory order; the layout-schema digest is SHA-256 of [`layout_schema`], which
//! names the spine format, so a bf16 pack under the int8 root (or the reverse) is rejected.
//!
//! Writing streams the tensors into `<pack>.part`, hashing chunks, components and the payload
//! as they are written, writes the directory and superblock last, syncs, and renames into
//! place (then syncs the directory). [`SpinePack::open`] maps the file and validates the
//! superblock, header and directory digests and every record; [`SpinePack::verify`]
//! re-hashes every chunk and component and checks every padding byte.
//!
//! Loading: [`PackSet::open_if_complete`] opens every pack of a complete default pack root
//! (validation and identity, no payload re-hash); `deltafin_k3::weights::loader` then takes every spine
//! tensor from it as zero-copy views (logits bit-identical to the shard / int8-file spine).

mod format;
mod read;
mod set;
mod write;

pub use format::*;
pub use read::*;
pub use set::*;
pub use write::*;
