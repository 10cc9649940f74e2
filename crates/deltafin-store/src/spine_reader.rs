//! The read side of spine streaming: where a streamed layer's spine matrices lie on disk
//! ([`SpineLocator`]: the shards, the int8 spine's files or DFSP packs), the aligned reads
//! that cover them ([`plan_reads`]), and a background reader ([`SpineReader`]) that fills one
//! pooled, page-aligned buffer per requested layer with explicit positional reads (O_DIRECT
//! where the filesystem allows it, `deltafin_experts::io`), never by faulting an mmap.
//!
//! What the bytes mean is the model's business: `deltafin_k3::weights::spine_stream` plans
//! which matrices of a layer are streamed, asks for layer `l + 1` while `l` computes, and
//! builds the layer's weights as views of the returned buffer, which goes back to the pool
//! when the last view is dropped.

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::spine_int8::TensorFiles;
use crate::spine_pack::{Codec, PackSet, SpinePack, TensorEntry};
use deltafin_experts::buffer::ExpertBuffer;
use deltafin_experts::io::{IoPath, SourceFile};
use deltafin_experts::layout::{ALIGN, Region};
use deltafin_experts::stream::DirectIo;
use deltafin_tensor::Bytes;
use deltafin_tensor::storage::ByteOwner;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Largest single read handed to one reader thread (a layer's contiguous run is split).
const READ_CHUNK: u64 = 4 << 20;

/// Spine-streaming settings (`K3_SPINE_READ_THREADS`, `K3_SPINE_STREAM_NOCACHE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpineStreamOptions {
    /// Reader threads per layer read (1–16).
    pub read_threads: usize,
    /// O_DIRECT policy of the spine reads.
    pub direct_io: DirectIo,
}

impl Default for SpineStreamOptions {
    fn default() -> Self {
        SpineStreamOptions {
            read_threads: 4,
            direct_io: DirectIo::Auto,
        }
    }
}

/// Where one spine byte range lives on disk: a file (an index into [`SpineFiles`]), an
/// offset and a length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub file: usize,
    pub offset: u64,
    pub len: u64,
}

/// Where a streamed matrix's bytes are: a bf16 matrix is one piece, a row-int8 matrix its
/// data and its scales.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Located {
    Bf16 { data: Piece },
    RowInt8 { data: Piece, scales: Piece },
}

/// The files the pieces of a streamed spine point into, each listed once.
#[derive(Clone, Debug, Default)]
pub struct SpineFiles {
    paths: Vec<PathBuf>,
}

impl SpineFiles {
    /// The index of `path`, added if new.
    pub fn index(&mut self, path: &Path) -> usize {
        match self.paths.iter().position(|p| p == path) {
            Some(i) => i,
            None => {
                self.paths.push(path.to_path_buf());
                self.paths.len() - 1
            }
        }
    }
}

fn io_err(path: &Path, what: &str, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::File {
        path: path.to_path_buf(),
        message: format!("{what}: {e}"),
    }
}

/// A tensor's pack and its entry there.
type PackEntry<'p> = (&'p SpinePack, &'p TensorEntry);

/// Where the loaded spine's matrices come from on disk.
pub struct SpineLocator<'a> {
    pub ckpt: &'a Checkpoint,
    /// The int8 spine's files are under this root (`--spine int8` without packs).
    pub int8_root: Option<&'a Path>,
    pub packs: Option<&'a PackSet>,
}

