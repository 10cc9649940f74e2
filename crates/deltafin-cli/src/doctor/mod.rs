//! `deltafin doctor`: a read-only, network-free health audit of the host and, unless
//! `--runtime-only`, of the model installation as `run` and `serve` would load it with the
//! same model flags and environment (docs/CLI.md, docs/OPERATIONS.md).
//!
//! Every check ends as `ok`, `info`, `warn` or `fail`; a `fail` carries a fix suggestion and
//! makes the exit status 1: whatever would make `run` or `serve` refuse to start is a `fail`.
//! `--json` prints one object (schema `deltafin.doctor.v1`).

use anyhow::Result;
pub use deltafin_k3::engine::host::meminfo;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::ExitCode;

mod canaries;
mod disk;
mod homes;
mod load;
mod memory;
mod model;
mod plan;
mod report;
mod runtime;
mod weights;

use disk::disk_probe;
use memory::{huge_pages_check, memory_check};
use model::model_checks;
use report::{Report, Status};
use runtime::runtime_checks;

/// `doctor` flags: the model flags are `run`'s and `serve`'s, read the same way (flag, else
/// its environment variable, else the default), so the audit is of what they would load.
#[derive(clap::Args, Debug, Clone)]
pub struct DoctorArgs {
    /// Check only the host (CPU, kernels, canaries, disk, memory); skip all model data.
    #[arg(long, conflicts_with_all = ["model_root", "memory_budget_gb", "device", "expert_backend", "spine", "expert_homes"])]
    pub runtime_only: bool,
    /// Print one JSON object (schema deltafin.doctor.v1) instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub model: crate::ModelArgs,
}

/// Run the audit and print it; exit status 0 when healthy, 1 when a problem was found.
pub fn doctor(args: &DoctorArgs) -> Result<ExitCode> {
    let root = (!args.runtime_only).then(|| args.model.root());
    let mut report = Report::default();
    runtime_checks(&mut report);
    let mem = meminfo();
    memory_check(&mut report, mem);
    huge_pages_check(
        &mut report,
        deltafin_k3::weights::resident::transparent_huge_pages(),
    );
    let mut probe_file: Option<PathBuf> = None;
    if let Some(root) = &root {
        probe_file = model_checks(&mut report, root, &args.model, mem.map(|m| m.available));
    }
    disk_probe(&mut report, probe_file.as_deref());

    let problems = report.problems();
    if args.json {
        let checks: Vec<Value> = report
            .checks
            .iter()
            .map(|c| {
                json!({
                    "name": c.name,
                    "status": c.status.as_str(),
                    "detail": c.detail,
                    "fix": c.fix,
                })
            })
            .collect();
        let out = json!({
            "schema": "deltafin.doctor.v1",
            "healthy": problems == 0,
            "problems": problems,
            "runtime_only": args.runtime_only,
            "model_root": root.as_ref().map(|r| r.display().to_string()),
            "model_contract": report.model_contract,
            "admitted_context": report.admitted_context,
            "facts": Value::Object(report.facts.clone()),
            "checks": checks,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("deltafin doctor (read-only, network-free)");
        for (i, c) in report.checks.iter().enumerate() {
            if i == report.contract_after
                && let Some(line) = &report.model_contract
            {
                println!("{line}");
            }
            let tag = match c.status {
                Status::Ok => "[ ok ]",
                Status::Info => "[info]",
                Status::Warn => "[warn]",
                Status::Fail => "[FAIL]",
            };
            println!("{tag} {}: {}", c.name, c.detail);
            if let Some(fix) = &c.fix {
                println!("       fix: {fix}");
            }
        }
        if report.contract_after >= report.checks.len()
            && let Some(line) = &report.model_contract
        {
            println!("{line}");
        }
        if problems == 0 {
            println!("doctor: healthy");
        } else {
            println!(
                "doctor: {problems} problem{} found",
                if problems == 1 { "" } else { "s" }
            );
        }
    }
    Ok(if problems == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

#[cfg(test)]
mod tests;
