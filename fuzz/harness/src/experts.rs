//! Expert-store files: scale4 sidecars, router traces, the heat histogram.

use crate::{MAX_INPUT, capped, le_u32, sha256, with_scratch, write_scratch};
use deltafin_experts::ExpertShape;
use deltafin_experts::heat::{self, DIGEST_BYTES, HEADER_BYTES, HeatDims, HeatTable};
use deltafin_experts::rank::{RouteCounts, looks_like_trace, rank, read_trace};
use deltafin_experts::scale4::{
    MANIFEST_FILE, RECORD_HEADER, Scale4Layout, Scale4Manifest, Scale4Sidecars, check_file_header,
    decode_expert, encode_expert, file_header, layer_file_name, parse_record, write_record,
};
use std::path::Path;
use std::sync::OnceLock;

/// The sidecar layout the scale4 target uses: a small model with two experts per layer,
/// layer 0 dense and layer 1 MoE (the real layout's sizes come from `config.json` the same
/// way).
const LAYOUT: Scale4Layout = Scale4Layout {
    shape: ExpertShape { f: 64, lr: 32 },
    num_experts: 2,
};
const MOE_LAYERS: [bool; 2] = [false, true];
const SIDECAR_LAYER: usize = 1;
const CONFIG_SHA256: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// A valid layer file and manifest of [`LAYOUT`], built once with the product's writer.
struct ValidSidecar {
    layer_file: Vec<u8>,
    manifest: String,
}

fn valid_sidecar() -> &'static ValidSidecar {
    static VALID: OnceLock<ValidSidecar> = OnceLock::new();
    VALID.get_or_init(|| {
        let counts = LAYOUT.scale_counts();
        let mut layer_file = file_header(&LAYOUT, SIDECAR_LAYER);
        for e in 0..LAYOUT.num_experts {
            let scales: [Vec<u8>; 3] = std::array::from_fn(|m| {
                (0..counts[m])
                    .map(|i| 120 + ((i + e + m) % 16) as u8)
                    .collect()
            });
            let enc = encode_expert([&scales[0], &scales[1], &scales[2]], SIDECAR_LAYER, e)
                .unwrap_or_else(|err| panic!("fuzz harness setup: scale4 encoding: {err}"));
            layer_file.extend(write_record(&LAYOUT, SIDECAR_LAYER, e, &enc));
        }
        let digest: String = sha256(&[&layer_file])
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let m = Scale4Manifest::new(
            &LAYOUT,
            CONFIG_SHA256.to_string(),
            &[(SIDECAR_LAYER, digest)],
        );
        let manifest = serde_json::to_string_pretty(&m)
            .unwrap_or_else(|err| panic!("fuzz harness setup: scale4 manifest: {err}"));
        ValidSidecar {
            layer_file,
            manifest,
        }
    })
}

/// The valid layer file and manifest the scale4 target pairs its input with (the seeds of
/// its corpus are written from them).
#[doc(hidden)]
pub fn scale4_valid_files() -> (&'static [u8], &'static str) {
    let v = valid_sidecar();
    (&v.layer_file, &v.manifest)
}

/// A scale4 sidecar. Input that starts (after blanks) with `{` is a `scale4-manifest.json`
/// next to a valid layer file; anything else is a layer file (`L1.sc4`) next to a valid
/// manifest. The file header and every record are checked directly
/// ([`check_file_header`], [`parse_record`] → [`decode_expert`]), as given and with the
/// record checksums recomputed; then the directory is opened as the engine opens it
/// ([`Scale4Sidecars::open`]) and every expert's scales read, out-of-range ones included.
pub fn scale4_sidecar(data: &[u8]) {
    let data = capped(data, MAX_INPUT);
    let valid = valid_sidecar();
    let is_manifest = data.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    with_scratch(|dir| {
        if is_manifest {
            open_sidecars(dir, data, &valid.layer_file);
            return;
        }
        check_layer_file(data);
        open_sidecars(dir, valid.manifest.as_bytes(), data);
        if let Some(fixed) = fix_record_checksums(data) {
            check_layer_file(&fixed);
            open_sidecars(dir, valid.manifest.as_bytes(), &fixed);
        }
    });
}

fn check_layer_file(file: &[u8]) {
    let path = Path::new("L1.sc4");
    let _ = check_file_header(&LAYOUT, SIDECAR_LAYER, file, path);
    for e in 0..LAYOUT.num_experts {
        let at = LAYOUT.record_offset(e) as usize;
        let Some(rec) = file.get(at..at + LAYOUT.record_bytes() as usize) else {
            return;
        };
        if let Ok(enc) = parse_record(&LAYOUT, SIDECAR_LAYER, e, rec, path) {
            let _ = decode_expert(&LAYOUT, &enc);
        }
    }
}

