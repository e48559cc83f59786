//! `draftpipe`: the command-line entry point. Parses arguments and hands off to the library crates.

fn main() {}
