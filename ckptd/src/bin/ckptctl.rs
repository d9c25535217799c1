//! `ckptctl`: list, show, verify, diff, import, export, restore, roll back and gc checkpoints.

use clap::Parser;

/// Import, export and verify go through chunk buffers of megabytes: see `ckptd`'s allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    lazarus_ckptd::ctl::main(lazarus_ckptd::ctl::Cli::parse())
}
