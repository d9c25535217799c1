//! `ckptd`, the per-node checkpoint daemon, is not built yet: the store it will stream into is.
//! Until then the trainer writes through the store library directly.

fn main() -> std::process::ExitCode {
    eprintln!(
        "ckptd: the checkpoint daemon is not built yet; use `ckptctl` with the store directly"
    );
    std::process::ExitCode::from(1)
}
