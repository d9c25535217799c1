#!/usr/bin/env bash
# The main job on embedded defaults: builds Lazarus, trains a small model on real text with
# checkpoints to a local store (./lazarus-data), resuming if a run is already there, then
# lists and audits the checkpoints. Until the trainer lands, the model is the toy byte-level
# model in tests/harness/toy.rs.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
ops/setup.sh build
cargo build --release --workspace --bins --examples
store="file://$PWD/lazarus-data"
text="../shared/data/tinyshakespeare.txt"
target/release/examples/toy_run --store "$store" --run toy --steps "${STEPS:-200}" --every 20 --text "$text"
target/release/ckptctl --store "$store" list toy
target/release/ckptctl --store "$store" verify toy --all --read-data
