//! Arms (named environment deltas), the completion oracle flags and the ABBA schedule.

use anyhow::{Context, Result, anyhow, bail};
use std::collections::BTreeSet;

/// One arm: a name and the environment changes its runs get.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arm {
    pub name: String,
    pub env: Vec<(String, String)>,
}

fn valid_env_key(k: &str) -> bool {
    let mut chars = k.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Parse `KEY=VALUE KEY=VALUE`: whitespace-separated pairs, valid unique keys, no
/// dynamic-loader variables (`LD_*`, `DYLD_*`) and none that `deltafin` refuses
/// (`crate::environment::REFUSED`, `K3_METAL_SRC` among them).
pub fn parse_env_delta(spec: &str) -> Result<Vec<(String, String)>> {
    let mut out: Vec<(String, String)> = Vec::new();
    for tok in spec.split_whitespace() {
        let Some((k, v)) = tok.split_once('=') else {
            bail!("`{tok}` is not KEY=VALUE");
        };
        if !valid_env_key(k) {
            bail!("`{k}` is not a valid environment variable name");
        }
        if k.starts_with("LD_") || k.starts_with("DYLD_") {
            bail!(
                "`{k}`: dynamic-loader variables are forbidden in arms (they would change which code runs, not how)"
            );
        }
        if let Some(why) = crate::environment::refusal(k) {
            bail!("`{k}` in an arm: {why}");
        }
        if out.iter().any(|(o, _)| o == k) {
            bail!("`{k}` is set twice");
        }
        out.push((k.to_string(), v.to_string()));
    }
    Ok(out)
}

fn valid_arm_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// The arms from `--arm` or `--configs/--names`; one arm `defaults` when neither is given.
pub fn parse_arms(arm: &[String], configs: &[String], names: &[String]) -> Result<Vec<Arm>> {
    let mut arms = Vec::new();
    if !arm.is_empty() {
        for a in arm {
            let Some((name, env)) = a.split_once('=') else {
                bail!("--arm {a:?}: expected NAME=ENV (e.g. --arm fast=RAYON_NUM_THREADS=8)");
            };
            let env = parse_env_delta(env).with_context(|| format!("--arm {a:?}"))?;
            arms.push(Arm {
                name: name.to_string(),
                env,
            });
        }
    } else if !configs.is_empty() {
        if !names.is_empty() && names.len() != configs.len() {
            bail!(
                "--names gives {} names for {} --configs arms; give one name per arm",
                names.len(),
                configs.len()
            );
        }
        for (i, c) in configs.iter().enumerate() {
            let env = parse_env_delta(c).with_context(|| format!("--configs {c:?}"))?;
            let name = names
                .get(i)
                .cloned()
                .unwrap_or_else(|| format!("config-{}", i + 1));
            arms.push(Arm { name, env });
        }
    } else {
        arms.push(Arm {
            name: "defaults".into(),
            env: Vec::new(),
        });
    }
    let mut seen = BTreeSet::new();
    for a in &arms {
        if !valid_arm_name(&a.name) {
            bail!(
                "arm name {:?}: use 1–64 characters from A–Z, a–z, 0–9, `-`, `_`, `.`",
                a.name
            );
        }
        if !seen.insert(a.name.as_str()) {
            bail!(
                "arm name `{}` is used twice; arm names must be unique",
                a.name
            );
        }
    }
    Ok(arms)
}

/// Token ids from a JSON array (`[1, 2]`) or a comma list (`1,2`).
pub fn parse_token_ids(s: &str) -> Result<Vec<u32>> {
    let t = s.trim();
    let ids: Vec<u32> = if t.starts_with('[') {
        serde_json::from_str::<Vec<u32>>(t).map_err(|e| {
            anyhow!("--expect-token-ids {s:?}: not a JSON array of token ids (0…4294967295): {e}")
        })?
    } else {
        t.split(',')
            .map(|p| {
                p.trim().parse::<u32>().map_err(|_| {
                    anyhow!("--expect-token-ids {s:?}: `{}` is not a token id", p.trim())
                })
            })
            .collect::<Result<_>>()?
    };
    if ids.is_empty() {
        bail!("--expect-token-ids {s:?}: no token ids given");
    }
    Ok(ids)
}

/// The schedule: `(repetition, arm index, position)` in execution order. Even repetitions
/// run the arms in order, odd repetitions in reverse (ABBA).
pub fn abba_schedule(arms: usize, reps: u64) -> Vec<(u64, usize, usize)> {
    let mut out = Vec::new();
    for rep in 0..reps {
        for pos in 0..arms {
            let arm = if rep % 2 == 0 { pos } else { arms - 1 - pos };
            out.push((rep, arm, pos));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abba_alternates_the_order() {
        let s: Vec<usize> = abba_schedule(2, 4).iter().map(|x| x.1).collect();
        assert_eq!(s, vec![0, 1, 1, 0, 0, 1, 1, 0]);
        let s: Vec<usize> = abba_schedule(3, 2).iter().map(|x| x.1).collect();
        assert_eq!(s, vec![0, 1, 2, 2, 1, 0]);
    }

    #[test]
    fn env_deltas_are_strict() {
        assert_eq!(
            parse_env_delta(" A=1  B_2=x=y ").unwrap(),
            vec![("A".into(), "1".into()), ("B_2".into(), "x=y".into())]
        );
        assert!(parse_env_delta("").unwrap().is_empty());
        assert!(
            parse_env_delta("LD_PRELOAD=/x.so")
                .unwrap_err()
                .to_string()
                .contains("dynamic-loader")
        );
        assert!(parse_env_delta("DYLD_INSERT_LIBRARIES=x").is_err());
        let e = parse_env_delta("K3_METAL_SRC=/tmp/x.metal")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("K3_METAL_SRC") && e.contains("not supported"),
            "{e}"
        );
        assert!(
            parse_env_delta("A=1 A=2")
                .unwrap_err()
                .to_string()
                .contains("twice")
        );
        assert!(parse_env_delta("NOEQUALS").is_err());
        assert!(parse_env_delta("1A=2").is_err());
    }

    #[test]
    fn arms_and_names() {
        let a = parse_arms(&["a=X=1".into(), "b=".into()], &[], &[]).unwrap();
        assert_eq!(
            a[1],
            Arm {
                name: "b".into(),
                env: vec![]
            }
        );
        assert!(parse_arms(&["a=".into(), "a=X=1".into()], &[], &[]).is_err());
        assert!(parse_arms(&["noequals".into()], &[], &[]).is_err());
        let c = parse_arms(&[], &["X=1".into(), "X=2".into()], &[]).unwrap();
        assert_eq!(c[1].name, "config-2");
        assert!(parse_arms(&[], &["X=1".into()], &["p".into(), "q".into()]).is_err());
        assert_eq!(parse_arms(&[], &[], &[]).unwrap()[0].name, "defaults");
    }

    #[test]
    fn token_ids_parse_both_forms() {
        assert_eq!(parse_token_ids("[1, 2,3]").unwrap(), vec![1, 2, 3]);
        assert_eq!(parse_token_ids(" 4, 5 ").unwrap(), vec![4, 5]);
        assert!(parse_token_ids("1,x").is_err());
        assert!(parse_token_ids("[-1]").is_err());
        assert!(parse_token_ids("").is_err());
    }
}
