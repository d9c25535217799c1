//! `ckptd`, the per-node checkpoint daemon. See `lazarus_ckptd::daemon`.

use clap::Parser;

/// Chunks are read, encoded and uploaded in buffers of megabytes, one after another: mimalloc
/// reuses their memory, where the system allocator hands it back and takes it again, paying
/// a page fault and a zeroed page every 4 KiB.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    lazarus_ckptd::daemon::main(lazarus_ckptd::daemon::Cli::parse())
}
