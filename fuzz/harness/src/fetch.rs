//! Downloads: the pinned source manifests and `Content-Range` answers.

use crate::{MAX_INPUT, capped, with_scratch, write_scratch};
use deltafin_fetch::hub::{HubResponse, check_range, parse_content_range};
use deltafin_fetch::manifest::{MANIFEST_FILES, Manifests};
use std::sync::OnceLock;

fn builtin() -> &'static Manifests {
    static BUILTIN: OnceLock<Manifests> = OnceLock::new();
    BUILTIN.get_or_init(|| {
        Manifests::builtin()
            .unwrap_or_else(|e| panic!("fuzz harness setup: the built-in manifests: {e}"))
    })
}

/// A `DELTAFIN_MANIFESTS` directory read by [`Manifests::from_dir`]. The first byte picks
/// which of the four manifests (`k3.json`, `dspark.json`, `qwen3-0.6b-base.json`,
/// `qwen3-1.7b-base.json`: `'0'`…`'3'`, modulo 4) the rest of the input replaces; the other
/// three are the built-in ones. An accepted K3 manifest is then used as the setup commands
/// use it (MoE layers, the shard of each, spine bytes and file sizes).
pub fn fetch_manifest(data: &[u8]) {
    let data = capped(data, MAX_INPUT);
    let Some((&first, text)) = data.split_first() else {
        return;
    };
    let slot = usize::from(first) % MANIFEST_FILES.len();
    with_scratch(|scratch| {
        let dir = scratch.join(format!("manifests-{slot}"));
        if !dir.is_dir() && builtin().write_dir(&dir).is_err() {
            return;
        }
        if write_scratch(&dir, MANIFEST_FILES[slot], text).is_none() {
            return;
        }
        let Ok(m) = Manifests::from_dir(&dir) else {
            return;
        };
        for layer in m.k3.moe_layers() {
            let _ = m.k3.shard_of_layer(layer);
        }
        for s in &m.k3.shards {
            let _ = (s.spine_bytes(), s.file_size());
        }
    });
}

/// A `Content-Range` header value (trimmed, as the client reads headers) parsed by
/// [`parse_content_range`], then checked by [`check_range`] against the range it names and
/// against a fixed one, on a 206 and on a 200 answer.
pub fn content_range(data: &[u8]) {
    let raw = String::from_utf8_lossy(capped(data, MAX_INPUT));
    let parsed = parse_content_range(raw.trim());
    for status in [206, 200] {
        let r = HubResponse {
            url: "https://hub.invalid/resolve/file".to_string(),
            status,
            commit: None,
            file_size: parsed.and_then(|c| c.2),
            etag: None,
            content_length: None,
            content_range: parsed,
            body: Box::new(std::io::empty()),
        };
        if let Some((a, b, _)) = parsed {
            let _ = check_range(&r, a, b);
        }
        let _ = check_range(&r, 0, 7);
    }
}
