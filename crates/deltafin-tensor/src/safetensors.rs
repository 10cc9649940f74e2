//! The safetensors container: an 8-byte little-endian header length `n`, `n` bytes of JSON
//! header, then the raw tensor data. Every header entry (except `__metadata__`) is
//! `{"dtype": "BF16", "shape": [..], "data_offsets": [start, end]}` with offsets relative to
//! the start of the data section.
//!
//! [`SafetensorsFile`] memory-maps a file and validates the whole header before any tensor is
//! read; [`SafetensorsWriter`] writes the same format deterministically, streaming tensor data
//! through a callback so that multi-gigabyte files never sit in memory.
//!
//! **Reading.** The `safetensors` crate parses the header
//! ([`safetensors::SafeTensors::read_metadata`]): framing, UTF-8, JSON, typed entries, sizes
//! against dtype × shape, tensors back to back from offset 0 to the end of the file. Two
//! checks of ours come on top: every dtype is one [`DType`] knows, and an entry holds no key
//! besides `dtype`, `shape` and `data_offsets` (the crate ignores unknown keys). When the crate
//! refuses a file its error does not say which tensor or field is wrong, so the header is then
//! examined entry by entry to name the fault (file, tensor, field, the numbers). A header that
//! passes that examination although the crate refused it is accepted: bytes between tensors or
//! after the last one, `__metadata__` values that are not strings. A tensor deleted from a
//! shard's header leaves such a hole, and the checkpoint then names the tensor its index lists
//! and the shard lacks.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, Metadata, SafeTensorError};
use serde::de::IgnoredAny;
use serde_json::{Map, Value};

use crate::{Bytes, DType, TensorError};

/// Largest header accepted (the real K3 shards have headers of about 1 MB); the limit of the
/// `safetensors` crate.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor of a safetensors header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Name as written in the header.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape (row-major; `[]` is a scalar).
    pub shape: Vec<usize>,
    /// Byte range relative to the start of the data section.
    pub data_offsets: (usize, usize),
}

impl TensorInfo {
    /// Number of data bytes.
    pub fn byte_len(&self) -> usize {
        self.data_offsets.1 - self.data_offsets.0
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A validated, memory-mapped safetensors file.
pub struct SafetensorsFile {
    path: PathBuf,
    file: Bytes,
    data_start: usize,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    metadata: Option<Map<String, Value>>,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .field("data_start", &self.data_start)
            .finish()
    }
}

impl SafetensorsFile {
    /// Memory-map `path` and validate its header: length within the file, UTF-8 JSON object,
    /// known dtypes, `end - start == numel * dtype size`, every range inside the data section
    /// (a truncated file names the first tensor that does not fit) and no overlapping ranges.
    pub fn open(path: impl AsRef<Path>) -> Result<SafetensorsFile, TensorError> {
        let path = path.as_ref();
        let io_err = |source| TensorError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io_err)?;
        let len = file.metadata().map_err(io_err)?.len();
        if len < 8 {
            return Err(TensorError::format(
                path,
                format!("file is {len} bytes, too short for the 8-byte safetensors header length"),
            ));
        }
        // A mapping that remembers its file, so that resident copies are read from the file
        // (`storage::copy_to_anonymous`); the file must not change while mapped.
        let bytes = crate::storage::map_file(&file, path).map_err(io_err)?;
        // The header is read through the mapping. A page fault there would read the
        // megabytes around it too (readahead), most of them tensor data nobody asked for
        // yet: read the header's bytes into the page cache with one explicit read, and parse
        // them with readahead off.
        let mut prefix = [0u8; 8];
        file.read_exact_at(&mut prefix, 0).map_err(io_err)?;
        let header = u64::from_le_bytes(prefix)
            .min(MAX_HEADER_BYTES)
            .min(len - 8);
        let mut warm = vec![0u8; 8 + header as usize];
        file.read_exact_at(&mut warm, 0).map_err(io_err)?;
        drop(warm);
        let mapping = bytes.file_origin().map(|(m, _)| m);
        if let Some(m) = mapping {
            m.advise_random(true);
        }
        let parsed = Self::from_bytes(path, bytes.clone());
        if let Some(m) = mapping {
            m.advise_random(false);
        }
        parsed
    }

