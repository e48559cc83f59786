//! The report's charts, drawn by `plotters` into SVG strings: one function per chart, from the run record.
//!
//! ```text
//!  RunRecord ──▶ loss_and_tau │ token_rates │ queue_depth │ drafter_shares (one per drafter) │ step_phases
//!           ──▶ Chart { id, title, svg, legend } ──▶ report::page (inlined <svg>, legend in HTML)
//! ```
//!
//! Every chart has the same size ([`CHART_WIDTH`] × [`CHART_HEIGHT`]), and only the data is drawn in colour:
//! axes, grid and text are black or grey, and the legend is HTML beside the chart, not inside it. The browser
//! check (`scripts/report-check.sh`) relies on that: coloured pixels in a chart's region mean its data drew.

use plotters::coord::ranged1d::{IntoSegmentedCoord, SegmentValue};
use plotters::prelude::*;

use super::ReportError;
use super::run_files::{RunRecord, simulated_tau, teacher_forced_tau};
use crate::figures::amount;
use crate::telemetry::{Diagnosis, StatusLine};

/// Width of every chart in CSS pixels.
pub const CHART_WIDTH: u32 = 600;
/// Height of every chart in CSS pixels.
pub const CHART_HEIGHT: u32 = 300;

/// The data colours (saturated, so none is mistaken for the black and grey of axes and text).
const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(23, 190, 207),
];
/// Reference levels (capacity, watermark) are drawn without colour: they are not data.
const LEVEL_COLOURS: [RGBColor; 2] = [RGBColor(0, 0, 0), RGBColor(128, 128, 128)];

/// One drawn chart.
#[derive(Debug, Clone)]
pub struct Chart {
    /// A stable id (`loss-tau`, `tokens`, `queue`, `drafter-0`, …, `phases`): the element id in the page.
    pub id: String,
    /// The heading above it.
    pub title: String,
    /// The `<svg>` element.
    pub svg: String,
    /// Each series' name and colour (`#rrggbb`), for the HTML legend.
    pub legend: Vec<(String, String)>,
    /// A sentence under the chart when the data is partial (no summary yet, no τ for this family).
    pub note: Option<String>,
}

/// One line of a chart.
struct Series {
    label: String,
    colour: RGBColor,
    points: Vec<(f64, f64)>,
    /// On the right-hand axis.
    secondary: bool,
    /// Drawn as dots (a few measurements) rather than a line.
    dots: bool,
}

/// A chart of lines over one x axis, with an optional second y axis and flat reference levels.
struct LineChart<'a> {
    id: String,
    title: String,
    x_desc: &'a str,
    y_desc: &'a str,
    y2_desc: Option<&'a str>,
    series: Vec<Series>,
    levels: Vec<(String, f64)>,
    note: Option<String>,
}

fn hex(colour: RGBColor) -> String {
    format!("#{:02x}{:02x}{:02x}", colour.0, colour.1, colour.2)
}

fn draw_error(chart: &str) -> impl Fn(String) -> ReportError + '_ {
    move |message| ReportError::Draw {
        chart: chart.to_string(),
        message,
    }
}

