//! The report's page: the charts at fixed positions, the diagnosis in words beside them, in one HTML file with
//! nothing to fetch and no script.
//!
//! ```text
//!  RunRecord ─▶ charts::all_charts ─▶ layout (fixed grid) ─▶ <section> per chart + diagnosis panel ─▶ HTML
//!                                                        └─▶ <!-- draftpipe-report-layout {json} -->
//! ```
//!
//! The layout comment gives the page's size and every chart's region in CSS pixels, so a checker that
//! screenshots the page at that size (`scripts/report-check.sh`) knows where each chart must have drawn.

use std::fmt::Write as _;

use serde::Serialize;

use super::ReportError;
use super::charts::{CHART_HEIGHT, CHART_WIDTH, Chart, all_charts};
use super::run_files::{RunRecord, RunState, teacher_forced_tau};
use crate::figures::amount;
use crate::telemetry::{Diagnosis, EndReason, SUMMARY_FILE};

/// The marker that opens the layout comment.
pub const LAYOUT_MARKER: &str = "draftpipe-report-layout";

const MARGIN: u32 = 20;
const HEADER_HEIGHT: u32 = 90;
const TITLE_HEIGHT: u32 = 28;
const LEGEND_HEIGHT: u32 = 52;
const COLUMNS: u32 = 2;
const PANEL_WIDTH: u32 = 540;

/// Where one chart lies on the page.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChartRegion {
    /// The chart's id.
    pub id: String,
    /// Left edge, CSS pixels from the page's left.
    pub x: u32,
    /// Top edge, CSS pixels from the page's top.
    pub y: u32,
    /// Width.
    pub width: u32,
    /// Height.
    pub height: u32,
}

/// The page's size and its charts' regions (the layout comment's content).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Layout {
    /// The width to view the page at.
    pub width: u32,
    /// The height that holds every chart.
    pub height: u32,
    /// Every chart.
    pub charts: Vec<ChartRegion>,
}

fn layout(charts: &[Chart]) -> Layout {
    let cell_height = TITLE_HEIGHT + CHART_HEIGHT + LEGEND_HEIGHT;
    let regions: Vec<ChartRegion> = (0u32..)
        .zip(charts)
        .map(|(index, chart)| ChartRegion {
            id: chart.id.clone(),
            x: MARGIN + (index % COLUMNS) * (CHART_WIDTH + MARGIN),
            y: HEADER_HEIGHT + (index / COLUMNS) * cell_height + TITLE_HEIGHT,
            width: CHART_WIDTH,
            height: CHART_HEIGHT,
        })
        .collect();
    let rows = (charts.len() as u32).div_ceil(COLUMNS);
    Layout {
        width: MARGIN + COLUMNS * (CHART_WIDTH + MARGIN) + PANEL_WIDTH + MARGIN,
        height: HEADER_HEIGHT + rows * cell_height + MARGIN,
        charts: regions,
    }
}

