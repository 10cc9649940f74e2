//! Writes the generated (binary) seeds of the fuzz corpora, `fuzz/corpus/<target>/gen-*`,
//! with the product's own writers: safetensors shards of a synthesized tiny checkpoint, its
//! scaled `config.json`, DFSP packs, a scale4 sidecar, heat histograms. The text seeds
//! (request bodies, chat conversations, manifests, traces) are committed as written.
//!
//! `cargo run -p deltafin-fuzz-harness --example write_seeds` (rewrites the `gen-*` files).

use deltafin_experts::heat::{HeatDims, HeatTable};
use deltafin_k3::synth::{SynthDims, SynthSpec, scaled_config, synthesize};
use deltafin_k3::weights::spine_int8::SpineFormat;
use deltafin_k3::weights::spine_pack::{Codec, PackId, PackSource, write_pack};
use deltafin_tensor::{Bytes, DType, SafetensorsWriter, TensorEntry};
use std::io::Write;
use std::path::{Path, PathBuf};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn corpus(target: &str) -> Res<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../corpus")
        .join(target);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn put(target: &str, name: &str, bytes: &[u8]) -> Res<()> {
    let path = corpus(target)?.join(format!("gen-{name}"));
    std::fs::write(&path, bytes)?;
    println!("{} ({} bytes)", path.display(), bytes.len());
    Ok(())
}

fn safetensors() -> Res<()> {
    let tmp = tempfile::tempdir()?;
    // Two shards of a synthesized tiny checkpoint: a layer shard whole, and the embedding
    // shard's header alone (its data cut off: a truncated file).
    let report = synthesize(tmp.path(), &SynthSpec::new(SynthDims::tiny(), 1))?;
    let mut shards: Vec<_> = report
        .files
        .iter()
        .filter(|f| f.path.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    shards.sort_by_key(|f| f.bytes);
    if let Some(small) = shards.first() {
        put(
            "safetensors_header",
            "layer-shard.safetensors",
            &std::fs::read(&small.path)?,
        )?;
    }
    if let Some(big) = shards.last() {
        let bytes = std::fs::read(&big.path)?;
        let mut len = [0u8; 8];
        len.copy_from_slice(&bytes[..8]);
        let header = 8 + u64::from_le_bytes(len) as usize;
        put(
            "safetensors_header",
            "truncated-shard.safetensors",
            &bytes[..header + 64],
        )?;
    }
    // Every dtype the header may name, a scalar, an empty tensor and metadata.
    let entries = vec![
        TensorEntry {
            name: "a.bf16".into(),
            dtype: DType::BF16,
            shape: vec![2, 3],
        },
        TensorEntry {
            name: "b.f32".into(),
            dtype: DType::F32,
            shape: vec![4],
        },
        TensorEntry {
            name: "c.f16".into(),
            dtype: DType::F16,
            shape: vec![1, 1, 2],
        },
        TensorEntry {
            name: "d.u8".into(),
            dtype: DType::U8,
            shape: vec![],
        },
        TensorEntry {
            name: "e.i8".into(),
            dtype: DType::I8,
            shape: vec![0, 5],
        },
    ];
    let w = SafetensorsWriter::new(entries).with_metadata("format", "pt");
    let path = tmp.path().join("mixed.safetensors");
    w.write(&path, |i, e, out: &mut dyn Write| {
        out.write_all(&vec![i as u8 + 1; e.byte_len()])
    })?;
    put(
        "safetensors_header",
        "mixed.safetensors",
        &std::fs::read(&path)?,
    )?;

    let config = scaled_config(&SynthDims::tiny())?;
    let text = serde_json::to_string_pretty(&config.to_json_value())?;
    put("config_json", "tiny-config.json", text.as_bytes())?;
    Ok(())
}

fn dfsp() -> Res<()> {
    let tmp = tempfile::tempdir()?;
    let bf16 = |name: &str, rows: usize, cols: usize| PackSource {
        name: name.into(),
        codec: Codec::Raw,
        source_dtype: DType::BF16,
        shape: vec![rows, cols],
        data: Bytes::from_vec((0..rows * cols * 2).map(|i| (i * 7) as u8).collect()),
        scales: None,
    };
    let f32v = |name: &str, n: usize| PackSource {
        name: name.into(),
        codec: Codec::Raw,
        source_dtype: DType::F32,
        shape: vec![n],
        data: Bytes::from_vec((0..n * 4).map(|i| (i * 3) as u8).collect()),
        scales: None,
    };
    let int8 = |name: &str, rows: usize, cols: usize| PackSource {
        name: name.into(),
        codec: Codec::RowI8F16Scale,
        source_dtype: DType::BF16,
        shape: vec![rows, cols],
        data: Bytes::from_vec((0..rows * cols).map(|i| (i * 5) as u8).collect()),
        scales: Some(Bytes::from_vec(vec![0x3c; rows * 2])),
    };
    let packs = [
        (
            "bf16-layer.dfsp",
            SpineFormat::Bf16,
            PackId::Layer(0),
            vec![
                bf16("model.layers.0.self_attn.q_proj.weight", 8, 16),
                f32v("model.layers.0.input_layernorm.weight", 16),
            ],
        ),
        (
            "int8-globals.dfsp",
            SpineFormat::Int8,
            PackId::Globals,
            vec![
                int8("lm_head.weight", 16, 32),
                bf16("model.embed_tokens.weight", 4, 32),
                f32v("model.norm.weight", 32),
            ],
        ),
    ];
    for (name, format, id, sources) in packs {
        let path = tmp.path().join(name);
        write_pack(&path, format, id, 4, [7; 32], &sources, 512, &mut |_| {})?;
        let bytes = std::fs::read(&path)?;
        put("dfsp_header", name, &bytes)?;
        if name.starts_with("bf16") {
            put("dfsp_header", "superblock-only.dfsp", &bytes[..4096])?;
        }
    }
    Ok(())
}

fn scale4() -> Res<()> {
    let (layer_file, manifest) = deltafin_fuzz_harness::scale4_valid_files();
    put("scale4_sidecar", "L1.sc4", layer_file)?;
    put(
        "scale4_sidecar",
        "scale4-manifest.json",
        manifest.as_bytes(),
    )?;
    put("scale4_sidecar", "L1-header-only.sc4", &layer_file[..8192])?;
    Ok(())
}

fn heat() -> Res<()> {
    let dims = HeatDims {
        layers: 3,
        experts: 8,
        top_k: 2,
    };
    let mut t = HeatTable::empty(dims);
    put("expert_heat", "empty.bin", &t.encode())?;
    for p in 0..300usize {
        let a = [p % 8, (p * 3 + 1) % 8];
        let b = [0usize, 1];
        t.record_pass([(1, &a[..]), (2, &b[..]), (3, &a[..1])]);
    }
    let bytes = t.encode();
    put("expert_heat", "learned.bin", &bytes)?;
    let mut other = bytes.clone();
    other[16] = 9;
    put("expert_heat", "wrong-dims.bin", &other)?;
    Ok(())
}

fn main() -> Res<()> {
    safetensors()?;
    dfsp()?;
    scale4()?;
    heat()?;
    Ok(())
}
