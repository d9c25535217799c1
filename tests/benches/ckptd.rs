//! `ckptd` benchmark (two daemons on 127.0.0.1, two ranks under a real mpiexec): prints
//! figures with baselines measured in the same run.
//!
//! 1. The training loop's stall per snapshot at three state sizes (it should be flat), each
//!    snapshot's slowest rank, with the part of the largest stall that rank spent waiting for
//!    a CPU and the step it was at; against the trainer's synchronous in-process save of the same state, and against
//!    PyTorch DCP `async_save` of a state of the same bytes (skipped without torch). The run's
//!    last snapshot, which waits for a daemon still busy with the step before, in a column of
//!    its own ("last snap", ms), and how many of the run's snapshots the daemons took (the
//!    others were skipped while a daemon was busy with the one before).
//! 2. Stored/raw bytes over a 100-step run, against plain zstd (level 3) of every durable step.
//! 3. Upload MB/s of the two daemons' shards of the d512 run's last step (uploaded at once,
//!    as the ranks finish), with the bytes each wrote to the store, against two `dd`
//!    sequential writes (fsync) of as many bytes as the shard at once to the same file
//!    system, and against one alone, each run right after the upload: five rounds of a fresh
//!    run each, and the median of the rounds' ratios.
//! 4. Both daemons' CPU per durable upload: their CPU over row 3's uploads, per raw byte, and
//!    as a share of the cores.
//! 5. Peak RSS of a daemon against its node's snapshot bytes.
//!
//! Row 1 also prints the daemons' CPU seconds per snapshot over the run.
//!
//! Run: cargo build --release --workspace --bins && cargo bench -p lazarus-tests --bench ckptd

// A benchmark program: a panic with its message is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use lazarus_tests::cluster::{text_of, Cluster, Settings};
use lazarus_tests::stats::{median, range, spread};
use lazarus_tests::train::TrainerArgs;
use lazarus_tests::{bin, python, Ctl};

const STEPS: u64 = 10;

fn args(dir: &Path, run: &str, store: &str, d_model: usize, steps: u64, every: u64) -> Vec<String> {
    bench_args(dir, run, store, d_model, steps, every).build()
}

fn bench_args(
    dir: &Path,
    run: &str,
    store: &str,
    d_model: usize,
    steps: u64,
    every: u64,
) -> TrainerArgs {
    TrainerArgs::small(dir)
        .run(run)
        .set("model.d_model", d_model)
        .set("model.expert_ffn", 64)
        .steps(steps)
        .set("train.warmup_steps", 10)
        .set("checkpoint.every", every)
        .store(store)
}

/// A run's stall line: mean, median and max (ms), the max's CPU and answer waits, the state
/// bytes per rank, and the max's step.
type Stalls = (f64, f64, f64, (f64, f64), u64, u64);

/// The [`Stalls`] of the trainer's stall line (each checkpoint's slowest rank).
fn stall(text: &str) -> Stalls {
    let line = text
        .lines()
        .find(|l| l.starts_with("checkpoint stall"))
        .unwrap_or_else(|| panic!("no stall line in {text}"));
    let number_after = |key: &str| -> f64 {
        let rest = &line[line.find(key).unwrap() + key.len()..];
        rest.split_whitespace()
            .next()
            .unwrap()
            .trim_end_matches(',')
            .parse()
            .unwrap()
    };
    (
        number_after("mean "),
        number_after("median "),
        number_after("max "),
        (number_after("of it "), number_after("CPU and ")),
        number_after("state ") as u64,
        number_after("at step ") as u64,
    )
}

/// Milliseconds the run's last snapshot took (it waits for a busy daemon, so the trainer
/// does not count it among the stalls), if the stall line gives it.
fn last_snapshot_ms(text: &str) -> Option<f64> {
    let key = "busy with the step before, ";
    let line = text.lines().find(|l| l.starts_with("checkpoint stall"))?;
    let rest = &line[line.find(key)? + key.len()..];
    rest.split_whitespace().next()?.parse().ok()
}

/// Snapshots the daemons took of `steps`: a rank skips a snapshot while its daemon is busy,
/// and every rank skips the same ones.
fn taken(text: &str, steps: u64) -> u64 {
    steps
        - skipped(text, "ckptd: ", " snapshots skipped")
            .unwrap_or_else(|| panic!("no skipped-snapshots line in {text}"))
}

