use super::format::TABLES_AT;
use super::*;
use crate::layout::ExpertShape;
use crate::test_support::HintLog;
use std::path::Path;

fn real_layout() -> Scale4Layout {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../assets/kimi/k3-config.json"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let t = v.get("text_config").unwrap_or(&v);
    let get = |k: &str| t[k].as_u64().unwrap() as usize;
    Scale4Layout {
        shape: ExpertShape {
            f: get("moe_intermediate_size"),
            lr: get("routed_expert_hidden_size"),
        },
        num_experts: get("num_experts"),
    }
}

#[test]
fn formulas_give_the_contract_sizes_for_the_real_config() {
    let l = real_layout();
    assert_eq!(l.shape.expert_bytes(), 17_547_264);
    assert_eq!(l.delta_bytes(), [172_032; 3]);
    assert_eq!(l.header_bytes(), 8192);
    assert_eq!(l.record_bytes(), 524_288);
    assert_eq!(
        l.blob_offsets(),
        [
            8_192, 5_513_216, 5_685_248, 11_190_272, 11_362_304, 16_867_328
        ]
    );
    assert_eq!(l.blob_bytes(), 17_039_360);
    assert_eq!(82_432 * l.record_bytes(), 43_218_108_416);
    assert_eq!(l.file_bytes(), 8192 + 896 * 524_288);
}

fn small() -> Scale4Layout {
    // w1/w3 [96, 64] → 192 scales; w2 [64, 96] → 192 scales; odd counts come from F = 33.
    Scale4Layout {
        shape: ExpertShape { f: 96, lr: 64 },
        num_experts: 5,
    }
}

fn rng(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

fn random_scales(layout: &Scale4Layout, seed: u64, lo: u8, span: u8) -> [Vec<u8>; 3] {
    let mut s = seed | 1;
    layout.scale_counts().map(|n| {
        (0..n)
            .map(|_| lo + (rng(&mut s) % (span as u64 + 1)) as u8)
            .collect()
    })
}

fn roundtrip(layout: &Scale4Layout, scales: &[Vec<u8>; 3]) {
    let enc = encode_expert([&scales[0], &scales[1], &scales[2]], 3, 1).unwrap();
    let rec = write_record(layout, 3, 1, &enc);
    assert_eq!(rec.len() as u64, layout.record_bytes());
    let back = parse_record(layout, 3, 1, &rec, Path::new("x.sc4")).unwrap();
    assert_eq!(back, enc);
    assert_eq!(&decode_expert(layout, &back), scales);
}

#[test]
fn roundtrip_is_bit_exact_on_random_and_edge_scales() {
    let l = small();
    for seed in 1..20 {
        roundtrip(&l, &random_scales(&l, seed, 100 + seed as u8, 15));
        roundtrip(&l, &random_scales(&l, seed, 120, 3));
    }
    roundtrip(&l, &random_scales(&l, 7, 0, 15)); // base 0
    roundtrip(&l, &random_scales(&l, 7, 239, 15)); // up to 254
    roundtrip(&l, &l.scale_counts().map(|n| vec![254; n]));
    roundtrip(&l, &l.scale_counts().map(|n| vec![0; n]));
    // Exactly 16 values: base and base + 15 both present.
    let mut s = l.scale_counts().map(|n| vec![60u8; n]);
    s[1][5] = 75;
    roundtrip(&l, &s);
    // Odd scale counts leave the last high nibble zero.
    let odd = Scale4Layout {
        shape: ExpertShape { f: 33, lr: 32 },
        num_experts: 1,
    };
    assert_eq!(odd.scale_counts(), [33, 33, 33]);
    roundtrip(&odd, &random_scales(&odd, 9, 110, 15));
}

#[test]
fn nibble_order_is_low_first() {
    let (base, d) = encode_matrix(&[10, 13, 25, 10], 0, 0, 0).unwrap();
    assert_eq!((base, d.clone()), (10, vec![0x30, 0x0f]));
    assert_eq!(decode_matrix(10, &d, 4).unwrap(), vec![10, 13, 25, 10]);
    assert_eq!(
        exponent_table(127)[..2],
        [1.0f32.to_bits(), 2.0f32.to_bits()]
    );
}

#[test]
fn a_span_of_seventeen_is_an_error_naming_the_matrix() {
    let l = small();
    let mut s = l.scale_counts().map(|n| vec![60u8; n]);
    s[2][7] = 76;
    let err = encode_expert([&s[0], &s[1], &s[2]], 4, 9).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("layer 4 expert 9 w3"), "{msg}");
    assert!(msg.contains("76") && msg.contains("index 7"), "{msg}");
}

