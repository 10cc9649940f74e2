//! Model files: safetensors headers, `config.json`, DFSP spine packs.

use crate::{MAX_INPUT, MAX_PACK_INPUT, capped, le_u64, sha256, with_scratch, write_scratch};
use deltafin_k3::config::K3Config;
use deltafin_k3::model::dims::ModelDims;
use deltafin_k3::model::inventory::{expert_layout, global_spine, layer_spine, shard_count};
use deltafin_k3::weights::spine_pack::{Codec, SUPERBLOCK, SpinePack};
use deltafin_tensor::{Bytes, DType, SafetensorsFile};

/// A safetensors file: parsed in memory ([`SafetensorsFile::from_bytes`]) and opened from a
/// file ([`SafetensorsFile::open`], the loader's path), then every tensor's range and bytes
/// looked up.
pub fn safetensors_header(data: &[u8]) {
    let data = capped(data, MAX_INPUT);
    if let Ok(f) = SafetensorsFile::from_bytes("fuzz.safetensors", Bytes::copy_from_slice(data)) {
        look_up(&f);
    }
    with_scratch(|dir| {
        if let Some(path) = write_scratch(dir, "fuzz.safetensors", data)
            && let Ok(f) = SafetensorsFile::open(&path)
        {
            look_up(&f);
        }
    });
}

fn look_up(f: &SafetensorsFile) {
    let _ = (f.metadata(), f.data_start(), f.path());
    for t in f.tensors() {
        let _ = (t.byte_len(), t.numel(), f.info(&t.name));
        let _ = f.absolute_range(&t.name);
        let _ = f.bytes(&t.name);
    }
}

/// `config.json` text → a validated [`K3Config`], then what the loader derives from it:
/// the model dimensions, the global and first and last layers' spine tensors, the last
/// expert's layout, the shard count, and the document written back.
pub fn config_json(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(capped(data, MAX_INPUT)) else {
        return;
    };
    let Ok(cfg) = K3Config::from_json_str(text) else {
        return;
    };
    let _ = cfg.to_json_value();
    let n = cfg.n_layers();
    for l in 0..n {
        let _ = (cfg.layer_kind(l), cfg.is_dense(l));
    }
    let _ = (
        cfg.kda_width(),
        cfg.shared_intermediate(),
        shard_count(&cfg),
    );
    let dims = ModelDims::from_config(&cfg);
    let _ = global_spine(&dims);
    for l in [0, n.saturating_sub(1)] {
        let _ = layer_spine(&dims, l);
    }
    let last = expert_layout(
        &cfg,
        n.saturating_sub(1),
        cfg.text.num_experts.saturating_sub(1),
    );
    let _ = last.total_bytes();
}

/// A DFSP spine pack, opened from a file as the loader opens it ([`SpinePack::open`]:
/// superblock, header and directory digests, every record), then fully verified and every
/// tensor viewed; as given and with its digests recomputed ([`fix_pack_digests`]).
pub fn dfsp_header(data: &[u8]) {
    let data = capped(data, MAX_PACK_INPUT);
    with_scratch(|dir| {
        open_pack(dir, data);
        if let Some(fixed) = fix_pack_digests(data) {
            open_pack(dir, &fixed);
        }
    });
}

fn open_pack(dir: &std::path::Path, bytes: &[u8]) {
    let Some(path) = write_scratch(dir, "layer-000.dfsp", bytes) else {
        return;
    };
    let Ok(pack) = SpinePack::open(&path) else {
        return;
    };
    let _ = pack.verify();
    let _ = pack.check_identity(pack.format(), pack.identity());
    let _ = (pack.id(), pack.layers(), pack.chunk_size(), pack.file_len());
    for t in pack.tensors() {
        let _ = pack.component_file_range(&t.data);
        let _ = pack.component_bytes(&t.data);
        if let Some(s) = &t.scales {
            let _ = pack.component_bytes(s);
        }
        let _ = pack.get(&t.name);
        match t.codec {
            Codec::Raw if t.source_dtype == DType::BF16 => {
                let _ = pack.bf16_matrix(&t.name);
            }
            Codec::Raw => {}
            Codec::RowI8F16Scale => {
                let _ = pack.row_int8_matrix(&t.name);
            }
        }
    }
}

/// The superblock's directory, payload, pack and header digests recomputed over `data`
/// where the superblock's geometry lets them be (the layout of
/// `deltafin_k3::weights::spine_pack`), so that mutations get past the digest checks.
/// Chunk and component digests are left as they are: a mutated superblock or record keeps
/// the payload, and with it those digests, intact.
fn fix_pack_digests(data: &[u8]) -> Option<Vec<u8>> {
    const DIRECTORY_DIGEST: usize = 288;
    const PAYLOAD_DIGEST: usize = 320;
    const PACK_DIGEST: usize = 352;
    const HEADER_DIGEST: usize = 384;
    const HEADER_END: usize = 416;
    if data.len() < SUPERBLOCK {
        return None;
    }
    let mut b = data.to_vec();
    let range = |off: u64, len: u64| -> Option<std::ops::Range<usize>> {
        let start = usize::try_from(off).ok()?;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        (end <= data.len()).then_some(start..end)
    };
    let dir = range(le_u64(&b, 56)?, le_u64(&b, 64)?);
    let payload = range(le_u64(&b, 72)?, le_u64(&b, 80)?);
    let dir_digest = dir.map(|r| sha256(&[&data[r]]));
    let payload_digest = payload.map(|r| sha256(&[&data[r]]));
    if let Some(d) = dir_digest {
        b[DIRECTORY_DIGEST..DIRECTORY_DIGEST + 32].copy_from_slice(&d);
    }
    if let Some(p) = payload_digest {
        b[PAYLOAD_DIGEST..PAYLOAD_DIGEST + 32].copy_from_slice(&p);
    }
    if let (Some(d), Some(p)) = (dir_digest, payload_digest) {
        let pack = sha256(&[&b[96..192], &d, &p]);
        b[PACK_DIGEST..PACK_DIGEST + 32].copy_from_slice(&pack);
    }
    let header = sha256(&[&b[..HEADER_DIGEST], &[0u8; 32], &b[HEADER_END..SUPERBLOCK]]);
    b[HEADER_DIGEST..HEADER_DIGEST + 32].copy_from_slice(&header);
    Some(b)
}
