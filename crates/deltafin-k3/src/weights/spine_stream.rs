//! Spine streaming: when the spine does not fit the memory budget, a prefix of layers stays
//! resident and the remaining layers' spine matrices are read per forward pass.
//!
//! The reads are the store's ([`deltafin_store::spine_reader`]: where each matrix lies, the
//! aligned reads, a background reader filling pooled page-aligned buffers with explicit
//! positional reads, never by faulting the mmap). Here: which matrices of a layer stream (its
//! projections, [`linears_mut`]), the order of a pass (while layer `l` computes, the reader
//! fills the buffer of the next streamed layer), and each layer's weights built as views of
//! its buffer, which goes back to the pool when the pass is done with it. The small tensors of
//! a streamed layer (norms, conv taps, biases, the router) stay resident: the vectors are
//! widened to f32 at load anyway, and the router is read once into an owned buffer (it also
//! feeds the previous layer's PILOT guess).

use crate::error::ModelError;
use crate::model::K3Model;
use crate::model::layer::{Ffn, Layer};
use crate::model::linear::Linear;
use crate::model::spine::{SpineLayers, StreamedSpine};
use deltafin_store::checkpoint::CheckpointError;
use deltafin_store::inventory::name;
use deltafin_store::spine_reader::{
    LayerReads, Located, Piece, SpineFiles, SpineReader, plan_reads,
};

pub use crate::model::layer::linears_mut;
use deltafin_store::spine_reader::SpineLocator;
pub use deltafin_store::spine_reader::SpineStreamOptions;
use deltafin_tensor::{Bf16Matrix, Bytes, RowInt8Matrix};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// How one streamed matrix is rebuilt from the layer buffer.
#[derive(Clone, Debug)]
struct MatrixPlan {
    located: Located,
    rows: usize,
    cols: usize,
}

