//! The `trainer` command line. Exit codes: 0 ok, 1 failure, 2 usage or bad input.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::config::{Config, ConfigError};
use crate::data::{self, DataError, PrepareProgress};
use crate::dist::World;
use crate::layout::Layout;

#[derive(Debug, Parser)]
#[command(
    name = "trainer",
    version,
    about = "Prepare data for and train Mixture-of-Experts language models"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Tokenize text, .jsonl or .jsonl.zst files (or folders of them) into token files.
    Prepare {
        #[arg(long = "input", required = true, num_args = 1..)]
        inputs: Vec<PathBuf>,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "gpt2")]
        tokenizer: String,
        /// Share of the token stream held out for validation (taken from the end).
        #[arg(long, default_value_t = 0.01)]
        val_fraction: f64,
    },
    /// Measure this machine's f32 matmul peak (GFLOP/s), which training divides by for CPU-MFU.
    BenchPeak {
        /// Square matrix size.
        #[arg(long, default_value_t = 2048)]
        size: usize,
        /// CPU threads (0: one per physical core).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Where the result is saved (`peak.json`); training reads it from its --metrics-dir.
        #[arg(long, default_value = "lazarus-runs")]
        out_dir: PathBuf,
    },
    /// Measure plain MPI all-to-all throughput between the ranks (run under mpiexec), the
    /// baseline for the trainer's expert exchange.
    BenchAllToAll {
        /// Bytes each rank sends to each other rank per call.
        #[arg(long, default_value_t = 1 << 20)]
        bytes: usize,
        #[arg(long, default_value_t = 20)]
        repeats: usize,
    },
    /// Train a model: --config is a preset name (tiny, small) or a TOML file.
    Train {
        #[arg(long)]
        config: String,
        /// Override a setting: --set section.key=value (repeatable).
        #[arg(long = "set")]
        overrides: Vec<String>,
        /// `auto` continues from the run's latest committed step; `never` refuses to touch a
        /// run that has checkpoints. Overrides checkpoint.resume.
        #[arg(long)]
        resume: Option<String>,
        /// Where `<run id>/metrics.jsonl` is written.
        #[arg(long, default_value = "lazarus-runs")]
        metrics_dir: PathBuf,
        /// Skip this many global batches of data right after the step this start resumes
        /// (recorded in the checkpoints): for a manual restart past data that made the loss
        /// spike. Once: not for a supervisor's trainer arguments, which it would repeat.
        #[arg(long, default_value_t = 0)]
        skip_batches: u64,
        /// Write a timeline of the first --trace-steps steps of this launch as a Chrome
        /// trace (open it in Perfetto or chrome://tracing): FILE itself with one rank, else
        /// one file per rank (`trace.json` -> `trace.rank1.json`). `trainer trace-summary`
        /// prints a step of it by phase and op.
        #[arg(long, value_name = "FILE")]
        trace: Option<PathBuf>,
        #[arg(long, default_value_t = 5, requires = "trace")]
        trace_steps: u64,
    },
    /// Print one step of a `train --trace` file by phase and op: calls, total and own time.
    /// Given every rank's file of one world, also how that step's waits inside MPI split, op
    /// by op, between waiting together (the transfer) and waiting for other ranks (imbalance).
    TraceSummary {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// The step (default: the last one traced).
        #[arg(long)]
        step: Option<u64>,
    },
}

struct Bar(ProgressBar);

impl PrepareProgress for Bar {
    fn set_total(&self, bytes: u64) {
        self.0.set_length(bytes);
    }

    fn advance(&self, bytes: u64) {
        self.0.inc(bytes);
    }
}

/// The exit code an error chain deserves.
fn exit_code(error: &anyhow::Error) -> u8 {
    let bad_input = error.chain().any(|cause| {
        cause.is::<ConfigError>()
            || cause.is::<crate::train::RefusedRun>()
            || matches!(cause.downcast_ref::<DataError>(), Some(e) if !matches!(e, DataError::Io { .. }))
            || matches!(cause.downcast_ref::<DataError>(), Some(DataError::Io { cause, .. }) if cause.kind() == std::io::ErrorKind::NotFound)
    });
    if bad_input {
        2
    } else {
        1
    }
}

