//! Trainer benchmark: prints figures, with ratios against baselines measured in the same run.
//!
//! 1. This machine's f32 matmul peak (`trainer bench-peak`'s measurement).
//! 2. The `tiny` preset (or LAZARUS_BENCH_PRESET) on LAZARUS_BENCH_THREADS (default 2) threads,
//!    fp32, on tinyshakespeare: tokens/s and CPU-MFU after warm-up steps, and where a step's
//!    time goes (forward, backward, optimizer), with the fused LM head + loss timed on its own.
//! 3. The same model in PyTorch (`ops/bench/olmoe_torch.py`: Hugging Face OlmoeForCausalLM,
//!    AdamW, clipping 1.0, same threads and batch), and the ratio. Skipped with a message when
//!    torch or transformers is missing (`ops/setup.sh interop` installs them; LAZARUS_PYTHON
//!    picks another interpreter).
//!
//! Run: cargo bench -p lazarus-tests --bench trainer

use std::process::Command;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use lazarus_tests::shared_data;
use lazarus_trainer::config::Config;
use lazarus_trainer::data::{self, Dataset, Sampler};
use lazarus_trainer::loss::LinearCrossEntropy;
use lazarus_trainer::model::{training_flops_per_token, Model};
use lazarus_trainer::optim::AdamW;
use lazarus_trainer::train::bench_peak;

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

/// Mean milliseconds of forward, backward and optimizer per step, and tokens/s, over `steps`
/// after `warmup` steps.
fn time_training(config: &Config, dataset: &Dataset, warmup: usize, steps: usize) -> [f64; 4] {
    let model = Model::new(&config.model, config.run.seed, DType::F32).expect("model");
    let world = std::sync::Arc::new(lazarus_trainer::dist::World::single());
    let mut optim = AdamW::new(&model, &config.train, world).expect("optimizer");
    let mut sampler =
        Sampler::new(&dataset.train, config.model.seq_len, config.run.seed).expect("sampler");
    let batch = config.train.micro_batch;
    let mut phases = [0f64; 3];
    let mut started = Instant::now();
    for step in 0..warmup + steps {
        if step == warmup {
            phases = [0.0; 3];
            started = Instant::now();
        }
        let tokens: Vec<u32> = (0..batch)
            .flat_map(|i| sampler.sample(&dataset.train, (step * batch + i) as u64))
            .collect();
        let timer = Instant::now();
        let forward = model.forward(&tokens, batch).expect("forward");
        phases[0] += timer.elapsed().as_secs_f64();
        let timer = Instant::now();
        let grads = forward.loss.backward().expect("backward");
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
    }
    let elapsed = started.elapsed().as_secs_f64();
    let tokens = (steps * batch * config.model.seq_len) as f64;
    let per_step = |s: f64| 1000.0 * s / steps as f64;
    [
        per_step(phases[0]),
        per_step(phases[1]),
        per_step(phases[2]),
        tokens / elapsed,
    ]
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

fn print_torch(label: &str, figures: &serde_json::Value) -> f64 {
    let theirs = figures["tokens_per_second"].as_f64().unwrap_or(f64::NAN);
    let ms = |key: &str| figures[key].as_f64().unwrap_or(f64::NAN);
    println!(
        "  {label}: tokens/s {theirs:.0}; step {:.0} ms = forward {:.0} + backward {:.0} + optimizer {:.0}",
        ms("step_ms"),
        ms("forward_ms"),
        ms("backward_ms"),
        ms("optimizer_ms"),
    );
    theirs
}

fn main() {
    let preset = env_or("LAZARUS_BENCH_PRESET", "tiny");
    let threads: usize = env_or("LAZARUS_BENCH_THREADS", "2")
        .parse()
        .expect("threads");
    let warmup: usize = env_or("LAZARUS_BENCH_WARMUP", "2").parse().expect("warmup");
    let steps: usize = env_or("LAZARUS_BENCH_STEPS", "5").parse().expect("steps");
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .expect("thread pool");
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());

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

    // PyTorch runs before and after ours (the machine drifts); the ratio is against the mean.
    let model_json = dir.path().join("model.json");
    std::fs::write(
        &model_json,
        serde_json::to_vec(&config.model).expect("json"),
    )
    .expect("write");
    let torch_before = run_torch(&config, &model_json, threads, warmup, steps);

    println!("trainer benchmark: preset {preset}, {threads} threads, fp32, {warmup} warm-up + {steps} measured steps");
    let peak = bench_peak(2048).expect("peak");
    println!("  f32 matmul peak (2048^3): {peak:.1} GFLOP/s");
    let [forward, backward, optimizer, tokens_per_second] =
        time_training(&config, &dataset, warmup, steps);
    let loss_ms = time_loss(&config, 3);
    let flops = training_flops_per_token(&config.model) * tokens_per_second;
    let step_ms = forward + backward + optimizer;
    println!("lazarus (candle):");
    println!(
        "  tokens/s {tokens_per_second:.0}, model {:.1} GFLOP/s, CPU-MFU {:.1}%",
        flops / 1e9,
        100.0 * flops / (peak * 1e9)
    );
    println!("  step {step_ms:.0} ms = forward {forward:.0} + backward {backward:.0} + optimizer {optimizer:.0}");
    println!("  of which the fused LM head + loss (forward computes its gradients): {loss_ms:.0} ms ({:.0}% of the step)", 100.0 * loss_ms / step_ms);

    match torch_before {
        Err(why) => println!("pytorch: skipped ({why})"),
        Ok(before) => {
            println!(
                "pytorch ({}), run before and after ours:",
                before["implementation"].as_str().unwrap_or("?")
            );
            let mut runs = vec![print_torch("before", &before)];
            match run_torch(&config, &model_json, threads, warmup, steps) {
                Ok(after) => runs.push(print_torch("after", &after)),
                Err(why) => println!("  after: failed ({why})"),
            }
            let theirs = runs.iter().sum::<f64>() / runs.len() as f64;
            println!(
                "ratio lazarus/pytorch tokens/s: {:.2}x",
                tokens_per_second / theirs
            );
        }
    }
}
