//! Ranking experts from router traces (§4.9) and the heat histogram (§4.8), for
//! `deltafin warm-expert-cache`.
//!
//! ```text
//! routes[l, e] = rows of all trace lines that chose e at layer l
//! weight[l, e] = Σ of their router weights
//! score[l, e]  = routes[l, e] + heat[l, e]          (heat: decayed passes that routed e)
//! rank: score ↓, then weight ↓, then (layer, expert) ↑
//! ```
//!
//! Trace lines are parsed strictly: exactly the keys `step`, `layer`, `ids`, `w`; `layer` a
//! MoE layer of the model; `ids` whole rows of `k` expert ids below `E`, at most 56 rows;
//! `w` one number (or `null`, written for a non-finite weight) per id. A bad line is an error
//! naming `file:line`.

use crate::heat::{HeatDims, HeatTable};
use crate::trace::ROWS_PER_LINE;
use std::collections::HashMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};

/// A router-trace file that cannot be read or has a bad line.
#[derive(Debug, thiserror::Error)]
pub enum TraceReadError {
    /// The file cannot be opened or read.
    #[error("router trace {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Line `line` (1-based) is not a valid trace line.
    #[error("{}:{line}: {message}", path.display())]
    Line {
        path: PathBuf,
        line: usize,
        message: String,
    },
}

/// One parsed trace line.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceLine {
    pub step: u64,
    pub layer: usize,
    pub ids: Vec<usize>,
    /// Router weights; `None` where the trace wrote `null`.
    pub w: Vec<Option<f64>>,
}

/// Parse one line of a trace for a model of shape `dims`.
pub fn parse_line(text: &str, dims: HeatDims) -> Result<TraceLine, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not a JSON object: {e}"))?;
    let o = v
        .as_object()
        .ok_or_else(|| "not a JSON object".to_string())?;
    for k in o.keys() {
        if !["step", "layer", "ids", "w"].contains(&k.as_str()) {
            return Err(format!(
                "unknown field {k:?} (a trace line has step, layer, ids, w)"
            ));
        }
    }
    let field = |k: &str| o.get(k).ok_or_else(|| format!("missing field {k:?}"));
    let step = field("step")?
        .as_u64()
        .ok_or_else(|| "field \"step\" is not an unsigned integer".to_string())?;
    let layer = field("layer")?
        .as_u64()
        .ok_or_else(|| "field \"layer\" is not an unsigned integer".to_string())?
        as usize;
    if !(1..=dims.layers).contains(&layer) {
        return Err(format!(
            "layer {layer} is not a MoE layer of this model (1…{})",
            dims.layers
        ));
    }
    let ids = field("ids")?
        .as_array()
        .ok_or_else(|| "field \"ids\" is not an array".to_string())?
        .iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_u64()
                .map(|e| e as usize)
                .filter(|&e| e < dims.experts)
                .ok_or_else(|| format!("ids[{i}] = {x} is not an expert id below {}", dims.experts))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let k = dims.top_k.max(1);
    if ids.is_empty() || ids.len() % k != 0 || ids.len() > ROWS_PER_LINE * k {
        return Err(format!(
            "{} ids: expected whole rows of {k} (1…{ROWS_PER_LINE} rows)",
            ids.len()
        ));
    }
    let w = field("w")?
        .as_array()
        .ok_or_else(|| "field \"w\" is not an array".to_string())?
        .iter()
        .enumerate()
        .map(|(i, x)| match x {
            serde_json::Value::Null => Ok(None),
            _ => x
                .as_f64()
                .map(Some)
                .ok_or_else(|| format!("w[{i}] = {x} is not a number")),
        })
        .collect::<Result<Vec<_>, _>>()?;
    if w.len() != ids.len() {
        return Err(format!("{} weights for {} ids", w.len(), ids.len()));
    }
    Ok(TraceLine {
        step,
        layer,
        ids,
        w,
    })
}

