//! `draftpipe report`'s library: reading run directories that ended, crashed (a cut-short last status line, no
//! summary) or are still going (the lock held), and the page: every chart present, nothing to fetch, no script.
//! The run files under `tests/data/report/` are a real quick-start run's (150 steps).

use std::fs;
use std::path::{Path, PathBuf};

use draftpipe_runtime::lock::{DirLock, LockPlace};
use draftpipe_runtime::output_file::REPORT_PREFIX;
use draftpipe_runtime::report::{
    LAYOUT_MARKER, REPORT_FILE, ReportError, RunRecord, RunState, parse_status_lines, render,
    write_report,
};

const STATUS: &str = include_str!("data/report/quickstart-status.jsonl");
const SUMMARY: &str = include_str!("data/report/quickstart-summary.json");

fn run_dir(name: &str, status: &str, summary: Option<&str>) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("draftpipe-report-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("status.jsonl"), status).unwrap();
    if let Some(summary) = summary {
        fs::write(dir.join("summary.json"), summary).unwrap();
    }
    dir
}

/// The page's chart ids, from its layout comment.
fn layout_ids(html: &str) -> Vec<String> {
    let start = html.find(LAYOUT_MARKER).expect("a layout comment") + LAYOUT_MARKER.len();
    let end = start + html[start..].find(" -->").unwrap();
    let layout: serde_json::Value = serde_json::from_str(html[start..end].trim()).unwrap();
    layout["charts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_string())
        .collect()
}

fn assert_self_contained(html: &str) {
    assert!(html.as_bytes().starts_with(REPORT_PREFIX));
    assert!(!html.contains("<script"), "the page needs no script");
    assert!(
        !html.contains("http"),
        "the page fetches and names no address"
    );
}

#[test]
fn an_ended_run_has_every_chart_and_the_diagnosis_in_words() {
    let dir = run_dir("ended", STATUS, Some(SUMMARY));
    let (path, run) = write_report(&dir, None, false).unwrap();
    assert_eq!(path, dir.join(REPORT_FILE));
    assert_eq!(run.state, RunState::Ended);
    let html = fs::read_to_string(&path).unwrap();
    assert_self_contained(&html);
    let ids = layout_ids(&html);
    assert_eq!(ids, ["loss-tau", "tokens", "queue", "drafter-0", "phases"]);
    for id in &ids {
        let section = format!("<section class=\"chart\" id=\"{id}\"");
        let at = html
            .find(&section)
            .unwrap_or_else(|| panic!("no section {id}"));
        let chart = &html[at..at + html[at..].find("</section>").unwrap()];
        assert!(chart.contains("<svg"), "{id} has its svg");
        assert!(
            chart.contains("<polyline") || chart.contains("<rect"),
            "{id} drew data"
        );
    }
    assert!(html.contains("bottleneck: the drafters (consumers)"));
    assert!(html.contains("min_ready 4") && html.contains("capacity 16"));
    assert!(html.contains("Ended at step 150 (the step limit was reached)"));
    // Written again over its own report: a report is replaced without --force.
    write_report(&dir, None, false).unwrap();
}

#[test]
fn the_real_loops_tau_is_drawn_where_an_acceptance_section_ran() {
    let mut summary: serde_json::Value = serde_json::from_str(SUMMARY).unwrap();
    let measurements: Vec<serde_json::Value> = [50, 100, 150]
        .map(|step| {
            serde_json::json!({
                "step": step, "tau": 1.2, "acceptance_by_position": [0.2], "prompts": 4,
                "generated_tokens": 64, "wall_s": 1.0, "export": "exports/x"
            })
        })
        .into();
    summary["acceptance"] = serde_json::json!({
        "every": 50, "skipped_busy": [], "failures": [], "measurements": measurements,
    });
    let dir = run_dir("acceptance", STATUS, Some(&summary.to_string()));
    let html = render(&RunRecord::load(&dir).unwrap()).unwrap();
    assert!(html.contains("τ of the real draft-and-verify loop"));
    // The fixture is a status file of a build before the exact τ: its `tau` reads as the simulated one.
    assert!(html.contains("τ simulated from slot accuracies"));
    assert!(!html.contains("τ exact"));
    assert_eq!(html.matches("<circle").count(), 3, "one dot per check");
}

#[test]
fn a_crashed_run_is_reported_from_its_status_lines_and_its_cut_short_line_is_named() {
    let cut = &STATUS[..STATUS.len() - 40];
    let dir = run_dir("crashed", cut, None);
    let run = RunRecord::load(&dir).unwrap();
    assert_eq!(run.state, RunState::StoppedWithoutSummary);
    assert_eq!((run.status.len(), run.truncated_line), (2, Some(3)));
    let html = render(&run).unwrap();
    assert_self_contained(&html);
    assert_eq!(
        layout_ids(&html),
        ["loss-tau", "tokens", "queue", "drafter-0", "phases"]
    );
    assert!(html.contains("Stopped without writing summary.json"));
    assert!(html.contains("Line 3 of status.jsonl was cut short"));
    assert!(html.contains("bottleneck: not known yet"));
    assert!(html.contains("The watermark (min_ready) is known once summary.json is written."));
}

#[test]
fn a_run_still_going_is_told_by_its_held_lock() {
    let dir = run_dir("running", STATUS, None);
    let lock = DirLock::acquire(&dir, "run directory", LockPlace::Inside).unwrap();
    assert_eq!(RunRecord::load(&dir).unwrap().state, RunState::Running);
    let html = render(&RunRecord::load(&dir).unwrap()).unwrap();
    assert!(html.contains("Still running"));
    drop(lock);
    assert_eq!(
        RunRecord::load(&dir).unwrap().state,
        RunState::StoppedWithoutSummary
    );
}

#[test]
fn several_drafters_get_a_chart_each() {
    let two: String = STATUS
        .lines()
        .map(|line| {
            let mut value: serde_json::Value = serde_json::from_str(line).unwrap();
            let one = value["drafters"][0].clone();
            value["drafters"] = serde_json::json!([one, one]);
            value.to_string() + "\n"
        })
        .collect();
    let dir = run_dir("two-drafters", &two, None);
    let html = render(&RunRecord::load(&dir).unwrap()).unwrap();
    assert_eq!(
        layout_ids(&html),
        [
            "loss-tau",
            "tokens",
            "queue",
            "drafter-0",
            "drafter-1",
            "phases"
        ]
    );
}

#[test]
fn a_bad_status_line_inside_the_file_is_an_error_naming_line_and_column() {
    let mut lines: Vec<&str> = STATUS.lines().collect();
    lines[1] = "{\"elapsed_s\": 1.0, \"step\": oops}";
    let text = lines.join("\n") + "\n";
    let error = parse_status_lines(Path::new("run/status.jsonl"), &text).unwrap_err();
    assert!(
        matches!(
            error,
            ReportError::StatusLine {
                line: 2,
                column: 28,
                ..
            }
        ),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .starts_with("run/status.jsonl:2:28: not a status line")
    );
    // A complete last line (it has its newline) that does not parse is an error too, not a cut-short one.
    let last_bad = format!("{STATUS}{{\"step\": 1}}\n");
    assert!(parse_status_lines(Path::new("s"), &last_bad).is_err());
}

#[test]
fn a_directory_without_run_files_and_outputs_that_are_not_reports_are_refused() {
    let empty = std::env::temp_dir().join(format!("draftpipe-report-empty-{}", std::process::id()));
    fs::create_dir_all(&empty).unwrap();
    let error = RunRecord::load(&empty).unwrap_err();
    assert!(
        error.to_string().contains("is not a run directory"),
        "{error}"
    );

    let dir = run_dir("outputs", STATUS, Some(SUMMARY));
    let notes = dir.join("notes.html");
    fs::write(&notes, "<p>mine</p>").unwrap();
    let error = write_report(&dir, Some(&notes), false).unwrap_err();
    assert!(error.to_string().contains("--force"), "{error}");
    assert_eq!(fs::read_to_string(&notes).unwrap(), "<p>mine</p>");
    write_report(&dir, Some(&notes), true).unwrap();
    let error = write_report(&dir, Some(&dir.join("status.jsonl")), true).unwrap_err();
    assert!(
        error.to_string().contains("which this command reads"),
        "{error}"
    );
}
