//! Pictures of replays: memory over a trace's operations, as SVG.
//!
//! One panel per (trace, result file); in each, per configuration, the bytes the replay
//! reserved (solid) and the bytes live (dashed) after each operation, in the configuration's
//! colour, with both peaks marked and labelled. The panels of a row (one trace, side by
//! side) share their axes, so that columns compare at a glance; peak labels are placed so
//! that no two overlap (moved up or down from where they belong, with a line to their peak,
//! when they would). Drawn with plotters' SVG backend and its built-in font metrics: the
//! file needs no fonts installed and no network to view.

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

/// Draws `panels` in a grid of `columns` columns into the SVG file `output`, row by row; the
/// panels of a row share their axes. The file is replaced once drawn whole (see
/// [`crate::output`]): what is not a regular file is refused.
pub fn draw(output: &Path, panels: &[Panel<'_>], columns: usize) -> Result<(), String> {
    crate::output::write_whole(output, "the plot", |file| draw_into(file, output, panels, columns))
}

/// [`draw`] into the new file `file`; errors name `output`.
fn draw_into(file: &Path, output: &Path, panels: &[Panel<'_>], columns: usize) -> Result<(), String> {
    let columns = columns.clamp(1, panels.len().max(1));
    let rows = panels.len().div_ceil(columns).max(1);
    let size = (PANEL.0 * columns as u32, PANEL.1 * rows as u32);
    let fail = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", output.display());
    let root = SVGBackend::new(file, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let areas = root.split_evenly((rows, columns));
    for (areas, row) in areas.chunks(columns).zip(panels.chunks(columns)) {
        let axes = Axes::of(row);
        for (area, panel) in areas.iter().zip(row) {
            draw_panel(area, panel, &axes).map_err(|e| fail(&e))?;
        }
    }
    root.present().map_err(|e| fail(&e))
}

/// The axes the panels of a row share.
struct Axes {
    /// The most operations of a result drawn (at least 1).
    max_ops: f64,
    /// The most bytes of a series drawn (at least 1).
    max_bytes: u64,
}

impl Axes {
    /// Axes that hold every series of `panels`.
    fn of(panels: &[Panel<'_>]) -> Self {
        let drawn = || panels.iter().flat_map(|p| &p.results).filter(|r| !r.series.is_empty());
        let max_ops = drawn().map(|r| r.ops).max().unwrap_or(0).max(1) as f64;
        let max_bytes = drawn()
            .flat_map(|r| r.series.reserved.iter().chain(&r.series.live))
            .copied()
            .max()
            .unwrap_or(0)
            .max(1);
        Self { max_ops, max_bytes }
    }
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;
type DrawResult = Result<(), DrawingAreaErrorKind<<SVGBackend<'static> as DrawingBackend>::ErrorType>>;

/// Width of the legend beside each chart, in pixels.
const LEGEND: u32 = 330;

/// The font size of peak labels, as plotters takes it (its SVG backend writes `1 / 1.24` of it).
const LABEL_FONT: u32 = 12;

fn draw_panel(area: &Area<'_>, panel: &Panel<'_>, axes: &Axes) -> DrawResult {
    let drawn: Vec<&ReplayResult> = panel.results.iter().copied().filter(|r| !r.series.is_empty()).collect();
    let Axes { max_ops, max_bytes } = *axes;
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
    // The peaks, labelled once every line is drawn (so that labels lie over lines).
    let mut peaks_drawn: Vec<PeakLabel> = Vec::new();
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
            let at = (x as f64, y);
            peaks_drawn.push(PeakLabel {
                at,
                pixel: chart.backend_coord(&at),
                text: format!("peak {what} {y:.2} {unit}"),
                offset,
                colour,
            });
        }
    }
    let (x_pixels, y_pixels) = chart.plotting_area().get_pixel_range();
    for (label, (dx, dy), moved) in place_labels(&peaks_drawn, (x_pixels, y_pixels)) {
        let (width, height) = label_size(&label.text);
        if moved {
            // A line from the peak to the label's nearer end, at its middle.
            let end = (if dx >= 0 { dx } else { dx + width }, dy + height / 2);
            chart.draw_series(std::iter::once(
                EmptyElement::at(label.at)
                    + PathElement::new(vec![(0, 0), end], label.colour.stroke_width(1)),
            ))?;
        }
        // On a light background, so that the lines under it do not cross its text.
        chart.draw_series(std::iter::once(
            EmptyElement::at(label.at)
                + Circle::new((0, 0), 4, label.colour.filled())
                + Rectangle::new([(dx - 1, dy - 2), (dx + width, dy + height - 1)], WHITE.mix(0.75).filled())
                + Text::new(label.text.clone(), (dx, dy), ("sans-serif", LABEL_FONT)),
        ))?;
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

/// A peak to mark and label.
struct PeakLabel {
    /// The peak, in chart coordinates.
    at: (f64, f64),
    /// The peak, in pixels.
    pixel: (i32, i32),
    /// The label.
    text: String,
    /// Where the label's top belongs, in pixels below the peak (negative: above).
    offset: i32,
    /// The colour of its series.
    colour: RGBAColor,
}

/// An estimate of the box a peak label covers, width and height in whole pixels. The SVG
/// backend writes a font of size `s` as `s / 1.24` pixels (its em); the box is 0.7 em per
/// character (DejaVu Sans, a usual sans-serif, averages about 0.65 em on these labels) and
/// 1.2 em high (its ascent and descent).
fn label_size(text: &str) -> (i32, i32) {
    let em = f64::from(LABEL_FONT) / 1.24;
    let width = (text.chars().count() as f64 * 0.7 * em).ceil().min(f64::from(i32::MAX / 2));
    (width as i32, (1.2 * em).ceil() as i32)
}

/// A box in pixels: left, top, right, bottom.
type Bounds = (i32, i32, i32, i32);

/// Whether two boxes share any point, with a pixel between them counted as touching.
fn intersect(a: Bounds, b: Bounds) -> bool {
    a.0 <= b.2 && b.0 <= a.2 && a.1 <= b.3 && b.1 <= a.3
}

/// Places each label beside its peak, in `area` (pixel ranges, x then y): right of the peak,
/// or left of it when the right would leave the area; at its own vertical offset when that
/// leaves it clear of the labels placed before, else moved up or down (alternately, a line
/// at a time) to the nearest place that does. Returns each label with its top-left corner
/// relative to its peak and whether it was moved. Should no place be clear (more labels
/// than lines in the area), a label stays where it belongs.
fn place_labels(
    labels: &[PeakLabel],
    area: (std::ops::Range<i32>, std::ops::Range<i32>),
) -> Vec<(&PeakLabel, (i32, i32), bool)> {
    let (xs, ys) = area;
    let mut placed: Vec<Bounds> = Vec::new();
    let mut out = Vec::new();
    for label in labels {
        let (width, height) = label_size(&label.text);
        let (px, py) = label.pixel;
        let right = px + 6;
        let left = if right + width <= xs.end { right } else { (px - 6 - width).max(xs.start) };
        let lowest = (ys.end - height).max(ys.start);
        let wanted = (py + label.offset).clamp(ys.start, lowest);
        let step = height + 2;
        let clear = |top: i32| {
            let bounds = (left, top, left + width, top + height);
            !placed.iter().any(|b| intersect(*b, bounds))
        };
        // Where it belongs, then a line up, a line down, two lines up...
        let tries = 2 * ((ys.end - ys.start) / step + 1);
        let top = std::iter::once(wanted)
            .chain((1..=tries).map(|k| {
                if k % 2 == 1 {
                    wanted - step * (k + 1) / 2
                } else {
                    wanted + step * k / 2
                }
            }))
            .filter(|top| (ys.start..=lowest).contains(top))
            .find(|top| clear(*top))
            .unwrap_or(wanted);
        placed.push((left, top, left + width, top + height));
        out.push((label, (left - px, top - py), top != wanted));
    }
    out
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
