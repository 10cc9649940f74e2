//! The DFSP format's constants, records and digests, shared by the writer and the reader
//! (layout: [`crate::spine_pack`]).

use crate::checkpoint::{CONFIG_FILE, CheckpointError, INDEX_FILE};
use crate::spine_int8::{SpineError, SpineFormat};
use deltafin_tensor::{Bytes, DType};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// File magic.
pub const MAGIC: [u8; 8] = *b"DFSPINE\0";
/// Format version (major, minor).
pub const VERSION: (u16, u16) = (1, 0);
/// Superblock bytes.
pub const SUPERBLOCK: usize = 4096;
/// Tensor record bytes.
pub const TENSOR_RECORD: usize = 256;
/// Chunk record bytes.
pub const CHUNK_RECORD: usize = 48;
/// Payload alignment in the file.
pub const PAYLOAD_ALIGN: u64 = 64 << 10;
/// Component alignment inside the payload.
pub const COMPONENT_ALIGN: u64 = 256;
/// Default chunk size of the written packs.
pub const DEFAULT_CHUNK: u64 = 8 << 20;
/// Endian tag as stored (little endian).
pub const ENDIAN_TAG: u32 = 0x0102_0304;
/// Root of the int8 packs under the model root.
pub const INT8_PACK_DIR: &str = "k3-resident-packs";
/// Root of the BF16 packs under the model root.
pub const BF16_PACK_DIR: &str = "k3-resident-packs-bf16";
/// Layer field of `globals.dfsp`.
pub const GLOBAL_LAYER: u32 = u32::MAX;
/// Longest tensor name a record holds.
pub const MAX_NAME: usize = 96;

pub(super) const OFF_DIRECTORY_DIGEST: usize = 288;
pub(super) const OFF_PAYLOAD_DIGEST: usize = 320;
pub(super) const OFF_PACK_DIGEST: usize = 352;
/// Offset in the superblock of the header digest (the digest of the superblock before it).
pub const OFF_HEADER_DIGEST: usize = 384;
pub(super) const HEADER_END: usize = 416;
pub(super) const MAX_RANK: usize = 4;
pub(super) const SLICE: usize = 1 << 20;
pub(super) const LOCK_FILE: &str = ".pack.lock";

/// The default pack root of `format` (relative to the model root).
pub fn default_pack_dir(format: SpineFormat) -> &'static str {
    match format {
        SpineFormat::Int8 => INT8_PACK_DIR,
        SpineFormat::Bf16 => BF16_PACK_DIR,
    }
}

/// The layout schema string whose SHA-256 is the layout-schema digest.
pub fn layout_schema(format: SpineFormat) -> String {
    format!(
        "deltafin-dfsp v{}.{} format={} superblock={SUPERBLOCK} tensor_record={TENSOR_RECORD} \
         chunk_record={CHUNK_RECORD} payload_align={PAYLOAD_ALIGN} component_align={COMPONENT_ALIGN} \
         order=codes,scales,raw hash=sha256",
        VERSION.0,
        VERSION.1,
        format.as_str()
    )
}

/// A DFSP error; each names the pack file and the field, chunk or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
    #[error("{path}: corrupt spine pack: {message} (rerun `deltafin pack-spine` to rebuild it)")]
    Corrupt { path: PathBuf, message: String },
    #[error(
        "{path}: holds the {found} spine where {expected} packs belong (bf16 packs live under \
         {BF16_PACK_DIR}/, int8 packs under {INT8_PACK_DIR}/)"
    )]
    WrongFormat {
        path: PathBuf,
        found: &'static str,
        expected: &'static str,
    },
    #[error(
        "{path}: the pack was built from a different {what}; rerun `deltafin pack-spine` to rebuild it"
    )]
    Identity { path: PathBuf, what: &'static str },
    #[error("{path} is missing: run `deltafin pack-spine` first")]
    Missing { path: PathBuf },
    #[error("--layer {layer} is out of range: the model has {layers} layers (0…{})", layers.saturating_sub(1))]
    LayerOutOfRange { layer: usize, layers: usize },
    #[error("tensor `{tensor}`: {message}")]
    Source { tensor: String, message: String },
    #[error(
        "{path} is held by another `deltafin pack-spine` (one packer per output root); wait for it to finish"
    )]
    Locked { path: PathBuf },
    #[error("chunk size {0}: must be a positive multiple of {COMPONENT_ALIGN}")]
    ChunkSize(u64),
    #[error(
        "int8 packs need the row-int8 spine: run `deltafin convert-spine-int8` first (or pack --spine bf16): {0}"
    )]
    Int8Spine(#[from] SpineError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

pub(super) fn io_err(path: &Path) -> impl Fn(std::io::Error) -> PackError + '_ {
    move |e| PackError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// How a tensor's bytes are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    /// The checkpoint's bytes.
    Raw = 0,
    /// Row-major int8 codes plus one little-endian f16 scale per row.
    RowI8F16Scale = 1,
}

