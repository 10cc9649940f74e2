//! [`SpinePack`]: an opened, structurally validated pack (the whole file mapped), its
//! full verification, and zero-copy tensor views.

use super::format::*;
use crate::spine_int8::SpineFormat;
use deltafin_tensor::{Bf16Matrix, Bytes, DType, RowInt8Matrix};
use rayon::prelude::*;
use std::fs::File;
use std::path::{Path, PathBuf};

/// An opened, structurally validated pack (the whole file mapped).
#[derive(Debug)]
pub struct SpinePack {
    path: PathBuf,
    bytes: Bytes,
    format: SpineFormat,
    layer: u32,
    layers: u32,
    chunk_size: u64,
    pub(super) payload_off: u64,
    payload_len: u64,
    dir_end: u64,
    identity: PackIdentity,
    payload_digest: [u8; 32],
    pack_digest: [u8; 32],
    tensors: Vec<TensorEntry>,
    chunks: Vec<Component>,
}

impl SpinePack {
    /// Offset of the payload (the tensors' bytes) in the pack file.
    pub fn payload_offset(&self) -> u64 {
        self.payload_off
    }

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
        // Packs must not be modified while in use (docs/OPERATIONS.md, "Spine packs").
        let bytes = deltafin_tensor::storage::map_file(&file, path).map_err(io_err(path))?;
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
    pub(super) fn entry(&self, name: &str, codec: Codec) -> Result<&TensorEntry, PackError> {
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

pub(super) fn parse_record(r: &[u8], payload_len: u64) -> Result<TensorEntry, String> {
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
    let overflows = || bad(format!("{source_dtype} {shape:?} overflows a byte length"));
    let (want_data, want_scales, want_stored) = match codec {
        Codec::Raw => (
            elems
                .checked_mul(source_dtype.size() as u64)
                .ok_or_else(overflows)?,
            0,
            source_dtype,
        ),
        Codec::RowI8F16Scale => {
            if rank != 2 {
                return Err(bad(format!("RowI8F16Scale needs rank 2, found {rank}")));
            }
            let scales = (shape[0] as u64).checked_mul(2).ok_or_else(overflows)?;
            (elems, scales, DType::I8)
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
