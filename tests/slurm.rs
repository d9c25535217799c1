//! The trainer under a real Slurm cluster on this machine (`ops/slurm/local-cluster.sh`): a
//! step launched with `srun --mpi=pmi2` across nodes trains exactly like `mpiexec`.

use std::path::Path;
use std::process::Command;

use lazarus_tests::cluster::text_of;
use lazarus_tests::{bin, shared_data, slurm_cluster};

fn args(dir: &Path, run: &str) -> Vec<String> {
    args_steps(dir, run, 6)
}

fn args_steps(dir: &Path, run: &str, steps: u64) -> Vec<String> {
    let mut args: Vec<String> = ["train", "--config", "tiny", "--metrics-dir"]
        .map(String::from)
        .to_vec();
    args.push(dir.join("metrics").display().to_string());
    for set in [
        format!("run.id={run}"),
        "model.d_model=32".into(),
        "model.layers=2".into(),
        "model.heads=2".into(),
        "model.experts=4".into(),
        "model.expert_ffn=32".into(),
        "model.seq_len=32".into(),
        "train.micro_batch=2".into(),
        format!("train.steps={steps}"),
        "train.log_every=1".into(),
        "train.val_every=1000".into(),
        "train.threads=1".into(),
        "parallel.ep=2".into(),
        "checkpoint.every=3".into(),
        format!("checkpoint.store=file://{}", dir.join("store").display()),
        format!("data.path={}", dir.join("data").display()),
    ] {
        args.push("--set".into());
        args.push(set);
    }
    args
}

fn losses(dir: &Path, run: &str) -> Vec<String> {
    std::fs::read_to_string(dir.join("metrics").join(run).join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap()["loss"].to_string())
        .collect()
}

#[test]
fn srun_with_pmi2_across_nodes_trains_like_mpiexec() {
    let conf = match slurm_cluster() {
        Ok(conf) => conf,
        Err(why) => {
            println!("skipped: {why}");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let output = Command::new(bin("trainer"))
        .args(["prepare", "--input"])
        .arg(shared_data("tinyshakespeare.txt"))
        .arg("--out")
        .arg(dir.join("data"))
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text_of(&output));
    let output = Command::new("srun")
        .env("SLURM_CONF", &conf)
        .args(["-N", "2", "-n", "2", "--mpi=pmi2", "--time=5", "-l"])
        .arg(bin("trainer"))
        .args(args(dir, "srun"))
        .output()
        .unwrap();
    let said = text_of(&output);
    assert!(output.status.success(), "{said}");
    assert!(
        said.contains("2 ranks (data parallel 2, expert parallel 2)"),
        "{said}"
    );
    let output = Command::new("mpiexec")
        .args(["-n", "2"])
        .arg(bin("trainer"))
        .args(args(dir, "mpiexec"))
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text_of(&output));
    let (srun, mpiexec) = (losses(dir, "srun"), losses(dir, "mpiexec"));
    assert_eq!(srun.len(), 6);
    assert_eq!(
        srun, mpiexec,
        "the same layout repeats bit for bit under either launcher"
    );
}

#[test]
fn a_killed_rank_under_srun_ends_the_step_and_is_named() {
    use std::io::{BufRead, BufReader};
    use std::time::{Duration, Instant};
    let conf = match slurm_cluster() {
        Ok(conf) => conf,
        Err(why) => {
            println!("skipped: {why}");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let output = Command::new(bin("trainer"))
        .args(["prepare", "--input"])
        .arg(shared_data("tinyshakespeare.txt"))
        .arg("--out")
        .arg(dir.join("data"))
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text_of(&output));
    let mut child = Command::new("srun")
        .env("SLURM_CONF", &conf)
        .args([
            "-N",
            "2",
            "-n",
            "2",
            "--mpi=pmi2",
            "--time=5",
            "--kill-on-bad-exit=1",
        ])
        .arg(bin("trainer"))
        .args(args_steps(dir, "killed", 100_000))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut ranks = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if line.starts_with("ranks: ") {
            ranks = line.clone();
        }
        if line.starts_with("step      4") {
            break;
        }
    }
    let pid: u32 = ranks
        .split("rank 1 = pid ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|pid| pid.parse().ok())
        .unwrap_or_else(|| panic!("no rank table in {ranks:?}"));
    let killed = Instant::now();
    assert!(Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    let _rest: Vec<String> = lines.map_while(|l| l.ok()).collect();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    let status = child.wait().unwrap();
    let took = killed.elapsed();
    println!(
        "srun ended {took:?} after rank 1 was killed: {}",
        stderr.trim()
    );
    assert!(!status.success());
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert!(
        stderr.contains("task 1: Killed"),
        "srun names the rank: {stderr}"
    );
}
