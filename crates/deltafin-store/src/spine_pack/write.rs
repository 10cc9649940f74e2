//! Writing one DFSP pack: the tensors' sources, the payload plan, and the streamed write
//! (`<pack>.part`, hashed as written, renamed into place).

use super::format::*;
use crate::checkpoint::Checkpoint;
use crate::inventory::{TensorKind, TensorSpec, text_inventory};
use crate::spine_int8::{Int8Spine, SpineFormat};
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

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
pub(super) fn spine_specs(ckpt: &Checkpoint) -> Vec<TensorSpec> {
    text_inventory(ckpt.config())
        .into_iter()
        .filter(|s| matches!(s.kind, TensorKind::Spine { .. }))
        .collect()
}

pub(super) fn sources_of(
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
pub(super) type Offsets = (u64, Option<u64>);

/// Payload offsets of every component (codes, then scales, then raw tensors) and the
/// payload length.
pub(super) fn plan(sources: &[PackSource]) -> Result<(Vec<Offsets>, u64), PackError> {
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
pub(super) struct PayloadWriter<'a> {
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

/// What a pack write produced.
#[derive(Clone, Debug)]
pub struct WrittenPack {
    pub path: PathBuf,
    pub tensors: usize,
    /// Source bytes streamed and the file's length.
    pub source_bytes: u64,
    pub file_bytes: u64,
}

/// `path.part`: where a pack is written before it is renamed into place.
fn part_of(path: &Path) -> PathBuf {
    let mut part = path.as_os_str().to_owned();
    part.push(".part");
    PathBuf::from(part)
}

/// Write the pack of `sources` to `path` (through `path.part`, synced, renamed into place).
/// `progress` receives the source bytes written since its last call. A write that fails (a
/// full disk) removes its `.part`, which would only hold on to the space.
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
    let written = write_pack_part(
        path, format, id, layers, model, sources, chunk_size, progress,
    );
    if written.is_err() {
        let _ = std::fs::remove_file(part_of(path));
    }
    written
}

#[allow(clippy::too_many_arguments)]
fn write_pack_part(
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
    let part = part_of(path);
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
