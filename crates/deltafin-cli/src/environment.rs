//! Every environment variable `deltafin` reads, in one table ([`VARIABLES`]): the
//! environment section of `--help` is printed from it, and a test checks that docs/CLI.md
//! names each one and that the sources read no other. Also the variables of the original
//! that deltafin refuses ([`REFUSED`]: knobs it has no counterpart for, and the `K3_METAL_SRC`
//! tripwire) and its legacy quality guards ([`check_legacy_guards`]), so that none of them is
//! ever ignored silently.

use crate::env::env_var;
use anyhow::{Result, bail};

/// One variable: its name, what it is for (one line of `--help`).
pub struct Variable {
    pub name: &'static str,
    pub what: &'static str,
}

const fn v(name: &'static str, what: &'static str) -> Variable {
    Variable { name, what }
}

/// Every variable deltafin reads, in the order of `--help` (docs/CLI.md has each in full).
pub const VARIABLES: &[Variable] = &[
    v(
        "DELTAFIN_ROOT",
        "the model root of every command without --model-root",
    ),
    v("K3_MEMORY_BUDGET_GB", "as --memory-budget-gb"),
    v("K3_DEV", "as --device: auto, cpu, mps, cuda, cuda:N"),
    v("K3_MOE", "as --expert-backend: auto, cpu, metal, cuda"),
    v(
        "K3_DEV_RESERVE_GB",
        "device memory kept free on a CUDA device (2)",
    ),
    v("K3_SPINE", "as --spine: auto (= int8), int8, bf16"),
    v("K3_SPINE_READ_THREADS", "as --spine-read-threads: 1…16 (4)"),
    v(
        "K3_SPINE_STREAM_NOCACHE",
        "streamed spine reads: auto/1 (O_DIRECT), 0 (page cache)",
    ),
    v(
        "K3_PROVIDER_RESIDENT_LAYERS",
        "at most this many resident spine layers, 0…layers",
    ),
    v("K3_STATE_CACHE", "as --state-cache: on, off"),
    v(
        "K3_STATE_CACHE_RAM_GB",
        "prefix states kept in RAM, GB (1; 0: none)",
    ),
    v(
        "K3_STATE_CACHE_DISK_GB",
        "prefix states kept in k3-meta/state-cache/, GB (16; 0: none)",
    ),
    v(
        "K3_EXPERT_READ_THREADS",
        "expert I/O threads under a budget, 1…16 (≤ 4)",
    ),
    v(
        "K3_EXPERT_STREAM_NOCACHE",
        "expert reads: auto/1 (O_DIRECT), 0 (page cache)",
    ),
    v(
        "K3_EXPERT_HOMES",
        "as --expert-homes: DIR[,DIR…] of expert copies on other drives",
    ),
    v(
        "K3_PILOT_GATE",
        "next-layer expert prefetch: off (ungoverned), measure, on, ranked",
    ),
    v(
        "K3_PILOT_GATE_THRESHOLD",
        "recall a layer must keep under `on`, [0, 1) (0.10)",
    ),
    v(
        "K3_PILOT_GATE_WARMUP",
        "predictions before the gate judges, 1…100000 (16)",
    ),
    v(
        "K3_PILOT_RANK_PRECISION",
        "precision a guess rank must keep under `ranked`, [0, 1] (0.5)",
    ),
    v(
        "K3_PILOT_MAX_GUESSES",
        "prefetch reads per prediction under `ranked`, 0…4096 (0: no cap)",
    ),
    v("K3_EXPERT_HEAT", "the persistent route histogram: on, off"),
    v(
        "K3_EXPERT_PIN_GB",
        "pinned tier of the expert cache, GB (0)",
    ),
    v("K3_EXPERT_SCALE4", "scale4 sidecars: auto, off, require"),
    v("K3_TRACE", "as --router-trace-mode: off, buffered, sync"),
    v("K3_TRACE_PATH", "as --router-trace"),
    v(
        "K3_REASONING_EFFORT",
        "as --reasoning-effort; the server's default effort",
    ),
    v(
        "K3_TEMPERATURE",
        "as --temperature (greedy when unset or 0)",
    ),
    v("K3_TOP_P", "as --top-p"),
    v("K3_TOP_K", "as --top-k"),
    v("K3_MIN_P", "as --min-p"),
    v("K3_SEED", "as --seed"),
    v("K3_DSPARK", "DSpark drafting: off, auto, on"),
    v(
        "K3_UAG_DRAFT",
        "Qwen3 drafting of raw completions: off, auto, on",
    ),
    v(
        "K3_DSPARK_AUTO_MIN_SPEEDUP",
        "speed-up auto drafting must keep, [0, 1) (0.03)",
    ),
    v("K3_SPEC_DEPTH", "widest verify pass, 1…8 (8)"),
    v(
        "K3_DSPARK_MAX_CONTEXT",
        "DSpark stops drafting past this many positions (8192; 0: never)",
    ),
    v("K3_SERVER_QUEUE", "as serve --queue: 0…64 (8)"),
    v(
        "K3_SERVER_PARALLEL",
        "as serve --parallel: 1…16 (the memory plan's count)",
    ),
    v(
        "K3_RESPONSE_STORE_GB",
        "as serve --response-store-gb: stored Responses (1; 0: none)",
    ),
    v("DELTAFIN_API_KEY", "as serve --api-key"),
    v("RAYON_NUM_THREADS", "compute threads (one per CPU)"),
    v(
        "DELTAFIN_KERNEL",
        "kernel backend: scalar, avx2, avx512, neon (the best this CPU has)",
    ),
    v(
        "K3_MXFP4_DISABLE_AVX2",
        "any value but 0: no AVX2/AVX-512 kernels (scalar on x86-64)",
    ),
    v(
        "DELTAFIN_MXFP4_ACT",
        "MXFP4 activations on AVX-512 VNNI: q8x3, f32",
    ),
    v(
        "DELTAFIN_HUGE_PAGES",
        "resident weights copied into huge pages at load: auto, off",
    ),
    v(
        "DELTAFIN_POOL_SPIN",
        "compute threads spin between products: on, off",
    ),
    v(
        "DELTAFIN_POOL_PREFETCH",
        "idle compute threads prefetch the next weights: on, off",
    ),
    v(
        "DELTAFIN_NVRTC",
        "a libnvrtc file or directory, tried first",
    ),
    v("CUDA_HOME", "CUDA toolkit root searched for NVRTC"),
    v("CUDA_PATH", "CUDA toolkit root searched for NVRTC"),
    v(
        "DELTAFIN_CUDA_PTX_DIR",
        "precompiled CUDA kernels (.ptx) instead of NVRTC",
    ),
    v(
        "HF_ENDPOINT",
        "the Hugging Face hub (https://huggingface.co)",
    ),
    v("HF_TOKEN", "a Hugging Face token for downloads"),
    v(
        "HF_HUB_CACHE",
        "the Hugging Face cache `setup --from-hf-cache` reads without DIR",
    ),
    v(
        "HF_HOME",
        "Hugging Face's home: its hub/ is the cache when HF_HUB_CACHE is unset",
    ),
    v(
        "DELTAFIN_MANIFESTS",
        "a directory of pinned source manifests instead of the built-in ones",
    ),
    v(
        "DELTAFIN_INSECURE_HTTP",
        "1: allow a plain http:// hub (a mirror you trust)",
    ),
    v(
        "DELTAFIN_TEST_FREE_DISK_BYTES",
        "tests only: the free disk space setup plans with",
    ),
    v(
        "DELTAFIN_UPGRADE_REPO",
        "tests only: the checkout `upgrade` works on",
    ),
    v(
        "DELTAFIN_UPGRADE_BUILD_CMD",
        "tests only: the command `upgrade` builds with",
    ),
];