/// `lo..hi` around `values`, never empty; from zero when `from_zero`.
fn span(values: impl Iterator<Item = f64>, from_zero: bool) -> std::ops::Range<f64> {
    let (mut lo, mut hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if !lo.is_finite() {
        (lo, hi) = (0.0, 1.0);
    }
    if from_zero {
        lo = lo.min(0.0);
    }
    let pad = ((hi - lo) * 0.05).max(1e-9);
    if hi - lo < 1e-9 {
        return (lo - 0.5).max(if from_zero { 0.0 } else { f64::MIN })..hi + 0.5;
    }
    (if from_zero { lo } else { lo - pad })..hi + pad
}

impl LineChart<'_> {
    fn draw(self) -> Result<Chart, ReportError> {
        let id = self.id.clone();
        let error = draw_error(&id);
        let x_range = span(
            self.series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| p.0)),
            false,
        );
        let y_range = span(
            self.series
                .iter()
                .filter(|s| !s.secondary)
                .flat_map(|s| s.points.iter().map(|p| p.1))
                .chain(self.levels.iter().map(|l| l.1)),
            true,
        );
        let y2_range = span(
            self.series
                .iter()
                .filter(|s| s.secondary)
                .flat_map(|s| s.points.iter().map(|p| p.1)),
            false,
        );
        let mut svg = String::new();
        {
            let root =
                SVGBackend::with_string(&mut svg, (CHART_WIDTH, CHART_HEIGHT)).into_drawing_area();
            root.fill(&WHITE).map_err(|e| error(e.to_string()))?;
            let mut chart = ChartBuilder::on(&root)
                .margin(8)
                .x_label_area_size(36)
                .y_label_area_size(56)
                .right_y_label_area_size(if self.y2_desc.is_some() { 64 } else { 0 })
                .build_cartesian_2d(x_range.clone(), y_range)
                .map_err(|e| error(e.to_string()))?
                .set_secondary_coord(x_range.clone(), y2_range);
            chart
                .configure_mesh()
                .light_line_style(RGBColor(235, 235, 235))
                .bold_line_style(RGBColor(210, 210, 210))
                .x_desc(self.x_desc)
                .y_desc(self.y_desc)
                .x_label_formatter(&|v| amount(*v))
                .y_label_formatter(&|v| amount(*v))
                .label_style(("sans-serif", 12))
                .draw()
                .map_err(|e| error(e.to_string()))?;
            if let Some(y2) = self.y2_desc {
                chart
                    .configure_secondary_axes()
                    .y_desc(y2)
                    .y_label_formatter(&|v| amount(*v))
                    .label_style(("sans-serif", 12))
                    .draw()
                    .map_err(|e| error(e.to_string()))?;
            }
            for (index, (_, level)) in self.levels.iter().enumerate() {
                let colour = LEVEL_COLOURS[index % LEVEL_COLOURS.len()];
                chart
                    .draw_series(LineSeries::new(
                        [(x_range.start, *level), (x_range.end, *level)],
                        colour.stroke_width(1),
                    ))
                    .map_err(|e| error(e.to_string()))?;
            }
            for series in &self.series {
                let style = series.colour.stroke_width(2);
                let points = series.points.iter().copied();
                let drawn = match (series.secondary, series.dots) {
                    (false, false) => chart.draw_series(LineSeries::new(points, style)).map(drop),
                    (true, false) => chart
                        .draw_secondary_series(LineSeries::new(points, style))
                        .map(drop),
                    (false, true) => chart
                        .draw_series(points.map(|p| Circle::new(p, 5, style.filled())))
                        .map(drop),
                    (true, true) => chart
                        .draw_secondary_series(points.map(|p| Circle::new(p, 5, style.filled())))
                        .map(drop),
                };
                drawn.map_err(|e| error(e.to_string()))?;
            }
            root.present().map_err(|e| error(e.to_string()))?;
        }
        let mut legend: Vec<(String, String)> = self
            .series
            .iter()
            .map(|s| (s.label.clone(), hex(s.colour)))
            .collect();
        legend.extend(
            self.levels
                .iter()
                .enumerate()
                .map(|(i, (label, _))| (label.clone(), hex(LEVEL_COLOURS[i % 2]))),
        );
        Ok(Chart {
            id: self.id,
            title: self.title,
            svg,
            legend,
            note: self.note,
        })
    }
}

fn points(
    lines: &[StatusLine],
    x: fn(&StatusLine) -> f64,
    y: impl Fn(&StatusLine) -> Option<f64>,
) -> Vec<(f64, f64)> {
    lines
        .iter()
        .filter_map(|line| y(line).filter(|v| v.is_finite()).map(|v| (x(line), v)))
        .collect()
}

fn by_step(line: &StatusLine) -> f64 {
    line.step as f64
}

fn by_time(line: &StatusLine) -> f64 {
    line.elapsed_s
}

fn series(label: &str, colour: usize, points: Vec<(f64, f64)>) -> Series {
    Series {
        label: label.to_string(),
        colour: PALETTE[colour % PALETTE.len()],
        points,
        secondary: false,
        dots: false,
    }
}

/// The real loop's τ per checked step: the summary's measurements, or (while the run goes) the status lines'
/// newest measurement at each line.
fn acceptance_taus(run: &RunRecord) -> Vec<(f64, f64)> {
    if let Some(acceptance) = run.summary.as_ref().and_then(|s| s.acceptance.as_ref()) {
        return acceptance
            .measurements
            .iter()
            .map(|m| (m.step as f64, m.tau))
            .collect();
    }
    let mut taus: Vec<(f64, f64)> = Vec::new();
    for line in &run.status {
        if let Some((Some(step), Some(tau))) = line.acceptance.as_ref().map(|a| (a.step, a.tau))
            && taus.last().is_none_or(|last| last.0 != step as f64)
        {
            taus.push((step as f64, tau));
        }
    }
    taus
}

