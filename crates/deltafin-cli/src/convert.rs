//! `deltafin convert-spine-int8`: quantize the BF16 spine of the shards into the row-int8
//! spine (`k3-resident-int8/`, docs/K3.md §12.6), resumably, or check it (`--check`).

use anyhow::{Result, bail};
use clap::Args;
use deltafin_experts::DirectIo;
use deltafin_experts::probe::{ProbeOptions, probe};
use deltafin_k3::checkpoint::{CONFIG_FILE, Checkpoint};
use deltafin_k3::install;
use deltafin_k3::spine_int8::{
    ConvertOptions, ConvertProgress, DEFAULT_CHECKPOINT_ROWS, INT8_DIR, MAX_CHECKPOINT_ROWS,
    convert_spine, verify_spine,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Args, Debug, Clone)]
pub struct ConvertSpineInt8Args {
    /// Install root holding config.json and the shards.
    #[arg(long, value_name = "PATH", default_value = ".")]
    pub model_root: PathBuf,
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

/// A byte progress bar on stderr, hidden when stderr is not a terminal.
pub(crate) fn progress_bar(total: u64) -> ProgressBar {
    let target = if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(total), target);
    if let Ok(style) = ProgressStyle::with_template(
        "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}",
    ) {
        bar.set_style(style);
    }
    bar
}

/// Sequential read bandwidth of the largest shard (up to 1 GB, the expert read path), GB/s.
pub(crate) fn disk_gbps(ckpt: &Checkpoint) -> Option<(f64, String)> {
    let largest: &Path = ckpt
        .shard_paths()
        .into_iter()
        .max_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))?;
    sequential_gbps(largest)
}

/// The sequential-read probe of `path`: up to 1 GB from its start in 8 MiB reads, four in
/// flight, O_DIRECT where the filesystem takes it (the expert read path). GB/s and the read
/// path (`direct` or `buffered (why)`).
pub(crate) fn sequential_gbps(path: &Path) -> Option<(f64, String)> {
    let opts = ProbeOptions {
        sequential_bytes: 1_000_000_000,
        sequential_chunk: 8 << 20,
        random_size: 1 << 20,
        random_count: 0,
        threads: 4,
        direct_io: DirectIo::Auto,
        seed: 1,
    };
    let r = probe(path, &opts).ok()?;
    (r.sequential_bytes > 0).then_some((r.sequential_gbps, r.io_path))
}

/// Run the command.
pub fn convert_spine_int8(args: &ConvertSpineInt8Args) -> Result<ExitCode> {
    let root = &args.model_root;
    if !root.join(CONFIG_FILE).is_file() {
        bail!(
            "no K3 model installed at {}: {CONFIG_FILE} is missing (pass --model-root PATH)",
            root.display()
        );
    }
    if args.checkpoint_rows == 0 || args.checkpoint_rows > MAX_CHECKPOINT_ROWS {
        bail!(
            "--checkpoint-rows {}: must be in 1…{MAX_CHECKPOINT_ROWS}",
            args.checkpoint_rows
        );
    }
    let ckpt = install::open_checkpoint(root)?;
    let mut bar: Option<ProgressBar> = None;
    let mut on_progress = |p: &ConvertProgress| {
        let b = bar.get_or_insert_with(|| progress_bar(p.total_bytes));
        b.set_position(p.done_bytes);
        b.set_message(p.tensor.to_string());
    };
    if args.check {
        let r = verify_spine(&ckpt, &mut on_progress)?;
        if let Some(b) = bar.take() {
            b.finish_and_clear();
        }
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
    if let Some(b) = bar.take() {
        b.finish_and_clear();
    }
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
    if r.read_bytes > 0
        && let Some((disk, io)) = disk_gbps(&ckpt)
    {
        println!(
            "disk: sequential shard read {disk:.3} GB/s ({io}); conversion ran at {:.0}% of it",
            100.0 * gb(r.read_bytes) / secs / disk.max(1e-9)
        );
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
