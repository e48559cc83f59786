//! `draftpipe`: the command-line entry point. Parses arguments and hands off to the library crates.

mod cli;
mod commands;

use clap::Parser as _;

fn main() -> std::process::ExitCode {
    cli::Cli::parse().command.run()
}
