use deltafin_store::checkpoint::{CONFIG_FILE, Checkpoint};
use deltafin_store::spine_int8::SpineFormat;
use deltafin_store::spine_pack::*;
use deltafin_tensor::DType;
use std::path::Path;
use std::sync::Arc;

/// A tiny checkpoint with a 1,024-token vocabulary and its int8 spine.
fn small(int8: bool) -> (tempfile::TempDir, Checkpoint) {
    crate::test_util::small_checkpoint(5, int8)
}

/// Options packing only layer `layer`.
fn one_layer(ckpt: &Checkpoint, format: SpineFormat, layer: usize) -> PackOptions {
    PackOptions {
        layer: Some(layer),
        ..opts(ckpt, format)
    }
}

fn opts(ckpt: &Checkpoint, format: SpineFormat) -> PackOptions {
    PackOptions {
        format,
        output: ckpt.root().join(default_pack_dir(format)),
        layer: None,
        // Small chunks: every pack has several.
        chunk_size: 64 << 10,
        stop_after_packs: None,
    }
}

/// Every tensor of every pack is byte-identical to its source.
fn assert_round_trip(ckpt: &Checkpoint, format: SpineFormat) {
    let o = opts(ckpt, format);
    let r = pack_spine(ckpt, &o, &mut |_| {}).unwrap();
    let layers = ckpt.config().n_layers();
    assert_eq!((r.packs, r.written, r.skipped), (layers + 1, layers + 1, 0));
    let int8 = open_int8(ckpt, format).unwrap();
    let mut quantized = 0;
    for id in selected_packs(layers, None).unwrap() {
        let p = SpinePack::open(&o.output.join(id.file_name())).unwrap();
        p.verify().unwrap();
        assert_eq!(p.id(), id);
        assert_eq!(p.format(), format);
        assert_eq!(p.file_len() % COMPONENT_ALIGN, 0);
        let sources = pack_sources(ckpt, int8.as_ref(), id).unwrap();
        assert_eq!(p.tensors().len(), sources.len());
        for s in &sources {
            let t = p.get(&s.name).unwrap();
            assert_eq!(t.shape, s.shape);
            assert_eq!(t.codec, s.codec);
            let data = p.component_bytes(&t.data);
            match s.codec {
                Codec::Raw => {
                    let src = ckpt.tensor_bytes(&s.name).unwrap();
                    assert_eq!(data.as_slice(), src.as_slice(), "{}", s.name);
                    if s.source_dtype == DType::BF16 && s.shape.len() == 2 {
                        let m = p.bf16_matrix(&s.name).unwrap();
                        let want = ckpt.bf16_matrix(&s.name).unwrap();
                        assert_eq!(m.data(), want.data());
                    }
                }
                Codec::RowI8F16Scale => {
                    quantized += 1;
                    let m = p.row_int8_matrix(&s.name).unwrap();
                    let want = int8.as_ref().unwrap().get(&s.name).unwrap();
                    assert_eq!(m.data(), want.data());
                    assert_eq!(m.scales(), want.scales());
                    assert!(p.bf16_matrix(&s.name).is_err());
                    let files = deltafin_store::spine_int8::TensorFiles::new(ckpt.root(), &s.name);
                    assert_eq!(data.as_slice(), std::fs::read(&files.i8).unwrap());
                    let sc = p.component_bytes(&t.scales.unwrap());
                    assert_eq!(sc.as_slice(), std::fs::read(&files.sc).unwrap());
                }
            }
        }
        // Payload order: every code block before every scale block before every raw tensor.
        let codes = p
            .tensors()
            .iter()
            .filter(|t| t.codec == Codec::RowI8F16Scale);
        let last_code = codes.clone().map(|t| t.data.offset).max();
        let first_scale = codes
            .clone()
            .filter_map(|t| t.scales)
            .map(|c| c.offset)
            .min();
        let last_scale = codes.filter_map(|t| t.scales).map(|c| c.offset).max();
        let first_raw = p
            .tensors()
            .iter()
            .filter(|t| t.codec == Codec::Raw)
            .map(|t| t.data.offset)
            .min();
        if let (Some(a), Some(b), Some(c), Some(d)) =
            (last_code, first_scale, last_scale, first_raw)
        {
            assert!(a < b && c < d);
        }
    }
    let want = deltafin_store::spine_int8::quantized_tensors(ckpt.config()).len();
    assert_eq!(
        quantized,
        if format == SpineFormat::Int8 { want } else { 0 }
    );
    let v = verify_packs(ckpt, format, &o.output, None, &mut |_| {}).unwrap();
    assert_eq!(v.skipped, layers + 1);
}

