//! Build a [`K3Model`] from a validated [`Checkpoint`]: map `config.json` onto
//! [`ModelDims`], take zero-copy views of the spine (the shards' bf16 matrices, or the
//! row-int8 files of [`deltafin_store::spine_int8`] with [`SpineFormat::Int8`]), widen the small
//! vectors to f32, and serve routed experts straight from the shard bytes.

use crate::model::attn_res::AttnResWeights;
use crate::model::kda::KdaWeights;
use crate::model::linear::Linear;
use crate::model::mla::MlaWeights;
use crate::model::moe::{ExpertError, ExpertSource, ExpertWeights, MoeWeights};
use crate::model::router::RouterWeights;
use crate::model::situ::SituMlp;
use crate::model::{Attention, Ffn, K3Model, Layer, ModelError};
use crate::weights::resident::{HugePages, ResidentCopy};
use crate::weights::spine_stream::{SpineStreamOptions, SpineStreamer};
use deltafin_experts::{ExpertHomes, StreamOptions, StreamingExperts};
use deltafin_store::checkpoint::{Checkpoint, CheckpointError};
use deltafin_store::config::{K3Config, LayerKind};
use deltafin_store::dims::{CacheDtype, ModelDims};
use deltafin_store::inventory::{self, name};
pub use deltafin_store::spine_int8::SpineFormat;
use deltafin_store::spine_int8::{Int8Spine, SpineError, is_quantized};
use deltafin_store::spine_pack::{Codec, PackError, PackSet};
use deltafin_store::spine_reader::SpineLocator;
use deltafin_tensor::storage::copy_to_anonymous;
use std::path::Path;
use std::sync::{Arc, OnceLock};

/// An error while loading a model: the checkpoint or the assembled model is invalid.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Spine(#[from] SpineError),
    #[error(transparent)]
    Pack(#[from] PackError),
    #[error(transparent)]
    Experts(#[from] deltafin_store::experts::ExpertsError),
}

/// Engine choices that are not part of `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineOptions {
    /// Storage type of the MLA latent cache (bf16 by default, §6).
    pub mla_cache_dtype: CacheDtype,
    /// Chunk length of the chunked KDA prefill (64, as FLA).
    pub kda_chunk: usize,
    /// The spine's format. The library default is [`SpineFormat::Bf16`] (weight-exact);
    /// the CLI's default `--spine auto` asks for [`SpineFormat::Int8`].
    pub spine: SpineFormat,
    /// Spine streaming: `Some(k)` keeps layers `0..k` resident and reads the spine matrices
    /// of layers `k..` per forward pass ([`crate::weights::spine_stream`]); `None` (default) or
    /// `k ≥ layers` keeps the whole spine resident.
    pub spine_resident_layers: Option<usize>,
    /// Reader threads and O_DIRECT policy of spine streaming.
    pub spine_stream: SpineStreamOptions,
    /// Whether the resident spine is copied into huge-page memory at load
    /// ([`crate::weights::resident`]; default `auto`: where the system grants huge pages).
    pub huge_pages: HugePages,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            mla_cache_dtype: CacheDtype::Bf16,
            kda_chunk: 64,
            spine: SpineFormat::Bf16,
            spine_resident_layers: None,
            spine_stream: SpineStreamOptions::default(),
            huge_pages: HugePages::default(),
        }
    }
}

/// The model dimensions and constants for `cfg` (docs/K3.md §1, epsilons of §5.1), with
/// the MLA cache type and KDA chunk of `opts`.
pub fn dims_from_config(cfg: &K3Config, opts: &EngineOptions) -> ModelDims {
    ModelDims {
        kda_chunk: opts.kda_chunk,
        mla_cache_dtype: opts.mla_cache_dtype,
        ..ModelDims::from_config(cfg)
    }
}

