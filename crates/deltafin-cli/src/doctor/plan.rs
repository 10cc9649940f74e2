//! The memory plan `run` and `serve` would load with, and the longest context it admits:
//! the engine builder's own planner inputs ([`deltafin_k3::engine::EngineBuilder::plan_inputs`])
//! for the configuration those commands resolve, so the figures are the plan `run` prints
//! at start-up (docs/CLI.md, "deltafin doctor").

use super::memory::gb;
use super::report::{Report, Status};
use deltafin_experts::DirectIo;
use deltafin_k3::engine::EngineConfig;
use deltafin_k3::engine::plan::{PlanError, PlanInputs, max_context_tokens, plan_memory};
use deltafin_k3::weights::checkpoint::Checkpoint;
use serde_json::json;

/// The memory plan of `config` for the install `ckpt`: with a memory budget, the plan `run`
/// and `serve` would use (a plan that cannot be made is a failure, as it is theirs); without
/// one, what the memory `available` now would admit under the same planner. `runtime`: the
/// process RSS to plan with (`None`: this process's, measured as `run` measures its own).
pub(super) fn plan_checks(
    r: &mut Report,
    ckpt: &Checkpoint,
    config: &EngineConfig,
    available: Option<u64>,
    runtime: Option<u64>,
) {
    let limit = ckpt.config().text.max_position_embeddings;
    let budget = match (config.memory_budget, available) {
        (Some(b), _) => b,
        (None, Some(a)) => a,
        (None, None) => {
            r.add(
                "admitted context",
                Status::Warn,
                "unknown: no memory budget (--memory-budget-gb, K3_MEMORY_BUDGET_GB) and the free memory could not be read",
            );
            return;
        }
    };
    let mut builder = crate::session::builder(ckpt.root(), config);
    if let Some(rss) = runtime {
        builder = builder.runtime_bytes(rss);
    }
    let inputs = match builder.plan_inputs(budget) {
        Ok(i) => i,
        Err(e) => {
            r.fail(
                "memory plan",
                format!(
                    "run and serve would refuse to start: {}",
                    crate::errtext::describe(&crate::session::cli_error(e))
                ),
                "correct the setting named, or repair the install as the checkpoint line says",
            );
            return;
        }
    };
    let admitted = max_context_tokens(&inputs, limit);
    r.admitted_context = admitted.map(|n| n as u64);
    r.facts
        .insert("memory_plan_budget_bytes".into(), json!(budget));
    r.facts.insert(
        "memory_plan_budget_from".into(),
        json!(if config.memory_budget.is_some() {
            "memory budget"
        } else {
            "memory available"
        }),
    );
    match config.memory_budget {
        Some(_) => budget_checks(r, config, &inputs, admitted, limit, available),
        None => no_budget_checks(r, config, &inputs, admitted, limit),
    }
}

/// With a budget: the plan `run` and `serve` would use, a budget beyond the memory
/// available, and the longest context the budget holds.
fn budget_checks(
    r: &mut Report,
    config: &EngineConfig,
    inputs: &PlanInputs,
    admitted: Option<usize>,
    limit: usize,
    available: Option<u64>,
) {
    let budget = inputs.budget;
    let plan = match plan_memory(inputs) {
        Ok(p) => p,
        Err(e) => {
            let shorter = admitted.map_or(String::new(), |n| {
                format!("; `run --max-new` fits a context of at most {n} tokens in it")
            });
            let fix = match &e {
                PlanError::TooSmall { need, .. } => format!(
                    "raise --memory-budget-gb (or K3_MEMORY_BUDGET_GB) to at least {}{shorter}",
                    gb_up(*need)
                ),
                PlanError::PinTooLarge { .. } => {
                    "lower K3_EXPERT_PIN_GB, or raise --memory-budget-gb".to_string()
                }
            };
            r.fail(
                "memory plan",
                format!("run and serve would refuse to start: {e}"),
                fix,
            );
            return;
        }
    };
    r.facts
        .insert("reserved_context".into(), json!(plan.context_tokens));
    let io = match config.stream.direct_io {
        DirectIo::Auto => "O_DIRECT where allowed",
        DirectIo::Off => "page cache",
    };
    r.add(
        "memory plan",
        Status::Ok,
        plan.describe(
            io,
            config.stream.read_threads,
            &crate::session::pilot_gate_setting(),
        ),
    );
    if let Some(a) = available
        && budget > a
    {
        r.warn(
            "memory budget",
            format!(
                "the {:.3} GB budget exceeds the {:.3} GB available now",
                gb(budget),
                gb(a)
            ),
            "lower --memory-budget-gb (K3_MEMORY_BUDGET_GB) to what the host can give, or free memory: beyond it the system swaps or stops the process",
        );
    }
    if let Some(n) = admitted {
        r.add(
            "admitted context",
            Status::Ok,
            format!(
                "{n} of {limit} tokens: the longest context whose state the {:.3} GB budget holds beside the rest of the plan (serve and an open-ended run reserve {}; `run --max-new N` reserves the prompt, N and 32 tokens)",
                gb(budget),
                plan.context_tokens
            ),
        );
    }
}

/// Without a budget: every routed expert stays mapped, and the context the memory available
/// would admit under the planner (what `--memory-budget-gb` of that memory plans).
fn no_budget_checks(
    r: &mut Report,
    config: &EngineConfig,
    inputs: &PlanInputs,
    admitted: Option<usize>,
    limit: usize,
) {
    let available = inputs.budget;
    let experts = inputs.expert_bytes.saturating_mul(inputs.experts as u64);
    let weights = inputs.spine.saturating_add(experts);
    let detail = format!(
        "no memory budget (--memory-budget-gb, K3_MEMORY_BUDGET_GB): run and serve map the {:.2} GB {} spine and all {} routed experts ({:.2} GB) from the install, {:.2} GB in all, against {:.2} GB available now",
        gb(inputs.spine),
        config.spine.as_str(),
        inputs.experts,
        gb(experts),
        gb(weights),
        gb(available)
    );
    if weights > available {
        r.warn(
            "memory plan",
            format!("{detail}: they do not fit, and pages are read again from disk as they are used"),
            format!(
                "pass --memory-budget-gb {:.0} (about the memory available) to stream the routed experts through a cache that fits",
                (gb(available)).floor().max(1.0)
            ),
        );
    } else {
        r.add("memory plan", Status::Info, detail);
    }
    match admitted {
        Some(n) => r.add(
            "admitted context",
            Status::Info,
            format!(
                "{n} of {limit} tokens fit in the {:.3} GB available, as the memory plan of `--memory-budget-gb {:.3}` splits it (without a budget run and serve do not plan memory)",
                gb(available),
                gb(available)
            ),
        ),
        None => {
            let why = plan_memory(&PlanInputs {
                context_tokens: 0,
                ..inputs.clone()
            })
            .err()
            .map_or_else(String::new, |e| format!(": {e}"));
            r.warn(
                "admitted context",
                format!("none: the memory available now cannot hold even the smallest plan{why}"),
                "free memory, or run on a host with more",
            );
        }
    }
}

/// `bytes` in GB rounded up to the third decimal (a budget that is enough).
fn gb_up(bytes: u64) -> String {
    format!("{:.3}", (bytes as f64 / 1e6).ceil() / 1e3)
}