    /// Parse an in-memory safetensors image (tests, embedded data). `path` is used in errors.
    pub fn from_bytes(path: impl AsRef<Path>, file: Bytes) -> Result<SafetensorsFile, TensorError> {
        let path = path.as_ref().to_path_buf();
        let header = parse_header(&path, file.as_slice())?;
        let index = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(SafetensorsFile {
            path,
            file,
            data_start: header.data_start,
            tensors: header.tensors,
            index,
            metadata: header.metadata,
        })
    }

    /// The file this was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// All tensors in file order (by data offset).
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Header entry of `name`, if present.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The `__metadata__` object, if the header has one.
    pub fn metadata(&self) -> Option<&Map<String, Value>> {
        self.metadata.as_ref()
    }

    /// Absolute file offset of the data section (8 + header length).
    pub fn data_start(&self) -> usize {
        self.data_start
    }

    /// Absolute file byte range `(offset, len)` of tensor `name`.
    pub fn absolute_range(&self, name: &str) -> Result<(u64, u64), TensorError> {
        let t = self.require(name)?;
        Ok((
            (self.data_start + t.data_offsets.0) as u64,
            t.byte_len() as u64,
        ))
    }

    /// Zero-copy view of the bytes of tensor `name`.
    pub fn bytes(&self, name: &str) -> Result<Bytes, TensorError> {
        let t = self.require(name)?;
        let (s, e) = t.data_offsets;
        self.file
            .slice(self.data_start + s..self.data_start + e)
            .ok_or_else(|| {
                // Ranges were validated in `from_bytes`; this is unreachable for a valid file.
                TensorError::format(
                    &self.path,
                    format!("tensor `{name}` lies outside the mapped file"),
                )
            })
    }

    fn require(&self, name: &str) -> Result<&TensorInfo, TensorError> {
        self.info(name).ok_or_else(|| {
            TensorError::format(&self.path, format!("tensor `{name}` is not in this file"))
        })
    }
}

/// A validated header: where the data starts, the tensors in file order (by data offset),
/// and the `__metadata__` object.
struct Header {
    data_start: usize,
    tensors: Vec<TensorInfo>,
    metadata: Option<Map<String, Value>>,
}

/// Parse and validate the header of the file image `all` (see the module docs).
fn parse_header(path: &Path, all: &[u8]) -> Result<Header, TensorError> {
    match SafeTensors::read_metadata(all) {
        Ok((n, meta)) => from_metadata(path, 8 + n, &meta, &all[8..8 + n]),
        Err(e) => examine(path, all, e),
    }
}

/// Our checks on top of a header the crate accepted.
fn from_metadata(
    path: &Path,
    data_start: usize,
    meta: &Metadata,
    header: &[u8],
) -> Result<Header, TensorError> {
    check_entry_keys(path, header)?;
    let mut tensors = Vec::new();
    for name in meta.offset_keys() {
        let Some(info) = meta.info(&name) else {
            continue;
        };
        let Some(dtype) = dtype_of(info.dtype) else {
            return Err(TensorError::format(
                path,
                format!(
                    "tensor `{name}`: unknown dtype {:?}",
                    info.dtype.to_string()
                ),
            ));
        };
        tensors.push(TensorInfo {
            name,
            dtype,
            shape: info.shape.clone(),
            data_offsets: info.data_offsets,
        });
    }
    // File order; only empty tensors share offsets, and they go by name.
    tensors.sort_by(|a, b| {
        a.data_offsets
            .cmp(&b.data_offsets)
            .then_with(|| a.name.cmp(&b.name))
    });
    let metadata = meta.metadata().as_ref().map(|m| {
        let mut kv: Vec<_> = m.iter().collect();
        kv.sort();
        kv.into_iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect()
    });
    Ok(Header {
        data_start,
        tensors,
        metadata,
    })
}

/// Refuse a header entry with a key besides `dtype`, `shape` and `data_offsets` (the first
/// by tensor name, then key).
fn check_entry_keys(path: &Path, header: &[u8]) -> Result<(), TensorError> {
    let entries: HashMap<String, HashMap<String, IgnoredAny>> = serde_json::from_slice(header)
        .map_err(|e| TensorError::format(path, format!("header is not valid JSON: {e}")))?;
    let unexpected = entries
        .iter()
        .filter(|(name, _)| name.as_str() != "__metadata__")
        .flat_map(|(name, keys)| keys.keys().map(move |k| (name, k)))
        .filter(|(_, k)| !matches!(k.as_str(), "dtype" | "shape" | "data_offsets"))
        .min();
    match unexpected {
        Some((name, k)) => Err(TensorError::format(
            path,
            format!("tensor `{name}`: unexpected key `{k}` in header entry"),
        )),
        None => Ok(()),
    }
}

