//! Pictures of replays: memory over a trace's operations, as SVG.
//!
//! One panel per (trace, result file); in each, per configuration, the bytes the replay
//! reserved (solid) and the bytes live (dashed) after each operation, in the configuration's
//! colour, with both peaks marked and labelled. Drawn with plotters' SVG backend and its
//! built-in font metrics: the file needs no fonts installed and no network to view.

use std::path::Path;

use plotters::prelude::*;
use streamalloc_replay::replay::{ReplayResult, Series};

/// One panel: a title and the results drawn in it.
pub struct Panel<'a> {
    /// Shown above the panel.
    pub title: String,
    /// The results, each labelled by its configuration.
    pub results: Vec<&'a ReplayResult>,
}

/// Panel size in pixels.
const PANEL: (u32, u32) = (900, 420);

/// Draws `panels` in a grid of `columns` columns into the SVG file `path`.
pub fn draw(path: &Path, panels: &[Panel<'_>], columns: usize) -> Result<(), String> {
    let columns = columns.clamp(1, panels.len().max(1));
    let rows = panels.len().div_ceil(columns).max(1);
    let size = (PANEL.0 * columns as u32, PANEL.1 * rows as u32);
    let fail = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", path.display());
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    for (area, panel) in root.split_evenly((rows, columns)).iter().zip(panels) {
        draw_panel(area, panel).map_err(|e| fail(&e))?;
    }
    root.present().map_err(|e| fail(&e))
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;
type DrawResult = Result<(), DrawingAreaErrorKind<<SVGBackend<'static> as DrawingBackend>::ErrorType>>;

/// Width of the legend beside each chart, in pixels.
const LEGEND: u32 = 330;

fn draw_panel(area: &Area<'_>, panel: &Panel<'_>) -> DrawResult {
    let drawn: Vec<&ReplayResult> = panel.results.iter().copied().filter(|r| !r.series.is_empty()).collect();
    let max_ops = drawn.iter().map(|r| r.ops).max().unwrap_or(0).max(1) as f64;
    let max_bytes = drawn
        .iter()
        .flat_map(|r| r.series.reserved.iter().chain(&r.series.live))
        .copied()
        .max()
        .unwrap_or(0)
        .max(1);
    let (unit, scale) = unit(max_bytes);
    let (plot_area, legend_area) = area.split_horizontally(PANEL.0 - LEGEND);
    let mut chart = ChartBuilder::on(&plot_area)
        .caption(&panel.title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..max_ops, 0f64..max_bytes as f64 / scale * 1.12)?;
    chart
        .configure_mesh()
        .x_desc("trace operation")
        .y_desc(format!("bytes ({unit})"))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.1}"))
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    if drawn.is_empty() {
        let text = if panel.results.is_empty() {
            "no result for this trace here"
        } else {
            "no series in these results (saved before replay kept them?)"
        };
        chart.draw_series(std::iter::once(Text::new(text, (0.0, 0.5), ("sans-serif", 14))))?;
    }
    // The legend: one row per line drawn.
    let mut legend: Vec<(RGBAColor, bool, String)> = Vec::new();
    // Live bytes alike for every configuration (the usual case) are drawn once, in grey.
    let alike = drawn.len() > 1 && drawn.windows(2).all(|w| w[0].series.live == w[1].series.live);
    // Each live series drawn: the series, its legend row, how many results share it.
    let mut live_drawn: Vec<(&Vec<u64>, usize, usize)> = Vec::new();
    for (i, r) in drawn.iter().enumerate() {
        let colour = Palette99::pick(i).to_rgba();
        let points = |values: &[u64]| -> Vec<(f64, f64)> {
            values
                .iter()
                .enumerate()
                .map(|(p, v)| ((p * r.series.ops_per_point) as f64, *v as f64 / scale))
                .collect()
        };
        chart.draw_series(LineSeries::new(points(&r.series.reserved), colour.stroke_width(2)))?;
        legend.push((colour, true, format!("{} reserved", r.allocator)));
        let mut peaks = vec![("reserved", &r.series.reserved, -18, colour)];
        // The same trace gives every configuration the same live bytes: drawn once.
        match live_drawn.iter_mut().find(|(live, _, _)| **live == r.series.live) {
            Some((_, _, shared)) => *shared += 1,
            None => {
                let colour = if alike { BLACK.mix(0.55) } else { colour };
                chart.draw_series(DashedLineSeries::new(
                    points(&r.series.live),
                    6,
                    4,
                    colour.stroke_width(1),
                ))?;
                live_drawn.push((&r.series.live, legend.len(), 1));
                legend.push((colour, false, format!("{} live", r.allocator)));
                peaks.push(("live", &r.series.live, 6, colour));
            }
        }
        for (what, values, offset, colour) in peaks {
            let (x, y) = peak(&r.series, values);
            let y = y as f64 / scale;
            chart.draw_series(std::iter::once(
                EmptyElement::at((x as f64, y))
                    + Circle::new((0, 0), 4, colour.filled())
                    + Text::new(format!("peak {what} {y:.2} {unit}"), (6, offset), ("sans-serif", 12)),
            ))?;
        }
    }
    for &(_, row, shared) in live_drawn.iter().filter(|(_, _, shared)| *shared > 1) {
        legend[row].2 = format!("live (alike for {shared} configurations)");
    }
    for (row, (colour, solid, label)) in legend.iter().enumerate() {
        let y = 48 + 20 * row as i32;
        let style = if *solid { colour.stroke_width(2) } else { colour.stroke_width(1) };
        if *solid {
            legend_area.draw(&PathElement::new(vec![(4, y), (28, y)], style))?;
        } else {
            for x in [4, 14, 24] {
                legend_area.draw(&PathElement::new(vec![(x, y), (x + 5, y)], style))?;
            }
        }
        legend_area.draw(&Text::new(label.as_str(), (36, y - 7), ("sans-serif", 13)))?;
    }
    Ok(())
}

/// The operation and value of the first highest point of `values` (a series of `series`).
fn peak(series: &Series, values: &[u64]) -> (usize, u64) {
    let (index, value) =
        values.iter().enumerate().fold((0, 0), |best, (i, v)| if *v > best.1 { (i, *v) } else { best });
    (index * series.ops_per_point, value)
}

/// The binary unit `max` is best shown in, and its size.
fn unit(max: u64) -> (&'static str, f64) {
    const UNITS: [(&str, f64); 4] =
        [("GiB", (1u64 << 30) as f64), ("MiB", (1u64 << 20) as f64), ("KiB", 1024.0), ("B", 1.0)];
    UNITS.iter().copied().find(|(_, size)| max as f64 >= *size).unwrap_or(("B", 1.0))
}