/// Routed experts served from the checkpoint's memory-mapped shards. Each expert's
/// matrices are validated (E8M0 NaN scan) on first use and then reused.
pub struct CheckpointExperts {
    ckpt: Arc<Checkpoint>,
    num_experts: usize,
    cells: Vec<OnceLock<ExpertWeights>>,
}

impl CheckpointExperts {
    pub fn new(ckpt: Arc<Checkpoint>) -> CheckpointExperts {
        let cfg = ckpt.config();
        let num_experts = cfg.text.num_experts;
        let cells = (0..cfg.n_layers() * num_experts)
            .map(|_| OnceLock::new())
            .collect();
        CheckpointExperts {
            ckpt,
            num_experts,
            cells,
        }
    }

    /// Bytes of every routed expert of every MoE layer (codes and scales of the three
    /// matrices).
    pub fn total_bytes(&self) -> u64 {
        let cfg = self.ckpt.config();
        (0..cfg.n_layers())
            .filter(|&l| !cfg.is_dense(l))
            .map(|l| {
                let one = inventory::expert_layout(cfg, l, 0).total_bytes() as u64;
                one * self.num_experts as u64
            })
            .sum()
    }

    /// Copy every routed expert into one anonymous mapping advised for transparent huge
    /// pages ([`crate::weights::resident`]) and serve the copies from then on. Meant for a model whose
    /// experts all stay resident (no memory budget) on a system where
    /// [`HugePages::copies`] holds; each expert is validated as on first use.
    /// `progress(bytes, total)` as [`copy_to_anonymous`] calls it.
    pub fn copy_to_huge_pages(
        &self,
        progress: &(dyn Fn(u64, u64) + Sync),
    ) -> Result<ResidentCopy, LoadError> {
        let cfg = self.ckpt.config();
        // The stored views only: the scales are checked on the copies, in memory, so that
        // nothing reads the shards through their mappings first.
        let mut experts = Vec::new();
        for l in (0..cfg.n_layers()).filter(|&l| !cfg.is_dense(l)) {
            for e in 0..self.num_experts {
                experts.push(((l, e), self.ckpt.expert_tensor_bytes(l, e)?));
            }
        }
        // In file order (the shards store experts in the string order of their ids,
        // docs/K3.md §3.4): experts that follow each other in a shard then follow each other
        // in the copy, and the copy reads them with a few large reads.
        experts.sort_by_cached_key(|(id, parts)| {
            let at = parts[0].file_origin();
            (
                at.map(|(f, _)| f.path().to_path_buf()),
                at.map_or(0, |(_, o)| o),
                *id,
            )
        });
        let parts: Vec<deltafin_tensor::Bytes> = experts
            .iter()
            .flat_map(|(_, p)| p.iter().cloned())
            .collect();
        let copies =
            copy_to_anonymous(&parts, true, progress).map_err(|e| ModelError::Weights {
                name: "routed experts".into(),
                message: format!("cannot copy the experts into anonymous memory: {e}"),
            })?;
        drop(parts);
        let mut views = copies.views.into_iter();
        let count = experts.len();
        for ((l, e), _) in experts {
            let mut next = || {
                views.next().ok_or_else(|| ModelError::Weights {
                    name: format!("layer {l} expert {e}"),
                    message: "no copy for this expert".into(),
                })
            };
            let copied = [next()?, next()?, next()?, next()?, next()?, next()?];
            let m = self.ckpt.expert_matrices_from(l, e, copied)?;
            let w = ExpertWeights {
                w1: m.w1,
                w2: m.w2,
                w3: m.w3,
            };
            if let Some(cell) = self.cells.get(l * self.num_experts + e) {
                // A cell filled earlier keeps its (identical) mapped view.
                let _ = cell.set(w);
            }
        }
        Ok(ResidentCopy {
            what: "routed experts",
            matrices: count * 3,
            bytes: copies.mapped as u64,
            huge_advised: copies.huge_advised,
            stats: copies.stats,
        })
    }
}

