//! Recovery benchmark: the supervising leader (daemons on 127.0.0.1 standing for nodes, two
//! ranks under a real mpiexec) recovers from each kind of fault. Prints figures measured in
//! this run:
//!
//! 1. Per scenario, the time from the fault to the first completed step after recovery,
//!    split into detect (fault to the leader's `fault` event), stop, relaunch (stopped to
//!    launch, including a swap or securing a step), restore (launch until every rank holds
//!    the restored step: process start, MPI init, the restore itself) and first step; with
//!    the restore tier the daemons counted.
//! 2. Goodput: steps reached in the same wall time with a fault every
//!    `LAZARUS_BENCH_FAULT_EVERY` seconds (default 60; rank crashes and lost nodes in turn),
//!    against the same run without faults. `LAZARUS_BENCH_MINUTES` (default 10) sets the time.
//!
//! Run: cargo build --release --workspace --bins && cargo bench -p lazarus-tests --bench recovery

// A benchmark program: a panic with its message is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use lazarus_tests::cluster::Cluster;
use lazarus_tests::supervision::{
    events, kill, now_ms, supervised_with, wait_for_event_or, Status,
};
use lazarus_tests::train::{loss_texts, TrainerArgs};

fn trainer_args(dir: &Path, run: &str) -> Vec<String> {
    TrainerArgs::small(dir)
        .run(run)
        .sets([
            "train.steps=10000000",
            "train.warmup_steps=1000",
            "train.lr=0.5",
            "checkpoint.every=1",
        ])
        .store(&format!("file://{}", dir.join("store").display()))
        .build()
}

/// The newest step the run logged (rank 0 logs every step).
fn logged_step(dir: &Path, run: &str) -> u64 {
    loss_texts(dir, run).keys().max().copied().unwrap_or(0)
}

fn event_ms(timeline: &[serde_json::Value], kind: &str, generation: u64) -> u64 {
    timeline
        .iter()
        .find(|e| e["kind"] == kind && e["generation"] == generation)
        .and_then(|e| e["unix_ms"].as_u64())
        .unwrap_or_else(|| panic!("no {kind} event in generation {generation}: {timeline:#?}"))
}

fn restores(cluster: &Cluster) -> String {
    let mut tiers = Vec::new();
    for tier in ["t0", "t1", "t2"] {
        // The daemons still running (a lost node's is gone).
        let count: f64 = (0..cluster.nodes.len())
            .filter(|i| cluster.pid(*i).is_some())
            .map(|i| {
                cluster.metric(
                    i,
                    &format!("lazarus_ckptd_restores_total{{tier=\"{tier}\"}}"),
                )
            })
            .sum();
        if count > 0.0 {
            tiers.push(format!("{tier} x{count}"));
        }
    }
    tiers.join(", ")
}

enum Fault {
    CrashRank,
    HangRank,
    LoseNode,
}

/// Runs one scenario on a fresh cluster and prints its row.
fn scenario(root: &Path, name: &str, nodes: usize, flags: &[&str], fault: Fault) {
    let dir = root.join(
        name.chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect::<String>(),
    );
    std::fs::create_dir_all(&dir).unwrap();
    std::os::unix::fs::symlink(root.join("data"), dir.join("data")).unwrap();
    let run = "bench";
    let (mut cluster, ctl) = supervised_with(
        &dir,
        run,
        nodes,
        flags,
        &trainer_args(&dir, run),
        Vec::new(),
    );
    // Past the first durable step (50), so a shrink has one to start from too.
    let victim = Status::of(&cluster, &ctl).rank_pid(1, 60);
    let injected = now_ms();
    match fault {
        Fault::CrashRank => assert!(kill("KILL", victim)),
        Fault::HangRank => assert!(kill("STOP", victim)),
        Fault::LoseNode => {
            cluster.kill_node(1);
            kill("KILL", victim);
        }
    }
    wait_for_event_or(&ctl, run, "first_step", 2, || cluster.logs());
    let timeline = events(&ctl, run);
    let fault = event_ms(&timeline, "fault", 0);
    let stopped = event_ms(&timeline, "stopped", 0);
    let relaunch = event_ms(&timeline, "relaunch", 1);
    let restored = event_ms(&timeline, "restored", 1);
    let first = event_ms(&timeline, "first_step", 1);
    println!(
        "{:<28} {:>8} {:>8} {:>9} {:>9} {:>10} {:>9}   {}",
        name,
        fault.saturating_sub(injected),
        stopped - fault,
        relaunch - stopped,
        restored - relaunch,
        first - restored,
        first.saturating_sub(injected),
        restores(&cluster)
    );
}

