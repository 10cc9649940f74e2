//! The evidence directory and what the campaign records about the machine and the runner.

use crate::buildinfo;
use anyhow::{Context, Result, bail};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// UTC `YYYYMMDD-HHMMSS` for `secs` since the Unix epoch.
pub fn utc_stamp(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn is_secret_name(k: &str) -> bool {
    let u = k.to_ascii_uppercase();
    [
        "TOKEN",
        "SECRET",
        "PASSWORD",
        "PASSWD",
        "KEY",
        "AUTH",
        "CREDENTIAL",
        "COOKIE",
    ]
    .iter()
    .any(|s| u.contains(s))
}

pub(super) fn redacted(k: &str, v: &str) -> Value {
    if is_secret_name(k) {
        json!("<redacted>")
    } else {
        json!(v)
    }
}

/// Performance-relevant environment variables of this process, secrets redacted.
pub(super) fn perf_environment() -> Value {
    let mut m = Map::new();
    let mut vars: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.to_string_lossy().into_owned())))
        .filter(|(k, _)| {
            ["K3_", "DELTAFIN_", "RAYON_", "OMP_", "MKL_", "CUDA_", "HF_"]
                .iter()
                .any(|p| k.starts_with(p))
        })
        .collect();
    vars.sort();
    for (k, v) in vars {
        let val = redacted(&k, &v);
        m.insert(k, val);
    }
    Value::Object(m)
}

pub(super) fn system_state() -> Value {
    let mem = crate::doctor::meminfo();
    let loadavg = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.trim().to_string());
    json!({
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
        "logical_cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "mem_total_bytes": mem.map(|m| m.total),
        "mem_available_bytes": mem.map(|m| m.available),
        "loadavg": loadavg,
        "kernel_backend": deltafin_kernels::kernel_backend(),
        "build_profile": buildinfo::PROFILE,
        "build_target": buildinfo::TARGET,
        "build_features": buildinfo::features(),
    })
}

pub(super) fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

pub(super) fn write_json(path: &Path, v: &Value) -> Result<()> {
    let mut text = serde_json::to_string_pretty(v)?;
    text.push('\n');
    write_whole(path, &text)
}

/// Replace `path` with `text` through a synced temporary and a rename: a campaign killed or
/// out of disk space while rewriting `runs.jsonl` or `campaign.json` keeps the previous
/// whole file (a plain rewrite truncated it first, losing every earlier run's record).
pub(super) fn write_whole(path: &Path, text: &str) -> Result<()> {
    deltafin_fetch::inventory::write_atomic(path, text.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Create the evidence directory: a given path must be new or empty.
pub(super) fn create_evidence_dir(given: Option<&Path>) -> Result<PathBuf> {
    match given {
        Some(p) => {
            if p.exists() {
                let empty = p.is_dir()
                    && std::fs::read_dir(p)
                        .with_context(|| format!("cannot read {}", p.display()))?
                        .next()
                        .is_none();
                if !empty {
                    bail!(
                        "--output-dir {}: already exists and is not an empty directory; give a new path",
                        p.display()
                    );
                }
            } else {
                std::fs::create_dir_all(p)
                    .with_context(|| format!("cannot create {}", p.display()))?;
            }
            Ok(p.to_path_buf())
        }
        None => {
            let secs = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let base = PathBuf::from("bench-results");
            std::fs::create_dir_all(&base)
                .with_context(|| format!("cannot create {}", base.display()))?;
            let stamp = utc_stamp(secs);
            for attempt in 0..100u32 {
                let name = if attempt == 0 {
                    format!("native-{stamp}Z")
                } else {
                    format!("native-{stamp}Z-{attempt}")
                };
                let p = base.join(name);
                match std::fs::create_dir(&p) {
                    Ok(()) => return Ok(p),
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                    Err(e) => {
                        return Err(e).with_context(|| format!("cannot create {}", p.display()));
                    }
                }
            }
            bail!("cannot find a new directory name under bench-results/")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rewrite_that_cannot_finish_keeps_the_previous_file() {
        let d = tempfile::tempdir().unwrap();
        let runs = d.path().join("runs.jsonl");
        write_whole(&runs, "{\"run\": 1}\n").unwrap();
        write_whole(&runs, "{\"run\": 1}\n{\"run\": 2}\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(&runs).unwrap(),
            "{\"run\": 1}\n{\"run\": 2}\n"
        );
        // The next rewrite cannot be written (its temporary cannot be created, as on a
        // full disk): the error names the file, and the two runs are still there.
        std::fs::create_dir(d.path().join("runs.jsonl.part")).unwrap();
        let e = write_whole(&runs, "{\"run\": 1}\n{\"run\": 2}\n{\"run\": 3}\n").unwrap_err();
        assert!(format!("{e:#}").contains("runs.jsonl"), "{e:#}");
        assert_eq!(
            std::fs::read_to_string(&runs).unwrap(),
            "{\"run\": 1}\n{\"run\": 2}\n"
        );
    }

    #[test]
    fn utc_stamps_of_the_epoch_and_a_leap_day() {
        assert_eq!(utc_stamp(0), "19700101-000000");
        assert_eq!(utc_stamp(951_782_400 + 3661), "20000229-010101");
    }
}