#[test]
fn round_trip_bf16_and_int8() {
    let (_d, ckpt) = small(true);
    assert_round_trip(&ckpt, SpineFormat::Bf16);
    assert_round_trip(&ckpt, SpineFormat::Int8);
}

fn flip(path: &Path, at: u64) {
    let mut b = std::fs::read(path).unwrap();
    b[at as usize] ^= 0x10;
    std::fs::write(path, b).unwrap();
}

fn corrupt_message(path: &Path) -> String {
    let e = SpinePack::open(path).and_then(|p| p.verify()).unwrap_err();
    assert!(matches!(e, PackError::Corrupt { .. }), "{e}");
    let m = e.to_string();
    assert!(m.contains(&path.display().to_string()), "{m}");
    m
}

#[test]
fn verify_detects_every_flipped_byte_and_truncation() {
    let (_d, ckpt) = small(true);
    let o = one_layer(&ckpt, SpineFormat::Int8, 1);
    pack_spine(&ckpt, &o, &mut |_| {}).unwrap();
    let path = o.output.join("layer-001.dfsp");
    let clean = std::fs::read(&path).unwrap();
    let p = SpinePack::open(&path).unwrap();
    let first = |codec| {
        p.tensors()
            .iter()
            .find(|t| t.codec == codec)
            .unwrap()
            .clone()
    };
    let (q, raw) = (first(Codec::RowI8F16Scale), first(Codec::Raw));
    let payload = p.payload_offset();
    drop(p);
    let cases: Vec<(&str, u64, &str)> = vec![
        ("header field", 40, "header digest"),
        (
            "header digest",
            OFF_HEADER_DIGEST as u64 + 3,
            "header digest",
        ),
        ("directory", SUPERBLOCK as u64 + 5, "directory digest"),
        (
            "directory chunk record",
            SUPERBLOCK as u64 + 1000,
            "directory digest",
        ),
        ("code", payload + q.data.offset + 7, "chunk"),
        ("scale", payload + q.scales.unwrap().offset + 1, "chunk"),
        ("raw", payload + raw.data.offset + raw.data.len - 1, "chunk"),
        ("padding", payload - 1, "padding"),
    ];
    for (what, at, expect) in cases {
        std::fs::write(&path, &clean).unwrap();
        flip(&path, at);
        let m = corrupt_message(&path);
        assert!(m.contains(expect), "{what}: {m}");
    }
    // The flipped scale is named by its tensor in the chunk message.
    std::fs::write(&path, &clean).unwrap();
    flip(&path, payload + q.scales.unwrap().offset);
    assert!(corrupt_message(&path).contains(&q.name));
    // Every byte of a small stretch of each region, exhaustively.
    for at in (0..clean.len() as u64).step_by(997) {
        std::fs::write(&path, &clean).unwrap();
        flip(&path, at);
        corrupt_message(&path);
    }
    for cut in [0usize, 100, SUPERBLOCK, clean.len() - 1] {
        std::fs::write(&path, &clean[..cut]).unwrap();
        let m = corrupt_message(&path);
        assert!(m.contains("truncated"), "{cut}: {m}");
    }
    std::fs::write(&path, &clean).unwrap();
    SpinePack::open(&path).unwrap().verify().unwrap();
}

