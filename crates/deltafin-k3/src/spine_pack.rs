//! DFSP per-layer spine packs (product-contract §4.7): one contiguous, aligned file per layer
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
//! (validation and identity, no payload re-hash); `crate::loader` then takes every spine
//! tensor from it as zero-copy views (logits bit-identical to the shard / int8-file spine).

use crate::checkpoint::{CONFIG_FILE, Checkpoint, CheckpointError, INDEX_FILE};
use crate::filelock::{FileLock, try_lock};
use crate::inventory::{TensorKind, TensorSpec, text_inventory};
use crate::spine_int8::{Int8Spine, SpineError, SpineFormat};
use deltafin_tensor::{Bf16Matrix, Bytes, DType, RowInt8Matrix};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

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

const OFF_DIRECTORY_DIGEST: usize = 288;
const OFF_PAYLOAD_DIGEST: usize = 320;
const OFF_PACK_DIGEST: usize = 352;
const OFF_HEADER_DIGEST: usize = 384;
const HEADER_END: usize = 416;
const MAX_RANK: usize = 4;
const SLICE: usize = 1 << 20;
const LOCK_FILE: &str = ".pack.lock";

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

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> PackError + '_ {
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

fn dtype_code(d: Option<DType>) -> Option<u8> {
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

fn dtype_from_code(c: u8) -> Option<Option<DType>> {
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

fn format_code(f: SpineFormat) -> u32 {
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

    fn code(self) -> u32 {
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

fn round_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

fn sha(bytes: &[u8]) -> [u8; 32] {
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
struct InventoryHasher(Sha256);

impl InventoryHasher {
    fn add(&mut self, name: &str, codec: Codec, dtype: DType, shape: &[usize]) {
        let h = &mut self.0;
        h.update(name.as_bytes());
        h.update([0, codec as u8]);
        h.update(dtype.as_str().as_bytes());
        for d in shape {
            h.update((*d as u64).to_le_bytes());
        }
        h.update(b"\n");
    }
    fn finish(self) -> [u8; 32] {
        self.0.finalize().into()
    }
}

/// The tensors of pack `id` in inventory order, with their source bytes: the int8 spine's
/// codes and scales for its quantized matrices (`int8` given), the checkpoint bytes otherwise.
pub fn pack_sources(
    ckpt: &Checkpoint,
    int8: Option<&Int8Spine>,
    id: PackId,
) -> Result<Vec<PackSource>, PackError> {
    sources_of(ckpt, int8, id, &spine_specs(ckpt))
}

/// The spine tensors of the inventory (the real K3's has 497,220 records: built once).
fn spine_specs(ckpt: &Checkpoint) -> Vec<TensorSpec> {
    text_inventory(ckpt.config())
        .into_iter()
        .filter(|s| matches!(s.kind, TensorKind::Spine { .. }))
        .collect()
}

fn sources_of(
    ckpt: &Checkpoint,
    int8: Option<&Int8Spine>,
    id: PackId,
    specs: &[TensorSpec],
) -> Result<Vec<PackSource>, PackError> {
    let want = match id {
        PackId::Layer(l) => Some(l),
        PackId::Globals => None,
    };
    let mut out = Vec::new();
    for spec in specs {
        if spec.kind != (TensorKind::Spine { layer: want }) {
            continue;
        }
        if let Some(m) = int8.and_then(|s| s.get(&spec.name)) {
            out.push(PackSource {
                name: spec.name.clone(),
                codec: Codec::RowI8F16Scale,
                source_dtype: spec.dtype,
                shape: spec.shape.clone(),
                data: m.data_bytes().clone(),
                scales: Some(m.scale_bytes().clone()),
            });
        } else {
            let (dtype, shape) = ckpt.tensor_info(&spec.name)?;
            out.push(PackSource {
                name: spec.name.clone(),
                codec: Codec::Raw,
                source_dtype: dtype,
                shape,
                data: ckpt.tensor_bytes(&spec.name)?,
                scales: None,
            });
        }
    }
    Ok(out)
}

/// Payload offsets of one tensor's data and (int8) scale components.
type Offsets = (u64, Option<u64>);

/// Payload offsets of every component (codes, then scales, then raw tensors) and the
/// payload length.
fn plan(sources: &[PackSource]) -> Result<(Vec<Offsets>, u64), PackError> {
    let mut offs: Vec<Offsets> = vec![(0, None); sources.len()];
    let mut pos = 0u64;
    let mut place = |len: usize| {
        let at = round_up(pos, COMPONENT_ALIGN);
        pos = at + len as u64;
        at
    };
    for (i, s) in sources.iter().enumerate() {
        if s.codec == Codec::RowI8F16Scale {
            offs[i].0 = place(s.data.len());
        }
    }
    for (i, s) in sources.iter().enumerate() {
        if let Some(sc) = &s.scales {
            offs[i].1 = Some(place(sc.len()));
        }
    }
    for (i, s) in sources.iter().enumerate() {
        if s.codec == Codec::Raw {
            offs[i].0 = place(s.data.len());
        }
    }
    for s in sources {
        let bad = |m: String| PackError::Source {
            tensor: s.name.clone(),
            message: m,
        };
        if s.name.len() > MAX_NAME {
            return Err(bad(format!("name longer than {MAX_NAME} bytes")));
        }
        if s.shape.len() > MAX_RANK {
            return Err(bad(format!("rank {} > {MAX_RANK}", s.shape.len())));
        }
        if dtype_code(Some(s.source_dtype)).is_none() {
            return Err(bad(format!(
                "dtype {} cannot be packed (U8, I8, F16, BF16, F32)",
                s.source_dtype
            )));
        }
        let elems: usize = s.shape.iter().product();
        let (want_data, want_sc) = match s.codec {
            Codec::Raw => (elems * s.source_dtype.size(), None),
            Codec::RowI8F16Scale => (elems, Some(2 * s.shape.first().copied().unwrap_or(0))),
        };
        if s.data.len() != want_data || s.scales.as_ref().map(|b| b.len()) != want_sc {
            return Err(bad(format!(
                "{} data bytes / {:?} scale bytes, the shape {:?} needs {want_data} / {want_sc:?}",
                s.data.len(),
                s.scales.as_ref().map(|b| b.len()),
                s.shape
            )));
        }
    }
    Ok((offs, round_up(pos, COMPONENT_ALIGN)))
}

/// Streams payload bytes into the file, hashing the payload and each chunk.
struct PayloadWriter<'a> {
    w: BufWriter<File>,
    path: &'a Path,
    pos: u64,
    chunk_size: u64,
    payload: Sha256,
    chunk: Sha256,
    chunk_start: u64,
    chunks: Vec<Component>,
}

impl PayloadWriter<'_> {
    fn write(&mut self, mut b: &[u8]) -> Result<(), PackError> {
        while !b.is_empty() {
            let room = (self.chunk_start + self.chunk_size - self.pos) as usize;
            let n = room.min(b.len());
            let (head, tail) = b.split_at(n);
            self.w.write_all(head).map_err(io_err(self.path))?;
            self.payload.update(head);
            self.chunk.update(head);
            self.pos += n as u64;
            if self.pos == self.chunk_start + self.chunk_size {
                self.close_chunk();
            }
            b = tail;
        }
        Ok(())
    }

    fn close_chunk(&mut self) {
        let h = std::mem::take(&mut self.chunk);
        self.chunks.push(Component {
            offset: self.chunk_start,
            len: self.pos - self.chunk_start,
            sha256: h.finalize().into(),
        });
        self.chunk_start = self.pos;
    }

    fn pad_to(&mut self, at: u64) -> Result<(), PackError> {
        let zeros = [0u8; 256];
        while self.pos < at {
            let n = ((at - self.pos) as usize).min(zeros.len());
            self.write(&zeros[..n])?;
        }
        Ok(())
    }

    /// Write one component, returning its digest.
    fn component(
        &mut self,
        at: u64,
        data: &[u8],
        progress: &mut dyn FnMut(u64),
    ) -> Result<[u8; 32], PackError> {
        self.pad_to(at)?;
        let mut h = Sha256::new();
        for piece in data.chunks(SLICE) {
            h.update(piece);
            self.write(piece)?;
            progress(piece.len() as u64);
        }
        Ok(h.finalize().into())
    }
}

fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn get_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}
fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}
fn get_digest(b: &[u8], at: usize) -> [u8; 32] {
    let mut a = [0u8; 32];
    a.copy_from_slice(&b[at..at + 32]);
    a
}

fn pack_digest(id: &PackIdentity, directory: &[u8; 32], payload: &[u8; 32]) -> [u8; 32] {
    let mut h = Sha256::new();
    for d in [&id.model, &id.inventory, &id.layout, directory, payload] {
        h.update(d);
    }
    h.finalize().into()
}

fn header_digest(sb: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(&sb[..OFF_HEADER_DIGEST]);
    h.update([0u8; 32]);
    h.update(&sb[HEADER_END..SUPERBLOCK]);
    h.finalize().into()
}

/// What a pack write produced.
#[derive(Clone, Debug)]
pub struct WrittenPack {
    pub path: PathBuf,
    pub tensors: usize,
    /// Source bytes streamed and the file's length.
    pub source_bytes: u64,
    pub file_bytes: u64,
}

/// Write the pack of `sources` to `path` (through `path.part`, synced, renamed into place).
/// `progress` receives the source bytes written since its last call.
#[allow(clippy::too_many_arguments)]
pub fn write_pack(
    path: &Path,
    format: SpineFormat,
    id: PackId,
    layers: usize,
    model: [u8; 32],
    sources: &[PackSource],
    chunk_size: u64,
    progress: &mut dyn FnMut(u64),
) -> Result<WrittenPack, PackError> {
    if chunk_size == 0 || !chunk_size.is_multiple_of(COMPONENT_ALIGN) {
        return Err(PackError::ChunkSize(chunk_size));
    }
    let (offs, payload_len) = plan(sources)?;
    let n_chunks = payload_len.div_ceil(chunk_size);
    let dir_len = (sources.len() * TENSOR_RECORD) as u64 + n_chunks * CHUNK_RECORD as u64;
    let payload_off = round_up(SUPERBLOCK as u64 + dir_len, PAYLOAD_ALIGN);
    let identity = PackIdentity {
        model,
        inventory: inventory_digest(sources),
        layout: sha(layout_schema(format).as_bytes()),
    };
    let mut part = path.as_os_str().to_owned();
    part.push(".part");
    let part = PathBuf::from(part);
    let file = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(&part)
        .map_err(io_err(&part))?;
    let mut pw = PayloadWriter {
        w: BufWriter::with_capacity(SLICE, file),
        path: &part,
        pos: 0,
        chunk_size,
        payload: Sha256::new(),
        chunk: Sha256::new(),
        chunk_start: 0,
        chunks: Vec::new(),
    };
    pw.w.seek(SeekFrom::Start(payload_off))
        .map_err(io_err(&part))?;
    let mut digests: Vec<([u8; 32], Option<[u8; 32]>)> = vec![([0; 32], None); sources.len()];
    let mut source_bytes = 0u64;
    let mut prog = |n: u64| {
        source_bytes += n;
        progress(n);
    };
    for (i, s) in sources.iter().enumerate() {
        if s.codec == Codec::RowI8F16Scale {
            digests[i].0 = pw.component(offs[i].0, s.data.as_slice(), &mut prog)?;
        }
    }
    for (i, s) in sources.iter().enumerate() {
        if let (Some(sc), Some(at)) = (&s.scales, offs[i].1) {
            digests[i].1 = Some(pw.component(at, sc.as_slice(), &mut prog)?);
        }
    }
    for (i, s) in sources.iter().enumerate() {
        if s.codec == Codec::Raw {
            digests[i].0 = pw.component(offs[i].0, s.data.as_slice(), &mut prog)?;
        }
    }
    pw.pad_to(payload_len)?;
    if pw.pos > pw.chunk_start {
        pw.close_chunk();
    }
    let payload_digest: [u8; 32] = std::mem::take(&mut pw.payload).finalize().into();
    let mut dir = vec![0u8; dir_len as usize];
    for (i, s) in sources.iter().enumerate() {
        let r = &mut dir[i * TENSOR_RECORD..(i + 1) * TENSOR_RECORD];
        r[..s.name.len()].copy_from_slice(s.name.as_bytes());
        r[96] = s.codec as u8;
        r[97] = dtype_code(Some(s.source_dtype)).unwrap_or(0);
        r[98] = match s.codec {
            Codec::Raw => r[97],
            Codec::RowI8F16Scale => 2,
        };
        r[99] = s.shape.len() as u8;
        for (k, d) in s.shape.iter().enumerate() {
            put_u64(r, 104 + 8 * k, *d as u64);
        }
        put_u64(r, 136, offs[i].0);
        put_u64(r, 144, s.data.len() as u64);
        if let (Some(sc), Some(at), Some(d)) = (&s.scales, offs[i].1, digests[i].1) {
            put_u64(r, 152, at);
            put_u64(r, 160, sc.len() as u64);
            r[224..256].copy_from_slice(&d);
        }
        r[192..224].copy_from_slice(&digests[i].0);
    }
    let base = sources.len() * TENSOR_RECORD;
    for (k, c) in pw.chunks.iter().enumerate() {
        let r = &mut dir[base + k * CHUNK_RECORD..base + (k + 1) * CHUNK_RECORD];
        put_u64(r, 0, c.offset);
        put_u64(r, 8, c.len);
        r[16..48].copy_from_slice(&c.sha256);
    }
    let dir_digest = sha(&dir);
    let mut sb = vec![0u8; SUPERBLOCK];
    sb[..8].copy_from_slice(&MAGIC);
    put_u16(&mut sb, 8, VERSION.0);
    put_u16(&mut sb, 10, VERSION.1);
    put_u32(&mut sb, 12, ENDIAN_TAG);
    put_u32(&mut sb, 16, SUPERBLOCK as u32);
    put_u32(&mut sb, 20, TENSOR_RECORD as u32);
    put_u32(&mut sb, 24, CHUNK_RECORD as u32);
    put_u32(&mut sb, 28, format_code(format));
    put_u32(&mut sb, 32, id.code());
    put_u32(&mut sb, 36, layers as u32);
    put_u32(&mut sb, 40, sources.len() as u32);
    put_u32(&mut sb, 44, pw.chunks.len() as u32);
    put_u64(&mut sb, 48, chunk_size);
    put_u64(&mut sb, 56, SUPERBLOCK as u64);
    put_u64(&mut sb, 64, dir_len);
    put_u64(&mut sb, 72, payload_off);
    put_u64(&mut sb, 80, payload_len);
    put_u64(&mut sb, 88, payload_off + payload_len);
    sb[96..128].copy_from_slice(&identity.model);
    sb[128..160].copy_from_slice(&identity.inventory);
    sb[160..192].copy_from_slice(&identity.layout);
    sb[OFF_DIRECTORY_DIGEST..OFF_DIRECTORY_DIGEST + 32].copy_from_slice(&dir_digest);
    sb[OFF_PAYLOAD_DIGEST..OFF_PAYLOAD_DIGEST + 32].copy_from_slice(&payload_digest);
    let pd = pack_digest(&identity, &dir_digest, &payload_digest);
    sb[OFF_PACK_DIGEST..OFF_PACK_DIGEST + 32].copy_from_slice(&pd);
    let hd = header_digest(&sb);
    sb[OFF_HEADER_DIGEST..OFF_HEADER_DIGEST + 32].copy_from_slice(&hd);
    pw.w.seek(SeekFrom::Start(0)).map_err(io_err(&part))?;
    pw.w.write_all(&sb).map_err(io_err(&part))?;
    pw.w.write_all(&dir).map_err(io_err(&part))?;
    let file =
        pw.w.into_inner()
            .map_err(|e| io_err(&part)(e.into_error()))?;
    file.sync_all().map_err(io_err(&part))?;
    drop(file);
    std::fs::rename(&part, path).map_err(io_err(path))?;
    if let Some(parent) = path.parent()
        && let Ok(d) = File::open(parent)
    {
        d.sync_all().map_err(io_err(parent))?;
    }
    Ok(WrittenPack {
        path: path.to_path_buf(),
        tensors: sources.len(),
        source_bytes,
        file_bytes: payload_off + payload_len,
    })
}

/// An opened, structurally validated pack (the whole file mapped).
#[derive(Debug)]
pub struct SpinePack {
    path: PathBuf,
    bytes: Bytes,
    format: SpineFormat,
    layer: u32,
    layers: u32,
    chunk_size: u64,
    payload_off: u64,
    payload_len: u64,
    dir_end: u64,
    identity: PackIdentity,
    payload_digest: [u8; 32],
    pack_digest: [u8; 32],
    tensors: Vec<TensorEntry>,
    chunks: Vec<Component>,
}

impl SpinePack {
    /// Map `path` and validate its superblock (magic, version, endian tag, sizes, header
    /// digest, length), its directory digest and every tensor and chunk record.
    pub fn open(path: &Path) -> Result<SpinePack, PackError> {
        let file = File::open(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                PackError::Missing {
                    path: path.to_path_buf(),
                }
            } else {
                io_err(path)(e)
            }
        })?;
        let len = file.metadata().map_err(io_err(path))?.len();
        let bytes = if len == 0 {
            Bytes::from_vec(Vec::new())
        } else {
            // SAFETY: read-only map; packs must not be modified while in use
            // (docs/OPERATIONS.md, "Spine packs").
            let m = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err(path))?;
            Bytes::from_owner(Arc::new(m))
        };
        Self::parse(path, bytes)
    }

    fn parse(path: &Path, bytes: Bytes) -> Result<SpinePack, PackError> {
        let bad = |m: String| PackError::Corrupt {
            path: path.to_path_buf(),
            message: m,
        };
        let b = bytes.as_slice();
        let flen = b.len() as u64;
        if b.len() < SUPERBLOCK {
            return Err(bad(format!(
                "truncated: {flen} bytes, shorter than the {SUPERBLOCK}-byte superblock"
            )));
        }
        if b[..8] != MAGIC {
            return Err(bad(format!(
                "superblock field magic (offset 0) is {:?}, not a DFSP pack",
                String::from_utf8_lossy(&b[..8])
            )));
        }
        let hd = header_digest(&b[..SUPERBLOCK]);
        if hd != get_digest(b, OFF_HEADER_DIGEST) {
            return Err(bad(format!(
                "header digest (offset {OFF_HEADER_DIGEST}) does not match the superblock: a superblock byte changed"
            )));
        }
        let version = (get_u16(b, 8), get_u16(b, 10));
        if version.0 != VERSION.0 {
            return Err(bad(format!(
                "superblock field version (offset 8) is {}.{}, this build reads {}.x",
                version.0, version.1, VERSION.0
            )));
        }
        let fields = [
            ("endian tag", 12usize, get_u32(b, 12), ENDIAN_TAG),
            ("superblock size", 16, get_u32(b, 16), SUPERBLOCK as u32),
            (
                "tensor record size",
                20,
                get_u32(b, 20),
                TENSOR_RECORD as u32,
            ),
            ("chunk record size", 24, get_u32(b, 24), CHUNK_RECORD as u32),
        ];
        for (name, at, got, want) in fields {
            if got != want {
                return Err(bad(format!(
                    "superblock field {name} (offset {at}) is {got:#x}, expected {want:#x}"
                )));
            }
        }
        let format = match get_u32(b, 28) {
            1 => SpineFormat::Bf16,
            2 => SpineFormat::Int8,
            f => {
                return Err(bad(format!(
                    "superblock field spine format (offset 28) is {f}, not 1 (bf16) or 2 (int8)"
                )));
            }
        };
        let (layer, layers) = (get_u32(b, 32), get_u32(b, 36));
        let (n_t, n_c) = (get_u32(b, 40) as u64, get_u32(b, 44) as u64);
        let chunk_size = get_u64(b, 48);
        let (dir_off, dir_len) = (get_u64(b, 56), get_u64(b, 64));
        let (payload_off, payload_len, file_len) = (get_u64(b, 72), get_u64(b, 80), get_u64(b, 88));
        if b[192..OFF_DIRECTORY_DIGEST].iter().any(|&x| x != 0)
            || b[HEADER_END..SUPERBLOCK].iter().any(|&x| x != 0)
        {
            return Err(bad("superblock reserved bytes are not zero".into()));
        }
        if dir_off != SUPERBLOCK as u64
            || dir_len != n_t * TENSOR_RECORD as u64 + n_c * CHUNK_RECORD as u64
            || !payload_off.is_multiple_of(PAYLOAD_ALIGN)
            || payload_off < dir_off + dir_len
            || Some(file_len) != payload_off.checked_add(payload_len)
            || chunk_size == 0
            || !chunk_size.is_multiple_of(COMPONENT_ALIGN)
            || n_c != payload_len.div_ceil(chunk_size)
        {
            return Err(bad(format!(
                "inconsistent superblock geometry: directory {dir_off}+{dir_len} ({n_t} tensors, {n_c} chunks), payload {payload_off}+{payload_len}, file length {file_len}, chunk size {chunk_size}"
            )));
        }
        if flen != file_len {
            return Err(bad(format!(
                "truncated or extended: the file is {flen} bytes, the superblock records {file_len}"
            )));
        }
        let dir = &b[dir_off as usize..(dir_off + dir_len) as usize];
        if sha(dir) != get_digest(b, OFF_DIRECTORY_DIGEST) {
            return Err(bad(format!(
                "directory digest (offset {OFF_DIRECTORY_DIGEST}) does not match the directory bytes {dir_off}..{}",
                dir_off + dir_len
            )));
        }
        let mut tensors = Vec::with_capacity(n_t as usize);
        for i in 0..n_t as usize {
            let r = &dir[i * TENSOR_RECORD..(i + 1) * TENSOR_RECORD];
            tensors.push(
                parse_record(r, payload_len).map_err(|m| bad(format!("tensor record {i}: {m}")))?,
            );
        }
        let base = n_t as usize * TENSOR_RECORD;
        let mut chunks = Vec::with_capacity(n_c as usize);
        for k in 0..n_c as usize {
            let r = &dir[base + k * CHUNK_RECORD..base + (k + 1) * CHUNK_RECORD];
            let c = Component {
                offset: get_u64(r, 0),
                len: get_u64(r, 8),
                sha256: get_digest(r, 16),
            };
            let want_off = k as u64 * chunk_size;
            let want_len = chunk_size.min(payload_len - want_off);
            if c.offset != want_off || c.len != want_len {
                return Err(bad(format!(
                    "chunk record {k}: covers {}+{}, expected {want_off}+{want_len}",
                    c.offset, c.len
                )));
            }
            chunks.push(c);
        }
        let identity = PackIdentity {
            model: get_digest(b, 96),
            inventory: get_digest(b, 128),
            layout: get_digest(b, 160),
        };
        Ok(SpinePack {
            path: path.to_path_buf(),
            format,
            layer,
            layers,
            chunk_size,
            payload_off,
            payload_len,
            dir_end: dir_off + dir_len,
            identity,
            payload_digest: get_digest(b, OFF_PAYLOAD_DIGEST),
            pack_digest: get_digest(b, OFF_PACK_DIGEST),
            tensors,
            chunks,
            bytes,
        })
    }

    fn corrupt(&self, m: String) -> PackError {
        PackError::Corrupt {
            path: self.path.clone(),
            message: m,
        }
    }

    /// Re-hash every chunk, component, the payload and the pack digest, and check that every
    /// padding byte is zero. Any flipped byte is an error naming the chunk, tensor or field.
    pub fn verify(&self) -> Result<(), PackError> {
        let b = self.bytes.as_slice();
        if b[self.dir_end as usize..self.payload_off as usize]
            .iter()
            .any(|&x| x != 0)
        {
            return Err(self.corrupt(format!(
                "padding bytes {}..{} between the directory and the payload are not zero",
                self.dir_end, self.payload_off
            )));
        }
        let payload = self.payload();
        let comps: Vec<(&TensorEntry, &'static str, Component)> = self
            .tensors
            .iter()
            .flat_map(|t| {
                [("data", Some(t.data)), ("scales", t.scales)]
                    .into_iter()
                    .filter_map(move |(f, c)| c.map(|c| (t, f, c)))
            })
            .collect();
        let span = |c: &Component| &payload[c.offset as usize..(c.offset + c.len) as usize];
        // The payload digest (one sequential pass) alongside the chunk and component digests
        // (in parallel); failures are reported chunk first, in file order.
        let (pd, (bad_chunk, bad_comp)) = rayon::join(
            || sha(payload),
            || {
                rayon::join(
                    || {
                        self.chunks
                            .par_iter()
                            .position_first(|c| sha(span(c)) != c.sha256)
                    },
                    || {
                        comps
                            .par_iter()
                            .position_first(|(_, _, c)| sha(span(c)) != c.sha256)
                    },
                )
            },
        );
        if let Some(k) = bad_chunk {
            let c = self.chunks[k];
            let who: Vec<String> = comps
                .iter()
                .filter(|(_, _, p)| p.offset < c.offset + c.len && c.offset < p.offset + p.len)
                .map(|(t, f, _)| format!("{}:{f}", t.name))
                .collect();
            return Err(self.corrupt(format!(
                "chunk {k} (payload bytes {}..{}, holding {who:?}) fails its SHA-256",
                c.offset,
                c.offset + c.len
            )));
        }
        if pd != self.payload_digest {
            return Err(self.corrupt(format!(
                "payload digest (offset {OFF_PAYLOAD_DIGEST}) does not match the payload"
            )));
        }
        let dir = &b[SUPERBLOCK..self.dir_end as usize];
        if pack_digest(&self.identity, &sha(dir), &pd) != self.pack_digest {
            return Err(self.corrupt(format!(
                "pack digest (offset {OFF_PACK_DIGEST}) does not match"
            )));
        }
        if let Some(i) = bad_comp {
            let (t, field, c) = comps[i];
            return Err(self.corrupt(format!(
                "tensor `{}`: {field} component (payload bytes {}..{}) fails its SHA-256",
                t.name,
                c.offset,
                c.offset + c.len
            )));
        }
        let mut covered: Vec<(u64, u64)> = comps
            .iter()
            .map(|(_, _, c)| (c.offset, c.offset + c.len))
            .collect();
        covered.sort_unstable();
        let mut pos = 0u64;
        for (start, end) in covered
            .into_iter()
            .chain([(self.payload_len, self.payload_len)])
        {
            if start < pos {
                return Err(self.corrupt(format!("components overlap at payload byte {start}")));
            }
            if payload[pos as usize..start as usize]
                .iter()
                .any(|&x| x != 0)
            {
                return Err(
                    self.corrupt(format!("payload padding bytes {pos}..{start} are not zero"))
                );
            }
            pos = end;
        }
        Ok(())
    }

    /// Check that the pack holds `format` (else [`PackError::WrongFormat`]) and matches the
    /// identity digests `want` (else [`PackError::Identity`] naming the digest).
    pub fn check_identity(
        &self,
        format: SpineFormat,
        want: &PackIdentity,
    ) -> Result<(), PackError> {
        if self.format != format || self.identity.layout != want.layout {
            return Err(PackError::WrongFormat {
                path: self.path.clone(),
                found: self.format.as_str(),
                expected: format.as_str(),
            });
        }
        for (what, got, exp) in [
            (
                "model (config.json / index digest)",
                &self.identity.model,
                &want.model,
            ),
            (
                "source inventory",
                &self.identity.inventory,
                &want.inventory,
            ),
        ] {
            if got != exp {
                return Err(PackError::Identity {
                    path: self.path.clone(),
                    what,
                });
            }
        }
        Ok(())
    }

    fn payload(&self) -> &[u8] {
        &self.bytes.as_slice()
            [self.payload_off as usize..(self.payload_off + self.payload_len) as usize]
    }

    /// The pack's file.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The spine format it holds.
    pub fn format(&self) -> SpineFormat {
        self.format
    }
    /// Which pack it is.
    pub fn id(&self) -> PackId {
        if self.layer == GLOBAL_LAYER {
            PackId::Globals
        } else {
            PackId::Layer(self.layer as usize)
        }
    }
    /// The model's layer count recorded in the pack.
    pub fn layers(&self) -> usize {
        self.layers as usize
    }
    /// Chunk size the pack was written with.
    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }
    /// The identity digests.
    pub fn identity(&self) -> &PackIdentity {
        &self.identity
    }
    /// Every tensor, in directory (inventory) order.
    pub fn tensors(&self) -> &[TensorEntry] {
        &self.tensors
    }
    /// The file length.
    pub fn file_len(&self) -> u64 {
        self.bytes.len() as u64
    }
    /// The tensor named `name`.
    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.iter().find(|t| t.name == name)
    }
    fn entry(&self, name: &str, codec: Codec) -> Result<&TensorEntry, PackError> {
        let t = self.get(name).ok_or_else(|| PackError::Source {
            tensor: name.to_string(),
            message: format!("not in {}", self.path.display()),
        })?;
        if t.codec != codec {
            return Err(PackError::Source {
                tensor: name.to_string(),
                message: format!(
                    "{}: stored as {:?}, not {codec:?}",
                    self.path.display(),
                    t.codec
                ),
            });
        }
        Ok(t)
    }

    /// A 2-D BF16 `Raw` tensor as a zero-copy matrix (`[1, D]` vectors included).
    pub fn bf16_matrix(&self, name: &str) -> Result<Bf16Matrix, PackError> {
        let t = self.entry(name, Codec::Raw)?;
        if t.source_dtype != DType::BF16 || t.shape.len() != 2 {
            return Err(PackError::Source {
                tensor: name.to_string(),
                message: format!("{} {:?} is not a 2-D BF16 matrix", t.source_dtype, t.shape),
            });
        }
        Bf16Matrix::new(name, self.component_bytes(&t.data), t.shape[0], t.shape[1]).map_err(|e| {
            PackError::Source {
                tensor: name.to_string(),
                message: format!("{}: {e}", self.path.display()),
            }
        })
    }

    /// A `RowI8F16Scale` tensor as a zero-copy row-int8 matrix (codes and scales in place).
    pub fn row_int8_matrix(&self, name: &str) -> Result<RowInt8Matrix, PackError> {
        let t = self.entry(name, Codec::RowI8F16Scale)?;
        let scales = t
            .scales
            .map(|c| self.component_bytes(&c))
            .unwrap_or_else(|| Bytes::from_vec(Vec::new()));
        RowInt8Matrix::new_unscanned(
            name,
            self.component_bytes(&t.data),
            scales,
            t.shape[0],
            t.shape[1],
        )
        .map_err(|e| PackError::Source {
            tensor: name.to_string(),
            message: format!("{}: {e}", self.path.display()),
        })
    }

    /// Absolute file offset and length of a component (for explicit reads of the pack).
    pub fn component_file_range(&self, c: &Component) -> (u64, u64) {
        (self.payload_off + c.offset, c.len)
    }

    /// Zero-copy bytes of a component (raw tensor bytes, int8 codes or f16 scales).
    pub fn component_bytes(&self, c: &Component) -> Bytes {
        let at = (self.payload_off + c.offset) as usize;
        // Records were bounds-checked against the payload in `parse`.
        self.bytes
            .slice(at..at + c.len as usize)
            .unwrap_or_else(|| Bytes::from_vec(Vec::new()))
    }
}

