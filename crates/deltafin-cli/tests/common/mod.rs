//! Helpers shared by the tests of the `deltafin` process: its output as text, JSON-lines files
//! (events files, `runs.jsonl`) and token-id arrays.
// Each test binary uses a part of this module.
#![allow(dead_code)]

use serde_json::Value;
use std::path::Path;
use std::process::Output;

/// A finished process's stdout then stderr, for assertions and failure messages.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A finished process's stdout and stderr, apart.
pub fn stdout_stderr(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The values of a JSON-lines file, one a line.
pub fn jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A JSON array of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}
