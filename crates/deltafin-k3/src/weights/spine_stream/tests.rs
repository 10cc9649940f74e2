use super::*;
use crate::model::LogitRows;
use crate::weights::loader::{EngineOptions, load_model};
use deltafin_experts::stream::DirectIo;
use deltafin_store::checkpoint::Checkpoint;
use deltafin_store::spine_int8::SpineFormat;
use deltafin_store::spine_int8::TensorFiles;
use deltafin_store::spine_pack::{PackOptions, default_pack_dir, pack_spine};
use std::sync::Arc;

fn small() -> (tempfile::TempDir, Arc<Checkpoint>) {
    let (dir, ckpt) = crate::test_util::small_checkpoint(7, true);
    (dir, Arc::new(ckpt))
}

/// Prefill logits of every row, then three decode steps, for one resident-layer count.
fn run(ckpt: &Arc<Checkpoint>, spine: SpineFormat, resident: Option<usize>) -> Vec<f32> {
    let m = load_model(
        ckpt.clone(),
        &EngineOptions {
            spine,
            spine_resident_layers: resident,
            spine_stream: SpineStreamOptions {
                read_threads: 3,
                direct_io: DirectIo::Auto,
            },
            ..Default::default()
        },
    )
    .unwrap();
    let layers = m.layers.len();
    match (resident, super::streamer(&m)) {
        (Some(k), Some(s)) => {
            assert!(k < layers);
            assert_eq!(s.split().resident, k);
            assert!(
                s.split()
                    .describe()
                    .contains(&format!("{k} of {layers} layers"))
            );
        }
        (Some(k), None) => assert!(k >= layers),
        (None, s) => assert!(s.is_none()),
    }
    let mut st = m.new_state();
    let mut out = m
        .forward(&mut st, &[1, 17, 99, 512, 3], LogitRows::All)
        .unwrap()
        .values;
    for t in [5u32, 700, 42] {
        out.extend(m.decode(&mut st, t).unwrap());
    }
    if let Some(s) = super::streamer(&m) {
        let stats = s.stats();
        // One prefill and three decode passes, each reads every streamed layer once.
        assert_eq!(stats.passes, 4);
        assert_eq!(stats.layer_reads, 4 * (layers - s.split().resident) as u64);
        assert!(stats.bytes_read >= 4 * s.split().bytes_per_pass);
    }
    out
}

/// Streaming 0, some or all layers gives bit-identical logits to the resident spine,
/// for the bf16 shards, the int8 spine files and both kinds of DFSP packs.
#[test]
fn streamed_spine_is_bit_identical_to_resident() {
    let (_d, ckpt) = small();
    let layers = ckpt.config().n_layers();
    let check = |spine: SpineFormat, what: &str| {
        let want = run(&ckpt, spine, None);
        for k in [0, 1, layers / 2, layers - 1, layers] {
            assert!(
                run(&ckpt, spine, Some(k)) == want,
                "{what}: {k} resident layers"
            );
        }
    };
    check(SpineFormat::Bf16, "bf16 shards");
    check(SpineFormat::Int8, "int8 files");
    for format in [SpineFormat::Bf16, SpineFormat::Int8] {
        let o = PackOptions {
            format,
            output: ckpt.root().join(default_pack_dir(format)),
            layer: None,
            chunk_size: 64 << 10,
            stop_after_packs: None,
        };
        pack_spine(&ckpt, &o, &mut |_| {}).unwrap();
        check(format, "packs");
    }
}

/// A streamed layer whose file shrank after loading is an error naming the file.
#[test]
fn a_short_read_names_the_file() {
    let (_d, ckpt) = small();
    let m = load_model(
        ckpt.clone(),
        &EngineOptions {
            spine: SpineFormat::Int8,
            spine_resident_layers: Some(0),
            ..Default::default()
        },
    )
    .unwrap();
    let victim = TensorFiles::new(
        ckpt.root(),
        &format!(
            "{}model.layers.2.self_attn.o_proj.weight",
            deltafin_store::inventory::PREFIX
        ),
    )
    .i8;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&victim)
        .unwrap();
    f.set_len(100).unwrap();
    let e = m.decode(&mut m.new_state(), 1).unwrap_err().to_string();
    assert!(
        e.contains("o_proj.weight.i8") && e.contains("layer 2"),
        "{e}"
    );
    // The pass that failed left nothing in flight: the next one fails the same way.
    let e2 = m.decode(&mut m.new_state(), 1).unwrap_err().to_string();
    assert!(e2.contains("layer 2"), "{e2}");
}