impl ExpertSource for CheckpointExperts {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError> {
        let err = |message: String| ExpertError::Unavailable {
            layer,
            expert,
            message,
        };
        if expert >= self.num_experts {
            return Err(err(format!(
                "out of range (num_experts = {})",
                self.num_experts
            )));
        }
        let cell = self
            .cells
            .get(layer * self.num_experts + expert)
            .ok_or_else(|| err("layer out of range".into()))?;
        if let Some(w) = cell.get() {
            return Ok(w.clone());
        }
        let m = self
            .ckpt
            .expert_matrices(layer, expert)
            .map_err(|e| err(e.to_string()))?;
        let w = ExpertWeights {
            w1: m.w1,
            w2: m.w2,
            w3: m.w3,
        };
        Ok(cell.get_or_init(|| w).clone())
    }
}

struct Names<'a> {
    ckpt: &'a Checkpoint,
    int8: Option<&'a Int8Spine>,
    /// Complete DFSP packs of the chosen spine: every tensor comes from them when present.
    packs: Option<&'a PackSet>,
    prefix: String,
}

impl Names<'_> {
    fn full(&self, name: &str) -> String {
        format!("{}{}{name}", inventory::PREFIX, self.prefix)
    }
    /// A matrix that is never quantized (the router, the embedding).
    fn mat(&self, name: &str) -> Result<deltafin_tensor::Bf16Matrix, LoadError> {
        if let Some(p) = self.packs {
            return Ok(p.bf16_matrix(&self.full(name))?);
        }
        Ok(self.ckpt.bf16_matrix(&format!("{}{name}", self.prefix))?)
    }
    /// A quantizable projection: row-int8 from the int8 spine when loaded, else bf16.
    fn lin(&self, name: &str) -> Result<Linear, LoadError> {
        let short = format!("{}{name}", self.prefix);
        let full = format!("{}{short}", inventory::PREFIX);
        if let Some(p) = self.packs {
            return Ok(match p.codec(&full) {
                Some(Codec::RowI8F16Scale) => Linear::RowInt8(p.row_int8_matrix(&full)?),
                _ => Linear::Bf16(p.bf16_matrix(&full)?),
            });
        }
        let bf16 = self.ckpt.bf16_matrix(&short)?;
        match self.int8 {
            Some(spine) if is_quantized(&full) => {
                let m = spine.get(&full).ok_or_else(|| CheckpointError::Request {
                    name: full.clone(),
                    message: "missing from the loaded int8 spine".into(),
                })?;
                if (m.rows(), m.cols()) != (bf16.rows(), bf16.cols()) {
                    return Err(CheckpointError::Request {
                        name: full,
                        message: format!(
                            "int8 spine shape [{}, {}] differs from the checkpoint's [{}, {}]",
                            m.rows(),
                            m.cols(),
                            bf16.rows(),
                            bf16.cols()
                        ),
                    }
                    .into());
                }
                Ok(Linear::RowInt8(m.clone()))
            }
            _ => Ok(Linear::Bf16(bf16)),
        }
    }
    fn vec(&self, name: &str) -> Result<Vec<f32>, LoadError> {
        if let Some(p) = self.packs {
            return Ok(p.f32_vector(&self.full(name))?);
        }
        Ok(self.ckpt.f32_vector(&format!("{}{name}", self.prefix))?)
    }
    /// A zero-padded vector (`A_log`, docs/K3.md §3.2): its first `used` entries, the
    /// padding after them checked to be exactly zero.
    fn unpadded(&self, name: &str, used: usize) -> Result<Vec<f32>, LoadError> {
        inventory::unpad(self.vec(name)?, used).map_err(|message| {
            CheckpointError::Request {
                name: self.full(name),
                message,
            }
            .into()
        })
    }
    fn attn_res(&self, norm: &str, proj: &str) -> Result<AttnResWeights, LoadError> {
        Ok(AttnResWeights {
            norm: self.vec(norm)?,
            proj: self.vec(proj)?,
        })
    }
    fn situ(&self, [gate, up, down]: [&str; 3]) -> Result<SituMlp, LoadError> {
        Ok(SituMlp {
            gate_proj: self.lin(gate)?,
            up_proj: self.lin(up)?,
            down_proj: self.lin(down)?,
        })
    }
}