fn open_sidecars(dir: &Path, manifest: &[u8], layer_file: &[u8]) {
    if write_scratch(dir, MANIFEST_FILE, manifest).is_none()
        || write_scratch(dir, &layer_file_name(SIDECAR_LAYER), layer_file).is_none()
    {
        return;
    }
    let Ok(sidecars) = Scale4Sidecars::open(dir, LAYOUT, &MOE_LAYERS, CONFIG_SHA256) else {
        return;
    };
    for layer in 0..=MOE_LAYERS.len() {
        for e in 0..=LAYOUT.num_experts {
            let _ = sidecars.scales(layer, e);
        }
    }
}

/// Each record's delta checksum (bytes 32..64: SHA-256 of its three delta regions)
/// recomputed over the input, so that mutations reach the checks behind it.
fn fix_record_checksums(file: &[u8]) -> Option<Vec<u8>> {
    let deltas: u64 = LAYOUT.delta_bytes().iter().sum();
    let mut b = file.to_vec();
    let mut changed = false;
    for e in 0..LAYOUT.num_experts {
        let at = LAYOUT.record_offset(e) as usize;
        let body = at + RECORD_HEADER as usize..at + (RECORD_HEADER + deltas) as usize;
        let Some(d) = file.get(body) else {
            break;
        };
        b[at + 32..at + 64].copy_from_slice(&sha256(&[d]));
        changed = true;
    }
    changed.then_some(b)
}

/// The shape the trace target reads traces for: MoE layers 1…4, 16 experts, top-2.
const TRACE_DIMS: HeatDims = HeatDims {
    layers: 4,
    experts: 16,
    top_k: 2,
};

/// A router trace (JSONL), read from a file as `deltafin warm-expert-cache` reads it
/// ([`looks_like_trace`], [`read_trace`]), then ranked.
pub fn expert_trace(data: &[u8]) {
    let data = capped(data, MAX_INPUT);
    with_scratch(|dir| {
        let Some(path) = write_scratch(dir, "router-trace.jsonl", data) else {
            return;
        };
        let _ = looks_like_trace(&path);
        let mut counts = RouteCounts::default();
        if read_trace(&path, TRACE_DIMS, &mut counts).is_ok() {
            let _ = rank(&counts, None);
        }
    });
}

/// Most heat slots the histogram target takes its shape from the input for.
const MAX_HEAT_SLOTS: u64 = 1 << 14;

/// The heat histogram (`expert_heat.v1.bin`) for the shape its header names (when small) or
/// for a fixed small shape, as given and with its SHA-256 recomputed: decoded
/// ([`HeatTable::decode`]) and the table used as the engine uses it (pin candidates,
/// ranking, encoding, another pass); then, as a file, read ([`heat::load`]) and merged into
/// by a recorder's flush ([`heat::merge_into_file`]), and read again.
pub fn expert_heat(data: &[u8]) {
    let data = capped(data, MAX_INPUT);
    let dims = heat_dims(data);
    let mut fixed = None;
    if data.len() >= HEADER_BYTES + DIGEST_BYTES {
        let body = data.len() - DIGEST_BYTES;
        let mut b = data.to_vec();
        b[body..].copy_from_slice(&sha256(&[&data[..body]]));
        fixed = Some(b);
    }
    for bytes in std::iter::once(data).chain(fixed.as_deref()) {
        decode_heat(bytes, dims);
        with_scratch(|dir| merge_heat(dir, bytes, dims));
    }
}

fn merge_heat(dir: &Path, bytes: &[u8], dims: HeatDims) {
    let Some(path) = write_scratch(dir, "expert_heat.v1.bin", bytes) else {
        return;
    };
    let _ = heat::load(&path, dims);
    let mut pending = HeatTable::empty(dims);
    pending.record_pass([(1usize, &[0usize][..])]);
    if heat::merge_into_file(&path, &pending).is_ok() {
        let _ = heat::load(&path, dims);
    }
}

fn heat_dims(data: &[u8]) -> HeatDims {
    let fallback = HeatDims {
        layers: 3,
        experts: 8,
        top_k: 2,
    };
    let (Some(layers), Some(experts), Some(top_k)) =
        (le_u32(data, 12), le_u32(data, 16), le_u32(data, 20))
    else {
        return fallback;
    };
    if u64::from(layers) * u64::from(experts) > MAX_HEAT_SLOTS {
        return fallback;
    }
    HeatDims {
        layers: layers as usize,
        experts: experts as usize,
        top_k: top_k as usize,
    }
}

fn decode_heat(bytes: &[u8], dims: HeatDims) {
    let Ok(mut table) = HeatTable::decode(bytes, dims) else {
        return;
    };
    let _ = table.pin_candidates();
    let _ = rank(&RouteCounts::default(), Some(&table));
    let encoded = table.encode();
    let _ = HeatTable::decode(&encoded, dims);
    table.record_pass([(1usize, &[0usize, 1][..])]);
    table.age(3);
}
