//! Embed Kimi K3 in a program with a memory budget: load through the engine builder, encode
//! a prompt, decode greedily through the generation driver, print the completion.
//!
//! `cargo run --release -p deltafin-spec --example embed -- MODEL_ROOT [BUDGET_GB] [PROMPT]`

use deltafin_k3::engine::{EngineBuilder, LoadedEngine};
use deltafin_spec::Generation;
use std::error::Error;
use std::path::Path;

/// Continue `prompt` greedily for at most `max_new` tokens with the install at `root` held
/// to `budget_gb` GB of RAM (the routed experts stream from disk into what is left).
pub fn complete(
    root: &Path,
    budget_gb: f64,
    prompt: &str,
    max_new: usize,
) -> Result<String, Box<dyn Error>> {
    let engine = EngineBuilder::new(root)
        .memory_budget(Some((budget_gb * 1e9) as u64))
        .context_tokens(Some(prompt.len() + max_new)) // a token is at least one byte
        .build()?;
    continue_greedily(&engine, prompt, max_new)
}

/// Continue `prompt` greedily for at most `max_new` tokens with a loaded engine, within the
/// context the engine admits (the raw completion's stop ids end it early).
pub fn continue_greedily(
    engine: &LoadedEngine,
    prompt: &str,
    max_new: usize,
) -> Result<String, Box<dyn Error>> {
    let prompt_ids = engine.tokenizer.encode_ordinary(prompt);
    let out = Generation::new(&engine.model, &prompt_ids)
        .chat(false)
        .max_new(Some(max_new))
        .max_context(engine.admitted_context())
        .run(|_| Ok(()))?;
    Ok(engine.tokenizer.decode(&out.ids)?)
}

#[cfg_attr(test, allow(dead_code))]
fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let root = args
        .next()
        .ok_or("usage: embed MODEL_ROOT [BUDGET_GB] [PROMPT]")?;
    let budget_gb = args.next().map_or(Ok(64.0), |v| v.parse::<f64>())?;
    let prompt = args
        .next()
        .unwrap_or_else(|| "The capital of France is".into());
    println!(
        "{prompt}{}",
        complete(Path::new(&root), budget_gb, &prompt, 32)?
    );
    Ok(())
}
