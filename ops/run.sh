#!/usr/bin/env bash
# The main job on embedded defaults: installs what is missing, builds Lazarus, tokenises the
# project's own source and documentation (no download), and trains the `tiny` MoE preset on
# it for STEPS (default 200) steps on 2 threads, checkpointing to ./lazarus-data. Running it
# again resumes the run. It ends with the loss curve, the run's checkpoints and an audit.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
ops/setup.sh build
cargo build --release --workspace --bins
store="file://$PWD/lazarus-data"
runs="$PWD/lazarus-runs"
mkdir -p "$runs"
mapfile -t corpus < <(find README.md ARCHITECTURE.md runbooks ops trainer shared ckptd tests -type f \
  \( -name '*.rs' -o -name '*.md' -o -name '*.toml' -o -name '*.sh' -o -name '*.py' \) | sort)
target/release/trainer prepare --input "${corpus[@]}" --out "$runs/corpus"
# The matmul peak once, so the logs report CPU-MFU.
[ -f "$runs/peak.json" ] || target/release/trainer bench-peak --out-dir "$runs"
target/release/trainer train --config tiny --metrics-dir "$runs" \
  --set "train.steps=${STEPS:-200}" \
  --set "data.path=$runs/corpus" \
  --set "checkpoint.store=$store"
target/release/ckptctl --store "$store" list tiny
target/release/ckptctl --store "$store" verify tiny --read-data