/// Our element type of the crate's, if we have it.
fn dtype_of(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::BOOL => DType::Bool,
        Dtype::U8 => DType::U8,
        Dtype::I8 => DType::I8,
        Dtype::U16 => DType::U16,
        Dtype::I16 => DType::I16,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::U32 => DType::U32,
        Dtype::I32 => DType::I32,
        Dtype::F32 => DType::F32,
        Dtype::U64 => DType::U64,
        Dtype::I64 => DType::I64,
        Dtype::F64 => DType::F64,
        _ => return None,
    })
}

/// The crate refused the file: name what is wrong, or accept a header whose only fault is a
/// hole in the data section (see the module docs).
fn examine(path: &Path, all: &[u8], refused: SafeTensorError) -> Result<Header, TensorError> {
    let total = all.len();
    let n = all
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map_or(0, u64::from_le_bytes);
    let fault = match refused {
        SafeTensorError::HeaderTooSmall => {
            format!("file is {total} bytes, too short for the 8-byte safetensors header length")
        }
        SafeTensorError::HeaderTooLarge => format!(
            "header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (not a safetensors file?)"
        ),
        SafeTensorError::InvalidHeaderLength => format!(
            "header length {n} runs past the end of the file ({total} bytes): truncated or not a safetensors file"
        ),
        SafeTensorError::InvalidHeader(e) => format!("header is not valid UTF-8: {e}"),
        _ => return examine_entries(path, all, 8 + n as usize),
    };
    Err(TensorError::format(path, fault))
}

/// Every entry of a header that frames correctly, checked one by one with errors that name
/// the tensor and field; then the ranges: inside the data section, not overlapping.
fn examine_entries(path: &Path, all: &[u8], data_start: usize) -> Result<Header, TensorError> {
    let total = all.len();
    let header = all
        .get(8..data_start)
        .ok_or_else(|| TensorError::format(path, "header length runs past the end of the file"))?;
    let header = std::str::from_utf8(header)
        .map_err(|e| TensorError::format(path, format!("header is not valid UTF-8: {e}")))?;
    let parsed: Value = serde_json::from_str(header.trim_end_matches(' '))
        .map_err(|e| TensorError::format(path, format!("header is not valid JSON: {e}")))?;
    let Value::Object(entries) = parsed else {
        return Err(TensorError::format(path, "header is not a JSON object"));
    };
    let data_len = total.saturating_sub(data_start);
    let mut metadata = None;
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, entry) in entries {
        if name == "__metadata__" {
            match entry {
                Value::Object(m) => metadata = Some(m),
                _ => {
                    return Err(TensorError::format(
                        path,
                        "`__metadata__` is not a JSON object",
                    ));
                }
            }
            continue;
        }
        tensors.push(parse_entry(path, &name, &entry)?);
    }
    // File order: by start offset (stable, so equal empty ranges keep header order).
    tensors.sort_by_key(|t| t.data_offsets);
    if let Some(t) = tensors.iter().find(|t| t.data_offsets.1 > data_len) {
        return Err(TensorError::format(
            path,
            format!(
                "truncated: tensor `{}` needs data bytes [{}, {}) but the file holds only {} data bytes ({} bytes in all)",
                t.name, t.data_offsets.0, t.data_offsets.1, data_len, total
            ),
        ));
    }
    for w in tensors.windows(2) {
        if w[1].data_offsets.0 < w[0].data_offsets.1 {
            return Err(TensorError::format(
                path,
                format!(
                    "tensors `{}` [{}, {}) and `{}` [{}, {}) overlap",
                    w[0].name,
                    w[0].data_offsets.0,
                    w[0].data_offsets.1,
                    w[1].name,
                    w[1].data_offsets.0,
                    w[1].data_offsets.1
                ),
            ));
        }
    }
    Ok(Header {
        data_start,
        tensors,
        metadata,
    })
}