/// Sets up the math's threads, before anything starts a pool: `threads` workers (0: candle's
/// default) in one rayon pool whose first worker is this thread, the one that trains (and
/// the only one that calls MPI). An op it starts then runs here and on the other workers,
/// instead of being handed to the pool while this thread sleeps until it is done; with one
/// thread per rank, every op runs here and no thread is woken at all. On cores that ranks and
/// a daemon share, each wake-up can be a wait to be scheduled. A pool already built is kept.
///
/// candle runs its element-wise ops of 64Ki elements and more on a second pool of its own
/// (`threads - 1` more threads), whose workers spin after each op before they sleep: while
/// the math pool runs the next matrix product on every core, they take cores from it. Those
/// ops (residual adds, gradient sums) are small and memory-bound, so they run on this thread
/// alone (`CANDLE_NUM_THREADS=1`) unless the environment says otherwise. In a profile of
/// `tiny` on 2 threads and 2 cores, the spinning was 7% of the CPU samples; tokens/s moved
/// less than the noise between runs, there and with 2 ranks of 8 threads on 16 cores.
pub fn use_math_threads(threads: usize) {
    if threads > 0 {
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    let _ = rayon::ThreadPoolBuilder::new()
        .use_current_thread()
        .build_global();
}

pub fn main(cli: Cli) -> ExitCode {
    crate::memory::keep_freed_memory();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("trainer: error: {error:#}");
            ExitCode::from(exit_code(&error))
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Prepare {
            inputs,
            out,
            tokenizer,
            val_fraction,
        } => {
            let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "{msg:>10} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            bar.set_message("tokenize");
            let started = Instant::now();
            let index = data::prepare(&inputs, &out, &tokenizer, val_fraction, &Bar(bar.clone()))?;
            bar.finish_and_clear();
            let bytes: u64 = index.sources.iter().map(|s| s.bytes).sum();
            println!(
                "prepared {} document(s) from {} file(s), {:.1} MB of text, in {:.1}s: {} train and {} validation tokens ({} tokenizer) in {}",
                index.documents,
                index.sources.len(),
                bytes as f64 / 1e6,
                started.elapsed().as_secs_f64(),
                index.train.tokens,
                index.val.tokens,
                index.tokenizer,
                out.display()
            );
            Ok(())
        }
        Command::TraceSummary { files, step } => {
            let mut text = String::new();
            for file in &files {
                let profile = crate::trace::profile(file, step)?;
                if files.len() > 1 {
                    text += &format!("{}: ", file.display());
                }
                text += &profile.to_string();
            }
            if files.len() > 1 {
                let splits = crate::trace::wait_split(&files, step)?;
                text += &crate::trace::wait_split_table(&splits, files.len());
            }
            // A reader that stops early (`| head`) is no error.
            match write!(std::io::stdout().lock(), "{text}") {
                Err(error) if error.kind() != std::io::ErrorKind::BrokenPipe => Err(error.into()),
                _ => Ok(()),
            }
        }
        Command::BenchAllToAll { bytes, repeats } => {
            let world = World::init(|ranks| {
                Ok::<_, std::convert::Infallible>(Layout::data_parallel(ranks))
            })?;
            let (moved, seconds) =
                world.bench_all_to_all(crate::dist::Group::World, bytes, repeats);
            if world.rank == 0 {
                println!(
                    "MPI all-to-all, {} ranks, {bytes} bytes per peer: {:.1} MB to and from other ranks in {seconds:.3} s ({:.0} MB/s)",
                    world.size,
                    moved as f64 / 1e6,
                    moved as f64 / 1e6 / seconds.max(1e-9)
                );
            }
            Ok(())
        }
        Command::BenchPeak {
            size,
            threads,
            out_dir,
        } => {
            use_math_threads(threads);
            let peak = crate::train::bench_peak(size)?;
            std::fs::create_dir_all(&out_dir)?;
            let path = out_dir.join("peak.json");
            let threads = candle_core::utils::get_num_threads();
            let record = serde_json::json!({ "gflops": peak, "size": size, "threads": threads });
            std::fs::write(&path, serde_json::to_vec_pretty(&record)?)?;
            println!("f32 matmul peak: {peak:.1} GFLOP/s ({size}x{size}, {threads} threads); saved to {}", path.display());
            Ok(())
        }
        Command::Train {
            config,
            mut overrides,
            resume,
            metrics_dir,
            skip_batches,
            trace,
            trace_steps,
        } => {
            if let Some(resume) = resume {
                overrides.push(format!("checkpoint.resume={resume}"));
            }
            let config = Config::load(&config, &overrides)?;
            use_math_threads(config.train.threads);
            let world = Arc::new(World::init(|ranks| {
                config.layout(ranks).and_then(Layout::built)
            })?);
            let mut trace = match &trace {
                Some(path) => Some(crate::trace::start(
                    path,
                    world.rank,
                    world.size,
                    trace_steps,
                )?),
                None => None,
            };
            let stop = Arc::new(AtomicBool::new(false));
            watch_signals(stop.clone());
            // A panic is an error like any other here: unwinding past this point would drop
            // the world into MPI_Finalize, which waits for ranks that wait in a collective
            // for this one, forever (the hook has printed the message and backtrace).
            let trained = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                crate::train::train(
                    &config,
                    world.clone(),
                    stop,
                    &metrics_dir,
                    skip_batches,
                    &mut std::io::stdout(),
                )
            }))
            .unwrap_or_else(|panic| Err(anyhow::anyhow!("panicked: {}", panic_message(&panic))));
            match trained {
                Ok(summary) => {
                    if world.rank == 0 {
                        print_summary(&summary);
                    }
                    Ok(())
                }
                Err(error) if world.size > 1 => {
                    // The other ranks would wait for this one forever: end the whole job.
                    // One write, so another rank's abort cannot cut the line short.
                    let line = format!(
                        "trainer: rank {} of {}: error: {error:#}\n",
                        world.rank, world.size
                    );
                    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
                    if let Some(trace) = trace.as_mut() {
                        trace.finish();
                    }
                    world.abort(i32::from(exit_code(&error)));
                    Err(error)
                }
                Err(error) => Err(error),
            }
        }
    }
}