/// `text` safe inside HTML elements and attribute values.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The page for `run`.
pub fn render(run: &RunRecord) -> Result<String, ReportError> {
    let charts = all_charts(run)?;
    let layout = layout(&charts);
    let plan = run
        .summary
        .as_ref()
        .map(|s| s.plan.clone())
        .unwrap_or_else(|| run.dir.display().to_string());
    let mut html = String::new();
    let layout_json =
        serde_json::to_string(&layout).map_err(|source| ReportError::Encode { source })?;
    // Writing into a String cannot fail; `let _` keeps the formatting calls readable.
    let _ = write!(
        html,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>draftpipe report: {title}</title>\n\
         <!-- {LAYOUT_MARKER} {layout_json} -->\n<style>\n\
         body {{ margin: 0; font-family: sans-serif; color: #111; background: #fff; width: {w}px; min-height: {h}px; position: relative; }}\n\
         header {{ position: absolute; left: {m}px; top: 12px; width: {hw}px; }}\n\
         header h1 {{ font-size: 22px; margin: 0 0 6px 0; }}\n\
         header p {{ margin: 0; font-size: 14px; }}\n\
         section.chart {{ position: absolute; width: {cw}px; }}\n\
         section.chart h2 {{ font-size: 15px; margin: 0; height: {th}px; line-height: {th}px; }}\n\
         section.chart svg {{ display: block; }}\n\
         .legend {{ font-size: 12px; margin-top: 4px; }}\n\
         .legend span {{ margin-right: 14px; white-space: nowrap; }}\n\
         .note {{ font-size: 12px; color: #555; margin: 2px 0 0 0; }}\n\
         aside {{ position: absolute; left: {px}px; top: {top}px; width: {pw}px; font-size: 13px; }}\n\
         aside h2 {{ font-size: 17px; margin: 0 0 8px 0; }}\n\
         aside pre {{ white-space: pre-wrap; font-size: 12px; background: #f6f6f6; padding: 8px; margin: 8px 0; }}\n\
         </style>\n</head>\n<body>\n",
        title = escape(&plan),
        w = layout.width,
        h = layout.height,
        m = MARGIN,
        hw = layout.width - 2 * MARGIN,
        cw = CHART_WIDTH,
        th = TITLE_HEIGHT,
        px = MARGIN + COLUMNS * (CHART_WIDTH + MARGIN),
        top = HEADER_HEIGHT,
        pw = PANEL_WIDTH,
    );
    let _ = write!(
        html,
        "<header>\n<h1>draftpipe report: {}</h1>\n<p>{}</p>\n</header>\n",
        escape(&plan),
        escape(&state_sentence(run))
    );
    for (chart, region) in charts.iter().zip(&layout.charts) {
        let _ = write!(
            html,
            "<section class=\"chart\" id=\"{id}\" style=\"left: {x}px; top: {y}px;\">\n<h2>{title}</h2>\n{svg}\n\
             <div class=\"legend\">",
            id = chart.id,
            x = region.x,
            y = region.y - TITLE_HEIGHT,
            title = escape(&chart.title),
            // Inline SVG in HTML needs no namespace, and the page then names no address at all.
            svg = chart
                .svg
                .replace(" xmlns=\"http://www.w3.org/2000/svg\"", ""),
        );
        for (label, colour) in &chart.legend {
            let _ = write!(
                html,
                "<span><b style=\"color: {colour}\">&#9473;&#9473;</b> {}</span>",
                escape(label)
            );
        }
        html.push_str("</div>\n");
        if let Some(note) = &chart.note {
            let _ = writeln!(html, "<p class=\"note\">{}</p>", escape(note));
        }
        html.push_str("</section>\n");
    }
    html.push_str(&panel(run));
    html.push_str("</body>\n</html>\n");
    Ok(html)
}

/// One sentence: what the run directory shows about where the run stands.
fn state_sentence(run: &RunRecord) -> String {
    let last = run.status.last();
    let at = last.map_or_else(
        || "no status line yet".to_string(),
        |l| {
            let of = l
                .total_steps
                .map_or_else(String::new, |t| format!(" of {t}"));
            format!(
                "the last status line is at {:.1} s, step {}{of}",
                l.elapsed_s, l.step
            )
        },
    );
    let mut sentence = match (
        run.state,
        run.summary.as_ref().and_then(|s| s.ending.as_ref()),
    ) {
        (RunState::Ended, Some(ending)) => format!(
            "Ended at step {} ({}); {at}.",
            ending.step,
            ending_words(ending.reason)
        ),
        (RunState::Ended, None) => format!("Ended; {at}."),
        (RunState::Running, _) => format!(
            "Still running (another process holds the run directory's lock): {at}; the figures so far."
        ),
        (RunState::StoppedWithoutSummary, _) => format!(
            "Stopped without writing {SUMMARY_FILE} (a crash or a kill: no process holds the run directory's \
             lock): {at}."
        ),
    };
    if let Some(line) = run.truncated_line {
        let _ = write!(
            sentence,
            " Line {line} of status.jsonl was cut short (written when the run stopped, or being written) and \
             is left out."
        );
    }
    sentence
}

/// How the summary's ending reads in the page's first line.
fn ending_words(reason: EndReason) -> &'static str {
    match reason {
        EndReason::StepLimit => "the step limit was reached",
        EndReason::DataExhausted => "the data ended",
        EndReason::DataExhaustedEarly => "the data ran out before the step limit",
        EndReason::Interrupted => "stopped by a signal",
        EndReason::NothingTrained => "every step was skipped: nothing was trained",
        EndReason::Error => "stopped by an error",
    }
}

/// The words beside the charts: the diagnosis `draftpipe diagnose` prints, or what the status lines tell
/// before there is a summary.
fn panel(run: &RunRecord) -> String {
    let mut html = String::from("<aside id=\"diagnosis\">\n<h2>Diagnosis</h2>\n");
    if let Some(summary) = &run.summary {
        let diagnosis = Diagnosis::from_summary(summary);
        let _ = write!(
            html,
            "<p id=\"bottleneck\"><b>bottleneck: {}</b></p>\n<p>{}</p>\n<pre>{}</pre>\n",
            escape(diagnosis.bottleneck.describe()),
            escape(&diagnosis.advice),
            escape(&diagnosis.to_string())
        );
        return html + "</aside>\n";
    }
    let _ = write!(
        html,
        "<p id=\"bottleneck\"><b>bottleneck: not known yet</b>: the verdict weighs the producers' time blocked on \
         a full queue, which only {SUMMARY_FILE} carries (written when the run ends). What the status lines \
         show:</p>\n<ul>\n"
    );
    for fact in known_facts(run) {
        let _ = writeln!(html, "<li>{}</li>", escape(&fact));
    }
    html + "</ul>\n</aside>\n"
}

/// Facts from the status lines alone.
fn known_facts(run: &RunRecord) -> Vec<String> {
    let lines = &run.status;
    let Some(last) = lines.last() else {
        return vec!["No status line has been written yet.".to_string()];
    };
    let count = lines.len() as f64;
    let mut facts = Vec::new();
    if let Some(rate) = last.real_tokens_per_s {
        facts.push(format!(
            "{} real tokens/s at the last line ({} since the start).",
            amount(rate),
            last.real_tokens_per_s_overall
                .map_or("-".to_string(), amount)
        ));
    }
    let full = lines
        .iter()
        .filter(|l| l.q_hs.capacity > 0 && l.q_hs.depth + 1 >= l.q_hs.capacity)
        .count() as f64;
    let empty = lines.iter().filter(|l| l.q_hs.depth == 0).count() as f64;
    let mean_fill = lines
        .iter()
        .map(|l| l.q_hs.depth as f64 / l.q_hs.capacity.max(1) as f64)
        .sum::<f64>()
        / count;
    facts.push(format!(
        "The queue held {:.0}% of its capacity on average over {} lines: at or next to capacity in {:.0}% of \
         them, empty in {:.0}%.",
        100.0 * mean_fill,
        lines.len(),
        100.0 * full / count,
        100.0 * empty / count
    ));
    for drafter in 0..last.drafters.len() {
        let shares: Vec<_> = lines
            .iter()
            .filter_map(|l| l.drafters.get(drafter))
            .collect();
        let n = shares.len().max(1) as f64;
        facts.push(format!(
            "Drafter {drafter}: busy {:.0}%, waiting for data {:.0}%, in the all-reduce {:.0}% (means of its \
             lines).",
            shares.iter().map(|d| d.busy_pct).sum::<f64>() / n,
            shares.iter().map(|d| d.data_wait_pct).sum::<f64>() / n,
            shares.iter().map(|d| d.all_reduce_pct).sum::<f64>() / n,
        ));
    }
    if let Some(loss) = last.loss {
        let tau =
            teacher_forced_tau(last).map_or_else(String::new, |t| format!(", τ {t:.3} exact"));
        facts.push(format!("Loss {loss:.4}{tau} at step {}.", last.step));
    }
    if last.skipped > 0 {
        facts.push(format!(
            "{} steps skipped for non-finite values.",
            last.skipped
        ));
    }
    facts
}