/// Steps the world reached in `minutes`, with a fault every `every` seconds (or none).
fn goodput_run(root: &Path, name: &str, minutes: f64, every: Option<f64>) -> (u64, usize) {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::os::unix::fs::symlink(root.join("data"), dir.join("data")).unwrap();
    let run = "goodput";
    let flags = ["--supervise", "mpiexec", "--active-nodes", "2"];
    let (mut cluster, ctl) =
        supervised_with(&dir, run, 3, &flags, &trainer_args(&dir, run), Vec::new());
    Status::of(&cluster, &ctl).rank_pid(0, 0);
    let started = Instant::now();
    let end = started + Duration::from_secs_f64(minutes * 60.0);
    let mut faults = 0;
    let mut next = every.map(|e| started + Duration::from_secs_f64(e));
    let mut restart_node: Option<(usize, Instant)> = None;
    while Instant::now() < end {
        if let Some((node, at)) = restart_node {
            if Instant::now() >= at {
                // The lost node is repaired and serves as the next spare.
                cluster.start_node(node);
                restart_node = None;
            }
        }
        if next.is_some_and(|at| Instant::now() >= at) {
            let status = Status::of(&cluster, &ctl).json();
            let ranks = status["runs"][0]["ranks"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if let Some(rank) = ranks.iter().find(|r| r["rank"] == 1) {
                let pid = rank["pid"].as_u64().unwrap();
                let node = rank["node"].as_str().unwrap().trim_start_matches('n');
                let index = node.parse::<usize>().unwrap() - 1;
                if faults % 2 == 1 && index != 0 && restart_node.is_none() {
                    cluster.kill_node(index);
                    restart_node = Some((index, Instant::now() + Duration::from_secs(10)));
                }
                kill("KILL", pid);
                faults += 1;
                next = every.map(|e| Instant::now() + Duration::from_secs_f64(e));
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    (logged_step(&dir, run), faults)
}

fn main() {
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    lazarus_tests::train::prepare_data(root);

    println!(
        "1. recovery by scenario (2 ranks on 127.0.0.1 daemons; ms; fault injected at step > 60)"
    );
    println!(
        "{:<28} {:>8} {:>8} {:>9} {:>9} {:>10} {:>9}   restores",
        "scenario", "detect", "stop", "relaunch", "restore", "first step", "total"
    );
    let spare = ["--supervise", "mpiexec", "--active-nodes", "2"];
    scenario(root, "crashed rank (SIGKILL)", 2, &spare, Fault::CrashRank);
    scenario(
        root,
        "hung rank (SIGSTOP, 5 s)",
        2,
        &[
            "--supervise",
            "mpiexec",
            "--active-nodes",
            "2",
            "--hang-timeout-seconds",
            "5",
        ],
        Fault::HangRank,
    );
    scenario(root, "lost node, hot spare", 3, &spare, Fault::LoseNode);
    scenario(
        root,
        "lost node, no spare, shrink",
        2,
        &[
            "--supervise",
            "mpiexec",
            "--active-nodes",
            "2",
            "--when-no-spare",
            "shrink",
        ],
        Fault::LoseNode,
    );

    let minutes: f64 = std::env::var("LAZARUS_BENCH_MINUTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10.0);
    let every: f64 = std::env::var("LAZARUS_BENCH_FAULT_EVERY")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60.0);
    println!();
    println!("2. goodput over {minutes} min (2 active nodes + 1 spare; a fault every {every} s: rank crashes and lost nodes in turn)");
    let (clean, _) = goodput_run(root, "clean", minutes, None);
    let (faulty, faults) = goodput_run(root, "faulty", minutes, Some(every));
    println!("without faults: step {clean}");
    println!("with {faults} faults: step {faulty}");
    println!(
        "goodput: {:.3} (steps with faults / steps without, same wall time)",
        faulty as f64 / clean.max(1) as f64
    );
}
