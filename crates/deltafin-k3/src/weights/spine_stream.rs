//! Spine streaming: when the spine does not fit the memory budget, a prefix of layers stays
//! resident and the remaining layers' spine matrices are read per forward pass with explicit
//! positional reads (O_DIRECT where the filesystem allows it, `deltafin_experts::io`), into
//! page-aligned buffers that are reused, never by faulting the mmap.
//!
//! While layer `l` computes, a background reader fills the buffer of the next streamed layer
//! (prefetch); a layer's buffer goes back to the pool when its pass is done with it. The
//! small tensors of a streamed layer (norms, conv taps, biases, the router) stay resident:
//! the vectors are widened to f32 at load anyway, and the router is read once into an owned
//! buffer (it also feeds the previous layer's PILOT guess).

use crate::error::ModelError;
use crate::model::K3Model;
use crate::model::layer::{Ffn, Layer};
use crate::model::linear::Linear;
use crate::model::spine::{SpineLayers, StreamedSpine};
use crate::weights::checkpoint::{Checkpoint, CheckpointError};

pub use crate::model::layer::linears_mut;
use crate::weights::spine_int8::TensorFiles;
use crate::weights::spine_pack::{Codec, PackSet};
use deltafin_experts::buffer::ExpertBuffer;
use deltafin_experts::io::SourceFile;
use deltafin_experts::layout::{ALIGN, Region};
use deltafin_experts::stream::DirectIo;
use deltafin_tensor::storage::ByteOwner;
use deltafin_tensor::{Bf16Matrix, Bytes, RowInt8Matrix};
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

/// Where one spine byte range lives on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Piece {
    file: usize,
    offset: u64,
    len: u64,
}

/// How one streamed matrix is rebuilt from the layer buffer.
#[derive(Clone, Debug)]
enum MatrixPlan {
    Bf16 {
        data: Piece,
        rows: usize,
        cols: usize,
    },
    RowInt8 {
        data: Piece,
        scales: Piece,
        rows: usize,
        cols: usize,
    },
}

/// The reads of one streamed layer and where each piece lands in its buffer.
#[derive(Clone, Debug)]
struct LayerPlan {
    /// Matrix name (relative to `model.layers.{l}.`) and its plan, in [`linears_mut`] order.
    matrices: Vec<(String, MatrixPlan)>,
    regions: Vec<(usize, Region)>,
    /// Buffer offset of every piece, in plan order (data, then scales for int8).
    piece_at: Vec<u64>,
    buf_len: u64,
    /// Payload bytes of the layer's matrices.
    bytes: u64,
}

/// Counters of spine streaming (for `--stats`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpineStreamStats {
    /// Forward passes that streamed at least one layer.
    pub passes: u64,
    /// Layer reads and the bytes transferred.
    pub layer_reads: u64,
    pub bytes_read: u64,
    /// Seconds the reader spent reading, and the model spent waiting for a layer.
    pub read_seconds: f64,
    pub wait_seconds: f64,
}

impl SpineStreamStats {
    /// Read throughput in GB/s (bytes ÷ reading time).
    pub fn read_gbps(&self) -> f64 {
        if self.read_seconds > 0.0 {
            self.bytes_read as f64 / self.read_seconds / 1e9
        } else {
            0.0
        }
    }
}

/// The split between resident and streamed layers (for the startup line).
#[derive(Clone, Debug, PartialEq)]
pub struct SpineSplit {
    /// Layers `0..resident` are resident, `resident..layers` are streamed.
    pub resident: usize,
    pub layers: usize,
    /// Matrix bytes read per forward pass (every streamed layer once).
    pub bytes_per_pass: u64,
    /// Largest streamed layer's buffer (two are live: current + prefetch).
    pub max_layer_buffer: u64,
    /// How the reads are served (`direct` or `buffered: why`).
    pub io: String,
    /// Reader threads per streamed layer (`SpineStreamOptions::read_threads`).
    pub read_threads: usize,
}

