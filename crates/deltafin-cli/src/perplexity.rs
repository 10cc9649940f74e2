//! `deltafin perplexity`: teacher-forced scoring of a text through the batched prefill path.

use crate::PerplexityArgs;
use crate::session;
use anyhow::{Context, Result, bail};
use deltafin_k3::generate::score;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use std::process::ExitCode;
use std::time::Instant;

pub fn perplexity(args: &PerplexityArgs) -> Result<ExitCode> {
    let bytes = std::fs::read(&args.file)
        .with_context(|| format!("cannot read {}", args.file.display()))?;
    let text = String::from_utf8(bytes)
        .map_err(|e| anyhow::anyhow!("{} is not valid UTF-8: {e}", args.file.display()))?;
    let config = crate::engine_config::engine_config(&args.model, None, None)?;
    let interrupt = session::interrupt_flag();
    let root = args.model.root();
    let s = session::load(&root, &config)?;
    session::report_memory_plan(&s.model, s.plan.as_ref());
    let mut tokens = s.tokenizer.encode_ordinary(&text);
    if let Some(m) = args.max_tokens {
        tokens.truncate(usize::try_from(m).unwrap_or(usize::MAX));
    }
    if tokens.len() < 2 {
        bail!(
            "{} encodes to {} token(s); perplexity needs at least 2",
            args.file.display(),
            tokens.len()
        );
    }
    let max_context = s.checkpoint.config().text.max_position_embeddings;
    if tokens.len() > max_context {
        bail!(
            "{} tokens exceed the model context of {max_context}; pass --max-tokens",
            tokens.len()
        );
    }
    let chunk = usize::try_from(args.chunk).unwrap_or(512);
    eprintln!(
        "[deltafin] perplexity {} spine={} model_root={} tokens={} chunk={chunk}",
        session::backend_description(),
        s.spine.as_str(),
        root.display(),
        tokens.len()
    );
    let bar = if tokens.len() > chunk && !args.json {
        let b = ProgressBar::new((tokens.len() - 1) as u64);
        b.set_style(
            ProgressStyle::with_template(
                "{bar:40} {pos}/{len} tokens [{elapsed_precise} < {eta_precise}] {per_sec}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Some(b)
    } else {
        None
    };
    let t = Instant::now();
    // On a rayon worker, as in `run` (the kernels' loops then start by work-stealing).
    let result = deltafin_kernels::pool::run_warm(|| {
        score(
            &s.model,
            &tokens,
            chunk,
            args.plot.is_some(),
            &interrupt,
            |done, _| {
                if let Some(b) = &bar {
                    b.set_position(done as u64);
                }
            },
        )
    })?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let secs = t.elapsed().as_secs_f64();
    if s.plan.is_some() {
        session::report_expert_stats(&s.model);
    }
    let interrupted = result.tokens_scored + 1 < tokens.len();
    if let (Some(path), Some(logprobs)) = (&args.plot, &result.logprobs) {
        let svg = loss_svg(logprobs)?;
        std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))?;
    }
    let rate = result.tokens_scored as f64 / secs.max(1e-9);
    if args.json {
        println!(
            "{}",
            json!({
                "file": args.file.display().to_string(),
                "tokens": tokens.len(),
                "tokens_scored": result.tokens_scored,
                "mean_nll": result.mean_nll(),
                "perplexity": result.perplexity(),
                "seconds": secs,
                "tokens_per_second": rate,
                "chunk": chunk,
                "interrupted": interrupted,
            })
        );
    } else {
        println!("tokens scored: {}", result.tokens_scored);
        println!("mean NLL:      {:.6} nats/token", result.mean_nll());
        println!("perplexity:    {:.4}", result.perplexity());
        println!("rate:          {rate:.1} tokens/s ({secs:.2} s)");
        if interrupted {
            println!(
                "(interrupted: only the first {} positions were scored)",
                result.tokens_scored
            );
        }
    }
    Ok(if interrupted {
        ExitCode::from(130)
    } else {
        ExitCode::SUCCESS
    })
}

/// The most points the loss plot draws per series; longer texts are averaged in buckets.
const PLOT_POINTS: usize = 2000;

/// The SVG of `--plot`: the negative log-likelihood of each scored position (bucket means
/// past [`PLOT_POINTS`] positions) and the running mean, against the position.
fn loss_svg(logprobs: &[f64]) -> Result<String> {
    let bucket = logprobs.len().div_ceil(PLOT_POINTS).max(1);
    let mut sum = 0.0;
    let mut per_position = Vec::new();
    let mut running = Vec::new();
    for (k, chunk) in logprobs.chunks(bucket).enumerate() {
        let nll: f64 = chunk.iter().map(|lp| -lp).sum();
        sum += nll;
        // Position of the bucket's last token (1-based: position 1 predicts token 2).
        let x = (k * bucket + chunk.len()) as f64;
        per_position.push((x, nll / chunk.len() as f64));
        running.push((x, sum / x));
    }
    let per = if bucket == 1 {
        "negative log-likelihood".to_string()
    } else {
        format!("mean negative log-likelihood of {bucket} positions")
    };
    crate::plot::svg(&crate::plot::Chart {
        title: "deltafin perplexity: loss along the text",
        x_desc: "position",
        y_desc: "nats per token",
        series: vec![
            crate::plot::Series {
                legend: Some(per),
                color: 0,
                mark: crate::plot::Mark::Dots,
                points: per_position,
            },
            crate::plot::Series {
                legend: Some("running mean".into()),
                color: 1,
                mark: crate::plot::Mark::Line,
                points: running,
            },
        ],
        empty: "no position was scored",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loss_plot_buckets_long_texts() {
        let short = loss_svg(&[-1.0, -3.0]).unwrap();
        assert_eq!(short.matches("<circle").count(), 2 + 1, "{short}");
        assert!(
            short.contains("\nnegative log-likelihood\n</text>"),
            "{short}"
        );
        let long: Vec<f64> = (0..5000).map(|i| -((i % 7) as f64)).collect();
        let svg = loss_svg(&long).unwrap();
        // 5000 positions in buckets of 3: 1667 dots and the legend's swatch.
        assert_eq!(svg.matches("<circle").count(), 1667 + 1);
        assert!(svg.contains("mean negative log-likelihood of 3 positions"));
    }
}
