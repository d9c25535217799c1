//! End-to-end tests: one test binary that `mod`s every scenario (one link, shared harness).

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used)]

mod alerts;
mod ckptd;
mod cli;
mod conformance;
mod crash;
mod deadline;
mod gc_race;
mod interop;
mod learning;
mod mpi;
mod scale;
mod slurm;
mod supervisor;
mod trainer;
