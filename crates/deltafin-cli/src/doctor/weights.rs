//! The checks that read the installed weights as `run` and `serve` would use them: every
//! routed expert's E8M0 scale bytes (a byte 0xFF is a NaN scale, refused when the expert is
//! used), and a short forward canary on the engine loaded exactly as `run` loads it (a NaN
//! or an infinity anywhere in the spine stops it, naming the layer). The sidecar records
//! are `super::load`'s scale4 check.
//!
//! They read: the scale bytes of every local expert (1/17 of the expert bytes: 84 GB on K3)
//! and, through the canary, every spine weight once. Nothing is written (the canary keeps no
//! heat, trace or prefix state) and nothing is fetched (a stream install's expert that is
//! not local yet stops the canary with an `info`).

use super::report::{Report, Status};
use deltafin_experts::scale4::RawSource;
use deltafin_k3::engine::{EngineBuilder, EngineConfig};
use deltafin_k3::error::ModelError;
use deltafin_k3::generate::greedy;
use deltafin_k3::weights::checkpoint::{Checkpoint, Layout};
use deltafin_store::experts::expert_table;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// The prompt of the forward canary (raw text: no chat markers needed).
const CANARY_PROMPT: &str = "deltafin doctor: a short forward canary through every layer";

/// Threads reading expert scales.
const SCAN_THREADS: usize = 4;

/// Both checks, in the order a damaged byte is cheapest to name: the scales (which name the
/// file), then the canary (which names the layer).
pub(super) fn weight_checks(r: &mut Report, ckpt: &Checkpoint, config: &EngineConfig) {
    expert_scales(r, ckpt);
    forward_canary(r, ckpt.root(), config);
}

/// A NaN scale found in an expert: where, and in which file.
struct NanScale {
    layer: usize,
    expert: usize,
    matrix: usize,
    group: usize,
    file: std::path::PathBuf,
}

/// Every local routed expert's three E8M0 scale arrays, read (not mapped) by a few threads:
/// a byte 0xFF (NaN) is a failure naming the expert and its file.
fn expert_scales(r: &mut Report, ckpt: &Checkpoint) {
    let fetch = format!(
        "`deltafin fetch-weights --model-root {}`",
        ckpt.root().display()
    );
    let opened = expert_table(ckpt)
        .map_err(|e| e.to_string())
        .and_then(|table| RawSource::new(table).map_err(|e| e.to_string()));
    let raw = match opened {
        Ok(raw) => raw,
        Err(e) => {
            r.fail(
                "expert scales",
                format!("run and serve would refuse to start: {e}"),
                format!("delete the file named and fetch it again with {fetch}"),
            );
            return;
        }
    };
    let experts: Vec<(usize, usize)> = raw
        .table
        .layers
        .iter()
        .enumerate()
        .filter_map(|(l, locs)| locs.as_ref().map(|locs| (l, locs.len())))
        .flat_map(|(l, n)| (0..n).map(move |e| (l, e)))
        .collect();
    let stream_install = ckpt.layout() == Layout::StreamInstall;
    let t0 = Instant::now();
    let next = AtomicUsize::new(0);
    let scanned = AtomicUsize::new(0);
    let found: Mutex<Option<NanScale>> = Mutex::new(None);
    let failed: Mutex<Option<String>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..SCAN_THREADS {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(l, e)) = experts.get(i) else { break };
                    let file = raw
                        .table
                        .get(l, e)
                        .map(|loc| raw.table.files[loc.file].clone())
                        .unwrap_or_default();
                    if stream_install && !file.is_file() {
                        continue; // fetched on demand
                    }
                    match raw.scales(l, e) {
                        Ok(scales) => {
                            scanned.fetch_add(1, Ordering::Relaxed);
                            for (m, s) in scales.iter().enumerate() {
                                if let Some(group) = s.iter().position(|&b| b == 0xff) {
                                    let mut f = found.lock().unwrap_or_else(|p| p.into_inner());
                                    // The first in (layer, expert) order, whatever the threads.
                                    if f.as_ref().is_none_or(|x| (l, e) < (x.layer, x.expert)) {
                                        *f = Some(NanScale {
                                            layer: l,
                                            expert: e,
                                            matrix: m + 1,
                                            group,
                                            file: file.clone(),
                                        });
                                    }
                                }
                            }
                        }
                        Err(err) => {
                            let mut f = failed.lock().unwrap_or_else(|p| p.into_inner());
                            f.get_or_insert_with(|| err.to_string());
                        }
                    }
                }
            });
        }
    });
    let failed = failed.into_inner().unwrap_or_else(|p| p.into_inner());
    let found = found.into_inner().unwrap_or_else(|p| p.into_inner());
    if let Some(why) = failed {
        r.fail(
            "expert scales",
            format!("run and serve would fail on an expert: {why}"),
            format!("delete the file named and fetch it again with {fetch}"),
        );
        return;
    }
    if let Some(n) = found {
        r.fail(
            "expert scales",
            format!(
                "expert {} of layer {}: E8M0 scale byte 0xFF (NaN) in w{} at group {} of {}: run and serve refuse this expert whenever it is routed",
                n.expert,
                n.layer,
                n.matrix,
                n.group,
                n.file.display()
            ),
            format!(
                "the file is damaged: delete {} and fetch it again with {fetch}",
                n.file.display()
            ),
        );
        return;
    }
    let scanned = scanned.into_inner();
    r.add(
        "expert scales",
        Status::Ok,
        format!(
            "{scanned} routed experts: every E8M0 scale finite ({:.1} MB read in {:.2} s){}",
            (scanned as u64 * raw.scale_bytes_per_expert()) as f64 / 1e6,
            t0.elapsed().as_secs_f64(),
            if scanned < experts.len() {
                format!("; {} not local yet", experts.len() - scanned)
            } else {
                String::new()
            }
        ),
    );
}

