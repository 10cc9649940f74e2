//! What `run` and `serve` would load from an install that opened, with the same model flags
//! and environment: their settings, the device, the spine (format, packs, int8 files), the
//! scale4 sidecars and the memory plan ([`super::plan`]). Each decision is the loader's own
//! (`deltafin_k3::engine`), so a `fail` here is a start-up `run` and `serve` would refuse.

use super::memory::gb;
use super::report::{Report, Status};
use crate::ModelArgs;
use deltafin_experts::scale4::{SCALE4_DIR, Scale4Sidecars};
use deltafin_k3::engine::{EngineConfig, Scale4Mode};
use deltafin_k3::weights::checkpoint::{Checkpoint, Layout};
use deltafin_k3::weights::spine_int8::{INT8_DIR, Int8Spine, SpineFormat, tensor_dir};
use deltafin_k3::weights::spine_pack::{PackSet, default_pack_dir};

/// The settings `run` and `serve` resolve from `model` and the environment, then the checks
/// of what they would load from `ckpt` with them.
pub(super) fn load_checks(
    r: &mut Report,
    ckpt: &Checkpoint,
    model: &ModelArgs,
    available: Option<u64>,
) {
    let settings = crate::engine_config::engine_config(model, None, None).and_then(|c| {
        let (_, origin) = crate::engine_config::resolve_spine_choice(model.spine.as_deref())?;
        Ok((c, origin))
    });
    let (config, origin) = match settings {
        Ok(v) => v,
        Err(e) => {
            r.fail(
                "settings",
                format!(
                    "run and serve would refuse to start: {}",
                    crate::errtext::describe(&e)
                ),
                "correct the flag or environment variable named",
            );
            return;
        }
    };
    device_check(r, &config);
    spine_check(r, ckpt, config.spine, &origin);
    scale4_check(r, ckpt, config.scale4);
    super::plan::plan_checks(r, ckpt, &config, available, None);
    // The weights themselves, once everything around them would load.
    if r.problems() == 0 {
        super::weights::weight_checks(r, ckpt, &config);
    }
}

/// Where the products would run (`--device`, `--expert-backend`): the loader's own choice,
/// which opens a CUDA device when one is asked for.
fn device_check(r: &mut Report, config: &EngineConfig) {
    match deltafin_k3::engine::placement::select(config.device, config.expert_backend) {
        Ok(p) => r.add("device", Status::Ok, p.line),
        Err(e) => r.fail(
            "device",
            format!("run and serve would refuse to start: {e}"),
            "pass --device cpu (or auto) and --expert-backend cpu (or auto), or provide what the message names",
        ),
    }
}

/// The spine `run` and `serve` would multiply with: `format` (chosen by `origin`) from the
/// complete DFSP packs of that format, else the int8 files or the original weights, as the
/// loader picks them; and the spine directories present that this choice leaves unused.
fn spine_check(r: &mut Report, ckpt: &Checkpoint, format: SpineFormat, origin: &str) {
    let root = ckpt.root();
    let rd = root.display();
    let weights = match ckpt.layout() {
        Layout::Shards => "the release shards",
        Layout::StreamInstall => "k3-resident/tensors/ of the stream install",
    };
    spine_unused(r, root, format, origin);
    if deltafin_k3::engine::check_spine(root, format).is_err() {
        r.fail(
            "spine",
            format!(
                "{origin} loads the row-int8 spine, but it is not converted ({} is missing): run and serve would refuse to start",
                tensor_dir(root).display()
            ),
            format!(
                "convert it once with `deltafin convert-spine-int8 --model-root {rd}` (no network; quantized, not weight-exact), or run with --spine bf16 (K3_SPINE=bf16) for the original BF16 weights"
            ),
        );
        return;
    }
    let packs = default_pack_dir(format);
    let opened = PackSet::open_if_complete(ckpt, format);
    if matches!(opened, Ok(None)) && root.join(packs).is_dir() {
        r.add(
            "spine packs",
            Status::Info,
            format!(
                "{packs}/ incomplete: not used until `deltafin pack-spine --model-root {rd}` completes it"
            ),
        );
    }
    match (opened, format) {
        (Ok(Some(_)), _) => r.add(
            "spine",
            Status::Ok,
            format!(
                "{origin}: the {} spine from the complete DFSP packs in {packs}/, which run and serve load instead of {}",
                format.as_str(),
                if format == SpineFormat::Int8 {
                    "k3-resident-int8/"
                } else {
                    weights
                }
            ),
        ),
        (Err(e), _) => r.fail(
            "spine",
            format!(
                "run and serve would refuse to start: the DFSP packs in {packs}/ are complete but not valid for this model: {e}"
            ),
            format!(
                "rebuild them with `deltafin pack-spine --model-root {rd}{}`, or remove {packs}/",
                if format == SpineFormat::Bf16 {
                    " --spine bf16"
                } else {
                    ""
                }
            ),
        ),
        (Ok(None), SpineFormat::Int8) => match Int8Spine::open(root, ckpt.config()) {
            Ok(s) => r.add(
                "spine",
                Status::Ok,
                format!(
                    "{origin}: the row-int8 spine in {INT8_DIR}/ ({} matrices, {:.2} GB, every receipt valid), which run and serve load (quantized, not weight-exact)",
                    s.len(),
                    gb(s.bytes)
                ),
            ),
            Err(e) => r.fail(
                "spine",
                format!("{origin}: run and serve would refuse to start: {e}"),
                format!(
                    "finish the conversion with `deltafin convert-spine-int8 --model-root {rd}` (`--no-resume` redoes it), or run with --spine bf16 (K3_SPINE=bf16)"
                ),
            ),
        },
        (Ok(None), SpineFormat::Bf16) => r.add(
            "spine",
            Status::Ok,
            format!("{origin}: the original BF16 weights from {weights} (weight-exact)"),
        ),
    }
}

