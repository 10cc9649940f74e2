//! The SVG plot of per-token decode latency.

use super::arms::Arm;
use std::fmt::Write as _;

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const PALETTE: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// An SVG of per-token decode latency (ms, steps ≥ 1) per run, coloured by arm.
pub fn latency_svg(arms: &[Arm], series: &[(usize, Vec<f64>)]) -> String {
    let (w, h) = (900.0f64, 480.0f64);
    let (left, right, top, bottom) = (70.0, 190.0, 40.0, 50.0);
    let pw = w - left - right;
    let ph = h - top - bottom;
    let max_steps = series.iter().map(|(_, s)| s.len()).max().unwrap_or(0);
    let max_ms = series
        .iter()
        .flat_map(|(_, s)| s.iter().copied())
        .fold(0.0f64, f64::max);
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">deltafin benchmark: per-token decode latency (steps after the prefill)</text>"#,
        left + pw / 2.0
    );
    let _ = writeln!(
        svg,
        r##"<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>"##
    );
    if max_steps == 0 || max_ms <= 0.0 {
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">no decode steps to plot (every run emitted one token)</text>"#,
            left + pw / 2.0,
            top + ph / 2.0
        );
    } else {
        let y_max = max_ms * 1.1;
        let x_of = |i: usize| {
            if max_steps <= 1 {
                left + pw / 2.0
            } else {
                left + pw * i as f64 / (max_steps - 1) as f64
            }
        };
        let y_of = |ms: f64| top + ph * (1.0 - ms / y_max);
        for k in 0..=4 {
            let ms = y_max * k as f64 / 4.0;
            let y = y_of(ms);
            let _ = writeln!(
                svg,
                r##"<line x1="{left}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{ms:.3}</text>"##,
                left + pw,
                left - 6.0,
                y + 4.0
            );
        }
        for i in [0, max_steps - 1] {
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
                x_of(i),
                top + ph + 18.0,
                i + 1
            );
        }
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">decode step</text>"#,
            left + pw / 2.0,
            h - 10.0
        );
        let _ = writeln!(
            svg,
            r#"<text x="18" y="{}" text-anchor="middle" transform="rotate(-90 18 {})">latency (ms)</text>"#,
            top + ph / 2.0,
            top + ph / 2.0
        );
        for (arm, s) in series {
            if s.is_empty() {
                continue;
            }
            let pts: Vec<String> = s
                .iter()
                .enumerate()
                .map(|(i, &ms)| format!("{:.1},{:.1}", x_of(i), y_of(ms)))
                .collect();
            let _ = writeln!(
                svg,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.5" stroke-opacity="0.8" points="{}"/>"#,
                PALETTE[arm % PALETTE.len()],
                pts.join(" ")
            );
        }
    }
    for (i, a) in arms.iter().enumerate() {
        let y = top + 14.0 + 20.0 * i as f64;
        let x = left + pw + 16.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            x + 24.0,
            PALETTE[i % PALETTE.len()],
            x + 30.0,
            y + 4.0,
            xml_escape(&a.name)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::benchmark::arms::parse_arms;

    #[test]
    fn svg_has_one_polyline_per_series() {
        let arms = parse_arms(&["a=".into(), "b<&>=".into()], &[], &[]);
        assert!(arms.is_err());
        let arms = parse_arms(&["a=".into(), "b=".into()], &[], &[]).unwrap();
        let svg = latency_svg(&arms, &[(0, vec![1.0, 2.0]), (1, vec![1.5, 1.0])]);
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.ends_with("</svg>\n"));
        let empty = latency_svg(&arms, &[]);
        assert!(empty.contains("no decode steps"));
    }
}