/// The loss and τ over steps: the teacher-forced τ of every status line, and the real loop's τ at each
/// acceptance check.
pub fn loss_and_tau(run: &RunRecord) -> Result<Chart, ReportError> {
    let loss = points(&run.status, by_step, |l| l.loss);
    let tau = points(&run.status, by_step, teacher_forced_tau);
    let simulated = points(&run.status, by_step, simulated_tau);
    let accepted = acceptance_taus(run);
    let has_tau = !tau.is_empty() || !simulated.is_empty() || !accepted.is_empty();
    let mut all = vec![series("loss", 0, loss)];
    if !tau.is_empty() {
        all.push(Series {
            secondary: true,
            ..series("τ exact, teacher-forced (right axis)", 1, tau)
        });
    }
    if !simulated.is_empty() {
        all.push(Series {
            secondary: true,
            ..series(
                "τ simulated from slot accuracies (right axis)",
                3,
                simulated,
            )
        });
    }
    if !accepted.is_empty() {
        all.push(Series {
            secondary: true,
            dots: true,
            ..series(
                "τ of the real draft-and-verify loop (right axis)",
                2,
                accepted,
            )
        });
    }
    LineChart {
        id: "loss-tau".into(),
        title: "Loss and acceptance length τ".into(),
        x_desc: "step",
        y_desc: "loss",
        y2_desc: has_tau.then_some("τ"),
        series: all,
        levels: Vec::new(),
        note: (!has_tau).then(|| "This drafter family reports no τ.".to_string()),
    }
    .draw()
}

/// Real tokens and token slots per second over time.
pub fn token_rates(run: &RunRecord) -> Result<Chart, ReportError> {
    LineChart {
        id: "tokens".into(),
        title: "Tokens per second".into(),
        x_desc: "seconds",
        y_desc: "tokens / s",
        y2_desc: None,
        series: vec![
            series(
                "real tokens / s",
                0,
                points(&run.status, by_time, |l| l.real_tokens_per_s),
            ),
            series(
                "token slots / s (padding included)",
                3,
                points(&run.status, by_time, |l| l.token_slots_per_s),
            ),
        ],
        levels: Vec::new(),
        note: None,
    }
    .draw()
}

/// The queue's depth per bucket over time, against its capacity and (from the summary) its watermark.
pub fn queue_depth(run: &RunRecord) -> Result<Chart, ReportError> {
    let buckets = run.status.iter().map(|l| l.q_hsb.len()).max().unwrap_or(0);
    // The total first, so a bucket holding everything draws over it and stays visible.
    let mut all: Vec<Series> = Vec::new();
    if buckets > 1 {
        all.push(series(
            "all buckets",
            buckets,
            points(&run.status, by_time, |l| Some(l.q_hs.depth as f64)),
        ));
    }
    all.extend((0..buckets).map(|b| {
        let depth = points(&run.status, by_time, |l| l.q_hsb.get(b).map(|&d| d as f64));
        series(&format!("bucket {b}"), b, depth)
    }));
    let capacity = run
        .summary
        .as_ref()
        .map(|s| s.queue.capacity)
        .or_else(|| run.status.last().map(|l| l.q_hs.capacity));
    let min_ready = run.summary.as_ref().map(|s| s.queue.min_ready);
    let mut levels = Vec::new();
    if let Some(capacity) = capacity {
        levels.push((format!("capacity {capacity}"), capacity as f64));
    }
    if let Some(min_ready) = min_ready {
        levels.push((format!("min_ready {min_ready}"), min_ready as f64));
    }
    LineChart {
        id: "queue".into(),
        title: "Queue depth per bucket".into(),
        x_desc: "seconds",
        y_desc: "items queued",
        y2_desc: None,
        series: all,
        levels,
        note: min_ready.is_none().then(|| {
            "The watermark (min_ready) is known once summary.json is written.".to_string()
        }),
    }
    .draw()
}

