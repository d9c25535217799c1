#!/usr/bin/env bash
# The soak: a nemesis over long supervised runs (four daemons through fault-injecting relays,
# two ranks under mpiexec, checkpoints on the S3 test server). It injects FAULTS (default
# 1000) random faults one at a time (ranks, daemons and the leader SIGKILLed or SIGSTOPped,
# storage stalls, partitions, gc racing the writers), checks after each run that every commit
# verifies and every loss equals the uninterrupted run's, and prints a table of faults,
# recoveries and time lost per kind of fault. Not part of the test suite: 1,000 faults take
# about 80 minutes on 2 cores. SEED replays a schedule; STEPS sets the steps of each run;
# LAUNCHER=srun runs the ranks under srun on the local Slurm cluster (as root), with nodes
# lost whole (their slurmd too) among the faults; ONLY=KillNode,CutLeader draws from those
# kinds of fault only; SETS="train.router_bias_rate=0.05 ..." adds trainer settings to every
# run and the reference.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
ops/setup.sh test
cargo build --release --workspace --bins
export LAZARUS_SOAK_FAULTS="${FAULTS:-1000}" LAZARUS_SOAK_STEPS="${STEPS:-2000}"
export LAZARUS_SOAK_LAUNCHER="${LAUNCHER:-mpiexec}"
export LAZARUS_SOAK_ONLY="${ONLY:-}" LAZARUS_SOAK_SETS="${SETS:-}"
if [ -n "${SEED:-}" ]; then
  export LAZARUS_SOAK_SEED="$SEED"
fi
cargo bench -p lazarus-tests --bench soak
