//! Store benchmark: prints figures, with ratios against baselines measured in the same run.
//!
//! 1. Throughput of `ckptctl import`, `export` and `verify --read-data` on about
//!    LAZARUS_BENCH_MB (default 500) MB of f32 tensors, next to `cp` of the same file (page
//!    cache only, and followed by fsync, which is what a durable import has to pay).
//! 2. Stored/raw ratio of each codec on real training state (weights and Adam moments of
//!    the toy model trained on tinyshakespeare), and with the previous step as a delta base.
//!
//! Run: cargo build --release --workspace --bins && cargo bench -p lazarus-tests --bench store

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use lazarus_shared::codec::{self, Codec, DeltaBase};
use lazarus_shared::ChunkHash;
use lazarus_tests::toy::Toy;
use lazarus_tests::{bin, random_f32_bytes, shared_data, write_safetensors};

fn timed(label: &str, run: impl FnOnce()) -> f64 {
    let started = Instant::now();
    run();
    let seconds = started.elapsed().as_secs_f64();
    eprintln!("  {label}: {seconds:.2}s");
    seconds
}

fn ckptctl(dir: &Path, args: &[&str]) {
    let store = format!("file://{}", dir.join("store").display());
    let status = Command::new(bin("ckptctl"))
        .arg("--store")
        .arg(&store)
        .arg("--index")
        .arg(dir.join("index"))
        .args(args)
        .status()
        .expect("ckptctl runs");
    assert!(status.success(), "ckptctl {args:?} failed");
}

fn throughput() {
    let megabytes: usize = std::env::var("LAZARUS_BENCH_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500);
    let dir = tempfile::tempdir().expect("temp dir");
    let input = dir.path().join("model.safetensors");
    let per_tensor = megabytes * (1 << 20) / 4 / 4;
    let names = [
        "layer0.weight",
        "layer1.weight",
        "layer2.weight",
        "layer3.weight",
    ];
    let tensors: Vec<(&str, Vec<u64>, Vec<u8>)> = names
        .iter()
        .zip(1..)
        .map(|(name, seed)| {
            (
                *name,
                vec![per_tensor as u64],
                random_f32_bytes(per_tensor, seed),
            )
        })
        .collect();
    write_safetensors(&input, &tensors);
    drop(tensors);
    let bytes = std::fs::metadata(&input).expect("input").len() as f64;
    let mb = bytes / 1e6;
    println!("throughput on {mb:.0} MB of f32 tensors (4 tensors, 4 MiB chunks, 2 cores):");
    let copy = dir.path().join("copy");
    let cp = timed("cp", || {
        assert!(Command::new("cp")
            .arg(&input)
            .arg(&copy)
            .status()
            .expect("cp")
            .success())
    });
    std::fs::remove_file(&copy).expect("rm");
    let cp_sync = timed("cp + fsync", || {
        assert!(Command::new("cp")
            .arg(&input)
            .arg(&copy)
            .status()
            .expect("cp")
            .success());
        std::fs::File::open(&copy)
            .and_then(|f| f.sync_all())
            .expect("fsync");
    });
    let import = timed("import", || {
        ckptctl(
            dir.path(),
            &[
                "import",
                "bench",
                "--step",
                "1",
                input.to_str().expect("utf-8 path"),
            ],
        )
    });
    let out = dir.path().join("export");
    let export = timed("export", || {
        ckptctl(
            dir.path(),
            &[
                "export",
                "bench",
                "1",
                "--out",
                out.to_str().expect("utf-8 path"),
            ],
        )
    });
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).expect("exported"),
        std::fs::read(&input).expect("input"),
        "export must be byte-identical"
    );
    let verify = timed("verify", || {
        ckptctl(dir.path(), &["verify", "bench", "1", "--read-data"])
    });
    println!(
        "{:<24} {:>8} {:>10} {:>14} {:>10}",
        "operation", "seconds", "MB/s", "vs cp+fsync", "vs cp"
    );
    for (name, seconds) in [
        ("cp", cp),
        ("cp + fsync", cp_sync),
        ("import (durable)", import),
        ("export", export),
        ("verify --read-data", verify),
    ] {
        println!(
            "{name:<24} {seconds:>8.2} {:>10.0} {:>13.2}x {:>9.2}x",
            mb / seconds,
            cp_sync / seconds,
            cp / seconds
        );
    }
}

fn codec_ratios() {
    let text = std::fs::read(shared_data("tinyshakespeare.txt"))
        .expect("../shared/data/tinyshakespeare.txt is beside the repository");
    let mut model = Toy::new(text, 512, 7);
    let mut snapshots = Vec::new();
    for step in 1..=60 {
        model.train_step(64, 0.01);
        if [9, 10, 59, 60].contains(&step) {
            snapshots.push((step, model.tensors()));
        }
    }
    println!();
    println!("codec stored/raw ratio on real training state (toy byte model on tinyshakespeare, {:.1} MB of state per step; lower is better):", model.state_bytes() as f64 / 1e6);
    println!(
        "{:<6} {:<22} {:>8} {:>8} {:>14} {:>22}",
        "step", "tensor", "raw", "zstd", "shuffle4+zstd", "xor(prev)+shuffle4+zstd"
    );
    for pair in snapshots.chunks(2) {
        let [(_, previous), (step, current)] = pair else {
            continue;
        };
        let mut totals = [0usize; 5];
        for (before, after) in previous.iter().zip(current) {
            let raw = &after.data;
            let hash = ChunkHash::of(raw);
            let size = |codec, base| codec::encode_with(raw, hash, codec, base, 3).bytes.len();
            let base = DeltaBase {
                hash: ChunkHash::of(&before.data),
                depth: 0,
                raw: &before.data,
            };
            let sizes = [
                raw.len(),
                size(Codec::Raw, None),
                size(Codec::Zstd, None),
                size(Codec::Shuffle4Zstd, None),
                size(Codec::XorShuffle4Zstd, Some(base)),
            ];
            let ratio = |i: usize| sizes[i] as f64 / sizes[0] as f64;
            println!(
                "{step:<6} {:<22} {:>8.3} {:>8.3} {:>14.3} {:>22.3}",
                after.name,
                ratio(1),
                ratio(2),
                ratio(3),
                ratio(4)
            );
            for (total, size) in totals.iter_mut().zip(sizes) {
                *total += size;
            }
        }
        let ratio = |i: usize| totals[i] as f64 / totals[0] as f64;
        println!(
            "{step:<6} {:<22} {:>8.3} {:>8.3} {:>14.3} {:>22.3}",
            "ALL",
            ratio(1),
            ratio(2),
            ratio(3),
            ratio(4)
        );
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    throughput();
    codec_ratios();
}