fn parse_record(r: &[u8], payload_len: u64) -> Result<TensorEntry, String> {
    let end = r[..MAX_NAME]
        .iter()
        .position(|&x| x == 0)
        .unwrap_or(MAX_NAME);
    if r[end..MAX_NAME].iter().any(|&x| x != 0) || end == 0 {
        return Err("name field is empty or not NUL padded".into());
    }
    let name = std::str::from_utf8(&r[..end])
        .map_err(|e| format!("name is not UTF-8 ({e})"))?
        .to_string();
    let bad = |m: String| format!("tensor `{name}`: {m}");
    let codec = match r[96] {
        0 => Codec::Raw,
        1 => Codec::RowI8F16Scale,
        c => {
            return Err(bad(format!(
                "codec {c} is neither Raw (0) nor RowI8F16Scale (1)"
            )));
        }
    };
    let dt = |at: usize| -> Result<DType, String> {
        match dtype_from_code(r[at]) {
            Some(Some(d)) => Ok(d),
            _ => Err(bad(format!("dtype code {} at record offset {at}", r[at]))),
        }
    };
    let (source_dtype, stored_dtype) = (dt(97)?, dt(98)?);
    let rank = r[99] as usize;
    if rank > MAX_RANK || get_u32(r, 100) != 0 || r[168..192].iter().any(|&x| x != 0) {
        return Err(bad(format!("rank {rank} or reserved bytes invalid")));
    }
    let shape: Vec<usize> = (0..rank)
        .map(|k| get_u64(r, 104 + 8 * k) as usize)
        .collect();
    if (rank..MAX_RANK).any(|k| get_u64(r, 104 + 8 * k) != 0) {
        return Err(bad("unused shape dims are not zero".into()));
    }
    let elems = shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
        .ok_or_else(|| bad("shape overflows".into()))?;
    let comp = |at: usize, dig: usize| Component {
        offset: get_u64(r, at),
        len: get_u64(r, at + 8),
        sha256: get_digest(r, dig),
    };
    let data = comp(136, 192);
    let scales = comp(152, 224);
    let (want_data, want_scales, want_stored) = match codec {
        Codec::Raw => (elems * source_dtype.size() as u64, 0, source_dtype),
        Codec::RowI8F16Scale => {
            if rank != 2 {
                return Err(bad(format!("RowI8F16Scale needs rank 2, found {rank}")));
            }
            (elems, 2 * shape[0] as u64, DType::I8)
        }
    };
    if stored_dtype != want_stored || data.len != want_data || scales.len != want_scales {
        return Err(bad(format!(
            "stored {stored_dtype} with {} data / {} scale bytes; {codec:?} {source_dtype} {shape:?} needs {want_stored} with {want_data} / {want_scales}",
            data.len, scales.len
        )));
    }
    for (field, c) in [("data", &data), ("scales", &scales)] {
        if !c.offset.is_multiple_of(COMPONENT_ALIGN)
            || c.offset.checked_add(c.len).is_none_or(|e| e > payload_len)
        {
            return Err(bad(format!(
                "{field} component {}+{} is unaligned or outside the {payload_len}-byte payload",
                c.offset, c.len
            )));
        }
    }
    if codec == Codec::Raw && (scales.offset != 0 || scales.sha256 != [0; 32]) {
        return Err(bad("Raw tensor has a scale component".into()));
    }
    Ok(TensorEntry {
        name,
        codec,
        source_dtype,
        stored_dtype,
        shape,
        data,
        scales: (codec == Codec::RowI8F16Scale).then_some(scales),
    })
}