pub(super) fn dtype_code(d: Option<DType>) -> Option<u8> {
    Some(match d {
        None => 0,
        Some(DType::U8) => 1,
        Some(DType::I8) => 2,
        Some(DType::F16) => 3,
        Some(DType::BF16) => 4,
        Some(DType::F32) => 5,
        Some(_) => return None,
    })
}

pub(super) fn dtype_from_code(c: u8) -> Option<Option<DType>> {
    Some(match c {
        0 => None,
        1 => Some(DType::U8),
        2 => Some(DType::I8),
        3 => Some(DType::F16),
        4 => Some(DType::BF16),
        5 => Some(DType::F32),
        _ => return None,
    })
}

pub(super) fn format_code(f: SpineFormat) -> u32 {
    match f {
        SpineFormat::Bf16 => 1,
        SpineFormat::Int8 => 2,
    }
}

/// Which pack: a zero-based layer or the globals.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackId {
    Layer(usize),
    Globals,
}

impl PackId {
    /// `layer-NNN.dfsp` or `globals.dfsp`.
    pub fn file_name(self) -> String {
        match self {
            PackId::Layer(l) => format!("layer-{l:03}.dfsp"),
            PackId::Globals => "globals.dfsp".to_string(),
        }
    }

    pub(super) fn code(self) -> u32 {
        match self {
            PackId::Layer(l) => l as u32,
            PackId::Globals => GLOBAL_LAYER,
        }
    }
}

/// The three identity digests of a pack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackIdentity {
    pub model: [u8; 32],
    pub inventory: [u8; 32],
    pub layout: [u8; 32],
}

/// One hashed byte range of the payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Component {
    /// Payload-relative offset and length.
    pub offset: u64,
    pub len: u64,
    pub sha256: [u8; 32],
}

/// One tensor of a pack.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    pub codec: Codec,
    pub source_dtype: DType,
    /// `I8` for `RowI8F16Scale`, else the source dtype.
    pub stored_dtype: DType,
    pub shape: Vec<usize>,
    pub data: Component,
    /// The f16 row scales (`RowI8F16Scale` only).
    pub scales: Option<Component>,
}

/// A tensor to pack: its description and source bytes.
#[derive(Clone, Debug)]
pub struct PackSource {
    pub name: String,
    pub codec: Codec,
    pub source_dtype: DType,
    pub shape: Vec<usize>,
    pub data: Bytes,
    pub scales: Option<Bytes>,
}

pub(super) fn round_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

pub(super) fn sha(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// The model digest: SHA-256 of `config.json` then `model.safetensors.index.json`.
pub fn model_digest(root: &Path) -> Result<[u8; 32], PackError> {
    let mut h = Sha256::new();
    for f in [CONFIG_FILE, INDEX_FILE] {
        let p = root.join(f);
        let b = std::fs::read(&p).map_err(io_err(&p))?;
        h.update((b.len() as u64).to_le_bytes());
        h.update(&b);
    }
    Ok(h.finalize().into())
}

/// The source-inventory digest of `sources` (names, codecs, source dtypes, shapes).
pub fn inventory_digest(sources: &[PackSource]) -> [u8; 32] {
    let mut h = InventoryHasher::default();
    for s in sources {
        h.add(&s.name, s.codec, s.source_dtype, &s.shape);
    }
    h.finish()
}

#[derive(Default)]
pub(super) struct InventoryHasher(Sha256);

impl InventoryHasher {
    pub(super) fn add(&mut self, name: &str, codec: Codec, dtype: DType, shape: &[usize]) {
        let h = &mut self.0;
        h.update(name.as_bytes());
        h.update([0, codec as u8]);
        h.update(dtype.as_str().as_bytes());
        for d in shape {
            h.update((*d as u64).to_le_bytes());
        }
        h.update(b"\n");
    }
    pub(super) fn finish(self) -> [u8; 32] {
        self.0.finalize().into()
    }
}
pub(super) fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
pub(super) fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
pub(super) fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
pub(super) fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
pub(super) fn get_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}
pub(super) fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}
pub(super) fn get_digest(b: &[u8], at: usize) -> [u8; 32] {
    let mut a = [0u8; 32];
    a.copy_from_slice(&b[at..at + 32]);
    a
}

pub(super) fn pack_digest(id: &PackIdentity, directory: &[u8; 32], payload: &[u8; 32]) -> [u8; 32] {
    let mut h = Sha256::new();
    for d in [&id.model, &id.inventory, &id.layout, directory, payload] {
        h.update(d);
    }
    h.finalize().into()
}

pub(super) fn header_digest(sb: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(&sb[..OFF_HEADER_DIGEST]);
    h.update([0u8; 32]);
    h.update(&sb[HEADER_END..SUPERBLOCK]);
    h.finalize().into()
}