/// The engine loaded as `run` loads it with `config` (no heat, no trace, no expert fetch, the
/// weights read in place rather than copied into huge pages: the same values), then a short
/// prompt and one decode step: every value of every layer must be finite.
fn forward_canary(r: &mut Report, root: &Path, config: &EngineConfig) {
    let mut config = config.clone();
    config.heat.enabled = false;
    config.router_trace = None;
    // The same weights, read in place: a copy into huge pages changes no value and would
    // cost the doctor a second copy of the resident spine in memory.
    config.huge_pages = deltafin_k3::weights::resident::HugePages::Off;
    config.copy_resident_experts = false;
    let rd = root.display();
    let t0 = Instant::now();
    let loaded = match EngineBuilder::new(root).config(config).build() {
        Ok(l) => l,
        Err(e) => {
            r.fail(
                "forward canary",
                format!("run and serve would refuse to start: {e}"),
                "repair what the message names (the lines above name the fix for each part of the install)",
            );
            return;
        }
    };
    let model = &loaded.model;
    let ids = loaded.tokenizer.encode_ordinary(CANARY_PROMPT);
    let mut state = model.new_state();
    let result = model
        .prefill(&mut state, &ids)
        .and_then(|logits| model.decode(&mut state, greedy(&logits)));
    match result {
        Ok(_) => r.add(
            "forward canary",
            Status::Ok,
            format!(
                "{} prompt tokens and one decode step through all {} layers on the weights run and serve load: every value finite ({:.2} s with the load)",
                ids.len(),
                model.dims.num_layers(),
                t0.elapsed().as_secs_f64()
            ),
        ),
        Err(ModelError::Expert { layer, expert, .. })
            if loaded.checkpoint.layout() == Layout::StreamInstall
                && !loaded.checkpoint.expert_file(layer, expert).is_file() =>
        {
            r.add(
                "forward canary",
                Status::Info,
                format!(
                    "stopped at expert {expert} of layer {layer}, not fetched yet (run and serve fetch it on demand; the doctor reads nothing from the network)"
                ),
            )
        }
        Err(e @ ModelError::NonFinite { .. }) => r.fail(
            "forward canary",
            format!("run and serve would answer with an error: {e}"),
            format!(
                "a weight file is damaged: `deltafin setup --check --model-root {rd}` re-hashes the fetched files, `deltafin convert-spine-int8 --check --model-root {rd}` the int8 spine and its BF16 sources; delete the damaged file and fetch it again (`deltafin fetch-weights`), or convert again (`deltafin convert-spine-int8 --no-resume`)"
            ),
        ),
        Err(e) => r.fail(
            "forward canary",
            format!("run and serve would answer with an error: {e}"),
            "repair what the message names (the lines above name the fix for each part of the install)",
        ),
    }
}
