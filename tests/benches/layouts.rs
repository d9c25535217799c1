//! Parallel layouts benchmark (real mpiexec, 4 ranks of one thread each): prints figures with
//! the baseline from the same run.
//!
//! 1. Tokens/s of the `tiny` preset in each tested layout on the same global batch of 8
//!    sequences, next to plain data parallel (DP4).
//! 2. The pipeline bubble: each stage's share of a step spent waiting on its neighbours, as
//!    the trainer measures it, against the 1F1B formula, for 2, 4 and 8 micro-batches (PP4).
//! 3. Pipeline balance: PP2 on 2 ranks (a core each), tokens/s with `tiny`'s four layers cut
//!    [3, 1] (`parallel.pipeline_layers`, the last stage beside the LM head) against an equal
//!    [2, 2], in interleaved pairs, with each split's stage waits.
//! 4. Per-rank memory: what each rank holds (weights, gradients, optimizer state) next to the
//!    layout's prediction, from rank 0's table; the peak activations measured on the heap
//!    next to their prediction; and each rank's peak resident memory.
//!
//! Run: cargo build --release --workspace --bins && cargo bench -p lazarus-tests --bench layouts

// A benchmark program: a panic with its message is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

use lazarus_tests::bin;
use lazarus_tests::stats::spread;
use lazarus_tests::train::{line_with, mean_tokens_per_second, TrainerArgs};

const RANKS: usize = 4;
const GLOBAL_BATCH: usize = 8;
const STEPS: u64 = 4;
const WARMUP: u64 = 1;

/// A layout: its name, data-parallel size and `parallel` settings.
struct Layout {
    name: &'static str,
    dp: usize,
    sets: &'static [&'static str],
}

const LAYOUTS: [Layout; 6] = [
    Layout {
        name: "DP4",
        dp: 4,
        sets: &[],
    },
    Layout {
        name: "TP2 x DP2",
        dp: 2,
        sets: &["parallel.tp=2"],
    },
    Layout {
        name: "PP2 x DP2, 4 micro-batches",
        dp: 2,
        sets: &["parallel.pp=2", "parallel.micro_batches=4"],
    },
    Layout {
        name: "TP2 x PP2, 4 micro-batches",
        dp: 1,
        sets: &["parallel.tp=2", "parallel.pp=2", "parallel.micro_batches=4"],
    },
    Layout {
        name: "DP2 x EP2 x PP2, 2 micro-batches",
        dp: 2,
        sets: &["parallel.pp=2", "parallel.ep=2", "parallel.micro_batches=2"],
    },
    Layout {
        name: "TP2 x DP2 x EP2",
        dp: 2,
        sets: &["parallel.tp=2", "parallel.ep=2"],
    },
];

/// Interleaved pairs of the pipeline-balance comparison.
const BALANCE_PAIRS: usize = 3;

/// Trains `steps` of `tiny` under `mpiexec -n 4`; returns the mean tokens/s after the warm-up
/// steps and what the ranks printed.
fn train(dir: &Path, run: &str, dp: usize, sets: &[&str]) -> (f64, String) {
    train_on(RANKS, dir, run, dp, sets)
}

/// [`train`] on `ranks` ranks.
fn train_on(ranks: usize, dir: &Path, run: &str, dp: usize, sets: &[&str]) -> (f64, String) {
    let output = Command::new("mpiexec")
        .args(["-n", &ranks.to_string()])
        .arg(bin("trainer"))
        .args(
            TrainerArgs::new("tiny")
                .metrics(&dir.join("metrics"))
                .run(run)
                .steps(STEPS)
                .set("train.micro_batch", GLOBAL_BATCH * ranks / RANKS / dp)
                .sets([
                    "train.threads=1",
                    "train.log_every=1",
                    "train.val_every=1000",
                    "checkpoint.every=1000",
                ])
                .sets(sets.iter().copied())
                .store(&format!("file://{}", dir.join("store").display()))
                .data(&dir.join("data"))
                .build(),
        )
        .output()
        .expect("mpiexec runs");
    let text = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{run}: {text}");
    (mean_tokens_per_second(dir, run, WARMUP), text)
}

/// Rank 0's layout table, header included.
fn layout_table(text: &str) -> Vec<&str> {
    text.lines()
        .skip_while(|line| !line.starts_with(" rank  tp"))
        .take(RANKS + 1)
        .collect()
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    lazarus_tests::train::prepare_data(dir.path());
    println!(
        "parallel layouts benchmark: preset tiny, {RANKS} ranks of 1 thread, global batch \
         {GLOBAL_BATCH} x 256 tokens, {STEPS} steps, tokens/s averaged after {WARMUP}"
    );
    let mut texts = Vec::new();
    let mut baseline = None;
    for (index, layout) in LAYOUTS.iter().enumerate() {
        let (rate, text) = train(
            dir.path(),
            &format!("layout-{index}"),
            layout.dp,
            layout.sets,
        );
        let base = *baseline.get_or_insert(rate);
        println!(
            "  {:<34} {rate:>7.0} tokens/s   {:.2}x DP4",
            layout.name,
            rate / base
        );
        texts.push(text);
    }

    println!("pipeline bubble, PP4 (one layer per stage; the last stage also runs the LM head):");
    for micro_batches in [2, 4, 8] {
        let (rate, text) = train(
            dir.path(),
            &format!("pp4-m{micro_batches}"),
            1,
            &[
                "parallel.pp=4",
                &format!("parallel.micro_batches={micro_batches}"),
            ],
        );
        println!(
            "  {micro_batches} micro-batches: {rate:>6.0} tokens/s; {}",
            line_with(&text, "pipeline bubble:")
        );
    }

    println!(
        "pipeline balance, PP2 on 2 ranks, 4 micro-batches of a global batch of {}: layers [3, 1] against [2, 2]:",
        GLOBAL_BATCH / 2
    );
    let pp2 = ["parallel.pp=2", "parallel.micro_batches=4"];
    let uneven = [pp2[0], pp2[1], "parallel.pipeline_layers=[3, 1]"];
    let mut ratios = Vec::new();
    for pair in 0..BALANCE_PAIRS {
        let (equal, equal_text) = train_on(2, dir.path(), &format!("pp2-equal-{pair}"), 1, &pp2);
        let (rate, text) = train_on(2, dir.path(), &format!("pp2-31-{pair}"), 1, &uneven);
        ratios.push(rate / equal);
        println!(
            "  pair {pair}: [2, 2] {equal:>6.0} tokens/s, [3, 1] {rate:>6.0} tokens/s, {:.2}x",
            rate / equal
        );
        println!("    [2, 2]: {}", line_with(&equal_text, "pipeline bubble:"));
        println!("    [3, 1]: {}", line_with(&text, "pipeline bubble:"));
    }
    println!("  [3, 1] against [2, 2]: {}", spread(&ratios, "pairs"));

    println!("memory per rank: held (prediction) from rank 0's table, then measured peaks:");
    for (layout, text) in LAYOUTS.iter().zip(&texts) {
        println!("  {}:", layout.name);
        for line in layout_table(text) {
            println!("    {line}");
        }
        println!("    {}", line_with(text, "peak activations"));
        println!("    {}", line_with(text, "peak resident memory"));
    }
}
