//! `deltafin convert-spine-int8`: quantize the BF16 spine of the shards into the row-int8
//! spine (`k3-resident-int8/`, docs/K3.md §12.6), resumably, or check it (`--check`).

use crate::RootArg;
use crate::session::{check_root, progress_bar, sequential_gbps};
use anyhow::{Result, bail};
use clap::Args;
use deltafin_store::checkpoint::Checkpoint;
use deltafin_store::install;
use deltafin_store::spine_int8::{
    ConvertOptions, ConvertProgress, DEFAULT_CHECKPOINT_ROWS, INT8_DIR, MAX_CHECKPOINT_ROWS,
    convert_spine, verify_spine,
};
use indicatif::ProgressBar;
use std::path::Path;
use std::process::ExitCode;

#[derive(Args, Debug, Clone)]
pub struct ConvertSpineInt8Args {
    #[command(flatten)]
    pub root: RootArg,
    /// Durable resume interval in rows (1…1048576).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_CHECKPOINT_ROWS)]
    pub checkpoint_rows: usize,
    /// Start over: delete every int8 output and partial file first.
    #[arg(long, conflicts_with = "check")]
    pub no_resume: bool,
    /// Write nothing: re-hash every int8 file and its BF16 source against the receipts.
    #[arg(long)]
    pub check: bool,
}

/// The byte progress bar of a job that reports `(done, total, what)`: made at the first
/// report, when the total is known.
#[derive(Default)]
pub(crate) struct LazyBar(Option<ProgressBar>);

impl LazyBar {
    pub(crate) fn show(&mut self, done: u64, total: u64, what: &str) {
        let bar = self.0.get_or_insert_with(|| progress_bar(total));
        bar.set_position(done);
        bar.set_message(what.to_string());
    }

    /// Take the bar off the terminal (before the job's report is printed).
    pub(crate) fn clear(&mut self) {
        if let Some(bar) = self.0.take() {
            bar.finish_and_clear();
        }
    }
}

/// After a job (`what`) that read the shards at `gbps` GB/s: the disk's sequential read
/// bandwidth and the share of it the job ran at (nothing when the disk cannot be probed).
pub(crate) fn print_disk_share(ckpt: &Checkpoint, what: &str, gbps: f64) {
    if let Some((disk, io)) = disk_gbps(ckpt) {
        println!(
            "disk: sequential shard read {disk:.3} GB/s ({io}); {what} ran at {:.0}% of it",
            100.0 * gbps / disk.max(1e-9)
        );
    }
}

/// Sequential read bandwidth of the largest shard (up to 1 GB, the expert read path), GB/s.
fn disk_gbps(ckpt: &Checkpoint) -> Option<(f64, String)> {
    let largest: &Path = ckpt
        .shard_paths()
        .into_iter()
        .max_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))?;
    sequential_gbps(largest)
}

/// Run the command.
pub fn convert_spine_int8(args: &ConvertSpineInt8Args) -> Result<ExitCode> {
    let root = &args.root.resolve();
    check_root(root)?;
    if args.checkpoint_rows == 0 || args.checkpoint_rows > MAX_CHECKPOINT_ROWS {
        bail!(
            "--checkpoint-rows {}: must be in 1…{MAX_CHECKPOINT_ROWS}",
            args.checkpoint_rows
        );
    }
    let ckpt = install::open_checkpoint(root)?;
    let mut bar = LazyBar::default();
    let mut on_progress = |p: &ConvertProgress| bar.show(p.done_bytes, p.total_bytes, p.tensor);
    if args.check {
        let r = verify_spine(&ckpt, &mut on_progress)?;
        bar.clear();
        println!(
            "int8 spine OK: {} tensors, {:.3} GB hashed against their receipts and BF16 sources",
            r.tensors,
            r.bytes_hashed as f64 / 1e9
        );
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!(
        "[deltafin] convert-spine-int8: {} → {}/{INT8_DIR} (row-int8: one f16 scale per output row; the result is QUANTIZED and NOT weight-exact — use --spine bf16 for the original weights)",
        root.display(),
        root.display()
    );
    let opts = ConvertOptions {
        checkpoint_rows: args.checkpoint_rows,
        resume: !args.no_resume,
        stop_after_rows: None,
    };
    let r = convert_spine(&ckpt, &opts, &mut on_progress)?;
    bar.clear();
    let gb = |b: u64| b as f64 / 1e9;
    let secs = r.seconds.max(1e-9);
    println!(
        "converted {} of {} tensors ({} resumed, {} already complete): read {:.3} GB, wrote {:.3} GB in {:.2} s ({:.3} GB/s read)",
        r.converted,
        r.tensors,
        r.resumed,
        r.tensors - r.converted,
        gb(r.read_bytes),
        gb(r.written_bytes),
        r.seconds,
        gb(r.read_bytes) / secs
    );
    if r.read_bytes > 0 {
        print_disk_share(&ckpt, "conversion", gb(r.read_bytes) / secs);
    }
    let mut worst = r.weight_error.clone();
    worst.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mean = worst.iter().map(|w| w.1).sum::<f64>() / worst.len().max(1) as f64;
    println!(
        "weight error (relative RMS ‖W − Ŵ‖/‖W‖): mean {:.4}% over {} tensors; worst:",
        100.0 * mean,
        worst.len()
    );
    for (name, e) in worst.iter().take(5) {
        println!("  {:.4}%  {name}", 100.0 * e);
    }
    println!(
        "the int8 spine is quantized, not weight-exact; `--spine bf16` (K3_SPINE=bf16) runs the original weights. The router is never quantized."
    );
    Ok(ExitCode::SUCCESS)
}