/// Options of [`pack_spine`].
#[derive(Clone, Debug)]
pub struct PackOptions {
    pub format: SpineFormat,
    /// Pack root (the `--output` directory).
    pub output: PathBuf,
    /// Only this zero-based layer (`None`: every layer and the globals).
    pub layer: Option<usize>,
    pub chunk_size: u64,
    /// Stop (as if killed) after this many packs were written in this run; tests.
    pub stop_after_packs: Option<usize>,
}

/// Where packing stands, for progress bars.
#[derive(Clone, Debug)]
pub struct PackProgress<'a> {
    pub pack: &'a str,
    pub done_bytes: u64,
    pub total_bytes: u64,
}

/// What [`pack_spine`] or [`verify_packs`] did.
#[derive(Clone, Debug, Default)]
pub struct PackReport {
    /// Packs selected.
    pub packs: usize,
    /// Packs written in this run.
    pub written: usize,
    /// Complete, verified packs that were skipped.
    pub skipped: usize,
    /// `.part` leftovers that were redone.
    pub parts_redone: usize,
    /// Existing packs that failed verification and were rebuilt: (file, reason).
    pub rebuilt: Vec<(String, String)>,
    /// Source bytes streamed in this run (packing) or pack bytes hashed (verifying).
    pub bytes: u64,
    pub seconds: f64,
    /// The run stopped early at `stop_after_packs`.
    pub stopped: bool,
}

