//! The build script's notice of a build without GPU kernels (`runtime/build_notice.rs`, shared with `build.rs`):
//! said once on the build's terminal, so cargo has no `cargo:warning` to store and replay on every later build;
//! through cargo only when there is no terminal.

#[path = "../build_notice.rs"]
mod build_notice;

use build_notice::{announce, notice};

#[test]
fn with_a_terminal_the_notice_is_written_there_and_nothing_is_left_for_cargo_to_replay() {
    let mut terminal = Vec::new();
    let directive = announce("nightly lacks rust-src", Some(&mut terminal));
    assert_eq!(
        directive, None,
        "a cargo:warning would be replayed on every build"
    );
    let written = String::from_utf8(terminal).unwrap();
    assert!(
        written.ends_with(
            "warning: draftpipe-runtime: building without GPU kernels: nightly lacks rust-src\n"
        ),
        "{written:?}"
    );
    assert_eq!(written.lines().count(), 1);
}

#[test]
fn without_a_terminal_or_when_it_fails_the_notice_goes_through_cargo() {
    assert_eq!(
        announce("DRAFTPIPE_NO_PTX is set", None).as_deref(),
        Some("cargo:warning=building without GPU kernels: DRAFTPIPE_NO_PTX is set")
    );
    struct Closed;
    impl std::io::Write for Closed {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    assert_eq!(
        announce("x", Some(&mut Closed)),
        Some(format!("cargo:warning={}", notice("x")))
    );
}