fn load_layer(
    ckpt: &Checkpoint,
    int8: Option<&Int8Spine>,
    packs: Option<&PackSet>,
    l: usize,
) -> Result<Layer, LoadError> {
    let cfg = ckpt.config();
    let n = Names {
        ckpt,
        int8,
        packs,
        prefix: format!("model.layers.{l}."),
    };
    let attn = match cfg.layer_kind(l) {
        LayerKind::Kda => {
            use name::kda::*;
            Attention::Kda(KdaWeights {
                q_proj: n.lin(Q_PROJ)?,
                k_proj: n.lin(K_PROJ)?,
                v_proj: n.lin(V_PROJ)?,
                q_conv: n.vec(Q_CONV)?,
                k_conv: n.vec(K_CONV)?,
                v_conv: n.vec(V_CONV)?,
                f_a_proj: n.lin(F_A_PROJ)?,
                f_b_proj: n.lin(F_B_PROJ)?,
                b_proj: n.lin(B_PROJ)?,
                a_log: n.unpadded(A_LOG, cfg.text.linear_attn.num_heads)?,
                dt_bias: n.vec(DT_BIAS)?,
                g_proj: n.lin(G_PROJ)?,
                o_norm: n.vec(O_NORM)?,
                o_proj: n.lin(O_PROJ)?,
            })
        }
        LayerKind::Mla => {
            use name::mla::*;
            Attention::Mla(MlaWeights {
                q_a_proj: n.lin(Q_A_PROJ)?,
                q_a_layernorm: n.vec(Q_A_NORM)?,
                q_b_proj: n.lin(Q_B_PROJ)?,
                kv_a_proj: n.lin(KV_A_PROJ)?,
                kv_a_layernorm: n.vec(KV_A_NORM)?,
                kv_b_proj: n.lin(KV_B_PROJ)?,
                g_proj: n.lin(G_PROJ)?,
                o_proj: n.lin(O_PROJ)?,
            })
        }
    };
    let ffn = if cfg.is_dense(l) {
        Ffn::Dense(n.situ(name::DENSE)?)
    } else {
        use name::moe::*;
        Ffn::Moe(MoeWeights {
            router: RouterWeights {
                weight: n.mat(ROUTER)?,
                bias: n.vec(ROUTER_BIAS)?,
            },
            latent_down: n.lin(LATENT_DOWN)?,
            latent_up: n.lin(LATENT_UP)?,
            latent_norm: n.vec(LATENT_NORM)?,
            shared: n.situ(SHARED)?,
        })
    };
    Ok(Layer {
        attn_res: n.attn_res(name::ATTN_RES_NORM, name::ATTN_RES_PROJ)?,
        mlp_res: n.attn_res(name::MLP_RES_NORM, name::MLP_RES_PROJ)?,
        input_layernorm: n.vec(name::INPUT_NORM)?,
        post_attention_layernorm: n.vec(name::POST_ATTENTION_NORM)?,
        attn,
        ffn,
    })
}

/// Assemble the model over an opened checkpoint (zero-copy for every matrix).
pub fn load_model(ckpt: Arc<Checkpoint>, opts: &EngineOptions) -> Result<K3Model, LoadError> {
    let experts = Box::new(CheckpointExperts::new(ckpt.clone()));
    load_model_with_experts(ckpt, opts, experts)
}

pub use deltafin_store::checkpoint::{EXPERT_DIR, expert_file_name};

/// Routed experts streamed from the checkpoint's shards with explicit reads (never through
/// the shard mmaps) under `stream.cache_bytes`.
pub fn streaming_experts(
    ckpt: &Checkpoint,
    stream: StreamOptions,
) -> Result<StreamingExperts, LoadError> {
    streaming_experts_with_homes(ckpt, stream, None)
}