/// One drafter's shares of each interval: busy, waiting for data, in the all-reduce, and on a GPU the device.
pub fn drafter_shares(run: &RunRecord, drafter: usize) -> Result<Chart, ReportError> {
    let of = |share: fn(&crate::telemetry::DrafterStatus) -> Option<f64>| {
        points(&run.status, by_time, move |l| {
            l.drafters.get(drafter).and_then(share)
        })
    };
    let mut all = vec![
        series("busy (inside the step)", 0, of(|d| Some(d.busy_pct))),
        series("waiting for data", 1, of(|d| Some(d.data_wait_pct))),
        series("in the all-reduce", 4, of(|d| Some(d.all_reduce_pct))),
    ];
    let gpu = of(|d| d.gpu_pct);
    if !gpu.is_empty() {
        all.push(series("GPU executing", 2, gpu));
    }
    LineChart {
        id: format!("drafter-{drafter}"),
        title: format!("Drafter {drafter}: share of each interval"),
        x_desc: "seconds",
        y_desc: "% of the interval",
        y2_desc: None,
        series: all,
        levels: Vec::new(),
        note: None,
    }
    .draw()
}

/// Where the drafters' time goes per phase: the diagnosis's steady-state shares from the summary, or (before
/// there is one) the status lines' mean busy, wait and all-reduce shares.
pub fn step_phases(run: &RunRecord) -> Result<Chart, ReportError> {
    let (bars, note): (Vec<(String, f64)>, Option<String>) = match &run.summary {
        Some(summary) => {
            let diagnosis = Diagnosis::from_summary(summary);
            let bars = diagnosis
                .drafters
                .phases
                .iter()
                .filter(|share| share.percent > 0.0 || share.ms_per_step > 0.0)
                .map(|share| (share.phase.name().to_string(), share.percent))
                .chain(std::iter::once((
                    "untracked".to_string(),
                    diagnosis.drafters.untracked_pct,
                )))
                .collect();
            (bars, None)
        }
        None => {
            let shares: Vec<_> = run.status.iter().flat_map(|l| l.drafters.iter()).collect();
            let mean = |share: fn(&crate::telemetry::DrafterStatus) -> f64| {
                shares.iter().map(|d| share(d)).sum::<f64>() / shares.len().max(1) as f64
            };
            let bars = vec![
                ("busy".to_string(), mean(|d| d.busy_pct)),
                ("data_wait".to_string(), mean(|d| d.data_wait_pct)),
                ("all_reduce".to_string(), mean(|d| d.all_reduce_pct)),
            ];
            let note = "No summary.json yet: the means of the status lines' shares; the split into forward, \
                        loss, backward and the other phases comes with the summary."
                .to_string();
            (bars, Some(note))
        }
    };
    let id = "phases";
    let error = draw_error(id);
    let top = bars.iter().map(|b| b.1).fold(0.0, f64::max).max(1.0) * 1.1;
    let mut svg = String::new();
    {
        let root =
            SVGBackend::with_string(&mut svg, (CHART_WIDTH, CHART_HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| error(e.to_string()))?;
        let names: Vec<&str> = bars.iter().map(|b| b.0.as_str()).collect();
        let mut chart = ChartBuilder::on(&root)
            .margin(8)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d((0..bars.len()).into_segmented(), 0.0..top)
            .map_err(|e| error(e.to_string()))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(RGBColor(235, 235, 235))
            .bold_line_style(RGBColor(210, 210, 210))
            .y_desc("% of the drafters' wall time")
            .y_label_formatter(&|v| amount(*v))
            .label_style(("sans-serif", 11))
            .x_label_formatter(&|value| match value {
                SegmentValue::CenterOf(i) => names.get(*i).copied().unwrap_or("").to_string(),
                _ => String::new(),
            })
            .draw()
            .map_err(|e| error(e.to_string()))?;
        chart
            .draw_series(bars.iter().enumerate().map(|(i, (_, value))| {
                let mut bar = Rectangle::new(
                    [
                        (SegmentValue::Exact(i), 0.0),
                        (SegmentValue::Exact(i + 1), *value),
                    ],
                    PALETTE[i % PALETTE.len()].filled(),
                );
                bar.set_margin(0, 0, 6, 6);
                bar
            }))
            .map_err(|e| error(e.to_string()))?;
        root.present().map_err(|e| error(e.to_string()))?;
    }
    Ok(Chart {
        id: id.to_string(),
        title: "Where the step's time goes".into(),
        svg,
        legend: Vec::new(),
        note,
    })
}

/// Every chart of the report, in page order.
pub fn all_charts(run: &RunRecord) -> Result<Vec<Chart>, ReportError> {
    let drafters = run
        .status
        .iter()
        .map(|l| l.drafters.len())
        .max()
        .unwrap_or(0);
    let mut charts = vec![loss_and_tau(run)?, token_rates(run)?, queue_depth(run)?];
    for drafter in 0..drafters {
        charts.push(drafter_shares(run, drafter)?);
    }
    charts.push(step_phases(run)?);
    Ok(charts)
}