/// One streamed layer: its matrices and where each piece lands in its buffer.
#[derive(Clone, Debug)]
struct LayerPlan {
    /// Matrix name (relative to `model.layers.{l}.`) and its plan, in [`linears_mut`] order.
    matrices: Vec<(&'static str, MatrixPlan)>,
    /// Buffer offset of every piece, in plan order (data, then scales for int8).
    piece_at: Vec<u64>,
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

/// Streams the spine matrices of layers `resident..layers`.
pub struct SpineStreamer {
    reader: SpineReader,
    plans: Vec<Option<LayerPlan>>,
    resident: usize,
    split: SpineSplit,
    wait_nanos: AtomicU64,
    passes: AtomicU64,
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

impl SpineStreamer {
    /// Plan the streaming of layers `resident..layers.len()` of a loaded model, whose spine
    /// came from `src`. The streamed layers' routers are replaced in `layers` by owned
    /// copies read here (so that no pass faults the mmap for them).
    pub fn new(
        src: &SpineLocator<'_>,
        layers: &mut [Layer],
        resident: usize,
        opts: SpineStreamOptions,
    ) -> Result<SpineStreamer, CheckpointError> {
        let mut files = SpineFiles::default();
        let mut plans: Vec<Option<LayerPlan>> = vec![None; layers.len()];
        let mut reads: Vec<Option<Vec<_>>> = vec![None; layers.len()];
        let mut buf_len = 0;
        let mut routers: Vec<(usize, Piece, usize, usize)> = Vec::new();
        for (l, layer) in layers.iter_mut().enumerate().skip(resident) {
            let prefix = format!("{}model.layers.{l}.", deltafin_store::inventory::PREFIX);
            let mut matrices = Vec::new();
            for (name, m) in linears_mut(layer) {
                let int8 = match m.host() {
                    Linear::RowInt8(_) => true,
                    Linear::Bf16(_) => false,
                    Linear::Device(_) => unreachable!("host() never returns Linear::Device"),
                };
                let located = src.locate(&mut files, &format!("{prefix}{name}"), int8)?;
                let (rows, cols) = (m.rows(), m.cols());
                matrices.push((
                    name,
                    MatrixPlan {
                        located,
                        rows,
                        cols,
                    },
                ));
            }
            if let Ffn::Moe(m) = &layer.ffn {
                let piece = src.bf16(&mut files, &format!("{prefix}{}", name::moe::ROUTER))?;
                routers.push((l, piece, m.router.weight.rows(), m.router.weight.cols()));
            }
            let mut pieces = Vec::new();
            for (_, mp) in &matrices {
                match &mp.located {
                    Located::Bf16 { data } => pieces.push(data.clone()),
                    Located::RowInt8 { data, scales } => {
                        pieces.push(data.clone());
                        pieces.push(scales.clone());
                    }
                }
            }
            let bytes = pieces.iter().map(|p| p.len).sum();
            let LayerReads {
                regions,
                piece_at,
                buf_len: len,
            } = plan_reads(&pieces);
            buf_len = buf_len.max(len);
            reads[l] = Some(regions);
            plans[l] = Some(LayerPlan {
                matrices,
                piece_at,
                bytes,
            });
        }
        let reader = SpineReader::start(&files, reads, buf_len, opts)?;
        // Routers of streamed layers: one explicit read each into an owned buffer.
        for (l, piece, rows, cols) in routers {
            let v = reader.read_owned(&piece)?;
            let full = format!("model.layers.{l}.{}", name::moe::ROUTER);
            let w = Bf16Matrix::new(&full, Bytes::from_vec(v), rows, cols).map_err(|e| {
                CheckpointError::Request {
                    name: full.clone(),
                    message: e.to_string(),
                }
            })?;
            if let Ffn::Moe(m) = &mut layers[l].ffn {
                m.router.weight = w;
            }
        }
        let split = SpineSplit {
            resident: resident.min(layers.len()),
            layers: layers.len(),
            bytes_per_pass: plans.iter().flatten().map(|p| p.bytes).sum(),
            max_layer_buffer: buf_len,
            io: reader.io().to_string(),
            read_threads: opts.read_threads.clamp(1, 16),
        };
        Ok(SpineStreamer {
            reader,
            plans,
            resident,
            split,
            wait_nanos: AtomicU64::new(0),
            passes: AtomicU64::new(0),
            pass_lock: Mutex::new(()),
        })
    }

    /// The resident/streamed split.
    pub fn split(&self) -> &SpineSplit {
        &self.split
    }

    /// Counters so far.
    pub fn stats(&self) -> SpineStreamStats {
        let read = self.reader.counters();
        SpineStreamStats {
            passes: self.passes.load(Ordering::Relaxed),
            layer_reads: read.layer_reads,
            bytes_read: read.bytes_read,
            read_seconds: read.read_seconds,
            wait_seconds: self.wait_nanos.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }

    fn request(&self, l: usize) -> Result<(), ModelError> {
        self.reader
            .request(l)
            .map_err(|message| ModelError::Layer { layer: l, message })
    }

    /// Start a forward pass: the first streamed layer's read begins now.
    pub fn begin_pass(&self) -> Result<SpinePass<'_>, ModelError> {
        let guard = self.pass_lock.lock().map_err(|_| ModelError::Layer {
            layer: self.resident,
            message: "spine streaming lock poisoned".into(),
        })?;
        let first = self.resident;
        let pending = if first < self.plans.len() {
            self.passes.fetch_add(1, Ordering::Relaxed);
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
        let Some(plan) = st.plans.get(l).and_then(|p| p.as_ref()) else {
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
        let (got, bytes) = st
            .reader
            .recv()
            .map_err(|message| ModelError::Layer { layer: l, message })?;
        self.pending = None;
        st.wait_nanos
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if got != l {
            return Err(ModelError::Layer {
                layer: l,
                message: format!("spine reader returned layer {got}"),
            });
        }
        let bytes = bytes.map_err(|message| ModelError::Layer { layer: l, message })?;
        if l + 1 < st.plans.len() {
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
        if self.pending.take().is_some() {
            let _ = self.streamer.reader.recv();
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
        if name != *pname {
            return Err(bad(format!("planned {pname}, found {name}")));
        }
        let full = format!("model.layers.{l}.{name}");
        let (rows, cols) = (mp.rows, mp.cols);
        *target = match &mp.located {
            Located::Bf16 { data } => {
                let d = view(i, data)?;
                i += 1;
                Linear::Bf16(Bf16Matrix::new(&full, d, rows, cols).map_err(|e| bad(e.to_string()))?)
            }
            Located::RowInt8 { data, scales } => {
                let d = view(i, data)?;
                let s = view(i + 1, scales)?;
                i += 2;
                Linear::RowInt8(
                    RowInt8Matrix::new_unscanned(&full, d, s, rows, cols)
                        .map_err(|e| bad(e.to_string()))?,
                )
            }
        };
    }
    Ok(layer)
}

#[cfg(test)]
mod tests;
