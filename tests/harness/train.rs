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
    let output = Command::new(bin("trainer"))
        .args(["prepare", "--input"])
        .arg(shared_data("tinyshakespeare.txt"))
        .arg("--out")
        .arg(dir.path().join("data"))
        .output()
        .expect("trainer prepare runs");
    assert!(
        output.status.success(),
        "{}",
        crate::cluster::text_of(&output)
    );
    let path = dir.path().to_path_buf();
    (dir, path)
}

/// `trainer train` on the `tiny` preset shrunk to a few million parameters (one thread per
/// rank, a log line per step, metrics under `dir/metrics`, data from [`prepared`]), then
/// `sets` (later ones win).
pub fn small_model_args(dir: &Path, sets: &[String]) -> Vec<String> {
    let mut args: Vec<String> = ["train", "--config", "tiny", "--metrics-dir"]
        .map(String::from)
        .to_vec();
    args.push(dir.join("metrics").display().to_string());
    let base = [
        "model.d_model=32",
        "model.layers=2",
        "model.heads=2",
        "model.experts=4",
        "model.expert_ffn=32",
        "model.seq_len=32",
        "train.micro_batch=2",
        "train.log_every=1",
        "train.val_every=100000",
        "train.threads=1",
    ]
    .map(String::from);
    let data = format!("data.path={}", dir.join("data").display());
    for set in base.iter().chain(std::iter::once(&data)).chain(sets) {
        args.push("--set".into());
        args.push(set.clone());
    }
    args
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
