#!/usr/bin/env bash
# The test command: installs what the suite needs (idempotently), checks formatting and lints,
# builds the binaries once in release, and runs the whole test suite against them.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
ops/setup.sh test
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo build --release --workspace --bins
cargo test --release --workspace
