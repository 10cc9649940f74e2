//! Lossless scale4 expert sidecars (`K3SC4V2`, product-contract §4.4).
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

use crate::layout::{ExpertShape, ExpertTable};
use crate::{ExpertError, ExpertSource, ExpertStats, ExpertWeights, PilotGuess};
use deltafin_tensor::mxfp4::GROUP;
use deltafin_tensor::{Bytes, Mxfp4Matrix};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// File magic.
pub const MAGIC: &[u8; 8] = b"K3SC4V2\0";
/// Record magic.
pub const RECORD_MAGIC: &[u8; 8] = b"K3SC4REC";
/// Format version.
pub const VERSION: u32 = 2;
/// Layout id.
pub const LAYOUT_ID: u32 = 2;
/// Bytes of a record header (and the minimum file header).
pub const RECORD_HEADER: u64 = 8192;
/// Sidecar directory under the model root.
pub const SCALE4_DIR: &str = "k3-experts-scale4";
/// Manifest file name inside the sidecar directory.
pub const MANIFEST_FILE: &str = "scale4-manifest.json";
/// Manifest schema.
pub const SCHEMA: &str = "deltafin-expert-scale4-v2";
/// Matrix names in record order.
pub const MATRICES: [&str; 3] = ["w1", "w2", "w3"];

const PAD: u64 = 4096;
const TABLES_AT: usize = 128;

/// `L{layer}.sc4`.
pub fn layer_file_name(layer: usize) -> String {
    format!("L{layer}.sc4")
}

/// A scale4 encoding, decoding, file or manifest error; each names what is at fault.
#[derive(Debug, thiserror::Error)]
pub enum Scale4Error {
    /// A matrix's scales span more than 16 values.
    #[error(
        "layer {layer} expert {expert} {matrix}: E8M0 scale {value} at index {index} exceeds base {base} + 15; the matrix cannot be stored as 4-bit deltas"
    )]
    Span {
        layer: usize,
        expert: usize,
        matrix: &'static str,
        base: u8,
        value: u8,
        index: usize,
    },
    /// A record is malformed (magic, version, dims, tables, checksum, padding).
    #[error("{}: record of layer {layer} expert {expert}: {message}", path.display())]
    Record {
        path: PathBuf,
        layer: usize,
        expert: usize,
        message: String,
    },
    /// A file header or file is malformed or the wrong size.
    #[error("{}: {message}", path.display())]
    File { path: PathBuf, message: String },
    /// Reading or writing failed.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The manifest is missing, malformed or disagrees with the model.
    #[error("{}: {message}", path.display())]
    Manifest { path: PathBuf, message: String },
    /// The raw source could not be read.
    #[error(transparent)]
    Source(#[from] ExpertError),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Scale4Error + '_ {
    move |source| Scale4Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Every size of the format, derived from the expert shape and the expert count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scale4Layout {
    pub shape: ExpertShape,
    pub num_experts: usize,
}

impl Scale4Layout {
    /// The scale counts of w1, w2, w3 (`rows · cols / 32`).
    pub fn scale_counts(&self) -> [usize; 3] {
        self.shape.matrix_shapes().map(|(r, c)| r * c / GROUP)
    }

    /// Delta bytes of w1, w2, w3 (`⌈n/2⌉`).
    pub fn delta_bytes(&self) -> [u64; 3] {
        self.scale_counts().map(|n| n.div_ceil(2) as u64)
    }

    /// One record: header + the three delta regions, padded to 4,096.
    pub fn record_bytes(&self) -> u64 {
        (RECORD_HEADER + self.delta_bytes().iter().sum::<u64>()).div_ceil(PAD) * PAD
    }

    /// The file header: `64 + 8·experts` rounded up to 4,096, at least 8,192.
    pub fn header_bytes(&self) -> u64 {
        ((64 + 8 * self.num_experts as u64).div_ceil(PAD) * PAD).max(RECORD_HEADER)
    }

    /// File offset of expert `e`'s record.
    pub fn record_offset(&self, e: usize) -> u64 {
        self.header_bytes() + e as u64 * self.record_bytes()
    }

    /// Size of one layer file.
    pub fn file_bytes(&self) -> u64 {
        self.record_offset(self.num_experts)
    }

    /// Offsets in the compact blob of w1 codes, w1 deltas, w2 codes, w2 deltas, w3 codes,
    /// w3 deltas.
    pub fn blob_offsets(&self) -> [u64; 6] {
        let codes = self.shape.tensor_bytes();
        let deltas = self.delta_bytes();
        let mut out = [0u64; 6];
        let mut at = RECORD_HEADER;
        for m in 0..3 {
            out[2 * m] = at;
            at += codes[2 * m];
            out[2 * m + 1] = at;
            at += deltas[m];
        }
        out
    }

    /// Size of the compact blob.
    pub fn blob_bytes(&self) -> u64 {
        self.blob_offsets()[5] + self.delta_bytes()[2]
    }
}

/// The 16-entry exponent table of `base`: entry δ is the f32 bit pattern `(base+δ) << 23`.
pub fn exponent_table(base: u8) -> [u32; 16] {
    std::array::from_fn(|d| (base as u32 + d as u32) << 23)
}

/// One expert's scales as bases and packed 4-bit deltas.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodedScales {
    pub bases: [u8; 3],
    pub deltas: [Vec<u8>; 3],
}