impl SpineSplit {
    /// `"spine: 12 of 24 layers resident, 12 streamed (0.123 GB read per pass, …)"`.
    pub fn describe(&self) -> String {
        format!(
            "spine: {} of {} layers resident, {} streamed ({:.3} GB read per forward pass, 2 × {:.3} GB reusable buffers, io={}, read_threads={})",
            self.resident,
            self.layers,
            self.layers - self.resident,
            self.bytes_per_pass as f64 / 1e9,
            self.max_layer_buffer as f64 / 1e9,
            self.io,
            self.read_threads
        )
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

/// Shared by the model thread and the reader.
struct Shared {
    files: Vec<SourceFile>,
    plans: Vec<Option<LayerPlan>>,
    pool: Arc<Mutex<Vec<ExpertBuffer>>>,
    buf_len: u64,
    threads: usize,
    bytes_read: AtomicU64,
    layer_reads: AtomicU64,
    read_nanos: AtomicU64,
    wait_nanos: AtomicU64,
    passes: AtomicU64,
}

type Reply = (usize, Result<Bytes, String>);

/// Streams the spine matrices of layers `resident..layers`.
pub struct SpineStreamer {
    shared: Arc<Shared>,
    resident: usize,
    requests: Mutex<Option<Sender<usize>>>,
    replies: Mutex<Receiver<Reply>>,
    worker: Option<std::thread::JoinHandle<()>>,
    split: SpineSplit,
    /// One pass at a time (the reader serves layers in order).
    pass_lock: Mutex<()>,
}

impl std::fmt::Debug for SpineStreamer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpineStreamer")
            .field("split", &self.split)
            .finish()
    }
}

/// Payload bytes of a layer's spine projections (what streaming it reads per pass).
pub fn layer_matrix_bytes(layer: &Layer) -> u64 {
    let mut l = layer.clone();
    linears_mut(&mut l)
        .into_iter()
        .map(|(_, m)| match m.host() {
            Linear::RowInt8(q) => (q.data_bytes().len() + q.scale_bytes().len()) as u64,
            Linear::Bf16(b) => b.bytes().len() as u64,
            Linear::Device(_) => unreachable!("host() never returns Linear::Device"),
        })
        .sum()
}

/// Where the loaded spine's matrices come from on disk.
pub struct SpineSources<'a> {
    pub ckpt: &'a Checkpoint,
    /// The int8 spine's files are under this root (`--spine int8` without packs).
    pub int8_root: Option<&'a Path>,
    pub packs: Option<&'a PackSet>,
}

fn io_err(path: &Path, what: &str, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::File {
        path: path.to_path_buf(),
        message: format!("{what}: {e}"),
    }
}

impl SpineSources<'_> {
    fn file_index(files: &mut Vec<PathBuf>, path: &Path) -> usize {
        match files.iter().position(|p| p == path) {
            Some(i) => i,
            None => {
                files.push(path.to_path_buf());
                files.len() - 1
            }
        }
    }

    /// The on-disk pieces of the matrix `full` (full tensor name) as loaded in `m`.
    fn locate(
        &self,
        files: &mut Vec<PathBuf>,
        full: &str,
        m: &Linear,
    ) -> Result<MatrixPlan, CheckpointError> {
        let (rows, cols) = (m.rows(), m.cols());
        if let Some(set) = self.packs {
            let pack = set.pack_of(full).ok_or_else(|| CheckpointError::Request {
                name: full.to_string(),
                message: "not in the loaded spine packs".into(),
            })?;
            let entry = pack.get(full).ok_or_else(|| CheckpointError::Request {
                name: full.to_string(),
                message: format!("not in {}", pack.path().display()),
            })?;
            let file = Self::file_index(files, pack.path());
            let piece = |c: &crate::weights::spine_pack::Component| {
                let (offset, len) = pack.component_file_range(c);
                Piece { file, offset, len }
            };
            return Ok(match (entry.codec, entry.scales.as_ref()) {
                (Codec::RowI8F16Scale, Some(sc)) => MatrixPlan::RowInt8 {
                    data: piece(&entry.data),
                    scales: piece(sc),
                    rows,
                    cols,
                },
                _ => MatrixPlan::Bf16 {
                    data: piece(&entry.data),
                    rows,
                    cols,
                },
            });
        }
        match (m.host(), self.int8_root) {
            (Linear::RowInt8(_), Some(root)) => {
                let tf = TensorFiles::new(root, full);
                let len = |p: &Path| {
                    std::fs::metadata(p)
                        .map(|md| md.len())
                        .map_err(|e| io_err(p, "int8 spine file", e))
                };
                let (dl, sl) = (len(&tf.i8)?, len(&tf.sc)?);
                Ok(MatrixPlan::RowInt8 {
                    data: Piece {
                        file: Self::file_index(files, &tf.i8),
                        offset: 0,
                        len: dl,
                    },
                    scales: Piece {
                        file: Self::file_index(files, &tf.sc),
                        offset: 0,
                        len: sl,
                    },
                    rows,
                    cols,
                })
            }
            (Linear::Bf16(_), _) => {
                let (path, offset, len) = self.ckpt.tensor_file_range(full)?;
                Ok(MatrixPlan::Bf16 {
                    data: Piece {
                        file: Self::file_index(files, &path),
                        offset,
                        len,
                    },
                    rows,
                    cols,
                })
            }
            (Linear::Device(_), _) => unreachable!("host() never returns Linear::Device"),
            (Linear::RowInt8(_), None) => Err(CheckpointError::Request {
                name: full.to_string(),
                message: "row-int8 matrix without an int8 spine or packs to stream it from".into(),
            }),
        }
    }
}