/// [`streaming_experts`], reading from `homes` what they hold copies of (docs/K3.md §12.11).
pub fn streaming_experts_with_homes(
    ckpt: &Checkpoint,
    stream: StreamOptions,
    homes: Option<ExpertHomes>,
) -> Result<StreamingExperts, LoadError> {
    let table = deltafin_store::experts::expert_table(ckpt)?;
    Ok(StreamingExperts::with_homes(table, stream, homes).map_err(ModelError::from)?)
}

/// Assemble the model with routed experts from `experts`. The spine's matrices are views of
/// the shard (or int8 spine, or pack) mappings; with [`EngineOptions::huge_pages`] `auto` on
/// a system with transparent huge pages the resident ones are then copied once into
/// huge-page memory ([`crate::weights::resident`]).
pub fn load_model_with_experts(
    ckpt: Arc<Checkpoint>,
    opts: &EngineOptions,
    experts: Box<dyn ExpertSource>,
) -> Result<K3Model, LoadError> {
    let mut model = assemble_model(ckpt, opts, experts)?;
    if opts.huge_pages.copies() {
        model.resident_copy = Some(model.copy_spine_to_huge_pages(&|_, _| {})?);
    }
    touch_embedding_in_background(&model);
    Ok(model)
}

/// [`load_model_with_experts`] without its last two steps, the huge-page copy and the
/// embedding's background read, for a caller that runs them itself: the engine builder copies
/// with progress, then starts the read ([`touch_embedding_in_background`]), so that the two do
/// not compete for the disk.
pub(crate) fn assemble_model(
    ckpt: Arc<Checkpoint>,
    opts: &EngineOptions,
    experts: Box<dyn ExpertSource>,
) -> Result<K3Model, LoadError> {
    let dims = dims_from_config(ckpt.config(), opts);
    // Complete DFSP packs of the chosen spine (docs/DFSP.md) replace the shards / int8 files.
    let packs = PackSet::open_if_complete(&ckpt, opts.spine)?;
    let int8 = match (opts.spine, &packs) {
        (SpineFormat::Int8, None) => Some(Int8Spine::open(ckpt.root(), ckpt.config())?),
        _ => None,
    };
    let mut layers = (0..ckpt.config().n_layers())
        .map(|l| load_layer(&ckpt, int8.as_ref(), packs.as_ref(), l))
        .collect::<Result<Vec<_>, _>>()?;
    let streamer = match opts.spine_resident_layers {
        Some(k) if k < layers.len() => {
            let src = SpineLocator {
                ckpt: &ckpt,
                int8_root: int8.as_ref().map(|_| ckpt.root()),
                packs: packs.as_ref(),
            };
            Some(SpineStreamer::new(&src, &mut layers, k, opts.spine_stream)?)
        }
        _ => None,
    };
    let top = Names {
        ckpt: &ckpt,
        int8: int8.as_ref(),
        packs: packs.as_ref(),
        prefix: String::new(),
    };
    let embed = top.mat(inventory::EMBED)?;
    let norm = top.vec(inventory::FINAL_NORM)?;
    let output_res = top.attn_res(inventory::OUTPUT_RES_NORM, inventory::OUTPUT_RES_PROJ)?;
    let lm_head = top.lin(inventory::LM_HEAD)?;
    let mut model = K3Model::new(dims, embed, layers, norm, output_res, lm_head, experts)?;
    model.spine_stream = streamer.map(|s| Box::new(s) as _);
    Ok(model)
}

/// Bytes between the touches of [`touch_pages`]: one per page of the smallest page size.
const TOUCH_STRIDE: usize = 4096;