/// The packs selected by `layer`: one layer (checked against the layer count), or every
/// layer and the globals.
pub fn selected_packs(layers: usize, layer: Option<usize>) -> Result<Vec<PackId>, PackError> {
    match layer {
        Some(l) if l >= layers => Err(PackError::LayerOutOfRange { layer: l, layers }),
        Some(l) => Ok(vec![PackId::Layer(l)]),
        None => Ok((0..layers)
            .map(PackId::Layer)
            .chain([PackId::Globals])
            .collect()),
    }
}

fn lock(dir: &Path) -> Result<FileLock, PackError> {
    let path = dir.join(LOCK_FILE);
    match try_lock(&path) {
        Ok(Some(l)) => Ok(l),
        Ok(None) => Err(PackError::Locked { path }),
        Err(e) => Err(io_err(&path)(e)),
    }
}

fn source_len(sources: &[PackSource]) -> u64 {
    sources
        .iter()
        .map(|s| (s.data.len() + s.scales.as_ref().map_or(0, |b| b.len())) as u64)
        .sum()
}

fn open_int8(ckpt: &Checkpoint, format: SpineFormat) -> Result<Option<Int8Spine>, PackError> {
    Ok(match format {
        SpineFormat::Int8 => Some(Int8Spine::open(ckpt.root(), ckpt.config())?),
        SpineFormat::Bf16 => None,
    })
}

