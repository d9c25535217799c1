//! Trainer benchmark: prints figures, with ratios against baselines measured in the same run.
//!
//! 1. This machine's f32 matmul peak (`trainer bench-peak`'s measurement), taken before each
//!    Lazarus run. The machine's noise only slows things down, and comes in spells of seconds
//!    (the peak has measured anywhere from 142 to 310 GFLOP/s within an hour on the 2-core
//!    development machine), so CPU-MFU is also given as the fastest step of all the runs
//!    against the highest peak: the least slowed measurement of each.
//! 2. The `tiny` preset (or LAZARUS_BENCH_PRESET) on LAZARUS_BENCH_THREADS (default 2) threads,
//!    fp32, on tinyshakespeare: tokens/s and CPU-MFU after warm-up steps, and where a step's
//!    time goes (forward, backward, optimizer), with the fused LM head + loss timed on its own.
//! 3. The same model in PyTorch (`ops/bench/olmoe_torch.py`: Hugging Face OlmoeForCausalLM,
//!    AdamW, clipping 1.0, same threads and batch), interleaved with ours: LAZARUS_BENCH_PAIRS
//!    (default 3) pairs of a Lazarus run then a PyTorch run, each pair's tokens/s ratio, and
//!    the median of the paired ratios with its spread (the machine drifts; a pair sees the
//!    same drift). Skipped with a message when torch or transformers is missing
//!    (`ops/setup.sh interop` installs them; LAZARUS_PYTHON picks another interpreter).
//! 4. A profile of one step by phase and op, from the Chrome trace `trainer train --trace`
//!    writes (kept under target/bench-traces to open in Perfetto): one process, then two
//!    ranks under mpiexec with the experts split over them (the exchange and the MPI waits).
//!
//! Run: cargo bench -p lazarus-tests --bench trainer

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use lazarus_tests::stats::{median, range, spread};
use lazarus_tests::{bin, shared_data};
use lazarus_trainer::config::Config;
use lazarus_trainer::data::{self, Dataset, Sampler};
use lazarus_trainer::loss::LinearCrossEntropy;
use lazarus_trainer::model::{training_flops_per_token, Model};
use lazarus_trainer::optim::AdamW;
use lazarus_trainer::train::bench_peak;

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

/// One run's figures over its measured steps.
struct Timing {
    /// Mean milliseconds of forward, backward and optimizer per step.
    forward: f64,
    backward: f64,
    optimizer: f64,
    tokens_per_second: f64,
    /// Milliseconds of the fastest step: the machine's noise only ever slows a step down.
    fastest: f64,
}