fn parse_entry(path: &Path, name: &str, entry: &Value) -> Result<TensorInfo, TensorError> {
    let bad = |msg: String| TensorError::format(path, format!("tensor `{name}`: {msg}"));
    let obj = entry
        .as_object()
        .ok_or_else(|| bad("header entry is not a JSON object".into()))?;
    let dtype_str = obj
        .get("dtype")
        .ok_or_else(|| bad("missing `dtype`".into()))?
        .as_str()
        .ok_or_else(|| bad("`dtype` is not a string".into()))?;
    let dtype = DType::from_safetensors(dtype_str)
        .ok_or_else(|| bad(format!("unknown dtype {dtype_str:?}")))?;
    let shape_v = obj
        .get("shape")
        .ok_or_else(|| bad("missing `shape`".into()))?
        .as_array()
        .ok_or_else(|| bad("`shape` is not an array".into()))?;
    let mut shape = Vec::with_capacity(shape_v.len());
    for d in shape_v {
        let d = d
            .as_u64()
            .and_then(|d| usize::try_from(d).ok())
            .ok_or_else(|| bad(format!("shape entry {d} is not a non-negative integer")))?;
        shape.push(d);
    }
    let offs = obj
        .get("data_offsets")
        .ok_or_else(|| bad("missing `data_offsets`".into()))?
        .as_array()
        .ok_or_else(|| bad("`data_offsets` is not an array".into()))?;
    let off = |v: &Value| v.as_u64().and_then(|d| usize::try_from(d).ok());
    let (start, end) = match offs.as_slice() {
        [a, b] => match (off(a), off(b)) {
            (Some(a), Some(b)) => (a, b),
            _ => {
                return Err(bad(
                    "`data_offsets` entries are not non-negative integers".into()
                ));
            }
        },
        _ => return Err(bad("`data_offsets` must have exactly two entries".into())),
    };
    if end < start {
        return Err(bad(format!(
            "data_offsets [{start}, {end}] end before they start"
        )));
    }
    let expected = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .and_then(|n| n.checked_mul(dtype.size()))
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    if end - start != expected {
        return Err(bad(format!(
            "data_offsets [{start}, {end}] span {} bytes but {dtype} {shape:?} needs {expected}",
            end - start
        )));
    }
    for (k, _) in obj {
        if !matches!(k.as_str(), "dtype" | "shape" | "data_offsets") {
            return Err(bad(format!("unexpected key `{k}` in header entry")));
        }
    }
    Ok(TensorInfo {
        name: name.to_string(),
        dtype,
        shape,
        data_offsets: (start, end),
    })
}

/// One tensor to be written: name, dtype and shape (its data comes from the fill callback).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorEntry {
    /// Bytes of data this tensor occupies.
    pub fn byte_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// Deterministic safetensors writer. Tensors are laid out in the order given; the header is
/// compact JSON (`__metadata__` first when set, then tensors in data order) padded with spaces
/// to a multiple of 8 bytes, exactly as the reference `safetensors` serializer does.
///
/// The writer is ours, not the crate's serializer: that one lays tensors out by descending
/// dtype alignment, then name, where callers here fix the order (shard and sidecar layouts
/// that other files' byte offsets refer to), and it takes each tensor's bytes from a view in
/// memory, where this one streams them from a callback.
#[derive(Clone, Debug, Default)]
pub struct SafetensorsWriter {
    entries: Vec<TensorEntry>,
    metadata: Vec<(String, String)>,
}

impl SafetensorsWriter {
    /// A writer for `entries`, laid out in this order.
    pub fn new(entries: Vec<TensorEntry>) -> Self {
        SafetensorsWriter {
            entries,
            metadata: Vec::new(),
        }
    }

    /// Add a `__metadata__` string entry (e.g. `format` = `pt`).
    pub fn with_metadata(mut self, key: &str, value: &str) -> Self {
        self.metadata.push((key.to_string(), value.to_string()));
        self
    }

    /// The entries, in layout order.
    pub fn entries(&self) -> &[TensorEntry] {
        &self.entries
    }

    /// The padded JSON header (without the 8-byte length prefix).
    pub fn header(&self) -> Vec<u8> {
        let mut map = Map::new();
        if !self.metadata.is_empty() {
            let m: Map<String, Value> = self
                .metadata
                .iter()
                .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                .collect();
            map.insert("__metadata__".into(), Value::Object(m));
        }
        let mut offset = 0usize;
        for e in &self.entries {
            let n = e.byte_len();
            let mut t = Map::new();
            t.insert("dtype".into(), Value::String(e.dtype.as_str().into()));
            t.insert("shape".into(), Value::from(e.shape.clone()));
            t.insert("data_offsets".into(), Value::from(vec![offset, offset + n]));
            map.insert(e.name.clone(), Value::Object(t));
            offset += n;
        }
        let mut h = Value::Object(map).to_string().into_bytes();
        let pad = (8 - h.len() % 8) % 8;
        h.extend(std::iter::repeat_n(b' ', pad));
        h
    }

