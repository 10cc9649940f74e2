//! `deltafin place-experts`: copy routed experts from the model root into expert homes,
//! directories on other drives (docs/K3.md §12.11, docs/CLI.md "place-experts").
//!
//! The plan gives every routed expert `--replicas` copies on different homes (with
//! `--by-heat` the hottest tenth by the learned route histogram one more), each new copy to
//! the home with the fewest bytes. `--dry-run` prints it: bytes per home and the free space
//! there. Placing reads each expert from the shards (or `k3-experts/` files), writes it into
//! its aligned slot, syncs, reads it back from the drive and journals it only when the
//! read-back's SHA-256 equals the source's; a rerun skips what the journals list, so an
//! interrupted placement resumes. `--check` reads every journaled copy back and drops the
//! ones that no longer match.

use crate::RootArg;
use crate::engine_config::parse_dir_list;
use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use deltafin_experts::heat::{HEAT_FILE, load as load_heat};
use deltafin_experts::homes::place::{
    check_home, copies_wanted, free_bytes, place_copy, plan, read_source,
};
use deltafin_experts::homes::{Home, HomeModel, MAX_HOMES};
use deltafin_store::checkpoint::Checkpoint;
use deltafin_store::experts::expert_table;
use deltafin_store::experts::{heat_dims, home_model};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

/// `place-experts` flags.
#[derive(Args, Debug, Clone)]
pub struct PlaceArgs {
    #[command(flatten)]
    pub root: RootArg,
    /// The expert homes, comma-separated: existing directories, one per drive.
    #[arg(long, value_name = "DIR[,DIR…]")]
    pub homes: String,
    /// Copies of every routed expert, each on a different home (at most one per home).
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=32))]
    pub replicas: u8,
    /// Place experts hottest first by the learned route histogram (k3-meta/expert_heat.v1.bin),
    /// the hottest tenth with one more copy.
    #[arg(long)]
    pub by_heat: bool,
    /// Print the plan (copies and bytes per home, free space) and place nothing.
    #[arg(long, conflicts_with = "check")]
    pub dry_run: bool,
    /// Read every copy the homes list back, compare it with its journaled SHA-256 and drop
    /// the ones that differ (a rerun of place-experts replaces them).
    #[arg(long)]
    pub check: bool,
}

fn gb(b: u64) -> String {
    format!("{:.3} GB", b as f64 / 1e9)
}

/// The routed experts of `ckpt`, hottest first with `by_heat` (then by layer and id).
fn placement_order(ckpt: &Checkpoint, by_heat: bool) -> Result<Vec<(usize, usize)>> {
    let cfg = ckpt.config();
    let mut order: Vec<(usize, usize)> = (0..cfg.n_layers())
        .filter(|&l| !cfg.is_dense(l))
        .flat_map(|l| (0..cfg.text.num_experts).map(move |e| (l, e)))
        .collect();
    if by_heat {
        let path = ckpt.root().join(HEAT_FILE);
        let loaded = load_heat(&path, heat_dims(cfg));
        if loaded.table.mass <= 0.0 {
            bail!(
                "--by-heat: no route heat learned yet in {} ({}); run the model with K3_EXPERT_HEAT=on first, or place without --by-heat",
                path.display(),
                loaded.note.unwrap_or_else(|| "it is empty".into())
            );
        }
        let heat = |&(l, e): &(usize, usize)| loaded.table.get(l, e);
        order.sort_by(|a, b| heat(b).total_cmp(&heat(a)).then(a.cmp(b)));
    }
    Ok(order)
}

/// The homes of `dirs` for a plan: opened where they exist (a home of another model is
/// refused), else empty ones (created when placing).
fn plan_homes(dirs: &[PathBuf], model: &HomeModel) -> Result<Vec<Home>> {
    if dirs.len() > MAX_HOMES {
        bail!("--homes: {} given, at most {MAX_HOMES}", dirs.len());
    }
    let mut seen = Vec::new();
    let mut homes = Vec::new();
    for d in dirs {
        if !d.is_dir() {
            bail!(
                "--homes: {} does not exist or is not a directory (create it on the drive first)",
                d.display()
            );
        }
        let canon = d.canonicalize().with_context(|| d.display().to_string())?;
        if seen.contains(&canon) {
            bail!("--homes: {} is named twice", d.display());
        }
        seen.push(canon);
        homes.push(if Home::exists_at(d) {
            Home::open(d, model)?
        } else {
            Home::empty(d, model)
        });
    }
    Ok(homes)
}