/// A variable of the original deltafin that this one refuses: `why` says what deltafin does
/// instead, and the command stops with it rather than ignore the setting.
pub struct Refused {
    pub name: &'static str,
    pub why: &'static str,
}

const fn r(name: &'static str, why: &'static str) -> Refused {
    Refused { name, why }
}

/// The original's variables deltafin refuses whatever their value.
pub const REFUSED: &[Refused] = &[
    r(
        "K3_METAL_SRC",
        "a retired override of the Metal kernel source: deltafin only runs the kernels built into the binary",
    ),
    r(
        "K3_SPINE_FDCACHE",
        "deltafin opens each streamed spine file once and keeps it open for the process (the original's `on`); there is nothing to choose",
    ),
    r(
        "K3_SPINE_RESIDENT_GB",
        "the original's clean-file-cache tier for the int8 spine on macOS with MPS; deltafin keeps a prefix of spine layers resident instead (--memory-budget-gb, K3_PROVIDER_RESIDENT_LAYERS)",
    ),
    r(
        "K3_MEMORY_PATIENCE_SECONDS",
        "deltafin admits work by its memory plan at startup (--memory-budget-gb) instead of waiting out memory pressure",
    ),
    r(
        "K3_GEMV_THREADS",
        "deltafin's products all run on one compute pool: set RAYON_NUM_THREADS",
    ),
    r(
        "K3_SPINE_IOPOL",
        "deltafin does not change the I/O priority of its readers",
    ),
    r(
        "K3_COMPLETE_EXPERT_UNION",
        "deltafin always reads the complete expert union of a pass (the original's 1)",
    ),
    r(
        "K3_HF_HOST",
        "set the hub with HF_ENDPOINT=https://HOST[/PATH]",
    ),
    r(
        "K3_HF_PATH",
        "set the hub with HF_ENDPOINT=https://HOST[/PATH]",
    ),
    r(
        "K3_MPS_SPINE_SLAB_UPLOAD",
        "the Metal/MPS path does not run the model in this build (docs/CLI.md \"Devices\")",
    ),
    r(
        "K3_METAL_BINDLESS",
        "the Metal/MPS path does not run the model in this build (docs/CLI.md \"Devices\")",
    ),
    r(
        "K3_EAGLE3",
        "deltafin drafts with DSpark and Qwen3 (K3_DSPARK, K3_UAG_DRAFT), not EAGLE-3",
    ),
    r(
        "K3_STORAGE_HOMES",
        "deltafin reads every weight from the model root",
    ),
    r(
        "K3_EXPERT_EARLY_DRAIN",
        "not a setting in deltafin: the MoE schedule decides when each expert's product starts",
    ),
];