#[test]
fn corrupted_records_are_named_errors() {
    let l = small();
    let s = random_scales(&l, 5, 100, 15);
    let enc = encode_expert([&s[0], &s[1], &s[2]], 2, 3).unwrap();
    let rec = write_record(&l, 2, 3, &enc);
    let p = Path::new("L2.sc4");
    let check = |mutate: &dyn Fn(&mut Vec<u8>), want: &str| {
        let mut r = rec.clone();
        mutate(&mut r);
        let msg = parse_record(&l, 2, 3, &r, p).unwrap_err().to_string();
        assert!(msg.contains(want), "{want}: {msg}");
        assert!(
            msg.contains("layer 2 expert 3") && msg.contains("L2.sc4"),
            "{msg}"
        );
    };
    check(&|r| r[0] = b'X', "magic");
    check(&|r| r[8] = 3, "version");
    check(&|r| r[12] = 7, "layer is 7");
    check(&|r| r[20] = 1, "F is");
    check(&|r| r[64 + 16 + 4] = 1, "w2 rows");
    check(
        &|r| r[TABLES_AT + 64 * 2 + 4 * 3] ^= 1,
        "w3 exponent table entry 3",
    );
    check(&|r| r[RECORD_HEADER as usize + 10] ^= 0x10, "checksum");
    check(&|r| r[1000] = 1, "reserved");
    check(&|r| r.truncate(100), "bytes, expected");
    let n = rec.len();
    if (RECORD_HEADER + l.delta_bytes().iter().sum::<u64>()) < n as u64 {
        check(&|r| r[n - 1] = 1, "padding");
    }
    // A record of another expert is not accepted in this slot.
    let other = write_record(&l, 2, 4, &enc);
    assert!(
        parse_record(&l, 2, 3, &other, p)
            .unwrap_err()
            .to_string()
            .contains("expert is 4")
    );
}

#[test]
fn file_headers_are_validated() {
    let l = small();
    let h = file_header(&l, 7);
    assert_eq!(h.len() as u64, l.header_bytes());
    let p = Path::new("L7.sc4");
    check_file_header(&l, 7, &h, p).unwrap();
    for (at, want) in [
        (0, "magic"),
        (8, "version"),
        (12, "layout id"),
        (24, "layer"),
        (64 + 8, "record index of expert 1"),
    ] {
        let mut b = h.clone();
        b[at] ^= 1;
        let msg = check_file_header(&l, 7, &b, p).unwrap_err().to_string();
        assert!(
            msg.contains(want) && msg.contains("L7.sc4"),
            "{want}: {msg}"
        );
    }
    assert!(check_file_header(&l, 7, &h[..100], p).is_err());
}

/// Write raw expert files for layers 1 and 2 of a 3-layer model (layer 0 dense).
fn raw_experts(dir: &Path, l: &Scale4Layout) -> (RawSource, Vec<bool>) {
    let moe = vec![false, true, true];
    let raw_dir = dir.join("k3-experts");
    std::fs::create_dir_all(&raw_dir).unwrap();
    for layer in 1..3 {
        for e in 0..l.num_experts {
            let s = random_scales(l, (layer * 100 + e) as u64, 90 + e as u8, 15);
            let mut bytes = Vec::new();
            let codes = l.shape.tensor_bytes();
            for m in 0..3 {
                bytes.extend((0..codes[2 * m]).map(|i| (i * 7 + e as u64) as u8));
                bytes.extend(&s[m]);
            }
            std::fs::write(raw_dir.join(format!("L{layer}-E{e}.bin")), bytes).unwrap();
        }
    }
    let table = raw_file_table(&raw_dir, l.shape, &moe, l.num_experts).unwrap();
    (RawSource::new(table).unwrap(), moe)
}

