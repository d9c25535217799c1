//! Store benchmark: prints figures, with ratios against baselines measured in the same run.
//!
//! 1. Throughput of `ckptctl import`, `export` and `verify --read-data` on about
//!    LAZARUS_BENCH_MB (default 500) MB of f32 tensors, next to `cp` of the same file (page
//!    cache only, and followed by fsync, which is what a durable import has to pay), in
//!    LAZARUS_BENCH_ROUNDS (default 5) rounds of all five: each ratio is the median of the
//!    rounds' ratios, with its spread, since this machine's speed drifts from one second to
//!    the next. The tensors are normal draws (standard deviation 0.02, as the model's weights
//!    start), with every mantissa bit random as in trained state.
//! 2. Stored/raw ratio of each codec on real training state (weights and Adam moments of
//!    the toy model trained on tinyshakespeare), and with the previous step as a delta base.
//!
//! Run: cargo build --release --workspace --bins && cargo bench -p lazarus-tests --bench store

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use lazarus_shared::codec::{self, Codec, CodecPolicy, DeltaBase};
use lazarus_shared::store::StoreOptions;
use lazarus_shared::ChunkHash;
use lazarus_tests::stats::{median, spread};
use lazarus_tests::toy::Toy;
use lazarus_tests::{bin, random_weight_bytes, shared_data, write_safetensors};

fn timed(run: impl FnOnce()) -> f64 {
    let started = Instant::now();
    run();
    started.elapsed().as_secs_f64()
}

fn ckptctl(store: &Path, args: &[&str]) {
    let status = Command::new(bin("ckptctl"))
        .arg("--store")
        .arg(format!("file://{}", store.join("store").display()))
        .arg("--index")
        .arg(store.join("index"))
        .args(args)
        .stdout(Stdio::null())
        .status()
        .expect("ckptctl runs");
    assert!(status.success(), "ckptctl {args:?} failed");
}

fn cp(from: &Path, to: &Path, fsync: bool) {
    assert!(Command::new("cp")
        .arg(from)
        .arg(to)
        .status()
        .expect("cp")
        .success());
    if fsync {
        std::fs::File::open(to)
            .and_then(|f| f.sync_all())
            .expect("fsync");
    }
    std::fs::remove_file(to).expect("rm");
}

/// The seconds of one round's operations, in [`OPERATIONS`] order.
const OPERATIONS: [&str; 5] = [
    "cp",
    "cp + fsync",
    "import (durable)",
    "export",
    "verify --read-data",
];

/// One round: the two baselines, then an import into a new store, its export and its audit.
fn round(dir: &Path, input: &Path, number: usize) -> [f64; 5] {
    let copy = dir.join("copy");
    let cp_plain = timed(|| cp(input, &copy, false));
    let cp_sync = timed(|| cp(input, &copy, true));
    let store = dir.join(format!("round-{number}"));
    let input = input.to_str().expect("utf-8 path");
    let import = timed(|| ckptctl(&store, &["import", "bench", "--step", "1", input]));
    let out = store.join("export");
    let out_arg = out.to_str().expect("utf-8 path");
    let export = timed(|| ckptctl(&store, &["export", "bench", "1", "--out", out_arg]));
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).expect("exported"),
        std::fs::read(input).expect("input"),
        "export must be byte-identical"
    );
    let verify = timed(|| ckptctl(&store, &["verify", "bench", "1", "--read-data"]));
    std::fs::remove_dir_all(&store).expect("remove the round's store");
    [cp_plain, cp_sync, import, export, verify]
}

