//! Writing a synthetic K3 checkpoint: the seeded generator, the per-tensor initialisation
//! (the scales of [`crate::synth`]), the shards, the index and the side files.

use std::io::Write;
use std::path::Path;

use deltafin_tensor::{DType, SafetensorsWriter, TensorEntry, bf16};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::spec::*;
use deltafin_store::checkpoint::{CONFIG_FILE, INDEX_FILE};
use deltafin_store::config::{K3Config, REAL_CONFIG_JSON};
use deltafin_store::inventory::{self, ExpertPart, TensorKind, TensorSpec};

/// SplitMix64: tiny, fast, and good enough for weights.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }
    /// Seed derived from a global seed and a tensor name (FNV-1a), so each tensor's values
    /// are independent of the others and of write order.
    pub fn for_tensor(seed: u64, name: &str) -> Self {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        SplitMix64(seed ^ h.rotate_left(17))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }
    /// Uniform with mean 0 and standard deviation `std`.
    pub fn centered(&mut self, std: f32) -> f32 {
        (2.0 * self.unit() - 1.0) * 3f32.sqrt() * std
    }
    /// Standard normal (Box–Muller, computed in f64).
    pub fn gaussian(&mut self) -> f32 {
        let u1 = ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let u2 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug)]
pub(super) enum Init {
    /// Zero-mean uniform with this std.
    Std(f32),
    /// `lm_head`: Gaussian entries of this std, each row scaled by a log-normal factor
    /// `e^{0.25 g}` (rows of `cols` values).
    HeavyRows { std: f32, cols: usize },
    /// `1 ± 0.1` (norm weights).
    Ones,
    /// `A_log`: `ln(1 + 3u)` for the first `used` entries, 0 after.
    ALog { used: usize },
    /// `dt_bias`: `-1.5 ± 0.5`.
    DtBias,
    /// Depthwise conv taps `[C, 1, K]`: std 0.5, last tap `1 ± 0.25`.
    Conv { k: usize },
    /// Permuted evenly spaced values in ±0.2.
    Spread,
    /// Random E2M1 codes.
    Codes,
    /// E8M0 scales `base + {-1, 0, 1}`.
    Scales { base: u8 },
}

/// E8M0 base exponent giving MXFP4 weights of standard deviation `std` with random codes
/// (E2M1 rms √8.5625) and a ±1 exponent jitter (mean square factor 1.75).
pub(super) fn scale_base(std: f32) -> u8 {
    let e = (std / (8.5625f32.sqrt() * 1.75f32.sqrt())).log2().round() as i32 + 127;
    e.clamp(2, 252) as u8
}

pub(super) fn init_for(cfg: &K3Config, spec: &TensorSpec) -> Init {
    let name = spec.name.as_str();
    let fan_in = spec.shape.get(1).copied().unwrap_or(1).max(1) as f32;
    let d = cfg.text.hidden_size as f32;
    let out_scale = 1.0 / (cfg.text.attn_res_block_size as f32).sqrt();
    if let TensorKind::Expert { matrix, part, .. } = spec.kind {
        let [_, cols] = inventory::ExpertLayout::logical_shape(cfg, matrix);
        return match part {
            ExpertPart::Packed => Init::Codes,
            ExpertPart::Scale => Init::Scales {
                base: scale_base(1.0 / (cols as f32).sqrt()),
            },
        };
    }
    if name.ends_with("A_log") {
        return Init::ALog {
            used: cfg.text.linear_attn.num_heads,
        };
    }
    if name.ends_with("dt_bias") {
        return Init::DtBias;
    }
    if name.ends_with("conv1d.weight") {
        return Init::Conv {
            k: cfg.text.linear_attn.short_conv_kernel_size,
        };
    }
    if name.ends_with("e_score_correction_bias") {
        return Init::Spread;
    }
    if name.ends_with("res_proj.weight") {
        return Init::Std(1.0 / d.sqrt());
    }
    if spec.shape.len() == 1 {
        return Init::Ones; // every other 1-D tensor is a norm weight
    }
    if name.ends_with(inventory::EMBED) {
        return Init::Std(1.0);
    }
    if name.ends_with(inventory::LM_HEAD) {
        return Init::HeavyRows {
            std: 4.0 / d.sqrt(),
            cols: spec.shape[1],
        };
    }
    let writes_residual = name.ends_with("o_proj.weight")
        || name.ends_with("down_proj.weight") && !name.contains("routed_expert_down_proj")
        || name.ends_with("routed_expert_up_proj.weight");
    if writes_residual {
        return Init::Std(out_scale / fan_in.sqrt());
    }
    Init::Std(1.0 / fan_in.sqrt())
}

