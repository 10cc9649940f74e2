//! `deltafin convert-experts-scale4` (lossless 4-bit scale sidecars, docs/K3.md §12.4)
//! (the `K3_EXPERT_SCALE4` runtime switch is the engine's `Scale4Mode`).
//!
//! Conversion goes layer by layer; within a layer `--workers` threads encode experts into
//! their record slots of `L{layer}.sc4.part`, which is fsynced, verified record by record
//! against the raw scales, and renamed to `L{layer}.sc4`. A renamed layer is the durable
//! point: a rerun verifies each finished layer against the raw source and skips it, and
//! restarts an interrupted layer (`.part`) from scratch. The manifest is removed at the start
//! and written last, so sidecars are never active while incomplete.

use crate::RootArg;
use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use deltafin_experts::DirectIo;
use deltafin_experts::probe::{ProbeOptions, probe};
use deltafin_experts::scale4::{self, MANIFEST_FILE, RawSource, SCALE4_DIR, Scale4Manifest};
use deltafin_fetch::progress::stderr_bar;
use deltafin_store::checkpoint::EXPERT_DIR;
use deltafin_store::checkpoint::{CONFIG_FILE, Checkpoint};
use deltafin_store::experts::expert_table;
use deltafin_store::install;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

/// `convert-experts-scale4` flags.
#[derive(Args, Debug, Clone)]
pub struct Scale4Args {
    #[command(flatten)]
    pub root: RootArg,
    /// Where the raw experts are read: `k3-experts/` files when present there, else the
    /// release shards [default: the model root].
    #[arg(long, value_name = "PATH")]
    pub source_root: Option<PathBuf>,
    /// Where `L{layer}.sc4` and `scale4-manifest.json` are written
    /// [default: MODEL_ROOT/k3-experts-scale4].
    #[arg(long, value_name = "PATH")]
    pub output_root: Option<PathBuf>,
    /// Encoding threads.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u8).range(1..=16))]
    pub workers: u8,
    /// Discard finished layers and convert everything again.
    #[arg(long)]
    pub no_resume: bool,
}

/// What a conversion did.
#[derive(Clone, Debug, PartialEq)]
pub struct ConvertReport {
    pub layers_converted: usize,
    pub layers_verified_and_skipped: usize,
    pub experts: usize,
    pub sidecar_bytes_written: u64,
    pub raw_scale_bytes_read: u64,
    /// Raw expert bytes the converted layers stand for (codes + scales).
    pub expert_bytes_covered: u64,
    pub seconds: f64,
    /// The sequential-read probe of the first source file: (file, bytes, GB/s).
    pub probe: Option<(PathBuf, u64, f64)>,
}

use deltafin_store::experts::scale4_layout as layout_of;
use deltafin_store::filelock::Refused;

/// The converter's lock file in the output directory.
const LOCK_FILE: &str = ".convert.lock";

fn config_sha256(root: &Path) -> Result<String> {
    Ok(deltafin_store::experts::config_sha256(root)?)
}

