//! The expert homes of `--expert-homes` / `K3_EXPERT_HOMES`: each opens for this model, and
//! each drive's read rate (docs/K3.md §12.11).

use super::disk::{DISK_PROBE_BYTES, timed_read};
use super::report::{Report, Status};
use crate::ModelArgs;
use deltafin_k3::engine::experts::open_expert_homes;
use deltafin_k3::weights::checkpoint::Checkpoint;
use deltafin_store::experts::expert_table;
use serde_json::json;

/// One check per home: it opens for this model (or a `fail` naming what is wrong) and its
/// largest layer file reads at the rate shown (page cache dropped first).
pub(super) fn homes_checks(r: &mut Report, ckpt: &Checkpoint, model: &ModelArgs) {
    let dirs = match crate::engine_config::resolve_expert_homes(model.expert_homes.as_deref()) {
        Ok(d) => d,
        Err(e) => {
            r.fail(
                "expert homes",
                format!("{e:#}"),
                "give existing directories, comma-separated",
            );
            return;
        }
    };
    if dirs.is_empty() {
        return;
    }
    let place = format!(
        "mount the drive, or place the experts with `deltafin place-experts --homes {} --model-root {}`",
        dirs.iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(","),
        ckpt.root().display()
    );
    let homes = match open_expert_homes(ckpt, &dirs) {
        Ok(Some(h)) => h,
        Ok(None) => return,
        Err(e) => {
            r.fail("expert homes", e.to_string(), place);
            return;
        }
    };
    if let Ok(table) = expert_table(ckpt)
        && let Err(e) = homes.verify_sample(&table)
    {
        r.fail("expert homes", e.to_string(), place);
        return;
    }
    let budget = crate::engine_config::resolve_memory_budget(model.memory_budget_gb.as_deref());
    if matches!(budget, Ok(None)) {
        r.add(
            "expert homes",
            Status::Info,
            "read only when experts stream: give a memory budget (--memory-budget-gb or K3_MEMORY_BUDGET_GB)",
        );
    }
    let mut rates = Vec::new();
    for home in homes.homes() {
        let largest = std::fs::read_dir(home.files_dir()).ok().and_then(|it| {
            it.filter_map(Result::ok)
                .filter(|e| e.path().extension().is_some_and(|x| x == "experts"))
                .filter_map(|e| Some((e.metadata().ok()?.len(), e.path())))
                .max()
        });
        let held = format!(
            "{} copies ({:.3} GB)",
            home.journal().copies.len(),
            home.held_bytes() as f64 / 1e9
        );
        let name = format!("expert home {}", home.dir.display());
        match largest {
            None => r.add(
                name,
                Status::Warn,
                format!("{held}: holds no layer file yet"),
            ),
            Some((_, p)) => match timed_read(&p, DISK_PROBE_BYTES) {
                Ok((n, s, dropped)) if n > 0 => {
                    let gbps = n as f64 / s.max(1e-9) / 1e9;
                    rates.push(json!({"dir": home.dir.display().to_string(), "read_gb_per_s": gbps, "copies": home.journal().copies.len()}));
                    r.add(
                        name,
                        Status::Ok,
                        format!(
                            "{held}; reads {gbps:.2} GB/s over {} MiB of {}{}",
                            n >> 20,
                            p.display(),
                            if dropped {
                                ""
                            } else {
                                " (page cache not dropped: may be a cached read)"
                            }
                        ),
                    );
                }
                Ok(_) => r.add(
                    name,
                    Status::Warn,
                    format!("{held}: {} is empty", p.display()),
                ),
                Err(e) => r.fail(
                    name,
                    format!("{held}: reading {}: {e}", p.display()),
                    "check the drive (dmesg), then `deltafin place-experts --check`",
                ),
            },
        }
    }
    r.facts.insert("expert_homes".into(), json!(rates));
}
