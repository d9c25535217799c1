//! Training-health benchmark (real mpiexec): what the health check and the silent-data-
//! corruption check cost per step, as a share of the step time, at two model sizes.
//!
//! Two ranks (data parallel, one thread each) train the test model and the `tiny` preset
//! twice each: with the SDC check at every step, and without it (the baseline, in the same
//! program). The trainer times both checks and prints them in its summary line; the step
//! times of the two runs give the check's cost a second way.
//!
//! Run: cargo build --release --workspace --bins && cargo bench -p lazarus-tests --bench health

// A benchmark program: a panic with its message is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

use lazarus_tests::bin;
use lazarus_tests::train::{line_with, TrainerArgs, SMALL_MODEL};

/// The summary line's figure after `after` (e.g. "of a " gives the step's milliseconds).
fn figure(line: &str, after: &str) -> f64 {
    let at = line
        .find(after)
        .unwrap_or_else(|| panic!("no {after:?} in {line}"));
    line[at + after.len()..]
        .split_whitespace()
        .next()
        .and_then(|word| word.trim_end_matches(['%', ',', ')']).parse().ok())
        .unwrap_or_else(|| panic!("no figure after {after:?} in {line}"))
}

/// Trains `args` on two ranks with the SDC check every `every` steps (0: off); returns the
/// trainer's summary line of the checks.
fn train(dir: &Path, run: &str, args: &TrainerArgs, every: u64) -> String {
    let args = args
        .clone()
        .run(run)
        .set("health.sdc_check_every", every)
        .store(&format!("file://{}", dir.join("store").display()))
        .build();
    let output = Command::new("mpiexec")
        .args(["-n", "2"])
        .arg(bin("trainer"))
        .args(&args)
        .output()
        .expect("mpiexec runs");
    let text = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{run}: {text}");
    line_with(&text, "health checks:").to_string()
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    lazarus_tests::train::prepare_data(dir.path());
    let steps: u64 = std::env::var("LAZARUS_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let common = |preset: &str| {
        TrainerArgs::new(preset)
            .metrics(&dir.path().join("metrics"))
            .data(&dir.path().join("data"))
            .steps(steps)
            .sets([
                "train.threads=1",
                "train.val_every=100000",
                "train.log_every=100000",
                "checkpoint.every=100000",
            ])
    };
    let sizes = [
        (
            "test model",
            common("tiny").sets(SMALL_MODEL).set("model.experts", 4),
        ),
        ("tiny preset", common("tiny").set("train.micro_batch", 4)),
    ];
    println!("health-check benchmark: 2 ranks under mpiexec, 1 thread each, {steps} steps; the SDC check at every step against none");
    println!(
        "  {:<12} {:>12} {:>12} {:>8} {:>14} {:>10} {:>14} {:>10} {:>16}",
        "model",
        "step ms",
        "step ms",
        "ratio",
        "health check",
        "of step",
        "SDC check",
        "of step",
        "every 100 steps"
    );
    println!("  {:<12} {:>12} {:>12}", "", "(no SDC)", "(SDC/step)");
    for (index, (name, args)) in sizes.iter().enumerate() {
        let off = train(dir.path(), &format!("off{index}"), args, 0);
        let on = train(dir.path(), &format!("on{index}"), args, 1);
        let (base, with) = (figure(&off, "of a "), figure(&on, "of a "));
        let sdc_part = &on[on
            .find("silent-data-corruption checks:")
            .unwrap_or_else(|| panic!("no SDC check ran: {on}"))..];
        let sdc_ms = figure(sdc_part, " at ");
        let health_us = figure(&on, " at ");
        println!(
            "  {:<12} {:>12.1} {:>12.1} {:>7.3}x {:>11.1} us {:>9.4}% {:>11.2} ms {:>9.2}% {:>15.3}%",
            name,
            base,
            with,
            with / base,
            health_us,
            100.0 * health_us / 1e3 / base,
            sdc_ms,
            100.0 * sdc_ms / base,
            100.0 * sdc_ms / base / 100.0
        );
        println!("    trainer (SDC every step): {on}");
    }
}