/// [`Timing`] over `steps` after `warmup` steps.
fn time_training(config: &Config, dataset: &Dataset, warmup: usize, steps: usize) -> Timing {
    assert!(steps > 0, "at least one measured step");
    let model = Model::new(&config.model, config.run.seed, DType::F32).expect("model");
    let world = std::sync::Arc::new(lazarus_trainer::dist::World::single());
    let mut optim = AdamW::new(&model, &config.train, world).expect("optimizer");
    let mut sampler =
        Sampler::new(&dataset.train, config.model.seq_len, config.run.seed).expect("sampler");
    let batch = config.train.micro_batch;
    let mut phases = [0f64; 3];
    let mut fastest = f64::INFINITY;
    let mut started = Instant::now();
    for step in 0..warmup + steps {
        if step == warmup {
            phases = [0.0; 3];
            started = Instant::now();
        }
        let stepping = Instant::now();
        let tokens: Vec<u32> = (0..batch)
            .flat_map(|i| sampler.sample(&dataset.train, (step * batch + i) as u64))
            .collect();
        let timer = Instant::now();
        let forward = model.forward(&tokens, batch).expect("forward");
        phases[0] += timer.elapsed().as_secs_f64();
        let timer = Instant::now();
        let grads = model.backward(&forward.loss).expect("backward");
        phases[1] += timer.elapsed().as_secs_f64();
        let timer = Instant::now();
        optim
            .update(
                &model,
                &grads,
                1e-3,
                &lazarus_trainer::snapshot::HeldSlots::default(),
            )
            .expect("update");
        phases[2] += timer.elapsed().as_secs_f64();
        if step >= warmup {
            fastest = fastest.min(stepping.elapsed().as_secs_f64());
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let tokens = (steps * batch * config.model.seq_len) as f64;
    let per_step = |s: f64| 1000.0 * s / steps as f64;
    Timing {
        forward: per_step(phases[0]),
        backward: per_step(phases[1]),
        optimizer: per_step(phases[2]),
        tokens_per_second: tokens / elapsed,
        fastest: 1000.0 * fastest,
    }
}

/// Milliseconds of the fused LM head + cross-entropy alone (forward with gradients, and the
/// backward that hands them out), at the preset's batch shape.
fn time_loss(config: &Config, repeats: usize) -> f64 {
    let rows = config.train.micro_batch * config.model.seq_len;
    let (hidden, vocab) = (config.model.d_model, config.model.vocab_size);
    let x = candle_core::Var::from_tensor(
        &Tensor::randn(0f32, 1.0, (rows, hidden), &Device::Cpu).expect("x"),
    )
    .expect("var");
    let weight = candle_core::Var::from_tensor(
        &Tensor::randn(0f32, 0.02, (vocab, hidden), &Device::Cpu).expect("w"),
    )
    .expect("var");
    let targets: Vec<u32> = (0..rows).map(|i| (i * 7919 % vocab) as u32).collect();
    let targets = Tensor::new(targets.as_slice(), &Device::Cpu).expect("targets");
    let mut best = f64::INFINITY;
    for _ in 0..repeats + 1 {
        let timer = Instant::now();
        let loss = x
            .apply_op3(&weight, &targets, LinearCrossEntropy::training())
            .and_then(|l| l.mean_all())
            .expect("loss");
        loss.backward().expect("backward");
        best = best.min(timer.elapsed().as_secs_f64());
    }
    best * 1000.0
}

/// Figures from the PyTorch reference, or why it was skipped.
fn run_torch(
    config: &Config,
    model_json: &std::path::Path,
    threads: usize,
    warmup: usize,
    steps: usize,
) -> std::result::Result<serde_json::Value, String> {
    let python = lazarus_tests::python();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../ops/bench/olmoe_torch.py");
    let output = Command::new(&python)
        .arg(script)
        .arg("--model-json")
        .arg(model_json)
        .args(["--micro-batch", &config.train.micro_batch.to_string()])
        .args(["--threads", &threads.to_string()])
        .args([
            "--warmup",
            &warmup.to_string(),
            "--steps",
            &steps.to_string(),
        ])
        .output()
        .map_err(|error| format!("{python}: {error}"))?;
    if !output.status.success() {
        let why = String::from_utf8_lossy(&output.stderr);
        return Err(why.trim().lines().last().unwrap_or("failed").to_string());
    }
    let line = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(line.trim().lines().last().unwrap_or(""))
        .map_err(|error| format!("unreadable output: {error}"))
}

fn torch_line(figures: &serde_json::Value) -> String {
    let ms = |key: &str| figures[key].as_f64().unwrap_or(f64::NAN);
    format!(
        "{:.0} tok/s, step {:.0} ms = fwd {:.0} + bwd {:.0} + opt {:.0}",
        figures["tokens_per_second"].as_f64().unwrap_or(f64::NAN),
        ms("step_ms"),
        ms("forward_ms"),
        ms("backward_ms"),
        ms("optimizer_ms"),
    )
}

/// Traces `steps` steps of the preset with the trainer binary (`ranks` ranks under mpiexec
/// when more than one, with expert parallel over them) and prints rank 0's last traced step.
fn traced_profile(preset: &str, threads: usize, ranks: usize, data: &Path, out: &Path) {
    let trace = out.join(format!("trace-{preset}-{ranks}rank.json"));
    let metrics = tempfile::tempdir().expect("tempdir");
    let mut command = if ranks > 1 {
        let mut command = Command::new("mpiexec");
        command.args(["-n", &ranks.to_string()]).arg(bin("trainer"));
        command
    } else {
        Command::new(bin("trainer"))
    };
    command
        .args(["train", "--config", preset, "--trace"])
        .arg(&trace)
        .args(["--trace-steps", "3", "--metrics-dir"])
        .arg(metrics.path())
        .args(["--set", &format!("data.path={}", data.display())])
        .args([
            "--set",
            "train.steps=3",
            "--set",
            "checkpoint.every=1000000",
        ])
        .args([
            "--set",
            &format!(
                "checkpoint.store=file://{}",
                metrics.path().join("store").display()
            ),
        ])
        .args(["--set", &format!("train.threads={threads}")])
        .args(["--set", &format!("parallel.ep={ranks}")])
        .args(["--set", "run.id=bench-trace"]);
    match command.output() {
        Ok(output) if output.status.success() => {}
        Ok(output) => {
            println!(
                "  trace with {ranks} rank(s) failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            );
            return;
        }
        Err(error) => {
            println!("  trace with {ranks} rank(s) not run: {error}");
            return;
        }
    }
    let file = lazarus_trainer::trace::file_for(&trace, 0, ranks);
    match lazarus_trainer::trace::profile(&file, None) {
        Ok(profile) => {
            println!(
                "  rank 0 of {ranks}, {threads} thread(s) each; the trace: {}",
                file.display()
            );
            for line in profile.to_string().lines() {
                println!("  {line}");
            }
        }
        Err(error) => println!("  {error:#}"),
    }
}

fn main() {
    // As the trainer does: the in-process timings run on the heap the trainer runs on.
    lazarus_trainer::memory::keep_freed_memory();
    let preset = env_or("LAZARUS_BENCH_PRESET", "tiny");
    let threads: usize = env_or("LAZARUS_BENCH_THREADS", "2")
        .parse()
        .expect("threads");
    let warmup: usize = env_or("LAZARUS_BENCH_WARMUP", "2").parse().expect("warmup");
    let steps: usize = env_or("LAZARUS_BENCH_STEPS", "5").parse().expect("steps");
    let pairs: usize = env_or("LAZARUS_BENCH_PAIRS", "3").parse().expect("pairs");
    // The math's threads as the trainer sets them up.
    lazarus_trainer::cli::use_math_threads(threads);

    let dir = tempfile::tempdir().expect("tempdir");
    let data_dir = dir.path().join("data");
    data::prepare(
        &[shared_data("tinyshakespeare.txt")],
        &data_dir,
        "gpt2",
        0.01,
        &(),
    )
    .expect("prepare tinyshakespeare");
    let dataset = Dataset::open(&data_dir).expect("dataset");
    let config = Config::load(&preset, &[]).expect("preset");
    let model_json = dir.path().join("model.json");
    std::fs::write(
        &model_json,
        serde_json::to_vec(&config.model).expect("json"),
    )
    .expect("write");

    println!("trainer benchmark: preset {preset}, {threads} threads, fp32, {warmup} warm-up + {steps} measured steps per run, {pairs} interleaved pairs (Lazarus, then PyTorch)");
    let flops_per_token = training_flops_per_token(&config.model);
    let mut ours = Vec::new();
    let mut peaks = Vec::new();
    let mut fastest = f64::INFINITY;
    let mut ratios = Vec::new();
    let mut torch_skipped = None;
    for pair in 1..=pairs {
        let peak = bench_peak(2048).expect("peak");
        peaks.push(peak);
        let run = time_training(&config, &dataset, warmup, steps);
        ours.push(run.tokens_per_second);
        fastest = fastest.min(run.fastest);
        let mine = format!(
            "{:.0} tok/s, step {:.0} ms = fwd {:.0} + bwd {:.0} + opt {:.0}, fastest {:.0} ms (peak {peak:.1} GFLOP/s just before)",
            run.tokens_per_second,
            run.forward + run.backward + run.optimizer,
            run.forward,
            run.backward,
            run.optimizer,
            run.fastest,
        );
        if torch_skipped.is_some() {
            println!("  pair {pair}: lazarus {mine}");
            continue;
        }
        match run_torch(&config, &model_json, threads, warmup, steps) {
            Ok(theirs) => {
                let ratio = run.tokens_per_second
                    / theirs["tokens_per_second"].as_f64().unwrap_or(f64::NAN);
                ratios.push(ratio);
                println!(
                    "  pair {pair}: lazarus {mine}\n          pytorch {} -> ratio {ratio:.2}x",
                    torch_line(&theirs)
                );
            }
            Err(why) => {
                println!("  pair {pair}: lazarus {mine}; pytorch skipped ({why})");
                torch_skipped = Some(why);
            }
        }
    }
    let tokens_per_second = median(&ours);
    let flops = flops_per_token * tokens_per_second;
    let (low_peak, peak) = range(&peaks);
    let step_flops = flops_per_token * (config.train.micro_batch * config.model.seq_len) as f64;
    println!("lazarus (candle), median of {pairs} runs:");
    println!(
        "  tokens/s {tokens_per_second:.0}, model {:.1} GFLOP/s, CPU-MFU {:.1}% of the highest peak",
        flops / 1e9,
        100.0 * flops / (peak * 1e9),
    );
    println!(
        "  CPU-MFU of the quiet machine {:.1}%: the fastest step ({fastest:.0} ms) against the highest peak ({peak:.1} GFLOP/s; {low_peak:.1} the lowest), each the least slowed of all the runs",
        100.0 * step_flops / (fastest / 1000.0) / (peak * 1e9),
    );
    let loss_ms = time_loss(&config, 3);
    println!("  the fused LM head + loss alone (forward computes its gradients): {loss_ms:.0} ms");
    match torch_skipped {
        Some(why) => println!("pytorch: skipped ({why}); `ops/setup.sh interop` installs it"),
        None => println!(
            "ratio lazarus/pytorch tokens/s, median of paired ratios: {}",
            spread(&ratios, "pairs")
        ),
    }
    // Where a step's time goes, from the trace the trainer writes (`train --trace`).
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-traces");
    std::fs::create_dir_all(&out).expect("trace folder");
    println!("profile of one {preset} step by phase and op (train --trace; self = outside the spans inside it):");
    traced_profile(&preset, threads, 1, &data_dir, &out);
    if Command::new("mpiexec").arg("--version").output().is_ok() {
        println!("over MPI, the experts split over two ranks (the exchange and the waits):");
        traced_profile(&preset, 1, 2, &data_dir, &out);
    }
}