/// The count N of a run's `{prefix}N{what}` line, if it has one.
fn skipped(text: &str, prefix: &str, what: &str) -> Option<u64> {
    text.lines()
        .filter_map(|l| l.strip_prefix(prefix)?.split_once(what))
        .map(|(count, _)| count.trim().parse::<u64>().unwrap())
        .max()
}

/// CPU seconds (user and system) both of `cluster`'s daemons have used so far.
fn cluster_cpu_seconds(cluster: &Cluster) -> f64 {
    (0..2)
        .map(|node| cpu_seconds(cluster.pid(node).unwrap()))
        .sum()
}

/// CPU seconds (user and system) process `pid` has used so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command's closing parenthesis; utime and stime are the 14th and 15th.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..]
        .split_whitespace()
        .collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    static TICKS_PER_SECOND: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    ticks
        / TICKS_PER_SECOND.get_or_init(|| {
            let output = Command::new("getconf").arg("CLK_TCK").output().unwrap();
            text_of(&output).trim().parse().unwrap()
        })
}

/// Both daemons' CPU seconds so far, read every 5 ms on a thread of its own until stopped,
/// each with the time it was read.
struct CpuSamples {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(SystemTime, f64)>>,
}

impl CpuSamples {
    fn start(cluster: &Cluster) -> Self {
        let pids = [0, 1].map(|node| cluster.pid(node).unwrap());
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                samples.push((SystemTime::now(), pids.map(cpu_seconds).iter().sum()));
                std::thread::sleep(Duration::from_millis(5));
            }
            samples
        });
        Self { stop, thread }
    }

    fn stop(self) -> Vec<(SystemTime, f64)> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

/// The CPU seconds `samples` show used from `from` to `to`, between the last sample before
/// the one and the first after the other.
fn cpu_between(samples: &[(SystemTime, f64)], from: SystemTime, to: SystemTime) -> f64 {
    let before = samples.iter().rev().find(|(at, _)| *at <= from);
    let after = samples.iter().find(|(at, _)| *at >= to);
    after.unwrap_or_else(|| samples.last().unwrap()).1 - before.unwrap_or(&samples[0]).1
}

/// The upload of `step` in a daemon's log: when it started and ended (its "shard stored"
/// line's time less its seconds, and that time), and the bytes it wrote to the store.
fn upload_window(log: &str, step: u64) -> (SystemTime, SystemTime, u64) {
    let line = log
        .lines()
        .find(|l| l.contains("shard stored") && l.contains(&format!(" step={step} ")))
        .unwrap_or_else(|| panic!("no upload of step {step} in {log}"));
    let end = humantime::parse_rfc3339(line.split_whitespace().next().unwrap()).unwrap();
    let field = |name: &str| {
        line[line.find(name).unwrap() + name.len()..]
            .split_whitespace()
            .next()
            .unwrap()
    };
    let seconds: f64 = field(" seconds=").parse().unwrap();
    let uploaded: u64 = field(" uploaded=").parse().unwrap();
    (end - Duration::from_secs_f64(seconds), end, uploaded)
}

fn vm_hwm_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