/// `deltafin convert-experts-scale4`.
pub fn convert(args: &Scale4Args) -> Result<ExitCode> {
    let r = convert_with(args, None)?;
    let mb = |b: u64| b as f64 / 1e6;
    let s = r.seconds.max(1e-9);
    println!(
        "scale4: {} layers converted, {} verified and kept, {} experts; wrote {:.1} MB of sidecars in {:.2} s ({:.1} MB/s) for {:.1} MB of raw experts ({:.1} MB/s), read {:.1} MB of raw scales (with verification, {:.1} MB/s)",
        r.layers_converted,
        r.layers_verified_and_skipped,
        r.experts,
        mb(r.sidecar_bytes_written),
        r.seconds,
        mb(r.sidecar_bytes_written) / s,
        mb(r.expert_bytes_covered),
        mb(r.expert_bytes_covered) / s,
        mb(r.raw_scale_bytes_read),
        mb(r.raw_scale_bytes_read) / s,
    );
    if let Some((file, bytes, gbps)) = &r.probe {
        println!(
            "scale4: sequential read probe of {}: {:.1} MB at {:.1} MB/s (conversion reads only the scale bytes of each expert)",
            file.display(),
            mb(*bytes),
            gbps * 1e3
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The raw expert table for conversion (`--source-root`).
fn raw_source(model: &Checkpoint, source_root: &Path) -> Result<RawSource> {
    let (layout, moe) = layout_of(model.config());
    let files_dir = source_root.join(EXPERT_DIR);
    let table = if files_dir.is_dir() {
        scale4::raw_file_table(&files_dir, layout.shape, &moe, layout.num_experts)?
    } else if source_root == model.root() {
        expert_table(model)?
    } else {
        let src = Checkpoint::open(source_root).with_context(|| {
            format!(
                "the source checkpoint at {} is not usable",
                source_root.display()
            )
        })?;
        if config_sha256(source_root)? != config_sha256(model.root())? {
            bail!(
                "{} differs from {}: the source is another model",
                source_root.join(CONFIG_FILE).display(),
                model.root().join(CONFIG_FILE).display()
            );
        }
        expert_table(&src)?
    };
    Ok(RawSource::new(table)?)
}

/// Convert; `stop_after` stops after that many converted layers (an interruption, for tests).
pub fn convert_with(args: &Scale4Args, stop_after: Option<usize>) -> Result<ConvertReport> {
    let t0 = Instant::now();
    let root = &args.root.resolve();
    crate::session::check_root(root)?;
    let ckpt = install::open_checkpoint(root)?;
    let (layout, moe) = layout_of(ckpt.config());
    let source_root = args.source_root.clone().unwrap_or_else(|| root.clone());
    let raw = raw_source(&ckpt, &source_root)?;
    let out = args
        .output_root
        .clone()
        .unwrap_or_else(|| root.join(SCALE4_DIR));
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    // One converter per output directory, as the other converters: a second one would
    // remove the first one's `.part` files under it.
    let _lock = deltafin_store::filelock::lock_in(&out, LOCK_FILE).map_err(|r| match r {
        Refused::Held(path) => anyhow!(
            "{} is held by another convert-experts-scale4 (one converter per output directory); wait for it to finish",
            path.display()
        ),
        Refused::Io(path, e) => anyhow!("cannot lock {}: {e}", path.display()),
    })?;
    let manifest = out.join(MANIFEST_FILE);
    if manifest.exists() {
        std::fs::remove_file(&manifest)
            .with_context(|| format!("cannot remove {}", manifest.display()))?;
    }
    let layers: Vec<usize> = (0..moe.len()).filter(|&l| moe[l]).collect();
    let workers = args.workers as usize;
    let bar = stderr_bar(
        (layers.len() * layout.num_experts) as u64,
        "scale4 {bar:40} {pos}/{len} experts {per_sec} eta {eta} {msg}",
        true,
    );
    let mut report = ConvertReport {
        layers_converted: 0,
        layers_verified_and_skipped: 0,
        experts: 0,
        sidecar_bytes_written: 0,
        raw_scale_bytes_read: 0,
        expert_bytes_covered: 0,
        seconds: 0.0,
        probe: None,
    };
    let per_expert = raw.scale_bytes_per_expert();
    let mut shas = Vec::with_capacity(layers.len());
    for &l in &layers {
        bar.set_message(format!("layer {l}"));
        let path = out.join(scale4::layer_file_name(l));
        if args.no_resume && path.exists() {
            std::fs::remove_file(&path)
                .with_context(|| format!("cannot remove {}", path.display()))?;
        }
        if path.exists() {
            match scale4::verify_layer(&path, &layout, l, Some(&raw), workers) {
                Ok(sha) => {
                    report.layers_verified_and_skipped += 1;
                    report.raw_scale_bytes_read += per_expert * layout.num_experts as u64;
                    bar.inc(layout.num_experts as u64);
                    shas.push((l, sha));
                    continue;
                }
                Err(e) => bar.suspend(|| {
                    eprintln!(
                        "[scale4] {} is not valid ({e}); converting layer {l} again",
                        path.display()
                    )
                }),
            }
        }
        if stop_after == Some(report.layers_converted) {
            bail!(
                "conversion stopped after {} layers (interruption requested)",
                report.layers_converted
            );
        }
        let sha = scale4::convert_layer(&out, &layout, l, &raw, workers, &|n| bar.inc(n))?;
        report.layers_converted += 1;
        report.sidecar_bytes_written += layout.file_bytes();
        report.expert_bytes_covered += layout.shape.expert_bytes() * layout.num_experts as u64;
        report.raw_scale_bytes_read += 2 * per_expert * layout.num_experts as u64;
        shas.push((l, sha));
    }
    bar.finish_and_clear();
    report.experts = layers.len() * layout.num_experts;
    Scale4Manifest::new(&layout, config_sha256(root)?, &shas).write(&out)?;
    report.seconds = t0.elapsed().as_secs_f64();
    // The largest source file (the first of many per-expert files, which are all alike).
    let probe_file = if raw.table.files.len() <= RawSource::MAX_OPEN {
        raw.table
            .files
            .iter()
            .max_by_key(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
    } else {
        raw.table.files.first()
    };
    if let Some(first) = probe_file {
        let opts = ProbeOptions {
            sequential_bytes: 256 << 20,
            sequential_chunk: 8 << 20,
            random_size: 1,
            random_count: 0,
            threads: 1,
            direct_io: DirectIo::Auto,
            seed: 1,
        };
        if let Ok(p) = probe(first, &opts) {
            report.probe = Some((first.clone(), p.sequential_bytes, p.sequential_gbps));
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_experts::scale4::Scale4Sidecars;
    use deltafin_k3::engine::Scale4Mode;
    use deltafin_k3::engine::experts::wrap_scale4;
    use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
    use deltafin_k3::weights::loader::{CheckpointExperts, EngineOptions, load_model_with_experts};
    use std::sync::Arc;

    fn args(root: &Path) -> Scale4Args {
        Scale4Args {
            root: RootArg::at(root.to_path_buf()),
            source_root: None,
            output_root: None,
            workers: 3,
            no_resume: false,
        }
    }

    fn logits(ckpt: &Arc<Checkpoint>, mode: Scale4Mode) -> Result<Vec<Vec<f32>>> {
        let inner = Box::new(CheckpointExperts::new(ckpt.clone()));
        let (experts, _) = wrap_scale4(ckpt, inner, mode, &deltafin_k3::engine::Silent)?;
        let model = load_model_with_experts(ckpt.clone(), &EngineOptions::default(), experts)?;
        let mut st = model.new_state();
        [17u32, 2025, 9, 4242, 311, 77]
            .iter()
            .map(|&t| Ok(model.decode(&mut st, t)?))
            .collect()
    }

    #[test]
    fn sidecars_roundtrip_every_expert_and_give_bit_identical_logits() {
        let d = tempfile::tempdir().unwrap();
        synthesize(d.path(), &SynthSpec::new(SynthDims::tiny(), 5)).unwrap();
        let ckpt = Arc::new(Checkpoint::open(d.path()).unwrap());
        // Without sidecars: require fails, auto and off use the raw scales.
        let msg = format!("{:#}", logits(&ckpt, Scale4Mode::Require).err().unwrap());
        assert!(
            msg.contains("require") && msg.contains(MANIFEST_FILE),
            "{msg}"
        );
        let raw = logits(&ckpt, Scale4Mode::Off).unwrap();
        assert_eq!(logits(&ckpt, Scale4Mode::Auto).unwrap(), raw);

        let r = convert_with(&args(d.path()), None).unwrap();
        let (layout, moe) = layout_of(ckpt.config());
        let n_moe = moe.iter().filter(|&&m| m).count();
        assert_eq!(
            (r.layers_converted, r.experts),
            (n_moe, n_moe * layout.num_experts)
        );
        let sc = Scale4Sidecars::open(
            &d.path().join(SCALE4_DIR),
            layout,
            &moe,
            &config_sha256(d.path()).unwrap(),
        )
        .unwrap();
        for l in (0..moe.len()).filter(|&l| moe[l]) {
            for e in 0..layout.num_experts {
                let m = ckpt.expert_matrices(l, e).unwrap();
                let want = [m.w1.scales(), m.w2.scales(), m.w3.scales()];
                let got = sc.scales(l, e).unwrap();
                for k in 0..3 {
                    assert_eq!(got[k], want[k], "layer {l} expert {e} matrix {k}");
                }
            }
        }
        let with = logits(&ckpt, Scale4Mode::Require).unwrap();
        let bits = |v: &Vec<Vec<f32>>| -> Vec<Vec<u32>> {
            v.iter()
                .map(|r| r.iter().map(|x| x.to_bits()).collect())
                .collect()
        };
        assert_eq!(bits(&with), bits(&raw));
        assert_eq!(bits(&logits(&ckpt, Scale4Mode::Auto).unwrap()), bits(&raw));

        // A corrupted layer file: require fails at open (header) and resume rewrites it.
        let p = d.path().join(SCALE4_DIR).join("L1.sc4");
        let mut b = std::fs::read(&p).unwrap();
        b[9] ^= 1;
        std::fs::write(&p, &b).unwrap();
        assert!(logits(&ckpt, Scale4Mode::Require).is_err());
        assert_eq!(logits(&ckpt, Scale4Mode::Auto).unwrap(), raw);
        let r = convert_with(&args(d.path()), None).unwrap();
        assert_eq!(
            (r.layers_converted, r.layers_verified_and_skipped),
            (1, n_moe - 1)
        );
        assert_eq!(
            bits(&logits(&ckpt, Scale4Mode::Require).unwrap()),
            bits(&raw)
        );

        // Valid records holding other scales (every scale + 1) are used under `require`
        // (the logits move), and the converter's verification against the raw experts
        // rewrites the layer.
        let mut b = std::fs::read(&p).unwrap();
        for e in 0..layout.num_experts {
            let s = sc
                .scales(1, e)
                .unwrap()
                .map(|v| v.iter().map(|x| x + 1).collect::<Vec<u8>>());
            let enc = scale4::encode_expert([&s[0], &s[1], &s[2]], 1, e).unwrap();
            let at = layout.record_offset(e) as usize;
            b[at..at + layout.record_bytes() as usize]
                .copy_from_slice(&scale4::write_record(&layout, 1, e, &enc));
        }
        std::fs::write(&p, &b).unwrap();
        assert_ne!(
            bits(&logits(&ckpt, Scale4Mode::Require).unwrap()),
            bits(&raw)
        );
        let r = convert_with(&args(d.path()), None).unwrap();
        assert_eq!(r.layers_converted, 1);
        assert_eq!(
            bits(&logits(&ckpt, Scale4Mode::Require).unwrap()),
            bits(&raw)
        );
    }

    #[test]
    fn resume_after_a_stop_and_no_resume() {
        let d = tempfile::tempdir().unwrap();
        synthesize(d.path(), &SynthSpec::new(SynthDims::tiny(), 6)).unwrap();
        let out = d.path().join("sc4-out");
        let a = Scale4Args {
            output_root: Some(out.clone()),
            ..args(d.path())
        };
        let msg = convert_with(&a, Some(2)).unwrap_err().to_string();
        assert!(msg.contains("stopped after 2 layers"), "{msg}");
        assert!(!out.join(MANIFEST_FILE).exists());
        // An interrupted layer's .part is redone from scratch.
        std::fs::write(out.join("L3.sc4.part"), b"half").unwrap();
        let n_moe = Checkpoint::open(d.path())
            .map(|c| layout_of(c.config()).1.iter().filter(|&&m| m).count())
            .unwrap();
        let r = convert_with(&a, None).unwrap();
        assert_eq!(
            (r.layers_verified_and_skipped, r.layers_converted),
            (2, n_moe - 2)
        );
        assert!(out.join(MANIFEST_FILE).exists());
        assert!(!out.join("L3.sc4.part").exists());
        let first = std::fs::read(out.join(MANIFEST_FILE)).unwrap();
        let r = convert_with(
            &Scale4Args {
                no_resume: true,
                ..a.clone()
            },
            None,
        )
        .unwrap();
        assert_eq!(
            (r.layers_verified_and_skipped, r.layers_converted),
            (0, n_moe)
        );
        assert_eq!(std::fs::read(out.join(MANIFEST_FILE)).unwrap(), first);
        // A source root without experts or a checkpoint is a clear error.
        let bad = Scale4Args {
            source_root: Some(d.path().join("nowhere")),
            ..a
        };
        assert!(convert_with(&bad, None).is_err());
    }
}