/// The legacy quality guards of the original, with the values that keep K3 exact.
pub const LEGACY_GUARDS: [&str; 3] = ["K3_APPROX", "K3_DTYPE", "K3_MOE_TOP_K"];

/// The refusal of `name` (set to anything), if deltafin refuses it.
pub fn refusal(name: &str) -> Option<String> {
    REFUSED.iter().find(|r| r.name == name).map(|r| {
        format!(
            "environment variable {} is not supported: {}; unset it",
            r.name, r.why
        )
    })
}

/// Fail on the first refused variable that is set (in [`REFUSED`]'s order).
pub fn check_refused() -> Result<()> {
    for r in REFUSED {
        if std::env::var_os(r.name).is_some()
            && let Some(msg) = refusal(r.name)
        {
            bail!("{msg}");
        }
    }
    Ok(())
}

/// The legacy guards `K3_APPROX` (off: unset, empty, `0`, `false`, `off`, `no`, `disabled`),
/// `K3_DTYPE` (`fp32`, `float32`, or empty) and `K3_MOE_TOP_K` (`top_k`, the model's routed
/// experts per token, or empty): a value that asks for anything else — an approximation, a
/// narrower activation type, fewer experts — is refused, since deltafin never trades K3's
/// exactness for speed.
pub fn check_legacy_guards(top_k: Option<usize>) -> Result<()> {
    if let Some(v) = env_var("K3_APPROX")? {
        let t = v.trim().to_ascii_lowercase();
        if !matches!(t.as_str(), "" | "0" | "false" | "off" | "no" | "disabled") {
            bail!(
                "environment variable K3_APPROX={v:?}: approximate inference is not supported, deltafin does not trade K3's exactness for speed (unset it, or 0)"
            );
        }
    }
    if let Some(v) = env_var("K3_DTYPE")? {
        let t = v.trim().to_ascii_lowercase();
        if !matches!(t.as_str(), "" | "fp32" | "float32") {
            bail!(
                "environment variable K3_DTYPE={v:?}: activations are always f32 (unset it, or fp32)"
            );
        }
    }
    if let Some(v) = env_var("K3_MOE_TOP_K")?
        && !v.trim().is_empty()
    {
        let want = top_k.map_or_else(|| "the model's".to_string(), |k| k.to_string());
        match (v.trim().parse::<usize>(), top_k) {
            (Ok(k), Some(t)) if k == t => {}
            (Ok(k), None) if k > 0 => {}
            _ => bail!(
                "environment variable K3_MOE_TOP_K={v:?}: every token uses all {want} routed experts the router picks; fewer would change K3's output (unset it, or {want})"
            ),
        }
    }
    Ok(())
}

