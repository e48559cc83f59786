//! Robustness: random bytes and random mutations of the valid pipelines never panic the compiler, and every
//! rejection renders (positions and snippets stay inside the text, on character boundaries).

use proptest::prelude::*;

const VALID: [&str; 6] = [
    include_str!("../../pipelines/quickstart.pipe"),
    include_str!("../../pipelines/dflash-5x3.pipe"),
    include_str!("../../pipelines/dflash-quickstart.pipe"),
    include_str!("../../pipelines/mlp-5x3.pipe"),
    include_str!("../../pipelines/eagle3-qwen3-8b.pipe"),
    include_str!("../../pipelines/eagle3-quickstart.pipe"),
];

/// Compiles and, on failure, renders every diagnostic: the two things a user ever does with a file.
fn compile_and_render(source: &str) {
    match draftpipe_compiler::compile_source("fuzz.pipe", source) {
        Ok(plan) => {
            // A plan that compiles must serialise (the CLI's `--emit json`) and summarise (`--emit text`).
            serde_json::to_string(&plan).expect("plans serialise");
            let _ = draftpipe_compiler::summary::Summary(&plan).to_string();
        }
        Err(diagnostics) => {
            assert!(
                !diagnostics.is_empty(),
                "a rejected file has at least one diagnostic"
            );
            let text = diagnostics.to_string();
            assert!(text.contains("--> fuzz.pipe:"));
            assert!(
                !text.contains("internal error"),
                "a check gave up without a reason:\n{source}\n{text}"
            );
        }
    }
}

/// One edit of a valid file: delete, insert or replace a run of characters at a char boundary.
#[derive(Debug, Clone)]
enum Mutation {
    Delete { at: usize, len: usize },
    Insert { at: usize, text: String },
    Replace { at: usize, len: usize, text: String },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    // Fragments the grammar cares about, so mutations reach the checks and not only the parser.
    let fragment = prop_oneof![
        Just("{".to_owned()),
        Just("}".to_owned()),
        Just("=".to_owned()),
        Just("..".to_owned()),
        Just(",".to_owned()),
        Just("\"".to_owned()),
        Just("#".to_owned()),
        Just("\n".to_owned()),
        Just("-".to_owned()),
        Just("0".to_owned()),
        Just("99999999999999999999".to_owned()),
        Just("1e308".to_owned()),
        Just("GiB".to_owned()),
        Just("gpu 0..4".to_owned()),
        Just("x0".to_owned()),
        Just("é".to_owned()),
        Just("\t".to_owned()),
        Just("[".to_owned()),
        Just("(".to_owned()),
        "[a-z_]{1,8}",
        "[0-9]{1,12}",
        any::<String>(),
    ];
    prop_oneof![
        (any::<usize>(), 1usize..12).prop_map(|(at, len)| Mutation::Delete { at, len }),
        (any::<usize>(), fragment.clone()).prop_map(|(at, text)| Mutation::Insert { at, text }),
        (any::<usize>(), 1usize..6, fragment).prop_map(|(at, len, text)| Mutation::Replace {
            at,
            len,
            text
        }),
    ]
}

fn apply(source: &str, mutation: &Mutation) -> String {
    let boundaries: Vec<usize> = source
        .char_indices()
        .map(|(i, _)| i)
        .chain([source.len()])
        .collect();
    let pick = |at: usize| boundaries[at % boundaries.len()];
    let end_of = |start: usize, len: usize| {
        boundaries
            .iter()
            .copied()
            .find(|&b| b >= start + len)
            .unwrap_or(source.len())
    };
    let mut out = source.to_owned();
    match mutation {
        Mutation::Delete { at, len } => {
            let start = pick(*at);
            out.replace_range(start..end_of(start, *len), "");
        }
        Mutation::Insert { at, text } => out.insert_str(pick(*at), text),
        Mutation::Replace { at, len, text } => {
            let start = pick(*at);
            out.replace_range(start..end_of(start, *len), text);
        }
    }
    out
}

proptest! {
    // 512 cases by default; `PROPTEST_CASES=100000` for a longer search.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        compile_and_render(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn random_text_never_panics(text in "[ -~\n\té{}()\\[\\]]{0,300}") {
        compile_and_render(&text);
    }

    #[test]
    fn mutated_valid_files_never_panic(
        which in 0usize..VALID.len(),
        mutations in proptest::collection::vec(mutation(), 1..4),
    ) {
        let mut source = VALID[which].to_owned();
        for m in &mutations {
            source = apply(&source, m);
        }
        compile_and_render(&source);
    }
}

#[test]
fn deeply_nested_values_are_an_error_not_a_crash() {
    let source = VALID[0].replace(
        "steps     = 300",
        &format!("steps = {}1{}", "[".repeat(200), "]".repeat(200)),
    );
    let diagnostics = draftpipe_compiler::compile_source("deep.pipe", &source).unwrap_err();
    assert!(
        diagnostics.to_string().contains("nested too deeply"),
        "{diagnostics}"
    );
}

#[test]
fn huge_dimensions_are_rejected_without_overflow() {
    let mlp = include_str!("../../pipelines/mlp-5x3.pipe")
        .replace("hidden = 1024", "hidden = 4294967296")
        .replace("intermediate = 2816", "intermediate = 4294967296");
    let dflash = VALID[1]
        .replace("hidden       = 4096", "hidden       = 4294967296")
        .replace("intermediate = 12288", "intermediate = 4294967296");
    let eagle3 = VALID[4]
        .replace("hidden       = 4096", "hidden       = 4294967296")
        .replace("intermediate = 12288", "intermediate = 4294967296");
    for source in [mlp, dflash, eagle3] {
        let diagnostics = draftpipe_compiler::compile_source("huge.pipe", &source).unwrap_err();
        assert!(
            diagnostics.to_string().contains("too large"),
            "{diagnostics}"
        );
    }
}

#[test]
fn the_summary_of_gpus_at_the_top_of_the_ordinal_range_renders() {
    let source = include_str!("../../pipelines/dflash-5x3.pipe")
        .replace(
            "gpu 0..8 { memory = 141GiB }",
            "gpu 0..5 { memory = 141GiB }\n    gpu [4294967294, 4294967295] { memory = 141GiB }",
        )
        .replace(
            "drafter drafter on gpu 5..8",
            "drafter drafter on gpu [4294967294, 4294967295]",
        );
    let plan =
        draftpipe_compiler::compile_source("top.pipe", &source).expect("the edited file is valid");
    let text = draftpipe_compiler::summary::Summary(&plan).to_string();
    assert!(text.contains("gpu 4294967294..4294967296"), "{text}");
}