/// The spine directories present that `format` does not read.
fn spine_unused(r: &mut Report, root: &std::path::Path, format: SpineFormat, origin: &str) {
    if format == SpineFormat::Bf16 && root.join(INT8_DIR).is_dir() {
        r.add(
            "int8 spine",
            Status::Info,
            format!("{INT8_DIR}/ present but not used: {origin} loads the BF16 weights"),
        );
    }
    for other in [SpineFormat::Int8, SpineFormat::Bf16] {
        let dir = default_pack_dir(other);
        if other != format && root.join(dir).is_dir() {
            r.add(
                "spine packs",
                Status::Info,
                format!(
                    "{dir}/ ({} packs) present but not used: {origin} loads the {} spine",
                    other.as_str(),
                    format.as_str()
                ),
            );
        }
    }
}

/// The scale4 sidecars under `K3_EXPERT_SCALE4` (`mode`): used when complete and valid
/// (`auto`, `require`), else the raw scales (`auto`) or a refusal (`require`).
fn scale4_check(r: &mut Report, ckpt: &Checkpoint, mode: Scale4Mode) {
    let root = ckpt.root();
    let dir = root.join(SCALE4_DIR);
    let convert = format!(
        "`deltafin convert-experts-scale4 --model-root {}`",
        root.display()
    );
    if mode == Scale4Mode::Off {
        if dir.is_dir() {
            r.add(
                "scale4",
                Status::Info,
                format!("{SCALE4_DIR}/ present but not used (K3_EXPERT_SCALE4=off)"),
            );
        }
        return;
    }
    if mode == Scale4Mode::Auto && !dir.exists() {
        return;
    }
    let (layout, moe) = deltafin_store::experts::scale4_layout(ckpt.config());
    let opened = deltafin_store::experts::config_sha256(root)
        .map_err(|e| e.to_string())
        .and_then(|sha| Scale4Sidecars::open(&dir, layout, &moe, &sha).map_err(|e| e.to_string()));
    let var = if mode == Scale4Mode::Require {
        "K3_EXPERT_SCALE4=require"
    } else {
        "K3_EXPERT_SCALE4=auto, the default"
    };
    match (opened.map(|_| damaged_record(&dir, layout, &moe)), mode) {
        (Ok(None), _) => r.add(
            "scale4",
            Status::Ok,
            format!("{SCALE4_DIR}/ complete and valid, every record verified: the routed experts take their scales from it ({var})"),
        ),
        (Ok(Some(e)), Scale4Mode::Require) => r.fail(
            "scale4",
            format!("run and serve would fail on the experts of a damaged record ({var}): {e}"),
            format!("{convert} rewrites the damaged layer"),
        ),
        (Ok(Some(e)), _) => r.warn(
            "scale4",
            format!("{e}: run and serve use the raw scales of that layer's damaged records ({var})"),
            format!("{convert} rewrites the damaged layer"),
        ),
        (Err(e), Scale4Mode::Require) => r.fail(
            "scale4",
            format!("run and serve would refuse to start: {var} but {SCALE4_DIR}/ is not complete and valid: {e}"),
            format!("complete it with {convert}, or set K3_EXPERT_SCALE4=auto"),
        ),
        (Err(e), _) => r.add(
            "scale4",
            Status::Info,
            format!("{SCALE4_DIR}/ present but not used ({e}); the routed experts use their raw scales ({convert} completes it)"),
        ),
    }
}

/// The first sidecar layer file (of the MoE layers `moe`) whose header or records fail
/// their checks, as the converter verifies them (record checksums; not against the raw
/// experts).
fn damaged_record(
    dir: &std::path::Path,
    layout: deltafin_experts::scale4::Scale4Layout,
    moe: &[bool],
) -> Option<String> {
    (0..moe.len()).filter(|&l| moe[l]).find_map(|l| {
        let path = dir.join(deltafin_experts::scale4::layer_file_name(l));
        deltafin_experts::scale4::verify_layer(&path, &layout, l, None, 4)
            .err()
            .map(|e| e.to_string())
    })
}