fn throughput() {
    let env = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let megabytes = env("LAZARUS_BENCH_MB", 500);
    let rounds = env("LAZARUS_BENCH_ROUNDS", 5).max(1);
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
                random_weight_bytes(per_tensor, seed, 0.02),
            )
        })
        .collect();
    write_safetensors(&input, &tensors);
    drop(tensors);
    let mb = std::fs::metadata(&input).expect("input").len() as f64 / 1e6;
    println!(
        "throughput on {mb:.0} MB of f32 tensors (4 tensors, 4 MiB chunks, 2 cores), {rounds} rounds of: cp, cp + fsync, import into a new store, export, verify --read-data"
    );
    let mut seconds: Vec<[f64; 5]> = Vec::new();
    for number in 1..=rounds {
        let figures = round(dir.path(), &input, number);
        let line: Vec<String> = OPERATIONS
            .iter()
            .zip(figures)
            .map(|(name, s)| format!("{name} {s:.2}s"))
            .collect();
        println!("  round {number}: {}", line.join(", "));
        seconds.push(figures);
    }
    println!(
        "{:<20} {:>8} {:>8}  {:<62} vs cp",
        "operation", "median s", "MB/s", "vs cp + fsync, median of the rounds' ratios"
    );
    for (index, name) in OPERATIONS.iter().enumerate() {
        let column: Vec<f64> = seconds.iter().map(|round| round[index]).collect();
        let against = |baseline: usize| -> Vec<f64> {
            seconds
                .iter()
                .map(|round| round[baseline] / round[index])
                .collect()
        };
        println!(
            "{name:<20} {:>8.2} {:>8.0}  {:<62} {}",
            median(&column),
            mb / median(&column),
            spread(&against(1), "rounds"),
            spread(&against(0), "rounds"),
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
    // (column, codec, zstd level, with the previous step as delta base); the last column is
    // what the writer stores (`encode_best` at the store's default level).
    let columns: [(&str, Codec, i32, bool); 6] = [
        ("raw", Codec::Raw, 1, false),
        ("zstd-3", Codec::Zstd, 3, false),
        ("shuffle4+zstd-3", Codec::Shuffle4Zstd, 3, false),
        ("xor+shuffle4+zstd-3", Codec::XorShuffle4Zstd, 3, true),
        ("planes4-1", Codec::Planes4, 1, false),
        ("xor+planes4-1", Codec::XorPlanes4, 1, true),
    ];
    let mut header = format!("{:<6} {:<22}", "step", "tensor");
    for (name, ..) in &columns {
        header += &format!(" {name:>19}");
    }
    println!("{header} {:>19}", "writer's choice");
    for pair in snapshots.chunks(2) {
        let [(_, previous), (step, current)] = pair else {
            continue;
        };
        let mut totals = [0usize; 8];
        for (before, after) in previous.iter().zip(current) {
            let raw = &after.data;
            let hash = ChunkHash::of(raw);
            let base = DeltaBase {
                hash: ChunkHash::of(&before.data),
                depth: 0,
                raw: &before.data,
            };
            let mut sizes = vec![raw.len()];
            for (_, codec, level, delta) in columns {
                let base = delta.then_some(base);
                sizes.push(
                    codec::encode_with(raw, hash, codec, base, level)
                        .bytes
                        .len(),
                );
            }
            let policy = CodecPolicy {
                element_bytes: 4,
                zstd_level: StoreOptions::default().zstd_level,
                delta_depth_max: 8,
            };
            sizes.push(
                codec::encode_best(raw, hash, Some(base), policy)
                    .bytes
                    .len(),
            );
            print_ratios(&format!("{step:<6} {:<22}", after.name), &sizes);
            for (total, size) in totals.iter_mut().zip(&sizes) {
                *total += size;
            }
        }
        print_ratios(&format!("{step:<6} {:<22}", "ALL"), &totals);
    }
}

/// One row of stored/raw ratios: `sizes[0]` is the raw size.
fn print_ratios(label: &str, sizes: &[usize]) {
    let mut line = label.to_string();
    for size in &sizes[1..] {
        line += &format!(" {:>19.3}", *size as f64 / sizes[0] as f64);
    }
    println!("{line}");
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    throughput();
    codec_ratios();
}