/// Read one byte of every page of `bytes`, in order, so that a memory-mapped range is read
/// from disk into memory now (sequential faults, so the kernel's readahead grows) instead of
/// page by page when first used. Returns the number of pages touched.
pub(crate) fn touch_pages(bytes: &[u8]) -> usize {
    let mut touched = 0;
    for i in (0..bytes.len()).step_by(TOUCH_STRIDE) {
        std::hint::black_box(bytes[i]);
        touched += 1;
    }
    touched
}

/// Bring the model's embedding table into memory on a background thread ([`touch_pages`]).
pub(crate) fn touch_embedding_in_background(model: &K3Model) {
    touch_in_background(model.embed.bytes().clone());
}

/// Bring the embedding table into memory on a background thread ([`touch_pages`]).
///
/// Decode reads one embedding row per token. The table is part of the resident spine in the
/// memory plan, but it is mapped from the checkpoint, and nothing else reads it: without
/// this, every token whose row was never read before takes a page fault to the disk in the
/// middle of the token, while the expert reads wait (measured on the `stream` preset after
/// dropping the page cache: ≈ 3.6 ms per decode token on this machine's virtual disk). The
/// thread holds its own view of the mapping, so dropping the model early is safe; if the
/// thread cannot start, rows are simply faulted in on first use, as before.
fn touch_in_background(bytes: deltafin_tensor::Bytes) {
    let _ = std::thread::Builder::new()
        .name("k3-embed-touch".into())
        .spawn(move || touch_pages(bytes.as_slice()));
}

/// Open the checkpoint under `root`, validate it, and build the model.
pub fn open_model(root: &Path, opts: &EngineOptions) -> Result<K3Model, LoadError> {
    let ckpt = Arc::new(Checkpoint::open(root)?);
    load_model(ckpt, opts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_store::config::REAL_CONFIG_JSON;
    use deltafin_store::dims::AttnKind;

    #[test]
    fn touch_pages_reads_every_page_once() {
        for (len, pages) in [(0, 0), (1, 1), (4096, 1), (4097, 2), (3 * 4096 + 5, 4)] {
            assert_eq!(touch_pages(&vec![7u8; len]), pages, "{len} bytes");
        }
        // Over a file mapping, as for the checkpoint's embedding table.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("table.bin");
        std::fs::write(&path, vec![1u8; 5 * 4096 + 100]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let bytes = deltafin_tensor::Bytes::from_owner(Arc::new(map));
        let view = bytes.slice(4096..bytes.len()).unwrap();
        assert_eq!(touch_pages(view.as_slice()), 5);
        // The background form returns at once and keeps its own view of the mapping.
        touch_in_background(view);
    }

    #[test]
    fn real_config_maps_to_the_k3_dims_and_state_sizes() {
        let cfg = K3Config::from_json_str(REAL_CONFIG_JSON).unwrap();
        let d = dims_from_config(&cfg, &EngineOptions::default());
        d.validate().unwrap();
        assert_eq!(d.num_layers(), 93);
        assert_eq!(d.num_mla_layers(), 24);
        assert_eq!(d.num_kda_layers(), 69);
        assert_eq!(d.attn_kind(0), AttnKind::Kda);
        assert_eq!(d.attn_kind(91), AttnKind::Mla);
        assert_eq!(d.attn_kind(92), AttnKind::Mla);
        assert_eq!(d.shared_intermediate, 6144);
        assert_eq!(d.gate_lower_bound, -5.0);
        assert_eq!(
            (d.mla_norm_eps, d.kda_l2_eps, d.rms_norm_eps),
            (1e-6, 1e-6, 1e-5)
        );
        // §6: 576 bf16 values per token per MLA layer, 24 layers; 443.1 MiB of KDA state.
        assert_eq!(d.mla_cache_bytes_per_token(), 27_648);
        assert_eq!(d.kda_state_bytes(), 464_633_856);
        let f32_cache = dims_from_config(
            &cfg,
            &EngineOptions {
                mla_cache_dtype: CacheDtype::F32,
                ..Default::default()
            },
        );
        assert_eq!(f32_cache.mla_cache_bytes_per_token(), 55_296);
    }
}