    /// Total file size that [`write`](Self::write) produces.
    pub fn file_size(&self) -> u64 {
        8 + self.header().len() as u64 + self.data_size()
    }

    /// Size of the data section.
    pub fn data_size(&self) -> u64 {
        self.entries.iter().map(|e| e.byte_len() as u64).sum()
    }

    /// Write the file. `fill(i, entry, out)` must write exactly `entry.byte_len()` bytes of
    /// tensor `i` to `out`; data is streamed, never collected. Returns the file size.
    pub fn write<F>(&self, path: impl AsRef<Path>, mut fill: F) -> Result<u64, TensorError>
    where
        F: FnMut(usize, &TensorEntry, &mut dyn Write) -> io::Result<()>,
    {
        let path = path.as_ref();
        let io_err = |source| TensorError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::create(path).map_err(io_err)?;
        let mut out = BufWriter::with_capacity(1 << 22, file);
        let header = self.header();
        out.write_all(&(header.len() as u64).to_le_bytes())
            .map_err(io_err)?;
        out.write_all(&header).map_err(io_err)?;
        let mut total = 8 + header.len() as u64;
        for (i, e) in self.entries.iter().enumerate() {
            let mut counted = CountingWriter {
                inner: &mut out,
                written: 0,
            };
            fill(i, e, &mut counted).map_err(io_err)?;
            if counted.written != e.byte_len() as u64 {
                return Err(TensorError::format(
                    path,
                    format!(
                        "writer: tensor `{}` got {} bytes, expected {}",
                        e.name,
                        counted.written,
                        e.byte_len()
                    ),
                ));
            }
            total += counted.written;
        }
        out.flush().map_err(io_err)?;
        Ok(total)
    }
}

struct CountingWriter<'a> {
    inner: &'a mut dyn Write,
    written: u64,
}

