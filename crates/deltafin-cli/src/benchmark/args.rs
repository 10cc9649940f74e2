//! The `benchmark` command's flags.

use crate::RootArg;
use std::path::PathBuf;

fn positive_seconds(s: &str) -> std::result::Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !v.is_finite() || v <= 0.0 {
        return Err(format!(
            "`{s}`: the timeout must be a positive number of seconds"
        ));
    }
    Ok(v)
}

/// `benchmark` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchmarkArgs {
    /// Text to continue (raw completion) or the user message (with --chat).
    #[arg(long, value_name = "TEXT", default_value = "The capital of France is")]
    pub prompt: String,
    /// Wrap the prompt in K3's XTML chat template.
    #[arg(long)]
    pub chat: bool,
    /// Generated tokens per run.
    #[arg(long, visible_alias = "tokens", value_name = "N", default_value_t = 4,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_new: u64,
    /// Repetitions per arm [default: 3 with one arm; 4 with two or more, whose runs
    /// alternate in ABBA order and so need an even count].
    #[arg(long, visible_alias = "repetitions", value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..=10000))]
    pub reps: Option<u64>,
    /// Decode steps after the first token excluded from the steady-state figures.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub warmup_steps: u64,
    /// Kill a run that takes longer than this many seconds.
    #[arg(long, visible_alias = "timeout-seconds", value_name = "SECONDS",
          default_value = "3600", value_parser = positive_seconds)]
    pub timeout: f64,
    /// Arms as quoted, space-separated `KEY=VALUE` environment deltas (`""` = no change).
    #[arg(long, visible_alias = "config", value_name = "ENV", num_args = 1.., conflicts_with = "arm")]
    pub configs: Vec<String>,
    /// Names for the --configs arms, one each, unique.
    #[arg(long, visible_alias = "name", value_name = "NAME", num_args = 1.., requires = "configs")]
    pub names: Vec<String>,
    /// A named arm `NAME=KEY=VALUE [KEY=VALUE…]`; repeatable.
    #[arg(long, value_name = "NAME=ENV")]
    pub arm: Vec<String>,
    /// Exact completion-id oracle: a JSON array or comma-separated integers.
    #[arg(long, value_name = "IDS")]
    pub expect_token_ids: Option<String>,
    /// Exact completion-text oracle.
    #[arg(long, value_name = "TEXT")]
    pub expect_text: Option<String>,
    /// New evidence directory [default: bench-results/native-<UTC time>].
    #[arg(long, visible_alias = "output", value_name = "PATH")]
    pub output_dir: Option<PathBuf>,
    /// Continue after an invalid run.
    #[arg(long)]
    pub keep_going: bool,
    /// The install root, passed to every run as `--model-root` (resolved once, here).
    #[command(flatten)]
    pub root: RootArg,
    /// Compute device passed to every run (`--device`; auto, cpu, mps, cuda, cuda:N)
    /// [default: the runs read K3_DEV].
    #[arg(long, value_name = "DEV")]
    pub device: Option<String>,
    /// Expert backend passed to every run (`--expert-backend`; auto, cpu, metal, cuda)
    /// [default: the runs read K3_MOE].
    #[arg(long, value_name = "BACKEND")]
    pub expert_backend: Option<String>,
    /// Expert homes passed to every run (`--expert-homes DIR[,DIR…]`) [default: the runs
    /// read K3_EXPERT_HOMES]; an arm's `K3_EXPERT_HOMES=` compares drive sets.
    #[arg(long, value_name = "DIR[,DIR…]")]
    pub expert_homes: Option<String>,
}
