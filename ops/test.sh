#!/usr/bin/env bash
# The test command: installs what the suite needs (idempotently), checks formatting and lints,
# builds the binaries once in release, and runs the whole test suite against them.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
ops/setup.sh test
cargo fmt --all -- --check
# Lints (dev profile, target/debug) and the release build (target/release) use separate build
# directories; run side by side, each fills the cores the other leaves idle.
cargo clippy --workspace --all-targets -- -D warnings &
clippy=$!
build_status=0
cargo build --release --workspace --bins || build_status=$?
clippy_status=0
wait "$clippy" || clippy_status=$?
if [ "$clippy_status" -ne 0 ] || [ "$build_status" -ne 0 ]; then
  echo "test: clippy exited $clippy_status, the release build $build_status" >&2
  exit 1
fi
cargo test --release --workspace