#[test]
fn convert_verify_open_and_detect_corruption() {
    let d = tempfile::tempdir().unwrap();
    let l = small();
    let (raw, moe) = raw_experts(d.path(), &l);
    let out = d.path().join(SCALE4_DIR);
    std::fs::create_dir_all(&out).unwrap();
    let done = std::sync::atomic::AtomicU64::new(0);
    let mut shas = Vec::new();
    for layer in 1..3 {
        let sha = convert_layer(&out, &l, layer, &raw, 3, &|n| {
            done.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        })
        .unwrap();
        assert_eq!(sha, sha256_file(&out.join(layer_file_name(layer))).unwrap());
        shas.push((layer, sha));
    }
    assert_eq!(done.into_inner(), 2 * l.num_experts as u64);
    assert!(!out.join("L1.sc4.part").exists());
    // Without a manifest the sidecars are not usable.
    assert!(Scale4Sidecars::open(&out, l, &moe, "c0").is_err());
    Scale4Manifest::new(&l, "c0".into(), &shas)
        .write(&out)
        .unwrap();
    let sc = Scale4Sidecars::open(&out, l, &moe, "c0").unwrap();
    for layer in 1..3 {
        for e in 0..l.num_experts {
            assert_eq!(sc.scales(layer, e).unwrap(), raw.scales(layer, e).unwrap());
        }
    }
    // The compact blob: header, then codes and deltas per matrix at the layout's offsets.
    let enc = sc.record(1, 2).unwrap();
    let codes: Vec<Vec<u8>> = (0..3)
        .map(|m| vec![m as u8; l.shape.tensor_bytes()[2 * m] as usize])
        .collect();
    let blob = compact_blob(&l, 1, 2, [&codes[0], &codes[1], &codes[2]], &enc);
    assert_eq!(blob.len() as u64, l.blob_bytes());
    let o = l.blob_offsets();
    assert_eq!(&blob[o[3] as usize..o[4] as usize], &enc.deltas[1][..]);
    assert_eq!(blob[o[4] as usize], 2);
    // Wrong config digest, and a manifest missing a layer.
    let msg = Scale4Sidecars::open(&out, l, &moe, "other")
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("config_sha256"), "{msg}");
    Scale4Manifest::new(&l, "c0".into(), &shas[..1])
        .write(&out)
        .unwrap();
    let msg = Scale4Sidecars::open(&out, l, &moe, "c0")
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("MoE layers"), "{msg}");
    Scale4Manifest::new(&l, "c0".into(), &shas)
        .write(&out)
        .unwrap();
    // A flipped delta byte: verification and the runtime read both name the record.
    let p = out.join("L2.sc4");
    let mut bytes = std::fs::read(&p).unwrap();
    let at = (l.record_offset(4) + RECORD_HEADER + 3) as usize;
    bytes[at] ^= 0x01;
    std::fs::write(&p, &bytes).unwrap();
    let msg = verify_layer(&p, &l, 2, Some(&raw), 2)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("layer 2 expert 4") && msg.contains("checksum"),
        "{msg}"
    );
    let sc = Scale4Sidecars::open(&out, l, &moe, "c0").unwrap();
    assert!(sc.scales(2, 4).is_err());
    assert!(sc.scales(2, 3).is_ok());
    // A record that is valid but differs from the raw expert: re-encode other scales.
    let s = random_scales(&l, 4242, 80, 15);
    let enc = encode_expert([&s[0], &s[1], &s[2]], 2, 4).unwrap();
    bytes[l.record_offset(4) as usize..l.record_offset(5) as usize]
        .copy_from_slice(&write_record(&l, 2, 4, &enc));
    std::fs::write(&p, &bytes).unwrap();
    verify_layer(&p, &l, 2, None, 2).unwrap();
    let msg = verify_layer(&p, &l, 2, Some(&raw), 2)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("differ from the raw expert"), "{msg}");
    // Truncated file.
    std::fs::write(&p, &bytes[..bytes.len() - 1]).unwrap();
    let msg = verify_layer(&p, &l, 2, None, 2).unwrap_err().to_string();
    assert!(msg.contains("bytes, expected"), "{msg}");
    assert!(Scale4Sidecars::open(&out, l, &moe, "c0").is_err());
}

#[test]
fn a_raw_span_over_sixteen_fails_conversion_and_leaves_no_file() {
    let d = tempfile::tempdir().unwrap();
    let l = small();
    let (raw, _) = raw_experts(d.path(), &l);
    let p = d.path().join("k3-experts/L1-E2.bin");
    let mut b = std::fs::read(&p).unwrap();
    let w1_scales = l.shape.tensor_bytes()[0] as usize;
    b[w1_scales + 3] = 250;
    std::fs::write(&p, b).unwrap();
    let out = d.path().join("o");
    std::fs::create_dir_all(&out).unwrap();
    let msg = convert_layer(&out, &l, 1, &raw, 2, &|_| {})
        .unwrap_err()
        .to_string();
    assert!(msg.contains("layer 1 expert 2 w1"), "{msg}");
    assert!(!out.join("L1.sc4").exists());
    assert!(
        !out.join("L1.sc4.part").exists(),
        "the failed layer's .part stays"
    );
}

#[test]
fn scale4_experts_forward_every_hint_and_ask_the_inner_source_for_codes() {
    let d = tempfile::tempdir().unwrap();
    let l = small();
    let (raw, moe) = raw_experts(d.path(), &l);
    let out = d.path().join(SCALE4_DIR);
    std::fs::create_dir_all(&out).unwrap();
    let shas: Vec<(usize, String)> = (1..3)
        .map(|layer| {
            (
                layer,
                convert_layer(&out, &l, layer, &raw, 1, &|_| {}).unwrap(),
            )
        })
        .collect();
    Scale4Manifest::new(&l, "c0".into(), &shas)
        .write(&out)
        .unwrap();
    let sc = Scale4Sidecars::open(&out, l, &moe, "c0").unwrap();
    let log = HintLog::default();
    let src = Scale4Experts::new(Box::new(log.clone()), sc);
    log.check_forwarding(&src);
    // The codes come from the inner source: its error comes back unchanged.
    let e = crate::ExpertSource::expert(&src, 1, 2).unwrap_err();
    assert!(e.to_string().contains("expert 2 of layer 1: none"), "{e}");
}
