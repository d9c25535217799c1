//! Scale benchmark: the real leader (`ckptd --lead`, supervising an adopted world) against N
//! simulated nodes of 8 ranks each, speaking the real wire protocol from tasks of this one
//! process (`lazarus_tests::scale`). Prints one table: per N, the memory-commit latency
//! from a step's last report to each node's receipt (p50, p99), the time from a node's last
//! frame to the leader declaring it lost (heartbeat timeout 1.5 s), the leader's CPU seconds
//! per step at one step per second, its resident memory (now and peak), the bytes per
//! second into and out of the leader, `ckptctl status` time and size, and the takeover: the
//! leader is killed, and the time to a candidate daemon's election and to its adoption of
//! the world (after which it must commit 3 more steps exactly once on every node).
//!
//! `LAZARUS_BENCH_NODES` (default 64,256,1024,4096) sets the sizes, `LAZARUS_BENCH_STEPS`
//! (default 20) the steps of each.
//!
//! Then the store at that scale (`lazarus_tests::store_scale`), in time and requests to the
//! backend, on a `file://` store and on a real S3 server (`LAZARUS_BENCH_BACKENDS`, default
//! `file,s3`): committing a step of `LAZARUS_BENCH_MANIFESTS` (default
//! 32,768) shard manifests and opening it; `latest` and the catalog (`ckptctl list`) over
//! `LAZARUS_BENCH_HISTORY` (default 10,000) steps of 8 ranks; gc over `LAZARUS_BENCH_CHUNKS`
//! (default 1,000,000) chunks in 1,000 steps, keeping the newest 100 (on `file://` only:
//! the S3 test server's listing walks every object for each page).
//! `LAZARUS_BENCH_PARTS` (default `leader,store`) picks the parts.
//!
//! Run: cargo build --release --workspace --bins && cargo bench -p lazarus-tests --bench scale

// A benchmark program: a panic with its message is the failure report.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use lazarus_tests::scale::{self, Figures, Load};
use lazarus_tests::store_scale::{self, Backend, Measured};
use lazarus_tests::S3Server;

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map_or(default, |v| v.parse().expect("a count"))
}

fn main() {
    let parts = std::env::var("LAZARUS_BENCH_PARTS").unwrap_or_else(|_| "leader,store".into());
    if parts.contains("leader") {
        leader();
    }
    if parts.contains("store") {
        store();
    }
}

fn store() {
    let manifests = setting("LAZARUS_BENCH_MANIFESTS", 32_768) as u32;
    let history = setting("LAZARUS_BENCH_HISTORY", 10_000);
    let chunks = setting("LAZARUS_BENCH_CHUNKS", 1_000_000);
    let backends = std::env::var("LAZARUS_BENCH_BACKENDS").unwrap_or_else(|_| "file,s3".into());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    for name in backends.split(',') {
        let dir = tempfile::tempdir().unwrap();
        let server;
        let backend = match name.trim() {
            "file" => Backend::File(dir.path()),
            "s3" => {
                server = S3Server::start();
                Backend::S3(&server)
            }
            other => panic!("LAZARUS_BENCH_BACKENDS: {other} is not file or s3"),
        };
        println!("\nthe store at scale on {name} (requests as S3 would count them):");
        println!("{}", Measured::header());
        let show = |figures: Vec<Measured>| {
            for figure in figures {
                println!("{}", figure.row());
            }
        };
        show(
            runtime
                .block_on(store_scale::commit(backend, manifests))
                .unwrap(),
        );
        show(
            runtime
                .block_on(store_scale::history(backend, history, 8))
                .unwrap(),
        );
        if let Backend::S3(_) = backend {
            // s3s-fs walks every object of the bucket for each page of a listing.
            println!("gc: not measured on s3s-fs, whose listing walks every object per page");
        } else {
            show(
                runtime
                    .block_on(store_scale::gc(backend, chunks, 1000))
                    .unwrap(),
            );
        }
    }
}

fn leader() {
    let sizes: Vec<usize> = std::env::var("LAZARUS_BENCH_NODES")
        .unwrap_or_else(|_| "64,256,1024,4096".into())
        .split(',')
        .map(|n| n.trim().parse().expect("LAZARUS_BENCH_NODES: node counts"))
        .collect();
    let steps: u64 = std::env::var("LAZARUS_BENCH_STEPS")
        .ok()
        .map_or(20, |s| s.parse().expect("LAZARUS_BENCH_STEPS: a count"));
    println!("{}", Figures::header());
    let mut rows: Vec<Figures> = Vec::new();
    for nodes in sizes {
        let dir = tempfile::tempdir().unwrap();
        let load = Load::new(nodes, 8)
            .steps(steps, Duration::from_secs(1))
            .with_takeover();
        let figures = scale::run(dir.path(), &load).unwrap();
        let faults = figures.commit_faults();
        assert!(
            faults.is_empty(),
            "steps not committed exactly once on every node: {faults:?}"
        );
        println!("{}", figures.row());
        rows.push(figures);
    }
    // How each figure grows with N: the ratio per N-fold step from the smallest size.
    if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
        let n = last.load.nodes as f64 / first.load.nodes as f64;
        let growth = |a: f64, b: f64| if a > 0.0 { b / a } else { f64::NAN };
        println!(
            "\nfrom {} to {} nodes ({n:.0}x): commit p99 {:.1}x, cpu/step {:.1}x, rss {:.1}x, bytes in {:.1}x, status time {:.1}x, status size {:.1}x",
            first.load.nodes,
            last.load.nodes,
            growth(first.commit_ms.p99, last.commit_ms.p99),
            growth(first.leader_cpu_per_step, last.leader_cpu_per_step),
            growth(first.leader_rss_mib, last.leader_rss_mib),
            growth(first.bytes_in_per_s, last.bytes_in_per_s),
            growth(first.status_ms, last.status_ms),
            growth(first.status_bytes as f64, last.status_bytes as f64),
        );
    }
}