impl SpineLocator<'_> {
    /// The on-disk pieces of the matrix `full` (full tensor name), loaded as row-int8
    /// (`int8`) or bf16. With packs, the pack's codec decides.
    pub fn locate(
        &self,
        files: &mut SpineFiles,
        full: &str,
        int8: bool,
    ) -> Result<Located, CheckpointError> {
        if let Some(set) = self.packs {
            let (pack, entry) = Self::pack_entry(set, full)?;
            let file = files.index(pack.path());
            let piece = |c: &crate::spine_pack::Component| {
                let (offset, len) = pack.component_file_range(c);
                Piece { file, offset, len }
            };
            return Ok(match (entry.codec, entry.scales.as_ref()) {
                (Codec::RowI8F16Scale, Some(sc)) => Located::RowInt8 {
                    data: piece(&entry.data),
                    scales: piece(sc),
                },
                _ => Located::Bf16 {
                    data: piece(&entry.data),
                },
            });
        }
        match (int8, self.int8_root) {
            (true, Some(root)) => {
                let tf = TensorFiles::new(root, full);
                let len = |p: &Path| {
                    std::fs::metadata(p)
                        .map(|md| md.len())
                        .map_err(|e| io_err(p, "int8 spine file", e))
                };
                let (dl, sl) = (len(&tf.i8)?, len(&tf.sc)?);
                Ok(Located::RowInt8 {
                    data: Piece {
                        file: files.index(&tf.i8),
                        offset: 0,
                        len: dl,
                    },
                    scales: Piece {
                        file: files.index(&tf.sc),
                        offset: 0,
                        len: sl,
                    },
                })
            }
            (false, _) => self.bf16(files, full).map(|data| Located::Bf16 { data }),
            (true, None) => Err(CheckpointError::Request {
                name: full.to_string(),
                message: "row-int8 matrix without an int8 spine or packs to stream it from".into(),
            }),
        }
    }

    /// The piece of the bf16 tensor `full` (a pack's data component with packs).
    pub fn bf16(&self, files: &mut SpineFiles, full: &str) -> Result<Piece, CheckpointError> {
        if let Some(set) = self.packs {
            let (pack, entry) = Self::pack_entry(set, full)?;
            let (offset, len) = pack.component_file_range(&entry.data);
            return Ok(Piece {
                file: files.index(pack.path()),
                offset,
                len,
            });
        }
        let (path, offset, len) = self.ckpt.tensor_file_range(full)?;
        Ok(Piece {
            file: files.index(&path),
            offset,
            len,
        })
    }

    fn pack_entry<'p>(set: &'p PackSet, full: &str) -> Result<PackEntry<'p>, CheckpointError> {
        let pack = set.pack_of(full).ok_or_else(|| CheckpointError::Request {
            name: full.to_string(),
            message: "not in the loaded spine packs".into(),
        })?;
        let entry = pack.get(full).ok_or_else(|| CheckpointError::Request {
            name: full.to_string(),
            message: format!("not in {}", pack.path().display()),
        })?;
        Ok((pack, entry))
    }
}

/// The aligned reads of one streamed layer and where each piece lands in its buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerReads {
    /// (file, region) reads, sorted by file and offset, adjacent ones merged, long ones
    /// split so that several reader threads share one contiguous layer.
    pub regions: Vec<(usize, Region)>,
    /// Buffer offset of every piece, in the order the pieces were given.
    pub piece_at: Vec<u64>,
    /// The buffer length the reads need.
    pub buf_len: u64,
}

/// Aligned reads covering `pieces` and the buffer offset of each piece.
pub fn plan_reads(pieces: &[Piece]) -> LayerReads {
    let mut order: Vec<usize> = (0..pieces.len()).collect();
    order.sort_by_key(|&i| (pieces[i].file, pieces[i].offset));
    let mut regions: Vec<(usize, Region)> = Vec::new();
    let mut at = vec![0u64; pieces.len()];
    let mut buf_end = 0u64;
    for i in order {
        let p = &pieces[i];
        let start = p.offset / ALIGN * ALIGN;
        let end = (p.offset + p.len).div_ceil(ALIGN) * ALIGN;
        if let Some((f, r)) = regions.last_mut()
            && *f == p.file
            && start <= r.file_offset + r.len
        {
            let new_end = end.max(r.file_offset + r.len);
            buf_end += new_end - (r.file_offset + r.len);
            r.len = new_end - r.file_offset;
            r.need_to = r.need_to.max(p.offset + p.len - r.file_offset);
            at[i] = r.buf_offset + (p.offset - r.file_offset);
            continue;
        }
        regions.push((
            p.file,
            Region {
                file_offset: start,
                len: end - start,
                buf_offset: buf_end,
                need_to: p.offset + p.len - start,
            },
        ));
        at[i] = buf_end + (p.offset - start);
        buf_end += end - start;
    }
    let mut split = Vec::new();
    for (f, r) in regions {
        let mut off = 0u64;
        while off < r.len {
            let len = READ_CHUNK.min(r.len - off);
            let need_to = r.need_to.saturating_sub(off).min(len);
            if need_to == 0 {
                break;
            }
            split.push((
                f,
                Region {
                    file_offset: r.file_offset + off,
                    len,
                    buf_offset: r.buf_offset + off,
                    need_to,
                },
            ));
            off += len;
        }
    }
    LayerReads {
        regions: split,
        piece_at: at,
        buf_len: buf_end,
    }
}

/// An aligned buffer that returns to its pool when the last view of it is dropped.
struct PooledBuffer {
    buf: Option<ExpertBuffer>,
    pool: Arc<Mutex<Vec<ExpertBuffer>>>,
}