/// Stream the values of one tensor into `out` in chunks (never the whole tensor at once).
pub(super) fn write_values(
    init: Init,
    dtype: DType,
    shape: &[usize],
    rng: &mut SplitMix64,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    let numel: usize = shape.iter().product();
    const CHUNK: usize = 1 << 16;
    let mut buf: Vec<u8> = Vec::with_capacity(CHUNK * 4);
    // Spread: a permutation of evenly spaced values, drawn up front (small tensors only).
    let spread: Vec<f32> = if let Init::Spread = init {
        let mut v: Vec<f32> = (0..numel)
            .map(|i| -0.2 + 0.4 * i as f32 / (numel.max(2) - 1) as f32)
            .collect();
        for i in (1..v.len()).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
        v
    } else {
        Vec::new()
    };
    let mut i = 0;
    let mut row_scale = 1.0f32;
    #[allow(clippy::needless_range_loop)] // `k` is the element index the initialisers use
    while i < numel {
        let n = CHUNK.min(numel - i);
        buf.clear();
        for k in i..i + n {
            match init {
                Init::Codes => buf.push(rng.next_u64() as u8),
                Init::Scales { base } => {
                    let j = (rng.next_u64() % 3) as u8;
                    buf.push(base - 1 + j);
                }
                _ => {
                    let x = match init {
                        Init::Std(s) => rng.centered(s),
                        Init::HeavyRows { std, cols } => {
                            if k % cols == 0 {
                                row_scale = (0.25 * rng.gaussian()).exp();
                            }
                            std * row_scale * rng.gaussian()
                        }
                        Init::Ones => 1.0 + rng.centered(0.1 / 3f32.sqrt()),
                        Init::ALog { used } => {
                            if k < used {
                                (1.0 + 3.0 * rng.unit()).ln()
                            } else {
                                0.0
                            }
                        }
                        Init::DtBias => -1.5 + (2.0 * rng.unit() - 1.0) * 0.5,
                        Init::Conv { k: kk } => {
                            if k % kk == kk - 1 {
                                1.0 + (2.0 * rng.unit() - 1.0) * 0.25
                            } else {
                                rng.centered(0.5)
                            }
                        }
                        Init::Spread => spread[k],
                        Init::Codes | Init::Scales { .. } => 0.0,
                    };
                    match dtype {
                        DType::F32 => buf.extend_from_slice(&x.to_le_bytes()),
                        _ => buf.extend_from_slice(&bf16::from_f32(x).to_le_bytes()),
                    }
                }
            }
        }
        out.write_all(&buf)?;
        i += n;
    }
    Ok(())
}

/// Write one safetensors file holding `specs` (already in layout order) with values from
/// `init`. Returns the file size.
pub(super) fn write_shard(
    path: &Path,
    specs: &[&TensorSpec],
    seed: u64,
    init: &dyn Fn(&TensorSpec) -> Init,
) -> Result<u64, SynthError> {
    let writer = SafetensorsWriter::new(
        specs
            .iter()
            .map(|s| TensorEntry {
                name: s.name.clone(),
                dtype: s.dtype,
                shape: s.shape.clone(),
            })
            .collect(),
    )
    .with_metadata("format", "pt");
    Ok(writer.write(path, |i, e, out| {
        let mut rng = SplitMix64::for_tensor(seed, &e.name);
        write_values(init(specs[i]), e.dtype, &e.shape, &mut rng, out)
    })?)
}

pub(super) fn write_json(path: &Path, v: &Value) -> Result<u64, SynthError> {
    let mut text = serde_json::to_string_pretty(v).map_err(|e| SynthError::Io {
        path: path.to_path_buf(),
        source: e.into(),
    })?;
    text.push('\n');
    std::fs::write(path, &text).map_err(io_err(path))?;
    Ok(text.len() as u64)
}

pub(super) fn sha256_file(path: &Path) -> Result<String, SynthError> {
    let data = std::fs::read(path).map_err(io_err(path))?;
    Ok(hex::encode(Sha256::digest(&data)))
}