#[test]
fn wrong_format_root_is_rejected() {
    let (_d, ckpt) = small(true);
    let o = one_layer(&ckpt, SpineFormat::Bf16, 0);
    pack_spine(&ckpt, &o, &mut |_| {}).unwrap();
    // A bf16 pack copied under the int8 root.
    let int8_root = ckpt.root().join(INT8_PACK_DIR);
    std::fs::create_dir_all(&int8_root).unwrap();
    std::fs::copy(
        o.output.join("layer-000.dfsp"),
        int8_root.join("layer-000.dfsp"),
    )
    .unwrap();
    let e = verify_packs(&ckpt, SpineFormat::Int8, &int8_root, Some(0), &mut |_| {}).unwrap_err();
    assert!(
        matches!(e, PackError::WrongFormat { found: "bf16", .. }),
        "{e}"
    );
    let io = one_layer(&ckpt, SpineFormat::Int8, 0);
    let e = pack_spine(&ckpt, &io, &mut |_| {}).unwrap_err();
    assert!(matches!(e, PackError::WrongFormat { .. }), "{e}");
}

/// The model loads from complete packs (and only then) with logits bit-identical to the
/// shard / int8-file spine.
#[test]
fn the_loader_uses_complete_packs_with_identical_logits() {
    use crate::model::LogitRows;
    use crate::weights::loader::{EngineOptions, load_model};
    let (_d, ckpt) = small(true);
    let ckpt = Arc::new(ckpt);
    let ids = [1u32, 17, 99, 512, 3];
    for format in [SpineFormat::Bf16, SpineFormat::Int8] {
        let eo = EngineOptions {
            spine: format,
            ..Default::default()
        };
        let logits = || {
            let m = load_model(ckpt.clone(), &eo).unwrap();
            m.forward(&mut m.new_state(), &ids, LogitRows::All)
                .unwrap()
                .values
        };
        assert!(PackSet::open_if_complete(&ckpt, format).unwrap().is_none());
        let want = logits();
        // Incomplete (one layer): not used.
        pack_spine(&ckpt, &one_layer(&ckpt, format, 0), &mut |_| {}).unwrap();
        let o = opts(&ckpt, format);
        assert!(PackSet::open_if_complete(&ckpt, format).unwrap().is_none());
        pack_spine(&ckpt, &o, &mut |_| {}).unwrap();
        let set = PackSet::open_if_complete(&ckpt, format).unwrap().unwrap();
        let quantized = set
            .packs()
            .iter()
            .flat_map(|p| p.tensors())
            .filter(|t| t.codec == Codec::RowI8F16Scale);
        assert_eq!(quantized.count() > 0, format == SpineFormat::Int8);
        assert_eq!(logits(), want, "{format:?}");
        if format == SpineFormat::Int8 {
            // The int8 files are not read at all: the packs carry the codes and scales.
            let dir = ckpt.root().join(deltafin_store::spine_int8::INT8_DIR);
            let away = ckpt.root().join("int8-away");
            std::fs::rename(&dir, &away).unwrap();
            assert_eq!(logits(), want);
            std::fs::rename(&away, &dir).unwrap();
        }
        // A damaged directory makes loading fail, naming the pack.
        let path = o.output.join("layer-002.dfsp");
        let clean = std::fs::read(&path).unwrap();
        flip(&path, SUPERBLOCK as u64 + 3);
        let e = load_model(ckpt.clone(), &eo).map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("layer-002.dfsp"), "{e}");
        std::fs::write(&path, clean).unwrap();
    }
}