/// Aligned reads covering `pieces` (sorted by file and offset, adjacent ones merged) and
/// the buffer offset of each piece.
fn plan_reads(pieces: &[Piece]) -> (Vec<(usize, Region)>, Vec<u64>, u64) {
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
    // Split long regions so that several readers share one contiguous layer.
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
    (split, at, buf_end)
}

impl Shared {
    /// Read layer `l`'s plan into a pooled buffer.
    fn read_layer(&self, l: usize) -> Result<Bytes, String> {
        let plan = self
            .plans
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
            for (f, r) in &plan.regions {
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

impl SpineStreamer {
    /// Plan the streaming of layers `resident..layers.len()` of a loaded model, whose spine
    /// came from `src`. The streamed layers' routers are replaced in `layers` by owned
    /// copies read here (so that no pass faults the mmap for them).
    pub fn new(
        src: &SpineSources<'_>,
        layers: &mut [Layer],
        resident: usize,
        opts: SpineStreamOptions,
    ) -> Result<SpineStreamer, CheckpointError> {
        let mut paths: Vec<PathBuf> = Vec::new();
        let mut plans: Vec<Option<LayerPlan>> = vec![None; layers.len()];
        let mut router_pieces: Vec<(usize, Piece, usize, usize)> = Vec::new();
        for (l, layer) in layers.iter_mut().enumerate().skip(resident) {
            let prefix = format!("{}model.layers.{l}.", crate::model::inventory::PREFIX);
            let mut matrices = Vec::new();
            for (name, m) in linears_mut(layer) {
                let full = format!("{prefix}{name}");
                matrices.push((name.to_string(), src.locate(&mut paths, &full, m)?));
            }
            if let Ffn::Moe(m) = &layer.ffn {
                let full = format!("{prefix}block_sparse_moe.gate.weight");
                let (rows, cols) = (m.router.weight.rows(), m.router.weight.cols());
                let piece = match src.packs {
                    Some(set) => {
                        let pack = set.pack_of(&full).ok_or_else(|| CheckpointError::Request {
                            name: full.clone(),
                            message: "not in the loaded spine packs".into(),
                        })?;
                        let entry = pack.get(&full).ok_or_else(|| CheckpointError::Request {
                            name: full.clone(),
                            message: format!("not in {}", pack.path().display()),
                        })?;
                        let (offset, len) = pack.component_file_range(&entry.data);
                        Piece {
                            file: SpineSources::file_index(&mut paths, pack.path()),
                            offset,
                            len,
                        }
                    }
                    None => {
                        let (path, offset, len) = src.ckpt.tensor_file_range(&full)?;
                        Piece {
                            file: SpineSources::file_index(&mut paths, &path),
                            offset,
                            len,
                        }
                    }
                };
                router_pieces.push((l, piece, rows, cols));
            }
            let mut pieces = Vec::new();
            for (_, mp) in &matrices {
                match mp {
                    MatrixPlan::Bf16 { data, .. } => pieces.push(data.clone()),
                    MatrixPlan::RowInt8 { data, scales, .. } => {
                        pieces.push(data.clone());
                        pieces.push(scales.clone());
                    }
                }
            }
            let bytes = pieces.iter().map(|p| p.len).sum();
            let (regions, piece_at, buf_len) = plan_reads(&pieces);
            plans[l] = Some(LayerPlan {
                matrices,
                regions,
                piece_at,
                buf_len,
                bytes,
            });
        }
        let files = paths
            .iter()
            .map(|p| SourceFile::open(p, opts.direct_io).map_err(|e| io_err(p, "open", e)))
            .collect::<Result<Vec<_>, _>>()?;
        // Routers of streamed layers: one explicit read each into an owned buffer.
        for (l, piece, rows, cols) in router_pieces {
            let file = &files[piece.file];
            let mut v = vec![0u8; piece.len as usize];
            use std::os::unix::fs::FileExt;
            std::fs::File::open(file.path())
                .and_then(|f| f.read_exact_at(&mut v, piece.offset))
                .map_err(|e| io_err(file.path(), "reading a router", e))?;
            let name = format!("model.layers.{l}.block_sparse_moe.gate.weight");
            let w = Bf16Matrix::new(&name, Bytes::from_vec(v), rows, cols).map_err(|e| {
                CheckpointError::Request {
                    name: name.clone(),
                    message: e.to_string(),
                }
            })?;
            if let Ffn::Moe(m) = &mut layers[l].ffn {
                m.router.weight = w;
            }
        }
        let buf_len = plans.iter().flatten().map(|p| p.buf_len).max().unwrap_or(0);
        let bytes_per_pass = plans.iter().flatten().map(|p| p.bytes).sum();
        let io = match files.first().map(|f| f.io_path()) {
            Some((deltafin_experts::io::IoPath::Direct, _)) => "direct".to_string(),
            Some((_, why)) => format!("buffered ({})", why.unwrap_or_default()),
            None => "none".to_string(),
        };
        let split = SpineSplit {
            resident: resident.min(layers.len()),
            layers: layers.len(),
            bytes_per_pass,
            max_layer_buffer: buf_len,
            io,
            read_threads: opts.read_threads.clamp(1, 16),
        };
        let shared = Arc::new(Shared {
            files,
            plans,
            pool: Arc::new(Mutex::new(Vec::new())),
            buf_len,
            threads: opts.read_threads.clamp(1, 16),
            bytes_read: AtomicU64::new(0),
            layer_reads: AtomicU64::new(0),
            read_nanos: AtomicU64::new(0),
            wait_nanos: AtomicU64::new(0),
            passes: AtomicU64::new(0),
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
        Ok(SpineStreamer {
            shared,
            resident,
            requests: Mutex::new(Some(req_tx)),
            replies: Mutex::new(rep_rx),
            worker: Some(worker),
            split,
            pass_lock: Mutex::new(()),
        })
    }

    /// The resident/streamed split.
    pub fn split(&self) -> &SpineSplit {
        &self.split
    }

    /// Counters so far.
    pub fn stats(&self) -> SpineStreamStats {
        let s = &self.shared;
        SpineStreamStats {
            passes: s.passes.load(Ordering::Relaxed),
            layer_reads: s.layer_reads.load(Ordering::Relaxed),
            bytes_read: s.bytes_read.load(Ordering::Relaxed),
            read_seconds: s.read_nanos.load(Ordering::Relaxed) as f64 / 1e9,
            wait_seconds: s.wait_nanos.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }

    fn request(&self, l: usize) -> Result<(), ModelError> {
        let err = || ModelError::Layer {
            layer: l,
            message: "the spine reader thread is gone".into(),
        };
        let guard = self.requests.lock().map_err(|_| err())?;
        guard.as_ref().ok_or_else(err)?.send(l).map_err(|_| err())
    }

    /// Start a forward pass: the first streamed layer's read begins now.
    pub fn begin_pass(&self) -> Result<SpinePass<'_>, ModelError> {
        let guard = self.pass_lock.lock().map_err(|_| ModelError::Layer {
            layer: self.resident,
            message: "spine streaming lock poisoned".into(),
        })?;
        let first = self.resident;
        let pending = if first < self.shared.plans.len() {
            self.shared.passes.fetch_add(1, Ordering::Relaxed);
            self.request(first)?;
            Some(first)
        } else {
            None
        };
        Ok(SpinePass {
            streamer: self,
            pending,
            _one_at_a_time: guard,
        })
    }
}

impl StreamedSpine for SpineStreamer {
    fn resident_layers(&self) -> usize {
        self.split.resident
    }

    fn begin_pass(&self) -> Result<Box<dyn SpineLayers + '_>, ModelError> {
        Ok(Box::new(SpineStreamer::begin_pass(self)?))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The model's spine streamer, when its layers stream (for `--stats` and the startup log).
pub fn streamer(model: &K3Model) -> Option<&SpineStreamer> {
    model
        .spine_stream
        .as_ref()
        .and_then(|s| s.as_any().downcast_ref::<SpineStreamer>())
}

impl Drop for SpineStreamer {
    fn drop(&mut self) {
        if let Ok(mut g) = self.requests.lock() {
            g.take();
        }
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// One forward pass over a streamed spine: hands out each layer's weights in order.
pub struct SpinePass<'a> {
    streamer: &'a SpineStreamer,
    /// The layer whose read is in flight.
    pending: Option<usize>,
    _one_at_a_time: std::sync::MutexGuard<'a, ()>,
}

impl SpinePass<'_> {
    /// The weights of layer `l`: `None` for a resident layer (use the model's own), else
    /// `resident` (the model's entry for `l`, which supplies the small tensors) with its
    /// projections over the freshly read buffer. Starts the next streamed layer's read.
    pub fn layer(&mut self, l: usize, resident: &Layer) -> Result<Option<Layer>, ModelError> {
        let st = self.streamer;
        let Some(plan) = st.shared.plans.get(l).and_then(|p| p.as_ref()) else {
            return Ok(None);
        };
        if self.pending != Some(l) {
            return Err(ModelError::Layer {
                layer: l,
                message: format!(
                    "spine streaming expected layer {:?} next (layers are visited in order)",
                    self.pending
                ),
            });
        }
        let t0 = Instant::now();
        let (got, bytes) = {
            let rx = st.replies.lock().map_err(|_| ModelError::Layer {
                layer: l,
                message: "spine reply channel poisoned".into(),
            })?;
            rx.recv().map_err(|_| ModelError::Layer {
                layer: l,
                message: "the spine reader thread is gone".into(),
            })?
        };
        self.pending = None;
        st.shared
            .wait_nanos
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if got != l {
            return Err(ModelError::Layer {
                layer: l,
                message: format!("spine reader returned layer {got}"),
            });
        }
        let bytes = bytes.map_err(|message| ModelError::Layer { layer: l, message })?;
        if l + 1 < st.shared.plans.len() {
            st.request(l + 1)?;
            self.pending = Some(l + 1);
        }
        build_layer(l, plan, &bytes, resident).map(Some)
    }
}

impl SpineLayers for SpinePass<'_> {
    fn layer(&mut self, l: usize, resident: &Layer) -> Result<Option<Layer>, ModelError> {
        SpinePass::layer(self, l, resident)
    }
}

impl Drop for SpinePass<'_> {
    fn drop(&mut self) {
        // A pass that stopped early (an error) leaves one read in flight: collect it so the
        // next pass starts clean.
        if self.pending.take().is_some()
            && let Ok(rx) = self.streamer.replies.lock()
        {
            let _ = rx.recv();
        }
    }
}

fn build_layer(
    l: usize,
    plan: &LayerPlan,
    bytes: &Bytes,
    resident: &Layer,
) -> Result<Layer, ModelError> {
    let mut layer = resident.clone();
    let bad = |message: String| ModelError::Layer { layer: l, message };
    let view = |i: usize, p: &Piece| {
        let at = plan.piece_at[i] as usize;
        bytes
            .slice(at..at + p.len as usize)
            .ok_or_else(|| bad(format!("piece {i} outside the layer buffer")))
    };
    let mut i = 0usize;
    let targets = linears_mut(&mut layer);
    if targets.len() != plan.matrices.len() {
        return Err(bad("the layer's projections changed since planning".into()));
    }
    for ((name, target), (pname, mp)) in targets.into_iter().zip(&plan.matrices) {
        if name != pname {
            return Err(bad(format!("planned {pname}, found {name}")));
        }
        let full = format!("model.layers.{l}.{name}");
        *target = match mp {
            MatrixPlan::Bf16 { data, rows, cols } => {
                let d = view(i, data)?;
                i += 1;
                Linear::Bf16(
                    Bf16Matrix::new(&full, d, *rows, *cols).map_err(|e| bad(e.to_string()))?,
                )
            }
            MatrixPlan::RowInt8 {
                data,
                scales,
                rows,
                cols,
            } => {
                let d = view(i, data)?;
                let s = view(i + 1, scales)?;
                i += 2;
                Linear::RowInt8(
                    RowInt8Matrix::new_unscanned(&full, d, s, *rows, *cols)
                        .map_err(|e| bad(e.to_string()))?,
                )
            }
        };
    }
    Ok(layer)
}

#[cfg(test)]
mod tests;
