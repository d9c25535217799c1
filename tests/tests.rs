//! End-to-end tests: one test binary that `mod`s every scenario (one link, shared harness).

mod cli;
mod conformance;
mod crash;
mod gc_race;
