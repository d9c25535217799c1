//! What the multi-process trainer tests share: prepared data, the small model they train,
//! and reading back what a run logged.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::deadline::{test_dir_within, TestDir};
use crate::{bin, shared_data};

/// `tinyshakespeare` tokenised into `<test dir>/data`, in a test directory with the
/// default deadline.
pub fn prepared() -> (TestDir, PathBuf) {
    prepared_within(crate::deadline::DEFAULT_DEADLINE)
}

/// [`prepared`], with a deadline of `limit`.
pub fn prepared_within(limit: std::time::Duration) -> (TestDir, PathBuf) {
    let dir = test_dir_within(limit);
    prepare_data(dir.path());
    let path = dir.path().to_path_buf();
    (dir, path)
}

/// `tinyshakespeare` tokenised into `dir/data` (what tests and benchmarks train on).
pub fn prepare_data(dir: &Path) {
    let output = Command::new(bin("trainer"))
        .args(["prepare", "--input"])
        .arg(shared_data("tinyshakespeare.txt"))
        .arg("--out")
        .arg(dir.join("data"))
        .output()
        .expect("trainer prepare runs");
    assert!(
        output.status.success(),
        "{}",
        crate::cluster::text_of(&output)
    );
}

/// Arguments of `trainer train`, built up: a config (a preset's name or a file), where the
/// metrics go, and `--set` overrides in order (a later one wins). Every test that starts a
/// trainer builds its arguments here.
#[derive(Clone, Debug)]
pub struct TrainerArgs {
    config: String,
    metrics: Option<PathBuf>,
    options: Vec<String>,
    sets: Vec<String>,
}

/// The `tiny` preset's model shrunk to a few million parameters (the GPT-2 vocabulary still
/// sets the head's width), a log line per step and no validation.
pub const SMALL_MODEL: [&str; 7] = [
    "model.d_model=32",
    "model.layers=2",
    "model.heads=2",
    "model.expert_ffn=32",
    "model.seq_len=32",
    "train.micro_batch=2",
    "train.log_every=1",
];

impl TrainerArgs {
    /// `trainer train --config <config>`, nothing overridden.
    pub fn new(config: &str) -> Self {
        Self {
            config: config.to_string(),
            metrics: None,
            options: Vec::new(),
            sets: Vec::new(),
        }
    }

    /// What the multi-process tests train: [`SMALL_MODEL`] with four experts and one thread
    /// per rank, metrics under `dir/metrics`, data from [`prepared`] in `dir`.
    pub fn small(dir: &Path) -> Self {
        Self::new("tiny")
            .metrics(&dir.join("metrics"))
            .sets(SMALL_MODEL)
            .sets([
                "model.experts=4",
                "train.val_every=100000",
                "train.threads=1",
            ])
            .data(&dir.join("data"))
    }

    /// Metrics (`metrics.jsonl` per run) under `dir`.
    pub fn metrics(mut self, dir: &Path) -> Self {
        self.metrics = Some(dir.to_path_buf());
        self
    }

    /// A command-line option before the overrides, e.g. `--resume never`.
    pub fn option(mut self, name: &str, value: &str) -> Self {
        self.options.push(name.to_string());
        self.options.push(value.to_string());
        self
    }

    /// `--set key=value`.
    pub fn set(mut self, key: &str, value: impl std::fmt::Display) -> Self {
        self.sets.push(format!("{key}={value}"));
        self
    }

    /// `--set` for each `key=value`.
    pub fn sets<S: Into<String>>(mut self, sets: impl IntoIterator<Item = S>) -> Self {
        self.sets.extend(sets.into_iter().map(Into::into));
        self
    }

    pub fn run(self, id: &str) -> Self {
        self.set("run.id", id)
    }

    pub fn steps(self, steps: u64) -> Self {
        self.set("train.steps", steps)
    }

    pub fn store(self, url: &str) -> Self {
        self.set("checkpoint.store", url)
    }

    /// Tokenised data in `dir` (what [`prepared`] makes under `<test dir>/data`).
    pub fn data(self, dir: &Path) -> Self {
        self.set("data.path", dir.display())
    }

    /// The command line after the program's name.
    pub fn build(&self) -> Vec<String> {
        let mut args: Vec<String> = vec!["train".into(), "--config".into(), self.config.clone()];
        if let Some(metrics) = &self.metrics {
            args.push("--metrics-dir".into());
            args.push(metrics.display().to_string());
        }
        args.extend(self.options.iter().cloned());
        for set in &self.sets {
            args.push("--set".into());
            args.push(set.clone());
        }
        args
    }
}

/// The last loss logged for each step of `run`, as exact text (for bit-for-bit comparisons).
pub fn loss_texts(dir: &Path, run: &str) -> BTreeMap<u64, String> {
    std::fs::read_to_string(dir.join("metrics").join(run).join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|v| Some((v["step"].as_u64()?, v["loss"].to_string())))
        .collect()
}

/// The pid of `rank` in rank 0's table ("ranks: rank 0 = pid P on H, rank 1 = pid Q on H").
pub fn pid_in_rank_table(line: &str, rank: usize) -> u32 {
    line.split(&format!("rank {rank} = pid "))
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|pid| pid.parse().ok())
        .unwrap_or_else(|| panic!("no rank {rank} in the rank table {line:?}"))
}

/// A test's uninterrupted reference: `args` (of the run `reference`) trained under plain
/// `mpiexec -n ranks`, no daemon. Its losses as exact text.
pub fn reference_run(dir: &Path, ranks: usize, args: &[String]) -> BTreeMap<u64, String> {
    let output = Command::new("mpiexec")
        .args(["-n", &ranks.to_string()])
        .arg(bin("trainer"))
        .args(args)
        .output()
        .expect("mpiexec runs");
    assert!(
        output.status.success(),
        "{}",
        crate::cluster::text_of(&output)
    );
    loss_texts(dir, "reference")
}

/// The records of `run`'s `metrics.jsonl` under `dir/metrics`, one per logged step.
pub fn metrics_records(dir: &Path, run: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics").join(run).join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}

/// The mean `tokens_per_second` of `run`'s steps after the first `warmup` (benchmarks).
pub fn mean_tokens_per_second(dir: &Path, run: &str, warmup: u64) -> f64 {
    let rates: Vec<f64> = metrics_records(dir, run)
        .iter()
        .filter_map(|value| {
            (value["step"].as_u64()? > warmup).then(|| value["tokens_per_second"].as_f64())?
        })
        .collect();
    rates.iter().sum::<f64>() / rates.len() as f64
}

/// The first line of `text` that contains `needle` (benchmarks quote the trainer's lines).
pub fn line_with<'a>(text: &'a str, needle: &str) -> &'a str {
    text.lines()
        .find(|l| l.contains(needle))
        .unwrap_or("(not printed)")
}