fn expected_identity(model: [u8; 32], format: SpineFormat, sources: &[PackSource]) -> PackIdentity {
    PackIdentity {
        model,
        inventory: inventory_digest(sources),
        layout: sha(layout_schema(format).as_bytes()),
    }
}

/// Every pack of one spine format under the model root, opened and validated, for loading:
/// tensor name → pack.
#[derive(Debug)]
pub struct PackSet {
    packs: Vec<SpinePack>,
    index: std::collections::HashMap<String, usize>,
}

impl PackSet {
    /// The packs of `format` under `<root>/k3-resident-packs[-bf16]/` when that root holds
    /// every layer's pack and `globals.dfsp` (`None` when the root is absent or incomplete,
    /// e.g. while `pack-spine` runs). Every pack is opened (superblock, header and directory
    /// digests, records) and must match this model and format (identity digests), else an
    /// error naming the file; the payload is not re-hashed (`pack-spine --verify-only` does).
    pub fn open_if_complete(
        ckpt: &Checkpoint,
        format: SpineFormat,
    ) -> Result<Option<PackSet>, PackError> {
        let dir = ckpt.root().join(default_pack_dir(format));
        let ids = selected_packs(ckpt.config().n_layers(), None)?;
        if !ids.iter().all(|id| dir.join(id.file_name()).is_file()) {
            return Ok(None);
        }
        let model = model_digest(ckpt.root())?;
        let specs = spine_specs(ckpt);
        let quantized: std::collections::HashSet<String> = match format {
            SpineFormat::Int8 => crate::spine_int8::quantized_tensors(ckpt.config())
                .into_iter()
                .map(|t| t.name)
                .collect(),
            SpineFormat::Bf16 => Default::default(),
        };
        let mut set = PackSet {
            packs: Vec::with_capacity(ids.len()),
            index: Default::default(),
        };
        for id in ids {
            let p = SpinePack::open(&dir.join(id.file_name()))?;
            let want = match id {
                PackId::Layer(l) => Some(l),
                PackId::Globals => None,
            };
            let mut h = InventoryHasher::default();
            for s in specs
                .iter()
                .filter(|s| s.kind == TensorKind::Spine { layer: want })
            {
                let codec = if quantized.contains(&s.name) {
                    Codec::RowI8F16Scale
                } else {
                    Codec::Raw
                };
                h.add(&s.name, codec, s.dtype, &s.shape);
            }
            let identity = PackIdentity {
                model,
                inventory: h.finish(),
                layout: sha(layout_schema(format).as_bytes()),
            };
            p.check_identity(format, &identity)?;
            for t in p.tensors() {
                set.index.insert(t.name.clone(), set.packs.len());
            }
            set.packs.push(p);
        }
        Ok(Some(set))
    }

