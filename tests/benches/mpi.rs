//! Distributed trainer benchmark (real mpiexec): prints figures with baselines from the same run.
//!
//! 1. Tokens/s of the `tiny` preset at 1 rank (2 threads) and 2 ranks (1 thread each), data
//!    parallel and expert parallel, on the same global batch of 8 sequences; data parallel
//!    also with the gradient reduced after the backward pass instead of around it, and the
//!    time the reduce-scatter was in flight and waited on.
//! 2. Optimizer-state bytes per rank against the ZeRO-1 formula.
//! 3. The expert all-to-all's MB/s against a plain MPI all-to-all of 1 MiB per peer.
//! 4. Expert parallel over a longer run (`LAZARUS_BENCH_BIAS_STEPS`, default 150) with and
//!    without the routing bias (`train.router_bias_rate = 1e-3`): the busiest expert and the
//!    busiest rank's experts against the mean and tokens/s over the run's last third, and
//!    the exchange's waits.
//!
//! Run: cargo build --release --workspace --bins && cargo bench -p lazarus-tests --bench mpi

// A benchmark program: a panic with its message is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

use lazarus_tests::bin;
use lazarus_tests::train::{line_with, mean_tokens_per_second, metrics_records, TrainerArgs};

const STEPS: u64 = 6;
const WARMUP: u64 = 2;

fn train(dir: &Path, ranks: usize, ep: usize, overlap: bool) -> (f64, String) {
    let run = format!("n{ranks}-ep{ep}-overlap-{overlap}");
    let (text, _) = launch(
        dir,
        &run,
        ranks,
        ep,
        STEPS,
        &[&format!("parallel.overlap_grad_reduce={overlap}")],
    );
    (mean_tokens_per_second(dir, &run, WARMUP), text)
}

/// Runs `trainer train` on `ranks` ranks with the benchmark's settings and `sets`; returns
/// what it printed and its metrics, one JSON object per step.
fn launch(
    dir: &Path,
    run: &str,
    ranks: usize,
    ep: usize,
    steps: u64,
    sets: &[&str],
) -> (String, Vec<serde_json::Value>) {
    let mut command = if ranks == 1 {
        Command::new(bin("trainer"))
    } else {
        let mut command = Command::new("mpiexec");
        command.args(["-n", &ranks.to_string()]).arg(bin("trainer"));
        command
    };
    command.args(
        TrainerArgs::new("tiny")
            .metrics(&dir.join("metrics"))
            .run(run)
            .steps(steps)
            .set("train.micro_batch", 8 / ranks)
            .set("train.threads", 2 / ranks)
            .set("parallel.ep", ep)
            .sets([
                "train.log_every=1",
                "train.val_every=1000",
                "checkpoint.every=1000",
            ])
            .sets(sets.iter().copied())
            .store(&format!("file://{}", dir.join("store").display()))
            .data(&dir.join("data"))
            .build(),
    );
    let output = command.output().expect("trainer runs");
    let text = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{run}: {text}");
    (text, metrics_records(dir, run))
}

/// The mean of `figure` over the last third of `steps`.
fn last_third(steps: &[serde_json::Value], figure: &str) -> f64 {
    let last = &steps[steps.len() - steps.len() / 3..];
    last.iter()
        .map(|s| s[figure].as_f64().unwrap())
        .sum::<f64>()
        / last.len() as f64
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    lazarus_tests::train::prepare_data(dir.path());
    println!("distributed trainer benchmark: preset tiny, global batch 8 x 256 tokens, {STEPS} steps, tokens/s averaged after {WARMUP}");
    let (one, _) = train(dir.path(), 1, 1, true);
    let (after, _) = train(dir.path(), 2, 1, false);
    let (dp2, dp2_text) = train(dir.path(), 2, 1, true);
    let (ep2, ep2_text) = train(dir.path(), 2, 2, true);
    println!("  N=1 (2 threads):          {one:>6.0} tokens/s   1.00x");
    println!(
        "  N=2 EP=1 (1 thread each): {dp2:>6.0} tokens/s   {:.2}x",
        dp2 / one
    );
    println!(
        "  N=2 EP=1, gradient reduced after the backward pass (overlap_grad_reduce = false): {after:>6.0} tokens/s   {:.2}x",
        after / one
    );
    println!(
        "  N=2 EP=2 (1 thread each): {ep2:>6.0} tokens/s   {:.2}x",
        ep2 / one
    );
    println!("gradient reduce-scatter, layer by layer around the backward pass:");
    println!(
        "  N=2 EP=1: {}",
        line_with(&dp2_text, "gradient reduce-scatter")
    );
    println!("optimizer state per rank (rank 0) against ZeRO-1's prediction:");
    println!("  N=2 EP=1: {}", line_with(&dp2_text, "ZeRO-1 predicts"));
    println!("  N=2 EP=2: {}", line_with(&ep2_text, "ZeRO-1 predicts"));
    println!("all-to-all:");
    println!("  trainer: {}", line_with(&ep2_text, "expert all-to-all"));
    let plain = Command::new("mpiexec")
        .args(["-n", "2"])
        .arg(bin("trainer"))
        .args(["bench-all-to-all", "--bytes", "1048576", "--repeats", "50"])
        .output()
        .expect("mpiexec runs");
    let plain = String::from_utf8_lossy(&plain.stdout).to_string();
    println!("  plain:   {}", line_with(&plain, "MPI all-to-all"));

    let steps: u64 = std::env::var("LAZARUS_BENCH_BIAS_STEPS").map_or(150, |v| {
        v.parse().expect("LAZARUS_BENCH_BIAS_STEPS is a number")
    });
    println!("routing bias: N=2 EP=2 over {steps} steps, the last third's means:");
    for (name, rate) in [("without", "0"), ("with", "1e-3")] {
        let run = format!("bias-{name}");
        let (text, figures) = launch(
            dir.path(),
            &run,
            2,
            2,
            steps,
            &[&format!("train.router_bias_rate={rate}")],
        );
        println!(
            "  {name:<7} (train.router_bias_rate = {rate:>4}): busiest expert {:.2}x the mean, busiest rank's experts {:.2}x, {:>6.0} tokens/s, loss {:.4}",
            last_third(&figures, "expert_imbalance"),
            last_third(&figures, "expert_rank_imbalance"),
            last_third(&figures, "tokens_per_second"),
            last_third(&figures, "loss"),
        );
        println!("    {}", line_with(&text, "expert all-to-all"));
    }
}
