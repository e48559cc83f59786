//! Grammar tests: what each construct parses to, that spans point at the right text, and how syntax errors
//! are reported (position, expectation, one per broken section).

use draftpipe_compiler::ast::{Section, ValueKind};
use draftpipe_compiler::parse;

/// Parses `telemetry { KEY = VALUE }`-style settings and returns the values, checking spans as it goes.
fn values(settings: &str) -> Vec<(String, ValueKind)> {
    let source = format!("telemetry {{\n{settings}\n}}\n");
    let file = parse("v.pipe", &source).unwrap_or_else(|d| panic!("{d}"));
    let Section::Telemetry(t) = &file.sections[0] else {
        panic!("expected telemetry")
    };
    t.block
        .entries
        .iter()
        .map(|e| {
            assert_eq!(e.key.span.text(&source), e.key.name);
            (e.value.span.text(&source).to_owned(), e.value.kind.clone())
        })
        .collect()
}

#[test]
fn numbers_sizes_durations_and_ranges() {
    let v = values(
        "a = 16\nb = -3\nc = 1e-3\nd = 0.95\ne = 141GiB\nf = 250ms\ng = 64..512\nh = 2.5E+2",
    );
    assert_eq!(v[0], ("16".into(), ValueKind::Integer(16)));
    assert_eq!(v[1], ("-3".into(), ValueKind::Integer(-3)));
    assert_eq!(v[2], ("1e-3".into(), ValueKind::Float(1e-3)));
    assert_eq!(v[3], ("0.95".into(), ValueKind::Float(0.95)));
    let ValueKind::Quantity { amount, unit } = &v[4].1 else {
        panic!("{:?}", v[4])
    };
    assert_eq!(
        (*amount, unit.name.as_str(), v[4].0.as_str()),
        (141.0, "GiB", "141GiB")
    );
    let ValueKind::Quantity { amount, unit } = &v[5].1 else {
        panic!("{:?}", v[5])
    };
    assert_eq!((*amount, unit.name.as_str()), (250.0, "ms"));
    let ValueKind::Range(start, end) = &v[6].1 else {
        panic!("{:?}", v[6])
    };
    assert_eq!(
        (&start.kind, &end.kind),
        (&ValueKind::Integer(64), &ValueKind::Integer(512))
    );
    assert_eq!(v[7].1, ValueKind::Float(250.0));
}

#[test]
fn strings_lists_tuples_calls_and_names() {
    let v = values(
        "s = \"a \\\"q\\\" \\\\ b\"\nl = [0, 1, 2,]\nt = (0.9, 0.95)\nc = mlp(hidden = 256, heads = 4)\nn = fifo\ne = []",
    );
    assert_eq!(v[0].1, ValueKind::Str("a \"q\" \\ b".into()));
    let ValueKind::List(items) = &v[1].1 else {
        panic!()
    };
    assert_eq!(items.len(), 3);
    let ValueKind::Tuple(items) = &v[2].1 else {
        panic!()
    };
    assert_eq!(items[1].kind, ValueKind::Float(0.95));
    let ValueKind::Call(call) = &v[3].1 else {
        panic!()
    };
    assert_eq!(call.name.name, "mlp");
    assert_eq!(
        call.args
            .iter()
            .map(|a| a.key.name.as_str())
            .collect::<Vec<_>>(),
        ["hidden", "heads"]
    );
    assert_eq!(v[3].0, "mlp(hidden = 256, heads = 4)");
    assert_eq!(v[4].1, ValueKind::Ident("fifo".into()));
    assert_eq!(v[5].1, ValueKind::List(vec![]));
}

#[test]
fn comments_and_layout_are_free() {
    let source =
        "# head\npipeline \"p\" # trailing\ntelemetry { every = 1s trace = \"t\" } # same line\n";
    let file = parse("c.pipe", source).unwrap();
    assert_eq!(file.sections.len(), 2);
    let Section::Pipeline(p) = &file.sections[0] else {
        panic!()
    };
    assert_eq!(p.name.value, "p");
    assert_eq!(p.span.text(source), "pipeline \"p\"");
}

#[test]
fn headers_keep_names_placements_and_spans() {
    let source = "target t on gpu [0, 2] { }\nqueue q from t to d { }\ndrafter d on cpu x3 { }\ndevices { gpu 0..8 { memory = 1GiB } cpu { memory = 2GiB } }";
    let file = parse("h.pipe", source).unwrap();
    let Section::Target(t) = &file.sections[0] else {
        panic!()
    };
    assert_eq!(
        (t.name.name.as_str(), t.placement.class.name.as_str()),
        ("t", "gpu")
    );
    assert_eq!(t.placement.span.text(source), "gpu [0, 2]");
    assert_eq!(t.header.text(source), "target t on gpu [0, 2]");
    let Section::Queue(q) = &file.sections[1] else {
        panic!()
    };
    assert_eq!((q.from.name.as_str(), q.to.name.as_str()), ("t", "d"));
    assert_eq!(q.header.text(source), "queue q from t to d");
    let Section::Drafter(d) = &file.sections[2] else {
        panic!()
    };
    assert_eq!(
        d.placement
            .workers
            .map(|(n, s)| (n, s.text(source).to_owned())),
        Some((Some(3), "x3".to_owned()))
    );
    let Section::Devices(devices) = &file.sections[3] else {
        panic!()
    };
    assert_eq!(devices.decls.len(), 2);
    assert_eq!(
        devices.decls[0].ids.as_ref().unwrap().span.text(source),
        "0..8"
    );
    assert!(devices.decls[1].ids.is_none());
}

#[test]
fn keywords_need_a_word_boundary() {
    // `targets` is not `target`: it parses as an unknown section for the checker to name.
    let file = parse("k.pipe", "targets x { }").unwrap();
    let Section::Unknown(u) = &file.sections[0] else {
        panic!("{:?}", file.sections[0])
    };
    assert_eq!(u.keyword.name, "targets");
}

#[test]
fn a_syntax_error_says_what_was_expected_and_where() {
    let source = "pipeline \"p\"\nqueue q from t to d {\n    capacity 16\n}\n";
    let diagnostics = parse("e.pipe", source).unwrap_err();
    assert_eq!(diagnostics.len(), 1);
    let d = diagnostics.iter().next().unwrap();
    assert_eq!(d.message, "expected `=`, found `16`");
    assert_eq!(diagnostics.position(d), (3, 14));
    assert_eq!(d.span.text(source), "16");
}

#[test]
fn each_broken_section_reports_its_own_syntax_error() {
    let source = "target t on cpu {\n  a 1\n}\nqueue q from t to d {\n  b = = 2\n}\ndrafter d on cpu {\n  c = [1,\n}\n";
    let diagnostics = parse("m.pipe", source).unwrap_err();
    let lines: Vec<usize> = diagnostics
        .iter()
        .map(|d| diagnostics.position(d).0)
        .collect();
    assert_eq!(lines, [2, 5, 9], "{diagnostics}");
}

#[test]
fn overflowing_literals_are_errors() {
    let diagnostics =
        parse("o.pipe", "telemetry { a = 99999999999999999999 b = 1e999 }").unwrap_err();
    let messages: Vec<&str> = diagnostics.iter().map(|d| d.message.as_str()).collect();
    assert_eq!(messages, ["integer is too large", "number is too large"]);
}