#[test]
fn a_second_packer_is_locked_out() {
    let (_d, ckpt) = small(false);
    let o = one_layer(&ckpt, SpineFormat::Bf16, 0);
    std::fs::create_dir_all(&o.output).unwrap();
    let held = lock(&o.output).unwrap();
    let e = pack_spine(&ckpt, &o, &mut |_| {}).unwrap_err();
    assert!(matches!(e, PackError::Locked { .. }), "{e}");
    drop(held);
    pack_spine(&ckpt, &o, &mut |_| {}).unwrap();
}

#[test]
fn int8_packs_need_the_int8_spine() {
    let (_d, ckpt) = small(false);
    let e = pack_spine(&ckpt, &opts(&ckpt, SpineFormat::Int8), &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("convert-spine-int8"), "{e}");
}

#[test]
fn resume_after_a_stop_skips_complete_packs_and_redoes_parts() {
    let (_d, ckpt) = small(false);
    let layers = ckpt.config().n_layers();
    let half = layers / 2;
    let o = opts(&ckpt, SpineFormat::Bf16);
    let r = pack_spine(
        &ckpt,
        &PackOptions {
            stop_after_packs: Some(half),
            ..o.clone()
        },
        &mut |_| {},
    )
    .unwrap();
    assert!(r.stopped);
    assert_eq!(r.written, half);
    // A torn write of the next pack.
    let next = o
        .output
        .join(format!("{}.part", PackId::Layer(half).file_name()));
    std::fs::write(&next, b"torn").unwrap();
    // A complete pack corrupted after the stop is rebuilt, not trusted.
    flip(&o.output.join("layer-000.dfsp"), 70_000);
    let r = pack_spine(&ckpt, &o, &mut |_| {}).unwrap();
    assert!(!r.stopped);
    assert_eq!(r.skipped, half - 1);
    assert_eq!(r.written, layers + 1 - (half - 1));
    assert_eq!(r.parts_redone, 1);
    assert_eq!(r.rebuilt.len(), 1);
    assert!(!next.exists());
    // The result equals an uninterrupted run.
    let again = tempfile::tempdir().unwrap();
    let mut o2 = o.clone();
    o2.output = again.path().to_path_buf();
    pack_spine(&ckpt, &o2, &mut |_| {}).unwrap();
    for id in selected_packs(layers, None).unwrap() {
        let a = std::fs::read(o.output.join(id.file_name())).unwrap();
        let b = std::fs::read(o2.output.join(id.file_name())).unwrap();
        assert!(a == b, "{}", id.file_name());
    }
    let r = pack_spine(&ckpt, &o, &mut |_| {}).unwrap();
    assert_eq!((r.written, r.skipped), (0, layers + 1));
}

#[test]
fn layer_out_of_range_and_other_model_are_rejected() {
    let (_d, ckpt) = small(false);
    let layers = ckpt.config().n_layers();
    let o = one_layer(&ckpt, SpineFormat::Bf16, layers);
    let e = pack_spine(&ckpt, &o, &mut |_| {}).unwrap_err();
    assert!(matches!(e, PackError::LayerOutOfRange { .. }), "{e}");
    assert!(e.to_string().contains(&format!("0…{}", layers - 1)), "{e}");
    // A pack of another model (different seed, same shapes: the index differs in nothing,
    // so change config.json) is refused by verify.
    let o = one_layer(&ckpt, SpineFormat::Bf16, 0);
    pack_spine(&ckpt, &o, &mut |_| {}).unwrap();
    let cfg = ckpt.root().join(CONFIG_FILE);
    let mut text = std::fs::read_to_string(&cfg).unwrap();
    text.push('\n');
    std::fs::write(&cfg, text).unwrap();
    let e = verify_packs(&ckpt, SpineFormat::Bf16, &o.output, Some(0), &mut |_| {}).unwrap_err();
    assert!(matches!(e, PackError::Identity { .. }), "{e}");
    let e = verify_packs(&ckpt, SpineFormat::Bf16, &o.output, Some(1), &mut |_| {}).unwrap_err();
    assert!(matches!(e, PackError::Missing { .. }), "{e}");
}
