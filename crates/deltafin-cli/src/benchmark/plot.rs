//! The SVG plot of per-token decode latency (through [`crate::plot`]).

use super::arms::Arm;
use crate::plot::{Chart, Mark, Series, svg};
use anyhow::Result;

/// An SVG of per-token decode latency (ms against the decode step, steps ≥ 1) per valid run
/// (`series`: the run's arm index and its latencies), coloured by arm, one legend entry per
/// arm.
pub fn latency_svg(arms: &[Arm], series: &[(usize, Vec<f64>)]) -> Result<String> {
    svg(&Chart {
        title: "deltafin benchmark: per-token decode latency (steps after the prefill)",
        x_desc: "decode step",
        y_desc: "latency (ms)",
        series: series
            .iter()
            .filter(|(_, s)| !s.is_empty())
            .map(|(arm, s)| Series {
                legend: arms.get(*arm).map(|a| a.name.clone()),
                color: *arm,
                mark: Mark::Line,
                points: s
                    .iter()
                    .enumerate()
                    .map(|(i, &ms)| ((i + 1) as f64, ms))
                    .collect(),
            })
            .collect(),
        empty: "no decode steps to plot (every run emitted one token)",
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::benchmark::arms::parse_arms;

    #[test]
    fn svg_has_one_line_per_run_and_one_legend_entry_per_arm() {
        let arms = parse_arms(&["a=".into(), "b<&>=".into()], &[], &[]);
        assert!(arms.is_err());
        let arms = parse_arms(&["a=".into(), "b=".into()], &[], &[]).unwrap();
        let runs = [
            (0, vec![1.0, 2.0]),
            (1, vec![1.5, 1.0]),
            (0, vec![1.1, 2.1]),
        ];
        let svg = latency_svg(&arms, &runs).unwrap();
        // Three runs (width 2) and two legend swatches (width 3), one per arm.
        assert_eq!(svg.matches("stroke-width=\"2\" points").count(), 3, "{svg}");
        assert_eq!(svg.matches("stroke-width=\"3\" points").count(), 2, "{svg}");
        assert_eq!(svg.matches("\na\n</text>").count(), 1, "{svg}");
        assert_eq!(svg.matches("\nb\n</text>").count(), 1, "{svg}");
        assert!(svg.trim_end().ends_with("</svg>"));
        let empty = latency_svg(&arms, &[]).unwrap();
        assert!(empty.contains("no decode steps"));
    }
}
