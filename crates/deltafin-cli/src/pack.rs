//! `deltafin pack-spine`: build or verify the DFSP per-layer spine packs (docs/DFSP.md,
//! docs/K3.md §12.7) of the BF16 or int8 spine, resumably, with a progress bar and a disk-bandwidth
//! comparison.

use crate::RootArg;
use crate::convert::{LazyBar, print_disk_share};
use crate::session::check_root;
use anyhow::Result;
use clap::Args;
use deltafin_store::install;
use deltafin_store::spine_pack::{
    DEFAULT_CHUNK, PackOptions, PackProgress, default_pack_dir, pack_spine, verify_packs,
};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args, Debug, Clone)]
pub struct PackSpineArgs {
    #[command(flatten)]
    pub root: RootArg,
    /// Spine to pack: auto or int8 (the row-int8 spine), bf16 (the checkpoint's weights)
    /// [env: K3_SPINE; default: auto = int8].
    #[arg(long, value_name = "FORMAT")]
    pub spine: Option<String>,
    /// Pack root [default: <model-root>/k3-resident-packs for int8,
    /// <model-root>/k3-resident-packs-bf16 for bf16].
    #[arg(long, value_name = "PATH")]
    pub output: Option<PathBuf>,
    /// Only this zero-based layer (default: every layer and globals.dfsp).
    #[arg(long, value_name = "N")]
    pub layer: Option<usize>,
    /// Write nothing: re-hash every selected pack and check it against the model.
    #[arg(long)]
    pub verify_only: bool,
}

/// Run the command.
pub fn pack_spine_cmd(args: &PackSpineArgs) -> Result<ExitCode> {
    let root = &args.root.resolve();
    check_root(root)?;
    let format = crate::engine_config::resolve_spine(args.spine.as_deref())?;
    let output = args
        .output
        .clone()
        .unwrap_or_else(|| root.join(default_pack_dir(format)));
    let ckpt = install::open_checkpoint(root)?;
    let mut bar = LazyBar::default();
    let mut on_progress = |p: &PackProgress| bar.show(p.done_bytes, p.total_bytes, p.pack);
    if args.verify_only {
        let r = verify_packs(&ckpt, format, &output, args.layer, &mut on_progress)?;
        bar.clear();
        println!(
            "{} {} pack(s) OK under {}: {:.3} GB hashed in {:.2} s ({:.3} GB/s)",
            r.skipped,
            format.as_str(),
            output.display(),
            r.bytes as f64 / 1e9,
            r.seconds,
            r.bytes as f64 / 1e9 / r.seconds.max(1e-9)
        );
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!(
        "[deltafin] pack-spine: {} spine of {} → {}",
        format.as_str(),
        root.display(),
        output.display()
    );
    let opts = PackOptions {
        format,
        output: output.clone(),
        layer: args.layer,
        chunk_size: DEFAULT_CHUNK,
        stop_after_packs: None,
    };
    let r = pack_spine(&ckpt, &opts, &mut on_progress)?;
    bar.clear();
    for (file, why) in &r.rebuilt {
        eprintln!("[deltafin] rebuilt {file}: {why}");
    }
    let gb = r.bytes as f64 / 1e9;
    let secs = r.seconds.max(1e-9);
    println!(
        "packed {} of {} pack(s) ({} complete and verified, skipped; {} .part leftover(s) redone; {} rebuilt): {gb:.3} GB in {:.2} s ({:.3} GB/s)",
        r.written,
        r.packs,
        r.skipped,
        r.parts_redone,
        r.rebuilt.len(),
        r.seconds,
        gb / secs
    );
    if r.bytes > 0 {
        print_disk_share(&ckpt, "packing", gb / secs);
    }
    Ok(ExitCode::SUCCESS)
}