/// Synthesise a K3 checkpoint into `out_dir` (created if needed).
pub fn synthesize(out_dir: &Path, spec: &SynthSpec) -> Result<SynthReport, SynthError> {
    synthesize_with_progress(out_dir, spec, &mut |_| {})
}

/// [`synthesize`], calling `progress` after each file with a one-line description.
pub fn synthesize_with_progress(
    out_dir: &Path,
    spec: &SynthSpec,
    progress: &mut dyn FnMut(&str),
) -> Result<SynthReport, SynthError> {
    let cfg = scaled_config(&spec.dims)?;
    std::fs::create_dir_all(out_dir).map_err(io_err(out_dir))?;
    let mut files = Vec::new();

    let config_path = out_dir.join(CONFIG_FILE);
    let n = write_json(&config_path, &cfg.to_json_value())?;
    files.push(SynthFile {
        path: config_path.clone(),
        bytes: n,
    });

    let mut all = inventory::text_inventory(&cfg);
    all.extend(inventory::vision_inventory(&cfg));
    let n_shards = inventory::shard_count(&cfg);
    let mut tensor_bytes = 0u64;
    let init = |s: &TensorSpec| init_for(&cfg, s);
    for shard in 1..=n_shards {
        let specs: Vec<&TensorSpec> = all.iter().filter(|t| t.shard == shard).collect();
        let name = inventory::shard_file_name(shard, n_shards);
        let path = out_dir.join(&name);
        let size = write_shard(&path, &specs, spec.seed, &init)?;
        let tb: u64 = specs.iter().map(|s| s.byte_len() as u64).sum();
        tensor_bytes += tb;
        progress(&format!("{name}: {} tensors, {size} bytes", specs.len()));
        files.push(SynthFile { path, bytes: size });
    }

    let mut weight_map = serde_json::Map::new();
    for t in &all {
        weight_map.insert(
            t.name.clone(),
            Value::String(inventory::shard_file_name(t.shard, n_shards)),
        );
    }
    let index = serde_json::json!({
        "metadata": { "total_size": tensor_bytes },
        "weight_map": weight_map,
    });
    let index_path = out_dir.join(INDEX_FILE);
    let n = write_json(&index_path, &index)?;
    files.push(SynthFile {
        path: index_path,
        bytes: n,
    });

    for f in ["tiktoken.model", "tokenizer_config.json"] {
        let src = spec.assets_dir.join(f);
        let dst = out_dir.join(f);
        let n = std::fs::copy(&src, &dst).map_err(io_err(&src))?;
        files.push(SynthFile {
            path: dst,
            bytes: n,
        });
    }
    let gen_path = out_dir.join("generation_config.json");
    let gen_cfg = serde_json::json!({
        "_from_model_config": true,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "transformers_version": "4.56.2",
    });
    let n = write_json(&gen_path, &gen_cfg)?;
    files.push(SynthFile {
        path: gen_path,
        bytes: n,
    });
    progress("index, tokenizer and generation config written");

    let total_bytes = files.iter().map(|f| f.bytes).sum();
    Ok(SynthReport {
        files,
        total_bytes,
        tensor_bytes,
        config_sha256: sha256_file(&config_path)?,
        config: cfg,
    })
}

/// A plain tensor list for the single-file draft models.
pub(super) fn single_file(
    out_dir: &Path,
    config: &Value,
    mut specs: Vec<TensorSpec>,
    seed: u64,
    init: &dyn Fn(&TensorSpec) -> Init,
) -> Result<SynthReport, SynthError> {
    std::fs::create_dir_all(out_dir).map_err(io_err(out_dir))?;
    inventory::sort_shard(&mut specs);
    let config_path = out_dir.join(CONFIG_FILE);
    let n = write_json(&config_path, config)?;
    let path = out_dir.join("model.safetensors");
    let refs: Vec<&TensorSpec> = specs.iter().collect();
    let size = write_shard(&path, &refs, seed, init)?;
    let tensor_bytes = specs.iter().map(|s| s.byte_len() as u64).sum();
    let files = vec![
        SynthFile {
            path: config_path.clone(),
            bytes: n,
        },
        SynthFile { path, bytes: size },
    ];
    Ok(SynthReport {
        total_bytes: files.iter().map(|f| f.bytes).sum(),
        files,
        tensor_bytes,
        config_sha256: sha256_file(&config_path)?,
        config: K3Config::from_json_str(REAL_CONFIG_JSON)?,
    })
}