impl ByteOwner for PooledBuffer {
    fn bytes(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], |b| b.bytes())
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let (Some(b), Ok(mut pool)) = (self.buf.take(), self.pool.lock()) {
            pool.push(b);
        }
    }
}

/// Read counters of a [`SpineReader`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReadCounters {
    /// Layers read.
    pub layer_reads: u64,
    /// Bytes read from disk.
    pub bytes_read: u64,
    /// Time spent reading.
    pub read_seconds: f64,
}

/// Shared by the requesting thread and the reader.
struct Shared {
    files: Vec<SourceFile>,
    /// The reads of each layer (`None`: not streamed).
    layers: Vec<Option<Vec<(usize, Region)>>>,
    pool: Arc<Mutex<Vec<ExpertBuffer>>>,
    buf_len: u64,
    threads: usize,
    bytes_read: AtomicU64,
    layer_reads: AtomicU64,
    read_nanos: AtomicU64,
}

/// A layer read's answer: the layer and its buffer, or why the read failed.
pub type Reply = (usize, Result<Bytes, String>);

/// A background thread that reads whole layers into pooled buffers, in the order asked.
pub struct SpineReader {
    shared: Arc<Shared>,
    requests: Mutex<Option<Sender<usize>>>,
    replies: Mutex<Receiver<Reply>>,
    worker: Option<std::thread::JoinHandle<()>>,
    io: String,
}

impl std::fmt::Debug for SpineReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpineReader").field("io", &self.io).finish()
    }
}

