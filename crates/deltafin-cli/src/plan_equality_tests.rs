//! `deltafin run`, `deltafin serve` and a library user of the engine builder get the same
//! memory plan for the same flags. (The environment of the test process is the CLI's
//! input too; it must not set `K3_EXPERT_PIN_GB`, `K3_PROVIDER_RESIDENT_LAYERS` or
//! `DELTAFIN_HUGE_PAGES`, which a library user here does not ask for.)

use crate::{Cli, Command};
use clap::Parser;
use deltafin_k3::engine::{EngineBuilder, EngineConfig, MemoryPlan};
use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use deltafin_k3::text::chat::{ReasoningEffort, Thinking};
use deltafin_k3::weights::spine_int8::SpineFormat;
use std::path::Path;

/// The process RSS every plan is made with (measuring it three times would differ).
const RUNTIME: u64 = 40_000_000;
const BUDGET_GB: &str = "0.11";

fn run_config(root: &Path, extra: &[&str]) -> EngineConfig {
    let root = root.display().to_string();
    let mut argv = vec!["deltafin", "run", "--model-root", &root];
    argv.extend(["--memory-budget-gb", BUDGET_GB, "--spine", "bf16"]);
    argv.extend(extra);
    match Cli::try_parse_from(argv).unwrap().command {
        Some(Command::Run(args)) => {
            crate::run::engine_config(&args, Thinking::On(ReasoningEffort::Max)).unwrap()
        }
        other => panic!("{other:?}"),
    }
}

fn serve_config(root: &Path) -> EngineConfig {
    let root = root.display().to_string();
    let argv = [
        "deltafin",
        "serve",
        "--model-root",
        &root,
        "--memory-budget-gb",
        BUDGET_GB,
        "--spine",
        "bf16",
    ];
    match Cli::try_parse_from(argv).unwrap().command {
        Some(Command::Serve(args)) => crate::serve::engine_config(&args).unwrap(),
        other => panic!("{other:?}"),
    }
}

fn plan(builder: EngineBuilder) -> MemoryPlan {
    builder.runtime_bytes(RUNTIME).plan().unwrap().unwrap()
}

#[test]
fn run_serve_and_the_library_plan_alike() {
    let d = tempfile::tempdir().unwrap();
    synthesize(d.path(), &SynthSpec::new(SynthDims::tiny_streaming(), 3)).unwrap();
    let root = d.path();
    let run = run_config(root, &[]);
    let serve = serve_config(root);
    // The server reserves state for two generations (`serve::DEFAULT_SEQUENCES`); everything
    // else is configured alike.
    assert_eq!((run.sequences, serve.sequences), (1, 2));
    assert_eq!(
        run,
        EngineConfig {
            sequences: 1,
            ..serve.clone()
        }
    );
    let run_plan = plan(crate::session::builder(root, &run));
    let serve_plan = plan(crate::session::builder(root, &serve));
    let library_plan = plan(
        EngineBuilder::new(root)
            .memory_budget(Some(110_000_000))
            .spine(SpineFormat::Bf16),
    );
    let library_serve_plan = plan(
        EngineBuilder::new(root)
            .memory_budget(Some(110_000_000))
            .spine(SpineFormat::Bf16)
            .sequences(2),
    );
    assert_eq!(run_plan, library_plan);
    assert_eq!(serve_plan, library_serve_plan);
    // The second generation's state (a KDA state and a side context) comes out of the
    // expert cache.
    let second = serve_plan.state - run_plan.state;
    assert_eq!(serve_plan.sequences, 2);
    assert!(second > 0);
    assert_eq!(
        serve_plan,
        MemoryPlan {
            state: run_plan.state + second,
            sequences: 2,
            cache: run_plan.cache - second,
            ..run_plan.clone()
        }
    );

    // The budget makes the experts stream: the cache holds some of them, not all.
    assert_eq!(run_plan.budget, 110_000_000);
    assert!(run_plan.cache < run_plan.expert_bytes * run_plan.experts as u64);
    assert!(run_plan.cache >= run_plan.expert_bytes);
    // `run --max-new` knows its context and reserves less state: its plan differs.
    let short = plan(crate::session::builder(
        root,
        &run_config(root, &["--max-new", "4"]),
    ));
    assert!(short.context_tokens < run_plan.context_tokens);
    assert!(short.cache > run_plan.cache);
}
