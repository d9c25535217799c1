//! `ckptd`, the per-node checkpoint daemon. See `lazarus_ckptd::daemon`.

use clap::Parser;

fn main() -> std::process::ExitCode {
    lazarus_ckptd::daemon::main(lazarus_ckptd::daemon::Cli::parse())
}
