//! `draftpipe`: the command-line entry point. Parses arguments, runs the command, and reports its error in one
//! place ([`commands::finish`]).

mod cli;
mod commands;

use clap::Parser as _;

fn main() -> std::process::ExitCode {
    commands::finish(commands::dispatch(cli::Cli::parse().command))
}