/// Run `place-experts`.
pub fn place_experts(args: &PlaceArgs) -> Result<ExitCode> {
    let root = args.root.resolve();
    let ckpt = Checkpoint::open(&root)
        .with_context(|| format!("the model root {} is not usable", root.display()))?;
    let model = home_model(&ckpt).map_err(|e| anyhow!("{e}"))?;
    let dirs = parse_dir_list(&args.homes).map_err(|e| anyhow!("--homes: {e}"))?;
    if args.check {
        return check(&dirs, &model);
    }
    let table = expert_table(&ckpt).context("cannot locate the routed experts")?;
    let mut homes = plan_homes(&dirs, &model)?;
    for h in &homes {
        h.verify_sample(&table)?;
    }
    let order = placement_order(&ckpt, args.by_heat)?;
    let replicas = usize::from(args.replicas);
    if replicas > homes.len() {
        eprintln!(
            "deltafin: note: --replicas {replicas} with {} homes: one copy per home",
            homes.len()
        );
    }
    let wanted = copies_wanted(&order, replicas, args.by_heat, homes.len());
    let todo = plan(&homes, &wanted);
    let slot = model.slot_bytes();
    println!(
        "place-experts: {} routed experts of {} bytes (slots of {slot}), {} cop{} each{}",
        order.len(),
        model.expert_bytes(),
        replicas.min(homes.len()),
        if replicas.min(homes.len()) == 1 {
            "y"
        } else {
            "ies"
        },
        if args.by_heat {
            ", the hottest tenth one more"
        } else {
            ""
        }
    );
    let mut short = Vec::new();
    for (h, home) in homes.iter().enumerate() {
        let n = todo.iter().filter(|c| c.home == h).count() as u64;
        let need = n * slot;
        let free = free_bytes(&home.dir);
        let fits = free.is_none_or(|f| f >= need);
        println!(
            "  {}: holds {} copies ({}); to place {n} ({}); free {}{}",
            home.dir.display(),
            home.journal().copies.len(),
            gb(home.held_bytes()),
            gb(need),
            free.map_or("unknown".into(), gb),
            if fits { "" } else { "  DOES NOT FIT" }
        );
        if !fits {
            short.push(home.dir.display().to_string());
        }
    }
    println!(
        "  total: {} copies to place ({})",
        todo.len(),
        gb(todo.len() as u64 * slot)
    );
    if args.dry_run {
        return Ok(ExitCode::SUCCESS);
    }
    if !short.is_empty() {
        bail!(
            "not enough free space on {} for its copies: free space there, use more homes, or fewer --replicas",
            short.join(", ")
        );
    }
    for home in homes.iter_mut() {
        if !Home::exists_at(&home.dir) {
            *home = Home::create_or_open(&home.dir, &model)?;
        }
    }
    let t0 = Instant::now();
    let mut last: Option<((usize, usize), Vec<u8>, deltafin_experts::homes::CopyDigest)> = None;
    let mut written = 0u64;
    let step = (todo.len() / 20).max(1);
    for (i, c) in todo.iter().enumerate() {
        let key = (c.layer, c.expert);
        if last.as_ref().is_none_or(|(k, _, _)| *k != key) {
            let (bytes, digest) = read_source(&table, c.layer, c.expert)?;
            last = Some((key, bytes, digest));
        }
        if let Some((_, bytes, digest)) = &last {
            place_copy(&mut homes[c.home], c.layer, c.expert, bytes, *digest)?;
            written += slot;
        }
        if (i + 1) % step == 0 || i + 1 == todo.len() {
            let s = t0.elapsed().as_secs_f64().max(1e-9);
            eprintln!(
                "place-experts: {}/{} copies placed and verified ({:.3} GB/s written)",
                i + 1,
                todo.len(),
                written as f64 / s / 1e9
            );
        }
    }
    println!(
        "place-experts: done: {} copies placed and verified in {:.1} s; run with --expert-homes {}",
        todo.len(),
        t0.elapsed().as_secs_f64(),
        args.homes
    );
    Ok(ExitCode::SUCCESS)
}

/// `--check`: read every copy back; drop the damaged ones.
fn check(dirs: &[PathBuf], model: &HomeModel) -> Result<ExitCode> {
    let mut bad = 0;
    for d in dirs {
        let mut home = Home::open(d, model)?;
        let c = check_home(&mut home)?;
        for (l, e, why) in &c.dropped {
            println!("  {}: expert {e} of layer {l}: {why}; dropped", display(d));
        }
        println!(
            "{}: {} copies checked, {} dropped",
            display(d),
            c.checked,
            c.dropped.len()
        );
        bad += c.dropped.len();
    }
    if bad > 0 {
        println!(
            "place-experts --check: {bad} damaged copies dropped; run place-experts again to replace them"
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

fn display(p: &Path) -> String {
    p.display().to_string()
}
