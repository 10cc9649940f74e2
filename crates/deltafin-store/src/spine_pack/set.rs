//! The pack root: every pack of a model ([`PackSet`]), packing a whole spine
//! ([`pack_spine`]) and verifying it ([`verify_packs`]).

use super::format::*;
use super::read::*;
use super::write::*;
use crate::checkpoint::Checkpoint;
use crate::filelock::{FileLock, Refused, lock_in};
use crate::inventory::TensorKind;
use crate::spine_int8::{Int8Spine, SpineFormat};
use deltafin_tensor::{Bf16Matrix, DType, RowInt8Matrix};
use std::path::{Path, PathBuf};
use std::time::Instant;

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

/// Take the packing lock of the pack root `dir`, as a packer does: a second packer finds it
/// held ([`PackError::Locked`]).
pub fn lock(dir: &Path) -> Result<FileLock, PackError> {
    lock_in(dir, LOCK_FILE).map_err(|r| match r {
        Refused::Held(path) => PackError::Locked { path },
        Refused::Io(path, e) => io_err(&path)(e),
    })
}

pub(super) fn source_len(sources: &[PackSource]) -> u64 {
    sources
        .iter()
        .map(|s| (s.data.len() + s.scales.as_ref().map_or(0, |b| b.len())) as u64)
        .sum()
}

/// The int8 spine a pack of `format` reads its quantized tensors from (`None` for bf16).
pub fn open_int8(ckpt: &Checkpoint, format: SpineFormat) -> Result<Option<Int8Spine>, PackError> {
    Ok(match format {
        SpineFormat::Int8 => Some(Int8Spine::open(ckpt.root(), ckpt.config())?),
        SpineFormat::Bf16 => None,
    })
}

pub(super) fn expected_identity(
    model: [u8; 32],
    format: SpineFormat,
    sources: &[PackSource],
) -> PackIdentity {
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
    pub(super) packs: Vec<SpinePack>,
    index: std::collections::HashMap<String, usize>,
}

impl PackSet {
    /// The packs, one per spine layer and the globals.
    pub fn packs(&self) -> &[SpinePack] {
        &self.packs
    }
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
                // As stored (a zero-padded `A_log` may be longer or shorter than the spec's
                // reference layout), the way the writer hashed its sources.
                let (dtype, shape) = ckpt.tensor_info(&s.name)?;
                h.add(&s.name, codec, dtype, &shape);
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
