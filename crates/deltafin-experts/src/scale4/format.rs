//! The `K3SC4V2` byte format: sizes, the 4-bit delta code, records and file headers.

use super::error::Scale4Error;
use crate::layout::ExpertShape;
use deltafin_tensor::mxfp4::GROUP;
use sha2::{Digest, Sha256};
use std::path::Path;

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
pub(super) const TABLES_AT: usize = 128;

/// `L{layer}.sc4`.
pub fn layer_file_name(layer: usize) -> String {
    format!("L{layer}.sc4")
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