/// Waits until the leader has committed `step` as durable, reading the daemons' metrics
/// (a scrape costs the cores far less than a `ckptctl list` would while they upload).
fn wait_for_durable(cluster: &Cluster, step: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let committed = || {
        (0..2)
            .any(|node| cluster.metric(node, "lazarus_ckptd_durable_committed_step") == step as f64)
    };
    while !committed() {
        assert!(
            Instant::now() < deadline,
            "step {step} was not committed as durable within 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The stall of the trainer's own save of every step (2 ranks, no daemon), written in the
/// foreground or in the background (`checkpoint.busy = skip`), and how many of the steps were
/// saved.
fn in_process(dir: &Path, d_model: usize, background: bool) -> (Stalls, u64) {
    let run = format!("in-process-{d_model}-{background}");
    let store = format!("file://{}", dir.join(&run).display());
    let output = Command::new("mpiexec")
        .args(["-n", "2"])
        .arg(bin("trainer"))
        .args(
            bench_args(dir, &run, &store, d_model, STEPS, 1)
                .set("checkpoint.background", background)
                .build(),
        )
        .output()
        .unwrap();
    let text = text_of(&output);
    assert!(output.status.success(), "{text}");
    // A run that skipped none says nothing of it.
    let skipped = skipped(&text, "in-process save: ", " checkpoints skipped").unwrap_or(0);
    (stall(&text), STEPS - skipped)
}

fn dcp_stall(bytes: u64, dir: &Path) -> Option<(f64, f64)> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/bench/dcp_async_save.py");
    let output = Command::new(python())
        .arg(script)
        .args(["--bytes", &bytes.to_string(), "--repeats", "5", "--out"])
        .arg(dir)
        .output()
        .ok()?;
    if !output.status.success() {
        eprintln!("DCP async_save skipped: {}", text_of(&output).trim());
        return None;
    }
    let value: serde_json::Value = serde_json::from_slice(&output.stdout).ok()?;
    Some((
        value["stall_ms_median"].as_f64()?,
        value["stall_ms_max"].as_f64()?,
    ))
}

/// Bytes per second of `streams` dd processes writing `bytes` each (in 4 MiB blocks) at once,
/// with fsync.
fn dd_rates(folder: &Path, streams: usize, bytes: u64) -> Vec<f64> {
    let count = bytes.div_ceil(4 << 20).max(1);
    let children: Vec<_> = (0..streams)
        .map(|stream| {
            let target = folder.join(format!("dd-{stream}.bin"));
            let child = Command::new("dd")
                .arg("if=/dev/zero")
                .arg(format!("of={}", target.display()))
                .args(["bs=4M", &format!("count={count}"), "conv=fsync"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            (child, target)
        })
        .collect();
    children
        .into_iter()
        .map(|(child, target)| {
            let output = child.wait_with_output().unwrap();
            let report = text_of(&output);
            assert!(output.status.success(), "{report}");
            let _ = std::fs::remove_file(&target);
            // dd's own time: "... copied, 0.31 s, 866 MB/s".
            let seconds: f64 = report
                .split(", ")
                .find_map(|part| part.strip_suffix(" s")?.parse().ok())
                .unwrap_or_else(|| panic!("no time in dd's report: {report}"));
            (count * (4 << 20)) as f64 / seconds
        })
        .collect()
}

/// Rounds of row 3, each a fresh run's upload followed by its dd baselines: this machine's
/// write rate swings by 2x from one second to the next, so each upload is measured against dd
/// run right after it, and the figure is the median of the rounds' ratios.
const UPLOAD_ROUNDS: usize = 5;

/// One upload of row 3: both daemons' raw bytes per second (their metric) and the bytes each
/// wrote to the store, the bytes of a rank's shard, where the store keeps its files, and both
/// daemons' CPU seconds from the first of their uploads' start to the last one's end, with the
/// seconds between.
struct Upload {
    rates: [f64; 2],
    written: [u64; 2],
    shard_bytes: u64,
    folder: std::path::PathBuf,
    cpu_seconds: f64,
    wall_seconds: f64,
}

/// Row 1's run at d_model 512 (a snapshot every step, steps 5 and 10 durable) on a fresh pair
/// of daemons, and the upload of its last step, which both daemons make at once as the ranks
/// exit (a profile showed their exit on up to half of both cores for the upload's first
/// 0.15 s of about 0.5), and nothing else on the cores after that.
fn upload_round(dir: &Path, round: usize) -> Upload {
    let run = format!("upload-{round}");
    let folder = dir.join(&run);
    let store = format!("file://{}", folder.display());
    let settings = Settings {
        durable_every_steps: 5,
        ..Settings::default()
    };
    let cluster = Cluster::start(dir, &run, &store, 2, &settings, Vec::new());
    // The nodes' log files go on from the earlier runs in `dir`: only what follows is this
    // run's.
    let earlier: Vec<usize> = (0..2).map(|node| cluster.log(node).len()).collect();
    let samples = CpuSamples::start(&cluster);
    let text = cluster.train(&args(dir, &run, &store, 512, STEPS, 1));
    wait_for_durable(&cluster, STEPS);
    let samples = samples.stop();
    // The daemons do nothing else meanwhile: the step's memory commit, which the uploads
    // wait for, came after both had replicated it.
    let windows = [0, 1].map(|node| upload_window(&cluster.log(node)[earlier[node]..], STEPS));
    let (from, to) = (
        windows.iter().map(|w| w.0).min().unwrap(),
        windows.iter().map(|w| w.1).max().unwrap(),
    );
    Upload {
        rates: [0, 1].map(|node| cluster.metric(node, "lazarus_ckptd_upload_bytes_per_second")),
        written: windows.map(|w| w.2),
        shard_bytes: stall(&text).4,
        folder,
        cpu_seconds: cpu_between(&samples, from, to),
        wall_seconds: to.duration_since(from).unwrap().as_secs_f64(),
    }
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    lazarus_tests::train::prepare_data(dir);

    println!("1. training-loop stall per snapshot (2 ranks, 1 per node; {STEPS} steps, one snapshot per step; the last, which waits for a busy daemon, in its own column)");
    println!(
        "{:>8} {:>14} {:>46} {:>10} {:>6} {:>26} {:>34} {:>20} {:>10} {:>16} {:>16}",
        "d_model",
        "state/rank",
        "ckptd mean/median/max (CPU/answer wait) @step",
        "last snap",
        "taken",
        "in-process mean/median/max",
        "in-process background (taken)",
        "DCP async median/max",
        "in-proc/ckptd",
        "ckptd peak RSS",
        "ckptd CPU/snap"
    );
    let mut memory = Vec::new();
    for d_model in [32usize, 128, 512] {
        // The trainer's own save through the store library, synchronous and in the
        // background.
        let sync = in_process(dir, d_model, false).0;
        let (background, background_taken) = in_process(dir, d_model, true);

        let store = format!("file://{}", dir.join(format!("ckptd-{d_model}")).display());
        let run = format!("ckptd-{d_model}");
        let settings = Settings {
            durable_every_steps: 5,
            ..Settings::default()
        };
        let cluster = Cluster::start(dir, &run, &store, 2, &settings, Vec::new());
        let text = cluster.train(&args(dir, &run, &store, d_model, STEPS, 1));
        let ours = stall(&text);
        // The run's last step is uploaded once the ranks are done: both daemons at once,
        // nothing else on the cores (the DCP run below waits for it).
        wait_for_durable(&cluster, STEPS);
        // Both daemons' CPU over the run, per snapshot (the hashing, sending and receiving of
        // its replica, and the uploads of its durable steps, the last one included).
        let cpu = cluster_cpu_seconds(&cluster) / (2 * STEPS) as f64;
        let dcp = dcp_stall(ours.4, &dir.join(format!("dcp-{d_model}")));
        let rss = vm_hwm_bytes(cluster.pid(0).unwrap());
        memory.push((ours.4, rss));
        println!(
            "{:>8} {:>11.1} MB {:>46} {:>10} {:>6} {:>26} {:>34} {:>20} {:>9.0}x {:>13.1} MB {:>13.3} s",
            d_model,
            ours.4 as f64 / 1e6,
            format!(
                "{:.2} / {:.2} / {:.2} ({:.1}/{:.1}) @{}",
                ours.0, ours.1, ours.2, ours.3 .0, ours.3 .1, ours.5
            ),
            last_snapshot_ms(&text).map_or("-".into(), |ms| format!("{ms:.1}")),
            format!("{}/{STEPS}", taken(&text, STEPS)),
            format!("{:.1} / {:.1} / {:.1}", sync.0, sync.1, sync.2),
            format!(
                "{:.1} / {:.1} / {:.1} ({background_taken}/{STEPS})",
                background.0, background.1, background.2
            ),
            dcp.map_or("skipped".into(), |(m, x)| format!("{m:.1} / {x:.1}")),
            sync.1 / ours.1.max(1e-6),
            rss as f64 / 1e6,
            cpu
        );
    }

    println!();
    println!("2. stored/raw over a 100-step run (d_model 32, 2 ranks, durable every 10 steps)");
    let store = format!("file://{}", dir.join("ratio").display());
    let settings = Settings {
        durable_every_steps: 10,
        ..Settings::default()
    };
    let cluster = Cluster::start(dir, "ratio", &store, 2, &settings, Vec::new());
    let wait_args = bench_args(dir, "ratio", &store, 32, 100, 1)
        .set("checkpoint.busy", "wait")
        .build();
    cluster.train(&wait_args);
    drop(cluster);
    let ctl = Ctl::new(store.clone(), &dir.join("index"));
    let listed = ctl.json(&["list", "ratio"]);
    let (mut raw, mut stored, mut zstd_bytes, mut steps) = (0u64, 0u64, 0u64, 0);
    for step in listed["steps"].as_array().unwrap() {
        if step["state"] != "committed" {
            continue;
        }
        steps += 1;
        raw += step["raw_bytes"].as_u64().unwrap();
        stored += step["uploaded_bytes"].as_u64().unwrap();
        let n = step["step"]["step"].as_u64().unwrap();
        let out = dir.join(format!("export-{n}"));
        ctl.expect(
            0,
            &[
                "export",
                "ratio",
                &n.to_string(),
                "--out",
                out.to_str().unwrap(),
            ],
        );
        for file in lazarus_tests::files_under(&out) {
            let bytes = std::fs::read(&file).unwrap();
            for chunk in bytes.chunks(4 << 20) {
                zstd_bytes += zstd::bulk::compress(chunk, 3).unwrap().len() as u64;
            }
        }
    }
    println!(
        "{steps} durable steps, {:.1} MB raw: ckptd stored {:.1} MB ({:.3} of raw), plain zstd -3 {:.1} MB ({:.3} of raw); ckptd/zstd {:.2}",
        raw as f64 / 1e6,
        stored as f64 / 1e6,
        stored as f64 / raw as f64,
        zstd_bytes as f64 / 1e6,
        zstd_bytes as f64 / raw as f64,
        stored as f64 / zstd_bytes as f64
    );

    println!();
    println!(
        "3. upload rate of the last durable step of the d_model 512 run of row 1 (uploaded as the ranks finish), with the bytes each daemon wrote, against dd to the same file system, in {UPLOAD_ROUNDS} rounds of a fresh run each, then dd two at once and one alone"
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (mut paired, mut against_alone) = (Vec::new(), Vec::new());
    let (mut cpu_per_byte, mut core_share, mut shard_bytes) = (Vec::new(), Vec::new(), 0);
    for round in 0..UPLOAD_ROUNDS {
        let upload = upload_round(dir, round);
        let pair = dd_rates(&upload.folder, 2, upload.shard_bytes);
        let alone = dd_rates(&upload.folder, 1, upload.shard_bytes)[0];
        let (ours, dd) = (
            upload.rates.iter().sum::<f64>() / 2.0,
            pair.iter().sum::<f64>() / 2.0,
        );
        let per_byte = upload.cpu_seconds * 1e9 / (2 * upload.shard_bytes) as f64;
        let share = upload.cpu_seconds / (cores as f64 * upload.wall_seconds);
        println!(
            "round {round}: ckptd {:.0} and {:.0} MB/s raw (writing {:.1} and {:.1} MB); dd two at once {:.0} and {:.0} MB/s, one alone {:.0}; ckptd/dd {:.2}, both daemons against one dd alone {:.2}; over their uploads the daemons used {:.0}% of the {cores} cores ({:.2} s of CPU in {:.2} s, {:.2} ns per raw byte)",
            upload.rates[0] / 1e6,
            upload.rates[1] / 1e6,
            upload.written[0] as f64 / 1e6,
            upload.written[1] as f64 / 1e6,
            pair[0] / 1e6,
            pair[1] / 1e6,
            alone / 1e6,
            ours / dd,
            2.0 * ours / alone,
            100.0 * share,
            upload.cpu_seconds,
            upload.wall_seconds,
            per_byte
        );
        paired.push(ours / dd);
        against_alone.push(2.0 * ours / alone);
        cpu_per_byte.push(per_byte);
        core_share.push(share);
        shard_bytes = upload.shard_bytes;
    }
    println!(
        "each daemon uploading its rank's shard ({:.1} MB; hash + shuffle/delta + zstd + fsync'd puts) against each of two dd with fsync of as many bytes at once, the median of the rounds' ratios: {}",
        shard_bytes as f64 / 1e6,
        spread(&paired, "rounds")
    );
    println!(
        "both daemons together against one dd alone: {}",
        spread(&against_alone, "rounds")
    );

    println!();
    println!("4. both daemons' CPU per durable upload: in each round of row 3, their CPU from the first of their uploads' start to the last one's end (by their logs), read every 5 ms");
    let (low, high) = range(&cpu_per_byte);
    let (share_low, share_high) = range(&core_share);
    println!(
        "median {:.2} ns per raw byte (range {low:.2}-{high:.2}); {:.0}% of the {cores} cores (range {:.0}-{:.0}%)",
        median(&cpu_per_byte),
        100.0 * median(&core_share),
        100.0 * share_low,
        100.0 * share_high
    );

    println!();
    println!("5. daemon peak RSS (node 1) against its snapshot bytes; slots, replicas and the delta base live in shm files, outside RSS");
    for (bytes, rss) in memory {
        println!(
            "snapshot {:>7.1} MB: peak RSS {:>6.1} MB = {:.2}x (limit 1.3x + a fixed overhead)",
            bytes as f64 / 1e6,
            rss as f64 / 1e6,
            rss as f64 / bytes as f64
        );
    }
}