    /// The pack holding full tensor name `name`.
    pub fn pack_of(&self, name: &str) -> Option<&SpinePack> {
        self.index.get(name).map(|&i| &self.packs[i])
    }

    /// How `name` is stored.
    pub fn codec(&self, name: &str) -> Option<Codec> {
        self.pack_of(name)
            .and_then(|p| p.get(name))
            .map(|t| t.codec)
    }

    fn missing(name: &str) -> PackError {
        PackError::Source {
            tensor: name.to_string(),
            message: "in no spine pack".into(),
        }
    }

    /// A 2-D BF16 raw tensor as a zero-copy matrix.
    pub fn bf16_matrix(&self, name: &str) -> Result<Bf16Matrix, PackError> {
        self.pack_of(name)
            .ok_or_else(|| Self::missing(name))?
            .bf16_matrix(name)
    }

    /// A quantized tensor as a zero-copy row-int8 matrix.
    pub fn row_int8_matrix(&self, name: &str) -> Result<RowInt8Matrix, PackError> {
        self.pack_of(name)
            .ok_or_else(|| Self::missing(name))?
            .row_int8_matrix(name)
    }

    /// A raw BF16 or F32 tensor of any rank widened to f32.
    pub fn f32_vector(&self, name: &str) -> Result<Vec<f32>, PackError> {
        let p = self.pack_of(name).ok_or_else(|| Self::missing(name))?;
        let t = p.entry(name, Codec::Raw)?;
        let b = p.component_bytes(&t.data);
        match t.source_dtype {
            DType::F32 => Ok(b
                .as_slice()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()),
            DType::BF16 => Ok(b
                .as_slice()
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect()),
            d => Err(PackError::Source {
                tensor: name.to_string(),
                message: format!("is {d}, not BF16 or F32"),
            }),
        }
    }
}

