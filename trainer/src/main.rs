//! `trainer`: prepare data and train MoE language models.

use clap::Parser;

fn main() -> std::process::ExitCode {
    lazarus_trainer::cli::main(lazarus_trainer::cli::Cli::parse())
}