/// The environment section of `--help`: every variable of [`VARIABLES`], then the refused
/// and guarded ones.
pub fn help() -> String {
    let width = VARIABLES.iter().map(|v| v.name.len()).max().unwrap_or(0);
    let mut out = String::from(
        "Environment (a flag wins over its variable; every value is parsed strictly; docs/CLI.md has the details):\n",
    );
    for v in VARIABLES {
        out += &format!("  {:width$}  {}\n", v.name, v.what);
    }
    out += &format!(
        "Refused (the original's, no counterpart here): {}\n",
        REFUSED
            .iter()
            .map(|r| r.name)
            .collect::<Vec<_>>()
            .join(", ")
    );
    out += &format!(
        "Legacy guards (refused unless they ask for exact K3: 0, fp32, all routed experts): {}\n",
        LEGACY_GUARDS.join(", ")
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    fn repo() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    fn every_name() -> Vec<&'static str> {
        VARIABLES
            .iter()
            .map(|v| v.name)
            .chain(REFUSED.iter().map(|r| r.name))
            .chain(LEGACY_GUARDS)
            .collect()
    }

    /// docs/CLI.md names every variable of the tables.
    #[test]
    fn cli_md_names_every_variable() {
        let doc = std::fs::read_to_string(repo().join("docs/CLI.md")).unwrap();
        for name in every_name() {
            assert!(
                doc.contains(&format!("`{name}`")),
                "docs/CLI.md does not name `{name}`"
            );
        }
        let mut names = every_name();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "a variable is in two tables");
    }

    /// Every `"K3_…"`, `"DELTAFIN_…"` or `"HF_…"` string in the crates' sources (their test
    /// files aside) is a variable of the tables, or a name deltafin does not read.
    #[test]
    fn the_sources_read_no_variable_outside_the_tables() {
        const NOT_READ: &[&str] = &[
            // Build facts recorded by build.rs, not read from the environment at run time.
            "DELTAFIN_BUILD_PROFILE",
            "DELTAFIN_BUILD_TARGET",
            "DELTAFIN_BUILD_FEATURES",
            // The original's build variables, which `upgrade` removes from its build.
            "DELTAFIN_BUILD_",
            "DELTAFIN_TORCH_ROOT",
            "DELTAFIN_CUDA_MOE",
            "DELTAFIN_CUDA_ARCHITECTURES",
            "DELTAFIN_HIPCC",
            "DELTAFIN_HIP_ARCHITECTURES",
        ];
        let re = regex_lite(&["K3_", "DELTAFIN_", "HF_"]);
        let names = every_name();
        let mut files = Vec::new();
        collect(&repo().join("crates"), &mut files);
        let mut unknown = Vec::new();
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            for name in re(&text) {
                if !names.contains(&name.as_str()) && !NOT_READ.contains(&name.as_str()) {
                    unknown.push(format!("{}: {name}", f.display()));
                }
            }
        }
        assert!(
            unknown.is_empty(),
            "not in environment.rs's tables: {unknown:#?}"
        );
    }

    /// The `.rs` files under `dir` that are sources of a crate, not tests.
    fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                if !matches!(name.as_str(), "tests" | "benches" | "examples") {
                    collect(&p, out);
                }
            } else if name.ends_with(".rs") && name != "tests.rs" && !name.ends_with("_tests.rs") {
                out.push(p);
            }
        }
    }

    /// The quoted names with one of `prefixes` in a text: `"PREFIX[A-Z0-9_]+"`, the prefix
    /// alone aside.
    fn regex_lite(prefixes: &[&'static str]) -> impl Fn(&str) -> Vec<String> {
        let prefixes = prefixes.to_vec();
        move |text: &str| {
            let mut found = Vec::new();
            for (i, _) in text.match_indices('"') {
                let rest = &text[i + 1..];
                if !prefixes.iter().any(|p| rest.starts_with(p)) {
                    continue;
                }
                let end = rest
                    .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
                    .unwrap_or(rest.len());
                // A bare prefix (`"K3_"`) names no variable.
                if rest[end..].starts_with('"') && !prefixes.contains(&&rest[..end]) {
                    found.push(rest[..end].to_string());
                }
            }
            found
        }
    }

    #[test]
    fn help_lists_every_variable() {
        let h = help();
        for name in every_name() {
            assert!(h.contains(name), "{name}");
        }
    }
}