impl SpineReader {
    /// Open `files` and start the reader for `layers` (each streamed layer's reads, from
    /// [`plan_reads`]).
    pub fn start(
        files: &SpineFiles,
        layers: Vec<Option<Vec<(usize, Region)>>>,
        buf_len: u64,
        opts: SpineStreamOptions,
    ) -> Result<SpineReader, CheckpointError> {
        let files = files
            .paths
            .iter()
            .map(|p| SourceFile::open(p, opts.direct_io).map_err(|e| io_err(p, "open", e)))
            .collect::<Result<Vec<_>, _>>()?;
        let io = match files.first().map(|f| f.io_path()) {
            Some((IoPath::Direct, _)) => "direct".to_string(),
            Some((_, why)) => format!("buffered ({})", why.unwrap_or_default()),
            None => "none".to_string(),
        };
        let shared = Arc::new(Shared {
            files,
            layers,
            pool: Arc::new(Mutex::new(Vec::new())),
            buf_len,
            threads: opts.read_threads.clamp(1, 16),
            bytes_read: AtomicU64::new(0),
            layer_reads: AtomicU64::new(0),
            read_nanos: AtomicU64::new(0),
        });
        let (req_tx, req_rx) = channel::<usize>();
        let (rep_tx, rep_rx) = channel::<Reply>();
        let worker_shared = shared.clone();
        let worker = std::thread::Builder::new()
            .name("deltafin-spine-reader".into())
            .spawn(move || {
                for l in req_rx {
                    if rep_tx.send((l, worker_shared.read_layer(l))).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| CheckpointError::Request {
                name: "spine streaming".into(),
                message: format!("cannot start the reader thread: {e}"),
            })?;
        Ok(SpineReader {
            shared,
            requests: Mutex::new(Some(req_tx)),
            replies: Mutex::new(rep_rx),
            worker: Some(worker),
            io,
        })
    }

    /// How the files are read: `direct`, or `buffered (why)`.
    pub fn io(&self) -> &str {
        &self.io
    }

    /// The number of layers the reader was planned for (streamed or not).
    pub fn layers(&self) -> usize {
        self.shared.layers.len()
    }

    /// One piece read whole into an owned buffer (a streamed layer's router, read once).
    pub fn read_owned(&self, piece: &Piece) -> Result<Vec<u8>, CheckpointError> {
        use std::os::unix::fs::FileExt;
        let file = self
            .shared
            .files
            .get(piece.file)
            .ok_or_else(|| CheckpointError::Request {
                name: "spine streaming".into(),
                message: format!("no file {} in the streamed spine's files", piece.file),
            })?;
        let mut v = vec![0u8; piece.len as usize];
        std::fs::File::open(file.path())
            .and_then(|f| f.read_exact_at(&mut v, piece.offset))
            .map_err(|e| io_err(file.path(), "reading a router", e))?;
        Ok(v)
    }

    /// Ask for layer `l` (answers come back in the order asked, [`SpineReader::recv`]).
    pub fn request(&self, l: usize) -> Result<(), String> {
        let gone = || "the spine reader thread is gone".to_string();
        let guard = self.requests.lock().map_err(|_| gone())?;
        guard.as_ref().ok_or_else(gone)?.send(l).map_err(|_| gone())
    }

    /// The next answer.
    pub fn recv(&self) -> Result<Reply, String> {
        let rx = self
            .replies
            .lock()
            .map_err(|_| "spine reply channel poisoned".to_string())?;
        rx.recv()
            .map_err(|_| "the spine reader thread is gone".to_string())
    }

    /// Counters so far.
    pub fn counters(&self) -> ReadCounters {
        let s = &self.shared;
        ReadCounters {
            layer_reads: s.layer_reads.load(Ordering::Relaxed),
            bytes_read: s.bytes_read.load(Ordering::Relaxed),
            read_seconds: s.read_nanos.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }
}

impl Drop for SpineReader {
    fn drop(&mut self) {
        if let Ok(mut g) = self.requests.lock() {
            g.take();
        }
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl Shared {
    /// Read layer `l` into a pooled buffer.
    fn read_layer(&self, l: usize) -> Result<Bytes, String> {
        let reads = self
            .layers
            .get(l)
            .and_then(|p| p.as_ref())
            .ok_or_else(|| format!("layer {l} is not streamed"))?;
        let mut buf = self
            .pool
            .lock()
            .map_err(|_| "spine buffer pool poisoned".to_string())?
            .pop()
            .unwrap_or_else(|| ExpertBuffer::new(self.buf_len));
        let t0 = Instant::now();
        {
            let mut rest: &mut [u8] = buf.as_mut_bytes();
            let mut consumed = 0u64;
            let mut jobs: Vec<(&SourceFile, &Region, &mut [u8])> = Vec::new();
            for (f, r) in reads {
                let skip = (r.buf_offset - consumed) as usize;
                let (_, tail) = rest.split_at_mut(skip);
                let (mine, tail) = tail.split_at_mut(r.len as usize);
                rest = tail;
                consumed = r.buf_offset + r.len;
                jobs.push((&self.files[*f], r, mine));
            }
            let threads = self.threads.clamp(1, jobs.len().max(1));
            let mut lanes: Vec<Vec<(&SourceFile, &Region, &mut [u8])>> =
                (0..threads).map(|_| Vec::new()).collect();
            for (i, j) in jobs.into_iter().enumerate() {
                lanes[i % threads].push(j);
            }
            let results: Vec<Result<u64, String>> = std::thread::scope(|s| {
                let handles: Vec<_> = lanes
                    .into_iter()
                    .map(|lane| {
                        s.spawn(move || {
                            let mut n = 0u64;
                            for (file, r, dst) in lane {
                                let (_, got) = file.read_region(r, dst).map_err(|e| {
                                    format!(
                                        "reading {} bytes at offset {} of {}: {e}",
                                        r.len,
                                        r.file_offset,
                                        file.path().display()
                                    )
                                })?;
                                n += got;
                            }
                            Ok(n)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err("a spine reader thread panicked".into()))
                    })
                    .collect()
            });
            let mut total = 0u64;
            for r in results {
                total += r?;
            }
            self.bytes_read.fetch_add(total, Ordering::Relaxed);
        }
        self.read_nanos
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.layer_reads.fetch_add(1, Ordering::Relaxed);
        Ok(Bytes::from_owner(Arc::new(PooledBuffer {
            buf: Some(buf),
            pool: self.pool.clone(),
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_aligned_merged_and_split() {
        let pieces = vec![
            Piece {
                file: 0,
                offset: 100,
                len: 5000,
            },
            Piece {
                file: 0,
                offset: 5100,
                len: 10,
            },
            Piece {
                file: 1,
                offset: 8192,
                len: 9 << 20,
            },
        ];
        let LayerReads {
            regions,
            piece_at: at,
            buf_len,
        } = plan_reads(&pieces);
        // File 0: one merged region [0, 8192); file 1: 9 MiB split into 4 MiB reads.
        assert_eq!(regions[0].1.file_offset, 0);
        assert_eq!(regions[0].1.len, 8192);
        assert_eq!(regions[0].1.need_to, 5110);
        assert_eq!(at[0], 100);
        assert_eq!(at[1], 5100);
        assert_eq!(at[2], 8192);
        assert_eq!(regions.len(), 1 + 3);
        assert!(regions.iter().all(|(_, r)| r.file_offset % ALIGN == 0
            && r.buf_offset % ALIGN == 0
            && r.len % ALIGN == 0));
        assert_eq!(buf_len, 8192 + (9 << 20));
        assert_eq!(regions[3].1.need_to, 1 << 20);
    }
}