/// Encode one matrix: `(base, packed deltas)`.
pub fn encode_matrix(
    scales: &[u8],
    layer: usize,
    expert: usize,
    matrix: usize,
) -> Result<(u8, Vec<u8>), Scale4Error> {
    let base = scales.iter().copied().min().unwrap_or(0);
    let mut out = vec![0u8; scales.len().div_ceil(2)];
    for (index, &value) in scales.iter().enumerate() {
        let d = value - base;
        if d > 15 {
            return Err(Scale4Error::Span {
                layer,
                expert,
                matrix: MATRICES[matrix],
                base,
                value,
                index,
            });
        }
        out[index / 2] |= d << (4 * (index % 2));
    }
    Ok((base, out))
}

/// Decode packed deltas back to `n` E8M0 bytes (`None` if a value would exceed 255 or the
/// delta bytes are too short).
pub fn decode_matrix(base: u8, deltas: &[u8], n: usize) -> Option<Vec<u8>> {
    if deltas.len() < n.div_ceil(2) {
        return None;
    }
    (0..n)
        .map(|i| base.checked_add((deltas[i / 2] >> (4 * (i % 2))) & 0x0f))
        .collect()
}

/// Encode the three scale arrays of one expert (w1, w2, w3).
pub fn encode_expert(
    scales: [&[u8]; 3],
    layer: usize,
    expert: usize,
) -> Result<EncodedScales, Scale4Error> {
    let mut bases = [0u8; 3];
    let mut deltas: [Vec<u8>; 3] = Default::default();
    for m in 0..3 {
        (bases[m], deltas[m]) = encode_matrix(scales[m], layer, expert, m)?;
    }
    Ok(EncodedScales { bases, deltas })
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn get32(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

fn get64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn record_header(
    layout: &Scale4Layout,
    layer: usize,
    expert: usize,
    enc: &EncodedScales,
) -> Vec<u8> {
    let mut h = vec![0u8; RECORD_HEADER as usize];
    h[..8].copy_from_slice(RECORD_MAGIC);
    put32(&mut h, 8, VERSION);
    put32(&mut h, 12, layer as u32);
    put32(&mut h, 16, expert as u32);
    put32(&mut h, 20, layout.shape.f as u32);
    put32(&mut h, 24, layout.shape.lr as u32);
    let mut sha = Sha256::new();
    for d in &enc.deltas {
        sha.update(d);
    }
    h[32..64].copy_from_slice(&sha.finalize());
    let counts = layout.scale_counts();
    for (m, (rows, cols)) in layout.shape.matrix_shapes().into_iter().enumerate() {
        let at = 64 + 16 * m;
        put32(&mut h, at, enc.bases[m] as u32);
        put32(&mut h, at + 4, rows as u32);
        put32(&mut h, at + 8, cols as u32);
        put32(&mut h, at + 12, counts[m] as u32);
        for (d, v) in exponent_table(enc.bases[m]).into_iter().enumerate() {
            put32(&mut h, TABLES_AT + 64 * m + 4 * d, v);
        }
    }
    h
}

/// One full record (`record_bytes` long).
pub fn write_record(
    layout: &Scale4Layout,
    layer: usize,
    expert: usize,
    enc: &EncodedScales,
) -> Vec<u8> {
    let mut r = record_header(layout, layer, expert, enc);
    for d in &enc.deltas {
        r.extend_from_slice(d);
    }
    r.resize(layout.record_bytes() as usize, 0);
    r
}

/// Validate a record (magic, version, ids, dims, tables, checksum, padding) and return its
/// bases and deltas. `path` only names the file in errors.
pub fn parse_record(
    layout: &Scale4Layout,
    layer: usize,
    expert: usize,
    rec: &[u8],
    path: &Path,
) -> Result<EncodedScales, Scale4Error> {
    let bad = |message: String| Scale4Error::Record {
        path: path.to_path_buf(),
        layer,
        expert,
        message,
    };
    if rec.len() as u64 != layout.record_bytes() {
        return Err(bad(format!(
            "is {} bytes, expected {}",
            rec.len(),
            layout.record_bytes()
        )));
    }
    if &rec[..8] != RECORD_MAGIC {
        return Err(bad("bad record magic (expected K3SC4REC)".into()));
    }
    let fields = [
        ("version", get32(rec, 8), VERSION),
        ("layer", get32(rec, 12), layer as u32),
        ("expert", get32(rec, 16), expert as u32),
        ("F", get32(rec, 20), layout.shape.f as u32),
        ("Lr", get32(rec, 24), layout.shape.lr as u32),
        ("reserved word", get32(rec, 28), 0),
    ];
    for (name, found, want) in fields {
        if found != want {
            return Err(bad(format!("{name} is {found}, expected {want}")));
        }
    }
    let counts = layout.scale_counts();
    let mut bases = [0u8; 3];
    for (m, (rows, cols)) in layout.shape.matrix_shapes().into_iter().enumerate() {
        let at = 64 + 16 * m;
        let base = get32(rec, at);
        if base > 255 {
            return Err(bad(format!("{} base {base} is not a byte", MATRICES[m])));
        }
        bases[m] = base as u8;
        for (name, found, want) in [
            ("rows", get32(rec, at + 4), rows),
            ("cols", get32(rec, at + 8), cols),
            ("scale count", get32(rec, at + 12), counts[m]),
        ] {
            if found as usize != want {
                return Err(bad(format!(
                    "{} {name} is {found}, expected {want}",
                    MATRICES[m]
                )));
            }
        }
        for (d, want) in exponent_table(bases[m]).into_iter().enumerate() {
            let found = get32(rec, TABLES_AT + 64 * m + 4 * d);
            if found != want {
                return Err(bad(format!(
                    "{} exponent table entry {d} is {found:#010x}, expected (base {} + {d}) << 23 = {want:#010x}",
                    MATRICES[m], bases[m]
                )));
            }
        }
    }
    if rec[TABLES_AT + 192..RECORD_HEADER as usize]
        .iter()
        .chain(&rec[28..32])
        .any(|&b| b != 0)
    {
        return Err(bad(
            "non-zero bytes in the reserved part of the header".into()
        ));
    }
    let sizes = layout.delta_bytes();
    let mut deltas: [Vec<u8>; 3] = Default::default();
    let mut at = RECORD_HEADER as usize;
    let mut sha = Sha256::new();
    for m in 0..3 {
        let d = &rec[at..at + sizes[m] as usize];
        sha.update(d);
        if counts[m] % 2 == 1 && d[d.len() - 1] >> 4 != 0 {
            return Err(bad(format!("{} unused last nibble is not 0", MATRICES[m])));
        }
        if bases[m] > 240 {
            let limit = 255 - bases[m];
            if let Some(i) = (0..counts[m]).find(|&i| (d[i / 2] >> (4 * (i % 2))) & 0x0f > limit) {
                return Err(bad(format!(
                    "{} delta at index {i} exceeds 255 − base {}",
                    MATRICES[m], bases[m]
                )));
            }
        }
        deltas[m] = d.to_vec();
        at += d.len();
    }
    if sha.finalize().as_slice() != &rec[32..64] {
        return Err(bad(
            "delta checksum mismatch (the record is corrupted)".into()
        ));
    }
    if rec[at..].iter().any(|&b| b != 0) {
        return Err(bad("non-zero record padding".into()));
    }
    Ok(EncodedScales { bases, deltas })
}

/// Decode all three matrices to E8M0 bytes.
pub fn decode_expert(layout: &Scale4Layout, enc: &EncodedScales) -> [Vec<u8>; 3] {
    let counts = layout.scale_counts();
    std::array::from_fn(|m| {
        decode_matrix(enc.bases[m], &enc.deltas[m], counts[m])
            .unwrap_or_else(|| unreachable!("deltas validated by parse_record/encode_expert"))
    })
}

/// The compact in-memory blob: the record header, then per matrix its codes and deltas.
/// `codes` are the raw w1, w2, w3 E2M1 code bytes.
pub fn compact_blob(
    layout: &Scale4Layout,
    layer: usize,
    expert: usize,
    codes: [&[u8]; 3],
    enc: &EncodedScales,
) -> Vec<u8> {
    let mut b = record_header(layout, layer, expert, enc);
    for (c, d) in codes.iter().zip(&enc.deltas) {
        b.extend_from_slice(c);
        b.extend_from_slice(d);
    }
    b
}

/// The file header of layer `layer`.
pub fn file_header(layout: &Scale4Layout, layer: usize) -> Vec<u8> {
    let mut h = vec![0u8; layout.header_bytes() as usize];
    h[..8].copy_from_slice(MAGIC);
    for (i, v) in [
        VERSION,
        LAYOUT_ID,
        layout.header_bytes() as u32,
        layout.record_bytes() as u32,
        layer as u32,
        layout.num_experts as u32,
        layout.shape.f as u32,
        layout.shape.lr as u32,
    ]
    .into_iter()
    .enumerate()
    {
        put32(&mut h, 8 + 4 * i, v);
    }
    for e in 0..layout.num_experts {
        let at = 64 + 8 * e;
        h[at..at + 8].copy_from_slice(&layout.record_offset(e).to_le_bytes());
    }
    h
}

/// Check a file header against the layout and layer.
pub fn check_file_header(
    layout: &Scale4Layout,
    layer: usize,
    h: &[u8],
    path: &Path,
) -> Result<(), Scale4Error> {
    let bad = |message: String| Scale4Error::File {
        path: path.to_path_buf(),
        message,
    };
    if (h.len() as u64) < layout.header_bytes() {
        return Err(bad(format!(
            "header is {} bytes, expected {}",
            h.len(),
            layout.header_bytes()
        )));
    }
    if &h[..8] != MAGIC {
        return Err(bad("bad magic (expected K3SC4V2)".into()));
    }
    let want = [
        ("version", VERSION),
        ("layout id", LAYOUT_ID),
        ("header bytes", layout.header_bytes() as u32),
        ("record bytes", layout.record_bytes() as u32),
        ("layer", layer as u32),
        ("experts", layout.num_experts as u32),
        ("F", layout.shape.f as u32),
        ("Lr", layout.shape.lr as u32),
    ];
    for (i, (name, v)) in want.into_iter().enumerate() {
        let found = get32(h, 8 + 4 * i);
        if found != v {
            return Err(bad(format!("header {name} is {found}, expected {v}")));
        }
    }
    for e in 0..layout.num_experts {
        let found = get64(h, 64 + 8 * e);
        if found != layout.record_offset(e) {
            return Err(bad(format!(
                "record index of expert {e} is {found}, expected {}",
                layout.record_offset(e)
            )));
        }
    }
    Ok(())
}

/// The raw experts a conversion reads: a table and its files (kept open when there are few,
/// as shards; opened per read when every expert is its own file).
pub struct RawSource {
    pub table: ExpertTable,
    open: Option<Vec<std::fs::File>>,
}

impl RawSource {
    /// Files kept open at most (more: one `open` per read, as `k3-experts/` files).
    pub const MAX_OPEN: usize = 256;

    /// Wrap `table`, opening its files now when there are at most [`Self::MAX_OPEN`].
    pub fn new(table: ExpertTable) -> Result<RawSource, Scale4Error> {
        let open = if table.files.len() <= Self::MAX_OPEN {
            Some(
                table
                    .files
                    .iter()
                    .map(|p| std::fs::File::open(p).map_err(io_err(p)))
                    .collect::<Result<Vec<_>, _>>()?,
            )
        } else {
            None
        };
        Ok(RawSource { table, open })
    }

    /// The three raw E8M0 scale arrays (w1, w2, w3) of one expert.
    pub fn scales(&self, layer: usize, expert: usize) -> Result<[Vec<u8>; 3], Scale4Error> {
        let loc = self.table.get(layer, expert)?;
        let path = &self.table.files[loc.file];
        let io = |offset: u64, len: u64| {
            move |source| {
                Scale4Error::Source(ExpertError::Io {
                    layer,
                    expert,
                    path: path.clone(),
                    offset,
                    len,
                    source,
                })
            }
        };
        let owned;
        let f = match &self.open {
            Some(files) => &files[loc.file],
            None => {
                owned = std::fs::File::open(path).map_err(io(0, 0))?;
                &owned
            }
        };
        let mut out: [Vec<u8>; 3] = Default::default();
        for (m, o) in out.iter_mut().enumerate() {
            let (off, len) = loc.ranges[2 * m + 1];
            *o = vec![0u8; len as usize];
            f.read_exact_at(o, off).map_err(io(off, len))?;
        }
        Ok(out)
    }

    /// Bytes of raw scales one expert conversion reads.
    pub fn scale_bytes_per_expert(&self) -> u64 {
        let t = self.table.shape.tensor_bytes();
        t[1] + t[3] + t[5]
    }
}

/// Write `L{layer}.sc4` into `dir` from the raw source: `.part` file, `workers` threads
/// encoding experts into their record slots, fsync, then verification of every record
/// against the raw scales, then an atomic rename. `progress(n)` is called as experts are
/// done. Returns the sha256 of the file.
pub fn convert_layer(
    dir: &Path,
    layout: &Scale4Layout,
    layer: usize,
    raw: &RawSource,
    workers: usize,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<String, Scale4Error> {
    let path = dir.join(layer_file_name(layer));
    let part = dir.join(format!("{}.part", layer_file_name(layer)));
    let f = std::fs::File::create(&part).map_err(io_err(&part))?;
    f.set_len(layout.file_bytes()).map_err(io_err(&part))?;
    f.write_all_at(&file_header(layout, layer), 0)
        .map_err(io_err(&part))?;
    for_each_expert(layout.num_experts, workers, |e| {
        let scales = raw.scales(layer, e)?;
        let enc = encode_expert([&scales[0], &scales[1], &scales[2]], layer, e)?;
        f.write_all_at(
            &write_record(layout, layer, e, &enc),
            layout.record_offset(e),
        )
        .map_err(io_err(&part))?;
        progress(1);
        Ok(())
    })?;
    f.sync_all().map_err(io_err(&part))?;
    drop(f);
    let sha = verify_layer(&part, layout, layer, Some(raw), workers)?;
    std::fs::rename(&part, &path).map_err(io_err(&path))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all(); // directory fsync is best effort (not every filesystem allows it)
    }
    Ok(sha)
}

fn for_each_expert(
    n: usize,
    workers: usize,
    job: impl Fn(usize) -> Result<(), Scale4Error> + Sync,
) -> Result<(), Scale4Error> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let results: Vec<Result<(), Scale4Error>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers.clamp(1, n.max(1)))
            .map(|_| {
                s.spawn(|| {
                    loop {
                        let e = next.fetch_add(1, Ordering::Relaxed);
                        if e >= n || failed.load(Ordering::Relaxed) {
                            return Ok(());
                        }
                        if let Err(err) = job(e) {
                            failed.store(true, Ordering::Relaxed);
                            return Err(err);
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    results.into_iter().collect()
}

/// Validate a layer file: size, header, every record; with a raw source, also that every
/// record decodes to the raw scale bytes. Returns the file's sha256.
pub fn verify_layer(
    path: &Path,
    layout: &Scale4Layout,
    layer: usize,
    raw: Option<&RawSource>,
    workers: usize,
) -> Result<String, Scale4Error> {
    let f = std::fs::File::open(path).map_err(io_err(path))?;
    let len = f.metadata().map_err(io_err(path))?.len();
    if len != layout.file_bytes() {
        return Err(Scale4Error::File {
            path: path.to_path_buf(),
            message: format!("is {len} bytes, expected {}", layout.file_bytes()),
        });
    }
    let mut h = vec![0u8; layout.header_bytes() as usize];
    f.read_exact_at(&mut h, 0).map_err(io_err(path))?;
    check_file_header(layout, layer, &h, path)?;
    for_each_expert(layout.num_experts, workers, |e| {
        let mut rec = vec![0u8; layout.record_bytes() as usize];
        f.read_exact_at(&mut rec, layout.record_offset(e))
            .map_err(io_err(path))?;
        let enc = parse_record(layout, layer, e, &rec, path)?;
        if let Some(raw) = raw {
            let want = raw.scales(layer, e)?;
            let got = decode_expert(layout, &enc);
            if let Some(m) = (0..3).find(|&m| got[m] != want[m]) {
                return Err(Scale4Error::Record {
                    path: path.to_path_buf(),
                    layer,
                    expert: e,
                    message: format!(
                        "{} decodes to scales that differ from the raw expert",
                        MATRICES[m]
                    ),
                });
            }
        }
        Ok(())
    })?;
    sha256_file(path)
}

/// Hex sha256 of a file.
pub fn sha256_file(path: &Path) -> Result<String, Scale4Error> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let mut sha = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        sha.update(&buf[..n]);
    }
    Ok(hex::encode(sha.finalize()))
}

/// One layer entry of the manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestLayer {
    pub layer: usize,
    pub file: String,
    pub bytes: u64,
    pub experts: usize,
    pub sha256: String,
}

/// `scale4-manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scale4Manifest {
    pub schema: String,
    pub version: u32,
    pub layout: u32,
    pub moe_intermediate_size: usize,
    pub routed_expert_hidden_size: usize,
    pub num_experts: usize,
    pub header_bytes: u64,
    pub record_bytes: u64,
    pub blob_bytes: u64,
    /// sha256 of the model's `config.json` the sidecars were made for.
    pub config_sha256: String,
    /// Experts validated against the raw source (all of them).
    pub validated_experts: usize,
    pub layers: Vec<ManifestLayer>,
}

impl Scale4Manifest {
    /// A manifest for `layers` (layer, sha256) converted with `layout`.
    pub fn new(layout: &Scale4Layout, config_sha256: String, layers: &[(usize, String)]) -> Self {
        Scale4Manifest {
            schema: SCHEMA.into(),
            version: VERSION,
            layout: LAYOUT_ID,
            moe_intermediate_size: layout.shape.f,
            routed_expert_hidden_size: layout.shape.lr,
            num_experts: layout.num_experts,
            header_bytes: layout.header_bytes(),
            record_bytes: layout.record_bytes(),
            blob_bytes: layout.blob_bytes(),
            config_sha256,
            validated_experts: layers.len() * layout.num_experts,
            layers: layers
                .iter()
                .map(|(l, sha)| ManifestLayer {
                    layer: *l,
                    file: layer_file_name(*l),
                    bytes: layout.file_bytes(),
                    experts: layout.num_experts,
                    sha256: sha.clone(),
                })
                .collect(),
        }
    }

    /// Write atomically (`.tmp` + fsync + rename).
    pub fn write(&self, dir: &Path) -> Result<(), Scale4Error> {
        let path = dir.join(MANIFEST_FILE);
        let tmp = dir.join(format!("{MANIFEST_FILE}.tmp"));
        let text = serde_json::to_string_pretty(self).map_err(|e| Scale4Error::Manifest {
            path: path.clone(),
            message: e.to_string(),
        })?;
        std::fs::write(&tmp, text + "\n").map_err(io_err(&tmp))?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io_err(&path))
    }
}

/// Validated sidecars of one model: the manifest agrees with the layout, the MoE layers and
/// the config digest, and every layer file has the right size and header. (Layer digests
/// are checked by the converter; at run time each record is validated, checksum included,
/// when it is read.)
pub struct Scale4Sidecars {
    layout: Scale4Layout,
    /// Per layer: the open file and its path (`None` for dense layers).
    files: Vec<Option<(std::fs::File, PathBuf)>>,
}

impl Scale4Sidecars {
    /// Open `dir` for a model with `layout`, `moe_layers[l]` true for MoE layers, and the
    /// sha256 of its `config.json`.
    pub fn open(
        dir: &Path,
        layout: Scale4Layout,
        moe_layers: &[bool],
        config_sha256: &str,
    ) -> Result<Scale4Sidecars, Scale4Error> {
        let path = dir.join(MANIFEST_FILE);
        let bad = |message: String| Scale4Error::Manifest {
            path: path.clone(),
            message,
        };
        let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
        let m: Scale4Manifest =
            serde_json::from_str(&text).map_err(|e| bad(format!("not a valid manifest: {e}")))?;
        let want = Scale4Manifest::new(&layout, config_sha256.to_string(), &[]);
        let fields = [
            ("schema", m.schema.clone(), want.schema),
            ("version", m.version.to_string(), want.version.to_string()),
            ("layout", m.layout.to_string(), want.layout.to_string()),
            (
                "moe_intermediate_size",
                m.moe_intermediate_size.to_string(),
                layout.shape.f.to_string(),
            ),
            (
                "routed_expert_hidden_size",
                m.routed_expert_hidden_size.to_string(),
                layout.shape.lr.to_string(),
            ),
            (
                "num_experts",
                m.num_experts.to_string(),
                layout.num_experts.to_string(),
            ),
            (
                "header_bytes",
                m.header_bytes.to_string(),
                want.header_bytes.to_string(),
            ),
            (
                "record_bytes",
                m.record_bytes.to_string(),
                want.record_bytes.to_string(),
            ),
            (
                "blob_bytes",
                m.blob_bytes.to_string(),
                want.blob_bytes.to_string(),
            ),
            ("config_sha256", m.config_sha256.clone(), want.config_sha256),
        ];
        for (name, found, expected) in fields {
            if found != expected {
                return Err(bad(format!(
                    "{name} is {found}, the model needs {expected}"
                )));
            }
        }
        let moe: Vec<usize> = (0..moe_layers.len()).filter(|&l| moe_layers[l]).collect();
        let listed: Vec<usize> = m.layers.iter().map(|l| l.layer).collect();
        if listed != moe {
            return Err(bad(format!(
                "lists layers {listed:?}, the model's MoE layers are {moe:?}"
            )));
        }
        let total = moe.len() * layout.num_experts;
        if m.validated_experts != total {
            return Err(bad(format!(
                "validated_experts is {}, activation needs all {total} experts validated",
                m.validated_experts
            )));
        }
        let mut files: Vec<Option<(std::fs::File, PathBuf)>> =
            (0..moe_layers.len()).map(|_| None).collect();
        for entry in &m.layers {
            if entry.file != layer_file_name(entry.layer)
                || entry.bytes != layout.file_bytes()
                || entry.experts != layout.num_experts
            {
                return Err(bad(format!(
                    "layer {} entry ({}, {} bytes, {} experts) disagrees with the layout ({}, {} bytes, {} experts)",
                    entry.layer,
                    entry.file,
                    entry.bytes,
                    entry.experts,
                    layer_file_name(entry.layer),
                    layout.file_bytes(),
                    layout.num_experts
                )));
            }
            let p = dir.join(&entry.file);
            let f = std::fs::File::open(&p).map_err(io_err(&p))?;
            let len = f.metadata().map_err(io_err(&p))?.len();
            if len != entry.bytes {
                return Err(Scale4Error::File {
                    path: p,
                    message: format!("is {len} bytes, the manifest says {}", entry.bytes),
                });
            }
            let mut h = vec![0u8; layout.header_bytes() as usize];
            f.read_exact_at(&mut h, 0).map_err(io_err(&p))?;
            check_file_header(&layout, entry.layer, &h, &p)?;
            files[entry.layer] = Some((f, p));
        }
        Ok(Scale4Sidecars { layout, files })
    }

    /// The layout.
    pub fn layout(&self) -> &Scale4Layout {
        &self.layout
    }

    /// Read and validate expert `expert`'s record of `layer`.
    pub fn record(&self, layer: usize, expert: usize) -> Result<EncodedScales, Scale4Error> {
        let Some(Some((f, path))) = self.files.get(layer) else {
            return Err(Scale4Error::Source(ExpertError::Unavailable {
                layer,
                expert,
                message: "no scale4 sidecar for this layer".into(),
            }));
        };
        if expert >= self.layout.num_experts {
            return Err(Scale4Error::Source(ExpertError::Unavailable {
                layer,
                expert,
                message: format!("out of range (num_experts = {})", self.layout.num_experts),
            }));
        }
        let mut rec = vec![0u8; self.layout.record_bytes() as usize];
        f.read_exact_at(&mut rec, self.layout.record_offset(expert))
            .map_err(io_err(path))?;
        parse_record(&self.layout, layer, expert, &rec, path)
    }

    /// The three E8M0 scale arrays of one expert, decoded from its record.
    pub fn scales(&self, layer: usize, expert: usize) -> Result<[Vec<u8>; 3], Scale4Error> {
        Ok(decode_expert(&self.layout, &self.record(layer, expert)?))
    }
}

/// An [`ExpertSource`] whose E8M0 scales come from scale4 sidecars: the E2M1 codes come from
/// `inner` (the raw expert) unchanged, the scale bytes are decoded from the record, so every
/// product is bit-identical to `inner`'s. Scheduling hints and stats pass through.
pub struct Scale4Experts {
    inner: Box<dyn ExpertSource>,
    sidecars: Scale4Sidecars,
}

impl Scale4Experts {
    /// Serve `inner`'s experts with scales from `sidecars`.
    pub fn new(inner: Box<dyn ExpertSource>, sidecars: Scale4Sidecars) -> Scale4Experts {
        Scale4Experts { inner, sidecars }
    }
}

impl ExpertSource for Scale4Experts {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError> {
        let raw = self.inner.expert(layer, expert)?;
        let scales = self
            .sidecars
            .scales(layer, expert)
            .map_err(|e| ExpertError::Unavailable {
                layer,
                expert,
                message: format!("scale4 sidecar: {e}"),
            })?;
        let [s1, s2, s3] = scales;
        let with = |m: &Mxfp4Matrix, s: Vec<u8>, name: &str| {
            m.with_scales(name, Bytes::from_vec(s))
                .map_err(|source| ExpertError::Tensor {
                    layer,
                    expert,
                    source,
                })
        };
        Ok(ExpertWeights {
            w1: with(&raw.w1, s1, "w1")?,
            w2: with(&raw.w2, s2, "w2")?,
            w3: with(&raw.w3, s3, "w3")?,
        })
    }
    fn begin_layer(&self, layer: usize, experts: &[usize]) {
        self.inner.begin_layer(layer, experts)
    }
    fn wants_prediction(&self) -> bool {
        self.inner.wants_prediction()
    }
    fn next_ready(&self, layer: usize, pending: &[usize]) -> usize {
        self.inner.next_ready(layer, pending)
    }
    fn predict(&self, layer: usize, rows: usize, guesses: &[PilotGuess]) {
        self.inner.predict(layer, rows, guesses)
    }
    fn stats(&self) -> Option<ExpertStats> {
        self.inner.stats()
    }
    fn record_routes(&self, layer: usize, k: usize, ids: &[usize], weights: &[f32]) {
        self.inner.record_routes(layer, k, ids, weights)
    }
}

/// A table of `k3-experts/L{l}-E{e}.bin` files under `dir` (each must exist with the
/// expert's size); `moe_layers[l]` true for MoE layers.
pub fn raw_file_table(
    dir: &Path,
    shape: ExpertShape,
    moe_layers: &[bool],
    num_experts: usize,
) -> Result<ExpertTable, Scale4Error> {
    let mut files = Vec::new();
    let mut layers = Vec::with_capacity(moe_layers.len());
    let mut ranges = [(0u64, 0u64); 6];
    let mut at = 0;
    for (r, len) in ranges.iter_mut().zip(shape.tensor_bytes()) {
        *r = (at, len);
        at += len;
    }
    for (l, &moe) in moe_layers.iter().enumerate() {
        if !moe {
            layers.push(None);
            continue;
        }
        let mut locs = Vec::with_capacity(num_experts);
        for e in 0..num_experts {
            let p = dir.join(format!("L{l}-E{e}.bin"));
            let len = std::fs::metadata(&p).map_err(io_err(&p))?.len();
            if len != shape.expert_bytes() {
                return Err(Scale4Error::File {
                    path: p,
                    message: format!("is {len} bytes, an expert is {}", shape.expert_bytes()),
                });
            }
            files.push(p);
            locs.push(crate::ExpertLocation {
                file: files.len() - 1,
                ranges,
            });
        }
        layers.push(Some(locs));
    }
    let table = ExpertTable {
        files,
        shape,
        layers,
    };
    table.validate()?;
    Ok(table)
}

#[cfg(test)]
mod tests;