/// Route counts gathered from traces.
#[derive(Clone, Debug, Default)]
pub struct RouteCounts {
    /// `(layer, expert)` → (rows that chose it, sum of their weights).
    pub routes: HashMap<(usize, usize), (u64, f64)>,
    /// Trace lines read.
    pub lines: u64,
}

/// What one trace file contributed.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceSummary {
    pub path: PathBuf,
    pub lines: u64,
    /// Distinct `step` values.
    pub passes: u64,
    /// Torn lines skipped: records a crash or a full disk cut short
    /// ([`deltafin_tensor::append::is_torn_json`]).
    pub torn: u64,
}

/// Whether the first non-empty line of `path` looks like a router trace (has `"layer"` and
/// `"ids"`); used to tell traces from other JSONL files (such as run events) in `k3-meta/`.
pub fn looks_like_trace(path: &Path) -> bool {
    let Ok(f) = std::fs::File::open(path) else {
        return false;
    };
    let mut lines = std::io::BufReader::new(f).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.trim().is_empty() => continue,
            Some(Ok(l)) => {
                return serde_json::from_str::<serde_json::Value>(&l).is_ok_and(|v| {
                    v.get("layer").is_some() && v.get("ids").is_some() && v.get("event").is_none()
                });
            }
            _ => return false,
        }
    }
}

/// Add the routes of the trace at `path` to `counts`. Blank lines are skipped, and so are
/// torn lines (a record cut short by a crash or a full disk; counted in
/// [`TraceSummary::torn`]); any other bad line is an error naming `path:line`.
pub fn read_trace(
    path: &Path,
    dims: HeatDims,
    counts: &mut RouteCounts,
) -> Result<TraceSummary, TraceReadError> {
    let io = |source| TraceReadError::Io {
        path: path.to_path_buf(),
        source,
    };
    let f = std::fs::File::open(path).map_err(io)?;
    let mut steps = std::collections::HashSet::new();
    let (mut n, mut torn) = (0, 0);
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line.map_err(io)?;
        if line.trim().is_empty() {
            continue;
        }
        if deltafin_tensor::append::is_torn_json(&line) {
            torn += 1;
            continue;
        }
        let t = parse_line(&line, dims).map_err(|message| TraceReadError::Line {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        })?;
        steps.insert(t.step);
        n += 1;
        for (&e, w) in t.ids.iter().zip(&t.w) {
            let c = counts.routes.entry((t.layer, e)).or_insert((0, 0.0));
            c.0 += 1;
            c.1 += w.unwrap_or(0.0);
        }
    }
    counts.lines += n;
    Ok(TraceSummary {
        path: path.to_path_buf(),
        lines: n,
        passes: steps.len() as u64,
        torn,
    })
}

/// One ranked expert.
#[derive(Clone, Debug, PartialEq)]
pub struct Ranked {
    pub layer: usize,
    pub expert: usize,
    /// Trace rows that chose it.
    pub routes: u64,
    /// Sum of those rows' router weights.
    pub weight: f64,
    /// Its heat in the histogram (0 without one).
    pub heat: f64,
    /// `routes + heat`.
    pub score: f64,
}

