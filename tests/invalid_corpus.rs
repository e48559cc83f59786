//! Golden tests for diagnostics: every `tests/invalid/NAME.pipe` must fail to compile with exactly the
//! messages, positions, snippets and help lines in `tests/invalid/NAME.expected`.
//!
//! After an intended change of wording, regenerate with `UPDATE_GOLDEN=1 cargo test --test invalid_corpus`
//! and review the diff.

use std::fs;
use std::path::{Path, PathBuf};

fn corpus() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/invalid");
    let mut files: Vec<PathBuf> = fs::read_dir(&dir)
        .expect("tests/invalid exists")
        .map(|e| e.expect("readable entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "pipe"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_invalid_file_fails_with_its_golden_diagnostics() {
    let files = corpus();
    assert!(
        files.len() >= 30,
        "the corpus must hold at least 30 invalid files, found {}",
        files.len()
    );
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    let mut mismatches = Vec::new();
    for path in &files {
        let name = path.file_name().unwrap().to_str().unwrap();
        let source = fs::read_to_string(path).unwrap();
        let diagnostics =
            match draftpipe_compiler::compile_source(&format!("tests/invalid/{name}"), &source) {
                Ok(_) => {
                    panic!("{name} compiled, but every file in tests/invalid must be rejected")
                }
                Err(d) => d,
            };
        assert!(!diagnostics.is_empty());
        let rendered = format!("{diagnostics}\n");
        let golden = path.with_extension("expected");
        if update {
            fs::write(&golden, &rendered).unwrap();
            continue;
        }
        let expected = fs::read_to_string(&golden)
            .unwrap_or_else(|_| panic!("missing golden {}", golden.display()));
        if expected != rendered {
            mismatches.push(format!(
                "--- {name}: expected\n{expected}--- got\n{rendered}"
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} golden mismatch(es):\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
}

#[test]
fn every_diagnostic_has_a_position_snippet_caret_and_help() {
    for path in corpus() {
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        let source = fs::read_to_string(&path).unwrap();
        let diagnostics = draftpipe_compiler::compile_source(&name, &source).unwrap_err();
        let text = diagnostics.to_string();
        let lines: Vec<&str> = source.split('\n').collect();
        for d in diagnostics.iter() {
            assert!(d.help.is_some(), "{name}: `{}` has no help line", d.message);
            // The position must be a real place in the file, and the quoted line the file's line there.
            let (line, col) = diagnostics.position(d);
            let source_line = lines
                .get(line - 1)
                .unwrap_or_else(|| panic!("{name}: line {line} is past the end of the file"))
                .trim_end_matches('\r');
            assert!(
                col <= source_line.chars().count() + 1,
                "{name}: column {col} is past the end of line {line}: {source_line:?}"
            );
            let quoted = format!("{line} | {}", source_line.replace('\t', " "));
            assert!(
                text.lines().any(|l| l.trim_end() == quoted.trim_end()),
                "{name}: line {line} is not quoted as `{quoted}` in\n{text}"
            );
        }
        assert!(
            text.contains(&format!("--> {name}:")),
            "{name}: no position in\n{text}"
        );
        assert!(text.contains('^'), "{name}: no caret in\n{text}");
    }
}