/// Build the selected packs of `ckpt` under `opts.output`, resumably: a complete pack that
/// verifies and matches the model is skipped, a `.part` leftover is redone, a pack of the
/// other spine format is an error, any other invalid pack is rebuilt.
pub fn pack_spine(
    ckpt: &Checkpoint,
    opts: &PackOptions,
    progress: &mut dyn FnMut(&PackProgress),
) -> Result<PackReport, PackError> {
    let t0 = Instant::now();
    let layers = ckpt.config().n_layers();
    let ids = selected_packs(layers, opts.layer)?;
    let int8 = open_int8(ckpt, opts.format)?;
    let model = model_digest(ckpt.root())?;
    std::fs::create_dir_all(&opts.output).map_err(io_err(&opts.output))?;
    let _lock = lock(&opts.output)?;
    let specs = spine_specs(ckpt);
    let mut total_bytes = 0u64;
    for &id in &ids {
        total_bytes += source_len(&sources_of(ckpt, int8.as_ref(), id, &specs)?);
    }
    let mut report = PackReport {
        packs: ids.len(),
        ..Default::default()
    };
    let mut done = 0u64;
    for id in &ids {
        let sources = &sources_of(ckpt, int8.as_ref(), *id, &specs)?;
        let name = id.file_name();
        let path = opts.output.join(&name);
        let mut part = path.as_os_str().to_owned();
        part.push(".part");
        let part = PathBuf::from(part);
        let src_bytes = source_len(sources);
        if path.is_file() {
            let want = expected_identity(model, opts.format, sources);
            let checked = SpinePack::open(&path).and_then(|p| {
                p.check_identity(opts.format, &want)?;
                p.verify()
            });
            match checked {
                Ok(()) => {
                    report.skipped += 1;
                    done += src_bytes;
                    progress(&PackProgress {
                        pack: &name,
                        done_bytes: done,
                        total_bytes,
                    });
                    continue;
                }
                Err(e @ PackError::WrongFormat { .. }) => return Err(e),
                Err(e) => report.rebuilt.push((name.clone(), e.to_string())),
            }
        }
        if part.exists() {
            report.parts_redone += 1;
        }
        if opts.stop_after_packs == Some(report.written) {
            report.stopped = true;
            break;
        }
        let mut on_bytes = |n: u64| {
            done += n;
            progress(&PackProgress {
                pack: &name,
                done_bytes: done,
                total_bytes,
            });
        };
        let w = write_pack(
            &path,
            opts.format,
            *id,
            layers,
            model,
            sources,
            opts.chunk_size,
            &mut on_bytes,
        )?;
        report.bytes += w.source_bytes;
        report.written += 1;
    }
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// Open, verify and identity-check every selected pack under `output` (nothing is written).
pub fn verify_packs(
    ckpt: &Checkpoint,
    format: SpineFormat,
    output: &Path,
    layer: Option<usize>,
    progress: &mut dyn FnMut(&PackProgress),
) -> Result<PackReport, PackError> {
    let t0 = Instant::now();
    let layers = ckpt.config().n_layers();
    let ids = selected_packs(layers, layer)?;
    let int8 = open_int8(ckpt, format)?;
    let model = model_digest(ckpt.root())?;
    let specs = spine_specs(ckpt);
    let mut report = PackReport {
        packs: ids.len(),
        ..Default::default()
    };
    let total_bytes: u64 = ids
        .iter()
        .filter_map(|id| std::fs::metadata(output.join(id.file_name())).ok())
        .map(|m| m.len())
        .sum();
    for id in &ids {
        let name = id.file_name();
        let path = output.join(&name);
        let p = SpinePack::open(&path)?;
        let sources = sources_of(ckpt, int8.as_ref(), *id, &specs)?;
        p.check_identity(format, &expected_identity(model, format, &sources))?;
        if p.id() != *id {
            return Err(PackError::Corrupt {
                path,
                message: format!("superblock field layer (offset 32) names {:?}", p.id()),
            });
        }
        p.verify()?;
        report.bytes += p.file_len();
        report.skipped += 1;
        progress(&PackProgress {
            pack: &name,
            done_bytes: report.bytes,
            total_bytes,
        });
    }
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny checkpoint with a 1,024-token vocabulary and its int8 spine.
    fn small(int8: bool) -> (tempfile::TempDir, Checkpoint) {
        crate::test_util::small_checkpoint(5, int8)
    }

    fn opts(ckpt: &Checkpoint, format: SpineFormat) -> PackOptions {
        PackOptions {
            format,
            output: ckpt.root().join(default_pack_dir(format)),
            layer: None,
            // Small chunks: every pack has several.
            chunk_size: 64 << 10,
            stop_after_packs: None,
        }
    }

    /// Every tensor of every pack is byte-identical to its source.
    fn assert_round_trip(ckpt: &Checkpoint, format: SpineFormat) {
        let o = opts(ckpt, format);
        let r = pack_spine(ckpt, &o, &mut |_| {}).unwrap();
        let layers = ckpt.config().n_layers();
        assert_eq!((r.packs, r.written, r.skipped), (layers + 1, layers + 1, 0));
        let int8 = open_int8(ckpt, format).unwrap();
        let mut quantized = 0;
        for id in selected_packs(layers, None).unwrap() {
            let p = SpinePack::open(&o.output.join(id.file_name())).unwrap();
            p.verify().unwrap();
            assert_eq!(p.id(), id);
            assert_eq!(p.format(), format);
            assert_eq!(p.file_len() % COMPONENT_ALIGN, 0);
            let sources = pack_sources(ckpt, int8.as_ref(), id).unwrap();
            assert_eq!(p.tensors().len(), sources.len());
            for s in &sources {
                let t = p.get(&s.name).unwrap();
                assert_eq!(t.shape, s.shape);
                assert_eq!(t.codec, s.codec);
                let data = p.component_bytes(&t.data);
                match s.codec {
                    Codec::Raw => {
                        let src = ckpt.tensor_bytes(&s.name).unwrap();
                        assert_eq!(data.as_slice(), src.as_slice(), "{}", s.name);
                        if s.source_dtype == DType::BF16 && s.shape.len() == 2 {
                            let m = p.bf16_matrix(&s.name).unwrap();
                            let want = ckpt.bf16_matrix(&s.name).unwrap();
                            assert_eq!(m.data(), want.data());
                        }
                    }
                    Codec::RowI8F16Scale => {
                        quantized += 1;
                        let m = p.row_int8_matrix(&s.name).unwrap();
                        let want = int8.as_ref().unwrap().get(&s.name).unwrap();
                        assert_eq!(m.data(), want.data());
                        assert_eq!(m.scales(), want.scales());
                        assert!(p.bf16_matrix(&s.name).is_err());
                        let files = crate::spine_int8::TensorFiles::new(ckpt.root(), &s.name);
                        assert_eq!(data.as_slice(), std::fs::read(&files.i8).unwrap());
                        let sc = p.component_bytes(&t.scales.unwrap());
                        assert_eq!(sc.as_slice(), std::fs::read(&files.sc).unwrap());
                    }
                }
            }
            // Payload order: every code block before every scale block before every raw tensor.
            let codes = p
                .tensors()
                .iter()
                .filter(|t| t.codec == Codec::RowI8F16Scale);
            let last_code = codes.clone().map(|t| t.data.offset).max();
            let first_scale = codes
                .clone()
                .filter_map(|t| t.scales)
                .map(|c| c.offset)
                .min();
            let last_scale = codes.filter_map(|t| t.scales).map(|c| c.offset).max();
            let first_raw = p
                .tensors()
                .iter()
                .filter(|t| t.codec == Codec::Raw)
                .map(|t| t.data.offset)
                .min();
            if let (Some(a), Some(b), Some(c), Some(d)) =
                (last_code, first_scale, last_scale, first_raw)
            {
                assert!(a < b && c < d);
            }
        }
        let want = crate::spine_int8::quantized_tensors(ckpt.config()).len();
        assert_eq!(
            quantized,
            if format == SpineFormat::Int8 { want } else { 0 }
        );
        let v = verify_packs(ckpt, format, &o.output, None, &mut |_| {}).unwrap();
        assert_eq!(v.skipped, layers + 1);
    }

    #[test]
    fn round_trip_bf16_and_int8() {
        let (_d, ckpt) = small(true);
        assert_round_trip(&ckpt, SpineFormat::Bf16);
        assert_round_trip(&ckpt, SpineFormat::Int8);
    }

    fn flip(path: &Path, at: u64) {
        let mut b = std::fs::read(path).unwrap();
        b[at as usize] ^= 0x10;
        std::fs::write(path, b).unwrap();
    }

    fn corrupt_message(path: &Path) -> String {
        let e = SpinePack::open(path).and_then(|p| p.verify()).unwrap_err();
        assert!(matches!(e, PackError::Corrupt { .. }), "{e}");
        let m = e.to_string();
        assert!(m.contains(&path.display().to_string()), "{m}");
        m
    }

    #[test]
    fn verify_detects_every_flipped_byte_and_truncation() {
        let (_d, ckpt) = small(true);
        let o = PackOptions {
            layer: Some(1),
            ..opts(&ckpt, SpineFormat::Int8)
        };
        pack_spine(&ckpt, &o, &mut |_| {}).unwrap();
        let path = o.output.join("layer-001.dfsp");
        let clean = std::fs::read(&path).unwrap();
        let p = SpinePack::open(&path).unwrap();
        let q = p
            .tensors()
            .iter()
            .find(|t| t.codec == Codec::RowI8F16Scale)
            .unwrap()
            .clone();
        let raw = p
            .tensors()
            .iter()
            .find(|t| t.codec == Codec::Raw)
            .unwrap()
            .clone();
        let payload = p.payload_off;
        drop(p);
        let cases: Vec<(&str, u64, &str)> = vec![
            ("header field", 40, "header digest"),
            (
                "header digest",
                OFF_HEADER_DIGEST as u64 + 3,
                "header digest",
            ),
            ("directory", SUPERBLOCK as u64 + 5, "directory digest"),
            (
                "directory chunk record",
                SUPERBLOCK as u64 + 1000,
                "directory digest",
            ),
            ("code", payload + q.data.offset + 7, "chunk"),
            ("scale", payload + q.scales.unwrap().offset + 1, "chunk"),
            ("raw", payload + raw.data.offset + raw.data.len - 1, "chunk"),
            ("padding", payload - 1, "padding"),
        ];
        for (what, at, expect) in cases {
            std::fs::write(&path, &clean).unwrap();
            flip(&path, at);
            let m = corrupt_message(&path);
            assert!(m.contains(expect), "{what}: {m}");
        }
        // The flipped scale is named by its tensor in the chunk message.
        std::fs::write(&path, &clean).unwrap();
        flip(&path, payload + q.scales.unwrap().offset);
        assert!(corrupt_message(&path).contains(&q.name));
        // Every byte of a small stretch of each region, exhaustively.
        for at in (0..clean.len() as u64).step_by(997) {
            std::fs::write(&path, &clean).unwrap();
            flip(&path, at);
            corrupt_message(&path);
        }
        for cut in [0usize, 100, SUPERBLOCK, clean.len() - 1] {
            std::fs::write(&path, &clean[..cut]).unwrap();
            let m = corrupt_message(&path);
            assert!(m.contains("truncated"), "{cut}: {m}");
        }
        std::fs::write(&path, &clean).unwrap();
        SpinePack::open(&path).unwrap().verify().unwrap();
    }

    #[test]
    fn wrong_format_root_is_rejected() {
        let (_d, ckpt) = small(true);
        let o = opts(&ckpt, SpineFormat::Bf16);
        pack_spine(
            &ckpt,
            &PackOptions {
                layer: Some(0),
                ..o.clone()
            },
            &mut |_| {},
        )
        .unwrap();
        // A bf16 pack copied under the int8 root.
        let int8_root = ckpt.root().join(INT8_PACK_DIR);
        std::fs::create_dir_all(&int8_root).unwrap();
        std::fs::copy(
            o.output.join("layer-000.dfsp"),
            int8_root.join("layer-000.dfsp"),
        )
        .unwrap();
        let e =
            verify_packs(&ckpt, SpineFormat::Int8, &int8_root, Some(0), &mut |_| {}).unwrap_err();
        assert!(
            matches!(e, PackError::WrongFormat { found: "bf16", .. }),
            "{e}"
        );
        let io = PackOptions {
            layer: Some(0),
            ..opts(&ckpt, SpineFormat::Int8)
        };
        let e = pack_spine(&ckpt, &io, &mut |_| {}).unwrap_err();
        assert!(matches!(e, PackError::WrongFormat { .. }), "{e}");
    }

    /// The model loads from complete packs (and only then) with logits bit-identical to the
    /// shard / int8-file spine.
    #[test]
    fn the_loader_uses_complete_packs_with_identical_logits() {
        use crate::loader::{EngineOptions, load_model};
        use crate::model::LogitRows;
        let (_d, ckpt) = small(true);
        let ckpt = Arc::new(ckpt);
        let ids = [1u32, 17, 99, 512, 3];
        for format in [SpineFormat::Bf16, SpineFormat::Int8] {
            let eo = EngineOptions {
                spine: format,
                ..Default::default()
            };
            let logits = || {
                let m = load_model(ckpt.clone(), &eo).unwrap();
                m.forward(&mut m.new_state(), &ids, LogitRows::All)
                    .unwrap()
                    .values
            };
            assert!(PackSet::open_if_complete(&ckpt, format).unwrap().is_none());
            let want = logits();
            // Incomplete (one layer): not used.
            let o = opts(&ckpt, format);
            pack_spine(
                &ckpt,
                &PackOptions {
                    layer: Some(0),
                    ..o.clone()
                },
                &mut |_| {},
            )
            .unwrap();
            assert!(PackSet::open_if_complete(&ckpt, format).unwrap().is_none());
            pack_spine(&ckpt, &o, &mut |_| {}).unwrap();
            let set = PackSet::open_if_complete(&ckpt, format).unwrap().unwrap();
            let quantized = set
                .packs
                .iter()
                .flat_map(|p| p.tensors())
                .filter(|t| t.codec == Codec::RowI8F16Scale);
            assert_eq!(quantized.count() > 0, format == SpineFormat::Int8);
            assert_eq!(logits(), want, "{format:?}");
            if format == SpineFormat::Int8 {
                // The int8 files are not read at all: the packs carry the codes and scales.
                let dir = ckpt.root().join(crate::spine_int8::INT8_DIR);
                let away = ckpt.root().join("int8-away");
                std::fs::rename(&dir, &away).unwrap();
                assert_eq!(logits(), want);
                std::fs::rename(&away, &dir).unwrap();
            }
            // A damaged directory makes loading fail, naming the pack.
            let path = o.output.join("layer-002.dfsp");
            let clean = std::fs::read(&path).unwrap();
            flip(&path, SUPERBLOCK as u64 + 3);
            let e = load_model(ckpt.clone(), &eo).map(|_| ()).unwrap_err();
            assert!(e.to_string().contains("layer-002.dfsp"), "{e}");
            std::fs::write(&path, clean).unwrap();
        }
    }

    #[test]
    fn a_second_packer_is_locked_out() {
        let (_d, ckpt) = small(false);
        let o = PackOptions {
            layer: Some(0),
            ..opts(&ckpt, SpineFormat::Bf16)
        };
        std::fs::create_dir_all(&o.output).unwrap();
        let held = lock(&o.output).unwrap();
        let e = pack_spine(&ckpt, &o, &mut |_| {}).unwrap_err();
        assert!(matches!(e, PackError::Locked { .. }), "{e}");
        drop(held);
        pack_spine(&ckpt, &o, &mut |_| {}).unwrap();
    }

    #[test]
    fn int8_packs_need_the_int8_spine() {
        let (_d, ckpt) = small(false);
        let e = pack_spine(&ckpt, &opts(&ckpt, SpineFormat::Int8), &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("convert-spine-int8"), "{e}");
    }

    #[test]
    fn resume_after_a_stop_skips_complete_packs_and_redoes_parts() {
        let (_d, ckpt) = small(false);
        let layers = ckpt.config().n_layers();
        let half = layers / 2;
        let o = opts(&ckpt, SpineFormat::Bf16);
        let r = pack_spine(
            &ckpt,
            &PackOptions {
                stop_after_packs: Some(half),
                ..o.clone()
            },
            &mut |_| {},
        )
        .unwrap();
        assert!(r.stopped);
        assert_eq!(r.written, half);
        // A torn write of the next pack.
        let next = o
            .output
            .join(format!("{}.part", PackId::Layer(half).file_name()));
        std::fs::write(&next, b"torn").unwrap();
        // A complete pack corrupted after the stop is rebuilt, not trusted.
        flip(&o.output.join("layer-000.dfsp"), 70_000);
        let r = pack_spine(&ckpt, &o, &mut |_| {}).unwrap();
        assert!(!r.stopped);
        assert_eq!(r.skipped, half - 1);
        assert_eq!(r.written, layers + 1 - (half - 1));
        assert_eq!(r.parts_redone, 1);
        assert_eq!(r.rebuilt.len(), 1);
        assert!(!next.exists());
        // The result equals an uninterrupted run.
        let again = tempfile::tempdir().unwrap();
        let mut o2 = o.clone();
        o2.output = again.path().to_path_buf();
        pack_spine(&ckpt, &o2, &mut |_| {}).unwrap();
        for id in selected_packs(layers, None).unwrap() {
            let a = std::fs::read(o.output.join(id.file_name())).unwrap();
            let b = std::fs::read(o2.output.join(id.file_name())).unwrap();
            assert!(a == b, "{}", id.file_name());
        }
        let r = pack_spine(&ckpt, &o, &mut |_| {}).unwrap();
        assert_eq!((r.written, r.skipped), (0, layers + 1));
    }

    #[test]
    fn layer_out_of_range_and_other_model_are_rejected() {
        let (_d, ckpt) = small(false);
        let layers = ckpt.config().n_layers();
        let o = PackOptions {
            layer: Some(layers),
            ..opts(&ckpt, SpineFormat::Bf16)
        };
        let e = pack_spine(&ckpt, &o, &mut |_| {}).unwrap_err();
        assert!(matches!(e, PackError::LayerOutOfRange { .. }), "{e}");
        assert!(e.to_string().contains(&format!("0…{}", layers - 1)), "{e}");
        // A pack of another model (different seed, same shapes: the index differs in nothing,
        // so change config.json) is refused by verify.
        let o = PackOptions {
            layer: Some(0),
            ..opts(&ckpt, SpineFormat::Bf16)
        };
        pack_spine(&ckpt, &o, &mut |_| {}).unwrap();
        let cfg = ckpt.root().join(CONFIG_FILE);
        let mut text = std::fs::read_to_string(&cfg).unwrap();
        text.push('\n');
        std::fs::write(&cfg, text).unwrap();
        let e =
            verify_packs(&ckpt, SpineFormat::Bf16, &o.output, Some(0), &mut |_| {}).unwrap_err();
        assert!(matches!(e, PackError::Identity { .. }), "{e}");
        let e =
            verify_packs(&ckpt, SpineFormat::Bf16, &o.output, Some(1), &mut |_| {}).unwrap_err();
        assert!(matches!(e, PackError::Missing { .. }), "{e}");
    }
}