/// Every expert with a positive score, best first (see the module docs).
pub fn rank(counts: &RouteCounts, heat: Option<&HeatTable>) -> Vec<Ranked> {
    let mut all: HashMap<(usize, usize), Ranked> = HashMap::new();
    for (&(layer, expert), &(routes, weight)) in &counts.routes {
        all.insert(
            (layer, expert),
            Ranked {
                layer,
                expert,
                routes,
                weight,
                heat: 0.0,
                score: 0.0,
            },
        );
    }
    if let Some(t) = heat {
        for (s, &h) in t.heat.iter().enumerate() {
            if h <= 0.0 {
                continue;
            }
            let (layer, expert) = (s / t.dims.experts + 1, s % t.dims.experts);
            all.entry((layer, expert))
                .or_insert(Ranked {
                    layer,
                    expert,
                    routes: 0,
                    weight: 0.0,
                    heat: 0.0,
                    score: 0.0,
                })
                .heat = h;
        }
    }
    let mut v: Vec<Ranked> = all
        .into_values()
        .map(|mut r| {
            r.score = r.routes as f64 + r.heat;
            r
        })
        .filter(|r| r.score > 0.0)
        .collect();
    v.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then(b.weight.total_cmp(&a.weight))
            .then((a.layer, a.expert).cmp(&(b.layer, b.expert)))
    });
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::RouterTrace;

    use crate::test_support::DIMS;

    #[test]
    fn ranks_what_a_router_trace_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        let t = RouterTrace::create(&p).unwrap();
        t.record_routes(1, 2, &[3, 1, 3, 2], &[0.9, 0.1, 0.8, 0.2]);
        t.record_routes(2, 2, &[5, 6], &[0.5, 0.5]);
        t.record_routes(1, 2, &[3, 2], &[0.7, 0.3]);
        drop(t);
        let mut c = RouteCounts::default();
        let s = read_trace(&p, DIMS, &mut c).unwrap();
        assert_eq!((s.lines, s.passes), (3, 2));
        let mut heat = HeatTable::empty(DIMS);
        for _ in 0..5 {
            heat.record_pass([(3, &[7usize][..])]);
        }
        let r = rank(&c, Some(&heat));
        let order: Vec<(usize, usize)> = r.iter().map(|x| (x.layer, x.expert)).collect();
        assert_eq!(order, [(3, 7), (1, 3), (1, 2), (2, 5), (2, 6), (1, 1)]);
        assert_eq!(r[1].routes, 3);
        assert!((r[1].weight - 2.4).abs() < 1e-9);
        assert!(r[0].heat > 4.9 && r[0].routes == 0);
        // (2,5) and (2,6) tie on score and weight: layer then expert order.
        assert_eq!(rank(&c, None).len(), 5);
    }

    #[test]
    fn bad_lines_name_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad.jsonl");
        let good = r#"{"step": 0, "layer": 1, "ids": [1, 2], "w": [0.5, 0.5]}"#;
        for (bad, why) in [
            ("not json", "not a JSON object"),
            (
                r#"{"step": 0, "layer": 4, "ids": [1, 2], "w": [0.5, 0.5]}"#,
                "layer 4",
            ),
            (
                r#"{"step": 0, "layer": 1, "ids": [1, 8], "w": [0.5, 0.5]}"#,
                "ids[1] = 8",
            ),
            (
                r#"{"step": 0, "layer": 1, "ids": [1], "w": [0.5]}"#,
                "whole rows of 2",
            ),
            (
                r#"{"step": 0, "layer": 1, "ids": [1, 2], "w": [0.5]}"#,
                "1 weights for 2 ids",
            ),
            (
                r#"{"step": -1, "layer": 1, "ids": [1, 2], "w": [0.5, 0.5]}"#,
                "\"step\"",
            ),
            (
                r#"{"step": 0, "layer": 1, "ids": [1, 2], "w": [0.5, "x"]}"#,
                "w[1]",
            ),
            (
                r#"{"step": 0, "layer": 1, "ids": [1, 2], "w": [1, 1], "x": 1}"#,
                "unknown field \"x\"",
            ),
            (
                r#"{"layer": 1, "ids": [1, 2], "w": [1, 1]}"#,
                "missing field \"step\"",
            ),
        ] {
            std::fs::write(&p, format!("{good}\n\n{bad}\n")).unwrap();
            let e = read_trace(&p, DIMS, &mut RouteCounts::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains("bad.jsonl:3: ") && e.contains(why), "{e}");
        }
        let e = read_trace(&dir.path().join("none"), DIMS, &mut RouteCounts::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("router trace") && e.contains("none"), "{e}");
        std::fs::write(&p, format!("{good}\n")).unwrap();
        assert!(looks_like_trace(&p));
        std::fs::write(
            &p,
            "{\"schema\": \"deltafin.run_event.v1\", \"event\": \"run_start\"}\n",
        )
        .unwrap();
        assert!(!looks_like_trace(&p));
    }
}