impl Write for CountingWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn image(header: &str, data: &[u8]) -> Bytes {
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(header.as_bytes());
        v.extend_from_slice(data);
        Bytes::from_vec(v)
    }

    fn err(header: &str, data: &[u8]) -> String {
        SafetensorsFile::from_bytes("x.safetensors", image(header, data))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn roundtrip_writer_reader() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.safetensors");
        let w = SafetensorsWriter::new(vec![
            TensorEntry {
                name: "b.f32".into(),
                dtype: DType::F32,
                shape: vec![3],
            },
            TensorEntry {
                name: "a.bf16".into(),
                dtype: DType::BF16,
                shape: vec![2, 1],
            },
            TensorEntry {
                name: "c.u8".into(),
                dtype: DType::U8,
                shape: vec![5],
            },
        ])
        .with_metadata("format", "pt");
        let size = w
            .write(&p, |i, e, out| {
                out.write_all(&vec![i as u8 + 1; e.byte_len()])
            })
            .unwrap();
        assert_eq!(size, std::fs::metadata(&p).unwrap().len());
        assert_eq!(size, w.file_size());
        let f = SafetensorsFile::open(&p).unwrap();
        assert_eq!(f.data_start() % 8, 0);
        let names: Vec<_> = f.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["b.f32", "a.bf16", "c.u8"]);
        assert_eq!(f.bytes("a.bf16").unwrap().as_slice(), &[2, 2, 2, 2]);
        assert_eq!(f.bytes("c.u8").unwrap().as_slice(), &[3; 5]);
        assert_eq!(f.info("b.f32").unwrap().data_offsets, (0, 12));
        assert_eq!(
            f.absolute_range("c.u8").unwrap(),
            (f.data_start() as u64 + 16, 5)
        );
        assert_eq!(f.metadata().unwrap()["format"], "pt");
        assert!(f.bytes("nope").unwrap_err().to_string().contains("`nope`"));
        let header = std::fs::read(&p).unwrap();
        let text = std::str::from_utf8(&header[8..f.data_start()]).unwrap();
        assert!(text.starts_with(
            r#"{"__metadata__":{"format":"pt"},"b.f32":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}"#
        ));
    }

    #[test]
    fn writer_checks_byte_count() {
        let dir = tempfile::tempdir().unwrap();
        let w = SafetensorsWriter::new(vec![TensorEntry {
            name: "t".into(),
            dtype: DType::F32,
            shape: vec![2],
        }]);
        let e = w
            .write(dir.path().join("x"), |_, _, out| out.write_all(&[0; 7]))
            .unwrap_err();
        assert!(e.to_string().contains("`t` got 7 bytes, expected 8"), "{e}");
    }

    /// `header`, followed by `len` zero bytes of data, is refused with an error that contains
    /// `want`.
    fn refused(header: &str, len: usize, want: &str) {
        let e = err(header, &vec![0; len]);
        assert!(e.contains(want), "{header}: {e}");
    }

    /// The error of a file whose 8-byte length prefix says `header_len`, followed by `rest`.
    fn prefix_err(header_len: u64, rest: &[u8]) -> String {
        let mut v = header_len.to_le_bytes().to_vec();
        v.extend_from_slice(rest);
        SafetensorsFile::from_bytes("x", Bytes::from_vec(v))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn malformed_headers() {
        let ok = r#"{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        assert!(SafetensorsFile::from_bytes("x", image(ok, &[0; 8])).is_ok());
        refused(ok, 7, "truncated: tensor `t`");
        refused("{nope", 0, "not valid JSON");
        refused("[1]", 0, "not a JSON object");
        // The valid header with one field of the entry changed (null: removed).
        for (key, value, want) in [
            ("dtype", json!("Q9"), "unknown dtype \"Q9\""),
            ("shape", json!([3]), "needs 12"),
            ("shape", Value::Null, "missing `shape`"),
            ("data_offsets", Value::Null, "missing `data_offsets`"),
            ("shape", json!([-2]), "not a non-negative integer"),
            ("data_offsets", json!([8, 0]), "end before"),
            (
                "x",
                json!(1),
                "tensor `t`: unexpected key `x` in header entry",
            ),
        ] {
            let mut header: Value = serde_json::from_str(ok).unwrap();
            let t = header["t"].as_object_mut().unwrap();
            match value {
                Value::Null => t.remove(key),
                value => t.insert(key.into(), value),
            };
            refused(&header.to_string(), 8, want);
        }
        refused(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
            12,
            "overlap",
        );
        refused(r#"{"__metadata__":3}"#, 0, "__metadata__");
        // Header length pointing past the end of the file.
        let e = prefix_err(100, b"{}");
        assert!(e.contains("runs past the end"), "{e}");
        let e = SafetensorsFile::from_bytes("short.st", Bytes::from_vec(vec![1, 2])).unwrap_err();
        assert!(e.to_string().contains("short.st"), "{e}");
        // Invalid UTF-8.
        let e = prefix_err(2, &[0xff, 0xfe]);
        assert!(e.contains("UTF-8"), "{e}");
    }

    #[test]
    fn checks_on_top_of_the_crate_and_what_it_refuses_but_we_accept() {
        // The crate ignores unknown keys (see `malformed_headers`) and knows dtypes we do not.
        refused(
            r#"{"t":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}}"#,
            2,
            "tensor `t`: unknown dtype \"F8_E4M3\"",
        );
        let e = prefix_err(MAX_HEADER_BYTES + 1, b"{}");
        assert!(e.contains("exceeds the 100000000-byte limit"), "{e}");
        // A hole between tensors, bytes after the last one, non-string metadata: accepted.
        let hole = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}"#;
        let f = SafetensorsFile::from_bytes("x", image(hole, &[1, 2, 0, 0, 3, 4, 9])).unwrap();
        assert_eq!(f.bytes("b").unwrap().as_slice(), &[3, 4]);
        let names: Vec<_> = f.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        let meta =
            r#"{"__metadata__":{"n":3},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
        let f = SafetensorsFile::from_bytes("x", image(meta, &[7])).unwrap();
        assert_eq!(f.metadata().unwrap()["n"], 3);
        // The crate's path: tensors in offset order whatever the header order.
        let rev = r#"{"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
        let f = SafetensorsFile::from_bytes("x", image(rev, &[5, 6])).unwrap();
        let names: Vec<_> = f.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(f.data_start(), 8 + rev.len());
    }

    #[test]
    fn open_reports_missing_and_tiny_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("gone.safetensors");
        assert!(
            SafetensorsFile::open(&p)
                .unwrap_err()
                .to_string()
                .contains("gone.safetensors")
        );
        std::fs::write(&p, b"").unwrap();
        assert!(
            SafetensorsFile::open(&p)
                .unwrap_err()
                .to_string()
                .contains("too short")
        );
    }
}
