//! The `stream(...)` source in the plan: defaults, the message limit derived from the target, and the rule that
//! a listener reachable from other machines needs a token (the refusals are in `tests/invalid/stream_*`).

use draftpipe_compiler::compile_source;
use draftpipe_compiler::plan::{DEFAULT_STREAM_READ_TIMEOUT_MS, SourceSpec};

const QUICKSTART: &str = include_str!("../../pipelines/quickstart.pipe");

fn with_source(source: &str) -> String {
    QUICKSTART.replace("synthetic(seed = 1, lengths = 64..512)", source)
}

#[test]
fn a_loopback_stream_needs_no_token_and_derives_its_message_limit() {
    let plan = compile_source(
        "s.pipe",
        &with_source(r#"stream(listen = "localhost:7070")"#),
    )
    .unwrap();
    // Two items of 2048 tokens, each 384 f32 wide plus an i64 id and an i64 mask, and 1 MiB of header room.
    let limit = 2 * 2048 * (4 * 384 + 16) + (1 << 20);
    assert_eq!(
        plan.target.source,
        SourceSpec::Stream {
            listen: "localhost:7070".into(),
            token_env: None,
            max_message_bytes: limit,
            read_timeout_ms: DEFAULT_STREAM_READ_TIMEOUT_MS,
        }
    );
    let summary = draftpipe_compiler::summary::Summary(&plan).to_string();
    assert!(
        summary.contains("stream on `localhost:7070` (no token"),
        "{summary}"
    );
}

#[test]
fn a_public_stream_with_a_token_from_the_environment_compiles() {
    let text = with_source(
        r#"stream(listen = "0.0.0.0:7070", token = env("DRAFTPIPE_TOKEN"), max_message = 64MiB, read_timeout = 5s)"#,
    );
    let plan = compile_source("s.pipe", &text).unwrap();
    assert_eq!(
        plan.target.source,
        SourceSpec::Stream {
            listen: "0.0.0.0:7070".into(),
            token_env: Some("DRAFTPIPE_TOKEN".into()),
            max_message_bytes: 64 << 20,
            read_timeout_ms: 5000,
        }
    );
    let json = serde_json::to_string(&plan).unwrap();
    assert!(
        !json.contains("hunter"),
        "the plan holds the variable's name, never a token"
    );
}

#[test]
fn unix_sockets_and_ipv6_loopback_are_local() {
    for listen in ["unix:/tmp/draftpipe.sock", "[::1]:7070", "127.0.0.2:9"] {
        let text = with_source(&format!(r#"stream(listen = "{listen}")"#));
        assert!(compile_source("s.pipe", &text).is_ok(), "{listen}");
    }
    let text = with_source(r#"stream(listen = "[::]:7070")"#);
    let errors = compile_source("s.pipe", &text).unwrap_err().to_string();
    assert!(errors.contains("s.pipe:9:"), "{errors}");
    assert!(errors.contains("no `token` is set"), "{errors}");
}