/// The text a panic was raised with.
fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Raises `stop` on SIGTERM or SIGINT; the loop then checkpoints and returns.
fn watch_signals(stop: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        runtime.block_on(async {
            let Ok(mut terminate) =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            else {
                return;
            };
            tokio::select! {
                _ = terminate.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            eprintln!("trainer: stop requested; checkpointing and exiting");
            stop.store(true, Ordering::Relaxed);
        });
    });
}

fn print_summary(summary: &crate::train::Summary) {
    let losses = &summary.losses;
    if let (Some(first), Some(last)) = (losses.first(), losses.last()) {
        let best = losses.iter().map(|(_, l)| *l).fold(f64::INFINITY, f64::min);
        let marks: Vec<String> = (0..=4)
            .map(|i| losses[(losses.len() - 1) * i / 4])
            .map(|(s, l)| format!("{s}:{l:.3}"))
            .collect();
        println!(
            "loss: step {} {:.4} -> step {} {:.4} (best {best:.4}); curve {}",
            first.0,
            first.1,
            last.0,
            last.1,
            marks.join("  ")
        );
    }
    if summary.stopped_by_signal {
        println!("stopped by signal at step {}", summary.last_step);
    }
    if let Some(step) = summary.last_checkpoint {
        println!(
            "last checkpoint: step {step} of run {} in {}",
            summary.run, summary.store
        );
        println!(
            "inspect it: ckptctl --store {} list {}",
            summary.store, summary.run
        );
    }
}
