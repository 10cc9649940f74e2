//! SVG line and point charts through `plotters` (its SVG backend, no fonts: text is written
//! as SVG `<text>` for the viewer to lay out): the latency plot of `deltafin benchmark` and
//! the per-position loss plot of `deltafin perplexity --plot`.

use anyhow::{Result, anyhow};
use plotters::prelude::*;

/// Colours of the series, by index (matplotlib's "tab10" order).
pub const PALETTE: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x17, 0xbe, 0xcf),
];

/// How a series is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mark {
    /// A polyline through the points.
    Line,
    /// A small dot per point.
    Dots,
}

/// One series: its points, colour index and mark; `legend` names it in the legend (several
/// series may share a name: only the first with a name is listed).
pub struct Series {
    pub legend: Option<String>,
    pub color: usize,
    pub mark: Mark,
    pub points: Vec<(f64, f64)>,
}

/// A chart: title, axis descriptions, series, and what to say when there is nothing to
/// plot.
pub struct Chart<'a> {
    pub title: &'a str,
    pub x_desc: &'a str,
    pub y_desc: &'a str,
    pub series: Vec<Series>,
    pub empty: &'a str,
}

const SIZE: (u32, u32) = (900, 480);

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("cannot draw the plot: {e}")
}

/// The range of `values` padded so that no point sits on the frame (a single value gets a
/// unit-wide range).
fn range(values: impl Iterator<Item = f64>, from_zero: bool) -> std::ops::Range<f64> {
    let (mut lo, mut hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| {
            (l.min(v), h.max(v))
        });
    if from_zero {
        lo = lo.min(0.0);
    }
    if !lo.is_finite() || !hi.is_finite() {
        return 0.0..1.0;
    }
    if hi - lo <= f64::EPSILON * hi.abs().max(1.0) {
        hi = lo + 1.0;
    }
    let pad = (hi - lo) * 0.05;
    (if from_zero && lo >= 0.0 { lo } else { lo - pad })..hi + pad
}

/// An axis label: at most three decimals, without trailing zeros (`5`, not `5.0`).
fn tick(v: &f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" { "0".into() } else { s.to_string() }
}

/// The chart as an SVG document.
pub fn svg(chart: &Chart<'_>) -> Result<String> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let points = || chart.series.iter().flat_map(|s| s.points.iter());
        if points().next().is_none() {
            let style = ("sans-serif", 20).into_font().color(&BLACK);
            root.draw_text(chart.empty, &style, (60, SIZE.1 as i32 / 2))
                .map_err(err)?;
            root.titled(chart.title, ("sans-serif", 22)).map_err(err)?;
            root.present().map_err(err)?;
            drop(root);
            return Ok(out);
        }
        let xs = range(points().map(|p| p.0), false);
        let ys = range(points().map(|p| p.1), true);
        let mut c = ChartBuilder::on(&root)
            .caption(chart.title, ("sans-serif", 22))
            .margin(14)
            .x_label_area_size(42)
            .y_label_area_size(64)
            .build_cartesian_2d(xs, ys)
            .map_err(err)?;
        c.configure_mesh()
            .x_desc(chart.x_desc)
            .y_desc(chart.y_desc)
            .label_style(("sans-serif", 15))
            .x_label_formatter(&tick)
            .y_label_formatter(&tick)
            .axis_desc_style(("sans-serif", 16))
            .draw()
            .map_err(err)?;
        let mut named = std::collections::BTreeSet::new();
        for s in &chart.series {
            let color = PALETTE[s.color % PALETTE.len()];
            let anno = match s.mark {
                Mark::Line => c
                    .draw_series(LineSeries::new(
                        s.points.iter().copied(),
                        color.mix(0.85).stroke_width(2),
                    ))
                    .map_err(err)?,
                Mark::Dots => c
                    .draw_series(
                        s.points
                            .iter()
                            .map(|&p| Circle::new(p, 2, color.mix(0.6).filled())),
                    )
                    .map_err(err)?,
            };
            if let Some(name) = &s.legend
                && named.insert(name.clone())
            {
                let mark = s.mark;
                anno.label(name.as_str()).legend(move |(x, y)| match mark {
                    Mark::Line => {
                        PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
                            .into_dyn()
                    }
                    Mark::Dots => Circle::new((x + 10, y), 3, color.filled()).into_dyn(),
                });
            }
        }
        if !named.is_empty() {
            c.configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .label_font(("sans-serif", 15))
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK.mix(0.4))
                .draw()
                .map_err(err)?;
        }
        root.present().map_err(err)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_become_paths_and_legends() {
        let chart = Chart {
            title: "t & <title>",
            x_desc: "x",
            y_desc: "y",
            series: vec![
                Series {
                    legend: Some("a<b".into()),
                    color: 0,
                    mark: Mark::Line,
                    points: vec![(1.0, 2.0), (2.0, 3.0)],
                },
                Series {
                    legend: Some("a<b".into()),
                    color: 0,
                    mark: Mark::Line,
                    points: vec![(1.0, 1.0), (2.0, 1.5)],
                },
                Series {
                    legend: None,
                    color: 1,
                    mark: Mark::Dots,
                    points: vec![(1.0, 0.5)],
                },
            ],
            empty: "nothing",
        };
        let s = svg(&chart).unwrap();
        assert!(
            s.starts_with("<svg") && s.trim_end().ends_with("</svg>"),
            "{s}"
        );
        // Two runs drawn (width 2), one legend swatch (width 3) and one legend entry for
        // their shared name, escaped text.
        assert_eq!(s.matches("stroke-width=\"2\" points").count(), 2, "{s}");
        assert_eq!(s.matches("stroke-width=\"3\" points").count(), 1, "{s}");
        assert_eq!(s.matches("\na&lt;b\n</text>").count(), 1, "{s}");
        assert!(s.contains("t &amp; &lt;title&gt;"), "{s}");
        assert!(s.contains("<circle"), "{s}");
        let empty = svg(&Chart {
            series: vec![],
            ..chart
        })
        .unwrap();
        assert!(empty.contains("nothing") && !empty.contains("stroke-width=\"2\""));
    }

    #[test]
    fn ticks_drop_trailing_zeros() {
        assert_eq!(tick(&5.0), "5");
        assert_eq!(tick(&7.25), "7.25");
        assert_eq!(tick(&-0.0001), "0");
        assert_eq!(tick(&1000.0), "1000");
    }

    #[test]
    fn ranges_pad_and_never_collapse() {
        assert_eq!(range([2.0, 2.0].into_iter(), false), 1.95..3.05);
        assert_eq!(range(std::iter::empty(), true), 0.0..1.0);
        let r = range([1.0, 3.0].into_iter(), true);
        assert_eq!(r.start, 0.0);
        assert!((r.end - 3.15).abs() < 1e-12);
    }
}