/// Rewrites the bf16 matrix `tensor` (its full stored name) of the checkpoint in `dir` in
/// place, one row at a time: `edit(r, row)` gets row `r` as f32 and may change it. For test
/// checkpoints with a chosen behaviour (see [`answers_end_at_once`]). Errors name the file.
pub fn edit_rows(
    dir: &Path,
    tensor: &str,
    edit: &mut dyn FnMut(usize, &mut [f32]),
) -> Result<(), SynthError> {
    use std::io::{Read, Seek, SeekFrom};
    let index_path = dir.join(INDEX_FILE);
    let bad = |path: &Path, why: String| SynthError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, why),
    };
    let index: Value =
        serde_json::from_slice(&std::fs::read(&index_path).map_err(io_err(&index_path))?)
            .map_err(|e| bad(&index_path, e.to_string()))?;
    let shard = index["weight_map"][tensor]
        .as_str()
        .ok_or_else(|| bad(&index_path, format!("{tensor} is not in the weight map")))?;
    let path = dir.join(shard);
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(io_err(&path))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(io_err(&path))?;
    let len = usize::try_from(u64::from_le_bytes(len))
        .map_err(|_| bad(&path, "header too long".into()))?;
    let mut header = vec![0u8; len];
    f.read_exact(&mut header).map_err(io_err(&path))?;
    let header: Value = serde_json::from_slice(&header).map_err(|e| bad(&path, e.to_string()))?;
    let t = &header[tensor];
    if t["dtype"] != "BF16" || t["shape"].as_array().map(Vec::len) != Some(2) {
        return Err(bad(&path, format!("{tensor} is not a bf16 matrix")));
    }
    let dim = |i: usize| {
        t["shape"][i]
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| bad(&path, "no shape".into()))
    };
    let (rows, cols) = (dim(0)?, dim(1)?);
    let start = t["data_offsets"][0]
        .as_u64()
        .ok_or_else(|| bad(&path, "no offsets".into()))?;
    let base = 8 + len as u64 + start;
    let mut raw = vec![0u8; cols * 2];
    let mut row = vec![0f32; cols];
    for r in 0..rows {
        let at = base + (r * cols * 2) as u64;
        f.seek(SeekFrom::Start(at)).map_err(io_err(&path))?;
        f.read_exact(&mut raw).map_err(io_err(&path))?;
        for (x, v) in row.iter_mut().zip(raw.chunks_exact(2)) {
            *x = bf16::from_bits(u16::from_le_bytes([v[0], v[1]])).to_f32();
        }
        edit(r, &mut row);
        for (x, v) in row.iter().zip(raw.chunks_exact_mut(2)) {
            v.copy_from_slice(&bf16::from_f32(*x).to_bits().to_le_bytes());
        }
        f.seek(SeekFrom::Start(at)).map_err(io_err(&path))?;
        f.write_all(&raw).map_err(io_err(&path))?;
    }
    f.sync_all().map_err(io_err(&path))
}

/// Makes a synthesized checkpoint's greedy answers end at once, for tests of clients that
/// need finished answers (a random model never ends its message): every token's embedding
/// gets a large constant in hidden dimension 0, which therefore dominates the final
/// normalised state; `lm_head` reads dimension 0 only in the rows of `<|end_of_msg|>` (12)
/// and `<|close|>` (10), and 0 elsewhere. The answer is then `<|end_of_msg|>` wherever it is
/// allowed, and where a constraint forbids it (a forced tool call) every marker closes as
/// soon as it may: string arguments are empty and calls end at once.
pub fn answers_end_at_once(dir: &Path) -> Result<(), SynthError> {
    use crate::text::tokenizer::{CLOSE, END_OF_MSG};
    let p = deltafin_store::inventory::PREFIX;
    edit_rows(
        dir,
        &format!("{p}{}", deltafin_store::inventory::EMBED),
        &mut |_, row| {
            row[0] = 100.0;
        },
    )?;
    let lm_head = format!("{p}{}", deltafin_store::inventory::LM_HEAD);
    edit_rows(dir, &lm_head, &mut |r, row| {
        row[0] = match u32::try_from(r) {
            Ok(END_OF_MSG) => 12.0,
            Ok(CLOSE) => 10.0,
            _ => 0.0,
        };
    })
}
