//! The trainer under a real Slurm cluster on this machine (`ops/slurm/local-cluster.sh`): a
//! step launched with `srun --mpi=pmi2` across nodes trains exactly like `mpiexec`.

use std::path::Path;
use std::process::Command;

use lazarus_tests::cluster::text_of;
use lazarus_tests::train::{loss_texts, pid_in_rank_table, prepared, TrainerArgs};
use lazarus_tests::{bin, slurm_cluster};

fn args(dir: &Path, run: &str) -> Vec<String> {
    args_steps(dir, run, 6)
}

fn args_steps(dir: &Path, run: &str, steps: u64) -> Vec<String> {
    TrainerArgs::small(dir)
        .run(run)
        .steps(steps)
        .sets(["parallel.ep=2", "checkpoint.every=3"])
        .store(&format!("file://{}", dir.join("store").display()))
        .build()
}

#[test]
fn srun_with_pmi2_across_nodes_trains_like_mpiexec() {
    let conf = match slurm_cluster() {
        Ok(conf) => conf,
        Err(why) => {
            lazarus_tests::skip(&why);
            return;
        }
    };
    let (_guard, dir) = prepared();
    let dir = dir.as_path();
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
    let (srun, mpiexec) = (loss_texts(dir, "srun"), loss_texts(dir, "mpiexec"));
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
            lazarus_tests::skip(&why);
            return;
        }
    };
    let (_guard, dir) = prepared();
    let dir = dir.as_path();
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
    let pid = pid_in_rank_table(&ranks, 1);
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
